"""Stage programs, instruction lists and the local pipeline executor (issue 6).

Every pipelined run is checked against single-device ``jax.jit`` of the same step.
"""

import time

import jax
import jax.numpy as jnp

import numpy as np
import pytest

import rhino
from rhino.errors import RhinoError
from rhino.hlo_passes import ingest
from rhino.hlo_passes.annotate import ScopedFunction
from rhino.models import get_model
from rhino.pipeline.coarsen import classify_ops
from rhino.pipeline.gradient import find_gradient_boundary
from rhino.parallel_plan import Plan
from rhino.pipeline.stages import assign_stages
from rhino.runtime.executors.local import (ExecutorError, LocalExecutor, LocalTransport,
                                    instructions)
from rhino.runtime.executors.artifacts import signatures
from rhino.runtime.scheduling.instructions import acknowledged_recvs, held_sends
from rhino.hlo_passes.backward_split import split_backward
from rhino.runtime.scheduling.schedules import SCHEDULE_NAMES, SPLIT_BACKWARD, make_schedule
from rhino.hlo_passes.stage_programs import (StageSplitError, assignment_from_ops, flatten,
                                             split_step, task_function)
from handmade import frozen_front_step, loss_only_last_step
from stage_runner import run_sequentially

RTOL, ATOL = 1e-4, 5e-5


def _gpt(layers=4, batch=16):
    m = get_model("gpt", layers=layers, hidden=64, heads=2, seq=16, vocab=256, batch=batch)
    params, opt = m.init(jax.random.PRNGKey(0))
    return m, params, opt, m.make_batch(jax.random.PRNGKey(1))


def _split(m, params, opt, batch, stages, micro):
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                      (params, opt, batch))
    traced = ScopedFunction(m.step, *abstract)
    g = ingest(traced, *abstract)
    b = find_gradient_boundary(g)
    if stages == 1:
        roles, stage_of = classify_ops(g, b), [0] * len(g.ops)
    else:
        a = assign_stages(g, b, stages)
        roles, stage_of = a.roles, a.stage_of
    asg = assignment_from_ops(traced, g, stage_of, roles.role)
    flat = flatten(traced.closed)
    refs = tuple(sorted(g.ops[p].arg.index for p in b.batch_params))
    return split_step(flat, asg, refs, stages, micro)


def _close(got, want):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


# 2 stages in the default suite; 1 and 3 with -m slow (the suite had grown past 18 minutes).
@pytest.mark.parametrize("stages", [pytest.param(1, marks=pytest.mark.slow), 2,
                                    pytest.param(3, marks=pytest.mark.slow)])
def test_stage_programs_reproduce_the_step(stages):
    m, params, opt, batch = _gpt(layers=3, batch=8)
    sp = _split(m, params, opt, batch, stages, micro=4)
    kinds = {k for (k, s), t in sp.tasks.items() if t.eqns}
    assert kinds == {"F", "B", "A"}
    # Each stage has forward, backward and apply work of its own.
    assert all(sp.task(k, s).eqns for k in "FBA" for s in range(stages))
    args = jax.tree_util.tree_leaves((params, opt, batch))
    got = run_sequentially(sp, args, make_schedule("1f1b", stages, 4))
    want = jax.tree_util.tree_leaves(jax.jit(m.step)(params, opt, batch))
    assert len(got) == len(want)
    _close(got, want)


def test_optimizer_runs_once_per_step_not_per_microbatch():
    m, params, opt, batch = _gpt(layers=1, batch=8)
    sp = _split(m, params, opt, batch, 1, micro=4)
    # Adam's count is updated by apply-gradients (or recomputed there), never per microbatch.
    assert sp.task("A", 0).eqns and not any(
        o.source == "acc" and o.producer[0] == "A" for o in sp.outputs)
    # The loss is a metric accumulated over microbatches.
    loss = sp.outputs[-1]
    assert loss.source == "acc"


def test_accumulated_gradients_are_not_also_returned_per_microbatch():
    """A value only apply tasks read (accumulated: the gradients) is in its task's
    ``accumulate`` and not among its outputs: a per-microbatch output would be one more
    gradient-sized buffer per microbatch, which the stage held to the step's end."""
    m, params, opt, batch = _gpt(layers=2, batch=8)
    sp = _split(m, params, opt, batch, 2, micro=4)
    results = {o.ref for o in sp.outputs if o.source == "task"}
    for key, t in sp.tasks.items():
        if key[0] in ("F", "B"):
            for r in t.outputs:     # each read per microbatch by another F/B task
                readers = {k for k in sp.consumers.get(r, ()) if k != key}
                assert r in results or any(k[0] in ("F", "B") for k in readers), (key, r)
    grads = sum(len(sp.task("B", s).accumulate) for s in range(2))
    assert grads >= len(jax.tree_util.tree_leaves(params))   # every weight's gradient
    # The first stage's backward has no result but its accumulators: its program returns
    # a token, on which the executor times it without holding up the next dispatch.
    b0 = sp.task("B", 0)
    assert not b0.outputs and b0.accumulate
    outs, new = jax.eval_shape(task_function(sp, b0, False), *signatures(sp)[("B", 0, False)])
    assert [(o.shape, o.dtype) for o in outs] == [((), jnp.bool_)]
    assert len(new) == len(b0.accumulate)


def _played(lists, held=None):
    """How far each stage's list gets when played together: a receive waits for the
    peer's send; with ``held`` (``held_sends`` per stage), a stage's apply also waits until
    those values were received."""
    pos, sent, got = [0] * len(lists), set(), set()
    progress = True
    while progress:
        progress = False
        for s, lst in enumerate(lists):
            while pos[s] < len(lst):
                i = lst[pos[s]]
                if i.op == "recv" and (i.peer, s, i.key) not in sent:
                    break
                if held and i.op == "run" and i.kind == "A" and any(
                        (s, h.peer, h.key) not in got for h in held[s]):
                    break
                if i.op == "send":
                    sent.add((s, i.peer, i.key))
                if i.op == "recv":
                    got.add((i.peer, s, i.key))
                pos[s] += 1
                progress = True
    return pos


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_instruction_lists_are_deadlock_free(schedule):
    m, params, opt, batch = _gpt(layers=3, batch=8)
    sp = _split(m, params, opt, batch, 3, micro=4)
    if schedule in SPLIT_BACKWARD:
        sp = split_backward(sp)
    lists = [instructions(sp, make_schedule(schedule, 3, 4), s) for s in range(3)]
    for lst in lists:  # a value is received once per stage
        keys = [(i.peer, i.key) for i in lst if i.op == "recv"]
        assert len(keys) == len(set(keys))
    # Play the lists: every receive is eventually matched by the peer's send.
    assert _played(lists) == [len(x) for x in lists]
    runs = [[i.label() for i in lst if i.op == "run"] for lst in lists]
    sched = make_schedule(schedule, 3, 4)
    # every task of the schedule but empty ones (zb-h1: stage 0 sends no gradient back,
    # its whole backward is W)
    assert runs == [[t.label for t in sched.stage_tasks(s)
                     if t.kind == "A" or not sp.task(t.kind, s).empty] for s in range(3)]


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_held_sends_are_the_last_backward_values_and_cannot_deadlock(schedule):
    """Before its first apply phase a stage waits (with a transport that can:
    ``wait_taken``) until the values of its last backward that other stages compute with
    are taken. On 3 stages with a tied embedding: each later stage holds the gradient it
    sends back after its last backward, never the tied weight's accumulated gradient (read
    only in stage 0's apply, maybe long after); the receivers acknowledge exactly those;
    and the lists played with the holds still run to the end."""
    m, params, opt, batch = _gpt(layers=3, batch=8)
    sp = _split(m, params, opt, batch, 3, micro=4)
    if schedule in SPLIT_BACKWARD:
        sp = split_backward(sp)
    sched = make_schedule(schedule, 3, 4)
    lists = [instructions(sp, sched, s) for s in range(3)]
    held = [held_sends(sp, sched, s) for s in range(3)]
    assert held[0] == []
    for s in (1, 2):
        if sched.splits_backward:
            # zb-h1: the stage's W tasks run between its last gradient sent back and its
            # apply; nothing is left to hold
            assert held[s] == [], held[s]
            continue
        assert held[s] and all(i.op == "send" and i.peer == s - 1 and i.microbatch == 3
                               and not i.acc for i in held[s]), held[s]
    assert any(i.acc and i.op == "send" for i in lists[2])   # the tied weight's, not held
    for s in range(3):
        assert acknowledged_recvs(sp, sched, s) == {
            (p, i.key) for p in range(3) for i in held[p] if i.peer == s}
    # Play: a stage at its first apply waits until its held values were received.
    assert _played(lists, held) == [len(x) for x in lists]


def test_split_errors():
    m, params, opt, batch = _gpt(layers=1, batch=8)
    flat = flatten(jax.make_jaxpr(m.step)(params, opt, batch))
    n = flat.num_args
    with pytest.raises(StageSplitError, match="stage in"):
        split_step(flat, {flat.eqns[0].path: ("fwd", 5)}, (n - 1,), 2, 2)
    with pytest.raises(StageSplitError, match="batch arguments"):
        split_step(flat, {}, (), 1, 2)
    with pytest.raises(StageSplitError, match="divisible by num_microbatches=3"):
        split_step(flat, {}, (n - 1,), 1, 3)


def test_integer_metrics_and_counts_are_kept_by_their_rules():
    """An integer count over the batch is summed as an integer; a step counter in the
    state is updated once per step (neither is averaged over microbatches)."""
    def count_step(w, count, x):
        g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - g, count + 1, jnp.sum(x > 0)
    w, x = jnp.ones((4, 2)), jax.random.normal(jax.random.PRNGKey(0), (8, 4))
    flat = flatten(jax.make_jaxpr(count_step)(w, jnp.int32(3), x))
    sp = split_step(flat, {}, (2,), 1, 4)
    got = run_sequentially(sp, [w, jnp.int32(3), x], make_schedule("1f1b", 1, 4))
    want = jax.jit(count_step)(w, jnp.int32(3), x)
    assert int(got[1]) == 4 and int(got[2]) == int(want[2]) and got[2].dtype == jnp.int32
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert sp.acc_rules[flat.outs[2]] == ("sum", None)


# ------------------------------------------------------------------------ executors
@pytest.fixture(scope="module")
def gpt_run():
    """GPT-4 layers, 2 stages x 4 devices, 4 microbatches, 1F1B (pinned: the tests of this
    fixture read 1F1B's tasks and sends): 10 steps beside jax.jit."""
    m, params, opt, batch = _gpt(layers=4, batch=16)
    step = rhino.auto_parallel(m.step, cluster="2x4", stages=2, num_microbatches=4,
                               schedule="1f1b", timeout=120)
    ref = jax.jit(m.step)
    p1, o1, p2, o2 = params, opt, params, opt
    losses = []
    for _ in range(10):
        p1, o1, l1 = step(p1, o1, batch)
        p2, o2, l2 = ref(p2, o2, batch)
        losses.append((float(l1), float(l2)))
    yield dict(model=m, step=step, params=(params, opt, batch), final=(p1, o1, p2, o2),
               losses=losses)
    step.close()


def test_gpt_pipeline_matches_single_device(gpt_run):
    for got, want in gpt_run["losses"]:
        assert got == pytest.approx(want, rel=RTOL)
    p1, o1, p2, o2 = gpt_run["final"]
    _close((p1, o1), (p2, o2))
    plan = gpt_run["step"].plan_for(*gpt_run["params"])
    assert plan.num_stages == 2 and all(s.mesh.shape == (4,) for s in plan.stages)
    # Stage meshes are disjoint sets of the local devices; updated weights live there.
    devs = [set(d.id for d in leaf.devices()) for leaf in jax.tree_util.tree_leaves(p1)]
    assert {frozenset(d) for d in devs} <= {frozenset(range(4)), frozenset(range(4, 8))}
    assert len({frozenset(d) for d in devs}) == 2


def test_updated_state_leaves_its_program_in_the_sharding_the_next_step_reads():
    """A result that updates an argument comes out of its apply program in that argument's
    sharding (``StageShardings.results``, as the SPMD path's out_shardings), so the next
    step takes the array as it is instead of resharding it before the stage's first task.
    (At this size stage 1's plan updates a layer's ``wqkv`` split by columns and reads it
    whole; a value another stage produced, such as the tied embedding, still moves.)"""
    m = get_model("gpt", layers=2, hidden=256, heads=4, seq=32, vocab=1024, batch=8)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    ref = jax.jit(m.step)
    with rhino.auto_parallel(m.step, cluster="2x4", stages=2, num_microbatches=4,
                             timeout=120) as step:
        p1, o1, p2, o2 = params, opt, params, opt
        for _ in range(3):
            p1, o1, l1 = step(p1, o1, batch)
            p2, o2, l2 = ref(p2, o2, batch)
            assert float(l1) == pytest.approx(float(l2), rel=RTOL)
        for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=2e-4)
        run = step._entry((params, opt, batch)).run
        assert any(sh.results for sh in run.lowering.shardings)
        for w in run.executor.workers:
            own = [r for r, x in w._state_src.items()
                   if isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) == w.mesh]
            assert own, w.stage
            moved = [(r, w._state_src[r].sharding.spec, w.sharding(r).spec) for r in own
                     if w._state[r] is not w._state_src[r]]
            assert moved == [], (w.stage, moved)


def test_a_tied_weight_gradient_crosses_stages_once_per_step(gpt_run):
    """GPT ties its embedding: its gradient is the LM head's part (stage 1) plus the
    embedding's part (stage 0). That sum and what follows it up to Adam are linear, so the
    split moves them to apply-gradients: stage 1 sums its part over the microbatches and
    sends it once per step (an ``acc`` value), not every microbatch (losses: the test
    above)."""
    step = gpt_run["step"]
    params, opt, batch = gpt_run["params"]
    run = step._entry((params, opt, batch)).run
    split = run.lowering.split
    wte = tuple(params["wte"].shape)
    shape = lambda i: tuple(split.flat.avals[i.ref].shape)   # noqa: E731
    per_mb = [i.ref for i in split.task("B", 0).inputs
              if i.source == "task" and i.producer == ("B", 1) and shape(i) == wte]
    once = [i.ref for i in split.task("A", 0).inputs
            if i.source == "acc" and i.producer == ("B", 1) and shape(i) == wte]
    assert per_mb == [] and len(once) == 1, (per_mb, once)
    sends = [ins for ins in run.executor.workers[1].instrs
             if ins.op == "send" and ins.ref == once[0]]
    assert len(sends) == 1 and sends[0].acc, sends


def test_microbatches_of_one_example_compute_the_step():
    """The zoo's default batch (4) in 4 microbatches: the stage programs are made from the
    step traced at the whole batch (a microbatch of one example is a chunk of it), so the
    plan made there is the plan that runs, and the step computes what jax.jit computes."""
    m, params, opt, batch = _gpt(layers=4, batch=4)
    ref = jax.jit(m.step)
    step = rhino.auto_parallel(m.step, cluster="2x4", stages=2, num_microbatches=4,
                               timeout=120)
    p1, o1, p2, o2 = params, opt, params, opt
    try:
        for _ in range(5):
            p1, o1, l1 = step(p1, o1, batch)
            p2, o2, l2 = ref(p2, o2, batch)
            assert float(l1) == pytest.approx(float(l2), rel=RTOL)
        run = step._entry((params, opt, batch)).run
        split = run.lowering.split
        tokens = run.lowering.batch_refs[0]
        assert split.microbatch_shape(tokens) == (1, 16)
        assert tuple(split.flat.avals[tokens].shape) == (4, 16)
    finally:
        step.close()


@pytest.mark.parametrize("schedule", ["gpipe", "eager-1f1b", "zb-h1"])
def test_other_schedules_give_the_same_losses(gpt_run, schedule):
    m = gpt_run["model"]
    params, opt, batch = gpt_run["params"]
    saved = Plan.from_json(gpt_run["step"].plan_for(params, opt, batch).to_json())
    step = rhino.auto_parallel(m.step, cluster="2x4", num_microbatches=4, schedule=schedule,
                               plan=saved, timeout=120)
    p, o = params, opt
    for k in range(3):
        p, o, loss = step(p, o, batch)
        assert float(loss) == pytest.approx(gpt_run["losses"][k][0], rel=RTOL)
    step.close()


def test_zb_h1_cuts_each_backward_and_computes_1f1bs_numbers(gpt_run):
    """Issue 44: under ``zb-h1`` each stage's backward is two programs, B (the gradients
    the previous stage waits for) and W (the weight gradients, from what B hands it): the
    same equations, each once, so the step's numbers are 1F1B's bit for bit."""
    m = gpt_run["model"]
    params, opt, batch = gpt_run["params"]
    saved = Plan.from_json(gpt_run["step"].plan_for(params, opt, batch).to_json())
    runs = {}
    for schedule in ("1f1b", "zb-h1"):
        step = rhino.auto_parallel(m.step, cluster="2x4", num_microbatches=4,
                                   schedule=schedule, plan=saved, timeout=120)
        try:
            p, o = params, opt
            for _ in range(2):
                p, o, loss = step(p, o, batch)
            runs[schedule] = [np.asarray(x) for x in jax.tree_util.tree_leaves((p, o, loss))]
            split = step._entry((params, opt, batch)).run.lowering.split
            labels = {r.label for r in step.timeline().records}
        finally:
            step.close()
    for a, b in zip(runs["1f1b"], runs["zb-h1"]):
        np.testing.assert_array_equal(a, b)
    assert {"W0", "W3", "B0", "F0", "A"} <= labels
    whole = gpt_run["step"]._entry((params, opt, batch)).run.lowering.split
    for s in range(2):
        b, w = split.task("B", s), split.task("W", s)
        assert sorted(b.eqns + w.eqns) == sorted(whole.task("B", s).eqns)
        assert not set(b.eqns) & set(w.eqns) and w.eqns and not w.outputs
        assert set(b.accumulate) | set(w.accumulate) == set(whole.task("B", s).accumulate)
        # the gradients the previous stage reads are B's; W reads what B hands it, the
        # forward's values and (as the unsplit backward did) the next stage's gradients
        assert set(whole.task("B", s).outputs) <= set(b.outputs)
        assert {i.producer for i in w.inputs if i.source == "task"} <= {
            ("B", s), ("F", s), ("B", s + 1)}
    assert not split.task("B", 0).eqns      # stage 0 sends no gradient: all of it is W
    assert split.task("B", 1).eqns


def test_a_backward_binding_host_callbacks_is_left_whole(gpt_run, monkeypatch):
    """Cut, a callback's order against the rest of the backward could change: a backward
    whose equations bind one stays one program, its W empty."""
    from rhino.hlo_passes import backward_split

    params, opt, batch = gpt_run["params"]
    whole = gpt_run["step"]._entry((params, opt, batch)).run.lowering.split
    stage1 = set(whole.task("B", 1).eqns)
    monkeypatch.setattr(backward_split.stage_effects, "loud",
                        lambda split, eqns: bool(set(eqns) & stage1))
    cut = backward_split.split_backward(whole)
    assert cut.task("B", 1) == whole.task("B", 1) and cut.task("W", 1).empty
    assert cut.task("W", 0).eqns and not cut.task("B", 0).eqns


def test_timeline_of_measured_tasks(gpt_run, tmp_path):
    step = gpt_run["step"]
    tl = step.timeline(tmp_path / "t.png")
    labels = {(r.stage, r.label) for r in tl.records}
    for s in range(2):
        for k in range(4):
            assert (s, f"F{k}") in labels and (s, f"B{k}") in labels
        assert (s, "A") in labels
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tl.step_s > 0 and step.last_step_s > 0


def test_the_timeline_as_chrome_trace_events(gpt_run, tmp_path):
    """Issue 48, item 8: ``timeline(trace=)`` (or a ``.json`` path) writes the step as
    Chrome / Perfetto trace events: a process per stage, a complete event per task with its
    kind and microbatch, in microseconds from the step's start."""
    import json

    step = gpt_run["step"]
    tl = step.timeline(tmp_path / "t.png", trace=tmp_path / "t.json")
    assert (tmp_path / "t.png").exists()
    trace = json.loads((tmp_path / "t.json").read_text())
    tasks = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(tasks) == len(tl.records)
    names = {(e["pid"], e["name"]) for e in tasks}
    assert {(s, f"B{k}") for s in range(2) for k in range(4)} <= names
    assert {e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"} == {"stage 0", "stage 1"}
    assert min(e["ts"] for e in tasks) == 0.0
    assert max(e["ts"] + e["dur"] for e in tasks) == pytest.approx(tl.step_s * 1e6, rel=1e-3)
    assert all(e["args"]["microbatch"] in range(4) for e in tasks if e["cat"] == "forward")
    assert trace["otherData"]["schedule"] == "1f1b"
    step.timeline(tmp_path / "only.json")
    assert json.loads((tmp_path / "only.json").read_text())["traceEvents"]


def test_tasks_are_named_in_a_jax_profiler_trace(gpt_run, tmp_path):
    """Issue 48, item 8: with ``jax.profiler`` tracing, each task's dispatch appears as a
    trace annotation ``rhino stageS LABEL`` (in the trace the profiler writes)."""
    import gzip
    import json

    step = gpt_run["step"]
    args = jax.tree.map(np.array, gpt_run["params"])    # host copies: nothing donated
    jax.profiler.start_trace(str(tmp_path))
    try:
        jax.block_until_ready(step(*args))
    finally:
        jax.profiler.stop_trace()
    found = list(tmp_path.rglob("*.trace.json.gz"))
    assert found, sorted(str(p) for p in tmp_path.rglob("*"))
    events = json.loads(gzip.decompress(found[0].read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    for s in range(2):
        for label in ("F0", "B3", "A"):
            assert f"rhino stage{s} {label}" in names, sorted(n for n in names
                                                             if n and "rhino" in n)


def test_memory_budget_with_a_cluster_bounds_each_stage_estimate():
    m, params, opt, batch = _gpt(layers=2, batch=8)
    tight = rhino.auto_parallel(m.step, cluster="2x4", stages=2, memory_budget=1024)
    with pytest.raises(rhino.InfeasiblePlanError, match=r"stage \d needs .* > budget 1.00 KiB"):
        tight.plan_for(params, opt, batch)
    budget = 64 << 20
    with rhino.auto_parallel(m.step, cluster="2x4", stages=2, memory_budget=budget) as step:
        plan = step.plan_for(params, opt, batch)
    assert plan.memory_budget == budget and all(s.memory.total <= budget for s in plan.stages)
    assert "budget 64.00 MiB per device" in plan.report()


def test_annotations_with_a_cluster_pin_the_stage_plans():
    m, params, opt, batch = _gpt(layers=2, batch=8)
    ann = {"params['wte']": "R·S[x]", "params['layers'][1]['w1']": "S[x]·R"}
    ref = jax.jit(m.step)
    with rhino.auto_parallel(m.step, cluster="2x4", stages=2, annotations=ann,
                             timeout=120) as step:
        plan = step.plan_for(params, opt, batch)
        got = {}
        for st in plan.stages:
            for q in st.spmd.params:
                if q.path in ann:
                    got.setdefault(q.path, set()).add(q.spec.to_str(st.spmd.mesh))
        assert got == {k: {v} for k, v in ann.items()}, got
        p1, o1, p2, o2 = params, opt, params, opt
        for _ in range(3):
            p1, o1, l1 = step(p1, o1, batch)
            p2, o2, l2 = ref(p2, o2, batch)
            assert float(l1) == pytest.approx(float(l2), rel=RTOL)
    # A spec no stage mesh can hold leaves no candidate, and says why.
    bad = rhino.auto_parallel(m.step, cluster="2x4", stages=2,
                              annotations={"params['wte']": "S[y]·R"})
    with pytest.raises(rhino.RhinoError, match=r"annotation \"params\['wte'\]\""):
        bad.plan_for(params, opt, batch)


def test_batch_not_divisible_by_microbatches_is_a_clear_error(gpt_run):
    m = gpt_run["model"]
    params, opt, batch = gpt_run["params"]
    saved = gpt_run["step"].plan_for(params, opt, batch)
    step = rhino.auto_parallel(m.step, cluster="2x4", num_microbatches=3, plan=saved)
    with pytest.raises(RhinoError, match="divisible by num_microbatches=3"):
        step(params, opt, batch)


class _Lossy(LocalTransport):
    """Drops every value sent to stage 0."""

    def send(self, src, dst, key, value):
        if dst != 0:
            super().send(src, dst, key, value)


def test_a_lost_value_times_out_naming_stage_and_instruction(gpt_run):
    step = gpt_run["step"]
    params, opt, batch = gpt_run["params"]
    entry = step._entry((params, opt, batch))
    ex = LocalExecutor(entry.run.executor.workers, timeout=2.0)
    ex.transport = _Lossy(2)
    with pytest.raises(ExecutorError, match=r"stage 0, recv v\d+@0←1: timed out"):
        ex.run(jax.tree_util.tree_leaves((params, opt, batch)))
    ex.close()


class _FailingInBackground(LocalTransport):
    """Sends on the stage's sender thread (``send_in_background``: a transport whose send
    waits for the value); every value for stage 1 fails."""

    send_in_background = True

    def send(self, src, dst, key, value):
        if dst == 1:
            raise ConnectionError("the receiver is gone")
        super().send(src, dst, key, value)


def test_a_background_send_that_fails_is_the_named_root_cause_at_once(gpt_run):
    """The failure of a send made on the sender thread stops the stage's waits: the step
    fails with that send named, not after the other stages' timeouts."""
    step = gpt_run["step"]
    params, opt, batch = gpt_run["params"]
    entry = step._entry((params, opt, batch))
    ex = LocalExecutor(entry.run.executor.workers, timeout=60.0)
    ex.transport = _FailingInBackground(2)
    t0 = time.monotonic()
    with pytest.raises(ExecutorError,
                       match=r"^stage 0, send v\d+@0→1: ConnectionError: the receiver is gone"):
        ex.run(jax.tree_util.tree_leaves((params, opt, batch)))
    assert time.monotonic() - t0 < 30
    ex.close()


def test_executor_options_are_checked():
    with pytest.raises(RhinoError, match="schedule"):
        rhino.auto_parallel(lambda x: x, cluster="2x4", schedule="zigzag")
    with pytest.raises(RhinoError, match="executor"):
        rhino.auto_parallel(lambda x: x, cluster="2x4", executor="mpi")
    with pytest.raises(rhino.OptionsError, match="a mesh .* or a cluster, found both"):
        rhino.auto_parallel(lambda x: x, cluster="2x4", mesh_shape=(8,))
    with pytest.raises(rhino.OptionsError, match="num_microbatches: expected a positive "
                                                 "integer or None, found 0"):
        rhino.auto_parallel(lambda x: x, cluster="2x4", num_microbatches=0)
    with pytest.raises(rhino.OptionsError, match="memory_budget .*found '2GB'"):
        rhino.auto_parallel(lambda x: x, memory_budget="2GB")


@pytest.mark.slow   # the default suite runs UNet pipelines on Ray (test_runtime_ray, _multihost)
def test_unet_pipeline_matches_single_device():
    """UNet (skip connections cross stages), 2 stages x 4 devices, 4 microbatches, 1F1B."""
    m = get_model("unet", batch=16)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    step = rhino.auto_parallel(m.step, cluster="2x4", stages=2, num_microbatches=4,
                               timeout=120)
    ref = jax.jit(m.step)
    p1, o1, p2, o2 = params, opt, params, opt
    for _ in range(10):
        p1, o1, l1 = step(p1, o1, batch)
        p2, o2, l2 = ref(p2, o2, batch)
        assert float(l1) == pytest.approx(float(l2), rel=RTOL)
    _close((p1, o1), (p2, o2))
    assert step.plan_for(params, opt, batch).num_stages == 2
    step.close()


def test_distributed_init_creates_state_on_the_stage_meshes(gpt_run):
    m = gpt_run["model"]
    params, opt, batch = gpt_run["params"]
    step = gpt_run["step"]
    key = jax.random.PRNGKey(0)
    p, o = step.distributed_init(m.init, key, example_args=(params, opt, batch))
    _close((p, o), (params, opt))  # equal to the single-device init with the same seed
    entry = step._entry((params, opt, batch))
    for k, leaf in enumerate(jax.tree_util.tree_leaves((p, o))):
        split = entry.run.lowering.split
        first = next(w for w in entry.run.executor.workers if k in split.stage_args(w.stage))
        assert leaf.sharding.is_equivalent_to(first.sharding(k), leaf.ndim)
    p1, o1, loss = step(p, o, batch)
    assert float(loss) == pytest.approx(gpt_run["losses"][0][0], rel=RTOL)
    with pytest.raises(RhinoError, match="leaf 0"):
        step.distributed_init(lambda k: jnp.zeros(3), key, example_args=(params, opt, batch))


def test_cross_mesh_broadcast_transport_matches_and_moves_fewer_cross_host_bytes(gpt_run):
    """004's resharding between the stage meshes (hosts: 4 devices each) gives the same
    step; broadcast moves fewer bytes across hosts than send/recv."""
    m = gpt_run["model"]
    params, opt, batch = gpt_run["params"]
    saved = gpt_run["step"].plan_for(params, opt, batch)
    cross = {}
    for strategy in ("broadcast", "send_recv"):
        step = rhino.auto_parallel(m.step, cluster="2x4", num_microbatches=4,
                                   plan=saved, transport=strategy, timeout=120)
        p, o, loss = step(params, opt, batch)
        assert float(loss) == pytest.approx(gpt_run["losses"][0][0], rel=RTOL)
        t = step._entry((params, opt, batch)).run.executor.transport
        cross[strategy] = t.cross_host_bytes
        step.close()
    assert 0 < cross["broadcast"] < cross["send_recv"]


def test_hand_given_split_is_honored_and_matches():
    m, params, opt, batch = _gpt(layers=4, batch=16)
    split = {"params['wte']": 0, "params['wpe']": 0, "params['layers'][0]": 0,
             "params['layers'][1]": 1, "params['layers'][2]": 1, "params['layers'][3]": 1}
    step = rhino.auto_parallel(m.step, cluster="2x4", stages=split, num_microbatches=4,
                               timeout=120)
    _close(step(params, opt, batch), jax.jit(m.step)(params, opt, batch))
    plan = step.plan_for(params, opt, batch)
    w0, w1 = (set(s.weights) for s in plan.stages)
    assert "params['layers'][0]['w1']" in w0 and "params['layers'][1]['w1']" in w1
    assert not any(w.startswith("params['layers'][0]") for w in w1)
    assert not any(w.startswith("params['layers'][3]") for w in w0)
    step.close()


def test_hand_given_split_errors():
    from rhino.pipeline.stage_ilp import StageAssignmentError
    from rhino.pipeline.stages import assign_given_stages

    m, params, opt, batch = _gpt(layers=2, batch=8)
    g = ingest(m.step, params, opt, batch)
    b = find_gradient_boundary(g)
    with pytest.raises(StageAssignmentError, match="forward data must flow"):
        assign_given_stages(g, b, {"params['layers'][0]": 1, "params['layers'][1]": 0})
    with pytest.raises(StageAssignmentError, match="found none"):
        assign_given_stages(g, b, {"params['nope']": 0, "params['layers'][1]": 1})
    with pytest.raises(StageAssignmentError, match="empty"):
        assign_given_stages(g, b, {"params['layers']": 2})
    a = assign_given_stages(g, b, {"params['layers'][0]": 0, "params['layers'][1]": 1})
    assert a.num_stages == 2 and a.solution.status == "given"


@pytest.mark.extended
def test_checkpointed_layers_are_recomputed_in_the_backward_programs():
    """GPT with ``jax.checkpoint`` per layer, pipelined: a forward task hands its backward
    task only the inputs of each checkpointed layer (the backward program recomputes the
    rest), so what each stage holds besides its state and gradient accumulators (in-flight
    handed values + its largest program's temporaries) is at most 0.8 of the same
    pipeline's without remat (issue 31); losses equal jax.jit's. (0.7 before the backward programs stopped returning each microbatch's
    gradients besides accumulating them: those buffers were outputs, outside this estimate;
    now the stage's reduced gradients are temporaries of both pipelines' backward, which
    puts stage 1 at 0.727 with jax 0.10.2 and 0.750 with jax 0.12 (which hands 2.73 MB
    without remat, not 2.99), stage 0 at 0.54.)"""
    mem = {}
    for remat in (False, True):
        m = get_model("gpt", layers=4, hidden=128, heads=4, seq=64, batch=16, remat=remat)
        params, opt = m.init(jax.random.PRNGKey(0))
        batch = m.make_batch(jax.random.PRNGKey(1))
        step = rhino.auto_parallel(m.step, cluster="2x4", stages=2, num_microbatches=4,
                                   timeout=300)
        try:
            p1, o1, l1 = step(params, opt, batch)
            p2, o2, l2 = jax.jit(m.step)(params, opt, batch)
            assert float(l1) == pytest.approx(float(l2), rel=1e-5)
            for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
                # Adam's first update turns summation order near eps into up to 1e-4
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
            workers = step._entry((params, opt, batch)).run.executor.workers
            mem[remat] = [w.memory() for w in workers]
        finally:
            step.close()
    for s, (plain, checked) in enumerate(zip(mem[False], mem[True])):
        assert checked["handed"] < 0.3 * plain["handed"], (s, plain, checked)
        held = {k: x["peak"] - x["state"] - x["accumulators"]
                for k, x in (("plain", plain), ("checked", checked))}
        assert held["checked"] <= 0.8 * held["plain"], (s, plain, checked)


def _host(tree):
    return jax.tree_util.tree_map(np.array, tree)


def test_a_stage_without_trained_weights_has_no_backward_or_apply_task():
    """Issue 43: stage 0 holds only frozen layers, so its backward and apply tasks compute
    nothing (``TaskSpec.empty``): no program is made for them (``signatures``, what the
    artifacts export) and no instruction list runs them. 3 steps equal jax.jit, and the
    loss (stage 1) divided by the number of positive features of a frozen layer (stage 0)
    divides as jax.jit's results do (before: "incompatible devices", each result committed to
    its own stage's devices)."""
    step, (params, frozen, x, y), opts = frozen_front_step()
    ref = jax.jit(step)
    with rhino.auto_parallel(step, cluster="2x4", stages=2, num_microbatches=4, timeout=120,
                             **opts) as piped:
        p1, p2 = _host(params), params
        for _ in range(3):
            p1, l1, a1 = piped(p1, frozen, x, y)
            p2, l2, a2 = ref(p2, frozen, x, y)
            np.testing.assert_allclose(float(l1 / a1), float(l2 / a2), rtol=1e-5)
            assert int(a1) == int(a2) and a1.dtype == a2.dtype
        _close(p1, p2)
        split = piped.split_for(p1, frozen, x, y)
        assert sorted(k for k, t in split.tasks.items() if t.empty) == [("A", 0), ("B", 0)]
        assert {(k, s) for k, s, _ in signatures(split)} == {("F", 0), ("F", 1), ("B", 1),
                                                              ("A", 1)}
        workers = piped._entry((p1, frozen, x, y)).run.executor.workers
        assert {i.kind for i in workers[0].instrs if i.op == "run"} == {"F"}
        assert {i.kind for i in workers[1].instrs if i.op == "run"} == {"F", "B", "A"}
        # Each 0-d result is uncommitted, on a device of the stage that made it.
        assert not l1.committed and not a1.committed
        assert {d.id for d in l1.devices()} <= set(range(4, 8))
        assert {d.id for d in a1.devices()} <= set(range(4))


def test_a_stage_that_is_only_the_loss_has_no_apply_task():
    """Stage 1 is the loss alone (no weights): its apply task is empty, the instruction
    list ends with its last backward task; 2 steps equal jax.jit."""
    step, (params, x, y), _ = loss_only_last_step()
    ref = jax.jit(step)
    with rhino.auto_parallel(step, cluster="2x4", stages=2, num_microbatches=4,
                             timeout=120) as piped:
        p1, p2 = _host(params), params
        for _ in range(2):
            p1, l1 = piped(p1, x, y)
            p2, l2 = ref(p2, x, y)
            assert float(l1) == pytest.approx(float(l2), rel=1e-5)
        _close(p1, p2)
        split = piped.split_for(p1, x, y)
        assert [k for k, t in split.tasks.items() if t.empty] == [("A", 1)]
        last = piped._entry((p1, x, y)).run.executor.workers[1].instrs
        assert [i.kind for i in last if i.op == "run"][-1] == "B"
