"""Per-op strategies (rhino.planner.strategies, strategies_rules)."""

import jax
import jax.numpy as jnp
import pytest

import rhino
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spec import ShardingSpec
from rhino.planner.strategies import (StrategyOptions, generate_strategies, group_sizes,
                                      op_strategies)
from rhino.planner.validate import check_strategy

F32 = jnp.float32


def sds(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def specs(strats, mesh):
    """{(in specs..., out spec)} as strings."""
    return {(tuple(s.to_str(mesh) for s in st.in_specs), st.out_spec.to_str(mesh))
            for st in strats}


def cost(mesh):
    """The cost model the tests price strategies with (α 10 µs, β 1/(5 GB/s), 50 GFLOP/s)."""
    return CostModel.uniform(mesh.ndim)


def only(g, opcode):
    ops = [op for op in g.ops if op.opcode == opcode]
    assert len(ops) == 1, [op.opcode for op in g.ops]
    return ops[0]


def check_all(g, mesh, ss):
    for op, strats in zip(g.ops, ss.strategies):
        assert strats
        for st in strats:
            check_strategy(g, op, st, mesh)


def test_dot_rules_1d():
    m = AbstractMesh((4,))
    g = rhino.ingest(lambda x, w: x @ w, sds(8, 16), sds(16, 32))
    ss = generate_strategies(g, m, cost(m))
    dot = only(g, "dot")
    got = specs(ss.strategies[dot.id], m)
    assert got == {(("R·R", "R·R"), "R·R"),
                   (("S[x]·R", "R·R"), "S[x]·R"),          # rows (batch of a matmul)
                   (("R·R", "R·S[x]"), "R·S[x]"),          # columns
                   (("R·S[x]", "S[x]·R"), "R·R·P(sum@x)")}  # contracting -> partial sum
    by_label = {st.label: st for st in ss.strategies[dot.id]}
    assert by_label["dot[R]"].compute_cost == pytest.approx(dot.flops / cost(m).flops_per_s)
    assert by_label["dot[k0@x]"].compute_cost == pytest.approx(dot.flops / cost(m).flops_per_s / 4)
    check_all(g, m, ss)


def test_dot_rules_compose_over_2d_mesh():
    m = AbstractMesh((2, 4))
    g = rhino.ingest(lambda x, w: jnp.einsum("bsh,hf->bsf", x, w), sds(4, 8, 16), sds(16, 32))
    ss = generate_strategies(g, m, cost(m))
    dot = only(g, "dot")
    got = specs(ss.strategies[dot.id], m)
    assert (("S[x]·R·R", "R·S[y]"), "S[x]·R·S[y]") in got          # batch on x, column on y
    assert (("R·R·S[y]", "S[y]·S[x]"), "R·R·S[x]·P(sum@y)") in got  # column x, contract y
    assert (("S[x,y]·R·R", "R·R"), "S[x,y]·R·R") not in got        # 4 does not split 8 ways
    assert (("R·S[x,y]·R", "R·R"), "R·S[x,y]·R") in got
    labels = {st.label for st in ss.strategies[dot.id]}
    assert "dot[m0@x,n0@y]" in labels and "dot[m1@xy]" in labels
    check_all(g, m, ss)


def test_batched_dot_and_elementwise_partial_rules():
    m = AbstractMesh((2,))

    def f(a, b, c):
        y = jnp.einsum("bij,bjk->bik", a, b)
        return jnp.tanh(y) + y * c
    g = rhino.ingest(f, sds(4, 6, 8), sds(4, 8, 2), sds(4, 6, 2))
    ss = generate_strategies(g, m, cost(m))
    dot = only(g, "dot")
    assert (("S[x]·R·R", "S[x]·R·R"), "S[x]·R·R") in specs(ss.strategies[dot.id], m)
    tanh, add, mul = only(g, "tanh"), only(g, "add"), only(g, "multiply")
    assert not any(st.out_spec.is_partial for st in ss.strategies[tanh.id])  # not linear
    assert (("R·R·R·P(sum@x)", "R·R·R·P(sum@x)"), "R·R·R·P(sum@x)") in specs(
        ss.strategies[add.id], m)
    mul_specs = specs(ss.strategies[mul.id], m)
    assert (("R·R·R·P(sum@x)", "R·R·R"), "R·R·R·P(sum@x)") in mul_specs
    assert (("R·R·R·P(sum@x)", "R·R·R·P(sum@x)"), "R·R·R·P(sum@x)") not in mul_specs
    check_all(g, m, ss)


def test_reduce_broadcast_transpose_rules():
    m = AbstractMesh((2,))
    g = rhino.ingest(lambda x: (jnp.sum(x, axis=1), jnp.max(x, axis=0),
                                jnp.broadcast_to(x[None], (4, 8, 6)), x.T),
                     sds(8, 6))
    ss = generate_strategies(g, m, cost(m))
    reds = [op for op in g.ops if op.opcode == "reduce"]
    by_reducer = {op.attrs["reducer"]: op for op in reds}
    s_sum = specs(ss.strategies[by_reducer["add"].id], m)
    assert (("S[x]·R", "()"), "S[x]") in s_sum
    assert (("R·S[x]", "()"), "R·P(sum@x)") in s_sum
    assert (("R·R·P(sum@x)", "()"), "R·P(sum@x)") in s_sum        # zero-init add reduce
    s_max = specs(ss.strategies[by_reducer["maximum"].id], m)
    assert (("S[x]·R", "()"), "R·P(max@x)") in s_max
    assert not any("P(sum" in x[0][0] for x in s_max)             # max is not linear
    bc = next(op for op in g.ops if op.opcode == "broadcast" and op.shape.dims[0] == 4)
    s_bc = specs(ss.strategies[bc.id], m)
    assert any(out == "S[x]·R·R" and all(i.startswith("R") for i in ins) for ins, out in s_bc)
    tr = only(g, "transpose")
    assert (("S[x]·R",), "R·S[x]") in specs(ss.strategies[tr.id], m)
    check_all(g, m, ss)


def test_slice_pad_concat_keep_touched_dims_whole():
    m = AbstractMesh((2,))
    g = rhino.ingest(lambda x: jnp.concatenate([x[:, :3], jnp.pad(x, ((0, 0), (1, 1)))],
                                               axis=1), sds(8, 6))
    ss = generate_strategies(g, m, cost(m))
    for code in ("slice", "pad", "concatenate"):
        op = only(g, code)
        for st in ss.strategies[op.id]:
            assert not st.out_spec.dims[1].axes, (code, st.describe(m))
        assert any(st.out_spec.dims[0].axes for st in ss.strategies[op.id])
    check_all(g, m, ss)


def test_convolution_rules():
    m = AbstractMesh((2,))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    g = rhino.ingest(jax.grad(lambda x, w: jnp.sum(conv(x, w)), argnums=1),
                     sds(4, 8, 8, 6), sds(3, 3, 6, 10))
    ss = generate_strategies(g, m, cost(m))
    convs = [op for op in g.ops if op.opcode == "convolution"]
    assert convs
    wgrad = convs[-1]                                  # weight gradient: f01b_i01o->01bf
    got = specs(ss.strategies[wgrad.id], m)
    # Batch of the activations is the contracting ("input feature") dim -> partial sum,
    # i.e. the data-parallel gradient.
    assert (("S[x]·R·R·R", "S[x]·R·R·R"), "R·R·R·R·P(sum@x)") in got
    assert all(not st.out_spec.dims[0].axes and not st.out_spec.dims[1].axes
               for st in ss.strategies[wgrad.id])      # spatial never split
    check_all(g, m, ss)

    g2 = rhino.ingest(conv, sds(4, 8, 8, 6), sds(3, 3, 6, 10))
    ss2 = generate_strategies(g2, m, cost(m))
    fwd = only(g2, "convolution")
    got2 = specs(ss2.strategies[fwd.id], m)
    assert (("S[x]·R·R·R", "R·R·R·R"), "S[x]·R·R·R") in got2      # batch
    assert (("R·R·R·R", "R·R·R·S[x]"), "R·R·R·S[x]") in got2      # output features
    assert (("R·R·R·S[x]", "R·R·S[x]·R"), "R·R·R·R·P(sum@x)") in got2  # input features


def test_gather_and_scatter_rules():
    m = AbstractMesh((2,))
    g = rhino.ingest(jax.grad(lambda t, i: jnp.sum(jnp.take(t, i, axis=0) ** 2)),
                     sds(16, 8), sds(4, 6, dtype=jnp.int32))
    ss = generate_strategies(g, m, cost(m))
    gather = only(g, "gather")
    got = specs(ss.strategies[gather.id], m)
    assert (("S[x]·R", "R·R·R"), "R·R·R·P(sum@x)") in got          # vocabulary split
    assert (("R·R", "S[x]·R·R"), "S[x]·R·R") in got                # batch of indices
    assert (("R·S[x]", "R·R·R"), "R·R·S[x]") in got                # hidden dim
    scatter = only(g, "scatter")
    sgot = specs(ss.strategies[scatter.id], m)
    assert any(out == "R·R·P(sum@x)" and ins[2].startswith("S[x]") for ins, out in sgot)
    assert any(out == "S[x]·R" and ins[0] == "S[x]·R" and ins[2] == "R·R·R"
               for ins, out in sgot)                              # rows of the table
    check_all(g, m, ss)


def _qkv_graph(B=2, S=4, H=32, heads=4):
    hd = H // heads

    def f(x, w):
        qkv = (x @ w).reshape(B, S, 3, heads, hd)
        return jnp.einsum("bqhd,bkhd->bhqk", qkv[:, :, 0], qkv[:, :, 1] + qkv[:, :, 2])
    return rhino.ingest(f, sds(B, S, H), sds(H, 3 * H))


def test_strided_candidates_come_from_reshapes():
    m = AbstractMesh((4,))
    g = _qkv_graph()
    ss = generate_strategies(g, m, cost(m))
    dot = next(op for op in g.ops if op.opcode == "dot" and op.shape.rank == 3)
    reshape = next(op for op in g.ops if op.opcode == "reshape" and op.shape.rank == 5)
    # A head split of [B,S,3,heads,hd] is a stride-8 split (1 head x hd=8) of 3H = 96.
    assert ss.hints[dot.id][2] >= {(4, 8)}
    assert (("R·R·S[x/s8]",), "R·R·R·S[x]·R") in specs(ss.strategies[reshape.id], m)
    assert (("R·R·R", "R·S[x/s8]"), "R·R·S[x/s8]") in specs(ss.strategies[dot.id], m)
    w = g.params[1]
    assert "R·S[x/s8]" in {st.out_spec.to_str(m) for st in ss.strategies[w]}
    check_all(g, m, ss)
    off = generate_strategies(g, m, cost(m), StrategyOptions(strided=False))
    assert not off.hints
    for strats in off.strategies:
        for st in strats:
            assert all(d.stride is None for s in (st.out_spec, *st.in_specs) for d in s.dims)


def test_reshape_pairs_move_no_data_2d():
    m = AbstractMesh((2, 2))
    g = _qkv_graph(H=16, heads=4)
    ss = generate_strategies(g, m, cost(m))
    check_all(g, m, ss)   # the validator brute-forces element placement of every reshape
    assert group_sizes(m) == [2, 4]


def test_unknown_ops_are_replicated_and_reported():
    m = AbstractMesh((2,))

    def f(x, n):
        return jax.lax.fori_loop(0, n, lambda i, v: v * 2.0, x)
    g = rhino.ingest(f, sds(8,), sds(dtype=jnp.int32))
    ss = generate_strategies(g, m, cost(m))
    names = {(u.opcode, u.reason.split(" ")[0]) for u in ss.unknown_ops}
    assert ("while", "tuple-shaped") in names
    for u in ss.unknown_ops:
        (st,) = ss.strategies[u.id]
        outs = st.out_spec if isinstance(st.out_spec, tuple) else (st.out_spec,)
        assert all(s.is_replicated for s in outs)
    check_all(g, m, ss)


def test_parameters_get_every_spec_and_op_strategies():
    m = AbstractMesh((2, 2))
    g = rhino.ingest(lambda w: w * 2.0, sds(4, 6))
    p = g.params[0]
    got = {st.out_spec.to_str(m) for st in op_strategies(g, p, m, cost(m))}
    assert got == {"R·R", "S[x]·R", "S[y]·R", "S[x,y]·R", "R·S[x]", "R·S[y]", "S[x]·S[y]",
                   "S[y]·S[x]"}
    assert all(not ShardingSpec.parse(s, m).is_partial for s in got)


def test_repeated_layers_share_one_enumeration():
    """Strategies are enumerated once per distinct op (loops, ranks, FLOPs, strides): the
    ops of repeated layers get the very same tuple, equal to a fresh enumeration. (The
    memo once stored under the wrong key and never hit: 9 s for a 48-layer GPT on 8x8.)"""
    from rhino.models import get_model

    m = get_model("gpt", layers=3, hidden=32, heads=2, seq=8, vocab=32, batch=4)
    g = rhino.ingest(m.step, *m.example_args())
    mesh = AbstractMesh((2, 2))
    ss = generate_strategies(g, mesh, cost(mesh))
    for opcode in ("dot", "reshape", "add"):
        ids = [i for i, op in enumerate(g.ops) if op.opcode == opcode]
        assert len({id(ss.strategies[i]) for i in ids}) < len(ids) / 2, opcode
        for i in ids[::7]:
            assert op_strategies(g, i, mesh, cost(mesh)) == ss.strategies[i]
