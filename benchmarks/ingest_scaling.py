"""Ingestion + analysis scaling on GPT (hidden 512) at 4..72 layers, beside the paper's Table 5.

Each size runs in a fresh subprocess so its peak memory (ru_maxrss) is its own.

    python benchmarks/ingest_scaling.py                 # all sizes, markdown table
    python benchmarks/ingest_scaling.py --layers 72     # one size
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

LAYERS = (4, 12, 24, 36, 48, 72)


def one(layers: int, hidden: int) -> dict:
    import resource

    t0 = time.perf_counter()
    import rhino
    from rhino.models import get_model

    model = get_model("gpt", layers=layers, hidden=hidden, heads=8, seq=128, vocab=8192)
    args = model.example_args()
    t1 = time.perf_counter()
    g = rhino.ingest(model.step, *args)
    t2 = time.perf_counter()
    a = rhino.analyze(g)
    t3 = time.perf_counter()
    return {
        "layers": layers, "hidden": hidden, "ops": len(g.ops),
        "critical": len(a.critical), "share": len(a.critical) / len(g.ops),
        "cones": len(a.cones), "segments": a.num_segments,
        "import_s": t1 - t0, "ingest_s": t2 - t1, "analyze_s": t3 - t2,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, nargs="*", default=list(LAYERS))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.layers[0], args.hidden)))
        return
    rows = []
    for L in args.layers:
        out = subprocess.run([sys.executable, __file__, "--one", "--layers", str(L),
                              "--hidden", str(args.hidden)], capture_output=True, text=True,
                             timeout=900, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"  done {L} layers", file=sys.stderr)
    print("| layers | HLO ops | critical nodes | share | cones | segments | ingest s "
          "| analyses s | ingest+analyses s | peak RSS MiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layers']} | {r['ops']} | {r['critical']} | {100 * r['share']:.2f}% | "
              f"{r['cones']} | {r['segments']} | {r['ingest_s']:.2f} | {r['analyze_s']:.3f} | "
              f"{r['ingest_s'] + r['analyze_s']:.2f} | {r['peak_rss_mib']:.0f} |")
    print("| paper GPT-72 (Table 5) | 76k | 378 | 0.5% | | 377 subgraphs | | | | |")


if __name__ == "__main__":
    main()
