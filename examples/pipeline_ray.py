"""Train a small GPT with rhino on Ray (or locally) and check it against one device.

By default a 2-stage pipeline on a ``2x4`` cluster (2 hosts × 4 devices: one actor per
stage); ``--stages 1`` runs one SPMD program over the whole cluster, whose mesh spans both
hosts (2 actors × 4 devices in one ``jax.distributed`` job). Run on a Ray cluster (see
docs/ray.md)::

    ray start --head --node-ip-address 127.0.0.1 --port 6379
    ray job submit --address http://127.0.0.1:8265 --working-dir . \\
        -- python examples/pipeline_ray.py --steps 10 [--stages 1]

or directly (``--address auto`` joins the cluster started by ``ray start``; no ``--address``:
``$RAY_ADDRESS``, else a new local Ray cluster)::

    python examples/pipeline_ray.py --steps 5
    python examples/pipeline_ray.py --executor local

Prints per step ``step i: pipelined loss X  single-device loss Y`` and exits 1 if a loss
differs from the single-device ``jax.jit`` loss by more than 1e-4 (relative), or the final
parameters differ (rtol 1e-4, atol 5e-5).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEVICES = 8


def _set_xla_devices(n: int) -> None:
    """``n`` simulated host devices for this process (before jax is imported)."""
    flag = "--xla_force_host_platform_device_count"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{flag}={n}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--address", default=None,
                    help="Ray cluster: auto, host:port, ray://host:10001 (default: "
                         "$RAY_ADDRESS, else a new local cluster)")
    ap.add_argument("--executor", choices=("ray", "local"), default="ray")
    ap.add_argument("--cluster", default="2x4", help="HOSTSxDEVICES (default 2x4)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "eager-1f1b"))
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds any one wait may take")
    ap.add_argument("--num-cpus", type=int, default=None,
                    help="CPUs of a new local Ray cluster")
    a = ap.parse_args(argv)

    _set_xla_devices(DEVICES)  # the local executor and the one-device reference
    import jax
    import numpy as np

    import rhino
    from rhino.models import get_model

    if a.executor == "ray":
        from rhino.runtime.ray.executor import init

        info = init(a.address, num_cpus=a.num_cpus)
        print(f"ray: {info.address}, {info.nodes} node(s), {info.cpus:g} CPUs", flush=True)

    m = get_model("gpt", layers=4, hidden=64, heads=2, seq=16, vocab=256, batch=16)
    params, opt_state = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    step = rhino.auto_parallel(m.step, cluster=a.cluster, stages=a.stages,
                               num_microbatches=a.microbatches, schedule=a.schedule,
                               executor=a.executor, timeout=a.timeout)
    ref_step = jax.jit(m.step)
    plan = step.plan_for(params, opt_state, batch)
    for st in plan.stages:
        print(f"stage {st.index}: mesh {tuple(st.mesh.shape)} on host(s) "
              f"{','.join(map(str, st.hosts))}"
              + (f" ({len(st.hosts)} actors, one jax.distributed job)"
                 if a.executor == "ray" and len(st.hosts) > 1 else ""), flush=True)

    p1, o1, p2, o2 = params, opt_state, params, opt_state
    worst, times = 0.0, []
    try:
        for i in range(a.steps):
            t0 = time.perf_counter()
            p1, o1, loss = step(p1, o1, batch)
            loss = float(loss)
            times.append(time.perf_counter() - t0)
            p2, o2, ref = ref_step(p2, o2, batch)
            ref = float(ref)
            rel = abs(loss - ref) / max(abs(ref), 1e-12)
            worst = max(worst, rel)
            print(f"step {i}: rhino loss {loss:.6f}  single-device loss {ref:.6f}  "
                  f"({times[-1] * 1e3:.1f} ms)", flush=True)
        params_ok = True
        # On Ray the state stays on the actors; rhino.fetch brings it here.
        for x, y in zip(jax.tree_util.tree_leaves(rhino.fetch(p1)),
                        jax.tree_util.tree_leaves(p2)):
            if not np.allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=5e-5):
                params_ok = False
    finally:
        step.close()
    examples, tokens = rhino.batch_sizes(batch)
    print(f"{a.executor}: {a.cluster}, {a.stages} stages, {a.microbatches} microbatches, "
          f"{a.schedule}; first step {times[0]:.2f} s (compiles), then "
          + rhino.throughput_line(plan, times, examples, tokens), flush=True)
    if worst > 1e-4 or not params_ok:
        print(f"MISMATCH: worst relative loss difference {worst:.2e}, parameters "
              f"{'match' if params_ok else 'differ'}", file=sys.stderr, flush=True)
        return 1
    print(f"OK: {a.steps} steps match the single-device step (worst relative loss "
          f"difference {worst:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
