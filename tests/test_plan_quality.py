"""Plan quality (issue 31): a 2-D mesh's plan is never estimated slower than the 1-D plan
of the same devices, and clipping by the global norm does not turn a sharded plan
replicated (XLA reduces the per-leaf scalars in one all-reduce)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import pathlib

import pytest

import rhino
from rhino.models import get_model
from rhino.planner.build import BuildOptions, build_problem, combined_reductions
from rhino.planner.cost_model import CostModel
from rhino.planner.fold import folded_choices
from rhino.planner.hierarchical import solve_o3
from rhino.planner.mesh import AbstractMesh

# The seven zoo models; O2's (2, 4) searches of the last four take 25-60 s each on the
# 2-core machine (its segment tables), so they run with -m slow.
_SLOW = pytest.mark.slow
ZOO = [pytest.param("mlp", {}), pytest.param("gpt", {}),
       pytest.param("vgg19", dict(width=8, classes=1000)),
       pytest.param("moe", {}, marks=_SLOW), pytest.param("wide_resnet", {}, marks=_SLOW),
       pytest.param("unet", {}, marks=_SLOW), pytest.param("dnabert", {}, marks=_SLOW)]


@pytest.mark.parametrize("name, config", ZOO)
def test_two_axis_plan_is_never_slower_than_the_one_axis_plan(name, config):
    """(2, 4) can run every (8) plan as S[x,y]; with the slowest-axis α and grouped
    pending sums it costs the same there, and O2 keeps the folded plan where its own
    search does worse."""
    m = get_model(name, **config)
    g = rhino.ingest(m.step, *m.example_args())
    one = rhino.plan(g, mesh_shape=(8,)).spmd
    two = rhino.plan(g, mesh_shape=(2, 4)).spmd
    assert two.step_time_s <= one.step_time_s * 1.001, (name, two.step_time_s,
                                                        one.step_time_s)


def test_folded_problem_is_the_one_axis_problem():
    """The (2, 4) problem restricted to folded choices has the (8) problem's choices per
    node, and its optimum costs what the (8) optimum costs."""
    m = get_model("mlp", hidden=64, batch=32)
    g = rhino.ingest(m.step, *m.example_args())
    one = build_problem(g, AbstractMesh((8,)), CostModel.simulated_cpu(1))
    two = build_problem(g, AbstractMesh((2, 4)), CostModel.simulated_cpu(2))
    keep = folded_choices(two)
    assert folded_choices(one) is None
    assert [len(k) for k in keep] == [one.problem.num_choices(i) for i in range(len(g.ops))]
    a = solve_o3(one.problem).objective
    b = solve_o3(two.problem.restricted(keep)).objective
    assert b == pytest.approx(a, rel=1e-9)


def _bench():
    """``benchmarks/plan_quality.py`` (its NNX transformer), loaded by path."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "plan_quality.py"
    spec = importlib.util.spec_from_file_location("plan_quality", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sharded_state_bytes(plan) -> int:
    return sum(p.global_bytes for p in plan.params
               if p.path.startswith(("params", "opt_state")) and not p.spec.is_replicated)


def test_global_norm_clipping_keeps_the_state_sharded():
    """As auto_parallel plans (no partial pass-through, so each leaf's sum of squares is
    reduced where it is made): 0 of 45 sharded state tensors before scalar reductions were
    priced as one combined all-reduce; as many bytes sharded with clipping as without.
    O3 (exact) compares the cost model's optima, not O2's heuristic luck."""
    cost = dataclasses.replace(CostModel.simulated_cpu(1), strided_moves_all_to_all=False)
    build = BuildOptions(strided_interior_only=True, partial_passthrough=False)
    plans = {}
    for clip in (False, True):
        step, args = _bench().nnx_transformer(clip)
        g = rhino.ingest(step, *args)
        plans[clip] = rhino.plan(g, mesh_shape=(8,), cost=cost, build=build,
                                 opt_level="O3").spmd
        if clip:   # one group of per-leaf sums of squares, each paying 1/K of α
            built = build_problem(g, AbstractMesh((8,)), cost, build)
            shares = combined_reductions(g, built.strategies)
            assert len(shares) > 40 and max(shares.values()) <= 1 / 40
    without, with_clip = (_sharded_state_bytes(plans[c]) for c in (False, True))
    assert without > 0 and with_clip >= without, (with_clip, without)
    assert plans[True].step_time_s <= plans[False].step_time_s * 1.02
    combined = [c for c in plans[True].collectives if c.alpha_share < 1]
    assert combined and all(c.kind == "all-reduce" and c.bytes <= 8 for c in combined)
    assert "combined with" in plans[True].report(max_collectives=10**4)


def test_a_plan_that_splits_nothing_says_why_with_numbers():
    """H100 figures and the zoo GPT's batch of 4: microseconds of compute, every device
    runs the whole step; the report prices the cheapest plan that splits the largest op."""
    m = get_model("gpt")
    p = rhino.plan(m.step, *m.example_args(), mesh_shape=(8,), backend="h100").spmd
    assert p.splits_nothing and p.split_alternative is not None
    alt = p.split_alternative
    assert alt.step_s > p.step_time_s and alt.compute_s < p.compute_s and alt.collectives > 0
    rep = p.report()
    assert "splits nothing" in rep and "the cheapest plan found that splits its largest op" in rep
    assert f"{1e3 * alt.step_s:.3f} ms" in rep
    assert type(p).from_json(p.to_json()) == p
    split = rhino.plan(m.step, *m.example_args(), mesh_shape=(8,)).spmd  # CPU figures
    assert not split.splits_nothing and split.split_alternative is None
    assert "splits nothing" not in split.report()


def test_cli_plan_with_gpu_figures_raises_the_zoo_batch(capsys, caplog):
    from rhino.cli import main
    caplog.set_level(logging.INFO, logger="rhino")
    assert main(["plan", "gpt:layers=2,hidden=128", "--mesh", "8", "--backend", "h100"]) == 0
    out, _ = capsys.readouterr()
    assert "planning gpt:layers=2,hidden=128,batch=" in caplog.text
    assert "splits nothing" not in out
    assert "collectives       all-reduce" in out or "collectives       all-gather" in out
    # A batch the user gives is kept.
    caplog.clear()
    assert main(["plan", "gpt:layers=2,hidden=128,batch=4", "--mesh", "8", "--backend",
                 "h100", "--quiet"]) == 0
    out, _ = capsys.readouterr()
    assert "splits nothing" in out and "planning" not in caplog.text
