"""Pipeline runtime overhead in a multi-controller job (issue 30, acceptance 5): the same
model, cluster, stages and microbatches as ``pipeline_overhead.py``, one stage per process,
values between the processes through JAX's transfer servers (``runtime.transfer.jax_transfer``).

    python -m rhino.launch --hosts 2 --devices-per-host 4 \\
        benchmarks/multicontroller_overhead.py --steps 20 [--no-cross-process-collectives]

Every process times its steps and its own stage's tasks; the task durations of both
processes go to process 0 through the job's key-value store, which computes each step's
critical path as ``pipeline_overhead.critical_path_s`` does (the schedule's task graph under
the measured durations, transfers at zero) and prints step, critical path and overhead =
(step - critical path) / step, its own step's wall time taken as the step. Losses are
checked against one-device ``jax.jit`` on every process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-cross-process-collectives", action="store_true",
                    help="rhino.distributed_init(cross_process_collectives=False): no gloo, "
                         "each stage's collectives inside its process")
    a = ap.parse_args(argv)

    import rhino

    job = rhino.distributed_init(cross_process_collectives=not a.no_cross_process_collectives)
    import jax
    import numpy as np

    from pipeline_overhead import critical_path_s
    from rhino.jaxpr.private import kv_get, kv_set
    from rhino.models import get_model
    from rhino.runtime.scheduling.schedules import make_schedule
    from rhino.runtime.scheduling.timeline import TaskRecord

    me, n = job.process_id, job.num_processes
    m = get_model("gpt", layers=a.layers, hidden=a.hidden, heads=4, seq=64, vocab=2048,
                  batch=a.batch)
    params, opt = jax.tree.map(np.asarray, m.init(jax.random.PRNGKey(0)))
    batch = jax.tree.map(np.asarray, m.make_batch(jax.random.PRNGKey(1)))
    # The one-device reference first, all its steps: run beside the pipelined steps, one
    # process's reference would compete with the other's stage for the cores.
    ref = jax.jit(m.step)
    rp, ro, ref_losses = params, opt, []
    for _ in range(1 + a.warmup + a.steps):
        rp, ro, rloss = ref(rp, ro, batch)
        ref_losses.append(float(rloss))
    del rp, ro
    kv_set(f"bench/ref/{me}", "done")
    for q in range(n):            # every process's reference has finished
        kv_get(f"bench/ref/{q}", 600.0)
    t0 = time.perf_counter()
    step = rhino.auto_parallel(m.step, cluster=f"{n}x{jax.local_device_count()}", stages=n,
                               num_microbatches=a.microbatches, report=False)
    p, o, loss = step(params, opt, batch)
    first_s = time.perf_counter() - t0
    bad = 0 if abs(float(loss) - ref_losses[0]) <= 1e-4 * abs(ref_losses[0]) else 1
    sched = make_schedule("1f1b", n, a.microbatches)
    rows = []
    for k in range(a.warmup + a.steps):
        t = time.perf_counter()
        p, o, loss = step(p, o, batch)
        float(loss)                       # the step's end: its loss here
        wall = time.perf_counter() - t
        want = ref_losses[k + 1]
        bad += abs(float(loss) - want) > 1e-4 * abs(want)
        if k < a.warmup:
            continue
        mine = [[r.stage, r.label, r.start, r.end, r.microbatch, r.kind]
                for r in step.last_records]
        kv_set(f"bench/{k}/{me}", json.dumps(mine))
        if me == 0:
            records = [TaskRecord(*r) for q in range(n)
                       for r in json.loads(kv_get(f"bench/{k}/{q}", 120.0))]
            rows.append((wall, critical_path_s(records, n, a.microbatches, sched)))
    if me == 0:
        over = [(s - c) / s for s, c in rows]
        print(f"model gpt (layers {a.layers}, hidden {a.hidden}, batch {a.batch}), {n} "
              f"processes x {jax.local_device_count()} devices, {n} stages, "
              f"{a.microbatches} microbatches, 1f1b, multi-controller (jax transfers), "
              f"CPU collectives between processes: "
              f"{'no' if a.no_cross_process_collectives else 'gloo'}")
        print(f"first call (plan + split + compile + step): {first_s:.1f} s")
        print(f"step      median {statistics.median([s for s, _ in rows]) * 1e3:8.2f} ms")
        print(f"crit path median {statistics.median([c for _, c in rows]) * 1e3:8.2f} ms")
        print(f"overhead  median {statistics.median(over) * 100:8.2f} %   "
              f"(step - critical path) / step, min {min(over) * 100:.2f} %, "
              f"max {max(over) * 100:.2f} %")
    print(f"process {me}: losses equal to jax.jit: {'yes' if not bad else f'no ({bad})'}",
          flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
