"""Pipeline runtime overhead: step time minus the critical path of the measured tasks (issue 6).

A pipelined step (``rhino.auto_parallel(step, cluster=..., stages=2, num_microbatches=4)``)
runs its static schedule; every task (F/B/A per stage and microbatch) is timed on its
stage. The schedule's task graph (``runtime.task_graph``: F/B/A per stage, the schedule's
per-stage order as extra edges) with those measured durations has a critical path; what the
step takes beyond it is the runtime's overhead: dispatch, microbatch slicing and placement,
cross-mesh copies, waits, thread hand-offs (Rhino §7 measures the same). Transfers are given
zero duration in the critical path, so their time counts as overhead.

For each step after ``--warmup`` steps (run back to back, as a training loop does: the
one-device reference's losses are computed before them): step wall time, critical path,
overhead = step − cp, and overhead / step. Also the single-device ``jax.jit`` step for
scale, and the losses of both (they must match). Writes the last step's Gantt chart (``--png``) and prints its text
rendering.

    python benchmarks/pipeline_overhead.py --model gpt --steps 20 \
        --png benchmarks/pipeline_timeline.png
    python benchmarks/pipeline_overhead.py --model gpt --executor ray
    python benchmarks/pipeline_overhead.py --model gpt --transport broadcast   # 004 §3
    python benchmarks/pipeline_overhead.py --model gpt --executor ray --pin-cpus off

The Ray executor's former transports (``object_store``, ``direct``) were removed after
their figures were taken with this script (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def critical_path_s(records, num_stages: int, num_microbatches: int, schedule) -> float:
    """Longest path through the step's task graph (with the schedule's order) under the
    measured task durations (transfers: 0). A stage's prologue (batch-only values computed
    once per step) runs before its first forward task and counts with it; its apply phases
    (``A``, ``A1``, ... where the update needs a value of other stages, such as a global
    norm) run one after another and count as one apply task."""
    from task_graph import build_task_graph

    dur: dict[str, float] = {}
    for r in records:
        if r.kind in ("forward", "backward"):
            key = f"{r.label[0]}({r.stage},{r.microbatch})"
        elif r.kind == "prologue":
            key = f"F({r.stage},0)"
        elif r.kind == "apply":
            key = f"AG({r.stage})"
        else:
            continue
        dur[key] = dur.get(key, 0.0) + r.end - r.start
    g = build_task_graph(num_stages, num_microbatches).with_schedule(schedule)
    return g.critical_path(lambda n: dur.get(n.id, 0.0)).length


def handover_cost(step, example: tuple, results: tuple, repeat: int = 500
                  ) -> tuple[float, int]:
    """Microseconds per step that ``Handover`` takes (``back`` of the step's arguments,
    ``give`` of its results, as ``StagedRun.__call__`` calls them) on the last step's
    results, and how many 0-d results it hands back."""
    import jax

    run = step._entry(example).run
    handover = getattr(run, "handover", None)
    if handover is None:
        return 0.0, 0
    args = jax.tree_util.tree_leaves(results[:-1] + example[-1:])
    own = handover.back(jax.tree_util.tree_leaves(results))   # what the executor returned
    handed = sum(1 for x, y in zip(own, jax.tree_util.tree_leaves(results)) if x is not y)
    t = time.perf_counter()
    for _ in range(repeat):
        handover.back(args)
        handover.give(own)
    return (time.perf_counter() - t) / repeat * 1e6, handed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt", choices=["gpt", "unet"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--cluster", default="2x4")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--executor", default="local", choices=["local", "ray"])
    ap.add_argument("--transport", default=None,
                    choices=["device_put", "broadcast", "send_recv", "jax"],
                    help="how values move between stage meshes (local executor: device_put, "
                         "broadcast, send_recv; Ray: jax); default: the executor's default")
    ap.add_argument("--pin-cpus", default="auto", choices=["auto", "on", "off"],
                    help="Ray: actors simulating hosts split this machine's cores "
                         "(auto_parallel's ray_pin_cpus: None, True, False)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)

    import jax

    import rhino
    from rhino.models import get_model
    from rhino.runtime.scheduling.schedules import make_schedule

    if args.model == "gpt":
        m = get_model("gpt", layers=args.layers, hidden=args.hidden, heads=4, seq=64,
                      vocab=2048, batch=args.batch)
    else:
        m = get_model("unet", batch=args.batch)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    if args.executor == "ray":
        from rhino.runtime.ray.executor import init
        # one CPU per simulated host at least (a 4x2 cluster: 4 actors on a 2-core machine)
        init(num_cpus=max(os.cpu_count() or 1, int(args.cluster.split("x")[0])))
    t0 = time.perf_counter()
    step = rhino.auto_parallel(m.step, cluster=args.cluster, stages=args.stages,
                               num_microbatches=args.microbatches, schedule=args.schedule,
                               executor=args.executor, transport=args.transport,
                               **({} if args.executor != "ray" else {"ray_pin_cpus": {
                                   "auto": None, "on": True, "off": False}[args.pin_cpus]}))
    p, o = params, opt
    p, o, loss = step(p, o, batch)
    first_s = time.perf_counter() - t0
    # The one-device reference's losses first: a 0.3 s jax.jit step of this process
    # between two pipelined steps (as before 2026-11-26) left the actors idle and took
    # their cores, and the next step's overhead rose by 5-15 ms; a training loop calls its
    # step back to back. (benchmarks/multicontroller_overhead.py does the same.)
    ref = jax.jit(m.step)
    rp, ro, rloss = ref(params, opt, batch)
    ref_losses = [float(rloss)]
    for _ in range(args.warmup + args.steps):
        rp, ro, rloss = ref(rp, ro, batch)
        ref_losses.append(float(rloss))
    losses = [(float(loss), ref_losses[0])]
    sched = make_schedule(args.schedule, args.stages, args.microbatches)
    rows, driver, outside = [], [], []
    for k in range(args.warmup + args.steps):
        t = time.perf_counter()
        p, o, loss = step(p, o, batch)
        wall = time.perf_counter() - t
        losses.append((float(loss), ref_losses[k + 1]))
        if k >= args.warmup:
            cp = critical_path_s(step.last_records, args.stages, args.microbatches, sched)
            rows.append((step.last_step_s, cp))
            outside.append(wall - step.last_step_s)
            ex = step._entry((params, opt, batch)).run.executor
            if getattr(ex, "last_stage_s", None):   # Ray: the driver's share of the step
                driver.append(step.last_step_s - max(ex.last_stage_s))
    ref_times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(ref(rp, ro, batch))
        ref_times.append(time.perf_counter() - t)
    bad = [i for i, (a, b) in enumerate(losses) if abs(a - b) > 1e-4 * abs(b)]
    steps = [s for s, _ in rows]
    cps = [c for _, c in rows]
    over = [(s - c) / s for s, c in rows]
    print(f"model {args.model} (layers {args.layers}, hidden {args.hidden}, batch "
          f"{args.batch}), cluster {args.cluster}, {args.stages} stages, {args.microbatches} "
          f"microbatches, {args.schedule}, executor {args.executor}, "
          f"transport {step.options.transport.value}"
          + ("" if args.transport else " (the default)")
          + (f", pin cpus {args.pin_cpus}" if args.executor == "ray" else ""))
    print(f"first call (plan + split + compile + step): {first_s:.1f} s")
    print(f"step      median {statistics.median(steps) * 1e3:8.2f} ms  "
          f"(min {min(steps) * 1e3:.2f}, max {max(steps) * 1e3:.2f})")
    print(f"crit path median {statistics.median(cps) * 1e3:8.2f} ms")
    print(f"overhead  median {statistics.median(over) * 100:8.2f} %   "
          f"(step - critical path) / step, min {min(over) * 100:.2f} %, "
          f"max {max(over) * 100:.2f} %")
    print(f"overhead  median {statistics.median([s - c for s, c in rows]) * 1e3:8.2f} ms")
    print(f"outside the executor (the call's wall time - its step) median "
          f"{statistics.median(outside) * 1e3:.3f} ms")
    handover_us, handed = handover_cost(step, (params, opt, batch), (p, o, loss))
    print(f"of which the handover of results (runtime.executors.runs.Handover: {handed} 0-d results "
          f"handed back uncommitted, the arguments mapped back to the stages' copies) "
          f"{handover_us:.1f} us per step")
    if driver:
        print(f"of which on the driver (step - slowest actor's run_step) median "
              f"{statistics.median(driver) * 1e3:.2f} ms")
    print(f"single-device jax.jit step median {statistics.median(ref_times) * 1e3:.2f} ms")
    transport = getattr(step._entry((params, opt, batch)).run.executor, "transport", None)
    if hasattr(transport, "moved_bytes"):
        n = 1 + args.warmup + args.steps
        print(f"transport {args.transport}: per step {transport.moved_bytes / n / 2**20:.2f} "
              f"MiB moved, {transport.cross_host_bytes / n / 2**20:.2f} MiB across hosts")
    print(f"losses (pipelined, single device): first {losses[0]}, last {losses[-1]}; "
          f"mismatches: {bad or 'none'}")
    tl = step.timeline(args.png, title=None) if args.png else step.timeline()
    print(tl.render_text(100))
    if args.png:
        print(f"wrote {args.png}")
    step.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
