"""Memory budgets: the planner's activation weight, and ``auto_parallel(memory_budget=...)``
checked on the compiled program (XLA's memory_analysis), on 8 simulated CPU devices."""

import jax
import pytest

import rhino
from rhino.errors import InfeasiblePlanError
from rhino.models import get_model
from rhino.planner.api import PlanOptions, plan_graph
from rhino.planner.build import build_problem
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh

from handmade import assert_trains_like_jit
from rhino import planning as ap_module   # MEMORY_PRESSURE: the pressure steps

MLP = dict(batch=64, hidden=128)


def _activation_total(graph, mesh, plan) -> float:
    built = build_problem(graph, mesh, plan.cost)
    per_op = built.activation_bytes
    # The plan's choice per op, found by its spec among the op's strategies.
    total = 0.0
    for op, strats, costs, o in zip(graph.ops, built.strategies, per_op, plan.ops):
        if op.opcode == "parameter" or o.out_spec is None:
            continue
        total += next(c for s, c in zip(strats, costs) if s.out_spec == o.out_spec)
    return total


def test_activation_tiebreak_trades_time_for_activation_memory():
    m = get_model("mlp", **MLP)
    graph = rhino.ingest(m.step, *m.example_args())
    mesh, cost = AbstractMesh((8,)), CostModel.simulated_cpu(1)
    free = plan_graph(graph, mesh, cost, PlanOptions(opt_level="O3"))
    heavy = plan_graph(graph, mesh, cost, PlanOptions(opt_level="O3", activation_tiebreak=1.0))
    # A Lagrangian weight on a term never raises that term at the optimum, and here it
    # lowers it strictly; the reported objective (time alone) can only rise.
    assert _activation_total(graph, mesh, heavy) < _activation_total(graph, mesh, free)
    assert heavy.search.objective >= free.search.objective * (1 - 1e-6)


def test_negative_tiebreak_is_refused():
    with pytest.raises(ValueError, match="activation_tiebreak: expected a weight >= 0"):
        PlanOptions(activation_tiebreak=-1.0)


def _peak_at(m, mu):
    """The compiled peak of the plan made at memory pressure ``mu`` alone."""
    saved = ap_module.MEMORY_PRESSURE
    ap_module.MEMORY_PRESSURE = (mu,)
    try:
        step = rhino.auto_parallel(m.step, mesh_shape=(8,), memory_budget=1 << 40)
        return step.memory_for(*m.example_args())["peak"]
    finally:
        ap_module.MEMORY_PRESSURE = saved


def test_memory_budget_is_met_by_the_compiled_program_and_training_is_exact():
    m = get_model("mlp", **MLP)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    default = rhino.auto_parallel(m.step, mesh_shape=(8,))
    free_peak = default.memory_for(params, opt, batch)["peak"]
    # A budget below the time-optimal plan's compiled peak that a higher pressure meets.
    peaks = {mu: _peak_at(m, mu) for mu in ap_module.MEMORY_PRESSURE}
    assert peaks[0.0] == free_peak
    low = min(peaks.values())
    assert low < free_peak
    budget = (low + free_peak) // 2 if low < free_peak - 1 else low

    step = rhino.auto_parallel(m.step, mesh_shape=(8,), memory_budget=budget)
    mem = step.memory_for(params, opt, batch)
    assert mem["peak"] <= budget < free_peak
    entry = step._entry((params, opt, batch))
    # The first pressure (in order) whose compiled program fits is the one taken.
    first = next(mu for mu in ap_module.MEMORY_PRESSURE if peaks[mu] <= budget)
    assert entry.run.pressure == first > 0
    assert mem["peak"] == peaks[first]
    report = entry.report()
    assert "compiled memory" in report and "met at memory pressure" in report

    assert_trains_like_jit(step, jax.jit(m.step), params, opt, batch, loss_rtol=1e-4)


def test_memory_budget_nothing_fits_names_every_attempt():
    m = get_model("mlp", **MLP)
    # Below what the arguments alone need: refused before any plan is compiled.
    with pytest.raises(InfeasiblePlanError, match="a lower bound") as ei:
        rhino.auto_parallel(m.step, mesh_shape=(8,), memory_budget=4096)(
            *m.example_args())
    assert ei.value.budget_bytes == 4096 and ei.value.needed_bytes > 4096
    # Above that bound (~56 KiB) but below every plan's compiled peak (>= ~145 KiB).
    with pytest.raises(InfeasiblePlanError) as ei:
        rhino.auto_parallel(m.step, mesh_shape=(8,), memory_budget=80_000)(
            *m.example_args())
    e = ei.value
    assert e.budget_bytes == 80_000 and e.needed_bytes > 80_000
    text = str(e)
    for mu in ap_module.MEMORY_PRESSURE:
        assert f"μ={mu:g}:" in text
    assert "compiled peak per device" in text
