"""Which arguments of a step are PRNG keys (``rhino.jaxpr.keys``): typed keys by their dtype,
raw ``uint32`` key data by how the step uses it, wherever it does; integer data that is no
key stays a batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from rhino.jaxpr.keys import key_arguments

RAW = jax.random.PRNGKey(0)
X = jnp.ones((4, 3))
TOKENS = jnp.arange(2, dtype=jnp.uint32)       # a batch of two uint32 token ids


def _keys(fn, *args):
    return sorted(key_arguments(jax.make_jaxpr(fn)(*args)))


def _dropout(key, x):
    return jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0)


@pytest.mark.parametrize("where", ["step", "jit", "checkpoint", "scan", "while", "cond",
                                   "vmap", "sliced", "fold_in", "threefry"])
def test_raw_key_data_is_a_key_wherever_the_step_uses_it(where):
    def step(key, x, tokens):
        if where == "step":
            y = _dropout(key, x)
        elif where == "jit":                         # a jitted helper (eqx.filter_jit)
            y = jax.jit(_dropout)(key, x)
        elif where == "checkpoint":
            y = jax.checkpoint(_dropout)(key, x)
        elif where == "scan":                        # split per iteration, in the carry
            def body(k, row):
                k, sub = jax.random.split(k)
                return k, _dropout(sub, row)
            y = jax.lax.scan(body, key, x)[1]
        elif where == "while":
            y = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (
                c[0] + 1, _dropout(jax.random.fold_in(c[2], c[0]), c[1]), c[2]),
                (0, x, key))[1]
        elif where == "cond":
            y = jax.lax.cond(x[0, 0] > 0, _dropout, lambda k, v: v, key, x)
        elif where == "vmap":                        # per-example keys
            keys = jnp.stack([key] * x.shape[0])
            y = jax.vmap(_dropout)(keys, x)
        elif where == "sliced":                      # one row of stacked key data
            y = _dropout(jnp.stack([key, key])[1], x)
        elif where == "fold_in":
            y = _dropout(jax.random.fold_in(key, tokens[0]), x)
        else:
            bits = jax.extend.random.threefry_2x32(key, jnp.arange(4, dtype=jnp.uint32))
            y = x * bits[0].astype(jnp.float32)
        return y.sum() + tokens.sum()

    assert _keys(step, RAW, X, TOKENS) == [0]


def test_typed_keys_and_key_data_inside_pytrees():
    def step(batch, state):
        y = _dropout(batch["rng"], batch["x"]) + _dropout(state["key"], batch["x"])
        return y.sum(), state["count"] + 1
    batch = {"rng": RAW, "x": X, "tokens": TOKENS}
    state = {"count": jnp.uint32(0), "key": jax.random.key(1)}
    # flat order: batch['rng'], batch['tokens'], batch['x'], state['count'], state['key']
    assert _keys(step, batch, state) == [0, 4]


def test_integer_data_that_is_no_key_stays_out():
    """A uint32 batch of two token ids (the shape of raw key data), a uint32 seed made into
    a key (``PRNGKey(seed)``: a new key, not the seed's words) and a counter folded into a
    key are no keys."""
    def step(tokens, seed, count, key, x):
        emb = jnp.take(x, tokens.astype(jnp.int32), axis=0)
        k = jax.random.fold_in(jax.random.PRNGKey(seed), count)
        return _dropout(k, emb).sum() + _dropout(key, x).sum()

    assert _keys(step, TOKENS, jnp.uint32(3), jnp.uint32(1), RAW, X) == [3]
