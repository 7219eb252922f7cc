"""A multi-controller job: the same script on every host, one SPMD program over all devices
(or, with ``--stages 2``, a pipeline: each process runs the stage on its devices).

Every process joins the job (``rhino.distributed_init()``), plans the GPT step on every
device of the job (``rhino.auto_parallel``: each process plans alone, the plans' hashes are
compared before anything runs), trains it for a few Adam steps, and checks its own shards
of the results against one-device ``jax.jit`` of the same step. It prints ``OK`` and exits 0
when they match, and exits 1 otherwise.

On one machine (2 processes x 4 simulated CPU devices)::

    python -m rhino.launch --hosts 2 --devices-per-host 4 examples/multicontroller_spmd.py

A 2-stage pipeline, one stage per process, values between them through JAX's transfer
servers (``runtime.transfer.jax_transfer``)::

    python -m rhino.launch --hosts 2 --devices-per-host 4 examples/multicontroller_spmd.py \
        --stages 2

Add ``--no-cross-process-collectives`` to a pipeline on CPU: each stage's collectives stay
inside its process instead of going through gloo's sockets (faster stage programs; a plan
that is one program over both processes is then refused before it runs).

On SLURM (one task per node)::

    srun --nodes 2 --ntasks-per-node 1 python examples/multicontroller_spmd.py

Alone (``python examples/multicontroller_spmd.py``) it is a job of one process.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

import rhino
from rhino.models import get_model

RTOL, ATOL = 1e-4, 5e-5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--stages", type=int, default=1,
                    help="pipeline stages, one per process (default 1: one SPMD program)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "eager-1f1b",
                                                             "zb-h1", "interleaved-1f1b"),
                    help="the pipeline schedule, with --stages (default 1f1b)")
    ap.add_argument("--virtual-stages", type=int, default=1,
                    help="stages of the model per process (interleaved-1f1b; default 1)")
    ap.add_argument("--no-cross-process-collectives", action="store_true",
                    help="CPU: no gloo (a pipeline whose stages each sit on one process)")
    a = ap.parse_args(argv)

    # before anything else uses jax
    job = rhino.distributed_init(cross_process_collectives=not a.no_cross_process_collectives)
    me = job.process_id
    print(f"process {me} of {job.num_processes} ({job.how}): {jax.local_device_count()} "
          f"local devices, {jax.device_count()} in the job, CPU collectives "
          f"{jax.config.jax_cpu_collectives_implementation}", flush=True)

    model = get_model("gpt", layers=a.layers, hidden=a.hidden, heads=4, seq=32, vocab=256,
                      batch=8)
    # Host values, the same on every process (same seed): rhino places each process's
    # shards from its own copy.
    params, opt_state = jax.tree.map(np.asarray, model.init(jax.random.PRNGKey(0)))
    batch = jax.tree.map(np.asarray, model.make_batch(jax.random.PRNGKey(1)))

    if a.stages > 1:     # hosts x devices: each stage on one process's devices
        step = rhino.auto_parallel(
            model.step, cluster=f"{job.num_processes}x{jax.local_device_count()}",
            stages=a.stages, virtual_stages=a.virtual_stages,
            num_microbatches=a.microbatches, schedule=a.schedule)
    else:
        step = rhino.auto_parallel(model.step)  # the mesh spans every device of the job
    ref_step = jax.jit(model.step)             # one device of this process

    p, o = params, opt_state
    rp, ro = params, opt_state
    ok, times = True, []
    for k in range(a.steps):
        t0 = time.perf_counter()
        p, o, loss = step(p, o, batch)         # global arrays, fed back as they are
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
        rp, ro, ref_loss = ref_step(rp, ro, batch)
        same = np.allclose(float(loss), float(ref_loss), rtol=RTOL, atol=ATOL)
        print(f"process {me} step {k}: loss {float(loss):.6f} (jax.jit {float(ref_loss):.6f})"
              f"{'' if same else '  MISMATCH'}", flush=True)
        ok &= bool(same)
    plan = step.plan_for(p, o, batch)
    where = (f"mesh {tuple(plan.spmd.mesh.shape)}" if plan.num_stages == 1 else
             f"{plan.num_stages} stages on meshes "
             f"{[tuple(st.mesh.shape) for st in plan.stages]}")
    print(f"process {me}: plan {plan.kind} on {where}", flush=True)
    examples, tokens = rhino.batch_sizes(batch)
    print(f"process {me}: measured " + rhino.throughput_line(plan, times, examples, tokens),
          flush=True)

    # Each process checks the shards it holds against the same slices of jax.jit's result.
    checked = 0
    for got, want in zip(jax.tree.leaves((p, o)), jax.tree.leaves((rp, ro))):
        want = np.asarray(want)
        for shard in got.addressable_shards:
            if not np.allclose(np.asarray(shard.data), want[shard.index], rtol=RTOL,
                               atol=ATOL):
                print(f"process {me}: MISMATCH in a shard {shard.index} of shape "
                      f"{want.shape}", flush=True)
                ok = False
            checked += 1
    if not ok:
        print(f"process {me}: FAILED: results differ from jax.jit", flush=True)
        return 1
    print(f"process {me}: OK: {a.steps} steps match jax.jit ({checked} shards checked)",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
