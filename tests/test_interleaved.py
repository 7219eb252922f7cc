"""Interleaved 1F1B run (issue 44): device groups each running several stages of the model
in the order of their column of the schedule (``executors.group_worker``), planned with
``stages=`` device groups and ``virtual_stages=``, on the local executor and (in
``test_launch.py``) under ``rhino.launch``. Every run is checked against ``jax.jit``.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

import rhino
from rhino.errors import OptionsError
from rhino.models import get_model
from rhino.parallel_plan import Plan
from rhino.runtime.executors.group_worker import GroupWorker, group_units
from rhino.runtime.scheduling.instructions import group_instructions, instructions, task_blocks
from rhino.runtime.scheduling.schedules import Task, make_schedule
from rhino.vocabulary import ScheduleKind
from test_runtime_pipeline import _gpt, _split

RTOL = 1e-4


def _played_groups(lists):
    """How far each group's ``(stage, instruction)`` list gets when the groups run together
    (one thread each): a receive waits for its sender's send."""
    pos, sent = [0] * len(lists), set()
    progress = True
    while progress:
        progress = False
        for g, lst in enumerate(lists):
            while pos[g] < len(lst):
                s, i = lst[pos[g]]
                if i.op == "recv" and (i.peer, s, i.key) not in sent:
                    break
                if i.op == "send":
                    sent.add((s, i.peer, i.key))
                pos[g] += 1
                progress = True
    return pos


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (2, 2, 8), (2, 3, 4), (3, 2, 6)])
def test_group_lists_follow_the_column_and_cannot_deadlock(p, v, m):
    """Each group runs its stages' tasks in its column's order (each stage's own list
    untouched, its blocks interleaved), and the groups' lists played together run to the
    end: every receive is matched, also between two stages of one group."""
    gpt, params, opt, batch = _gpt(layers=p * v, batch=2 * m)
    sp = _split(gpt, params, opt, batch, p * v, micro=m)
    sched = make_schedule("interleaved-1f1b", p, m, virtual_stages=v)
    lists = [group_instructions(sp, sched, g) for g in range(p)]
    for g, lst in enumerate(lists):
        runs = [(s, i.label()) for s, i in lst if i.op == "run"]
        want = [(t.stage, t.label) for t in sched.stage_tasks(g)
                if t.kind == "A" or not sp.task(t.kind, t.stage).empty]
        assert runs == want
        for c in sched.chunks_of(g):   # each stage's instructions, in its own order
            assert [i for s, i in lst if s == c] == instructions(sp, sched, c)
    assert _played_groups(lists) == [len(x) for x in lists]


def _clipped_mlp(layers=4, width=16, batch=8):
    """A step clipping its update by the global gradient norm: every stage's apply reads
    the squared norms of every other stage's gradients (apply phases)."""
    import jax.numpy as jnp

    def step(params, batch):
        x, y = batch

        def loss(ps):
            h = x
            for w in ps:
                h = jnp.tanh(h @ w)
            return jnp.mean((h - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads))
        scale = jnp.minimum(1.0, 1.0 / norm)
        return [w - 0.1 * scale * g for w, g in zip(params, grads)], value

    keys = jax.random.split(jax.random.PRNGKey(0), layers + 2)
    params = [jax.random.normal(k, (width, width)) / width ** 0.5 for k in keys[:layers]]
    batch = (jax.random.normal(keys[-2], (batch, width)),
             jax.random.normal(keys[-1], (batch, width)))
    return step, params, batch


def _split_of(step, args, stages, micro):
    from rhino.hlo_passes import ingest
    from rhino.hlo_passes.annotate import ScopedFunction
    from rhino.hlo_passes.stage_programs import assignment_from_ops, flatten, split_step
    from rhino.pipeline.gradient import find_gradient_boundary
    from rhino.pipeline.stages import assign_stages

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    traced = ScopedFunction(step, *abstract)
    g = ingest(traced, *abstract)
    b = find_gradient_boundary(g)
    a = assign_stages(g, b, stages)
    asg = assignment_from_ops(traced, g, a.stage_of, a.roles.role)
    refs = tuple(sorted(g.ops[p].arg.index for p in b.batch_params))
    return split_step(flatten(traced.closed), asg, refs, stages, micro)


@pytest.mark.parametrize("p,v", [(2, 2), (2, 3)])
def test_apply_phases_of_a_group_run_one_phase_of_each_stage_at_a_time(p, v):
    """With the update clipped by the global gradient norm, a stage's second apply phase
    reads the first phase of every stage: a group runs its stages' first phases, then
    their second (before: stage 0's both phases, waiting for stage 2's first: a deadlock
    found on Flax NNX's LM with gradient-norm clipping)."""
    step, params, batch = _clipped_mlp(layers=p * v)
    sp = _split_of(step, (params, batch), p * v, micro=4)
    assert any(len(phases) > 1 for phases in sp.apply_phases.values())
    sched = make_schedule("interleaved-1f1b", p, 4, virtual_stages=v)
    lists = [group_instructions(sp, sched, g) for g in range(p)]
    assert _played_groups(lists) == [len(x) for x in lists]
    for g, lst in enumerate(lists):
        applies = [(s, i.kind) for s, i in lst if i.op == "run" and i.kind.startswith("A")]
        phases = [sp.apply_phases[c] for c in sched.chunks_of(g)]
        want = [(c, ph[k]) for k in range(max(map(len, phases)))
                for c, ph in zip(sched.chunks_of(g), phases)
                if k < len(ph) and not sp.task(ph[k], c).empty]
        assert applies == want


def test_task_blocks_start_at_a_tasks_receives():
    gpt, params, opt, batch = _gpt(layers=4, batch=8)
    sp = _split(gpt, params, opt, batch, 4, micro=4)
    sched = make_schedule("interleaved-1f1b", 2, 4, virtual_stages=2)
    lst = instructions(sp, sched, 1)
    blocks = task_blocks(lst)
    assert blocks[0] == ("F", 0) and lst[0].op == "recv"
    for n, (kind, mb) in blocks.items():
        assert n == 0 or lst[n - 1].op in ("run", "send")
        run = next(i for i in lst[n:] if i.op == "run")
        assert (run.kind, run.microbatch) == (kind, mb)
    assert len(blocks) == sum(i.op == "run" for i in lst)


def test_schedule_chunk_views():
    s = make_schedule("interleaved-1f1b", 2, 4, virtual_stages=2)
    assert s.chunks_of(0) == (0, 2) and s.chunks_of(1) == (1, 3)
    assert [s.group_of(c) for c in range(4)] == [0, 1, 0, 1]
    assert all(t.stage == 2 for t in s.chunk_tasks(2))
    assert s.chunk_tasks(2)[-1] == Task("A", 2)
    # a chunk holds at most its group's in-flight microbatches, and at least one
    assert all(1 <= s.chunk_in_flight(c) <= s.max_in_flight(s.group_of(c)) for c in range(4))
    one = make_schedule("1f1b", 3, 4)
    assert [one.chunk_in_flight(c) for c in range(3)] == [one.max_in_flight(c)
                                                          for c in range(3)]


# ------------------------------------------------------------------------ options
@pytest.mark.parametrize("options,match", [
    (dict(stages=2, virtual_stages=2, schedule="1f1b"), "expected 'interleaved-1f1b'"),
    (dict(stages=2, schedule="interleaved-1f1b"), "virtual_stages: expected >= 2"),
    (dict(virtual_stages=2), "expected a count of device groups >= 2"),
    (dict(stages={"params": 0}, virtual_stages=2), "expected a count of device groups"),
    (dict(stages=2, virtual_stages=0), "virtual_stages"),
])
def test_virtual_stage_options_are_checked(options, match):
    with pytest.raises(OptionsError, match=match):
        rhino.auto_parallel(lambda x: x, cluster="2x4", **options)


def test_virtual_stages_imply_the_interleaved_schedule_and_run_on_the_local_executor():
    step = rhino.auto_parallel(lambda x: x, cluster="2x4", stages=2, virtual_stages=2)
    assert step.options.schedule is ScheduleKind.INTERLEAVED
    assert step.options.virtual_stages == 2


# ------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def gpt_interleaved():
    """GPT of 4 layers on cluster 2x4: 2 device groups of 4 devices, each running 2 of the
    model's 4 stages; 8 microbatches; 3 steps beside jax.jit."""
    m, params, opt, batch = _gpt(layers=4, batch=16)
    step = rhino.auto_parallel(m.step, cluster="2x4", stages=2, virtual_stages=2,
                               num_microbatches=8, timeout=120)
    ref = jax.jit(m.step)
    p1, o1, p2, o2 = params, opt, params, opt
    losses = []
    for _ in range(3):
        p1, o1, l1 = step(p1, o1, batch)
        p2, o2, l2 = ref(p2, o2, batch)
        losses.append((float(l1), float(l2)))
    yield dict(step=step, args=(params, opt, batch), final=(p1, o1, p2, o2), losses=losses)
    step.close()


def test_interleaved_gpt_equals_jax_jit(gpt_interleaved):
    for got, want in gpt_interleaved["losses"]:
        assert got == pytest.approx(want, rel=RTOL)
    p1, o1, p2, o2 = gpt_interleaved["final"]
    for a, b in zip(jax.tree.leaves((p1, o1)), jax.tree.leaves((p2, o2))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=5e-5)
    step = gpt_interleaved["step"]
    plan = step.plan_for(*gpt_interleaved["args"])
    assert plan.schedule is ScheduleKind.INTERLEAVED and plan.virtual_stages == 2
    assert plan.num_stages == 4
    assert [s.devices for s in plan.stages] == [tuple(range(4)), tuple(range(4, 8))] * 2
    # the updated weights of stages 0 and 2 live on group 0's devices
    assert {frozenset(d.id for d in x.devices()) for x in jax.tree.leaves(p1)} <= {
        frozenset(range(4)), frozenset(range(4, 8))}


def test_one_thread_per_device_group_runs_its_stages_in_column_order(gpt_interleaved):
    executor = gpt_interleaved["step"]._entry(gpt_interleaved["args"]).run.executor
    units = executor.units
    assert [type(u) for u in units] == [GroupWorker, GroupWorker]
    assert [u.stages for u in units] == [(0, 2), (1, 3)]
    assert len(executor.workers) == 4 and group_units(executor.workers)[0].stages == (0, 2)
    # each group dispatched its stages' programs in its column's order
    sched = units[0].schedule
    for g, u in enumerate(units):
        assert u.last_order == [(t.stage, t.label) for t in sched.stage_tasks(g)]
    assert [(s, label) for s, label in units[0].last_order[:4]] == [
        (0, "F0"), (0, "F1"), (2, "F0"), (2, "F1")]
    # and its timeline has them one after another on the group's devices
    runs = {(r.stage, r.label): r for r in executor.last_records
            if r.kind in ("forward", "backward", "apply")}
    for u in units:
        seq = [runs[k] for k in u.last_order]
        assert all(b.start >= min(a.end, b.end) for a, b in zip(seq, seq[1:]))


def test_interleaved_plan_report_json_and_refusals(gpt_interleaved):
    plan = gpt_interleaved["step"].plan_for(*gpt_interleaved["args"])
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.virtual_stages == 2
    assert json.loads(plan.to_json())["virtual_stages"] == 2
    text = plan.report()
    assert "2 per device group" in text and "interleaved-1f1b" in text
    assert "1f1b on the same device groups" in plan.decision
    moved = dataclasses.replace(plan.stages[2], devices=plan.stages[1].devices)
    with pytest.raises(ValueError, match="stage 2 .*expected the devices of stage 0"):
        dataclasses.replace(plan, stages=(plan.stages[0], plan.stages[1], moved,
                                          plan.stages[3]))
    with pytest.raises(ValueError, match="virtual_stages"):
        dataclasses.replace(plan, schedule=ScheduleKind.ONE_F_ONE_B)
    m = get_model("gpt", layers=4, hidden=64, heads=2, seq=16, vocab=256, batch=16)
    with pytest.raises(OptionsError, match="runs 'interleaved-1f1b'"):
        rhino.auto_parallel(m.step, plan=plan, schedule="1f1b")(*gpt_interleaved["args"])


def test_stage_artifacts_carry_the_virtual_stages(gpt_interleaved):
    """What the Ray executor ships to its actors (one per device group: the run itself is
    ``test_runtime_ray.py::test_interleaved_1f1b_runs_one_actor_per_device_group``): each
    stage's artifact says it is one of 2 per group, so built from it a stage runs the
    interleaved schedule, and the executor puts stages 0, 2 and 1, 3 on one actor each."""
    from rhino.runtime.executors.artifacts import export_stages
    from rhino.runtime.ray.executor import device_groups

    run = gpt_interleaved["step"]._entry(gpt_interleaved["args"]).run
    arts = export_stages(run.specs, run.lowering.split, "cpu")
    assert [a.virtual_stages for a in arts] == [2] * 4
    assert device_groups(arts) == device_groups(run.specs) == {0: (0, 2), 1: (1, 3)}
    workers = [arts[c].build(jax.devices()[:4]) for c in (2, 0)]
    try:
        assert workers[0].schedule.virtual_stages == 2
        assert workers[0].schedule.num_chunks == 4
        assert [u.stages for u in group_units(workers)] == [(0, 2)]
    finally:
        for w in workers:
            w.close()


# ------------------------------------------------------------------ other layouts
@pytest.mark.parametrize("schedule", [
    "1f1b", *(pytest.param(s, marks=pytest.mark.extended)
              for s in ("gpipe", "eager-1f1b", "zb-h1"))])
def test_four_stages_of_two_devices_under_every_schedule(schedule):
    """Issue 44, acceptance 2's other layout: GPT on 4 stages of 2 devices (cluster 2x4),
    8 microbatches, under each schedule of one stage per group: 3 steps equal jax.jit."""
    m, params, opt, batch = _gpt(layers=4, batch=16)
    step = rhino.auto_parallel(m.step, cluster="2x4", stages=4, num_microbatches=8,
                               schedule=schedule, timeout=120)
    ref = jax.jit(m.step)
    p1, o1, p2, o2 = params, opt, params, opt
    try:
        for _ in range(3):
            p1, o1, l1 = step(p1, o1, batch)
            p2, o2, l2 = ref(p2, o2, batch)
            assert float(l1) == pytest.approx(float(l2), rel=RTOL)
        plan = step.plan_for(params, opt, batch)
        assert plan.num_stages == 4 and plan.schedule.value == schedule
        assert [len(s.devices) for s in plan.stages] == [2] * 4
        for a, b in zip(jax.tree.leaves((p1, o1)), jax.tree.leaves((p2, o2))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=5e-5)
    finally:
        step.close()


def test_interleaved_is_priced_by_its_table_and_each_group_holds_its_stages_memory():
    """``price_interleaved``: the search's 1F1B estimate of the 4 stages scaled by the
    simulated interleaved table over 1F1B on the same stages; 1F1B on the 2 device groups
    (each running its 2 stages back to back) for the report; each group's memory the sum
    of its stages' at their own microbatches in flight."""
    from rhino.parallel_plan import StageEstimate, StageMemory
    from rhino.pipeline.schedule_choice import price_interleaved, with_in_flight
    from rhino.runtime.scheduling import schedules as S

    est = [StageEstimate(3.0, 0.0, 0.0, 0.0)] * 4
    flops = [(1.0, 2.0, 0.0)] * 4                  # F 1 s, backward 2 s per microbatch
    mem = [StageMemory(100 * (c + 1), 0, 10, 1, 0, handed=7) for c in range(4)]
    price = price_interleaved(est, mem, flops, 8, 2, step_1f1b=50.0)
    inter = S.make_schedule("interleaved-1f1b", 2, 8, 2)
    sim = S.simulate(inter, 1.0, 2.0).makespan
    base = S.simulate(S.make_schedule("1f1b", 4, 8), 1.0, 2.0).makespan
    grouped = S.simulate(S.make_schedule("1f1b", 2, 8), 2.0, 4.0).makespan
    assert price.step_s == pytest.approx(50.0 * sim / base)
    assert price.grouped_1f1b == pytest.approx(50.0 * grouped / base)
    # the closed forms: bubble (p - 1)/(v m) of the work against 1F1B's (p - 1)/m
    assert sim == pytest.approx(2 * 8 * 3.0 * (1 + 1 / 16))     # v stages of 8 × 3 s
    assert grouped == pytest.approx(8 * 6.0 * (1 + 1 / 8))
    assert price.step_s < price.grouped_1f1b and "under 1f1b on the same" in price.text()
    assert price.in_flight == tuple(inter.chunk_in_flight(c) for c in range(4))
    assert price.group_peaks == tuple(
        sum(with_in_flight(mem[c], price.in_flight[c]).total for c in (g, g + 2))
        for g in range(2))


def test_rhino_plan_cli_plans_interleaving(capsys):
    from rhino.cli import main

    assert main(["plan", "gpt:layers=4,hidden=64,heads=2,seq=16,vocab=256,batch=16",
                 "--cluster", "2x4", "--stages", "2", "--virtual-stages", "2",
                 "--microbatches", "8", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "4 stages" in out and "schedule interleaved-1f1b: est." in out
    assert "stages (2 per device group, interleaved" in out
    # a schedule that contradicts the virtual stages is refused, naming both
    assert main(["plan", "gpt:layers=4,hidden=64,heads=2,seq=16,vocab=256,batch=16",
                 "--cluster", "2x4", "--stages", "2", "--virtual-stages", "2",
                 "--schedule", "zb-h1", "--quiet"]) != 0
    assert "expected 'interleaved-1f1b' with virtual_stages=2" in capsys.readouterr().err


def test_the_timeline_has_a_row_per_device_group(gpt_interleaved):
    tl = gpt_interleaved["step"].timeline()
    assert tl.num_stages == 2 and tl.schedule == "interleaved-1f1b"
    labels = {r.stage: {r.label for r in tl.records if r.kind == "forward"} for r in tl.records}
    assert {"F0/s0", "F0/s2", "F7/s2"} <= labels[0] and {"F0/s1", "F7/s3"} <= labels[1]
    assert tl.render_text().startswith("interleaved-1f1b: 2 stages × 8 microbatches")
