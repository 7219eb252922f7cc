"""Building sharding problems, exact solves, and the independent validator.

Cost constants: the tests use ``CostModel.simulated_cpu`` (α = 10 µs per collective,
β = 1/(5 GB/s), 50 GFLOP/s). α is charged once per collective, so one all-reduce beats the
equivalent reduce-scatter + all-gather pair by α; that margin is what makes plain data
parallelism (rather than a ZeRO-style sharded update with the same bytes) and Megatron's
single all-reduce (rather than reduce-scatter + all-gather around a batch-split loss) the
unique optima below.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino
from rhino.models import MODEL_NAMES, get_model
from rhino.planner.build import BuildOptions, PlanningError, build_problem, carried_pairs
from rhino.planner.collectives import all_reduce_cost, reshard
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh
from rhino.planner.solvers import solve_ilp
from rhino.planner.spec import ShardingSpec
from rhino.planner.validate import PlanValidationError, validate_built, validate_plan

F32 = jnp.float32
MESH4 = AbstractMesh((4,))
CPU1 = CostModel.simulated_cpu(1)


def sds(*shape):
    return jax.ShapeDtypeStruct(shape, F32)


def mlp_step(params, x, y):
    """2-layer MLP, MSE loss, plain SGD: returns the updated params."""
    def loss(p):
        h = jax.nn.relu(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)


def mlp_graph(batch, hidden):
    params = {"w1": sds(hidden, hidden), "w2": sds(hidden, hidden)}
    return rhino.ingest(mlp_step, params, sds(batch, hidden), sds(batch, hidden))


def solve_and_validate(built):
    sol = solve_ilp(built.problem, time_limit=60)
    assert sol.status == "optimal"
    check = validate_built(built, sol.choice, sol.objective)
    assert check.total == pytest.approx(sol.objective, rel=1e-9)
    return sol, built.plan(sol.choice)


def param_spec(g, plan, name):
    p = next(p for p in g.params if g.ops[p].arg.path.endswith(f"['{name}']"))
    return plan[p].out_spec.to_str(MESH4)


def test_mlp_data_parallel():
    g = mlp_graph(1024, 128)
    built = build_problem(g, MESH4, CPU1)
    assert {g.ops[p].arg.path for _, p in built.carried} == {"params['w1']", "params['w2']"}
    sol, plan = solve_and_validate(built)
    assert param_spec(g, plan, "w1") == "R·R" and param_spec(g, plan, "w2") == "R·R"
    for op, st in zip(g.ops, plan):
        if op.opcode == "dot" and op.shape.dims == (1024, 128):
            assert st.out_spec.to_str(MESH4) == "S[x]·R", st.describe(MESH4)
    x = next(p for p in g.params if g.ops[p].arg.path == "x")
    first = next(op for op in g.ops if op.opcode == "dot" and x in op.operands)
    assert plan[first.id].in_specs[first.operands.index(x)].to_str(MESH4) == "S[x]·R"
    comm = built.breakdown(sol.choice).communication
    assert comm == pytest.approx(2 * all_reduce_cost(128 * 128 * 4, (0,), MESH4, CPU1), rel=1e-12)


def test_mlp_megatron():
    g = mlp_graph(128, 1024)
    built = build_problem(g, MESH4, CPU1)
    sol, plan = solve_and_validate(built)
    assert param_spec(g, plan, "w1") == "R·S[x]"      # columns
    assert param_spec(g, plan, "w2") == "S[x]·R"      # rows
    comm = built.breakdown(sol.choice).communication
    assert comm == pytest.approx(all_reduce_cost(128 * 1024 * 4, (0,), MESH4, CPU1), rel=1e-12)


def attention_graph(B=2, S=16, H=256, heads=8):
    hd = H // heads

    def loss(p, x):
        qkv = (x @ p["wqkv"]).reshape(B, S, 3, heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        probs = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, H)
        return jnp.mean((out @ p["wo"]) ** 2)

    def step(p, x):
        grads = jax.grad(loss)(p, x)
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)
    return rhino.ingest(step, {"wqkv": sds(H, 3 * H), "wo": sds(H, H)}, sds(B, S, H))


def test_fused_qkv_head_parallel_needs_strides():
    g = attention_graph()
    built = build_problem(g, MESH4, CPU1)
    sol, plan = solve_and_validate(built)
    fwd = next(op for op in g.ops if op.opcode == "reshape" and op.shape.rank == 5)
    st = plan[fwd.id]
    src = plan[fwd.operands[0]].out_spec
    # Head-parallel: heads dim of [B,S,3,heads,hd] split; the fused [B,S,3H] side is
    # strided (2 heads x 32 = 64 per chunk) and the reshape costs nothing.
    assert st.out_spec.to_str(MESH4) == "R·R·R·S[x]·R"
    assert st.in_specs[0].to_str(MESH4) == "R·R·S[x/s64]"
    assert reshard(src, st.in_specs[0], g.ops[fwd.operands[0]].shape, MESH4, CPU1).cost == 0.0
    assert param_spec(g, plan, "wqkv") == "R·S[x/s64]"
    assert param_spec(g, plan, "wo") == "S[x]·R"
    for op in g.ops:
        if op.opcode == "dot" and op.shape.rank == 4:            # per-head attention dots
            assert plan[op.id].out_spec.dims[1].axes == (0,), plan[op.id].describe(MESH4)
    comm = built.breakdown(sol.choice).communication
    assert comm == pytest.approx(all_reduce_cost(2 * 16 * 256 * 4, (0,), MESH4, CPU1), rel=1e-12)

    blocked = build_problem(g, MESH4, CPU1, BuildOptions(strided=False))
    sol_b, plan_b = solve_and_validate(blocked)
    assert not any(d.stride for s in plan_b for d in s.out_spec.dims)
    assert sol.objective < sol_b.objective * (1 - 1e-6)


def test_validator_rejects_corrupted_plans():
    g = mlp_graph(128, 1024)
    built = build_problem(g, MESH4, CPU1)
    sol = solve_ilp(built.problem)
    plan = list(built.plan(sol.choice))
    # 1. A dot whose operands split the contracting dim but whose output is not partial.
    k = next(i for i, s in enumerate(plan) if g.ops[i].opcode == "dot"
             and s.out_spec.is_partial)
    bad = list(plan)
    bad[k] = dataclasses.replace(plan[k], out_spec=plan[k].out_spec.without_partial())
    with pytest.raises(PlanValidationError, match=rf"op #{k} .*dot.*mesh axis x"):
        validate_plan(g, MESH4, CPU1, bad, carried=built.carried)
    # 2. A wrong objective.
    with pytest.raises(PlanValidationError, match="objective: recomputed"):
        validate_plan(g, MESH4, CPU1, plan, objective=sol.objective * 1.001, carried=built.carried)
    # 3. A compute cost that pretends more sharing.
    bad = list(plan)
    bad[k] = dataclasses.replace(plan[k], compute_cost=plan[k].compute_cost / 2)
    with pytest.raises(PlanValidationError, match="compute cost"):
        validate_plan(g, MESH4, CPU1, bad, carried=built.carried)
    # 4. A spec that does not divide its tensor: refused on a parameter (JAX holds no
    # uneven split at a jit boundary; inside, test_uneven.py), and a split into more shards
    # than a dimension has elements anywhere.
    p = g.params[0]
    bad = list(plan)
    bad[p] = dataclasses.replace(plan[p], out_spec=ShardingSpec.parse("S[x]·R"))
    mesh3 = AbstractMesh((3,))
    with pytest.raises(PlanValidationError, match="unevenly"):
        validate_plan(g, mesh3, CPU1, bad)
    with pytest.raises(PlanValidationError, match="divisible"):
        validate_plan(g, AbstractMesh((2048,)), CPU1, bad)
    # 5. A reshape that would move data.
    ga = attention_graph(H=64, heads=4)
    ba = build_problem(ga, MESH4, CPU1)
    choice = [0] * len(ga.ops)
    plan_a = list(ba.plan(choice))
    r = next(op for op in ga.ops if op.opcode == "reshape" and op.shape.rank == 5)
    plan_a[r.id] = dataclasses.replace(plan_a[r.id], in_specs=(ShardingSpec.parse("R·R·S[x]"),),
                                       out_spec=ShardingSpec.parse("R·R·R·S[x]·R"))
    with pytest.raises(PlanValidationError, match="moves data"):
        validate_plan(ga, MESH4, CPU1, plan_a)
    # 6. The right plan passes.
    validate_built(built, sol.choice, sol.objective)


def test_options_forced_pinned_memory():
    g = mlp_graph(64, 32)
    w1 = next(p for p in g.params if g.ops[p].arg.path == "params['w1']")
    built = build_problem(g, MESH4, CPU1, BuildOptions(forced_sharded=frozenset({w1}),
                                                 optimizer_state_multiplier=2.0))
    assert all(not s.out_spec.is_replicated for s in built.strategies[w1])
    mem = dict(zip((s.out_spec.to_str(MESH4) for s in built.strategies[w1]),
                   built.problem.memory[w1]))
    assert mem["S[x]·R"] == 3 * 32 * 32 * 4 / 4
    pinned = build_problem(g, MESH4, CPU1, BuildOptions(pinned={w1: ShardingSpec.parse("R·S[x]")}))
    assert [s.out_spec.to_str(MESH4) for s in pinned.strategies[w1]] == ["R·S[x]"]
    with pytest.raises(PlanningError, match="expected one of its output specs"):
        build_problem(g, MESH4, CPU1, BuildOptions(pinned={w1: ShardingSpec.parse("P(sum@x)")}))
    with pytest.raises(PlanningError, match="forced_sharded"):
        build_problem(g, MESH4, CPU1, BuildOptions(forced_sharded=frozenset({len(g.ops) - 1})))
    assert build_problem(g, MESH4, CPU1, BuildOptions(carry_outputs=False)).carried == ()


def test_non_carried_outputs_resolve_partials():
    g = rhino.ingest(lambda x, w: jnp.sum(x @ w), sds(8, 16), sds(16, 4))
    built = build_problem(g, MESH4, CPU1)
    assert built.carried == ()
    out = g.outputs[0]
    for st in built.strategies[out]:
        want = reshard(st.out_spec, st.out_spec.without_partial(), g.ops[out].shape, MESH4, CPU1).cost
        assert st.comm_cost == want
    sol = solve_ilp(built.problem)
    validate_built(built, sol.choice, sol.objective)


@pytest.fixture(scope="module")
def zoo_graphs():
    graphs = {}
    for name in MODEL_NAMES:
        m = get_model(name)
        graphs[name] = rhino.ingest(m.step, *m.example_args())
    return graphs


@pytest.mark.parametrize("shape", [(8,), (2, 4)])
def test_zoo_builds_and_random_plans_validate(zoo_graphs, shape):
    mesh, cost = AbstractMesh(shape), CostModel.simulated_cpu(len(shape))
    rng = np.random.default_rng(0)
    for name, g in zoo_graphs.items():
        built = build_problem(g, mesh, cost)   # its time is benchmarks/spmd_search.py's to record
        built.partition.check(built.problem)
        assert built.problem.num_nodes == len(g.ops)
        assert len(built.carried) >= len(g.params) // 2 - 1, name
        for u in built.unknown_ops:
            assert built.problem.num_choices(u.id) == 1
        pending = {sv.op: set(sv.pending) for sv in built.shared}
        choice = []
        for i in range(built.problem.num_nodes):  # pending twins: feasible only sometimes
            n = built.problem.num_choices(i) - len(pending.get(i, ()))
            choice.append(int(rng.integers(n)))
        validate_built(built, choice)


def test_zoo_o2_plan_validates(zoo_graphs):
    from rhino.planner.hierarchical import solve_o2
    g = zoo_graphs["gpt"]
    built = build_problem(g, AbstractMesh((8,)), CostModel.simulated_cpu(1))
    sol = solve_o2(built.problem, built.partition, time_limit=60)
    check = validate_built(built, sol.choice, sol.objective)
    assert check.total == pytest.approx(sol.objective, rel=1e-9)


def test_carried_pairs_zoo(zoo_graphs):
    g = zoo_graphs["mlp"]
    pairs = carried_pairs(g)
    paths = {(g.output_info[g.outputs.index(o)].path, g.ops[p].arg.path) for o, p in pairs}
    assert ("out[0]['layers'][0]['w']", "params['layers'][0]['w']") in paths
    assert any(p.startswith("opt_state") for _, p in paths)
    assert all(g.ops[o].shape == g.ops[p].shape for o, p in pairs)


def test_carried_pairs_read_attributes_and_string_keys_alike():
    """An argument flattened by attribute (a namedtuple, a Flax NNX module: ``p.w``) and
    its update returned as a dict (``nnx.state(...)``: ``['w']``), behind the loss."""
    import collections

    P = collections.namedtuple("P", "w b")

    def step(x, p):
        loss = jnp.sum(x @ p.w + p.b)
        return loss, {"w": p.w - 0.1 * loss, "b": p.b * 0.5}

    g = rhino.ingest(step, jnp.ones((8, 4)), P(jnp.ones((4, 2)), jnp.ones((2,))))
    paired = {g.output_info[g.outputs.index(o)].path: g.ops[p].arg.path
              for o, p in carried_pairs(g)}
    assert paired == {"out[1]['w']": "p.w", "out[1]['b']": "p.b"}, paired


def test_carried_pairs_count_arguments_without_leaves():
    """``step(params, opt_state, ema, x)`` with SGD's empty optimizer state: ``out[2]`` is
    the third argument's update (``ema``), though only three arguments have leaves."""
    import optax

    def step(params, opt_state, ema, x):
        g = jax.grad(lambda p: jnp.sum(x @ p["w"]))(params)
        return {"w": params["w"] - 0.1 * g["w"]}, opt_state, 0.9 * ema + x.mean(0), 0.0

    g = rhino.ingest(step, {"w": jnp.ones((4, 2))}, optax.sgd(0.1).init(None),
                     jnp.zeros((4,)), jnp.ones((8, 4)))
    paired = {g.output_info[g.outputs.index(o)].path: g.ops[p].arg.path
              for o, p in carried_pairs(g)}
    assert paired == {"out[0]['w']": "params['w']", "out[2]": "ema"}, paired


# ------------------------------------------------------------------ shared pending sums
def _three_readers():
    def f(x, w):
        y = x @ w                       # a pending sum when the contraction is split
        return jnp.tanh(y), jnp.exp(y), jnp.sin(y)
    g = rhino.ingest(f, sds(64, 1024), sds(1024, 64))
    x, w = g.params
    return g, {x: ShardingSpec.parse("R·S[x]"), w: ShardingSpec.parse("S[x]·R")}


@pytest.mark.parametrize("passthrough", [False, True])
def test_pending_sum_with_three_readers_is_reduced_once(passthrough):
    from rhino.planner.api import predicted_collectives
    g, pins = _three_readers()
    built = build_problem(g, MESH4, CPU1, BuildOptions(pinned=pins, partial_passthrough=passthrough))
    sol, plan = solve_and_validate(built)
    dot = next(op for op in g.ops if op.opcode == "dot")
    assert plan[dot.id].out_spec.to_str(MESH4) == "R·R·P(sum@x)"
    assert built.resolved(sol.choice) == {dot.id}
    # One all-reduce of y, not one per reader (per-edge charging gave exactly 3).
    ar = all_reduce_cost(64 * 64 * 4, (0,), MESH4, CPU1)
    assert built.breakdown(sol.choice).communication == pytest.approx(ar, rel=1e-12)
    coll = predicted_collectives(built, plan, built.resolved(sol.choice))
    assert [(c.kind, c.bytes, c.tensor) for c in coll] == [("all-reduce", 64 * 64 * 4, dot.name)]
    # The validator recomputes the same and refuses a pending sum left unreduced.
    with pytest.raises(PlanValidationError, match="expected it reduced once"):
        validate_plan(g, MESH4, CPU1, plan, resolved=())
    with pytest.raises(PlanValidationError, match="reduced once: expected a pending sum"):
        validate_plan(g, MESH4, CPU1, plan, resolved={dot.id, g.params[0]})


def test_pending_sum_read_as_pending_is_not_reduced():
    # Two linear readers can carry the pending sum to the scalar outputs: then the only
    # reductions are of the scalars, and y's pending twin (no reduction) is chosen.
    def f(x, w):
        y = x @ w
        return jnp.sum(2.0 * y) + jnp.sum(3.0 * y)
    g = rhino.ingest(f, sds(64, 1024), sds(1024, 64))
    x, w = g.params
    pins = {x: ShardingSpec.parse("R·S[x]"), w: ShardingSpec.parse("S[x]·R")}
    built = build_problem(g, MESH4, CPU1, BuildOptions(pinned=pins))
    dot = next(op for op in g.ops if op.opcode == "dot")
    (sv,) = [sv for sv in built.shared if sv.op == dot.id]
    assert sv.pending and len(sv.readers) == 2
    sol, plan = solve_and_validate(built)
    assert sol.choice[dot.id] in sv.pending and dot.id not in built.resolved(sol.choice)
    comm = built.breakdown(sol.choice).communication
    assert comm == pytest.approx(all_reduce_cost(4, (0,), MESH4, CPU1), rel=1e-9)  # the scalar
    from rhino.planner.hierarchical import solve_o2
    o2 = solve_o2(built.problem, built.partition)
    assert o2.objective == pytest.approx(sol.objective, rel=1e-9)
    validate_built(built, o2.choice, o2.objective)


def ffn_graph(tokens=64, hidden=256, ffn=1024):
    """x0 = x @ w0; pre-layernorm FFN with a residual: the backward of the FFN's first
    matmul feeds the layernorm backward, which reads it three times (GPT's pattern)."""
    from handmade import ffn_layernorm_step as step

    params = {"w0": sds(hidden, hidden), "w1": sds(hidden, ffn), "w2": sds(ffn, hidden)}
    return rhino.ingest(step, params, sds(tokens, hidden))


@pytest.mark.parametrize("passthrough", [False, True])
def test_ffn_with_layernorm_is_megatron_with_three_all_reduces(passthrough):
    from rhino.planner.hierarchical import solve_o2
    g = ffn_graph()
    built = build_problem(g, MESH4, CPU1, BuildOptions(strided=False,
                                                 partial_passthrough=passthrough))
    sol, plan = solve_and_validate(built)
    assert param_spec(g, plan, "w1") == "R·S[x]"      # columns
    assert param_spec(g, plan, "w2") == "S[x]·R"      # rows
    # Hand-derived: all-reduces of three [64, 256] f32 pending sums, each read 2-4 times —
    # x0 = x @ w0 (w0 row-split), the FFN output, and the FFN input's gradient. Charged
    # per reader edge, the same plan cost 2.3x more and the search picked another.
    ar = all_reduce_cost(64 * 256 * 4, (0,), MESH4, CPU1)
    assert built.breakdown(sol.choice).communication == pytest.approx(3 * ar, rel=1e-9)
    o2 = solve_o2(built.problem, built.partition)
    assert o2.objective == pytest.approx(sol.objective, rel=1e-9)
    validate_built(built, o2.choice, o2.objective)
