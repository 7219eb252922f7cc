"""Cluster splits, the 1F1B cost model, the controller, Plan JSON and the CLI."""

import dataclasses
import doctest
import json
import re

import pytest

import rhino
from rhino.cli import main
from rhino.errors import InfeasiblePlanError
from rhino.models import get_model
from rhino import cluster as cluster_module
from rhino.pipeline import cost as cost_module
from rhino import parallel_plan as plan_module
from rhino.cluster import Cluster, enumerate_splits
from rhino.pipeline.cost import in_flight, pipeline_step, transfer_seconds
from rhino.parallel_plan import Plan
from rhino.pipeline import search as search_module
from rhino.pipeline.search import PipelineOptions

FAST = PipelineOptions(two_d=False, executor="thread")


@pytest.fixture(scope="module")
def gpt_graph():
    # Compute-heavy enough that the bubble matters; small enough to plan in seconds.
    m = get_model("gpt", layers=2, hidden=64, heads=2, seq=64, vocab=256, batch=32)
    return rhino.ingest(m.step, *m.example_args())


def test_doctests():
    for mod in (cluster_module, cost_module):
        assert doctest.testmod(mod).failed == 0


def test_cluster_parse_and_splits():
    c = Cluster.parse("2x8")
    assert (c.hosts, c.devices_per_host, c.num_devices) == (2, 8, 16)
    assert Cluster.parse("8").hosts == 1
    with pytest.raises(ValueError, match="HOSTSxDEVICES"):
        Cluster.parse("2by8")
    with pytest.raises(ValueError, match="hosts"):
        Cluster(0, 8)
    splits = enumerate_splits(Cluster.parse("2x8", beta_inter=1e-9))
    assert sorted({s.num_stages for s in splits}) == [1, 2, 4, 8, 16]
    kinds = {(s.num_stages, s.kind) for s in splits}
    assert (1, "spmd") in kinds and (16, "pipeline") in kinds and (2, "hybrid") in kinds
    # Every split covers the cluster; 2 stages = one per host, linked across hosts.
    for s in splits:
        assert s.num_stages * s.devices_per_stage == 16
        assert s.stage_mesh(Cluster.parse("2x8")).num_devices == s.devices_per_stage
    two = next(s for s in splits if s.num_stages == 2 and s.stage_shape == (8,))
    c = Cluster.parse("2x8", beta_inter=1e-9)
    assert two.hosts(c, 0) == (0,) and two.hosts(c, 1) == (1,)
    assert two.link(c, 0, 1) == (c.alpha_inter, 1e-9)
    four = next(s for s in splits if s.num_stages == 4 and s.stage_shape == (4,))
    assert four.link(c, 0, 1) == (c.alpha_intra, c.beta_intra)
    assert four.link(c, 1, 2) == (c.alpha_inter, 1e-9)
    spmd = next(s for s in splits if s.num_stages == 1 and s.stage_shape == (2, 8))
    assert spmd.stage_cost(c).beta == (1e-9, c.beta_intra)
    assert [s.num_stages for s in enumerate_splits(c, max_stages=2)] == [1, 1, 1, 1, 2, 2]
    # 3 hosts x 4: 2 stages of 6 devices would straddle a host unevenly.
    assert not any(s.num_stages == 2 for s in enumerate_splits(Cluster.parse("3x4")))


def test_one_f_one_b_formula():
    # Equal stages: (m + p - 1) · t + apply.
    assert pipeline_step([1.0] * 4, 8, [0.5] * 4)["step"] == pytest.approx(11 * 1.0 + 0.5)
    # The slowest stage paces the steady state.
    parts = pipeline_step([1.0, 3.0, 1.0], 4, [0.0, 0.2, 0.1])
    assert parts == {"step": 4 * 3.0 + 2.0 + 0.2, "bottleneck": 3.0, "fill": 2.0,
                     "apply": 0.2}
    assert [in_flight(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(0, 4, 2) == 2
    assert transfer_seconds(0, 4, 4, 1e-5, 1e-9) == 0.0
    assert transfer_seconds(4e6, 4, 2, 1e-5, 1e-9) == pytest.approx(1e-5 + 2e-3)


def test_controller_slow_inter_host_links_pick_pipeline_across_hosts(gpt_graph):
    """Acceptance 4a: slow links between hosts -> one stage per host, SPMD within."""
    p = rhino.plan_pipeline(gpt_graph, cluster="2x2", beta_inter=1e-8, options=FAST)
    assert p.kind == "hybrid" and p.num_stages == 2
    assert [s.hosts for s in p.stages] == [(0,), (1,)]
    assert p.stages[0].mesh.shape == (2,)
    spmd = [c for c in p.candidates if c.kind == "spmd"]
    assert spmd and all(c.step_s > p.step_s for c in spmd)
    assert "communication" in p.decision
    assert p.crossings and {c.kind for c in p.crossings} <= {"activation", "gradient"}


def test_controller_uniform_fast_links_pick_spmd(gpt_graph):
    """Acceptance 4b: uniform fast links -> SPMD only."""
    p = rhino.plan_pipeline(gpt_graph, cluster="2x2", beta_inter=2e-10, options=FAST)
    assert p.kind == "spmd" and p.num_stages == 1 and p.stages[0].mesh.shape == (4,)
    others = [c for c in p.candidates if c.kind != "spmd"]
    assert others
    for c in others:   # slower, or pruned: its lower bound is already slower
        assert (c.feasible and c.step_s > p.step_s) or (
            c.note.startswith("pruned") and c.lower_bound_s > p.step_s)
    assert "bubble" in p.decision
    # Without pruning every candidate is costed, and SPMD still wins.
    q = rhino.plan_pipeline(gpt_graph, cluster="2x2", beta_inter=2e-10,
                            options=dataclasses.replace(FAST, prune=False))
    assert q.kind == "spmd" and all(c.feasible for c in q.candidates if c.num_stages <= 2)
    assert q.step_s == pytest.approx(p.step_s)


def test_controller_fits_a_model_too_big_to_replicate():
    """Acceptance 4c: the weights and Adam state do not fit one small device."""
    m = get_model("gpt", layers=2, hidden=256, heads=4, seq=16, vocab=2048, batch=8)
    g = rhino.ingest(m.step, *m.example_args())
    budget = 16 * 2**20
    state = sum(g.ops[q].out_bytes for q in g.params if not g.ops[q].arg.path.startswith("batch"))
    assert state > budget        # replicated state alone is over budget
    p = rhino.plan_pipeline(g, cluster="1x4", memory_bytes=budget, options=FAST)
    assert all(s.memory.total <= budget for s in p.stages)
    assert p.winner.memory <= budget and p.winner.feasible
    with pytest.raises(InfeasiblePlanError, match="budget"):
        rhino.plan_pipeline(g, cluster="1x2", memory_bytes=2 * 2**20, options=FAST)


@pytest.mark.parametrize("executor", ["thread", "serial"])
def test_a_candidate_already_slower_without_a_memory_limit_is_not_fitted(executor):
    """Fitting a plan to the budget only adds constraints: a candidate over budget whose
    unconstrained step is no faster than the best feasible one is left unfitted (its note
    says why); without pruning it is fitted, and the winner is the same. Parallel workers
    queue the fits at once, a serial search one at a time."""
    # Activations weigh enough here that 2 stages (each holding at most half the batch's
    # forward values under 1F1B) need less memory per device than SPMD over 4.
    m = get_model("gpt", layers=2, hidden=256, heads=4, seq=64, vocab=2048, batch=16)
    g = rhino.ingest(m.step, *m.example_args())
    kw = dict(cluster="1x4", memory_bytes=30 * 2**20)
    opts = dataclasses.replace(FAST, executor=executor)
    said: list[str] = []
    p = rhino.plan_pipeline(g, options=opts, progress=said.append, **kw)
    q = rhino.plan_pipeline(g, options=dataclasses.replace(opts, prune=False), **kw)
    assert p.winner.label == q.winner.label and p.step_s == pytest.approx(q.step_s)
    assert p.winner.feasible and p.winner.memory <= 30 * 2**20
    skipped = [c for c in p.candidates if "not fitted" in c.note]
    assert [c.num_stages for c in skipped] == [4]
    c = skipped[0]
    assert not c.feasible and c.memory > 30 * 2**20
    shown = float(re.search(r"its plan takes ([\d.]+) ms >= best ([\d.]+) ms", c.note)[1])
    assert shown >= 1e3 * p.step_s
    # The unpruned search fitted it (and it still did not fit).
    (c4,) = [c for c in q.candidates if c.num_stages == 4]
    assert not c4.feasible and "not fitted" not in c4.note
    # The SPMD candidate was fitted in both (its no-limit plan is the fastest of all).
    assert all("even with all" in c.note for c in (*p.candidates, *q.candidates)
               if c.num_stages == 1)
    assert "memory: fitting 1 of 1 candidates over the budget" in "\n".join(said)   # SPMD
    assert "memory: fitting 0 of 1 candidates over the budget" in "\n".join(said)   # pp=4
    assert "every pipeline candidate is over the memory budget and not faster" in p.decision


def test_a_candidate_fitted_before_a_wave_can_prune_it(monkeypatch):
    """An over-budget candidate whose no-limit step is under a wave's lower bound is fitted
    before that wave: fitted, it may beat every plan the wave could make and prune it."""
    m = get_model("gpt", layers=2, hidden=512, heads=4, seq=16, vocab=2048, batch=8)
    g = rhino.ingest(m.step, *m.example_args())
    real = search_module._cost_spmd

    def over_unless_fitted(split, plan, err, budget, lower_bound=0.0):
        c = real(split, plan, err, budget, lower_bound)
        if plan is not None and plan.memory_budget is None:   # planned with no limit
            c = dataclasses.replace(c, free_step=plan.step_time_s, candidate=dataclasses.replace(
                c.candidate, feasible=False, step_s=None, note="needs more (test)"))
        return c

    monkeypatch.setattr(search_module, "_cost_spmd", over_unless_fitted)
    said: list[str] = []
    p = rhino.plan_pipeline(g, cluster="1x4", memory_bytes=2**30, progress=said.append,
                            options=dataclasses.replace(FAST, executor="serial"))
    assert p.kind == "spmd" and p.winner.feasible and "needs more" not in p.winner.note
    assert [c.num_stages for c in p.candidates if c.note.startswith("pruned")] == [2, 4]
    fit = said.index("memory: fitting 1 of 1 candidates over the budget (the rest are no "
                     "faster than the best even with no limit)")
    assert fit < next(i for i, s in enumerate(said) if s.startswith("pruned 1 candidates "
                                                                    "with 2 stages"))


@pytest.mark.parametrize("beta_inter", [1e-8, 2e-10])     # a pipeline wins; SPMD wins
def test_candidates_are_planned_without_window_moves_and_the_winner_with_them(
        gpt_graph, monkeypatch, beta_inter):
    """O2's window moves cost about as much again as the rest of O2, so the search plans
    its candidates without them and re-plans only the chosen one with them, keeping the
    re-plan when it is no slower; ``PlanOptions(refine=False)`` plans no refinement."""
    from rhino.pipeline import spmd_pool
    from rhino.planner.api import PlanOptions
    real, seen = spmd_pool._plan_task, []

    def record(graph, mesh, cost, options):
        seen.append(options.refine)
        return real(graph, mesh, cost, options)

    monkeypatch.setattr(spmd_pool, "_plan_task", record)
    said: list[str] = []
    p = rhino.plan_pipeline(gpt_graph, cluster="2x2", beta_inter=beta_inter,
                            progress=said.append, options=FAST)
    stages = p.num_stages
    assert seen[-stages:] == [True] * stages and not any(seen[:-stages]), seen
    assert "refining the chosen plan with O2's window moves" in said
    kept_out = any(s.startswith("refined plan kept out") for s in said)
    assert kept_out != ("refined by O2's window moves" in p.winner.note)
    seen.clear()
    q = rhino.plan_pipeline(gpt_graph, cluster="2x2", beta_inter=beta_inter,
                            options=dataclasses.replace(FAST, spmd=PlanOptions(refine=False)))
    assert not any(seen) and (q.kind, q.num_stages) == (p.kind, p.num_stages)
    assert p.step_s <= q.step_s * (1 + 1e-12)


def test_a_refinement_that_cannot_be_planned_keeps_the_chosen_plan(gpt_graph, monkeypatch):
    from rhino.pipeline import spmd_pool
    real = spmd_pool._plan_task

    def refuse_refined(graph, mesh, cost, options):
        if options.refine:
            return None, "refused (test)", 0.0
        return real(graph, mesh, cost, options)

    monkeypatch.setattr(spmd_pool, "_plan_task", refuse_refined)
    said: list[str] = []
    p = rhino.plan_pipeline(gpt_graph, cluster="2x2", beta_inter=2e-10,
                            progress=said.append, options=FAST)
    assert p.kind == "spmd" and p.winner.feasible and "refined" not in p.winner.note
    assert "refined plan kept out (refused (test))" in said


def test_plan_json_round_trip_and_report(gpt_graph):
    p = rhino.plan_pipeline(gpt_graph, cluster="2x2", beta_inter=2e-8, options=FAST,
                            microbatches=4)
    q = Plan.from_json(p.to_json())
    assert q == p
    d = json.loads(p.to_json(include_spmd=False))
    assert all(s["spmd"] is None for s in d["stages"])
    assert p.num_microbatches == 4
    rep = p.report()
    for field in ("cluster", "chosen", "why", "gradient boundary", "search", "candidates",
                  "stage 0", "stage 1", "tensors between stages"):
        assert field in rep
    # Every op the program runs is on exactly one stage; copied ops are extra.
    names = [n for s in p.stages for n in s.ops]
    assert len(names) == len(set(names))
    s0 = p.stages[0]
    assert s0.op_counts["forward"] > 0 and s0.op_counts["backward"] > 0
    assert s0.spmd is not None and s0.spmd.mesh == s0.mesh
    assert any(w.startswith("params['layers'][0]") for w in s0.weights)
    t = p.search
    assert t.total >= t.stage_ilp and t.spmd_plans >= 3 and t.candidates == len(p.candidates)
    with pytest.raises(rhino.PlanMismatchError, match="format"):
        Plan.from_dict(dict(json.loads(p.to_json()), format=99))


def test_options_are_checked():
    with pytest.raises(ValueError, match="num_microbatches"):
        PipelineOptions(num_microbatches=0)
    with pytest.raises(ValueError, match="kinds"):
        PipelineOptions(kinds=("mpmd",))
    with pytest.raises(ValueError, match="executor"):
        PipelineOptions(executor="gpu")


def test_cli_plan_with_cluster(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "mlp:batch=32,hidden=64,layers=2", "--cluster", "1x2",
               "--microbatches", "2", "--max-stages", "2", "--epsilon", "0.3",
               "--beta-inter", "1e-9", "--quiet", "--output", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "rhino plan" in text and "candidates" in text and "chosen" in text
    p = Plan.from_json(out.read_text())
    assert p.cluster.hosts == 1 and p.num_microbatches in (1, 2)
    assert main(["plan", "mlp", "--cluster", "2by2", "--quiet"]) == 2
    assert "HOSTSxDEVICES" in capsys.readouterr().err


def test_plan_module_doctest():
    assert doctest.testmod(plan_module).failed == 0


@pytest.mark.parametrize("remat", [False, True])
def test_identical_stages_are_planned_once_and_renamed(remat):
    # With remat, each layer's barrier has its own name; the copies behind it still match.
    m = get_model("gpt", layers=4, hidden=32, heads=2, seq=8, vocab=32, batch=4, remat=remat)
    g = rhino.ingest(m.step, *m.example_args())
    # Volume first (the paper's objective): equal cuts in every layer gap.
    p = rhino.plan_pipeline(g, cluster="1x4", options=dataclasses.replace(
        FAST, kinds=("pipeline",), prune=False, balance_weight=0.05), epsilon=0.3)
    assert p.kind == "pipeline" and p.num_stages == 4
    # The two middle stages share one plan, among the candidates' plans and again among
    # the chosen one's re-planned with O2's window moves: 3 + 3, not 4 + 4.
    assert p.search.spmd_plans < 2 * 4
    for s in p.stages:
        planned = {o.name for o in s.spmd.ops}
        assert set(s.ops) <= planned, s.index
        assert {w for w in s.weights} <= {q.path for q in s.spmd.params}
    assert p.stages[1].weights != p.stages[2].weights


@pytest.mark.extended
def test_process_workers_find_the_serial_plan_and_keep_a_mesh_on_one_worker():
    """The forked planning workers (the default above 3000 ops) give the serial search's
    plan; plans for one stage mesh go to one worker, so that a split's first, middle and
    last stages share the worker's memo of exact segment tables."""
    m = get_model("gpt", layers=4, hidden=32, heads=2, seq=8, vocab=32, batch=4)
    g = rhino.ingest(m.step, *m.example_args())
    opts = dict(cluster="2x4", epsilon=0.3)
    serial = rhino.plan_pipeline(g, options=dataclasses.replace(FAST, executor="serial"),
                                 **opts)
    forked = rhino.plan_pipeline(g, options=dataclasses.replace(FAST, executor="process",
                                                                workers=2), **opts)
    assert forked.report() .split("search")[0] == serial.report().split("search")[0]
    assert [c.step_s for c in forked.candidates] == [c.step_s for c in serial.candidates]


def test_an_idle_worker_takes_its_own_meshes_first_and_never_waits():
    import concurrent.futures as cf

    from rhino.pipeline.spmd_pool import SpmdPool
    from rhino.planner.cost_model import CostModel
    from rhino.planner.mesh import AbstractMesh

    class Worker:                        # stands in for a one-process pool
        def __init__(self):
            self.jobs = []

        def submit(self, fn, graph, *rest):
            self.jobs.append((graph, cf.Future()))
            return self.jobs[-1][1]

        def shutdown(self, **_):
            pass

    pool = SpmdPool(1, "serial")
    pool.workers, pool.busy, pool.processes = [Worker(), Worker()], [False, False], True
    m = get_model("mlp", batch=8, hidden=8, layers=1)
    g = rhino.ingest(m.step, *m.example_args())
    a, b = AbstractMesh((8,)), AbstractMesh((2, 4))
    ca, cb = CostModel.uniform(1), CostModel.uniform(2)
    w0, w1 = pool.workers
    fa = pool.submit(g, a, ca, rhino.PlanOptions(), "a1")[0]
    fb = pool.submit(g, b, cb, rhino.PlanOptions(), "b1")[0]
    assert [len(w0.jobs), len(w1.jobs)] == [1, 1]          # a on worker 0, b on worker 1
    fb2 = pool.submit(g, b, cb, rhino.PlanOptions(), "b2")[0]
    fa2 = pool.submit(g, a, ca, rhino.PlanOptions(), "a2")[0]
    assert pool.waiting and not fb2.done()
    w0.jobs[0][1].set_result((None, "first", 1.0))          # worker 0 frees: takes a2, its mesh
    assert fa.result() == (None, "first", 1.0)
    assert len(w0.jobs) == 2 and len(pool.waiting) == 1
    w0.jobs[1][1].set_result((None, "second", 1.0))         # only b2 is left: worker 0 takes it
    assert fa2.result()[1] == "second" and len(w0.jobs) == 3 and not pool.waiting
    w0.jobs[2][1].set_exception(RuntimeError("worker died"))
    with pytest.raises(RuntimeError, match="worker died"):
        fb2.result()
    fc = pool.submit(g, a, ca, rhino.PlanOptions(), "a3")[0]   # idle worker 0 at once
    assert len(w0.jobs) == 4
    # Both busy: a later wave waits behind an earlier one, and a pruned wave is dropped.
    late = pool.submit(g, a, ca, rhino.PlanOptions(), "late", 8)
    early = pool.submit(g, b, cb, rhino.PlanOptions(), "early", 2)
    assert [q[3] for q in pool.waiting] == [early[0], late[0]]
    made = pool.made
    pool.withdraw([late])
    assert late[0].cancelled() and pool.made == made - 1
    assert pool.submit(g, a, ca, rhino.PlanOptions(), "late", 8)[0] is not late[0]
    pool.close()
    w1.jobs[0][1].cancel()
    assert fb.cancelled() and not fc.done()
