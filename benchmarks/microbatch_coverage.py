"""The microbatch analysis over a generated corpus (issue 43, acceptance 1): every case of
``tests/microbatch_corpus.py`` (one per use of every ``jax.lax`` primitive that can take a
per-example operand, and the composites users write) in each of its dtypes, pipelined by
``rhino.auto_parallel`` on 2x4 with 2 stages and 4 microbatches, judged against
``jax.jit`` (``microbatch_corpus.judge``): exact to the dtype's rounding, or refused where
gradient accumulation computes something else than the step.

    python benchmarks/microbatch_coverage.py [--out FILE.json] [--table FILE.md]
                                             [--cases a,b] [--dtypes float32,...]

Prints one line per run as it ends and the table (case, primitives, outcome per dtype)
with the counts; exit status 1 if any run is wrong or a false refusal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import microbatch_corpus as C  # noqa: E402  (tests/microbatch_corpus.py)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file of every run's verdict")
    ap.add_argument("--table", help="markdown file of the table")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--dtypes", default=",".join(C.FLOATS))
    a = ap.parse_args(argv)
    names = set(a.cases.split(",")) if a.cases else None
    dtypes = a.dtypes.split(",")
    rows, t0 = [], time.time()
    for c in C.CASES:
        if names is not None and c.name not in names:
            continue
        for dt in c.dtypes:
            if dt not in dtypes:
                continue
            t = time.time()
            try:
                v = C.pipelined_verdict(c, dt)
                row = dict(case=c.name, dtype=dt, outcome=v.outcome, error=v.error,
                           rounding=v.rounding, accumulation=v.accumulation)
            except Exception as e:           # a crash is a finding, recorded as such
                row = dict(case=c.name, dtype=dt, outcome="error",
                           error_text=f"{type(e).__name__}: {str(e)[:300]}")
            row["seconds"] = round(time.time() - t, 1)
            rows.append(row)
            print(f"{c.name:28s} {dt:9s} {row['outcome']:14s} {row['seconds']:6.1f} s",
                  flush=True)
    table = _table(rows)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(runs=rows, seconds=round(time.time() - t0)), f, indent=1)
    if a.table:
        with open(a.table, "w") as f:
            f.write(table)
    return 0 if all(r["outcome"] in ("exact", "refused", "unpartitioned")
                    for r in rows) else 1


def _table(rows) -> str:
    by = {}
    for r in rows:
        by.setdefault(r["case"], {})[r["dtype"]] = r["outcome"]
    cases = {c.name: c for c in C.CASES}
    lines = ["| case | primitives | " + " | ".join(C.FLOATS) + " |",
             "|---|---|" + "---|" * len(C.FLOATS)]
    for name, got in by.items():
        prims = " ".join(f"`{p}`" for p in cases[name].prims)
        lines.append(f"| {name} | {prims} | " +
                     " | ".join(got.get(dt, "—") for dt in C.FLOATS) + " |")
    counts = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    lines.append("")
    for c in C.CASES:
        if c.unpartitioned and c.name in by:
            lines.append(f"{c.name}: not run on several devices: {c.unpartitioned}.")
    lines.append("Runs: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) +
                 f" (of {len(rows)}).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
