"""O2 against O3 as the compute/communication balance moves (issue 15, acceptance 4).

For every zoo model at its default size, on meshes (8) and (2, 4), the simulated-CPU cost
model with its FLOP rate set so that one device computes R FLOP in the time the slowest mesh
axis moves one byte (R = 10, 100, 1000: CPU-like to GPU-like balances), plan with O2 and O3
and report O2's objective over O3's (O3 is the whole-graph ILP: its objective is the optimum
unless it hit its time limit, which the table says). Each model runs in its own process.

    python benchmarks/o2_vs_o3_balance.py --out benchmarks/out/o2_vs_o3_balance.jsonl
    python benchmarks/o2_vs_o3_balance.py --table benchmarks/out/o2_vs_o3_balance.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODELS = ("mlp", "gpt", "moe", "vgg19", "wide_resnet", "unet", "dnabert")
MESHES = ("8", "2,4")
RATIOS = (10.0, 100.0, 1000.0)


def one(model_name: str, time_limit: float) -> list[dict]:
    import rhino
    from rhino.models import get_model
    from rhino.planner.api import PlanOptions, plan_graph
    from rhino.planner.cost_model import CostModel
    from rhino.planner.mesh import AbstractMesh

    model = get_model(model_name)
    t0 = time.perf_counter()
    graph = rhino.ingest(model.step, *model.example_args())
    ingest_s = time.perf_counter() - t0
    rows = []
    for mesh in MESHES:
        shape = tuple(int(x) for x in mesh.split(","))
        base = CostModel.simulated_cpu(len(shape), memory_bytes=None)
        for ratio in RATIOS:
            cost = base.with_flops(ratio / max(base.beta))
            row = {"model": model_name, "mesh": mesh, "flop_per_byte": ratio,
                   "ops": len(graph.ops), "ingest_s": ingest_s}
            for level in ("O2", "O3"):
                t = time.perf_counter()
                plan = plan_graph(graph, AbstractMesh(shape), cost,
                                  PlanOptions(opt_level=level, time_limit=time_limit))
                row[f"{level}_s"] = time.perf_counter() - t
                row[f"{level}_objective"] = plan.search.objective
                row[f"{level}_status"] = str(plan.search.status)
            row["ratio"] = row["O2_objective"] / row["O3_objective"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def table(path: str) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    out = ["| model | mesh | FLOP per byte | O2 ms | O3 ms | O2 ÷ O3 | O2 s | O3 s | O3 status |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['model']} | ({r['mesh']}) | {r['flop_per_byte']:g} | "
                   f"{1e3 * r['O2_objective']:.4f} | {1e3 * r['O3_objective']:.4f} | "
                   f"{r['ratio']:.4f} | {r['O2_s']:.1f} | {r['O3_s']:.1f} | {r['O3_status']} |")
    worst = max(rows, key=lambda r: r["ratio"])
    out.append("")
    out.append(f"worst O2 ÷ O3: {worst['ratio']:.4f} ({worst['model']}, mesh ({worst['mesh']}), "
               f"{worst['flop_per_byte']:g} FLOP/byte); rows above 1.01: "
               f"{sum(r['ratio'] > 1.01 for r in rows)} of {len(rows)}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--time-limit", type=float, default=300.0)
    p.add_argument("--out", default="benchmarks/out/o2_vs_o3_balance.jsonl")
    p.add_argument("--table", metavar="JSONL", help="only print the table of a results file")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.table:
        print(table(a.table))
        return 0
    if a.one:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        one(a.one, a.time_limit)
        return 0
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        for m in a.models:
            t = time.perf_counter()
            res = subprocess.run([sys.executable, __file__, "--one", m, "--time-limit",
                                  str(a.time_limit)], capture_output=True, text=True)
            lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
            for ln in lines:
                f.write(ln + "\n")
            f.flush()
            print(f"# {m}: {len(lines)} rows, {time.perf_counter() - t:.0f} s"
                  + ("" if res.returncode == 0 else f", exit {res.returncode}: "
                     + res.stderr.strip()[-400:]), flush=True)
    print(table(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
