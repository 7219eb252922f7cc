"""Whole ``rhino.plan(..., cluster="8x8")`` of a GPT of Alpa's largest size (issue 15,
acceptance 5): 48 layers, hidden 8192, 64 heads, seq 1024, vocab 51200, batch 64, H100
figures, ShapeDtypeStruct arguments (nothing allocated); ``jax.checkpoint`` per layer and 32
microbatches by default (without them no candidate fits 80 GB: ``--no-remat
--microbatches 8``). Prints each phase as the planner
reports it, with wall-clock seconds since the start, then the total, the peak resident
memory of this process and of its planning workers, and the plan's summary; or, past
``--limit`` seconds, the phase it was in.

    python benchmarks/plan_at_scale.py --limit 1500
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time


def timed_progress(limit: float):
    """A ``progress`` callback printing each line with the seconds since now, and a
    watchdog that ends the process (and its planning workers) past ``limit`` seconds,
    saying which phase it was in."""
    import os

    t0 = time.time()
    last = ["start"]

    def progress(line: str) -> None:
        last[0] = line
        print(f"[{time.time() - t0:8.1f} s] {line}", flush=True)

    def watchdog() -> None:
        time.sleep(limit)
        print(f"NOT DONE within {limit:.0f} s; last phase: {last[0]}", flush=True)
        import multiprocessing
        for child in multiprocessing.active_children():   # the search's planning workers
            child.kill()
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    return progress


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=float, default=1500.0, help="seconds before giving up")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--no-remat", action="store_true", help="no jax.checkpoint per layer")
    a = ap.parse_args()
    import rhino
    from rhino.models import get_model

    t0 = time.time()
    progress = timed_progress(a.limit)
    m = get_model("gpt", layers=a.layers, hidden=a.hidden, heads=64, seq=1024, vocab=51200,
                  batch=64, remat=not a.no_remat)
    plan = rhino.plan(m.step, *m.example_args(), cluster="8x8", backend="h100",
                      microbatches=a.microbatches, progress=progress)
    self_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    kids_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"total {time.time() - t0:.1f} s; peak RSS {self_gib:.2f} GiB (planner), "
          f"{kids_gib:.2f} GiB (largest worker)")
    print(plan.report())
    sys.exit(0)


if __name__ == "__main__":
    main()
