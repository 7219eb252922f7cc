"""The Llama zoo model (issue 31): the published shapes, bf16 weights with float32 AdamW
moments, grouped-query attention through ``jax.nn.dot_product_attention`` (or the fused
call with cuDNN's sharding rule, which gives the same values), scan and remat."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino
from rhino.models import LLAMA_CONFIGS, get_model, parse_model_spec


def test_presets_have_the_published_shapes():
    m8 = get_model("llama", preset="Llama-3-8B")
    params, opt, _ = m8.example_args()
    n = sum(x.size for x in jax.tree.leaves(params))
    assert 8.0e9 < n < 8.1e9                                     # 8.03B parameters
    layer = params["layers"][0]
    assert layer["wq"].shape == (4096, 4096) and layer["wk"].shape == (4096, 1024)
    assert layer["w_gate"].shape == (4096, 14336) and params["lm_head"].shape == (4096, 128256)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((opt.mu, opt.nu)))
    c70 = get_model("llama", preset="Llama-3-70B").config
    assert (c70.layers, c70.hidden, c70.ffn, c70.heads, c70.kv_heads) == (80, 8192, 28672, 64, 8)
    assert set(LLAMA_CONFIGS) == {"Llama-3-8B", "Llama-3-70B"}
    assert parse_model_spec("llama:preset=Llama-3-8B,layers=2").config.layers == 2
    with pytest.raises(ValueError, match="kv_heads"):
        get_model("llama", heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="attention"):
        get_model("llama", attention="flash")


def _losses(model, steps=3):
    params, opt = model.init(jax.random.key(0))
    batch = model.make_batch(jax.random.key(1))
    step = jax.jit(model.step)
    out = []
    for _ in range(steps):
        params, opt, loss = step(params, opt, batch)
        out.append(float(loss))
    return out, params


def test_fused_scan_and_remat_give_the_same_training():
    """The fused call, a scan over layers and remat compute what the plain layers do."""
    base, p0 = _losses(get_model("llama", dtype="float32"))
    for kw in (dict(attention="fused"), dict(scan=True), dict(remat=True)):
        got, p1 = _losses(get_model("llama", dtype="float32", **kw))
        np.testing.assert_allclose(got, base, rtol=2e-5)
    assert base[-1] < base[0]
    bf16, _ = _losses(get_model("llama"))                       # bf16 weights train too
    assert bf16[-1] < bf16[0] and abs(bf16[0] - base[0]) < 0.05


def test_fused_attention_is_one_call_split_over_kv_heads():
    """Two kv heads, four query heads, batch 2: on (2, 2) each call's batch and kv heads
    are split (the query's heads in blocks of two with them)."""
    m = get_model("llama", batch=2, heads=4, kv_heads=2, attention="fused", layers=1)
    g = rhino.ingest(m.step, *m.example_args())
    calls = [op for op in g.ops if op.opcode == "custom-call"]
    assert len(calls) == 2 and all(op.flops > 0 for op in calls)
    plan = rhino.plan(g, mesh_shape=(2, 2), opt_level="O3").spmd
    for o in plan.ops:
        if o.opcode == "custom-call":
            q = o.in_specs[0]                                   # [B, T, N, D]
            assert q.dims[1].axes == () and q.dims[3].axes == ()
            assert len(q.dims[0].axes + q.dims[2].axes) == 2, o
    assert not [u for u in plan.unplanned if u.opcode == "custom-call"]


def test_rope_is_the_rotate_half_form():
    from rhino.models.llama import rope
    x = jax.random.normal(jax.random.key(0), (2, 16, 4, 32))
    ang = jnp.arange(16.0)[:, None] * 1e4 ** (-jnp.arange(0, 16) * 2 / 32)[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = jnp.split(x, 2, -1)
    want = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    np.testing.assert_allclose(np.asarray(rope(x, 1e4)), np.asarray(want), rtol=1e-6, atol=1e-6)


def _accumulated_step(model, m):
    """Gradient accumulation (issue 43's reference): each of ``m`` microbatches' loss and
    gradients under ``jax.jit``, averaged in float32, cast to the parameters' dtypes, then
    the model's own update."""
    import optax

    tx = model.optimizer()

    def step(params, opt_state, batch):
        n = jax.tree.leaves(batch)[0].shape[0] // m
        parts = [jax.value_and_grad(model.loss)(
            params, jax.tree.map(lambda a: a[j * n:(j + 1) * n], batch)) for j in range(m)]
        loss = sum(l for l, _ in parts) / m
        grads = jax.tree.map(lambda *g: sum(x.astype(jnp.float32) for x in g) / m,
                             *[g for _, g in parts])
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return jax.jit(step)


def _worst(a, b):
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("attention", [
    "fused", pytest.param("xla", marks=pytest.mark.slow)])
@pytest.mark.extended
def test_bf16_llama_pipelined_for_20_adamw_steps_tracks_gradient_accumulation(attention):
    """Issue 43, acceptance 4: the zoo Llama with its defaults (bfloat16 weights, float32
    AdamW moments) pipelined on 2x4 (2 stages, 4 microbatches) for 20 steps against
    gradient accumulation under ``jax.jit``.

    The tolerance is the one two correct bfloat16 computations of the same step already
    show: ``jax.jit`` on the whole batch against gradient accumulation (each rounds its
    sums and its updates differently, and AdamW turns a rounding of a near-zero gradient
    into a step of up to the learning rate). The pipeline, which sums the microbatches'
    gradients in float32 as the reference does, may be off the reference by 4 times that
    (worst over the steps so far) plus one bfloat16 unit of the largest weight; a wrong
    gradient or a wrong microbatch shows at once in the loss (checked to 5e-4 relative,
    against whole-batch jit's 2e-4 here)."""
    model = get_model("llama", layers=2, hidden=64, ffn=128, heads=4, kv_heads=2,
                      vocab=256, seq=16, batch=8, attention=attention)
    params, opt = model.init(jax.random.key(0))
    reference, whole = _accumulated_step(model, 4), jax.jit(model.step)
    pipelined = rhino.auto_parallel(model.step, cluster="2x4", stages=2, num_microbatches=4)
    ulp = float(jnp.finfo(jnp.bfloat16).eps) * max(float(jnp.max(jnp.abs(x.astype(
        jnp.float32)))) for x in jax.tree.leaves(params))
    s_ref = s_whole = s_pipe = (params, opt)
    noise = 0.0
    for k in range(20):
        batch = model.make_batch(jax.random.key(100 + k))
        *s_ref, l_ref = reference(*s_ref, batch)
        *s_whole, l_whole = whole(*s_whole, batch)
        *s_pipe, l_pipe = pipelined(*s_pipe, batch)
        assert abs(float(l_pipe) - float(l_ref)) <= 5e-4 * abs(float(l_ref)), k
        noise = max(noise, _worst(s_whole[0], s_ref[0]))
        assert _worst(s_pipe[0], s_ref[0]) <= 4 * noise + ulp, (k, noise)
    assert float(l_ref) < 6.2
