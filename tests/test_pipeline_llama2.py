"""A Llama 2 written in plain JAX (layers stacked under ``lax.scan``, ``optax.MultiSteps``
accumulation, bfloat16 with interleaved rotary), pipelined on cluster 2x4 with 2 stages and
4 microbatches against one-device ``jax.jit`` (issue 43); the helpers are
``test_pipeline_exact``'s."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rhino
from test_pipeline_exact import PIPE, _close_in_bf16, _host


# ------------------------------------------------- a Llama 2 in plain JAX, layers scanned
LLAMA = dict(vocab=64, d=32, heads=4, layers=2, ffn=64, seq=8)


def _rms_norm(x, w, eps=1e-5):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def _rotary(x):
    """Rotary position embedding of ``x`` [batch, time, heads, head_dim], rotate-half
    form."""
    t, d = x.shape[1], x.shape[-1]
    inv = 1.0 / 10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def _llama_layer(h, lp):
    b, t, d = h.shape
    heads = LLAMA["heads"]
    x = _rms_norm(h, lp["attn_norm"])
    q = _rotary((x @ lp["wq"]).reshape(b, t, heads, d // heads))
    k = _rotary((x @ lp["wk"]).reshape(b, t, heads, d // heads))
    v = (x @ lp["wv"]).reshape(b, t, heads, d // heads)
    s = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / np.sqrt(d // heads)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)
    h = h + o.reshape(b, t, d) @ lp["wo"]
    x = _rms_norm(h, lp["ffn_norm"])
    return h + (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"], None


def _llama_init(key):
    v, d, n, f = LLAMA["vocab"], LLAMA["d"], LLAMA["layers"], LLAMA["ffn"]
    ks = jax.random.split(key, 9)

    def w(k, shape, fan):
        return jax.random.normal(k, shape) / np.sqrt(fan)
    return {"embed": w(ks[0], (v, d), 1.0),
            "layers": {"attn_norm": jnp.ones((n, d)), "ffn_norm": jnp.ones((n, d)),
                       "wq": w(ks[1], (n, d, d), d), "wk": w(ks[2], (n, d, d), d),
                       "wv": w(ks[3], (n, d, d), d), "wo": w(ks[4], (n, d, d), d),
                       "w_gate": w(ks[5], (n, d, f), d), "w_up": w(ks[6], (n, d, f), d),
                       "w_down": w(ks[7], (n, f, d), f)},
            "norm": jnp.ones((d,)), "lm_head": w(ks[8], (d, v), d)}


@pytest.mark.parametrize("mode", ["spmd", pytest.param("pipelined", marks=pytest.mark.slow)])
def test_plain_jax_llama2_with_scanned_layers_and_gradient_accumulation(mode):
    """A Llama 2 written in plain JAX (RMSNorm, rotary embeddings, causal attention,
    SwiGLU), its layers stacked and run by ``lax.scan``, trained with
    ``optax.MultiSteps(optax.adamw(...), every_k_schedule=2)``: 3 steps (two mini-steps,
    then an update) equal jax.jit, as one SPMD program on 8 devices and pipelined.
    MultiSteps reads the gradients in a ``lax.cond``; unrolled, the scan's stacked
    gradients entered the cond's branches as rhino's per-iteration pieces (before: in
    every mode, ``TypeError: Error interpreting argument to sub as a JAX value ...
    _Stack``)."""
    tx = optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), every_k_schedule=2)

    def loss_fn(params, tokens, labels):
        h = params["embed"][tokens]
        h, _ = jax.lax.scan(_llama_layer, h, params["layers"])
        logits = _rms_norm(h, params["norm"]) @ params["lm_head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(params, opt_state, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = _llama_init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, LLAMA["seq"]), 0, LLAMA["vocab"])
    labels = jnp.roll(tokens, -1, axis=1)
    options = dict(mesh_shape=(4,)) if mode == "spmd" else PIPE
    ref = jax.jit(step)
    s1, s2 = (params, tx.init(params)), _host((params, tx.init(params)))
    with rhino.auto_parallel(step, **options) as piped:
        for _ in range(3):
            *s1, l1 = ref(*s1, tokens, labels)
            *s2, l2 = piped(*s2, tokens, labels)
            np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
        assert int(s2[1].gradient_step) == 1 and int(s2[1].mini_step) == 1
        plan = piped.plan_for(*s2, tokens, labels)
        assert plan.num_stages == (1 if mode == "spmd" else 2)


def _rotary_interleaved(x):
    """Rotary embedding in the interleaved form (pairs of neighbouring features rotated,
    put back with ``jnp.stack``: on jax 0.10 its own ``stack`` primitive)."""
    t, d = x.shape[1], x.shape[-1]
    inv = 1.0 / 10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    a, b = x.astype(jnp.float32)[..., 0::2], x.astype(jnp.float32)[..., 1::2]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def test_plain_jax_llama2_in_bf16_with_interleaved_rotary_pipelines(monkeypatch):
    """The plain-JAX Llama 2 above with bfloat16 weights (its RMSNorm weights' gradients
    float32 sums cast to bfloat16) and interleaved rotary embeddings (``jnp.stack``):
    both were refused pipelined; within bfloat16 rounding of jax.jit."""
    monkeypatch.setattr(sys.modules[__name__], "_rotary", _rotary_interleaved)
    tx = optax.adamw(1e-2, weight_decay=0.1)

    def loss_fn(params, tokens, labels):
        h = params["embed"][tokens]
        h, _ = jax.lax.scan(_llama_layer, h, params["layers"])
        logits = (_rms_norm(h, params["norm"]) @ params["lm_head"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(params, opt_state, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _llama_init(jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (8, LLAMA["seq"]), 0, LLAMA["vocab"])
    _close_in_bf16(step, (params, tx.init(params)), (tokens, jnp.roll(tokens, -1, axis=1)),
                   lr=1e-2)
