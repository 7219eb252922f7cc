"""O2 search time and objective against O3 on the steps with a segment too dense for O2's
former exact segment tables (quick MoE and quick Wide-ResNet on mesh (2, 4): an ILP per pivot
pair, 690 s and 58 s), plus the benchmark shapes of ``benchmarks/spmd_vs_peers.py`` on mesh
(8,) and the small GPT of the tests on (2, 4), as a no-regression check.

Each problem is built the way its user builds it: the ``spmd_vs_peers`` models as
``rhino.auto_parallel`` did when these figures were taken (``BuildOptions(strided=False,
partial_passthrough=False)``; auto_parallel now offers interior strided specs, which these
models' plans do not use), the
test GPT as ``rhino.plan`` does (default ``BuildOptions``). Solves go through
``rhino.planner.api._solve`` with the default ``PlanOptions`` (time limit 600 s per solve,
memory tie-break), so the objective is the true estimated step time of the plan.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/o2_hard_segments.py
    python benchmarks/o2_hard_segments.py --cases moe_quick_2x4 --levels O2 --cache /tmp/o2c

``--cache DIR`` pickles each built problem there and reuses it (problem building is not
what is measured). Prints a Markdown table; ``--out`` appends one JSON line per case, and
``--table`` joins such files (e.g. O2 and O3 runs, and an O2 run of an older commit)::

    python benchmarks/o2_hard_segments.py --table before:old_o2.jsonl o2.jsonl o3.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# name -> (model, config source, mesh, build path)
CASES = {
    "moe_quick_2x4": ("moe", "quick", (2, 4), "auto_parallel"),
    "wide_resnet_quick_2x4": ("wide_resnet", "quick", (2, 4), "auto_parallel"),
    "gpt_8": ("gpt", "bench", (8,), "auto_parallel"),
    "moe_8": ("moe", "bench", (8,), "auto_parallel"),
    "vgg19_8": ("vgg19", "bench", (8,), "auto_parallel"),
    "wide_resnet_8": ("wide_resnet", "bench", (8,), "auto_parallel"),
    "gpt_test_2x4": ("gpt", "test", (2, 4), "plan"),
}
# the small GPT of tests/test_plan.py
TEST_GPT = dict(layers=2, hidden=256, heads=4, seq=8, vocab=4096, batch=8)


def build(case: str):
    import jax

    import rhino
    from rhino.hlo_passes.annotate import ScopedFunction
    from rhino.models import get_model
    from rhino.planner.build import BuildOptions, build_problem
    from rhino.planner.cost_model import CostModel
    from rhino.planner.mesh import AbstractMesh
    from spmd_vs_peers import MODELS, QUICK

    name, src, mesh, path = CASES[case]
    cfg = {"quick": QUICK, "bench": MODELS}[src][name] if src != "test" else TEST_GPT
    model = get_model(name, **cfg)
    args = model.example_args()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    if path == "auto_parallel":
        graph = rhino.ingest(ScopedFunction(model.step, *abstract), *abstract)
        opts = BuildOptions(strided=False, partial_passthrough=False)
    else:
        graph = rhino.ingest(model.step, *abstract)
        opts = BuildOptions()
    return build_problem(graph, AbstractMesh(mesh), CostModel.simulated_cpu(len(mesh)), opts)


def built_problem(case: str, cache: str | None):
    """What ``_solve`` reads of a ``BuiltProblem`` (problem, partition, the cost model's β),
    cached."""
    from types import SimpleNamespace
    if cache:
        f = os.path.join(cache, f"{case}.v2.pkl")
        if os.path.exists(f):
            with open(f, "rb") as fh:
                return pickle.load(fh)
    full = build(case)
    b = SimpleNamespace(problem=full.problem, partition=full.partition,
                        cost=SimpleNamespace(beta=tuple(full.cost.beta)))
    if cache:
        os.makedirs(cache, exist_ok=True)
        with open(os.path.join(cache, f"{case}.v2.pkl"), "wb") as fh:
            pickle.dump(b, fh)
    return b


def run(case: str, levels: tuple[str, ...], time_limit: float, cache: str | None) -> dict:
    import warnings

    from rhino.planner.api import PlanOptions, _solve

    built = built_problem(case, cache)
    name, src, mesh, _ = CASES[case]
    row = {"case": case, "model": name, "config": src, "mesh": list(mesh),
           "nodes": built.problem.num_nodes, "edges": len(built.problem.edges)}
    for level in levels:
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            sol = _solve(built, built.problem, PlanOptions(opt_level=level,
                                                           time_limit=time_limit))
        row[f"{level}_s"] = time.perf_counter() - t
        row[f"{level}_objective"] = sol.objective
        row[f"{level}_status"] = sol.status + (" (time limit)" if any(
            "time limit" in str(x.message) for x in w) else "")
        print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def merge(paths: list[str]) -> list[dict]:
    """Rows of JSON-lines files joined by case (later files add or override keys); a row
    of a file named with a ``before:`` prefix gives its O2 figures as ``O2_before_*``."""
    rows: dict[str, dict] = {}
    for path in paths:
        before = path.startswith("before:")
        for line in open(path.removeprefix("before:")):
            if not line.strip():
                continue
            r = json.loads(line)
            if before:
                r = {k.replace("O2_", "O2_before_"): v for k, v in r.items()}
            rows.setdefault(r["case"], {}).update(r)
    order = list(CASES)
    return sorted(rows.values(), key=lambda r: order.index(r["case"]) if r["case"] in order
                  else len(order))


def table(rows: list[dict]) -> str:
    before = any("O2_before_s" in r for r in rows)
    head = ["model", "config", "mesh", "nodes"]
    head += ["O2 s before", "O2 s", "O2 objective before (ms)"] if before else ["O2 s"]
    head += ["O2 objective (ms)", "O3 s", "O3 objective (ms)", "O3 status", "O2 / O3"]
    out = ["| " + " | ".join(head) + " |",
           "|---|---|---|" + "---:|" * (len(head) - 5) + "---|---:|"]

    def f(r, k, fmt, scale=1.0):
        return fmt.format(scale * r[k]) if k in r else "—"
    for r in rows:
        cells = [r["model"], r["config"], f"({','.join(map(str, r['mesh']))})",
                 str(r["nodes"])]
        if before:
            cells += [f(r, "O2_before_s", "{:.2f}"), f(r, "O2_s", "{:.2f}"),
                      f(r, "O2_before_objective", "{:.4f}", 1e3)]
        else:
            cells += [f(r, "O2_s", "{:.2f}")]
        cells += [f(r, "O2_objective", "{:.4f}", 1e3), f(r, "O3_s", "{:.1f}"),
                  f(r, "O3_objective", "{:.4f}", 1e3), r.get("O3_status", "—"),
                  f"{r['O2_objective'] / r['O3_objective']:.4f}"
                  if "O2_objective" in r and "O3_objective" in r else "—"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--levels", nargs="+", default=["O2", "O3"], choices=["O2", "O3"])
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--cache", default=None, help="directory of pickled built problems")
    p.add_argument("--out", default=None, help="append JSON lines here")
    p.add_argument("--table", nargs="+", default=None,
                   help="only print the table of JSON-lines files, joined by case; prefix "
                        "a file with 'before:' to show its O2 figures as the 'before' columns")
    a = p.parse_args()
    if a.table:
        print(table(merge(a.table)))
        return
    rows = []
    for case in a.cases:
        row = run(case, tuple(a.levels), a.time_limit, a.cache)
        rows.append(row)
        if a.out:
            with open(a.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
