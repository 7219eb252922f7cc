"""Does the cost model predict this machine? Estimated against measured steps (issue 45).

On the 8 simulated CPU devices, calibrated here with ``rhino.calibrate`` (the figures of
the 8 devices working at once on this machine's cores: matmul rates by size and dtype,
memory bandwidth, vector and transcendental rates, kernel launch and program dispatch
costs, collectives by kind and group size), every (model, plan) pair is planned by
``rhino.auto_parallel`` priced with that calibration, compiled, run, and its step measured:

* models (``MODELS``): the zoo's GPT, MoE, VGG19 and Wide-ResNet at sizes whose steps take
  tens to hundreds of milliseconds here;
* plans (``PLANS``): the peers of ``benchmarks/peers.py`` written as pins on every state
  and batch leaf (``annotations=``, the planner fills in the rest): data parallel (``dp``),
  ZeRO-3/FSDP (``fsdp``), Megatron tensor parallel (``megatron``), 2-D DP×TP on (2, 4)
  (``dp_tp``); rhino's own O2 and O3 on (8) (``rhino_O2``, ``rhino_O3``); and a pipeline of
  two stages × 4 devices, 4 microbatches, 1F1B (``pipeline``, local executor); and what
  rhino chooses by itself over the 1x8 cluster (``rhino``: ``auto_parallel(step,
  cluster=...)``, whose controller weighs SPMD on (8) and (2, 4), pipelines and hybrids
  by the same calibrated model);
* the estimate is the plan's ``step_s`` (the cost model's step time); the measurement the
  median (``--statistic min``: the fastest; then the calibration takes the fastest of its
  runs too) of ``rounds × steps`` steps taken round-robin over the model's pairs (each round
  runs every pair ``steps`` times), so that the machine's drift (this machine is shared)
  touches every pair alike. One process per model; the calibration is made in that process
  just before its pairs are planned (``--calibration FILE`` reuses a saved one instead).

Output (``--json FILE``): ``pairs`` (model, plan, estimate, measured, error = estimate ÷
measured − 1, the plan's parts), ``spearman`` (rank correlation of estimates and
measurements over all pairs; per model too), ``median_abs_error``, and per model whether
rhino's chosen plan (``rhino``: the controller's choice) measured fastest or within 5 % of
the fastest plan (pairs that planned the same program count as one plan, their steps
pooled); ``--table`` prints the markdown table for RESULTS.md.

    python benchmarks/cost_model_check.py --json benchmarks/out/cost_model_check.json
    python benchmarks/cost_model_check.py --table benchmarks/out/cost_model_check.json
    python benchmarks/cost_model_check.py --quick --json /tmp/q.json    # toy sizes
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

N_DEVICES = 8
MODELS = {
    "gpt": dict(layers=2, hidden=256, heads=8, seq=64, vocab=2048, batch=16),
    "moe": dict(layers=2, hidden=256, heads=8, seq=32, vocab=2048, batch=16, experts=8),
    "vgg19": dict(batch=16, image=32, width=8, fc_hidden=512, classes=2048),
    "wide_resnet": dict(batch=16, image=16, base_channels=16, layers=10, classes=512),
}
QUICK = {
    "gpt": dict(layers=1, hidden=64, heads=4, seq=32, vocab=256, batch=8),
    "moe": dict(layers=2, hidden=64, heads=4, seq=16, vocab=256, batch=8, experts=8),
}
PLANS = ("dp", "fsdp", "megatron", "dp_tp", "rhino_O2", "rhino_O3", "pipeline", "rhino")
PIPELINE_MODELS = ("gpt", "moe")
CHOSEN = "rhino"
WITHIN = 0.05


# ----------------------------------------------------------------------------- statistics
def ranks(xs: Sequence[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on the ranks); None under 3 pairs or with no
    spread."""
    if len(a) < 3 or len(a) != len(b):
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den > 0 else None


def summarize(pairs: list[dict]) -> dict:
    """``spearman``, ``median_abs_error``, per-model figures and the chosen-plan check."""
    ok = [p for p in pairs if p.get("measured_s") and p.get("estimate_s")]
    est = [p["estimate_s"] for p in ok]
    meas = [p["measured_s"] for p in ok]
    out: dict[str, Any] = {
        "pairs_measured": len(ok),
        "spearman": spearman(est, meas),
        "median_abs_error": (statistics.median(abs(p["error"]) for p in ok) if ok else None),
        "models": {}}
    for model in dict.fromkeys(p["model"] for p in ok):
        mine = [p for p in ok if p["model"] == model]
        fastest = min(mine, key=lambda p: p["measured_s"])
        row = {"pairs": len(mine),
               "spearman": spearman([p["estimate_s"] for p in mine],
                                    [p["measured_s"] for p in mine]),
               "median_abs_error": statistics.median(abs(p["error"]) for p in mine),
               "fastest_measured": fastest["plan"],
               "fastest_estimated": min(mine, key=lambda p: p["estimate_s"])["plan"]}
        row.update(_chosen_check(mine))
        out["models"][model] = row
    checks = [r["chosen_ok"] for r in out["models"].values() if "chosen_ok" in r]
    out["chosen_ok"] = bool(checks) and all(checks)
    return out


def _chosen_check(mine: list[dict]) -> dict:
    """The chosen plan against the fastest, plans compared as programs: pairs that planned
    the same program (equal ``plan_key``: the same spec for every op, e.g. the controller's
    choice and O2's plan on the same mesh) are one plan whose steps are pooled (the statistic
    of all of them), so that two measurements of one program are not ranked as two plans."""
    chosen = next((p for p in mine if p["plan"] == CHOSEN), None)
    if chosen is None:
        return {}
    groups: dict[str, list[dict]] = {}
    for p in mine:
        groups.setdefault(p.get("plan_key") or p["plan"], []).append(p)

    def pooled(ps: list[dict]) -> float:
        times = [t for p in ps for t in p.get("times_s") or ()]
        if not times:
            return min(p["measured_s"] for p in ps)
        stat = ps[0].get("statistic", "median")
        return min(times) if stat == "min" else statistics.median(times)

    by = {k: pooled(ps) for k, ps in groups.items()}
    mine_key = chosen.get("plan_key") or chosen["plan"]
    best = min(by, key=by.get)
    return {"chosen": CHOSEN,
            "chosen_same_as": [p["plan"] for p in groups[mine_key] if p is not chosen],
            "chosen_over_fastest": by[mine_key] / by[best],
            "fastest_plan": [p["plan"] for p in groups[best]],
            "chosen_ok": by[mine_key] <= (1 + WITHIN) * by[best]}


def plan_key(plan) -> str:
    """A digest of what a plan runs: per stage its mesh, ops and every op's specs."""
    import hashlib

    parts = []
    for st in plan.stages:
        parts.append(repr((st.mesh.shape, st.ops)))
        if st.spmd is not None:
            parts.append(repr([(o.name, o.out_spec, o.in_specs) for o in st.spmd.ops]))
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- plans as pins
def arg_leaves(step: Callable, args: tuple) -> list[tuple[str, str, Any]]:
    """``(argument name, path inside it, leaf)`` of every leaf of ``args``, as rhino names
    parameters (``params['layers'][0]['wqkv']``, ``opt_state[0].mu[...]``, ...)."""
    import jax

    names = list(inspect.signature(step).parameters)
    out = []
    for name, tree in zip(names, args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out.append((name, jax.tree_util.keystr(path), leaf))
    return out


def peer_annotations(plan: str, model: str, step: Callable, args: tuple) -> dict:
    """The pins of a peer plan (module docstring) on mesh (8) axis ``x``, or (2, 4) axes
    ``x`` (data) and ``y`` (tensor) for ``dp_tp``."""
    from jax.sharding import PartitionSpec as P

    import peers

    out = {}
    for name, key, leaf in arg_leaves(step, args):
        shape = tuple(leaf.shape)
        if name == "batch":
            spec = () if plan == "megatron" or not shape else ("x",)
        elif plan == "dp":
            spec = ()
        elif plan == "fsdp":
            spec = peers.zero3_spec(shape, "x", N_DEVICES)
        elif plan == "megatron":
            spec = peers.megatron_spec(model, key, shape, "x", N_DEVICES)
        elif plan == "dp_tp":
            spec = peers.megatron_spec(model, key, shape, "y", 4)
        else:
            raise ValueError(f"no pins for plan {plan!r}")
        out[f"{name}{key}"] = P(*spec)
    return out


# ----------------------------------------------------------------------------- one model
def calibration(path: str | None, quick: bool, say: Callable[[str], None],
                statistic: str = "median"):
    """``(roofline, peaks)``: loaded from ``path``, else measured now on the 8 devices
    (each figure the ``statistic`` of its timed runs)."""
    from rhino.calibrate import CalibrationSizes, calibrate_roofline
    from rhino.planner.roofline import Roofline

    if path:
        with open(path) as f:
            d = json.load(f)
        return Roofline.from_dict(d["roofline"]), d["peaks"]
    import jax

    import dataclasses

    sizes = CalibrationSizes.quick() if quick else CalibrationSizes.for_platform("cpu")
    sizes = dataclasses.replace(sizes, statistic=statistic)
    return calibrate_roofline(jax.devices()[:N_DEVICES], sizes, progress=say)


def probe(devices) -> dict:
    """Three quick figures of the machine now (a 512³ matmul's FLOP/s, a 4 MiB stream's
    bytes/s, a program's dispatch), taken before planning and after measuring: how far the
    machine drifted while a model's pairs ran (other work on a shared machine)."""
    from rhino.calibrate import (measure_launch_latency, measure_matmul_rates,
                                 measure_memory_bandwidth)

    return {"matmul_flops": measure_matmul_rates(devices, (512,), "float32", 7)[0][1],
            "bandwidth": measure_memory_bandwidth(nbytes=1 << 22, reps=7, devices=devices),
            "program_s": measure_launch_latency(reps=20, devices=devices),
            "load_average": os.getloadavg()[0]}


def build_step(plan: str, model_name: str, model, roofline, peaks) -> Any:
    """The ``ParallelStep`` of one pair, priced by the calibrated figures."""
    import rhino
    from rhino.calibrate import cost_model_from_roofline, figures_from_roofline
    from rhino.cluster import Cluster

    example = model.example_args()
    if plan in ("pipeline", "rhino"):
        fig = figures_from_roofline(roofline, peaks, "calibrated-cpu")
        cluster = Cluster.from_figures(1, N_DEVICES, fig)
        if plan == "rhino":           # the controller's choice: SPMD (8), (2, 4) or stages
            return rhino.auto_parallel(model.step, cluster=cluster)
        return rhino.auto_parallel(model.step, cluster=cluster, stages=2,
                                   num_microbatches=4)
    shape = (2, 4) if plan == "dp_tp" else (N_DEVICES,)
    cost = cost_model_from_roofline(roofline, peaks, shape)
    if plan.startswith("rhino_"):
        return rhino.auto_parallel(model.step, mesh_shape=shape, cost=cost,
                                   opt_level=plan.split("_")[1])
    return rhino.auto_parallel(model.step, mesh_shape=shape, cost=cost,
                               annotations=peer_annotations(plan, model_name, model.step,
                                                            example))


def run_model(name: str, overrides: dict, plans: Sequence[str], rounds: int, steps: int,
              calib_path: str | None, quick: bool, statistic: str = "median") -> list[dict]:
    import jax

    from rhino.models import get_model

    def say(msg: str) -> None:
        print(f"[{name}] {msg}", file=sys.stderr, flush=True)

    devices = jax.devices()[:N_DEVICES]
    before = probe(devices)
    t0 = time.perf_counter()
    roofline, peaks = calibration(calib_path, quick, say, statistic)
    calib_s = time.perf_counter() - t0
    model = get_model(name, **overrides)
    host = jax.device_get((*model.init(jax.random.PRNGKey(0)),
                           model.make_batch(jax.random.PRNGKey(1))))
    live: dict[str, dict] = {}
    rows: list[dict] = []
    for plan in plans:
        if plan == "pipeline" and name not in PIPELINE_MODELS:
            continue
        row: dict[str, Any] = {"model": name, "plan": plan, "config": overrides}
        try:
            t = time.perf_counter()
            ap = build_step(plan, name, model, roofline, peaks)
            state = jax.tree.map(lambda x: x, host)
            params, opt, loss = ap(*state)        # plans, compiles, first step
            jax.block_until_ready(loss)
            p = ap.plan_for(*model.example_args())
            row.update(plan_compile_s=time.perf_counter() - t, estimate_s=p.step_s,
                       plan_key=plan_key(p),
                       kind=p.kind.value, stages=p.num_stages,
                       mesh=list(p.stages[0].mesh.shape), first_loss=float(loss),
                       mfu_estimated=p.utilization().mfu)
            if p.num_stages == 1:
                sp = p.spmd
                row.update(compute_s=sp.compute_s, communication_s=sp.communication_s,
                           overhead_s=sp.overhead_s,
                           collectives={k: list(v) for k, v in
                                        sp.collective_summary().items()})
            else:
                w = p.winner
                row.update(compute_s=w.compute_s, communication_s=w.communication_s,
                           transfer_s=w.transfer_s, bubble_s=w.bubble_s, apply_s=w.apply_s)
            live[plan] = {"ap": ap, "state": (params, opt), "batch": state[2], "times": []}
            say(f"{plan}: estimated {1e3 * p.step_s:.2f} ms ({row['plan_compile_s']:.1f} s "
                f"to plan and compile)")
        except Exception as e:  # noqa: BLE001 - recorded, never hidden
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            say(f"{plan}: {row['error']}")
        rows.append(row)
        gc.collect()
    for entry in live.values():                     # one more warm-up step each
        entry["state"] = _step(entry)[0]
    for r in range(rounds):
        for plan, entry in live.items():
            for _ in range(steps):
                t = time.perf_counter()
                entry["state"], _ = _step(entry)
                entry["times"].append(time.perf_counter() - t)
    after = probe(devices)
    drift = {k: after[k] / before[k] for k in before if before[k]}
    say("drift while measuring (after ÷ before): " + ", ".join(f"{k} {v:.2f}"
                                                             for k, v in drift.items()))
    for row in rows:
        row.update(probe_before=before, probe_after=after)
        entry = live.get(row["plan"])
        if entry is None:
            continue
        ts = entry["times"]
        row.update(measured_median_s=statistics.median(ts), measured_min_s=min(ts),
                   measured_max_s=max(ts), steps=len(ts), calibration_s=calib_s,
                   statistic=statistic, times_s=ts)
        row["measured_s"] = min(ts) if statistic == "min" else statistics.median(ts)
        row["error"] = row["estimate_s"] / row["measured_s"] - 1
    for row in rows:
        row["roofline"] = roofline.to_dict()
        row["peaks"] = peaks
    return rows


def _step(entry: dict):
    import jax

    params, opt = entry["state"]
    p2, o2, loss = entry["ap"](params, opt, entry["batch"])
    jax.block_until_ready((p2, o2, loss))
    return (p2, o2), loss


# ----------------------------------------------------------------------------- driver
def table(result: dict) -> str:
    stat = next((p.get("statistic") for p in result["pairs"] if p.get("statistic")),
                "median")
    lines = [f"| model | plan | kind, mesh | estimate ms | measured ms ({stat}; min–max) | "
             "error | est. MFU |", "|---|---|---|---:|---:|---:|---:|"]
    for p in result["pairs"]:
        if "measured_s" not in p:
            lines.append(f"| {p['model']} | {p['plan']} | — | — | — | {p.get('error', '')} "
                         f"| — |")
            continue
        lines.append(
            f"| {p['model']} | {p['plan']} | {p['kind']} {'x'.join(map(str, p['mesh']))}"
            f"{' ×' + str(p['stages']) if p['stages'] > 1 else ''} | "
            f"{1e3 * p['estimate_s']:.2f} | {1e3 * p['measured_s']:.2f} "
            f"({1e3 * p['measured_min_s']:.2f}–{1e3 * p['measured_max_s']:.2f}) | "
            f"{100 * p['error']:+.1f} % | {100 * p['mfu_estimated']:.1f} % |")
    s = result["summary"]
    lines.append("")
    sp = "—" if s["spearman"] is None else f"{s['spearman']:.3f}"
    err = "—" if s["median_abs_error"] is None else f"{100 * s['median_abs_error']:.1f} %"
    lines.append(f"Pairs measured: {s['pairs_measured']}; Spearman {sp}; "
                 f"median |error| {err}; rhino's chosen plan "
                 f"({CHOSEN}) fastest or within {100 * WITHIN:.0f} %: "
                 f"{'yes' if s['chosen_ok'] else 'NO'}")
    for m, r in s["models"].items():
        sp = "—" if r["spearman"] is None else f"{r['spearman']:.2f}"
        same = (f" (the same program as {', '.join(r['chosen_same_as'])})"
                if r.get("chosen_same_as") else "")
        lines.append(f"- {m}: Spearman {sp}, median |error| "
                     f"{100 * r['median_abs_error']:.1f} %, fastest measured "
                     f"{r['fastest_measured']}, fastest estimated {r['fastest_estimated']}"
                     + (f"; {CHOSEN}{same} at {r['chosen_over_fastest']:.3f}× the fastest "
                        f"plan ({', '.join(r['fastest_plan'])})"
                        if "chosen_over_fastest" in r else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the result here")
    ap.add_argument("--table", metavar="FILE", help="print the table of a result and exit")
    ap.add_argument("--models", default=None, help="comma separated (default: all)")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per pair per round")
    ap.add_argument("--quick", action="store_true", help="toy sizes, quick calibration")
    ap.add_argument("--calibration", metavar="FILE",
                    help="a saved calibration (a row's roofline and peaks) instead of one "
                         "measured per model")
    ap.add_argument("--statistic", choices=("median", "min"), default="median",
                    help="of each pair's timed steps and of each calibration measurement "
                         "(min: the machine without the other work it shares its cores "
                         "with)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.table:
        with open(a.table) as f:
            print(table(json.load(f)))
        return 0
    sizes = QUICK if a.quick else MODELS
    plans = tuple(p for p in a.plans.split(",") if p)
    if a.worker:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                                   f"platform_device_count={N_DEVICES}").strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        rows = run_model(a.worker, sizes[a.worker], plans, a.rounds, a.steps, a.calibration,
                         a.quick, a.statistic)
        print("ROWS " + json.dumps(rows), flush=True)
        return 0
    models = a.models.split(",") if a.models else list(sizes)
    pairs: list[dict] = []
    t0 = time.time()
    for m in models:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", m, "--plans",
               ",".join(plans), "--rounds", str(a.rounds), "--steps", str(a.steps),
               "--statistic", a.statistic]
        cmd += ["--quick"] if a.quick else []
        cmd += ["--calibration", a.calibration] if a.calibration else []
        p = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(p.stderr[-4000:])
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("ROWS ")]
        if p.returncode != 0 or not got:
            pairs.append({"model": m, "plan": "*", "error": f"worker exit {p.returncode}: "
                          f"{p.stderr.strip().splitlines()[-1:]}"})
            continue
        pairs.extend(json.loads(got[-1][5:]))
    result = {"tool": "benchmarks/cost_model_check.py", "argv": sys.argv[1:],
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": time.time() - t0,
              "load_average": os.getloadavg(), "pairs": pairs, "summary": summarize(pairs)}
    result["spearman"] = result["summary"]["spearman"]
    result["median_abs_error"] = result["summary"]["median_abs_error"]
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
