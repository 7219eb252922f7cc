"""rhino.auto_parallel on 8 simulated CPU devices: numerics against single-device jax.jit,
collectives of the compiled program against the plan, annotations, plan reuse, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino
from rhino.errors import RhinoError
from rhino.models import get_model
from rhino.runtime.executors.spmd import ShardingMismatchError, count_collectives, summarize

# Adam divides by sqrt(v): where a gradient is ~0, a last-bit difference from another
# reduction order moves that element by up to a fraction of one step (lr = 1e-3), so
# parameters are compared with rtol 1e-4 plus an atol of 5% of a step.
RTOL, ATOL = 1e-4, 5e-5

MODELS = {
    "mlp": dict(batch=64, hidden=128),
    "gpt": dict(layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=8),
    "moe": dict(layers=2, hidden=64, heads=4, seq=16, vocab=256, batch=8, experts=4),
    "wide_resnet": dict(batch=8, image=16, base_channels=8, layers=10),
}


def _train(model, step_fn, steps, params, opt, batch):
    losses = []
    for _ in range(steps):
        params, opt, loss = step_fn(params, opt, batch)
        losses.append(float(loss))
    return params, losses


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


# The default suite runs one case per model; the whole matrix (4 models x 2 meshes x
# O2/O3) is marked slow: python -m pytest -m slow tests/test_auto_parallel.py
_DEFAULT = {("mlp", (2, 4), "O3"), ("gpt", (8,), "O2"), ("gpt", (2, 4), "O3"),
            ("moe", (8,), "O3"), ("wide_resnet", (8,), "O2")}
CASES = [pytest.param(n, m, o, marks=() if (n, m, o) in _DEFAULT else pytest.mark.slow)
         for n in MODELS for m in [(8,), (2, 4)] for o in ["O2", "O3"]]


@pytest.mark.parametrize("name,mesh,opt_level", CASES)
def test_training_matches_single_device(name, mesh, opt_level):
    model = get_model(name, **MODELS[name])
    params, opt = model.init(jax.random.PRNGKey(0))
    batch = model.make_batch(jax.random.PRNGKey(1))
    ref_params, ref_losses = _train(model, jax.jit(model.step), 10, params, opt, batch)
    step = rhino.auto_parallel(model.step, mesh_shape=mesh, opt_level=opt_level)
    got_params, got_losses = _train(model, step, 10, _copy(params), _copy(opt), batch)
    np.testing.assert_allclose(got_losses, ref_losses, rtol=RTOL)
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
    # Outputs keep the plan's shardings, so the next step's inputs need no movement.
    plan = step.plan_for(params, opt, batch).spmd
    leaf = jax.tree.leaves(got_params)[0]
    assert leaf.sharding.mesh.devices.shape == mesh
    assert plan.mesh.shape == mesh and plan.search.opt_level == opt_level


def _compare_collectives(step, args, exact_counts: bool):
    plan = step.plan_for(*args).spmd
    got = summarize(count_collectives(step.compiled_text(*args)))
    want = plan.collective_summary()

    def fold(d):  # XLA may run an all-to-all resharding as a collective-permute
        d = dict(d)
        if "collective-permute" in d:
            c, b = d.pop("collective-permute")
            c0, b0 = d.get("all-to-all", (0, 0))
            d["all-to-all"] = (c0 + c, b0 + b)
        return d

    got, want = fold(got), fold(want)
    assert set(got) == set(want), (got, want)
    total_got = sum(b for _, b in got.values())
    total_want = sum(b for _, b in want.values())
    # Pending sums are reduced once and readers of one value in one layout share the
    # resharding (as XLA does), so the prediction is exact here (it allowed 10% before).
    assert abs(total_got - total_want) <= 0.01 * total_want, (got, want)
    for kind in want:
        if exact_counts:
            assert got[kind][0] == want[kind][0], (kind, got, want)
        else:
            # On 2-D meshes XLA sometimes merges or splits per-axis reductions differently
            # from the plan (known gap); counts must agree to 20%, bytes to 10% overall.
            assert abs(got[kind][0] - want[kind][0]) <= max(2, 0.2 * want[kind][0]), (got, want)
    return plan, got


def test_mlp_collectives_data_parallel():
    m = get_model("mlp", batch=1024, hidden=128)
    step = rhino.auto_parallel(m.step, mesh_shape=(4,), opt_level="O3")
    plan, got = _compare_collectives(step, m.example_args(), exact_counts=True)
    # Data parallel: the batch split, weights replicated, gradients all-reduced.
    assert plan.param_spec("batch['inputs']").to_str(plan.mesh) == "S[x]·R"
    assert plan.param_spec("params['layers'][0]['w']").is_replicated
    assert set(got) == {"all-reduce"}


def test_mlp_collectives_megatron():
    m = get_model("mlp", batch=128, hidden=1024)
    step = rhino.auto_parallel(m.step, mesh_shape=(4,), opt_level="O3")
    plan, got = _compare_collectives(step, m.example_args(), exact_counts=True)
    assert plan.param_spec("params['layers'][0]['w']").to_str(plan.mesh) == "R·S[x]"
    assert plan.param_spec("params['layers'][1]['w']").to_str(plan.mesh) == "S[x]·R"
    assert got == {"all-reduce": (1, 128 * 1024 * 4)}


def test_gpt_collectives_1d():
    m = get_model("gpt", layers=2)
    step = rhino.auto_parallel(m.step, mesh_shape=(8,), opt_level="O2")
    _compare_collectives(step, m.example_args(), exact_counts=True)


def test_gpt_collectives_2d():
    m = get_model("gpt", layers=2)
    step = rhino.auto_parallel(m.step, mesh_shape=(2, 4), opt_level="O2")
    _compare_collectives(step, m.example_args(), exact_counts=True)


def test_annotation_pins_embedding_to_vocabulary_split():
    m = get_model("gpt", **MODELS["gpt"])
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    # O3 (exact): a pin cannot beat the free optimum (O2 is a heuristic; on this tiny
    # GPT it lands 1.9% above the optimum, so the comparison would not test the pin).
    free = rhino.auto_parallel(m.step, mesh_shape=(8,), opt_level="O3").plan_for(
        params, opt, batch).spmd
    step = rhino.auto_parallel(m.step, mesh_shape=(8,), opt_level="O3",
                               annotations={"params['wte']": "S[x]·R"})
    plan = step.plan_for(params, opt, batch).spmd
    assert plan.param_spec("params['wte']").to_str(plan.mesh) == "S[x]·R"
    assert plan.search.objective >= free.search.objective - 1e-12
    ref_params, ref_losses = _train(m, jax.jit(m.step), 3, params, opt, batch)
    got_params, got_losses = _train(m, step, 3, _copy(params), _copy(opt), batch)
    np.testing.assert_allclose(got_losses, ref_losses, rtol=RTOL)
    assert got_params["wte"].sharding.spec[0] == "x"


def test_contradictory_annotations_are_clear_errors():
    m = get_model("gpt", **MODELS["gpt"])
    args = m.example_args()
    # 4 heads' worth of a 64-wide dim cannot split 8 ways with a 3-long dim... use an
    # impossible split: the position table's 32 rows over a mesh axis of 8 is fine, so pin
    # a scalar-shaped count (rank 0) to a split instead.
    bad = rhino.auto_parallel(m.step, mesh_shape=(8,),
                              annotations={"opt_state[0].count": "S[x]"})
    with pytest.raises(RhinoError, match="opt_state"):
        bad.plan_for(*args)
    unknown = rhino.auto_parallel(m.step, mesh_shape=(8,),
                                  annotations={"params['nope']": "S[x]·R"})
    with pytest.raises(RhinoError, match="params\\['nope'\\]"):
        unknown.plan_for(*args)


def test_saved_plan_is_reused(tmp_path):
    m = get_model("mlp", batch=64, hidden=128)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    first = rhino.auto_parallel(m.step, mesh_shape=(4,))
    plan = first.plan_for(params, opt, batch)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    again = rhino.auto_parallel(m.step, plan=rhino.Plan.from_json(path.read_text()))
    assert again.plan_for(params, opt, batch) == plan
    p1, l1 = _train(m, first, 2, _copy(params), _copy(opt), batch)
    p2, l2 = _train(m, again, 2, _copy(params), _copy(opt), batch)
    assert l1 == l2
    other = get_model("mlp", batch=64, hidden=64)
    with pytest.raises(RhinoError, match="re-plan"):
        rhino.auto_parallel(other.step, plan=plan).plan_for(*other.example_args())


def test_bare_decorator_and_report(capsys, monkeypatch):
    @rhino.auto_parallel
    def step(w, x):
        return w - 0.01 * x.T @ (x @ w), jnp.sum((x @ w) ** 2)

    w, x = jnp.ones((16, 16)), jnp.ones((64, 16))
    ref_w, ref_loss = jax.jit(step.__wrapped__)(w, x)
    monkeypatch.setenv("RHINO_REPORT", "1")
    w2, loss = step(w, x)  # w is donated: updated in place
    assert "rhino plan" in capsys.readouterr().err
    np.testing.assert_allclose(np.asarray(w2), np.asarray(ref_w), rtol=1e-5)
    # Same signature: no re-planning; a host array is accepted as input.
    w3, _ = step(np.asarray(w2), x)
    assert len(step._cache) == 1


def test_fast_path_falls_back_on_other_layouts_and_shapes():
    from jax.sharding import NamedSharding, PartitionSpec

    def f(w, x):
        return w - 0.01 * x.T @ (x @ w), jnp.sum((x @ w) ** 2)

    step = rhino.auto_parallel(f, mesh_shape=(8,), donate=False)
    w, x = jnp.ones((16, 16)), jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) / 1e3
    want = jax.jit(f)(w, x)
    got = step(w, x)
    _close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
    _close(got[1], want[1])
    # A committed input laid out otherwise than planned: moved, same result.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("z",))
    odd = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "z")))
    assert not odd.sharding.is_equivalent_to(step._last.run.lowering.in_shardings[1], 2)
    _close(step(w, odd)[1], want[1])
    # Another shape: a second entry, right result; then the first shape again.
    x2 = x[:32]
    _close(step(w, x2)[1], jax.jit(f)(w, x2)[1])
    assert len(step._cache) == 2
    _close(step(w, x)[1], want[1])


def test_mismatched_compiled_sharding_is_refused():
    from rhino.runtime.executors.spmd import check_shardings
    from jax.sharding import NamedSharding, PartitionSpec as P
    import numpy as onp
    mesh = jax.sharding.Mesh(onp.array(jax.devices()[:2]), ("x",))
    with pytest.raises(ShardingMismatchError, match="refusing to run"):
        check_shardings("argument", [NamedSharding(mesh, P())], [NamedSharding(mesh, P("x"))],
                        [1], ["params['w']"])


def test_ffn_layernorm_backward_reduces_once():
    """A pending sum read three times (the layernorm backward reading the FFN input's
    gradient) is one all-reduce in the plan and in the compiled program: Megatron's
    column/row split wins, with three all-reduces of the [64, 256] activations in all."""
    from handmade import ffn_layernorm_step as step

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"w0": 0.05 * jax.random.normal(keys[0], (256, 256)),
         "w1": 0.05 * jax.random.normal(keys[1], (256, 1024)),
         "w2": 0.05 * jax.random.normal(keys[2], (1024, 256))}
    x = jax.random.normal(keys[3], (64, 256))
    ref = jax.jit(step)(p, x)
    fn = rhino.auto_parallel(step, mesh_shape=(4,), opt_level="O3", donate=False)
    plan, got = _compare_collectives(fn, (p, x), exact_counts=True)
    assert plan.param_spec("p['w1']").to_str(plan.mesh) == "R·S[x]"
    assert plan.param_spec("p['w2']").to_str(plan.mesh) == "S[x]·R"
    assert got == {"all-reduce": (3, 3 * 64 * 256 * 4)}
    # x0 (4 uses) and the FFN input's gradient (2 uses) are reduced once each.
    assert sorted(c.consumer for c in plan.collectives if c.consumer.startswith("<")) == [
        "<reduced once for 2 uses>", "<reduced once for 4 uses>"]
    out = fn(p, x)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def _heads_roundtrip(w, x):
    """A fused [D, 3, heads, hd] projection flattened to [B, 3·heads·hd], elementwise work
    on the flat value, and back to heads: with the heads split, the flat value is strided."""
    b = x.shape[0]
    qkv = jnp.einsum("bd,dthe->bthe", x, w)
    flat = jnp.tanh(qkv.reshape(b, -1))
    back = flat.reshape(qkv.shape)
    return jnp.sum(back[:, 0] * back[:, 1] + back[:, 2])


def test_strided_values_run_split_with_no_resharding_the_plan_lacks():
    from rhino.hlo_passes.strided import is_strided

    # Batch 2 cannot split 8 ways, so the heads are split; the flat value between the two
    # reshapes is then strided (S[x/s64]: 2 heads x 32 per shard, round-robin).
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 3, 16, 32))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 64))
    fn = jax.value_and_grad(_heads_roundtrip)
    step = rhino.auto_parallel(fn, mesh_shape=(8,), opt_level="O3")
    plan = step.plan_for(w, x).spmd
    strided = [o for o in plan.ops if is_strided(o.out_spec)]
    assert strided, "expected the plan to keep the flat value strided"
    assert not any(is_strided(p.spec) for p in plan.params)
    # The compiled program runs exactly the plan's collectives (none here): the strided
    # values are held split, so XLA never sees a layout it would have to gather.
    got = summarize(count_collectives(step.compiled_text(w, x)))
    assert got == plan.collective_summary() == {}
    loss, grad = step(w, x)
    ref_loss, ref_grad = jax.jit(fn)(w, x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=1e-4, atol=1e-6)


def test_strided_specs_stay_interior_in_auto_parallel():
    from rhino.planner.build import BuildOptions, STRIDED_OPCODES, build_problem
    from rhino.hlo_passes.strided import is_strided

    def fused(w, x):  # the fused weight is stored flat, [D, 3·heads·hd]
        return _heads_roundtrip(w.reshape(64, 3, 16, 32), x)

    w = jnp.ones((64, 3 * 16 * 32))
    x = jnp.ones((2, 64))
    g = rhino.ingest(jax.value_and_grad(fused), w, x)
    mesh, cost = rhino.AbstractMesh((8,)), rhino.CostModel.simulated_cpu(1)
    free = build_problem(g, mesh, cost, BuildOptions())
    inner = build_problem(g, mesh, cost, BuildOptions(strided_interior_only=True))
    boundary = set(g.params) | set(g.outputs)
    offered = {i for i, ss in enumerate(free.strategies) if any(is_strided(s.out_spec)
                                                                 for s in ss)}
    assert offered & boundary  # the unrestricted planner offers strided parameters ...
    for i, ss in enumerate(inner.strategies):  # ... interior_only never does
        if any(is_strided(s.out_spec) for s in ss):
            assert i not in boundary and g.ops[i].opcode in STRIDED_OPCODES


def test_remat_keeps_the_weights_sharded():
    """GPT with ``jax.checkpoint`` per layer: the planner sees through the ``opt-barrier``
    that orders the recomputation, so saved weights keep their specs. The compiled peak per
    device is at most the plan without remat's (before: the barrier's tuple had no rule and
    kept everything in it replicated, 2-3.6x the memory); collectives as predicted; losses
    equal jax.jit's."""
    args = {}
    peaks = {}
    for remat in (False, True):
        m = get_model("gpt", layers=2, hidden=128, heads=4, seq=32, batch=8, remat=remat)
        params, opt = m.init(jax.random.PRNGKey(0))
        batch = m.make_batch(jax.random.PRNGKey(1))
        step = rhino.auto_parallel(m.step, mesh_shape=(8,))
        plan, _ = _compare_collectives(step, (params, opt, batch), exact_counts=True)
        assert not plan.unplanned, plan.unplanned
        peaks[remat] = step.memory_for(params, opt, batch)["peak"]
        args[remat] = (m, step, params, opt, batch)
    assert peaks[True] <= peaks[False], peaks
    m, step, params, opt, batch = args[True]
    _, want = _train(m, jax.jit(m.step), 2, params, opt, batch)
    _, got = _train(m, step, 2, params, opt, batch)
    np.testing.assert_allclose(got, want, rtol=1e-5)


# Without remat with -m slow (the default suite's time): the remat case plans and
# compiles the same scan, checkpointed.
@pytest.mark.parametrize("remat", [pytest.param(False, marks=pytest.mark.slow),
                                   pytest.param(True, marks=pytest.mark.extended)])
def test_a_scan_over_layers_is_planned_like_the_unrolled_step(remat, monkeypatch):
    """GPT written with ``lax.scan`` over stacked layers (and with ``jax.checkpoint`` in the
    scanned body): the scan is written out layer by layer (``hlo_passes.unroll``), so the
    stacked weights, their gradients and Adam state get planned specs. The plan's bytes and
    the compiled peak are within 5% of the unrolled GPT's (issue 15, acceptance 1; the
    peak was 8% over, 22% with remat, while the backward scan's weight slices were merged
    into the forward's and held across the pass: see ``unroll._index_after``) and the peak
    under half of the loop kept opaque (everything it touched replicated); collectives as
    predicted; losses equal jax.jit's."""
    from rhino.hlo_passes import unroll
    got = {}
    for scan in (False, True, "loop"):
        if scan == "loop":
            monkeypatch.setattr(unroll, "UNROLL_LIMIT", 0)
        m = get_model("gpt", layers=3, hidden=256, heads=8, seq=64, batch=8,
                      scan=bool(scan), remat=remat)
        params, opt = m.init(jax.random.PRNGKey(0))
        batch = m.make_batch(jax.random.PRNGKey(1))
        step = rhino.auto_parallel(m.step, mesh_shape=(8,))
        if scan == "loop":
            got[scan] = (None, step.memory_for(params, opt, batch)["peak"], None)
            continue
        plan, _ = _compare_collectives(step, (params, opt, batch), exact_counts=True)
        assert not plan.unplanned, plan.unplanned
        got[scan] = (sum(c.bytes for c in plan.collectives),
                     step.memory_for(params, opt, batch)["peak"], (m, step, params, opt, batch))
    (b0, p0, _), (b1, p1, run), (_, p_loop, _) = got[False], got[True], got["loop"]
    assert abs(b1 - b0) <= 0.05 * b0, (b0, b1)
    # jax 0.12's XLA holds a little more at the scan's peak with remat (measured 1.072x on
    # 0.12.0.1; 1.026x at most on 0.10.2): see benchmarks/RESULTS.md, scan vs unrolled.
    bound = 1.05 if tuple(map(int, jax.__version__.split(".")[:2])) < (0, 11) else 1.08
    assert p1 <= bound * p0 and p1 < 0.5 * p_loop, (p0, p1, p_loop)
    m, step, params, opt, batch = run
    _, want = _train(m, jax.jit(m.step), 2, params, opt, batch)
    _, have = _train(m, step, 2, params, opt, batch)
    np.testing.assert_allclose(have, want, rtol=1e-5)


def test_a_scan_past_the_unroll_limit_stays_a_loop_and_runs(monkeypatch):
    from rhino.hlo_passes import unroll
    monkeypatch.setattr(unroll, "UNROLL_LIMIT", 2)
    m = get_model("gpt", layers=3, hidden=64, heads=2, seq=16, batch=8, scan=True)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    step = rhino.auto_parallel(m.step, mesh_shape=(8,))
    assert "while" in step.compiled_text(params, opt, batch)
    _, want = _train(m, jax.jit(m.step), 2, params, opt, batch)
    _, have = _train(m, step, 2, params, opt, batch)
    np.testing.assert_allclose(have, want, rtol=1e-5)


def test_a_bare_list_of_weights_is_paired_with_the_weights_not_by_position():
    """A step returning a bare list of updated weights: ``out[1]`` is the list's second
    weight, not the step's second argument (``x``, of the same type), so each weight comes
    back in the layout it was passed in (nothing to reshard before the next step) and the
    collectives counted equal those predicted, over two steps; values equal jax.jit's."""
    from rhino.planner.build import carried_pairs

    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h ** 2)
        g = jax.grad(loss)(ws)
        return [w - 0.1 * d for w, d in zip(ws, g)]

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    ws = [jax.random.normal(k[0], (64, 64)) * 0.1, jax.random.normal(k[1], (64, 64)) * 0.1]
    x = jax.random.normal(k[2], (64, 64))
    g = rhino.ingest(step, ws, x)
    paired = {g.output_info[g.outputs.index(o)].path: g.ops[p].arg.path
              for o, p in carried_pairs(g)}
    assert paired == {"out[0]": "ws[0]", "out[1]": "ws[1]"}, paired
    par = rhino.auto_parallel(step, mesh_shape=(8,))
    _compare_collectives(par, (ws, x), exact_counts=True)
    want = jax.jit(step)(jax.jit(step)(ws, x), x)
    s = jax.tree.map(np.asarray, ws)
    first = par(s, x)
    entry = par._last.run.compiled
    ins = jax.tree_util.tree_leaves(entry.input_shardings[0])
    for w, sharding in zip(first, ins[:2]):
        assert w.sharding.is_equivalent_to(sharding, 2), (w.sharding, sharding)
    got = par(first, x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_argmax_is_planned():
    """``argmax`` is a reduce of values and indices together (a tuple result): each result
    gets specs of its own (before: no rule, the reduce and its operands replicated, and an
    all-gather predicted that XLA does not do); collectives as predicted; equal to jit."""
    def step(w, x):
        logits = x @ w
        return w * 0.9, jnp.argmax(logits, axis=-1), jnp.max(logits, axis=-1)

    w = jax.random.normal(jax.random.PRNGKey(0), (256, 512)) * 0.1
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 256))
    par = rhino.auto_parallel(step, mesh_shape=(8,))
    plan, _ = _compare_collectives(par, (w, x), exact_counts=True)
    assert not plan.unplanned, plan.unplanned
    variadic = [o for o in plan.ops if o.opcode == "reduce" and o.out_spec is not None
                and o.out_spec.shard_count(plan.mesh) > 1]
    assert len(variadic) >= 2, [(o.name, o.out_spec) for o in plan.ops]
    want = jax.jit(step)(w, x)
    got = par(np.asarray(w), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5)


def test_a_cond_around_the_update_keeps_the_state_sharded():
    """``lax.cond`` choosing between applying an update and skipping it (as
    ``optax.apply_if_finite`` does): cheap pure branches are evaluated both and selected,
    so the state passing through keeps a sharded spec (before: the opaque conditional kept
    the whole state replicated, 3.5x the peak); each step takes the branch jax.jit takes
    (updates in steps 1-2, skipped in step 3 once the norm passes the bound, and in step
    4 on a NaN gradient)."""
    def step(w, x):
        g = jax.grad(lambda v: jnp.mean(jnp.tanh(x @ v) ** 2))(w)
        ok = jnp.all(jnp.isfinite(g)) & (jnp.sum(w * w) > 58.9)   # 59.3, 59.0, 58.8
        w2 = jax.lax.cond(ok, lambda: w - 0.5 * g, lambda: w)
        return w2, jnp.sum(x @ w)

    w = jax.random.normal(jax.random.PRNGKey(0), (256, 256)) * 0.03
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 256))
    par = rhino.auto_parallel(step, mesh_shape=(8,))
    plan = par.plan_for(w, x).spmd
    assert not plan.unplanned, plan.unplanned
    assert plan.param_spec("w").shard_count(plan.mesh) == 8, plan.param_spec("w")
    replicated = rhino.auto_parallel(step, mesh_shape=(8,), annotations={"w": "R·R"})
    assert par.memory_for(w, x)["peak"] * 2 < replicated.memory_for(w, x)["peak"]
    ref = jax.jit(step)
    s1, s2 = w, np.asarray(w)
    for i in range(4):
        xi = x.at[0, 0].set(jnp.nan) if i == 3 else x
        s1, l1 = ref(s1, xi)
        before = np.asarray(s2).copy()
        s2, l2 = par(s2, np.asarray(xi))
        np.testing.assert_allclose(np.asarray(s2), np.asarray(s1), rtol=1e-5, atol=1e-6)
        assert np.array_equal(np.asarray(s2), before) == (i >= 2), i


def test_six_devices_weigh_2d_meshes_so_even_dimensions_split():
    """6 devices, every dimension divisible by 2 but not by 3 (nor 6): the 1-D mesh (6,)
    can split nothing, so rhino also weighs (2, 3) and (3, 2) and takes the cheapest; the
    weights end up split over the axis of 2 and the step matches jax.jit."""
    def step(w1, w2, x, y):
        def loss(w1, w2):
            return jnp.mean((jnp.tanh(x @ w1) @ w2 - y) ** 2)
        value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
        return w1 - 0.1 * g1, w2 - 0.1 * g2, value

    k = jax.random.split(jax.random.PRNGKey(0), 4)
    args = (jax.random.normal(k[0], (128, 256)) * 0.1, jax.random.normal(k[1], (256, 64)) * 0.1,
            jax.random.normal(k[2], (16, 128)), jax.random.normal(k[3], (16, 64)))
    want = jax.jit(step)(*args)
    six = jax.devices()[:6]
    flat = rhino.auto_parallel(step, devices=six, mesh_shape=(6,), report=False)
    auto = rhino.auto_parallel(step, devices=six, report=False)
    assert all(p.spec.is_replicated for p in flat.plan_for(*args).spmd.params)
    plan = auto.plan_for(*args)
    assert plan.spmd.mesh.shape in ((2, 3), (3, 2))
    assert not all(p.spec.is_replicated for p in plan.spmd.params)
    assert plan.spmd.compute_s + plan.spmd.communication_s < \
        flat.plan_for(*args).spmd.compute_s
    assert "mesh chosen       SPMD on mesh" in auto.report_for(*args)
    # The shapes are weighed without O2's window moves, the chosen one planned with them.
    assert "ms, before window moves) of the shapes of 6 devices" in auto.report_for(*args)
    got = auto(*[a.copy() for a in args])
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
