"""The microbatch corpus (``microbatch_corpus``) as a multi-controller job (issue 43,
acceptance 5), run under ``python -m rhino.launch --hosts 2 --devices-per-host 4``: every
case and dtype pipelined by ``rhino.auto_parallel`` over the job's 2x4 devices (2 stages,
one per process, 4 microbatches), judged in each process on the shards it holds of every
result against the float32 step (``microbatch_corpus.judge``).

    python -m rhino.launch --hosts 2 --devices-per-host 4 tests/corpus_job.py \\
        --out DIR [--cases a,b] [--dtypes float32,...]

Each process writes ``DIR/pN.json``: per run its outcome and, per result leaf, the
index ranges it held (``covered`` checks that the processes together held every element
of every result, so that no result escaped the comparison). Exit status 1 if any run of
this process is not exact or rightly refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import microbatch_corpus as C  # noqa: E402

import rhino  # noqa: E402
from rhino.errors import BatchCouplingError  # noqa: E402


def held_part(x):
    """``(values, ranges)``: this process's shards of result ``x`` as a masked array
    (unheld elements masked) and the index ranges held, ``[[start, stop], ...]`` per
    shard; a result whole in this process (an uncommitted or local array) is held whole."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        a = np.asarray(x)
        return a, [[[0, n] for n in a.shape]]
    data = np.zeros(x.shape, np.float64)
    mask = np.ones(x.shape, bool)
    ranges = []
    for shard in x.addressable_shards:
        data[shard.index] = np.asarray(shard.data, np.float64)
        mask[shard.index] = False
        ranges.append([list(s.indices(n)[:2]) for s, n in zip(shard.index, x.shape)])
    return np.ma.MaskedArray(data, mask), ranges


def run_case(c: C.Case, dtype: str, cluster: str, timeout: float):
    """The case pipelined over the job, judged on this process's shards: ``(verdict,
    ranges per result leaf or None where refused or not run, result shapes)``."""
    if c.unpartitioned:
        return C.Verdict("unpartitioned"), None, None
    args = C.args_of(dtype)
    step, _ = C.make_step(c, dtype)
    run = rhino.auto_parallel(step, cluster=cluster, stages=2, num_microbatches=C.M,
                               timeout=timeout)
    try:
        parts = [held_part(x) for x in jax.tree.leaves(run(*args))]
    except BatchCouplingError:
        parts = None
    finally:
        run.close()
    if parts is None:
        return C.judge(c, dtype, args, None), None, None
    got = [v for v, _ in parts]
    return (C.judge(c, dtype, args, got), [r for _, r in parts],
            [list(np.shape(v)) for v in got])


def covered(runs_per_process) -> list[str]:
    """Runs (``case dtype``) some result element of which no process held."""
    missing = []
    for runs in zip(*runs_per_process):
        first = runs[0]
        if first["shapes"] is None:
            continue
        for leaf, shape in enumerate(first["shapes"]):
            seen = np.zeros(shape, bool)
            for r in runs:
                for rng in r["held"][leaf]:
                    seen[tuple(slice(a, b) for a, b in rng)] = True
            if not seen.all():
                missing.append(f"{first['case']} {first['dtype']} (result {leaf})")
    return missing


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for pN.json")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--dtypes", default=",".join(C.FLOATS))
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds a run may wait on a value (default 120)")
    ap.add_argument("--traceback", action="store_true", help="print each error's traceback")
    a = ap.parse_args()
    job = rhino.distributed_init()
    me = job.process_id
    cluster = f"{job.num_processes}x{jax.local_device_count()}"
    names = set(a.cases.split(",")) if a.cases else None
    dtypes = a.dtypes.split(",")
    rows: list[dict] = []
    os.makedirs(a.out, exist_ok=True)
    for c in C.CASES:
        if names is not None and c.name not in names:
            continue
        for dt in c.dtypes:
            if dt not in dtypes:
                continue
            t = time.time()
            row = dict(case=c.name, dtype=dt, held=None, shapes=None)
            try:
                v, row["held"], row["shapes"] = run_case(c, dt, cluster, a.timeout)
                row.update(outcome=v.outcome, error=v.error, rounding=v.rounding,
                           accumulation=v.accumulation)
            except Exception as e:           # a crash is a finding, recorded as such
                if a.traceback:
                    traceback.print_exc()
                row.update(outcome="error", error_text=f"{type(e).__name__}: {str(e)[:300]}")
            row["seconds"] = round(time.time() - t, 1)
            rows.append(row)
            print(f"process {me}: {c.name:28s} {dt:9s} {row['outcome']:14s} "
                  f"{row['seconds']:6.1f} s", flush=True)
            with open(os.path.join(a.out, f"p{me}.json"), "w") as f:   # kept as it goes
                json.dump(rows, f)
    ok = all(r["outcome"] in ("exact", "refused", "unpartitioned") for r in rows)
    print(f"process {me}: {'OK' if ok else 'FAILED'}: {len(rows)} runs", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
