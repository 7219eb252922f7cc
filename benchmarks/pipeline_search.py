"""The pipeline planner's whole search, timed per phase, and the controller's choices.

Two parts, each printing Markdown for ``benchmarks/RESULTS.md``:

* ``--search``: GPT with the GPT-2.7B shapes (hidden 2560, ffn 10240, 32 heads) and 32
  layers on 16 devices (2 hosts × 8): ingest, gradient boundary, coarsening, stage ILPs,
  per-stage SPMD plans, costing; the whole search and each phase, with the candidates.
* ``--controller``: three clusters for one model: slow links between hosts (pipeline across
  hosts, SPMD within expected), uniform fast links (SPMD only expected), and devices too
  small to hold the replicated weights and Adam state (a plan that fits expected).

    python benchmarks/pipeline_search.py --search [--layers 32] [--cluster 2x8]
        [--beta-inter 1e-9] [--microbatches 8] [--executor auto] [--no-prune]
    python benchmarks/pipeline_search.py --controller
"""

from __future__ import annotations

import argparse
import platform
import time

import rhino
from rhino.models import get_model
from rhino.pipeline import PipelineOptions


def _row(c) -> str:
    ms = 1e3
    if not c.feasible:
        return (f"| {c.kind} | {c.num_stages} | {'x'.join(map(str, c.stage_mesh))} | "
                f"{c.note} | | | | | |")
    return (f"| {c.kind} | {c.num_stages} | {'x'.join(map(str, c.stage_mesh))} | "
            f"{ms * c.step_s:.2f} | {ms * c.compute_s:.2f} | {ms * c.communication_s:.2f} | "
            f"{ms * c.transfer_s:.2f} | {ms * c.bubble_s:.2f} | {c.memory / 2**20:.0f} |")


def _candidates(p) -> None:
    print("| kind | p | stage mesh | step ms | compute | comm | transfer | bubble | "
          "mem MiB |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for c in sorted(p.candidates, key=lambda c: (not c.feasible, c.step_s or 0.0)):
        print(_row(c))


def search(layers: int, cluster: str, beta_inter: float, microbatches: int,
           executor: str, prune: bool = True) -> None:
    m = get_model("gpt", preset="GPT-2.7B", layers=layers)
    t0 = time.perf_counter()
    p = rhino.plan_pipeline(m.step, *m.example_args(), cluster=cluster, beta_inter=beta_inter,
                            microbatches=microbatches,
                            options=PipelineOptions(executor=executor, prune=prune),
                            progress=lambda s: print(f"<!-- {time.perf_counter() - t0:7.1f} s "
                                                     f"{s} -->", flush=True))
    wall = time.perf_counter() - t0
    t = p.search
    print(f"GPT-2.7B shapes, {layers} layers, cluster {cluster} (β inter-host {beta_inter:g} "
          f"s/B, intra-host {p.cluster.beta_intra:g}), m = {microbatches}, executor "
          f"{executor}, pruning {'on' if prune else 'off'}: **whole search {wall:.1f} s**\n")
    print("| phase | seconds |")
    print("|---|---:|")
    for name, v in (("ingest (lower + parse)", t.ingest), ("gradient boundary", t.boundary),
                    ("roles + coarsening", t.coarsen), ("stage ILPs (all p)", t.stage_ilp),
                    (f"SPMD plans ({t.spmd_plans}, summed over workers)", t.spmd),
                    ("costing", t.estimate), ("whole search (wall)", t.total)):
        print(f"| {name} | {v:.2f} |")
    print()
    _candidates(p)
    print(f"\nChosen: {p.kind}, {p.num_stages} stage(s) × {p.stages[0].mesh}. Why: "
          f"{p.decision}\n")


def controller() -> None:
    m = get_model("gpt", layers=8, hidden=512, heads=8, seq=128, vocab=8192, batch=8)
    g = rhino.ingest(m.step, *m.example_args())
    state = sum(g.ops[q].out_bytes for q in g.params
                if not g.ops[q].arg.path.startswith("batch"))
    cases = [
        ("slow links between hosts", "2x4", dict(beta_inter=1e-8, alpha_inter=5e-5)),
        ("uniform fast links", "2x4", dict(beta_inter=2e-10, alpha_inter=1e-5)),
        ("small devices", "2x4", dict(beta_inter=1e-9, memory_bytes=int(state * 0.6))),
    ]
    print(f"GPT 8 layers, hidden 512, seq 128, vocab 8192, batch 8 ({len(g.ops)} HLO ops; "
          f"weights + Adam state {state / 2**20:.0f} MiB), m = 8, ε = 0.1.\n")
    for name, cluster, kw in cases:
        t0 = time.perf_counter()
        p = rhino.plan_pipeline(g, cluster=cluster, microbatches=8, **kw)
        wall = time.perf_counter() - t0
        extra = ", ".join(f"{k} {v:g}" for k, v in kw.items())
        print(f"**{name}** (cluster {cluster}, {extra}): chose **{p.kind}**, "
              f"{p.num_stages} stage(s) × {p.stages[0].mesh}, est. {1e3 * p.step_s:.2f} ms, "
              f"largest stage memory {max(s.memory.total for s in p.stages) / 2**20:.0f} MiB "
              f"(search {wall:.1f} s).\nWhy: {p.decision}\n")
        _candidates(p)
        print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--search", action="store_true")
    ap.add_argument("--controller", action="store_true")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--cluster", default="2x8")
    ap.add_argument("--beta-inter", type=float, default=1e-9)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--executor", default="auto")
    ap.add_argument("--no-prune", action="store_true", help="cost every candidate")
    args = ap.parse_args()
    print(f"<!-- {platform.machine()}, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')} -->")
    if args.search:
        search(args.layers, args.cluster, args.beta_inter, args.microbatches, args.executor,
               not args.no_prune)
    if args.controller:
        controller()


if __name__ == "__main__":
    main()
