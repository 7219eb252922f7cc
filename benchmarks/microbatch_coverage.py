"""The microbatch analysis over a generated corpus (issue 43, acceptance 1): every case of
``tests/microbatch_corpus.py`` (one per use of every ``jax.lax`` primitive that can take a
per-example operand, and the composites users write) in each of its dtypes, pipelined by
``rhino.auto_parallel`` on 2x4 with 2 stages and 4 microbatches, judged against
``jax.jit`` (``microbatch_corpus.judge``): exact to the dtype's rounding, or refused where
gradient accumulation computes something else than the step.

    python benchmarks/microbatch_coverage.py [--out FILE.json] [--table FILE.md]
                                             [--cases a,b] [--dtypes float32,...]
                                             [--executor ray|launch]

``--executor ray`` runs every pipelined step on Ray actors (a local Ray instance with 4
CPUs, started and stopped here) instead of the local executor; ``--executor launch`` runs
the corpus as one job of ``rhino.launch`` (2 hosts x 4 simulated devices, one stage per
process: ``tests/corpus_job.py``), each process judging the shards it holds; a run is
exact where both are and together they held every element of every result.

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
    ap.add_argument("--executor", choices=("local", "ray", "launch"), default="local")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a Ray run may take (default 300)")
    a = ap.parse_args(argv)
    options = {}
    if a.executor == "ray":
        from rhino.runtime.ray.executor import init
        init(num_cpus=4, log_to_driver=False)
        options = dict(executor="ray", timeout=a.timeout)
    names = set(a.cases.split(",")) if a.cases else None
    dtypes = a.dtypes.split(",")
    rows, t0 = [], time.time()
    if a.executor == "launch":
        rows = _launched(a)
    for c in C.CASES if a.executor != "launch" else ():
        if names is not None and c.name not in names:
            continue
        for dt in c.dtypes:
            if dt not in dtypes:
                continue
            t = time.time()
            try:
                v = C.pipelined_verdict(c, dt, **options)
                row = dict(case=c.name, dtype=dt, outcome=v.outcome, error=v.error,
                           rounding=v.rounding, accumulation=v.accumulation)
            except Exception as e:           # a crash is a finding, recorded as such
                row = dict(case=c.name, dtype=dt, outcome="error",
                           error_text=f"{type(e).__name__}: {str(e)[:300]}")
            row["seconds"] = round(time.time() - t, 1)
            rows.append(row)
            print(f"{c.name:28s} {dt:9s} {row['outcome']:14s} {row['seconds']:6.1f} s",
                  flush=True)
    if a.executor == "ray":
        import ray
        ray.shutdown()
    table = _table(rows)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(runs=rows, executor=a.executor,
                           seconds=round(time.time() - t0)), f, indent=1)
    if a.table:
        with open(a.table, "w") as f:
            f.write(table)
    return 0 if all(r["outcome"] in ("exact", "refused", "unpartitioned")
                    for r in rows) else 1


def _launched(a) -> list[dict]:
    """The corpus run as a ``rhino.launch`` job: one row per run, from both processes'."""
    import subprocess
    import tempfile

    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "rhino.launch", "--hosts", "2", "--devices-per-host",
               "4", "--timeout", str(24 * 3600), os.path.join(tests, "corpus_job.py"),
               "--out", out, "--dtypes", a.dtypes, "--timeout", str(a.timeout)]
        if a.cases:
            cmd += ["--cases", a.cases]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        status = subprocess.call(cmd, env=env)
        parts = []
        for p in (0, 1):
            path = os.path.join(out, f"p{p}.json")
            if not os.path.exists(path):
                raise SystemExit(f"the job (exit status {status}) left no {path}")
            with open(path) as f:
                parts.append(json.load(f))
    import corpus_job  # noqa: E402  (tests/corpus_job.py)

    missing = set(corpus_job.covered(parts))
    rows = []
    for runs in zip(*parts):
        row = dict(runs[0])
        outcomes = {r["outcome"] for r in runs}
        if len(outcomes) > 1:
            row["outcome"] = "error"
            row["error_text"] = "the processes disagree: " + ", ".join(
                f"p{i} {r['outcome']}" for i, r in enumerate(runs))
        elif f"{row['case']} {row['dtype']}" in {m.rsplit(" (", 1)[0] for m in missing}:
            row["outcome"] = "error"
            row["error_text"] = "some result was held by no process"
        row["error"] = max(r.get("error", 0.0) for r in runs)
        row["seconds"] = max(r["seconds"] for r in runs)
        row.pop("held"), row.pop("shapes")
        rows.append(row)
    return rows


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
