"""rhino.plan end to end: report, JSON round trip, memory constraint (§4.4), CLI, errors."""

import json

import jax.numpy as jnp
import pytest

import rhino
from rhino.cli import main
from rhino.errors import InfeasiblePlanError
from rhino.models import get_model
from rhino.planner.api import memory_of
from rhino.planner.build import build_problem
from rhino.planner.spmd_plan import SpmdPlan


def _small_gpt():
    # Parameters (with Adam state) dominate memory: wide layers, a short sequence.
    return get_model("gpt", layers=2, hidden=256, heads=4, seq=8, vocab=4096, batch=8)


def test_plan_report_and_json_round_trip(tmp_path):
    m = get_model("mlp", batch=128, hidden=1024)
    whole = rhino.plan(m.step, *m.example_args(), mesh_shape=(4,), opt_level="O3")
    assert whole.kind == "spmd" and whole.num_stages == 1
    assert rhino.Plan.from_json(whole.to_json()) == whole
    assert whole.report() == whole.spmd.report()
    p = whole.spmd
    rep = p.report()
    for field in ("mesh", "search", "step time", "memory / device", "collectives",
                  "parameters", "params['layers'][0]['w']", "replicated for lack of a rule"):
        assert field in rep
    q = SpmdPlan.from_json(p.to_json())
    assert q == p
    assert q.param_spec("params['layers'][0]['w']") == p.param_spec("params['layers'][0]['w']")
    assert p.search.status == "optimal" and p.search.nodes == len(p.ops)
    # The predicted collectives account for all of the communication time.
    assert sum(c.seconds for c in p.collectives) == pytest.approx(p.communication_s, rel=1e-9)
    with pytest.raises(KeyError, match="no parameter"):
        p.param_spec("params['nope']")
    with pytest.raises(ValueError, match="format"):
        SpmdPlan.from_dict(dict(json.loads(p.to_json()), format=99))


def test_o2_and_o3_agree_on_mlp():
    m = get_model("mlp", batch=128, hidden=1024)
    p2 = rhino.plan(m.step, *m.example_args(), mesh_shape=(4,), opt_level="O2").spmd
    p3 = rhino.plan(m.step, *m.example_args(), mesh_shape=(4,), opt_level="O3").spmd
    assert p3.search.objective <= p2.search.objective <= 1.05 * p3.search.objective


def test_memory_budget_shards_only_the_largest_parameters():
    m = _small_gpt()
    free = rhino.plan(m.step, *m.example_args(), mesh_shape=(8,)).spmd
    # The graph and problem rhino.plan plans (the front door's trace and build options).
    from rhino.front_door import PlanRequest, trace_step
    g = trace_step(m.step, m.example_args()).graph
    built = build_problem(g, free.mesh, free.cost, PlanRequest().build_options(pipeline=False))
    from rhino.planner.api import PlanOptions, _forbid_replicated, _solve
    order = sorted(g.params, key=lambda i: -g.ops[i].out_bytes)
    # The floor: what a plan needs with every parameter forced sharded.
    sol = _solve(built, _forbid_replicated(built, order), PlanOptions())
    floor = memory_of(g, free.mesh, built.plan(sol.choice), built.carried).peak
    assert floor < free.memory.peak
    # A budget below the planner's lower bound (<= the floor) is refused at once.
    with pytest.raises(InfeasiblePlanError, match="a lower bound") as ei:
        rhino.plan(m.step, *m.example_args(), mesh_shape=(8,), memory_budget=1024).spmd
    assert 1024 < ei.value.needed_bytes <= floor
    budget = int(floor + 0.3 * (free.memory.peak - floor))
    p = rhino.plan(m.step, *m.example_args(), mesh_shape=(8,), memory_budget=budget).spmd
    assert p.memory.peak <= budget < free.memory.peak
    k = p.search.forced_sharded
    assert 0 < k < len(p.params)
    by_size = sorted(p.params, key=lambda q: -q.global_bytes)
    # The k largest parameters are sharded ...
    assert all(not q.spec.is_replicated for q in by_size[:k])
    assert "forced sharded" in p.report()
    # ... and k is the smallest count that fits: k-1 forced does not.
    sol = _solve(built, _forbid_replicated(built, order[:k - 1]), PlanOptions())
    assert memory_of(g, p.mesh, built.plan(sol.choice), built.carried).peak > budget


def test_impossible_budget_raises_with_minimum_and_budget():
    m = _small_gpt()
    with pytest.raises(InfeasiblePlanError) as ei:
        rhino.plan(m.step, *m.example_args(), mesh_shape=(8,), memory_budget=4096).spmd
    assert ei.value.budget_bytes == 4096
    assert ei.value.needed_bytes > 4096
    assert "budget" in str(ei.value)


def test_plan_from_hlo_file(tmp_path):
    import jax
    f = tmp_path / "m.hlo"
    lowered = jax.jit(lambda x, w: jnp.sum(jnp.tanh(x @ w))).lower(jnp.ones((64, 32)),
                                                                    jnp.ones((32, 32)))
    f.write_text(lowered.as_text(dialect="hlo", debug_info=True))
    p = rhino.plan(str(f), mesh_shape=(2, 2)).spmd
    assert p.origin.startswith("hlo:") and p.mesh.shape == (2, 2)


def test_bad_options():
    with pytest.raises(ValueError, match="opt_level"):
        rhino.plan(lambda x: x * 2, jnp.ones(8), mesh_shape=(2,), opt_level="O9").spmd
    with pytest.raises(rhino.RhinoError, match="mesh"):
        rhino.plan(lambda x: x * 2, jnp.ones(8), mesh_shape=(0,)).spmd


def test_cli_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "mlp:batch=128,hidden=512", "--mesh", "2,2", "--opt-level", "O3",
                 "--output", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "rhino plan" in text and "Mesh(x=2, y=2)" in text
    assert rhino.Plan.from_json(out.read_text()).spmd.mesh.shape == (2, 2)
    assert main(["plan", "mlp", "--mesh", "4", "--json", "--quiet",
                 "--alpha", "1e-5", "--beta", "1e-9"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stages"][0]["cost"]["beta"] == [1e-9]
    assert d["stages"][0]["mesh"] == {"shape": [4], "axis_names": ["x"]}
    assert main(["plan", "mlp", "--mesh", "4", "--memory-budget", "1KiB", "--quiet"]) == 2
    assert "no plan fits" in capsys.readouterr().err
    assert main(["plan", "mlp", "--mesh", "4", "--memory-budget", "lots", "--quiet"]) == 2
    assert "--memory-budget" in capsys.readouterr().err


def test_plan_with_cluster_uses_the_controller():
    """With a cluster, the controller weighs SPMD and pipeline candidates and runs the
    fastest feasible one; the report lists them with the winner marked."""
    m = get_model("gpt", layers=2, hidden=64, heads=4, seq=16, vocab=256, batch=8)
    p = rhino.plan(m.step, *m.example_args(), cluster="2x4", microbatches=4, max_stages=2)
    kinds = {c.kind for c in p.candidates}
    assert "spmd" in kinds and kinds & {"pipeline", "hybrid"}, kinds
    assert p.num_stages <= 2 and sum(len(st.devices) for st in p.stages) <= 8
    timed = [c for c in p.candidates if c.feasible and c.step_s is not None]
    assert p.step_s == pytest.approx(min(c.step_s for c in timed))
    assert p.winner.kind == p.kind
    report = p.report()
    assert f"chosen            {p.kind}" in report and p.decision in report
    assert sum(1 for line in report.splitlines() if line.lstrip().startswith("*")) == 1
