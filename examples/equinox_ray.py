"""An Equinox model whose class lives in this script (``__main__``), trained with dropout
keys as a 2-stage pipeline on Ray actors, checked against one-device ``jax.jit``.

The actors run the stage programs the driver exported (``rhino.runtime.executors.artifacts``): they
never unpickle this script's classes or functions, so ``Net`` (defined here, in
``__main__``) is never looked for on the actors. The per-example dropout keys are made on
one stage and read on the other: PRNG-key-typed values cross between the stages.

    python examples/equinox_ray.py [--steps 3] [--address auto]

Prints per step both losses, the number of key-typed values between the stages, and exits
1 if a loss differs from ``jax.jit``'s by more than 1e-4 (relative) or the trained
parameters differ (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEVICES = 4
_FLAG = "--xla_force_host_platform_device_count"
os.environ["XLA_FLAGS"] = " ".join(    # before jax is imported
    [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    + [f"{_FLAG}={DEVICES}"])

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import rhino  # noqa: E402


class Net(eqx.Module):
    """A model class of the training script itself (``__main__.Net``)."""

    layers: list
    drop: eqx.nn.Dropout

    def __init__(self, key):
        dims = [16, 64, 64, 64, 10]
        self.layers = [eqx.nn.Linear(i, o, key=k) for i, o, k in
                       zip(dims, dims[1:], jax.random.split(key, 4))]
        self.drop = eqx.nn.Dropout(0.2)

    def __call__(self, x, key):
        for layer in self.layers[:-1]:
            x = self.drop(jax.nn.relu(layer(x)), key=key)
        return self.layers[-1](x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--address", default=None,
                    help="Ray cluster (default: $RAY_ADDRESS, else a new local cluster)")
    ap.add_argument("--num-cpus", type=int, default=4)
    a = ap.parse_args(argv)
    params, static = eqx.partition(Net(jax.random.key(4)), eqx.is_array)
    tx = optax.adam(1e-3)

    def step(params, opt_state, x, y, ids, key):
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)   # one per example
        def loss_fn(p):
            model = eqx.combine(p, static)
            logits = jax.vmap(model)(x, keys)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return eqx.apply_updates(params, upd), opt_state, loss

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(32, 16)).astype(np.float32),
                rng.integers(0, 10, size=32).astype(np.int32),
                np.arange(32 * i, 32 * (i + 1), dtype=np.int32), jax.random.key(10 + i))
               for i in range(a.steps)]
    rhino.init(a.address, num_cpus=a.num_cpus)
    pipelined = rhino.auto_parallel(step, cluster="2x2", stages=2, num_microbatches=4,
                                    executor="ray", timeout=300.0)
    state = (params, tx.init(params))
    crossing = _keys_between_stages(pipelined.split_for(*state, *batches[0]))
    print(f"key-typed values between the stages: {crossing}")
    ref, mine, ok, times = state, state, True, []
    with pipelined:
        for i, b in enumerate(batches):
            *ref, ref_loss = jax.jit(step)(*ref, *b)
            t0 = time.perf_counter()
            *mine, loss = pipelined(*mine, *b)
            loss = float(loss)                          # ready
            times.append(time.perf_counter() - t0)
            good = np.allclose(loss, float(ref_loss), rtol=1e-4, atol=0)
            ok &= good
            print(f"step {i}: pipelined loss {float(loss):.6f}  single-device loss "
                  f"{float(ref_loss):.6f}" + ("" if good else "  MISMATCH"))
        for x, y in zip(jax.tree_util.tree_leaves(rhino.fetch(mine[0])),
                        jax.tree_util.tree_leaves(ref[0])):
            if not np.allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5):
                print("trained parameters differ from jax.jit's")
                ok = False
                break
        plan = pipelined.plan_for(*state, *batches[0])
    print("measured: " + rhino.throughput_line(plan, times, examples=len(batches[0][0])))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def _keys_between_stages(split) -> int:
    """How many PRNG-key-typed values one stage sends to another."""
    sent = {i.ref for (kind, stage), t in split.tasks.items() for i in t.inputs
            if i.source == "task" and i.producer[1] != stage}
    return sum(jax.dtypes.issubdtype(split.flat.avals[r].dtype, jax.dtypes.prng_key)
               for r in sent)


if __name__ == "__main__":
    sys.exit(main())
