"""The planner's per-stage memory estimate against the compiled stage programs (issue 43,
acceptance 7): a Llama pipelined by ``rhino.auto_parallel`` on 2x4 (2 stages, 4
microbatches) with and without ``jax.checkpoint`` per layer; for each stage the plan's
``StageMemory`` (state, float32 gradient accumulators, one microbatch's working set, the
values each microbatch in flight holds for its backward) beside ``StageWorker.memory()``
(the same parts from the programs it compiled and ran: arguments at their shards' sizes,
the accumulators, what the forward hands the backward, the largest ``memory_analysis``
temporaries).

    python benchmarks/stage_memory_check.py [--layers 4] [--hidden 256] [--seq 128]
                                            [--batch 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import rhino  # noqa: E402
from rhino.models import get_model  # noqa: E402

MiB = 2 ** 20


def measure(remat: bool, a) -> list[dict]:
    m = get_model("llama", layers=a.layers, hidden=a.hidden, heads=4, seq=a.seq, vocab=512,
                  batch=a.batch, remat=remat)
    params, opt = m.init(jax.random.PRNGKey(0))
    args = (params, opt, m.make_batch(jax.random.PRNGKey(1)))
    step = rhino.auto_parallel(m.step, cluster="2x4", stages=2, num_microbatches=4,
                               timeout=300)
    try:
        step(*args)
        return [dict(s, remat=remat, estimate=dataclasses.asdict(s["estimate"]))
                for s in step.stage_memory_for(*args)]
    finally:
        step.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--json", help="write the rows to FILE")
    a = ap.parse_args(argv)
    rows = [r for remat in (False, True) for r in measure(remat, a)]
    print("| remat | stage | estimate MiB (state + grads + working + (k-1) × held) | "
          "compiled MiB (state + acc + k × handed + temp) | estimate / compiled |")
    print("|---|---:|---|---|---:|")
    for r in rows:
        e, c = r["estimate"], r["compiled"]
        print(f"| {r['remat']} | {r['stage']} | {e['total'] / MiB:.1f} = {e['state'] / MiB:.1f}"
              f" + {e['gradients'] / MiB:.1f} + {e['per_microbatch'] / MiB:.1f} + "
              f"{max(0, e['in_flight'] - 1)} × {e['handed'] / MiB:.2f} | "
              f"{c['peak'] / MiB:.1f} = {c['state'] / MiB:.1f} + {c['accumulators'] / MiB:.1f}"
              f" + {c['in_flight']} × {c['handed'] / MiB:.2f} + {c['temp'] / MiB:.1f} | "
              f"{e['total'] / c['peak']:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(0.8 <= r["estimate"]["total"] / r["compiled"]["peak"] <= 1.2
                    for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
