"""Stage ILP solve time with and without the bound tightening of Rhino §5.2.

For GPT with 24 and 48 layers (hidden 512, 8 heads, seq 128, vocab 8192, Adam; the
training step's forward and backward coarsened into units, ``coarsen.py``), solve the stage
ILP of §5.1 for p stages and ε ∈ {0.1, 0.2, 0.5}, plain (every unit may take every stage)
and tightened (§5.2 bounds), side by side in one process. Prints a Markdown table: solve
seconds, status, stage choices left (Σ_u (ub_u - lb_u + 1)), ILP columns, and whether the
two optima agree.

    python benchmarks/pipeline_bound_tightening.py [--layers 24 48] [--stages 4 8]
        [--eps 0.1 0.2 0.5] [--time-limit 120]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import rhino
from rhino.models import get_model
from rhino.pipeline.coarsen import classify_ops, coarsen
from rhino.pipeline.gradient import find_gradient_boundary, gradient_weights
from rhino.pipeline.stage_ilp import StageAssignmentError, StageOptions, solve_stage_problem


def problem_for(layers: int):
    m = get_model("gpt", layers=layers, hidden=512, heads=8, seq=128, vocab=8192)
    t0 = time.perf_counter()
    g = rhino.ingest(m.step, *m.example_args())
    b = find_gradient_boundary(g)
    c = coarsen(g, classify_ops(g, b), state_params=b.state_params,
                gradient_weights=gradient_weights(g, b))
    return g, c, time.perf_counter() - t0


def solve(problem, options):
    t0 = time.perf_counter()
    try:
        sol = solve_stage_problem(problem, options)
    except StageAssignmentError:
        return None, time.perf_counter() - t0
    return sol, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 48])
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--eps", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    ap.add_argument("--time-limit", type=float, default=120.0)
    args = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| layers | HLO ops | units | p | ε | plain s | plain status | tightened s | "
          "tightened status | speed-up | choices plain → tight | columns plain → tight | "
          "same optimum |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---|---|---|")
    for layers in args.layers:
        g, c, prep = problem_for(layers)
        for p in args.stages:
            problem = dataclasses.replace(c.problem, num_stages=p)
            for eps in args.eps:
                opts = StageOptions(epsilon=eps, relax=False, time_limit=args.time_limit)
                plain, tp = solve(problem, dataclasses.replace(opts, tighten=False))
                tight, tt = solve(problem, opts)
                same = "n/a"
                if plain is not None and tight is not None:
                    same = ("yes" if abs(plain.objective - tight.objective)
                            <= 1e-6 * max(1.0, abs(plain.objective)) else
                            f"no ({plain.objective:.4f} vs {tight.objective:.4f})")

                def status(sol):
                    return "infeasible" if sol is None else sol.status

                ncols = (f"{plain.num_vars if plain else '-'} → "
                         f"{tight.num_vars if tight else '-'}")
                nch = (f"{plain.free_choices if plain else '-'} → "
                       f"{tight.free_choices if tight else '-'}")
                print(f"| {layers} | {len(g.ops)} | {c.problem.num_units} | {p} | {eps} | "
                      f"{tp:.2f} | {status(plain)} | {tt:.2f} | {status(tight)} | "
                      f"{tp / tt:.1f}× | {nch} | {ncols} | {same} |", flush=True)
        print(f"<!-- {layers} layers: ingest + boundary + coarsening {prep:.1f} s -->")


if __name__ == "__main__":
    main()
