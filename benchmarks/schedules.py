"""The field's pipeline schedules side by side (issue 44, acceptance 3).

Four parts, each printed as a table (``--json FILE`` writes them all):

1. **Closed forms**: the bubble rate (idle over busy time, summed over the stages) of each
   schedule simulated with unit task times (F = 1, B = 2 for 1F1B's whole backward; F = B =
   W = 1 for ZB-H1's split one; each task ``1/v`` for interleaving) for p = 4, 8 stages and
   m = 8, 16, 32 microbatches, beside the closed forms (p - 1)/m, (p - 1)/3m, (p - 1)/vm.
2. **Measured task times**: the zoo GPT pipelined on the CPU mesh (2x4: 2 stages of 4
   devices) under zb-h1; the mean F, B and W times of its stages are the per-stage task
   times of p-stage pipelines simulated under each schedule (bubble rate and step).
3. **Measured steps**: the same GPT under every schedule the executors run, the median
   step (``step.last_step_s``) over ``--steps`` steps after a warm-up, beside the step
   ``simulate`` predicts from the measured task times of that run. Interleaved 1F1B runs
   its own plan (``stages=2, virtual_stages=2``: the model cut into 4 stages, 2 on each
   device group of 4), predicted from its stages' measured task times.
4. **Llama-3-70B on 8x8** (H100 figures, sequence 4096, 64 sequences in 64 microbatches,
   ``jax.checkpoint`` per layer): rhino's plan (the whole search, ~4 minutes), then its
   stages' estimated per-microbatch times under each schedule: F and B split by the
   stage's forward and backward FLOPs, W taken as F (the weight-gradient matmuls mirror
   the forward's, as in the zero-bubble paper), the stage's sends as the transfer time,
   apply-gradients once at the end. Each schedule's activations in flight are priced with
   the stage's memory (``StageMemory``: state + gradients + in_flight × handed + one
   microbatch's working set) against the device's 80 GB.

    python benchmarks/schedules.py --json benchmarks/data/schedules.json
    python benchmarks/schedules.py --skip-70b     # parts 1-3 only (about 3 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

P_VALUES, M_VALUES = (4, 8), (8, 16, 32)
RUNNABLE = ("gpipe", "1f1b", "eager-1f1b", "zb-h1", "interleaved-1f1b")


def _sched():
    from rhino.runtime.scheduling import schedules
    return schedules


def simulated(name: str, p: int, m: int, f: float, b: float, w: float, transfer: float = 0.0,
              apply: float = 0.0, v: int = 1) -> tuple[float, float]:
    """(step seconds, bubble rate) of schedule ``name`` with uniform stages: forward ``f``,
    backward ``b`` (input gradients under a split schedule) and ``w`` (its weight gradients;
    added to ``b`` where the backward is one task), per microbatch; interleaving cuts each
    into ``v`` chunks."""
    S = _sched()
    s = S.make_schedule(name, p, m, virtual_stages=v)
    if s.splits_backward:
        tl = S.simulate(s, f, b, transfer_s=transfer, apply_s=apply, weight_s=w)
    else:
        tl = S.simulate(s, f / v, (b + w) / v, transfer_s=transfer, apply_s=apply)
    return tl.makespan, S.bubble_rate(s, tl)


def closed_forms() -> list[dict]:
    rows = []
    for p in P_VALUES:
        for m in M_VALUES:
            for name, v, closed in (("1f1b", 1, (p - 1) / m), ("eager-1f1b", 1, (p - 1) / m),
                                    ("gpipe", 1, (p - 1) / m), ("zb-h1", 1, (p - 1) / (3 * m)),
                                    ("interleaved-1f1b", 2, (p - 1) / (2 * m)),
                                    ("interleaved-1f1b", 4, (p - 1) / (4 * m))):
                _, rate = simulated(name, p, m, 1.0, 1.0, 1.0, v=v)
                rows.append({"p": p, "m": m, "schedule": name, "v": v, "bubble": rate,
                             "closed_form": closed})
    return rows


def _gpt():
    import jax
    from rhino.models import get_model

    m = get_model("gpt", layers=8, hidden=256, heads=4, seq=64, vocab=512, batch=32)
    params, opt = m.init(jax.random.PRNGKey(0))
    return m, params, opt, m.make_batch(jax.random.PRNGKey(1))


def measured_runs(steps: int, microbatches: int) -> dict:
    """Every runnable schedule on 2x4 from one plan: median step, task times, prediction."""
    import jax
    import numpy as np

    import rhino
    from rhino.parallel_plan import Plan

    m, params, opt, batch = _gpt()
    ref = jax.jit(m.step)
    want = None
    plan = None
    out = {}
    for name in RUNNABLE:
        v = 2 if name == "interleaved-1f1b" else 1
        opts = dict(cluster="2x4", stages=2, num_microbatches=microbatches, schedule=name,
                    timeout=300, virtual_stages=v)
        if plan is not None and v == 1:   # every other schedule on the first run's stages
            opts["plan"] = Plan.from_json(plan)
            del opts["stages"], opts["virtual_stages"]
        step = rhino.auto_parallel(m.step, **opts)
        try:
            p, o = params, opt
            times = []
            for k in range(steps + 1):
                p, o, loss = step(p, o, batch)
                jax.block_until_ready(loss)
                if k:                                   # the first is the warm-up
                    times.append(step.last_step_s)
            if plan is None:
                plan = step.plan_for(params, opt, batch).to_json()
            if want is None:
                p2, o2 = params, opt
                for _ in range(steps + 1):
                    p2, o2, want = ref(p2, o2, batch)
            tl = step.timeline()
        finally:
            step.close()
        durations: dict[str, list[float]] = {}
        for r in tl.records:
            if r.kind in ("forward", "backward", "apply") and r.label[:1] in tuple("FBWA"):
                durations.setdefault(r.label[0], []).append(r.end - r.start)
        mean = {k: statistics.mean(v) for k, v in durations.items()}
        f, b, w = mean.get("F", 0.0), mean.get("B", 0.0), mean.get("W", 0.0)
        # (interleaved: the mean task is one of a group's v stages; ``simulated`` takes
        # a whole group's and cuts it into v)
        predicted, _ = simulated(name, 2, microbatches, v * f, v * b, v * w,
                                 apply=mean.get("A", 0.0), v=v)
        out[name] = {"median_step_s": statistics.median(times), "min_step_s": min(times),
                     "task_s": mean, "predicted_step_s": predicted,
                     "loss": float(loss), "loss_jit": float(want),
                     "equal_to_jit": bool(np.isclose(float(loss), float(want), rtol=1e-4))}
    return out


def from_measured(task_s: dict) -> list[dict]:
    f, b, w = task_s["F"], task_s["B"], task_s["W"]
    rows = []
    for p in P_VALUES:
        for m in M_VALUES:
            base, _ = simulated("1f1b", p, m, f, b, w)
            for name, v in (("1f1b", 1), ("eager-1f1b", 1), ("gpipe", 1), ("zb-h1", 1),
                            ("interleaved-1f1b", 2)):
                step, rate = simulated(name, p, m, f, b, w, v=v)
                rows.append({"p": p, "m": m, "schedule": name, "v": v, "step_s": step,
                             "bubble": rate, "vs_1f1b": step / base})
    return rows


def llama_70b(limit: float) -> dict:
    """rhino's plan of Llama-3-70B on 8x8, priced under each schedule (see the docstring)."""
    import rhino
    from rhino.models import get_model
    from rhino.pipeline.schedule_choice import stage_times
    S = _sched()

    m = get_model("llama", preset="Llama-3-70B", seq=4096, batch=64, attention="fused",
                  remat=True)
    t0 = time.time()
    plan = rhino.plan(m.step, *m.example_args(), cluster="8x8", backend="h100",
                      microbatches=64)
    search_s = time.time() - t0
    p, mb = plan.num_stages, plan.num_microbatches
    # the planner's own split of each stage's time (schedule_choice.stage_times)
    f, b, w, send = (list(x) for x in zip(*(stage_times(st.estimate, st.flops)
                                            for st in plan.stages)))
    apply_s = max(st.estimate.apply_s for st in plan.stages)
    budget = 80e9
    rows = {}
    for name, v in (("1f1b", 1), ("eager-1f1b", 1), ("gpipe", 1), ("zb-h1", 1),
                    ("interleaved-1f1b", 2), ("interleaved-1f1b", 5)):
        if name == "interleaved-1f1b" and (mb % p or v * p > 80):
            continue
        s = S.make_schedule(name, p, mb, virtual_stages=v)
        kw = {"weight_s": w} if s.splits_backward else {}
        if name == "interleaved-1f1b":
            # each group's v stages: the chunk times of its stage's layers over v
            ff = [f[c % p] / v for c in range(p * v)]
            bb = [(b[c % p] + w[c % p]) / v for c in range(p * v)]
            tl = S.simulate(s, ff, bb, transfer_s=max(send), apply_s=apply_s)
        else:
            tl = S.simulate(s, f, b if s.splits_backward else [x + y for x, y in zip(b, w)],
                            transfer_s=max(send), apply_s=apply_s, **kw)
        mem = []
        for g, st in enumerate(plan.stages):
            sm = st.memory
            flight = S.in_flight_bound(name, p, mb, g, v)
            # under interleaving a microbatch in flight holds one chunk's: 1/v of the stage's
            mem.append(sm.state + sm.gradients + sm.per_microbatch
                       + (flight - 1) * sm.handed / v)
        rows[f"{name}" + (f" v={v}" if v > 1 else "")] = {
            "step_s": tl.makespan, "bubble": S.bubble_rate(s, tl),
            "peak_memory_gb": max(mem) / 1e9, "fits_80gb": max(mem) <= budget}
    base = rows["1f1b"]["step_s"]
    for r in rows.values():
        r["vs_1f1b"] = r["step_s"] / base
    fitting = {k: r for k, r in rows.items() if r["fits_80gb"]}
    best = min(fitting, key=lambda k: fitting[k]["step_s"]) if fitting else None
    return {"plan": f"{plan.kind.value} pp={p} x mesh {tuple(plan.stages[0].mesh.shape)}",
            "microbatches": mb, "search_s": search_s, "plan_step_s": plan.step_s,
            "plan_schedule": plan.schedule.value, "decision": plan.decision,
            "schedules": rows, "best": best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--only-70b", action="store_true", help="part 4 only")
    ap.add_argument("--limit", type=float, default=900.0)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    if a.only_70b:
        result = {}
        _print_70b(result, a)
        sys.exit(0)
    result = {"closed_forms": closed_forms()}
    print("1. bubble rate, unit task times, simulated vs closed form")
    print(f"{'p':>2} {'m':>3} {'schedule':<20} {'simulated':>9} {'closed':>7}")
    for r in result["closed_forms"]:
        name = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
        print(f"{r['p']:>2} {r['m']:>3} {name:<20} {r['bubble']:>9.4f} {r['closed_form']:>7.4f}")
    runs = measured_runs(a.steps, a.microbatches)
    result["measured"] = runs
    print(f"\n3. GPT (8 layers, hidden 256) on 2x4, 2 stages, {a.microbatches} microbatches, "
          f"median of {a.steps} steps")
    print(f"{'schedule':<12} {'median ms':>9} {'min ms':>7} {'predicted':>9}  F / B / W / A ms"
          f"  loss = jit")
    for name, r in runs.items():
        t = r["task_s"]
        parts = " / ".join(f"{1e3 * t.get(k, 0.0):.1f}" for k in "FBWA")
        print(f"{name:<12} {1e3 * r['median_step_s']:>9.1f} {1e3 * r['min_step_s']:>7.1f} "
              f"{1e3 * r['predicted_step_s']:>9.1f}  {parts}  {r['equal_to_jit']}")
    task_s = runs["zb-h1"]["task_s"]
    result["from_measured"] = from_measured(task_s)
    print(f"\n2. simulated with the measured zb-h1 task times (F {1e3 * task_s['F']:.1f}, "
          f"B {1e3 * task_s['B']:.1f}, W {1e3 * task_s['W']:.1f} ms per stage and microbatch)")
    print(f"{'p':>2} {'m':>3} {'schedule':<20} {'step ms':>8} {'bubble':>7} {'vs 1F1B':>8}")
    for r in result["from_measured"]:
        name = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
        print(f"{r['p']:>2} {r['m']:>3} {name:<20} {1e3 * r['step_s']:>8.1f} "
              f"{r['bubble']:>7.4f} {r['vs_1f1b']:>8.3f}")
    if not a.skip_70b:
        _print_70b(result, a)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
    sys.exit(0)


def _print_70b(result: dict, a) -> None:
    """Part 4, printed and added to ``result``."""
    big = llama_70b(a.limit)
    result["llama_70b"] = big
    print(f"\n4. Llama-3-70B on 8x8 (H100): {big['plan']}, {big['microbatches']} "
          f"microbatches (search {big['search_s']:.0f} s); the planner chose "
          f"{big['plan_schedule']}, est. {1e3 * big['plan_step_s']:.0f} ms: "
          f"{big['decision'].rsplit('; ', 1)[-1]}")
    print(f"{'schedule':<22} {'step ms':>8} {'bubble':>7} {'vs 1F1B':>8} {'peak GB':>8} fits")
    for name, r in big["schedules"].items():
        print(f"{name:<22} {1e3 * r['step_s']:>8.0f} {r['bubble']:>7.4f} "
              f"{r['vs_1f1b']:>8.3f} {r['peak_memory_gb']:>8.1f} {r['fits_80gb']}")
    print(f"best that fits: {big['best']}")
    if a.only_70b and a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
