"""SPMD search time and plan quality, O2 vs O3, on GPT (hidden 512) at 4..72 layers and
meshes (8) and (2, 4) — the experiment of the Rhino paper's Fig. 10.

Each (layers, mesh) runs in a fresh subprocess: ingest, build the problem, solve with O2,
then with O3 (time limit per solve, default 600 s). Results go to a JSON-lines file; --plot
draws search time and objective against layers into a PNG.

    python benchmarks/spmd_search.py --out benchmarks/out/spmd_search.jsonl
    python benchmarks/spmd_search.py --plot benchmarks/out/spmd_search.jsonl \
        --png benchmarks/spmd_search.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LAYERS = (4, 12, 24, 36, 48, 72)
MESHES = ("8", "2,4")


def one(layers: int, mesh: str, time_limit: float, levels: tuple[str, ...]) -> dict:
    import rhino
    from rhino.models import get_model
    from rhino.planner.api import PlanOptions, _solve
    from rhino.planner.build import build_problem
    from rhino.planner.cost_model import CostModel
    from rhino.planner.mesh import AbstractMesh

    shape = tuple(int(x) for x in mesh.split(","))
    model = get_model("gpt", layers=layers, hidden=512, heads=8, seq=128, vocab=8192)
    t0 = time.perf_counter()
    graph = rhino.ingest(model.step, *model.example_args())
    t1 = time.perf_counter()
    built = build_problem(graph, AbstractMesh(shape), CostModel.simulated_cpu(len(shape)))
    t2 = time.perf_counter()
    row = {"layers": layers, "mesh": mesh, "ops": len(graph.ops), "ingest_s": t1 - t0,
           "build_s": t2 - t1, **{k: v for k, v in built.stats().items() if k != "seconds"}}
    for level in levels:
        t = time.perf_counter()
        sol = _solve(built, built.problem, PlanOptions(opt_level=level, time_limit=time_limit))
        row[f"{level}_s"] = time.perf_counter() - t
        row[f"{level}_objective"] = sol.objective
        row[f"{level}_status"] = sol.status
    return row


def plot(path: str, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(path) if line.strip()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mesh in MESHES:
        rs = sorted((r for r in rows if r["mesh"] == mesh), key=lambda r: r["layers"])
        for level, style in (("O2", "-o"), ("O3", "--s")):
            pts = [(r["layers"], r[f"{level}_s"], r[f"{level}_objective"]) for r in rs
                   if f"{level}_s" in r]
            if not pts:
                continue
            xs, ts, objs = zip(*pts)
            a.plot(xs, ts, style, label=f"{level}, mesh ({mesh})")
            b.plot(xs, [1e3 * o for o in objs], style, label=f"{level}, mesh ({mesh})")
    a.set(xlabel="GPT layers (hidden 512)", ylabel="search time (s)", yscale="log",
          title="SPMD search time")
    b.set(xlabel="GPT layers (hidden 512)", ylabel="estimated step time (ms)",
          title="plan objective")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, nargs="*", default=list(LAYERS))
    p.add_argument("--meshes", nargs="*", default=list(MESHES))
    p.add_argument("--levels", nargs="*", default=["O2", "O3"])
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--out", default="benchmarks/out/spmd_search.jsonl")
    p.add_argument("--plot", metavar="JSONL", help="only draw the PNG from results")
    p.add_argument("--png", default="benchmarks/spmd_search.png")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plot:
        plot(args.plot, args.png)
        return
    if args.one:
        print(json.dumps(one(args.layers[0], args.meshes[0], args.time_limit,
                             tuple(args.levels))))
        return
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for L in args.layers:
        for mesh in args.meshes:
            cmd = [sys.executable, __file__, "--one", "--layers", str(L), "--meshes", mesh,
                   "--time-limit", str(args.time_limit), "--levels", *args.levels]
            out = subprocess.run(cmd, capture_output=True, text=True,
                                 timeout=3 * args.time_limit + 600)
            if out.returncode != 0:
                print(f"layers {L} mesh {mesh} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
