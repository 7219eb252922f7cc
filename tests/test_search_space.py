"""Every plan an expert writes is in the search space (issue 46): no pin beats the free
search (acceptance 1), and two-speed meshes get the closed-form plans (acceptance 3).

The plans an expert writes by hand — data parallelism, Megatron's column/row alternation,
FSDP/ZeRO-3, expert parallelism, DP × TP on a 2-D mesh, the batch over a mesh's slow axis
and the model split over its fast one — are given to ``rhino.plan`` as annotations (pins),
as a user would. Planned with O3 on the user's path (the SPMD build options
``auto_parallel`` runs), the free search's objective must be at most each pinned one: a
pinned plan is a point of the same search space priced by the same model, so a pin that
wins means the whole-graph ILP is missing strategies or not solved to optimality.

The pins are generated from the model's parameters and the mesh (every leaf whose spec
fits, the rest left to the search), not listed by hand per model; the two-speed cases
sweep batch, width, depth, mesh shape, which axis is slow and by how much.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import rhino
from rhino.models import get_model

REL = 1e-6

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    """A module of ``benchmarks/`` by path (``peers``: the peers' Megatron rules and ZeRO-3
    split; ``cost_model_check``: those peers pinned on every leaf)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)      # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


peers = _load("peers")
expert_plans = peers.expert_annotations
_RULES_OF = peers.RULES_OF


def peer_plans(model, name: str, mesh_shape) -> dict[str, dict[str, P]]:
    """The peers of ``benchmarks/cost_model_check.py`` pinned on every leaf (replicated
    ones too), where their rules fit: dp, fsdp, megatron on (8); dp_tp on (2, 4)."""
    check = _load("cost_model_check")
    kinds = {(8,): ("dp", "fsdp", "megatron"), (2, 4): ("dp_tp",)}.get(tuple(mesh_shape), ())
    out = {}
    for kind in kinds:
        try:
            pins = check.peer_annotations(kind, _RULES_OF.get(name, name), model.step,
                                          model.example_args())
        except (peers.PeerRuleError, KeyError):
            continue      # a rule that does not fit this model's sizes, or no rules
        out[f"peer {kind}, every leaf"] = pins
    return out


def _fitting(graph, mesh_shape, plans: dict) -> dict:
    """The plans all of whose pins fit the leaves they name on the mesh."""
    shapes = {graph.ops[p].arg.path: tuple(graph.ops[p].shape.dims) for p in graph.params}
    return {k: v for k, v in plans.items()
            if all(peers.fits(shapes[path], spec, mesh_shape) for path, spec in v.items())}


def _objective(graph, mesh_shape, opt_level, annotations=None, **cost) -> float:
    plan = rhino.plan(graph, mesh_shape=mesh_shape, opt_level=opt_level,
                      annotations=annotations, **cost).spmd
    return plan.step_time_s


def _check_no_pin_wins(graph, mesh_shape, plans, opt_level="O3", **cost):
    """The free search's objective is at most every pinned one (each found with O3, the
    exact whole-graph ILP; with ``opt_level="O2"`` the free search is O2's)."""
    free = _objective(graph, mesh_shape, opt_level, **cost)
    beaten = {}
    for name, pins in plans.items():
        pinned = _objective(graph, mesh_shape, "O3", pins, **cost)
        if pinned < free * (1 - REL):
            beaten[name] = pinned
    assert not beaten, (f"free {opt_level} objective {free:.9g} s; pinned plans cheaper: "
                        f"{beaten}")
    return free


_SLOW = pytest.mark.slow
# O2 is a heuristic: on the MoE over (2, 4) its free plan (weights over both axes, the batch
# replicated) is estimated at 3.8198 ms where O2 itself, given the data-parallel pins,
# finds 3.8105 ms (O3 free: 3.8004 ms). Known, not fixed: strict, so a fix shows.
_O2_MISSES = pytest.mark.xfail(strict=True, reason="O2's heuristic plan for the MoE on "
                               "(2, 4) is 0.25 % above the data-parallel pinned plan")
ZOO = [pytest.param(*case, level, marks=marks + ((_O2_MISSES,) if level == "O2" and
                                                  case == ("moe", (2, 4)) else ()))
       for case, marks in ((("mlp", (8,)), ()), (("mlp", (2, 4)), ()),
                           (("gpt", (8,)), ()), (("vgg19", (8,)), ()),
                           (("gpt", (2, 4)), (_SLOW,)), (("vgg19", (2, 4)), (_SLOW,)),
                           (("moe", (8,)), (_SLOW,)), (("moe", (2, 4)), (_SLOW,)),
                           (("wide_resnet", (8,)), (_SLOW,)),
                           (("wide_resnet", (2, 4)), (_SLOW,)),
                           (("unet", (8,)), (_SLOW,)), (("unet", (2, 4)), (_SLOW,)),
                           (("dnabert", (8,)), (_SLOW,)), (("dnabert", (2, 4)), (_SLOW,)))
       for level in ("O3", "O2")]


@pytest.mark.parametrize("name, mesh_shape, opt_level", ZOO)
def test_no_expert_plan_beats_the_free_search_on_the_zoo(name, mesh_shape, opt_level):
    m = get_model(name)
    g = rhino.ingest(m.step, *m.example_args())
    plans = {**expert_plans(g, name, mesh_shape),
             **_fitting(g, mesh_shape, peer_plans(m, name, mesh_shape))}
    assert "megatron" in plans, sorted(plans)
    _check_no_pin_wins(g, mesh_shape, plans, opt_level)


@pytest.mark.parametrize("name, mesh_shape", [("mlp", (4,)), ("gpt", (4,)),
                                              pytest.param("gpt", (2, 2), marks=_SLOW)])
def test_no_expert_plan_beats_the_free_search_of_a_pipeline_stage(name, mesh_shape):
    """A pipeline stage's SPMD plan is searched with the stage programs' build options
    (no strided layouts): pins do not win there either."""
    from rhino.front_door import PlanRequest

    m = get_model(name)
    g = rhino.ingest(m.step, *m.example_args())
    stage = PlanRequest().build_options(pipeline=True)
    assert not stage.partial_passthrough and not stage.strided
    _check_no_pin_wins(g, mesh_shape, expert_plans(g, name, mesh_shape), build=stage)


def test_expert_plans_are_generated_from_the_leaves():
    """The generator pins what fits and leaves the rest: GPT's batch of 4 cannot be split
    8 ways, so there is no data-parallel plan on (8) but there is one on (2, 4)."""
    m = get_model("gpt")
    g = rhino.ingest(m.step, *m.example_args())
    one = expert_plans(g, "gpt", (8,))
    assert "data parallel" not in one and "megatron" in one
    meg = one["megatron"]
    assert meg["params['layers'][0]['wqkv']"] == P(None, "x")
    assert meg["params['wte']"] == P("x", None)       # the vocabulary-parallel embedding
    assert meg["params['layers'][0]['w2']"] == P("x", None)
    assert meg["opt_state[0].mu['layers'][1]['b1']"] == P("x")
    two = expert_plans(g, "gpt", (2, 4))
    assert two["data parallel"]["batch['tokens']"] == P(("x",))
    assert two["dp over x x tp over y"]["batch['tokens']"] == P("x")


def _mlp(batch: int, width: int, layers: int):
    def loss(ws, x, y):
        h = x
        for i, w in enumerate(ws):
            h = h @ w
            if i < len(ws) - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - y) ** 2)

    def step(ws, x, y):
        value, grads = jax.value_and_grad(loss)(ws, x, y)
        return [w - 0.1 * g for w, g in zip(ws, grads)], value

    f32 = jnp.float32
    return step, ([jax.ShapeDtypeStruct((width, width), f32)] * layers,
                  jax.ShapeDtypeStruct((batch, width), f32),
                  jax.ShapeDtypeStruct((batch, width), f32))


def _two_speed_plans(layers: int, slow: str, fast: str) -> dict[str, dict[str, P]]:
    ws = [f"ws[{i}]" for i in range(layers)]
    meg = {w: (P(None, fast) if i % 2 == 0 else P(fast, None)) for i, w in enumerate(ws)}
    meg_slow = {w: (P(None, slow) if i % 2 == 0 else P(slow, None)) for i, w in enumerate(ws)}
    both = ("x", "y")
    return {"batch over the slow axis, model over the fast": {**meg, "x": P(slow), "y": P(slow)},
            "batch over the fast axis, model over the slow": {**meg_slow, "x": P(fast),
                                                               "y": P(fast)},
            "model over the fast axis only": meg,
            "batch over both": {"x": P(both), "y": P(both)},
            "fsdp over both": {**{w: P(both) for w in ws}, "x": P(both), "y": P(both)}}


TWO_SPEED = [(b, w, l, shape, slow, ratio, opt)
             for b, w, l in ((1024, 1024, 2), (8192, 512, 4), (256, 2048, 6))
             for shape in ((2, 4), (4, 2)) for slow in (0, 1) for ratio in (10, 100)
             for opt in (("O3", "O2") if ratio == 100 else ("O3",))]


@pytest.mark.parametrize("batch, width, layers, shape, slow, ratio, opt_level", TWO_SPEED)
def test_no_textbook_plan_beats_the_free_search_on_two_speed_meshes(batch, width, layers,
                                                                    shape, slow, ratio,
                                                                    opt_level):
    """Axes 10x and 100x apart in bandwidth (NVLink within a host, a network across): the
    plans of the Alpa and Megatron papers, in both orders of the axes, are never cheaper
    than what O3 finds on its own."""
    step, args = _mlp(batch, width, layers)
    g = rhino.ingest(step, *args)
    beta = [1 / 100e9, 1 / 100e9]
    beta[slow] *= ratio
    names = ("x", "y")
    plans = _two_speed_plans(layers, names[slow], names[1 - slow])
    _check_no_pin_wins(g, shape, plans, opt_level, alpha=[1e-5, 1e-5], beta=beta,
                       flops_per_s=100e12)



@pytest.mark.slow
@pytest.mark.parametrize("shape, slow, ratio", [((2, 4), 0, 10), ((2, 4), 1, 100),
                                                ((4, 2), 0, 100), ((4, 2), 1, 10)])
def test_no_expert_plan_beats_the_free_search_for_gpt_on_two_speed_meshes(shape, slow,
                                                                          ratio):
    """The zoo GPT's expert plans (the batch over one axis and Megatron over the other,
    both ways; data parallel; ZeRO-3; Megatron over both) on two-speed meshes."""
    m = get_model("gpt")
    g = rhino.ingest(m.step, *m.example_args())
    beta = [1 / 100e9, 1 / 100e9]
    beta[slow] *= ratio
    _check_no_pin_wins(g, shape, expert_plans(g, "gpt", shape), "O3", alpha=[1e-5, 1e-5],
                       beta=beta, flops_per_s=100e12)

def test_the_spmd_lowering_reduces_a_pending_sum_at_its_source():
    """Why a carried pending sum is held explicit (``hlo_passes/pending.py``) rather than
    written as sharding constraints: under ``jax.jit`` with sharding constraints, XLA's
    partitioner all-reduces a contraction split over the mesh right at the dot, whatever
    follows. Here ``sum(2 * (x @ w) + b, axis=0)`` is all-reduced as the [16, 32] product,
    not as the [32] sum a pending sum carried through the scaling, the bias add and the
    reduction needs (what ``tests/test_pending.py`` checks the lowering compiles to). If
    this fails, XLA has learnt to move the reduction and the explicit form may go."""
    from jax.sharding import NamedSharding

    from rhino.runtime.executors.spmd import count_collectives

    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def f(x, w, b):
        s = jnp.sum((x @ w) * 2.0 + b, axis=0)
        return jax.lax.with_sharding_constraint(s, NamedSharding(mesh, P()))

    f32 = jnp.float32
    x = jax.ShapeDtypeStruct((16, 64), f32, sharding=NamedSharding(mesh, P(None, "x")))
    w = jax.ShapeDtypeStruct((64, 32), f32, sharding=NamedSharding(mesh, P("x", None)))
    b = jax.ShapeDtypeStruct((32,), f32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(f).lower(x, w, b).compile().as_text()
    got = [(c.kind, c.bytes) for c in count_collectives(text)]
    assert got == [("all-reduce", 16 * 32 * 4)], got


def test_stage_plans_reduce_pending_sums_where_the_lowering_does():
    """The stage programs are lowered as the SPMD program is (each planned value
    constrained where its equation makes it), so a pipeline's stage plans carry no pending
    sum through a linear op either. Before, GPT's two stage plans on 2x4 carried pending
    sums through 11 adds, reshapes, selects and reductions (two pending sums added and
    reduced once, for one), which the stage programs all-reduce at their source."""
    m = get_model("gpt")
    plan = rhino.plan(m.step, *m.example_args(), cluster="2x4", stages=2,
                      num_microbatches=4)
    assert plan.num_stages == 2
    for st in plan.stages:
        carried = [o.name for o in st.spmd.ops
                   if o.out_spec is not None and o.out_spec.is_partial
                   and any(s is not None and s.is_partial for s in o.in_specs)]
        assert carried == [], (st.index, carried)


# ------------------------------------------------------------------ two-speed closed forms
ALPHA, FAST = 1e-5, 1 / 100e9        # s per collective; s per byte of the fast axis


def _all_reduce(nbytes: float, n: int, beta: float) -> float:
    return ALPHA + 2 * (n - 1) / n * nbytes * beta


def _all_gather(nbytes: float, n: int, beta: float) -> float:
    return ALPHA + (n - 1) / n * nbytes * beta


def hierarchical_data_parallel(layers: int, width: int, n_fast: int, n_slow: int,
                               slow: float) -> float:
    """Data parallelism over both axes of a two-speed mesh, each weight's gradient (M
    bytes) reduced the two-level way: reduced over the fast axis and left split (XLA:CPU
    has no reduce-scatter: an all-reduce and a slice), the 1/n_fast piece all-reduced
    over the slow axis, gathered back over the fast axis; and the scalar loss reduced over
    both axes at the slow axis' α and β."""
    m = width * width * 4
    per_weight = (_all_reduce(m, n_fast, FAST) + _all_reduce(m / n_fast, n_slow, slow)
                  + _all_gather(m, n_fast, FAST))
    return layers * per_weight + _all_reduce(4, n_fast * n_slow, slow)


def fast_data_parallel(layers: int, width: int, n_fast: int, n_slow: int,
                       slow: float) -> tuple[float, float]:
    """Data parallelism over the fast axis alone (the slow axis' devices repeat the
    matmuls): each gradient all-reduced over the fast axis; the scalar loss reduced over
    the fast axis, or over both where the loss's elementwise work is split over the slow
    axis too (one collective either way: the same α, 7e-9 s more of β, less compute)."""
    grads = layers * _all_reduce(width * width * 4, n_fast, FAST)
    return (grads + _all_reduce(4, n_fast, FAST),
            grads + _all_reduce(4, n_fast * n_slow, slow))


# The batch decides: with a large one the slow axis' compute is worth its reduction, with
# a small one on a 100x slower axis it is not.
CLOSED_FORMS = [(batch, width, layers, shape, slow, ratio)
                for shape in ((2, 4), (4, 2)) for slow in (0, 1)
                for batch, width, layers, ratio in ((65536, 512, 2, 10), (65536, 512, 4, 10),
                                                    (524288, 512, 2, 100),
                                                    (16384, 512, 2, 100),
                                                    (32768, 512, 4, 100))]


@pytest.mark.parametrize("batch, width, layers, shape, slow, ratio", CLOSED_FORMS)
def test_two_speed_data_parallel_costs_its_closed_form(batch, width, layers, shape, slow,
                                                       ratio):
    """Where data parallelism is the plan (a wide batch, square weights), on a mesh whose
    axes differ 10x or 100x in bandwidth, in both orders of the axes: O3 reduces the
    gradients the two-level way over both axes, or over the fast axis alone where the slow
    one's reduction costs more than the compute it saves; its communication is the closed
    form's to 1e-9, and the batch is split as the regime says."""
    step, args = _mlp(batch, width, layers)
    beta = [FAST, FAST]
    beta[slow] = FAST * ratio
    plan = rhino.plan(step, *args, mesh_shape=shape, opt_level="O3", alpha=[ALPHA] * 2,
                      beta=beta, flops_per_s=100e12).spmd
    n_slow, n_fast = shape[slow], shape[1 - slow]
    names = ("x", "y")
    both = hierarchical_data_parallel(layers, width, n_fast, n_slow, FAST * ratio)
    fast_forms = fast_data_parallel(layers, width, n_fast, n_slow, FAST * ratio)
    fast = fast_forms[0]
    x_spec = plan.param_spec("x").to_str(plan.mesh)
    if x_spec == f"S[{names[1 - slow]}]·R":
        regime, closed = "fast", fast_forms
    else:
        regime, closed = "both", (both,)
        assert x_spec in ("S[x,y]·R", "S[y,x]·R"), x_spec
    assert any(plan.communication_s == pytest.approx(c, rel=1e-9) for c in closed), \
        (regime, x_spec, plan.communication_s, closed)
    # The regime is the closed forms' choice: each one's communication plus the compute of
    # data parallelism over its devices (planned on a 1-D mesh of that many).
    compute = {n: rhino.plan(step, *args, mesh_shape=(n,), opt_level="O3", alpha=[ALPHA],
                             beta=[FAST], flops_per_s=100e12,
                             annotations={"x": P("x"), "y": P("x")}).spmd.compute_s
               for n in (n_fast, n_fast * n_slow)}
    want = "both" if compute[n_fast * n_slow] + both < compute[n_fast] + fast else "fast"
    assert regime == want, (regime, compute, both, fast)


def megatron_over_fast(batch: int, width: int, layers: int, n_fast: int, n_slow: int,
                       slow: float) -> tuple[float, ...]:
    """The batch over the slow axis and Megatron's column/row pairs over the fast one (the
    Megatron-LM paper's DP x TP; Alpa's two-level plan): per pair, the row layer's [B/n_slow,
    H] output all-reduced over the fast axis in the forward pass, and every pair but the
    first all-reduces its input's gradient in the backward pass (L - 1 activations in all);
    each weight's gradient, a 1/n_fast column or row block, all-reduced over the slow axis.
    The scalar loss is reduced over both axes at the slow axis' α and β, over the slow axis
    alone where its elementwise work stays whole on the fast axis, or over each axis in turn
    (one α more: a tie within the MIP gap of 1e-4, which HiGHS may return)."""
    act = (layers - 1) * _all_reduce(batch / n_slow * width * 4, n_fast, FAST)
    grads = layers * _all_reduce(width * width / n_fast * 4, n_slow, slow)
    loss = (_all_reduce(4, n_fast * n_slow, slow), _all_reduce(4, n_slow, slow),
            _all_reduce(4, n_slow, slow) + _all_reduce(4, n_fast, FAST))
    return tuple(act + grads + l for l in loss)


def matmul_time(batch: int, width: int, layers: int, devices: int, flops: float) -> float:
    """The MLP's matmuls split over ``devices``: L forward, L weight gradients and L - 1
    input gradients (the batch needs none), 2·B·H² FLOP each."""
    return 2 * batch * width * width * (3 * layers - 1) / devices / flops


def two_speed_regimes(batch, width, layers, n_fast, n_slow, slow, flops):
    """Each textbook plan's closed form (communication + matmuls): the cheapest is the
    plan the sizes call for."""
    n = n_fast * n_slow
    every, fast_only = (matmul_time(batch, width, layers, d, flops) for d in (n, n_fast))
    act_fast = (layers - 1) * _all_reduce(batch * width * 4, n_fast, FAST)
    swapped = ((layers - 1) * _all_reduce(batch / n_fast * width * 4, n_slow, slow)
               + layers * _all_reduce(width * width / n_slow * 4, n_fast, FAST)
               + _all_reduce(4, n, slow))
    return {"megatron over fast, batch over slow":
                min(megatron_over_fast(batch, width, layers, n_fast, n_slow, slow)) + every,
            "megatron over slow, batch over fast": swapped + every,
            "data parallel over both": hierarchical_data_parallel(layers, width, n_fast,
                                                                  n_slow, slow) + every,
            "data parallel over fast, slow idle": min(fast_data_parallel(
                layers, width, n_fast, n_slow, slow)) + fast_only,
            "megatron over fast, slow idle": act_fast + _all_reduce(4, n_fast, FAST)
                + fast_only}


# (batch, width, layers, n_slow, n_fast, bandwidth ratio, FLOP/s): a few layers and many,
# 10x and 100x (the slower axis needs ten times the compute per byte to be worth splitting
# the batch over, hence 10 TFLOP/s there), two and four devices on the slow axis.
MEGATRON_FORMS = [(32768, 4096, 2, 4, 2, 10, 100e12), (32768, 4096, 2, 4, 2, 100, 10e12),
                  (16384, 8192, 4, 2, 4, 10, 100e12), (16384, 8192, 4, 2, 4, 100, 10e12),
                  (16384, 8192, 8, 2, 4, 100, 10e12), (32768, 8192, 8, 4, 2, 10, 100e12),
                  (32768, 8192, 2, 4, 2, 10, 100e12), (32768, 8192, 4, 4, 2, 10, 100e12),
                  (16384, 8192, 8, 2, 4, 10, 100e12), (32768, 16384, 8, 2, 4, 100, 10e12)]


@pytest.mark.parametrize("slow_first", [True, False], ids=["slow axis first",
                                                           "slow axis second"])
@pytest.mark.parametrize("batch, width, layers, n_slow, n_fast, ratio, flops",
                         [pytest.param(*c, marks=(_SLOW,) if i >= 6 else ())
                          for i, c in enumerate(MEGATRON_FORMS)])
def test_two_speed_megatron_costs_its_closed_form(batch, width, layers, n_slow, n_fast,
                                                  ratio, flops, slow_first):
    """Where the sizes make it cheapest (a wide model: the weights outweigh a slow group's
    activations; a large batch: its compute outweighs the slow axis' gradient reduction),
    O3 finds the plan the Megatron-LM and Alpa papers derive, in both orders of the mesh's
    axes: the batch over the slow axis alone, each pair of weights split by columns then
    rows over the fast one. Its communication is the closed form's to 1e-9, its compute the
    matmuls' split eight ways (elementwise work within 0.1 %), and that total is below every
    other textbook plan's closed form."""
    step, args = _mlp(batch, width, layers)
    shape = (n_slow, n_fast) if slow_first else (n_fast, n_slow)
    slow_axis = 0 if slow_first else 1
    beta = [FAST, FAST]
    beta[slow_axis] = FAST * ratio
    plan = rhino.plan(step, *args, mesh_shape=shape, opt_level="O3", alpha=[ALPHA] * 2,
                      beta=beta, flops_per_s=flops).spmd
    s, f = ("x", "y") if slow_first else ("y", "x")
    got = {k: plan.param_spec(k).to_str(plan.mesh)
           for k in ["x", "y"] + [f"ws[{i}]" for i in range(layers)]}
    want = {"x": f"S[{s}]·R", "y": f"S[{s}]·R",
            **{f"ws[{i}]": (f"R·S[{f}]" if i % 2 == 0 else f"S[{f}]·R")
               for i in range(layers)}}
    assert got == want
    forms = megatron_over_fast(batch, width, layers, n_fast, n_slow, FAST * ratio)
    assert any(plan.communication_s == pytest.approx(c, rel=1e-9) for c in forms), \
        (plan.communication_s, forms)
    matmuls = matmul_time(batch, width, layers, n_slow * n_fast, flops)
    assert plan.compute_s == pytest.approx(matmuls, rel=1e-3)
    regimes = two_speed_regimes(batch, width, layers, n_fast, n_slow, FAST * ratio, flops)
    best = min(regimes, key=regimes.get)
    assert best == "megatron over fast, batch over slow", regimes
    assert plan.step_time_s == pytest.approx(regimes[best], rel=1e-3)


def _two_speed_case(seed: int):
    """A generated two-speed setting: batch, width, depth, slow-axis size and position,
    bandwidth ratio and FLOP rate drawn over the ranges where each textbook plan wins."""
    import random
    r = random.Random(seed)
    n_slow = r.choice((2, 4))
    slow_first = r.random() < 0.5
    return (r.choice((4096, 8192, 16384, 32768, 65536)), r.choice((1024, 2048, 4096, 8192)),
            r.choice((2, 4)), n_slow, 8 // n_slow, r.choice((10, 30, 100)),
            r.choice((1e12, 10e12, 100e12)), slow_first)


@pytest.mark.parametrize("seed", [pytest.param(s, marks=(_SLOW,) if s >= 8 else ())
                                  for s in range(48)])
def test_o3_is_never_above_a_two_speed_closed_form(seed):
    """Over generated sizes (batch, width, depth, which axis is slow, by 10x to 100x, two or
    four devices on it, the FLOP rate), O3's objective is at most the cheapest textbook
    plan's closed form, plus the work those forms leave out: the step's non-matmul FLOPs,
    counted as if all ran on one device. The graph's matmul FLOPs are the forms' own. Over
    the 48 seeds each of the five forms is the cheapest somewhere."""
    batch, width, layers, n_slow, n_fast, ratio, flops, slow_first = _two_speed_case(seed)
    step, args = _mlp(batch, width, layers)
    g = rhino.ingest(step, *args)
    dots = sum(op.flops for op in g.ops if op.opcode == "dot")
    assert dots / flops == pytest.approx(matmul_time(batch, width, layers, 1, flops))
    rest = sum(op.flops for op in g.ops if op.opcode != "dot") / flops
    shape = (n_slow, n_fast) if slow_first else (n_fast, n_slow)
    beta = [FAST, FAST]
    beta[0 if slow_first else 1] = FAST * ratio
    plan = rhino.plan(g, mesh_shape=shape, opt_level="O3", alpha=[ALPHA] * 2,
                      beta=beta, flops_per_s=flops).spmd
    regimes = two_speed_regimes(batch, width, layers, n_fast, n_slow, FAST * ratio, flops)
    best = min(regimes, key=regimes.get)
    assert plan.step_time_s <= regimes[best] + rest, (plan.step_time_s, rest, regimes)


def test_the_generated_two_speed_cases_reach_every_textbook_regime():
    """The generator above is not stuck in one regime: over its 48 seeds, each textbook
    plan's closed form is the cheapest for some."""
    won = set()
    for seed in range(48):
        batch, width, layers, n_slow, n_fast, ratio, flops, _ = _two_speed_case(seed)
        regimes = two_speed_regimes(batch, width, layers, n_fast, n_slow, FAST * ratio,
                                    flops)
        won.add(min(regimes, key=regimes.get))
    assert won == set(two_speed_regimes(1, 1, 2, 2, 4, FAST, 1.0)), won
