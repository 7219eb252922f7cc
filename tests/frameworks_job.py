"""The Flax / Equinox / Haiku / optax steps of ``tests/test_frameworks.py`` as one
multi-controller job (issue 43, acceptance 5), run under ``python -m rhino.launch --hosts 2
--devices-per-host 4``: each test function that takes no arguments runs in both processes
(its pipelined steps over the job's 2x4 devices, one stage per process; its ``jax.jit``
references in each process), and each process reports what it saw.

    python -m rhino.launch --hosts 2 --devices-per-host 4 tests/frameworks_job.py \\
        [--tests name,name] [--out FILE]

Prints ``process P: NAME passed|failed|skipped|unreadable here [why]`` per test
(*unreadable here*: the test reads a whole result of which this process holds no shard,
which no process of a multi-controller job can, under ``jax.jit`` either); ``--out``
writes ``FILE.pN.json``. Exit status 1 if a test failed in this process.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

import rhino  # noqa: E402

UNREADABLE = "Fetching value for `jax.Array` that spans non-addressable"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests", help="comma-separated test names (default: every test of "
                                    "test_frameworks that takes no arguments)")
    ap.add_argument("--out", help="write FILE.pN.json")
    a = ap.parse_args()
    job = rhino.distributed_init()
    me = job.process_id
    import test_frameworks as T

    names = a.tests.split(",") if a.tests else [
        n for n, f in vars(T).items() if n.startswith("test_") and callable(f)
        and not inspect.signature(f).parameters]
    rows = []
    for name in names:
        t = time.time()
        try:
            getattr(T, name)()
            outcome, why = "passed", ""
        except pytest.skip.Exception as e:
            outcome, why = "skipped", str(e)[:200]
        except BaseException as e:     # noqa: BLE001  (a finding, recorded as such)
            outcome, why = "failed", f"{type(e).__name__}: {str(e)[:400]}"
            if str(e).startswith(UNREADABLE):
                # The test reads a whole result this process holds no shard of: no
                # process of a multi-controller job can, under jax.jit either.
                outcome = "unreadable here"
        rows.append(dict(test=name, outcome=outcome, why=why,
                         seconds=round(time.time() - t, 1)))
        print(f"process {me}: {name} {outcome} ({rows[-1]['seconds']} s) {why}", flush=True)
    if a.out:
        with open(f"{a.out}.p{me}.json", "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["outcome"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
