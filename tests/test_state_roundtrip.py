"""A nanoGPT-style training step's results passed back as its next state take the plan
made for the first call (issue 30): no second plan, no second set of stage programs, on
the local executor and on Ray, and the run equals ``jax.jit``.

The step is written as such scripts are: a GPT in plain JAX, optax AdamW under
``inject_hyperparams`` with a warm-up cosine schedule (its int32 counts in the optimizer
state), a Python-int step counter and a Python-float scale in the state (weakly typed), a
per-layer array of typed PRNG keys in the state (kept on the actors: a key dtype), and a
dict batch of int32 tokens. Before: a handle of the key array could not be made
(``data type 'key<fry>' not understood``), and a result's dtype or weak type came from
what crossed the host, not from the step.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rhino
from rhino.step_arguments import signature

V, D, HEADS, L, T, B = 64, 32, 2, 2, 8, 8

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 50, 1e-3)
TX = optax.chain(optax.clip_by_global_norm(1.0),
                 optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE,
                                                       weight_decay=0.1))


def _params(key):
    ks = iter(jax.random.split(key, 2 + 4 * L))

    def n(k, shape):
        return jax.random.normal(k, shape) * 0.02

    return {"wte": n(next(ks), (V, D)), "wpe": n(next(ks), (T, D)), "lnf": jnp.ones(D),
            "blocks": [{"ln1": jnp.ones(D), "qkv": n(next(ks), (D, 3 * D)),
                        "proj": n(next(ks), (D, D)), "ln2": jnp.ones(D),
                        "fc": n(next(ks), (D, 4 * D)), "fc2": n(next(ks), (4 * D, D))}
                       for _ in range(L)]}


def _ln(x, g):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g


def _logits(p, idx):
    b, t = idx.shape
    x = p["wte"][idx] + p["wpe"][:t]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for blk in p["blocks"]:
        q, k, v = jnp.split(_ln(x, blk["ln1"]) @ blk["qkv"], 3, axis=-1)
        q, k, v = (z.reshape(b, t, HEADS, D // HEADS).transpose(0, 2, 1, 3)
                   for z in (q, k, v))
        a = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(D // HEADS), -1e9)
        y = (jax.nn.softmax(a, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, D)
        x = x + y @ blk["proj"]
        x = x + jax.nn.gelu(_ln(x, blk["ln2"]) @ blk["fc"]) @ blk["fc2"]
    return _ln(x, p["lnf"]) @ p["wte"].T


def nanogpt_step(state, batch):
    """``(params, opt_state, it, scale, keys), batch -> state, metrics``."""
    params, opt_state, it, scale, keys = state

    def loss_fn(p):
        return optax.softmax_cross_entropy_with_integer_labels(
            _logits(p, batch["x"]), batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # Per-layer keys: a little noise on each block's output projection (batch-independent).
    keys, subs = jax.vmap(lambda k: tuple(jax.random.split(k)))(keys)
    params["blocks"] = [dict(blk, proj=blk["proj"] + 1e-4 * jax.random.normal(
        subs[i], blk["proj"].shape)) for i, blk in enumerate(params["blocks"])]
    metrics = {"loss": loss * scale, "lr": opt_state[1].hyperparams["learning_rate"],
               "it": it}
    return (params, opt_state, it + 1, scale * 1.0, keys), metrics


def initial_state():
    params = _params(jax.random.PRNGKey(0))
    return (params, TX.init(params), 0, 1.0, jax.random.split(jax.random.key(3), L))


def batches(n, b=B):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        x = rng.integers(0, V, (b, T), dtype=np.int32)
        out.append({"x": x, "y": np.roll(x, -1, axis=1)})
    return out


def _close(a, b):
    a, b = rhino.fetch(a), rhino.fetch(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jax.dtypes.issubdtype(jnp.result_type(y), jax.dtypes.prng_key):
            np.testing.assert_array_equal(np.asarray(jax.random.key_data(x)),
                                          np.asarray(jax.random.key_data(y)))
        else:
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("executor", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_returned_state_takes_the_first_plan(executor, request, tmp_path):
    if executor == "ray":
        ray = pytest.importorskip("ray")
        request.getfixturevalue("ray_cluster")
        # The actors unpickle the step: this module's functions travel by value.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    data = batches(3)
    ref = jax.jit(nanogpt_step)
    want = initial_state()
    step = rhino.auto_parallel(nanogpt_step, cluster="2x4", stages=2, num_microbatches=2,
                               executor=executor, timeout=120.0)
    try:
        state = initial_state()
        first = signature(nanogpt_step, (state, data[0]))
        for i, batch in enumerate(data):
            state, metrics = step(state, batch)
            want, wanted = ref(want, batch)
            # What came back has the signature jax.jit's results have, which is the
            # first call's: passed back, it plans nothing.
            assert signature(nanogpt_step, (state, batch)) == \
                signature(nanogpt_step, (want, batch)) == first
            assert step.plans_built == 1, f"call {i}: planned again"
            _close(metrics, wanted)
        _close(state, want)
        if executor == "ray":
            leaves = jax.tree.leaves(state)
            assert any(isinstance(x, rhino.RemoteArray) and
                       jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in leaves)
            # A key handle in a checkpoint is refused as a local key array is.
            with pytest.raises(rhino.CheckpointError, match="found PRNG keys"):
                rhino.save_checkpoint(str(tmp_path / "ckpt"), state)
            ex = step._last.run.executor
            # The state stays on the actors: only the batch and another stage's values move.
            assert ex.last_kept > 0
            assert ex.last_sent_bytes < 2 * sum(x.nbytes for x in jax.tree.leaves(data[0]))
        # A genuinely different signature (another batch size) is planned anew.
        state, _ = step(state, batches(1, 2 * B)[0])
        assert step.plans_built == 2
    finally:
        step.close()


def test_a_part_of_some_processes_is_each_process_shards(tmp_path):
    """A stage over some processes of a Ray job writes its checkpoint part as each process's
    shards (``checkpoint._write_shards``: orbax would write the arrays' metadata on the
    job's process 0 only): every element once, from replica 0's shards, read back whole;
    a process's file missing is named by the array it leaves short."""
    import json

    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from rhino.runtime.state import checkpoint as ck
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    values = {"x": jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4),
                                  NamedSharding(mesh, P("a"))),     # replicated over b
              "y": jax.device_put(jnp.arange(6, dtype=jnp.bfloat16).reshape(1, 6),
                                  NamedSharding(mesh, P(None, "b"))),
              "n": np.int32(7)}
    (tmp_path / "other").mkdir()
    ck._write_shards(str(tmp_path / "other"), values, first=1)   # not this process's
    with np.load(tmp_path / "other" / "shards-p0.npz") as data:
        assert "n.0" not in data.files and "x.0" in data.files
    ck._write_shards(str(tmp_path), values)
    files = [str(f) for f in sorted(tmp_path.glob("shards-p*.npz"))]
    assert len(files) == 1      # this process's
    abstract = {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype) for k, v in values.items()}
    got = ck._read_shards(files, abstract)
    for k, v in values.items():
        assert got[k].dtype == v.dtype
        np.testing.assert_array_equal(got[k], np.asarray(v))
    with np.load(files[0]) as data:
        kept = {k: data[k] for k in data.files}
    index = json.loads(kept["__index__"].tobytes())
    assert len(index["x"]) == 2     # 4 shards, 2 of replica 0
    index["x"] = index["x"][:1]
    kept["__index__"] = np.frombuffer(json.dumps(index).encode(), np.uint8)
    np.savez(files[0], **kept)
    with pytest.raises(ck.CheckpointError, match=r"x: expected its 32 elements .*found 16"):
        ck._read_shards(files, abstract)
