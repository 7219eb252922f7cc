"""What the end-of-step agreement of a multi-controller pipeline costs: each process writes
its outcome of a step in the ``jax.distributed`` job's key-value store and waits for every
other process's (``runtime.executors.multicontroller.ProcessStages._agree``), one round per
step. Run under the launcher::

    python -m rhino.launch --hosts 2 --devices-per-host 1 benchmarks/step_agreement.py

Prints, per process, the median and 90th percentile of one round over 250 steps (after 50
warm-up rounds). Compare with the measured step of the pipelined example
(``python -m rhino.launch --hosts 2 --devices-per-host 4 examples/multicontroller_spmd.py
--stages 2``). Results: ``benchmarks/RESULTS.md``, "Issue 47".
"""

from __future__ import annotations

import time

import jax

import rhino
from rhino.jaxpr.private import distributed_kv_client

ROUNDS, WARM = 300, 50


def main() -> None:
    rhino.distributed_init()
    kv = distributed_kv_client()
    me, n = jax.process_index(), jax.process_count()
    times = []
    for step in range(1, ROUNDS + 1):
        t = time.perf_counter()
        kv.key_value_set(f"rhino-bench/outcome/{step}/{me}", "ok", allow_overwrite=True)
        for p in range(n):
            if p != me:
                kv.blocking_key_value_get(f"rhino-bench/outcome/{step}/{p}", 10_000)
        times.append(time.perf_counter() - t)
        if step > 2:
            kv.key_value_delete(f"rhino-bench/outcome/{step - 2}/{me}")
    times = sorted(times[WARM:])
    print(f"process {me} of {n}: one agreement round: median "
          f"{1e3 * times[len(times) // 2]:.3f} ms, p90 {1e3 * times[int(0.9 * len(times))]:.3f} "
          f"ms ({len(times)} rounds)", flush=True)


if __name__ == "__main__":
    main()
