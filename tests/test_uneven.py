"""Uneven splits (issue 46, acceptance 2): a dimension its shards do not divide is split
with padding inside a program, priced at the padded size, kept off the step's arguments
and results (JAX refuses an uneven sharding at a jit boundary), and run by
``auto_parallel`` equal to ``jax.jit`` with the compiled collectives the plan predicts."""

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino
from rhino.front_door import PlanRequest
from rhino.hlo_passes.graph import TensorType
from rhino.models import get_model
from rhino.planner.build import BuildOptions, build_problem
from rhino.planner.collectives import reshard
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh
from rhino.planner.solvers import solve_ilp
from rhino.planner.spec import InvalidSpecError, ShardingSpec
from rhino.planner.validate import PlanValidationError, validate_built, validate_plan
from rhino.runtime.executors.spmd import count_collectives, summarize

from handmade import assert_trains_like_jit

# auto_parallel's SPMD build options without uneven splits: what the search finds evenly
_EVENLY = dataclasses.replace(PlanRequest().build_options(pipeline=False), uneven=False)


def _dims(shape: str) -> tuple[int, ...]:
    inside = shape[shape.index("[") + 1:shape.index("]")]
    return tuple(int(x) for x in inside.split(",")) if inside else ()


def _uneven_values(plan):
    """The plan's values split unevenly (``SpmdPlan.uneven``), each checked: its spec
    splits its shape unevenly, its padded shape is that spec's, and it is no parameter."""
    opcode = {o.name: o.opcode for o in plan.ops}
    for u in plan.uneven:
        spec = ShardingSpec.parse(u.spec, plan.mesh)
        assert spec.uneven_dims(_dims(u.shape), plan.mesh), u
        assert spec.padded_shape(_dims(u.shape), plan.mesh) == _dims(u.padded), u
        assert opcode[u.name] != "parameter", u
    return plan.uneven


def _compiled_matches_plan(step, args):
    plan = step.plan_for(*args).spmd
    got = summarize(count_collectives(step.compiled_text(*args)))
    want = plan.collective_summary()
    assert got == want, (got, want)
    return plan


# ------------------------------------------------------------------------------ specs
def test_an_uneven_spec_is_valid_only_where_asked_for_and_pads_its_shards():
    mesh = AbstractMesh((8,))
    s = ShardingSpec.parse("S[x]·R")
    why = s.problems((50257, 16), mesh)
    assert why and "divisible by its 8 shards" in why[0] and "inside a program" in why[0]
    assert s.problems((50257, 16), mesh, uneven=True) == []
    assert s.uneven_dims((50257, 16), mesh) == (0,)
    assert s.uneven_dims((50264, 16), mesh) == ()
    assert s.padded_shape((50257, 16), mesh) == (50264, 16)
    assert s.local_shape((50257, 16), mesh) == (6283, 16)
    assert s.axis_roles((50257, 16), mesh) == (("dim", 0, 6283),)
    assert ShardingSpec.from_axis_roles(s.axis_roles((50257, 16), mesh), (50257, 16),
                                        mesh) == s
    # strided uneven splits and splits into more shards than elements are not offered
    assert ShardingSpec.parse("S[x/s2]·R").problems((50257, 16), mesh, uneven=True)
    assert s.problems((5, 16), mesh, uneven=True)
    with pytest.raises(InvalidSpecError, match="divisible by its 8 shards"):
        s.check((50257, 16), mesh)


def test_resharding_an_uneven_split_moves_the_padded_shards():
    mesh, cost = AbstractMesh((8,)), CostModel((1e-5,), (1e-9,))
    t = TensorType("f32", (50257, 16))
    gather = reshard(ShardingSpec.parse("S[x]·R"), ShardingSpec.parse("R·R"), t, mesh, cost)
    assert [(c.kind, c.bytes) for c in gather.collectives] == [("all-gather", 50264 * 16 * 4)]
    move = reshard(ShardingSpec.parse("R·S[x]"), ShardingSpec.parse("S[x]·R"), t, mesh, cost)
    assert [(c.kind, c.bytes) for c in move.collectives] == [("all-to-all",
                                                              50264 * 16 * 4 // 8)]
    assert reshard(ShardingSpec.parse("R·R"), ShardingSpec.parse("S[x]·R"), t, mesh,
                   cost).is_free


@pytest.mark.parametrize("src,dst", [("S[y]·R", "R·S[x]"), ("R·S[x]", "S[y]·R"),
                                     ("S[x]·R", "R·S[y]"), ("S[y]·R", "S[x]·R")])
def test_a_slice_beside_a_gather_is_priced_as_xla_runs_it(src, dst):
    """A local slice into one dim beside a gather of another: XLA gathers the whole and
    slices after (the model priced slice-then-gather, half the bytes, until a generated
    step on (2, 4) showed it); a slice of the dim being gathered still comes first. The
    model's all-gather bytes are the compiled program's (a canary on XLA's partitioner)."""
    import re
    from jax.sharding import Mesh, NamedSharding

    mesh, cost = AbstractMesh((2, 4)), CostModel((1e-5, 1e-5), (1e-9, 1e-9))
    t = TensorType("f32", (512, 128))
    a, b = ShardingSpec.parse(src, mesh), ShardingSpec.parse(dst, mesh)
    planned = sum(c.bytes for c in reshard(a, b, t, mesh, cost).collectives
                  if c.kind == "all-gather")
    jmesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))

    def pspec(spec):
        return jax.sharding.PartitionSpec(*[("x", "y")[d.axes[0]] if d.axes else None
                                            for d in spec.dims])

    def f(v):
        v = jax.lax.with_sharding_constraint(v * 2, NamedSharding(jmesh, pspec(a)))
        return jax.lax.with_sharding_constraint(v + 1, NamedSharding(jmesh, pspec(b)))
    text = jax.jit(f).lower(jnp.ones(t.dims)).compile().as_text()
    gathered = [int(np.prod([int(x) for x in m.group(1).split(",")])) * 4
                for m in re.finditer(r"= f32\[([\d,]+)\]\S* all-gather\(", text)]
    assert gathered == [planned]


# ------------------------------------------------------------------------------ build
def _lm_head(w, h, y):
    def loss(w):
        logits = h @ w.T
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[:, 0] * y)
    value, g = jax.value_and_grad(loss)(w)
    return w - 0.1 * g, value


def _lm_args(vocab=1001, hidden=32, batch=16):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(k[0], (vocab, hidden)) * 0.1,
            jax.random.normal(k[1], (batch, hidden)), jax.random.normal(k[2], (batch,)))


def test_the_build_splits_unevenly_inside_only_and_prices_the_padding():
    graph = rhino.ingest(_lm_head, *_lm_args())
    mesh, cost = AbstractMesh((8,)), CostModel.simulated_cpu(1)
    even = build_problem(graph, mesh, cost, BuildOptions(strided=False))
    padded = build_problem(graph, mesh, cost, BuildOptions(strided=False, uneven=True))
    boundary = set(graph.params) | set(graph.outputs)

    def uneven(built, i):
        t = graph.ops[i].shape
        return [s for s in built.strategies[i] if isinstance(t, TensorType)
                and isinstance(s.out_spec, ShardingSpec) and s.out_spec.uneven_dims(t.dims, mesh)]

    assert not any(uneven(even, op.id) for op in graph.ops)
    assert not any(uneven(padded, i) for i in boundary)
    inside = [op for op in graph.ops if op.id not in boundary and uneven(padded, op.id)]
    assert any(op.opcode == "dot" for op in inside)
    # compute at the padded size: a dot split over the 1001 rows runs 126 of them per device
    dot = next(op for op in inside if op.opcode == "dot")
    s = uneven(padded, dot.id)[0]
    whole = next(x for x in padded.strategies[dot.id] if x.label.endswith("[R]"))
    assert s.compute_cost == pytest.approx(whole.compute_cost * 126 / 1001, rel=1e-9)
    # memory at the padded size: 126 rows of the 1001 a device
    j = padded.strategies[dot.id].index(s)
    t = dot.shape
    assert padded.activation_bytes[dot.id][j] == pytest.approx(
        t.nbytes / t.dims[s.out_spec.uneven_dims(t.dims, mesh)[0]] * 1008 / 8)
    # and the solution, checked from scratch, prices what it chose (validate_built)
    sol = solve_ilp(padded.problem)
    validate_built(padded, sol.choice)
    assert sol.objective <= solve_ilp(even.problem).objective * (1 + 1e-9)


def test_validation_refuses_an_uneven_argument():
    graph = rhino.ingest(_lm_head, *_lm_args())
    mesh, cost = AbstractMesh((8,)), CostModel.simulated_cpu(1)
    built = build_problem(graph, mesh, cost, BuildOptions(strided=False, uneven=True))
    plan = list(built.plan(solve_ilp(built.problem).choice))
    w = graph.params[0]
    plan[w] = dataclasses.replace(plan[w], out_spec=ShardingSpec.parse("S[x]·R"))
    with pytest.raises(PlanValidationError, match="unevenly"):
        validate_plan(graph, mesh, cost, plan, carried=built.carried)


# ------------------------------------------------------------------------------ user path
def test_gpt_with_the_gpt2_vocabulary_splits_its_embedding_and_matches_jit():
    """GPT-2's vocabulary of 50257 on 8 devices: the embedding arrives split by its columns
    (even), is split by its rows inside (padded to 50264), and the step equals jax.jit."""
    m = get_model("gpt", layers=1, hidden=64, heads=4, seq=32, vocab=50257, batch=8)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    args = (params, opt, batch)
    step = rhino.auto_parallel(m.step, mesh_shape=(8,), report=False)
    plan = _compiled_matches_plan(step, args)
    assert not plan.param_spec("params['wte']").is_replicated
    rows = [u for u in _uneven_values(plan) if 50257 in _dims(u.shape)]
    assert rows, "no value split over the vocabulary"
    assert all(50264 in _dims(u.padded) for u in rows)
    # the report names them, and a saved plan keeps them
    text = step.report_for(*args)
    assert "uneven splits" in text and "50264]" in text
    assert type(plan).from_json(plan.to_json()).uneven == plan.uneven
    # the same search without uneven splits keeps the table whole and moves far more
    evenly = rhino.plan(m.step, *args, mesh_shape=(8,), build=_EVENLY).spmd
    assert evenly.param_spec("params['wte']").is_replicated
    moved = sum(c.bytes for c in plan.collectives)
    assert moved * 3 < sum(c.bytes for c in evenly.collectives)
    assert plan.step_time_s < evenly.step_time_s

    p1 = assert_trains_like_jit(step, jax.jit(m.step), params, opt, batch)
    assert p1["wte"].shape == (50257, 64)


def _mlp_step(params, x, y):
    def loss(params):
        h = x
        for w in params[:-1]:
            h = jnp.tanh(h @ w)
        return jnp.mean((h @ params[-1] - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return [w - 0.05 * g for w, g in zip(params, grads)], value


def test_a_3x4_mesh_plans_uneven_splits():
    """On (3, 4), dimensions of 256 do not divide by 3: the search splits some values over
    the axis of 3 with padding and estimates the step cheaper than without."""
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    params = [jax.random.normal(k[i], (256, 256)) * 0.05 for i in range(3)]
    args = (params, jax.random.normal(k[3], (256, 256)), jax.random.normal(k[4], (256, 256)))
    plan = rhino.plan(_mlp_step, *args, mesh_shape=(3, 4), opt_level="O3").spmd
    evenly = rhino.plan(_mlp_step, *args, mesh_shape=(3, 4), opt_level="O3", build=_EVENLY).spmd
    split = [ShardingSpec.parse(u.spec, plan.mesh) for u in _uneven_values(plan)]
    assert any(s.dims[d].axes == (0,) for s, u in zip(split, plan.uneven)
               for d in s.uneven_dims(_dims(u.shape), plan.mesh))      # over the axis of 3
    assert plan.step_time_s < evenly.step_time_s
    assert all(not p.spec.uneven_dims(_dims(p.shape), plan.mesh) for p in plan.params)


# ------------------------------------------------------------------------------ generated
_ODD = (99, 127, 150, 200, 255, 257, 300, 383, 500, 513, 640, 769, 1000, 1025)
_MESHES = ((3,), (5,), (6,), (7,), (8,), (2, 3), (3, 2), (2, 4))


def _generated(seed: int):
    """A training step with random, mostly indivisible dimensions: a few dense layers
    with biases and one of tanh / relu / softmax between them, a squared or
    cross-entropy loss, and SGD; and a mesh of 3 to 8 devices."""
    rnd = random.Random(seed)
    depth = rnd.randint(1, 3)
    dims = [rnd.choice(_ODD) for _ in range(depth + 1)]
    batch = rnd.choice(_ODD[:9])
    acts = [rnd.choice(("tanh", "relu", "softmax")) for _ in range(depth)]
    xent = rnd.random() < 0.5
    mesh = rnd.choice(_MESHES)
    k = jax.random.split(jax.random.PRNGKey(seed), 2 * depth + 2)
    params = [{"w": jax.random.normal(k[2 * i], (dims[i], dims[i + 1])) / dims[i] ** 0.5,
               "b": jax.random.normal(k[2 * i + 1], (dims[i + 1],)) * 0.1}
              for i in range(depth)]
    x = jax.random.normal(k[-2], (batch, dims[0]))
    y = (jax.nn.one_hot(jax.random.randint(k[-1], (batch,), 0, dims[-1]), dims[-1]) if xent
         else jax.random.normal(k[-1], (batch, dims[-1])))

    def step(params, x, y):
        def loss(params):
            h = x
            for layer, act in zip(params, acts):
                h = h @ layer["w"] + layer["b"]
                h = (jnp.tanh(h) if act == "tanh" else jax.nn.relu(h) if act == "relu"
                     else jax.nn.softmax(h, axis=-1))
            if xent:
                return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(h, axis=-1), axis=-1))
            return jnp.mean((h - y) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    return step, (params, x, y), mesh


_SEEDS = list(range(64))     # 130 seeds passed when this was written
_DEFAULT_SEEDS = set(range(8))


@pytest.mark.parametrize("seed", [pytest.param(s, marks=() if s in _DEFAULT_SEEDS
                                               else pytest.mark.slow) for s in _SEEDS])
def test_generated_steps_with_indivisible_dimensions_match_jit(seed):
    step, args, mesh = _generated(seed)
    devices = jax.devices()[:int(np.prod(mesh))]
    want = jax.jit(step)(*args)
    auto = rhino.auto_parallel(step, devices=devices, mesh_shape=mesh,
                               opt_level="O3" if seed % 2 else "O2", report=False)
    plan = auto.plan_for(*args).spmd
    _uneven_values(plan)
    got = auto(*jax.tree.map(jnp.copy, args))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    compiled = summarize(count_collectives(auto.compiled_text(*args)))
    total = sum(b for _, b in compiled.values())
    planned = sum(b for _, b in plan.collective_summary().values())
    assert abs(total - planned) <= 0.01 * max(planned, 1), (compiled,
                                                           plan.collective_summary())


def test_the_generated_steps_do_split_unevenly():
    """The generator is not vacuous: most of its plans split some value unevenly."""
    hits = 0
    for seed in sorted(_DEFAULT_SEEDS):
        step, args, mesh = _generated(seed)
        plan = rhino.plan(step, *args, mesh_shape=mesh, opt_level="O3").spmd
        hits += bool(_uneven_values(plan))
    assert hits >= len(_DEFAULT_SEEDS) // 2, hits


def test_a_named_scope_inside_the_step_may_be_pinned_to_an_uneven_split():
    """A user's pin on logits of 1001 classes over 8 devices is a padded split inside the
    step (accepted and run equal to jax.jit); the same split of an argument is refused."""
    from jax.sharding import PartitionSpec as P

    def step(w, h, y):
        def loss(w):
            with jax.named_scope("logits"):
                logits = h @ w.T
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[:, 0] * y)
        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value

    args = _lm_args()
    auto = rhino.auto_parallel(step, mesh_shape=(8,), annotations={"logits": P(None, "x")},
                               report=False)
    plan = auto.plan_for(*args).spmd
    assert any(u.spec == "R·S[x]" and u.shape == "f32[16,1001]" for u in _uneven_values(plan))
    want = jax.jit(step)(*args)
    for a, b in zip(auto(*jax.tree.map(jnp.copy, args)), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    bad = rhino.auto_parallel(step, mesh_shape=(8,), annotations={"w": P("x")}, report=False)
    with pytest.raises(rhino.errors.RhinoError, match="inside a program"):
        bad.plan_for(*args)
