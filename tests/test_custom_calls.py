"""Custom calls planned through their sharding rules (issue 31, acceptance 1): a
``custom_partitioning`` attention declaring a Shardy rule (``rhino.models.attention``), run
on 8 CPU devices split over heads and equal to ``jax.jit``; a GPU-style HLO dump with cuDNN fused-attention calls,
planned from the file with the calls split; a custom call without a rule kept whole and
listed with its source line."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino
from rhino.models.attention import fused_attention
from rhino.hlo_passes.custom_calls import parse_sdy_rule, rule_for
from rhino.hlo_passes.graph import TensorType as T
from rhino.planner.custom_calls import check_custom, rule_loops
from rhino.planner.strategies import Strategy
from rhino.planner.spec import ShardingSpec

DATA = pathlib.Path(__file__).parent / "data"
GPU_HLO = DATA / "gpu_cudnn_attention.hlo"


# ------------------------------------------------------------------ rules
def test_sdy_rule_text_and_loops():
    r = parse_sdy_rule("#sdy.op_sharding_rule<([i, jk], [k, l], [])->([i, l]) "
                       "{i=4, j=2, k=8, l=6} reduction={k} need_replication={l}, custom>")
    assert r.operands == ((("i",), ("j", "k")), (("k",), ("l",)), ())
    assert r.results == ((("i",), ("l",)),)
    # j is a dim's major factor but in no result and no reduction; k is not major on the
    # first operand (a minor factor needs a stride) but is on the second; l is whole.
    assert r.splittable() == ("i", "k")
    loops = rule_loops(r, (True,))
    assert [(lp.name, lp.outs, lp.ins) for lp in loops] == [("i", (0,), (0, None, None)),
                                                          ("k", ("sum",), (None, 0, None))]
    assert rule_loops(r, (False,))[1:] == []            # an integer result cannot pend
    with pytest.raises(ValueError, match="expected '#sdy.op_sharding_rule"):
        parse_sdy_rule("#sdy.sharding<@mesh, [{}]>")
    with pytest.raises(ValueError, match="size for every factor"):
        parse_sdy_rule("#sdy.op_sharding_rule<([i])->([i]) {}, custom>")


def test_cudnn_rule_grouped_query_heads_split_in_blocks():
    """GQA: 8 query heads over 2 key/value heads; the heads factor is the kv heads, the
    query's head dim splits with it in blocks; sequences and head dims stay whole."""
    q, kv = T("bf16", (4, 256, 8, 64)), T("bf16", (4, 256, 2, 64))
    out, stats, ws = T("bf16", (4, 8, 256, 64)), T("f32", (4, 8, 256)), T("u8", (0,))
    r = rule_for({"custom_call_target": "__cudnn$fmhaSoftmax"}, [q, kv, kv], (out, stats, ws))
    assert r.splittable() == ("b", "m") and r.sizes["m"] == 2 and r.sizes["r"] == 4
    loops = {lp.name: lp for lp in rule_loops(r, (True, True, False))}
    assert loops["m"].ins == (2, 2, 2) and loops["m"].outs == (1, 1, None)
    assert loops["b"].ins == (0, 0, 0) and loops["b"].outs == (0, 0, None)
    with pytest.raises(ValueError, match="dimensions in the rule"):
        rule_for({"frontend_attributes": '{xla.sdy.sharding_rule="#sdy.op_sharding_rule<'
                  '([i])->([i]) {i=4}, custom>"}'}, [T("f32", (4, 4))], T("f32", (4,)))


# ------------------------------------------------------------------ custom_partitioning
B, S, H, D = 2, 32, 8, 16
E = H * D


def _step():
    """A self-attention layer whose attention is ``fused_attention``: a custom_partitioning
    kernel pair declaring a Shardy rule (batch and heads split; sequences and the head dim
    need replication)."""
    def step(params, x):
        def loss(p):
            qkv = (x @ p["wqkv"]).reshape(B, S, 3, H, D)
            o = fused_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(B, S, E)
            return jnp.mean((o @ p["wo"]) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda w, d: w - 0.1 * d, params, grads), value

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"wqkv": jax.random.normal(k1, (E, 3 * E)) * E ** -0.5,
              "wo": jax.random.normal(k2, (E, E)) * E ** -0.5}
    return step, params, jax.random.normal(k3, (B, S, E))


def test_custom_partitioning_attention_is_split_over_heads_and_equals_jit():
    """Batch 2 cannot go over 8 devices: the rule's heads factor is the kernel's split.
    The compiled program runs each device's attention on one head (the XLA attention's
    [kv heads, B, group, T, S] scores are [1, 2, 1, 32, 32] per device), and the step
    equals jax.jit. The calls cost their bodies' FLOPs."""
    step, params, x = _step()
    g = rhino.ingest(step, params, x)
    calls = [op for op in g.ops if op.opcode == "custom-call"]
    q = jax.ShapeDtypeStruct((B, S, H, D), jnp.float32)
    body = rhino.ingest(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True), q, q, q)
    assert len(calls) == 2 and calls[0].flops == body.total_flops
    ap = rhino.auto_parallel(step, mesh_shape=(8,))
    plan = ap.plan_for(params, x).spmd
    ops = {o.name: o for o in plan.ops}
    for op in calls:
        o = ops[op.name]
        assert o.strategy.endswith("@x]") and all(       # [B, T, N, D]: N split
            s.dims[2].axes == (0,) and not any(d.axes for i, d in enumerate(s.dims) if i != 2)
            for s in o.in_specs), o
    assert not plan.unplanned
    ref_p, ref_l = jax.jit(step)(params, x)
    got_p, got_l = ap(jax.tree.map(np.array, params), np.array(x))
    np.testing.assert_allclose(float(got_l), float(ref_l), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ref_p), jax.tree.leaves(got_p)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    text = ap.compiled_text(params, x)
    assert re.search(r"f32\[1,2,1,32,32\]", text) and not re.search(r"f32\[8,2,1,32,32\]", text)


# ------------------------------------------------------------------ a GPU dump
def _calls(plan):
    return {o.name: o for o in plan.ops if o.opcode in ("custom-call", "get-tuple-element")}


@pytest.mark.parametrize("mesh", [(8,), (2, 4)])
def test_gpu_dump_with_cudnn_attention_is_planned_with_the_calls_split(mesh):
    """A hand-written dump in XLA:GPU's form (BTNH, causal, training: forward and backward
    calls with their tuple results): q/k/v projections column-split, the calls split over
    heads (dim 2 of BTNH operands, dim 1 of the BNTH results), no call kept whole."""
    g = rhino.ingest(str(GPU_HLO))
    fwd, bwd = (op for op in g.ops if op.opcode == "custom-call")
    assert fwd.flops == 2 * 2 * 8 * 128 * 128 * (64 + 64) / 2           # causal
    assert bwd.flops == 2 * 2 * 8 * 128 * 128 * (3 * 64 + 2 * 64) / 2
    plan = rhino.plan(g, mesh_shape=mesh).spmd        # validated by the planner
    calls = _calls(plan)
    for name in (fwd.name, bwd.name):
        heads = calls[name].in_specs[0].dims[2].axes
        assert heads and len(heads) + len(calls[name].in_specs[0].dims[0].axes) == len(mesh)
    for o in calls.values():
        if o.opcode == "get-tuple-element" and o.out_spec.rank >= 3:
            assert o.out_spec.dims[1].axes, o                             # heads (BNT..)
    assert not plan.unplanned and "replicated for lack of a rule: none" in plan.report()
    for p in ("params['wq']", "params['wk']", "params['wv']"):
        assert plan.param_spec(p).dims[1].axes


H200_HLO = DATA / "h200_cudnn_attention_step.hlo"


@pytest.mark.parametrize("mesh", [(8,), (2, 4)])
def test_a_real_h200_dump_with_cudnn_attention_is_planned_with_the_calls_split(mesh):
    """The attention step ``benchmarks/gpu_check.py`` lowered on an H200 (jax 0.11.2,
    2026-11-26; causal, ``implementation="cudnn"``, batch 4, 16 heads of 64): XLA:GPU's own
    ``__cudnn$fmhaSoftmax`` / ``__cudnn$fmhaSoftmaxBackward`` calls are planned through the
    built-in rule, split over heads (dim 2 of the BTNH operands, dim 1 of the BNT.. results;
    batch 4 cannot take 8 devices), nothing kept whole for lack of a rule."""
    g = rhino.ingest(str(H200_HLO))
    targets = sorted(op.attrs.get("custom_call_target", "") for op in g.ops
                     if op.opcode == "custom-call")
    assert targets == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], targets
    calls = [op for op in g.ops if op.opcode == "custom-call"]
    assert all(op.flops > 0 for op in calls)
    plan = rhino.plan(g, mesh_shape=mesh).spmd
    found = _calls(plan)
    for op in calls:
        for s in found[op.name].in_specs:
            heads = s.dims[2].axes if s.rank == 4 else s.dims[1].axes      # BTNH; stats BNT
            assert heads, (op.name, s)
    for o in found.values():
        if o.opcode == "get-tuple-element" and o.out_spec.rank >= 3:
            assert o.out_spec.dims[1].axes, o
    assert not plan.unplanned and "replicated for lack of a rule: none" in plan.report()


def test_a_custom_call_without_a_rule_stays_whole_and_is_listed(tmp_path):
    text = GPU_HLO.read_text().replace('"__cudnn$fmhaSoftmax"', '"__gpu$xla.gpu.triton"', 1)
    path = tmp_path / "triton.hlo"
    path.write_text(text)
    plan = rhino.plan(str(path), mesh_shape=(8,)).spmd
    (u,) = [x for x in plan.unplanned if x.opcode == "custom-call"]   # and its elements
    assert u.opcode == "custom-call" and u.source == "/work/model/attention.py:33"
    assert "declares no sharding rule" in u.reason
    rep = plan.report()
    assert "__gpu$xla.gpu.triton" in rep and "/work/model/attention.py:33" in rep
    whole = [o for o in plan.ops if o.name == u.name][0]
    assert all(s is None or s.is_replicated for s in whole.in_specs)


def test_validator_refuses_a_split_the_rule_does_not_allow():
    g = rhino.ingest(str(GPU_HLO))
    fwd = next(op for op in g.ops if op.opcode == "custom-call")
    mesh = rhino.AbstractMesh((8,))
    seq = ShardingSpec.parse("R·S[x]·R·R")          # BTNH: the query's sequence
    rep4, rep3 = ShardingSpec.replicated(4), ShardingSpec.replicated(3)
    bad = Strategy((rep4, rep3, ShardingSpec.replicated(1)), (seq, rep4, rep4), 0.0)
    assert "no factor's" in check_custom(g, fwd, bad, mesh)
