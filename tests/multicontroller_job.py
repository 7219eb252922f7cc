"""A small multi-controller job for ``tests/test_launch.py``, run under ``python -m
rhino.launch``: an MLP step under ``rhino.auto_parallel`` for a few steps, each checked
against one-device ``jax.jit``.

Options make it misbehave on purpose: ``--pin-on P`` (process P pins a weight's layout, so
its plan differs from the others'), ``--fail-on P`` (process P exits with ``--exit-code``
right after joining; the others wait), ``--raise-on P`` (process P raises instead),
``--global-batch`` (each process passes only its own rows, through ``rhino.global_batch``);
``--cluster``, ``--stages``: ``auto_parallel``'s options; ``--effects PATH``: the step holds
a ``jax.debug.callback`` and an ordered ``io_callback``, which append ``TAG pPROCESS VALUE``
lines to PATH (the one-device ``jax.jit`` reference's tags start with ``ref-``).
``--fail-call K``: a pipelined step whose host callback raises on call K, the calls
after it made anyway (``failed_call``). ``--checkpoints DIR [--die-at K]``: a checkpoint
after every step, resuming from DIR's latest; process 1 dies at step K (``resumable``). ``--arg-kinds numpy,local,global`` runs the step once per kind of argument users have, each
with a new ``auto_parallel``: numpy arrays, process-local jax arrays (on the process's first
device, as ``model.init`` returns them) and global ``jax.Array``s (replicated over every
device of the job), or ``split`` (global arrays whose rows are split over every device of
the job). ``--frozen`` runs another step instead (``handmade.frozen_front_step``: frozen first layers, so a stage may have no
backward or apply task; results of several stages combined).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import rhino


def train_step(params, x, y):
    def loss_fn(p):
        h = jax.nn.relu(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss


def effect_step(path: str, prefix: str):
    """``train_step`` with host callbacks appending to ``path``."""
    from jax.experimental import io_callback

    def write(tag):
        def f(v):
            with open(path, "a") as out:
                out.write(f"{prefix}{tag} p{jax.process_index()} {float(np.sum(v)):.6f}\n")
        return f

    def step(params, x, y):
        def loss_fn(p):
            h = jax.nn.relu(x @ p["w1"])
            jax.debug.callback(write("sum"), jnp.sum(h))
            return jnp.mean((h @ p["w2"] - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        io_callback(write("loss"), None, loss, ordered=True)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss
    return step


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--pin-on", type=int, default=None)
    ap.add_argument("--fail-on", type=int, default=None)
    ap.add_argument("--raise-on", type=int, default=None)
    ap.add_argument("--exit-code", type=int, default=3)
    ap.add_argument("--global-batch", action="store_true")
    ap.add_argument("--cluster", default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--effects", default=None)
    ap.add_argument("--frozen", action="store_true")
    ap.add_argument("--arg-kinds", default=None)
    ap.add_argument("--fail-call", type=int, default=None)
    ap.add_argument("--stall-s", type=float, default=None)
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument("--die-at", type=int, default=None)
    a = ap.parse_args()

    job = rhino.distributed_init()
    assert rhino.distributed_init() == dataclass_again(job), "distributed_init is idempotent"
    me, n = job.process_id, job.num_processes
    print(f"joined: process {me} of {n} ({job.how})", flush=True)
    if a.fail_on is not None:
        if me == a.fail_on:
            print(f"process {me}: failing on purpose", flush=True)
            return a.exit_code
        time.sleep(120)
        print(f"process {me}: not stopped", flush=True)
        return 0
    if a.raise_on == me:
        raise RuntimeError(f"process {me}: raising on purpose")
    if a.frozen:
        return frozen(me, f"{n}x{jax.local_device_count()}", a.stages)
    if a.arg_kinds:
        return arg_kinds(me, a.arg_kinds.split(","), a.cluster, a.stages)
    if a.fail_call is not None:
        return failed_call(me, a.fail_call, a.cluster, a.stages, a.stall_s)
    if a.checkpoints:
        return resumable(me, a.checkpoints, a.die_at, a.cluster, a.stages, a.steps)

    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(64, 256)).astype(np.float32) * 0.05,
              "w2": rng.normal(size=(256, 16)).astype(np.float32) * 0.05}
    x = rng.normal(size=(128, 64)).astype(np.float32)
    y = rng.normal(size=(128, 16)).astype(np.float32)
    pins = {"params['w1']": "R·R"} if a.pin_on == me else {}
    fn, ref_fn = train_step, train_step
    if a.effects:
        fn, ref_fn = effect_step(a.effects, ""), effect_step(a.effects, "ref-")
    step = rhino.auto_parallel(fn, annotations=pins, cluster=a.cluster, stages=a.stages)
    if a.global_batch:        # each process only has its own rows
        rows = len(x) // n
        mine = slice(me * rows, (me + 1) * rows)
        xb, yb = rhino.global_batch((x[mine], y[mine]))
    else:
        xb, yb = x, y
    p, ref = params, params
    ref_step = jax.jit(ref_fn)
    for k in range(a.steps):
        p, loss = step(p, xb, yb)
        if k == 0:        # global arrays in the plan's layout, passed back as they are
            leaves = jax.tree.leaves(p)
            print(f"process {me}: results global: "
                  f"{all(not x.is_fully_addressable for x in leaves)}, loss shape "
                  f"{loss.shape} replicated: {loss.is_fully_replicated}", flush=True)
        ref, ref_loss = ref_step(ref, x, y)
        print(f"process {me}: step {k} ran: loss {float(loss):.6f} (jax.jit "
              f"{float(ref_loss):.6f})", flush=True)
        if not np.allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-6):
            print(f"process {me}: MISMATCH", flush=True)
            return 1
    return shards_match(me, p, ref)


def shards_match(me: int, got_tree, want_tree) -> int:
    """0 (and OK) when this process's shards of ``got_tree`` equal ``want_tree``'s."""
    for got, want in zip(jax.tree.leaves(got_tree), jax.tree.leaves(want_tree)):
        for shard in got.addressable_shards:
            if not np.allclose(np.asarray(shard.data), np.asarray(want)[shard.index],
                               rtol=1e-5, atol=1e-6):
                print(f"process {me}: MISMATCH in a shard", flush=True)
                return 1
    print(f"process {me}: OK", flush=True)
    return 0


def frozen(me: int, cluster: str, stages: int) -> int:
    """``handmade.frozen_front_step`` pipelined over the job, 3 steps beside jax.jit: the
    loss divided by the count (results of different stages, here or received) and each
    process's own shards of the weights."""
    from handmade import frozen_front_step

    fn, (params, layers, x, y), opts = frozen_front_step()
    step = rhino.auto_parallel(fn, cluster=cluster, stages=stages, num_microbatches=4,
                               **opts)
    ref_step = jax.jit(fn)
    host = jax.tree.map(np.asarray, (params, layers, x, y))
    p, ref = host[0], params
    for k in range(3):
        p, loss, count = step(p, *host[1:])
        ref, ref_loss, ref_count = ref_step(ref, layers, x, y)
        got, want = float(loss / count), float(ref_loss / ref_count)
        print(f"process {me}: step {k} ran: loss / count {got:.6g} (jax.jit {want:.6g})",
              flush=True)
        if not np.isclose(got, want, rtol=1e-5) or int(count) != int(ref_count):
            print(f"process {me}: MISMATCH", flush=True)
            return 1
    split = step.split_for(p, *host[1:])
    print(f"process {me}: empty tasks "
          f"{sorted(f'{k}{s}' for (k, s), t in split.tasks.items() if t.empty)}", flush=True)
    return shards_match(me, p, ref)


def arg_kinds(me: int, kinds: list[str], cluster: str | None, stages: int | None) -> int:
    """The MLP step fed each kind of argument (``--arg-kinds``), 2 steps each beside
    jax.jit; every process checks the loss and its own shards."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rng = np.random.default_rng(0)
    host = ({"w1": rng.normal(size=(64, 256)).astype(np.float32) * 0.05,
             "w2": rng.normal(size=(256, 16)).astype(np.float32) * 0.05},
            rng.normal(size=(128, 64)).astype(np.float32),
            rng.normal(size=(128, 16)).astype(np.float32))
    mesh = Mesh(np.array(jax.devices()), ("all",))
    everywhere = NamedSharding(mesh, PartitionSpec())
    rows = NamedSharding(mesh, PartitionSpec("all"))
    make = {"numpy": lambda x: x,
            "local": jnp.asarray,      # this process's default device
            # committed to this process's first device (as a checkpoint restores)
            "committed": lambda x: jax.device_put(x, jax.local_devices()[0]),
            "global": lambda x: jax.make_array_from_callback(x.shape, everywhere,
                                                             lambda i: x[i]),
            # rows split over every device of the job: no process holds the whole value
            "split": lambda x: jax.make_array_from_callback(x.shape, rows, lambda i: x[i])}
    for kind in kinds:
        args = jax.tree.map(make[kind], host)
        step = rhino.auto_parallel(train_step, cluster=cluster, stages=stages)
        p, ref = args[0], host[0]
        for k in range(2):
            try:
                p, loss = step(p, *args[1:])
            except rhino.RhinoError as e:
                print(f"process {me}: {kind} arguments: refused: {e}", flush=True)
                return 2
            ref, ref_loss = jax.jit(train_step)(ref, *host[1:])
            if not np.allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-6):
                print(f"process {me}: {kind}: MISMATCH ({float(loss)} vs {float(ref_loss)})",
                      flush=True)
                return 1
        if shards_match(me, p, ref):
            return 1
        print(f"process {me}: {kind} arguments: OK", flush=True)
    return 0


def failed_call(me: int, bad: int, cluster: str | None, stages: int | None,
                stall_s: float | None = None) -> int:
    """Calls of a pipelined MLP step whose host callback (run by stage 0's process) raises
    on call ``bad`` (or sleeps ``stall_s`` seconds, past the step's timeout: a stall): each
    call's outcome printed, each failed call's arguments passed to the next; the final
    state checked against jax.jit over the calls that ran."""
    calls = [0]

    def gate(v):
        if calls[0] == bad and stall_s:
            time.sleep(stall_s)
        elif calls[0] == bad:
            raise RuntimeError("the data check failed")

    def fn(params, x, y):
        new, loss = train_step(params, x, y)
        jax.debug.callback(gate, loss)
        return new, loss

    rng = np.random.default_rng(0)
    p = {"w1": rng.normal(size=(64, 256)).astype(np.float32) * 0.05,
         "w2": rng.normal(size=(256, 16)).astype(np.float32) * 0.05}
    x = rng.normal(size=(128, 64)).astype(np.float32)
    y = rng.normal(size=(128, 16)).astype(np.float32)
    step = rhino.auto_parallel(fn, cluster=cluster, stages=stages,
                               timeout=3 if stall_s else 10)
    ref, ref_step = p, jax.jit(train_step)
    for k in range(bad + 4):
        calls[0] = k
        try:
            p, loss = step(p, x, y)
        except rhino.RhinoError as e:
            print(f"process {me}: call {k}: failed: {e}", flush=True)
            continue
        ref, ref_loss = ref_step(ref, x, y)
        print(f"process {me}: call {k}: ran: loss {float(loss):.6f} (jax.jit "
              f"{float(ref_loss):.6f})", flush=True)
    return shards_match(me, p, ref)


def resumable(me: int, directory: str, die_at: int | None, cluster: str | None,
              stages: int | None, steps: int) -> int:
    """``steps`` steps of the pipelined MLP step with a checkpoint after each
    (``rhino.CheckpointManager``, every process saving its shards), starting from the
    latest checkpoint in ``directory`` if there is one; process 1 dies (``os._exit``) at
    step ``die_at`` of a run that did not resume. The final state is checked against
    jax.jit over all ``steps`` steps."""
    import os

    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(64, 256)).astype(np.float32) * 0.05,
              "w2": rng.normal(size=(256, 16)).astype(np.float32) * 0.05}
    x = rng.normal(size=(128, 64)).astype(np.float32)
    y = rng.normal(size=(128, 16)).astype(np.float32)
    step = rhino.auto_parallel(train_step, cluster=cluster, stages=stages, timeout=30)
    with rhino.CheckpointManager(directory, max_to_keep=2) as mgr:
        start = mgr.latest_step() or 0
        p = mgr.restore(like=params) if start else params
        if start:
            print(f"process {me}: resumed from step {start} (steps kept: "
                  f"{mgr.all_steps()})", flush=True)
        for k in range(start, steps):
            if k == die_at and me == 1 and not start:
                print(f"process {me}: dying at step {k}", flush=True)
                os._exit(9)
            p, loss = step(p, x, y)
            mgr.save(k + 1, p)
            print(f"process {me}: step {k} ran: loss {float(loss):.6f}", flush=True)
    ref, ref_step = params, jax.jit(train_step)
    for _ in range(steps):
        ref, _ = ref_step(ref, x, y)
    return shards_match(me, p, ref)


def dataclass_again(job):
    import dataclasses
    return dataclasses.replace(job, how="already joined")


if __name__ == "__main__":
    sys.exit(main())
