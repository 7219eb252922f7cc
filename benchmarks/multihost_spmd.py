"""One SPMD program over a whole 2x4 cluster: in one process, and across two host processes.

The same GPT step, planned as one SPMD stage over 8 devices (``stages=1``), run three ways:

* ``local``: in this process on 8 simulated devices (the compiled program called directly);
* ``ray 1x8``: one Ray actor holding 8 devices (the stage programs, F/B/A, in one process);
* ``ray 2x4``: two Ray actors × 4 devices, one ``jax.distributed`` job (gloo collectives
  between the two processes): the multi-host path.

Per row: median, min and max step time over ``--steps`` steps after ``--warmup``; losses are
checked against single-device ``jax.jit`` (the script exits 1 on a mismatch); bytes the
driver sent and received per steady-state step. Rows as JSON lines with ``--out``.

    python benchmarks/multihost_spmd.py --out benchmarks/out/multihost_spmd.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _run(step, m, params, opt, batch, warmup: int, steps: int) -> tuple[list, list]:
    p, o = params, opt
    times, losses = [], []
    for k in range(warmup + steps):
        t = time.perf_counter()
        p, o, loss = step(p, o, batch)
        loss = float(loss)       # waits for the step
        if k >= warmup:
            times.append(time.perf_counter() - t)
        losses.append(loss)
    return times, losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax

    import rhino
    from rhino.models import get_model
    from rhino.runtime.ray.executor import init

    m = get_model("gpt", layers=args.layers, hidden=args.hidden, heads=4, seq=64, vocab=2048,
                  batch=args.batch)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    _, want = _run(jax.jit(m.step), m, params, opt, batch, 0, args.warmup + args.steps)
    init(num_cpus=4, log_to_driver=False)
    rows, bad = [], []
    for name, cluster, executor in (("local", "2x4", "local"), ("ray 1x8", "1x8", "ray"),
                                    ("ray 2x4", "2x4", "ray")):
        t0 = time.perf_counter()
        step = rhino.auto_parallel(m.step, cluster=cluster, stages=1, executor=executor,
                                   timeout=600.0)
        step.plan_for(params, opt, batch)
        start_s = time.perf_counter() - t0
        try:   # a copy: the local run donates (updates in place) the state it is given
            mine = jax.tree_util.tree_map(lambda x: x.copy(), (params, opt))
            times, losses = _run(step, m, *mine, batch, args.warmup, args.steps)
            ex = getattr(step._entry((params, opt, batch)).run, "executor", None)
            sent = getattr(ex, "last_sent_bytes", None)
            received = getattr(ex, "last_received_bytes", None)
            actors = len(getattr(ex, "actors", ())) or None
        finally:
            step.close()
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        if worst > 1e-4:
            bad.append(name)
        row = {"run": name, "cluster": cluster, "executor": executor, "actors": actors,
               "start_s": round(start_s, 2),
               "step_ms_median": round(statistics.median(times) * 1e3, 2),
               "step_ms_min": round(min(times) * 1e3, 2),
               "step_ms_max": round(max(times) * 1e3, 2),
               "sent_bytes_per_step": sent, "received_bytes_per_step": received,
               "worst_rel_loss_diff": worst, "layers": args.layers, "hidden": args.hidden,
               "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
               "machine": platform.processor() or platform.machine(),
               "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
        rows.append(row)
        print(f"{name:8s} step median {row['step_ms_median']:8.2f} ms (min "
              f"{row['step_ms_min']:.2f}, max {row['step_ms_max']:.2f}); start "
              f"{start_s:.1f} s; driver sent {sent} B, received {received} B per step; "
              f"worst relative loss difference {worst:.1e}", flush=True)
    base = rows[0]["step_ms_median"]
    for r in rows[1:]:
        print(f"{r['run']} ÷ local: {r['step_ms_median'] / base:.3f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if bad:
        print(f"MISMATCH against jax.jit: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
