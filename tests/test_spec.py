"""Sharding specs, meshes and α-β resharding costs (rhino.planner.mesh / spec / collectives)."""

import itertools
import math

import numpy as np
import pytest

from rhino.hlo_passes.graph import TensorType
from rhino.planner.collectives import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER,
                                       ReshardCostTable, all_gather_cost, all_reduce_cost,
                                       all_to_all_cost, collective_cost, reduce_scatter_cost,
                                       reshard)
from rhino.errors import OptionsError
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spec import DimSharding, InvalidSpecError, ShardingSpec, map_reshape

A, B = 1e-5, 2e-10          # α, β of the test meshes
C1 = CostModel((A,), (B,))  # their cost model (native reduce-scatter)
C2 = CostModel((1e-6, 1e-5), (1e-9, 1e-10))   # of the (2, 4) test mesh


def mesh1(n=4):
    return AbstractMesh((n,))


def parse(text, mesh=None):
    return ShardingSpec.parse(text, mesh)


# ------------------------------------------------------------------------------- mesh
def test_mesh_defaults_and_json():
    m = AbstractMesh((2, 4))
    assert m.axis_names == ("x", "y") and m.num_devices == 8 and m.ndim == 2
    assert AbstractMesh.from_json(m.to_json()) == m
    assert m.to_dict() == {"shape": [2, 4], "axis_names": ["x", "y"]}
    cost = CostModel.simulated_cpu(2)
    assert cost.alpha == (1e-5, 1e-5) and cost.beta == (1 / 5e9, 1 / 5e9)
    assert cost.flops_per_s == 5e10 and cost.memory_bytes == 4 * 2**30
    assert not cost.native_reduce_scatter and cost.backend == "cpu"
    m2 = AbstractMesh((2, 4), axis_names=("dp", "tp"))
    c2 = CostModel((1e-5, 1e-6), (1e-9, 1e-10))
    assert c2.group_alpha((0, 1)) == 1e-5          # the slowest axis: one collective
    assert c2.group_beta((0, 1)) == 1e-9 and m2.group_size((0, 1)) == 8
    assert AbstractMesh.from_json(m2.to_json()) == m2
    assert m2.axis_index("tp") == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(shape=()), "non-empty"), (dict(shape=(0,)), "positive"),
    (dict(shape=(2, 2), axis_names=("a", "a")), "distinct"),
    (dict(shape=(2,), axis_names=("a", "b")), "distinct")])
def test_mesh_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AbstractMesh(**kwargs)


def test_mesh_json_rejects_cost_figures():
    """A mesh dict holding α, β (an older plan's) is not silently stripped of them."""
    with pytest.raises(ValueError, match="legacy_mesh"):
        AbstractMesh.from_dict({"shape": [2], "alpha": [1e-5], "beta": [1e-9]})


@pytest.mark.parametrize("kwargs, match", [
    (dict(alpha=(1.0, 2.0), beta=(1.0,)), "same axes"),
    (dict(alpha=1e-5, beta=(1.0,)), "one value per mesh axis"),
    (dict(alpha=(-1.0,), beta=(1.0,)), ">= 0"),
    (dict(alpha=(1.0,), beta=(1.0,), flops_per_s=0), "flops_per_s"),
    (dict(alpha=(1.0,), beta=(1.0,), dtype_flops_per_s={"bf16": -1}), "bf16"),
    (dict(alpha=(1.0,), beta=(1.0,), memory_bytes=0), "memory_bytes")])
def test_cost_model_errors(kwargs, match):
    with pytest.raises(OptionsError, match=match):
        CostModel(**kwargs)
    with pytest.raises(OptionsError, match="2 axes"):
        C1.check(AbstractMesh((2, 4)))


# ------------------------------------------------------------------------------- specs
def test_local_shapes_strides_and_strings():
    m = AbstractMesh((2, 4))
    s = ShardingSpec.sharded(3, {0: 0, 2: 1}, partial=())
    assert str(s) == "S[x]·R·S[y]" and s.local_shape((8, 3, 16), m) == (4, 3, 4)
    both = ShardingSpec.sharded(2, {1: (0, 1)})
    assert both.to_str(m) == "R·S[x,y]" and both.local_shape((5, 16), m) == (5, 2)
    strided = ShardingSpec.sharded(1, {0: 1}, strides={0: 8})
    assert str(strided) == "S[y/s8]" and strided.local_shape((64,), m) == (16,)
    part = ShardingSpec.sharded(2, {0: 0}, partial=[(1, "max")])
    assert str(part) == "S[x]·R·P(max@y)" and part.is_partial and not part.is_replicated
    assert part.shard_count(m) == 2 and part.without_partial() == ShardingSpec.sharded(2, {0: 0})
    assert ShardingSpec.replicated(2).is_replicated and str(ShardingSpec.replicated(0)) == "()"
    assert str(ShardingSpec((), ((0, "sum"),))) == "P(sum@x)"
    assert part.used_axes == (0, 1) and part.split_axes == (0,)


def test_parse_and_json_round_trip():
    m = AbstractMesh((2, 4), axis_names=("dp", "tp"))
    texts = ["S[dp]·R", "R·S[dp,tp/s4]", "S[tp/s2]·R·P(sum@dp)", "R·R", "()", "P(min@tp)"]
    for t in texts:
        s = ShardingSpec.parse(t, m)
        assert s.to_str(m) == t
        assert ShardingSpec.from_json(s.to_json()) == s
        assert hash(ShardingSpec.from_dict(s.to_dict())) == hash(s)
    assert ShardingSpec.parse("S[x].R") == ShardingSpec.parse("S[x]·R")


@pytest.mark.parametrize("spec, shape, match", [
    ("S[x]·R", (6, 4), "dim 0 of size 6: expected divisible by its 4 shards"),
    ("S[x/s4]", (24,), "shards x stride = 4 x 4"),
    ("R·S[y]", (4, 4), "expected axes < 1"),
    ("S[x]", (4, 4), "rank-1"),
])
def test_validity_errors(spec, shape, match):
    s = ShardingSpec.parse(spec)
    assert not s.is_valid(shape, mesh1())
    with pytest.raises(InvalidSpecError, match=match):
        s.check(shape, mesh1())


def test_malformed_specs():
    with pytest.raises(InvalidSpecError, match="at most once, found axis 0 used twice"):
        ShardingSpec.parse("S[x]·P(sum@x)")
    with pytest.raises(InvalidSpecError, match="reducer"):
        ShardingSpec((DimSharding(),), ((0, "prod"),))
    with pytest.raises(InvalidSpecError, match="expected R, S"):
        ShardingSpec.parse("Q[x]")
    with pytest.raises(InvalidSpecError, match="stride None"):
        DimSharding((), 4)
    with pytest.raises(InvalidSpecError, match=">= 1"):
        DimSharding((0,), 0)
    with pytest.raises(InvalidSpecError, match="spec JSON"):
        ShardingSpec.from_dict({"nope": 1})


def test_normalized_and_axis_roles():
    m = AbstractMesh((2, 4))
    s = ShardingSpec.parse("S[x,y/s2]")
    assert s.normalized((16,), m) == ShardingSpec.parse("S[x,y]")
    assert s.normalized((32,), m) == s
    roles = s.axis_roles((32,), m)
    assert roles == (("dim", 0, 8), ("dim", 0, 2))
    assert ShardingSpec.from_axis_roles(roles, (32,), m) == s
    # Axes that do not nest have no single-stride spec.
    assert ShardingSpec.from_axis_roles((("dim", 0, 8), ("dim", 0, 1)), (64,), m) is None


def _owner_map(spec, shape, mesh):
    """Device coordinate tuple of every row-major element, computed naively."""
    numel = math.prod(shape)
    coords = np.zeros((numel, mesh.ndim), dtype=int)
    idx = np.array(list(itertools.product(*[range(s) for s in shape]))).reshape(numel, -1)
    for d, ds in enumerate(spec.dims):
        if not ds.axes:
            continue
        n = mesh.group_size(ds.axes)
        stride = ds.stride or shape[d] // n
        shard = (idx[:, d] // stride) % n
        for a in reversed(ds.axes):          # mixed radix, first axis most significant
            coords[:, a] = shard % mesh.shape[a]
            shard //= mesh.shape[a]
    return coords


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_map_reshape_moves_no_data(mesh_shape):
    m = AbstractMesh(mesh_shape)
    x, y = (2, 12), (2, 3, 2, 2)               # [B, 3H] <-> [B, 3, heads, hd], H = 4
    for text in ["R·S[x]·R·R", "R·R·R·S[x]", "S[x]·R·R·R", "R·R·S[x]·R"] + (
            ["R·R·S[x]·S[y]", "S[x]·R·S[y]·R"] if len(mesh_shape) == 2 else []):
        t = ShardingSpec.parse(text)
        if not t.is_valid(y, m):
            continue
        s = map_reshape(t, y, x, m)
        if s is None:
            continue
        assert (_owner_map(s, x, m) == _owner_map(t, y, m)).all(), (text, str(s))
        assert map_reshape(s, x, y, m) == t


def test_map_reshape_fused_qkv():
    m = mesh1(4)
    heads = ShardingSpec.parse("R·R·R·S[x]·R")            # [B, S, 3, 8 heads, 16]
    fused = map_reshape(heads, (2, 4, 3, 8, 16), (2, 4, 384), m)
    assert fused == ShardingSpec.parse("R·R·S[x/s32]")    # chunks of 2 heads x 16 = 32
    # A blocked split of 3H is not a split of any one dim of the 5-D view.
    assert map_reshape(ShardingSpec.parse("R·R·S[x]"), (2, 4, 384), (2, 4, 3, 8, 16), m) is None
    merged = map_reshape(ShardingSpec.parse("R·R·S[x]·R"), (2, 4, 8, 16), (2, 4, 128), m)
    assert merged == ShardingSpec.parse("R·R·S[x]")
    part = map_reshape(ShardingSpec.parse("R·R·P(sum@x)"), (4, 8), (32,), m)
    assert part == ShardingSpec.parse("R·P(sum@x)")


# ------------------------------------------------------------------------------- collectives
def test_collective_formulas():
    m = mesh1(4)
    nb = 1 << 20
    assert all_reduce_cost(nb, (0,), m, C1) == pytest.approx(A + 2 * 3 / 4 * nb * B)
    assert all_gather_cost(nb, (0,), m, C1) == pytest.approx(A + 3 / 4 * nb * B)
    assert reduce_scatter_cost(nb, (0,), m, C1) == pytest.approx(A + 3 / 4 * nb * B)
    assert all_to_all_cost(nb, (0,), m, C1) == pytest.approx(A + 3 / 4 * nb * B)
    assert collective_cost(ALL_REDUCE, (), nb, m, C1) == 0.0
    m2 = AbstractMesh((2, 4))
    # α and β of the slowest axis: one collective over the 8 devices.
    assert all_reduce_cost(nb, (0, 1), m2, C2) == pytest.approx(1e-5 + 2 * 7 / 8 * nb * 1e-9)
    with pytest.raises(ValueError, match="kind"):
        collective_cost("broadcast", (0,), nb, m, C1)
    # One all-reduce is cheaper than the reduce-scatter + all-gather pair (α once).
    assert all_reduce_cost(nb, (0,), m, C1) < (reduce_scatter_cost(nb, (0,), m, C1)
                                               + all_gather_cost(nb, (0,), m, C1))


@pytest.mark.parametrize("src, dst, kinds, bytes_, cost", [
    ("R·R·P(sum@x)", "R·R", [ALL_REDUCE], [4096], A + 1.5 * 4096 * B),
    ("R·R·P(sum@x)", "S[x]·R", [REDUCE_SCATTER], [4096], A + 0.75 * 4096 * B),
    ("S[x]·R", "R·R", [ALL_GATHER], [4096], A + 0.75 * 4096 * B),
    ("S[x]·R", "R·S[x]", [ALL_TO_ALL], [1024], A + 0.75 * 1024 * B),
    ("R·R", "R·S[x]", [], [], 0.0),
    ("R·S[x]", "R·S[x]", [], [], 0.0),
    ("R·S[x/s4]", "R·S[x]", [ALL_TO_ALL], [1024], A + 0.75 * 1024 * B),
    ("S[x]·R", "S[x]·R·P(sum@x)".replace("S[x]·R·", "R·R·"), [], [], 0.0),
    ("R·R·P(max@x)", "R·R·P(sum@x)", [ALL_REDUCE], [4096], A + 1.5 * 4096 * B),
])
def test_reshard_standard_cases(src, dst, kinds, bytes_, cost):
    t = TensorType("f32", (32, 32))                   # 4096 bytes
    plan = reshard(ShardingSpec.parse(src), ShardingSpec.parse(dst), t, mesh1(4), C1)
    assert [c.kind for c in plan.collectives] == kinds
    assert [c.bytes for c in plan.collectives] == bytes_
    assert plan.cost == pytest.approx(cost, rel=1e-12)
    assert plan.is_free == (not kinds)


def test_reshard_two_axes():
    m = AbstractMesh((2, 4))
    t = TensorType("f32", (64, 64))                   # 16384 bytes
    # Partial over y on a tensor split over x: all-reduce of the local half over y.
    p = reshard(ShardingSpec.parse("S[x]·R·P(sum@y)"), ShardingSpec.parse("S[x]·R"), t, m, C2)
    assert [(c.kind, c.axes, c.bytes) for c in p.collectives] == [(ALL_REDUCE, (1,), 8192)]
    assert p.cost == pytest.approx(1e-5 + 2 * 3 / 4 * 8192 * 1e-10)
    # Fully split -> replicated: one all-gather over both axes of the full tensor.
    g = reshard(ShardingSpec.parse("S[x,y]·R"), ShardingSpec.parse("R·R"), t, m, C2)
    assert [(c.kind, c.axes, c.bytes) for c in g.collectives] == [(ALL_GATHER, (0, 1), 16384)]
    assert g.cost == pytest.approx(1e-5 + 7 / 8 * 16384 * 1e-9)    # the slowest axis' α, β
    # Reduce-scatter first (shrinks), then gather on the other axis.
    rs = reshard(ShardingSpec.parse("S[y]·R·P(sum@x)"), ShardingSpec.parse("R·S[x]"), t, m, C2)
    assert [(c.kind, c.bytes) for c in rs.collectives] == [(REDUCE_SCATTER, 4096),
                                                           (ALL_GATHER, 8192)]
    # Moving one axis' split from one dim to another is an all-to-all of the local shard.
    a2a = reshard(ShardingSpec.parse("S[x]·R"), ShardingSpec.parse("R·S[x]"), t, m, C2)
    assert [(c.kind, c.axes, c.bytes) for c in a2a.collectives] == [(ALL_TO_ALL, (0,), 8192)]
    # Moving two axes apart: gathered (one all-gather per dim, the minor dim first, as
    # XLA gathers S[x]·S[y] to R·R), then sliced.
    both = reshard(ShardingSpec.parse("S[x]·S[y]"), ShardingSpec.parse("S[y]·S[x]"), t, m, C2)
    assert [(c.kind, c.axes, c.bytes) for c in both.collectives] == [(ALL_GATHER, (1,), 8192),
                                                                    (ALL_GATHER, (0,), 16384)]
    # A group moving together, in its order, is one all-to-all over it (as XLA runs it).
    group = reshard(ShardingSpec.parse("S[x,y]·R"), ShardingSpec.parse("R·S[x,y]"), t, m, C2)
    assert [(c.kind, c.axes, c.bytes) for c in group.collectives] == [(ALL_TO_ALL, (0, 1), 2048)]
    swapped = reshard(ShardingSpec.parse("S[x,y]·R"), ShardingSpec.parse("R·S[y,x]"), t, m, C2)
    assert [c.kind for c in swapped.collectives] == [ALL_GATHER]
    table = ReshardCostTable(m, C2)
    src, dst = ShardingSpec.parse("S[x,y]·R"), ShardingSpec.parse("R·R")
    assert table.cost(src, dst, t) == g.cost and len(table) == 1


def test_reshard_partial_groups_as_xla_reduces_them():
    """A sum one split dimension leaves over x and y (``P(sum@x+y)``) is one all-reduce
    over the 8 devices, as XLA runs a dot contracting a dimension split over both axes;
    sums left by two dimensions (``P(sum@x,sum@y)``) are reduced one axis at a time. A
    pending sum cannot become grouped without being reduced; the other way is free."""
    m = AbstractMesh((2, 4))
    cost = CostModel.uniform(2, 1e-5, 1e-9)
    t = TensorType("f32", (64, 64))                   # 16384 bytes
    r = ShardingSpec.parse("R·R")
    grouped, apart = ShardingSpec.parse("R·R·P(sum@x+y)"), ShardingSpec.parse("R·R·P(sum@x,sum@y)")
    assert grouped.partial_groups == ((0, 1),) and apart.partial_groups == ()
    assert str(grouped) == "R·R·P(sum@x+y)" and ShardingSpec.from_json(grouped.to_json()) == grouped
    assert grouped != apart and grouped.axis_roles((64, 64), m) == apart.axis_roles((64, 64), m)
    one = reshard(grouped, r, t, m, cost)
    assert [(c.kind, c.axes) for c in one.collectives] == [(ALL_REDUCE, (0, 1))]
    assert one.cost == pytest.approx(1e-5 + 2 * 7 / 8 * 16384 * 1e-9)
    # ... the cost of the same all-reduce on the (8) mesh of the same devices.
    assert one.cost == pytest.approx(reshard(ShardingSpec.parse("R·R·P(sum@x)"), r, t,
                                             AbstractMesh((8,)), CostModel.uniform(1, 1e-5,
                                                                                   1e-9)).cost)
    two = reshard(apart, r, t, m, cost)
    assert [(c.kind, c.axes) for c in two.collectives] == [(ALL_REDUCE, (0,)), (ALL_REDUCE, (1,))]
    assert two.cost > one.cost
    assert reshard(grouped, apart, t, m, cost).is_free
    assert reshard(apart, grouped, t, m, cost).cost == pytest.approx(two.cost)
    # Reducing one axis of a group is an all-reduce over that axis alone.
    half = reshard(grouped, ShardingSpec.parse("R·R·P(sum@y)"), t, m, cost)
    assert [(c.kind, c.axes) for c in half.collectives] == [(ALL_REDUCE, (0,))]
    with pytest.raises(InvalidSpecError, match="group"):
        ShardingSpec((DimSharding(),), ((0, "sum"), (1, "max")), ((0, 1),))
    with pytest.raises(InvalidSpecError, match="group"):
        ShardingSpec((DimSharding(),), ((0, "sum"),), ((0, 1),))


def test_reshard_errors_and_tuples():
    t = TensorType("f32", (6,))
    # 6 over 4 is an uneven split (padded, test_uneven.py); 3 over 4 leaves a shard empty
    assert reshard(ShardingSpec.parse("S[x]"), ShardingSpec.parse("R"), t, mesh1(4), C1).cost
    with pytest.raises(InvalidSpecError, match="divisible"):
        reshard(ShardingSpec.parse("S[x]"), ShardingSpec.parse("R"), TensorType("f32", (3,)),
                mesh1(4), C1)
    r = (ShardingSpec.replicated(1),)
    assert reshard(r, r, (t,), mesh1(4), C1).is_free
    with pytest.raises(InvalidSpecError, match="tuple"):
        reshard(r, ShardingSpec.replicated(1), t, mesh1(4), C1)
