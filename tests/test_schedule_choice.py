"""The planner chooses the schedule (issue 44, acceptance 4): ``schedule="auto"``, the
default, picks another schedule than 1F1B where its own estimate says it is faster, and
never one whose activations exceed the memory budget — over generated stage estimates and
memories, and on the zoo GPT through ``rhino.plan`` and ``auto_parallel``."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rhino.parallel_plan import StageEstimate, StageMemory  # noqa: E402
from rhino.pipeline.schedule_choice import CHOICES, choose  # noqa: E402


@st.composite
def stages(draw):
    p = draw(st.integers(2, 6))
    m = draw(st.integers(1, 16))
    est = [StageEstimate(draw(st.floats(0.01, 2.0)), draw(st.floats(0.0, 0.5)),
                         draw(st.floats(0.0, 0.5)), draw(st.floats(0.0, 1.0)))
           for _ in range(p)]
    mem = []
    for s in range(p):
        state, handed, work = (draw(st.integers(0, 1000)) for _ in range(3))
        k = min(p - s, m)
        mem.append(StageMemory(state, 0, work, k, state + work + (k - 1) * handed, handed))
    flops = [(draw(st.floats(0.1, 3.0)), draw(st.floats(0.1, 6.0)), 0.0) for _ in range(p)]
    budget = draw(st.one_of(st.none(), st.integers(0, 30000)))
    return est, mem, flops, m, budget


@settings(max_examples=150, deadline=None)
@given(stages(), st.floats(0.1, 100.0))
def test_the_choice_is_the_fastest_schedule_that_fits_and_never_over_budget(case, step):
    est, mem, flops, m, budget = case
    c = choose(est, mem, flops, m, step, budget)
    assert c.steps["1f1b"] == pytest.approx(step)     # the search's own 1F1B estimate
    assert c.step_s <= step * (1 + 1e-9)
    if c.name != "1f1b":
        assert c.fits[c.name] and (budget is None or c.peaks[c.name] <= budget)
        assert c.step_s < step
    fitting = [n for n in CHOICES if c.fits[n]]
    if fitting:
        assert c.step_s <= min(c.steps[n] for n in fitting) * (1 + 1e-9) or c.name == "1f1b"


def test_zb_h1_wins_when_it_fits_and_is_refused_over_the_budget():
    est = [StageEstimate(3.0, 0.0, 0.0, 0.0)] * 4
    handed = [3, 3, 3, 10]
    mem = [StageMemory(0, 0, 10, 4 - s, 10 + (3 - s) * h, h) for s, h in enumerate(handed)]
    flops = [(1.0, 2.0, 0.0)] * 4
    free = choose(est, mem, flops, 4, 21.0, None)
    assert free.name == "zb-h1" and free.step_s == pytest.approx(15.0)
    assert "zb-h1: est. 15000.000 ms, 28.6 % under 1f1b's 21000.000 ms" in free.text()
    tight = choose(est, mem, flops, 4, 21.0, 20)
    assert tight.name == "1f1b" and not tight.fits["zb-h1"] and tight.peaks["1f1b"] <= 20
    assert "zb-h1 15000.000 ms (over the memory budget)" in tight.text()


def test_eager_1f1b_wins_where_transfers_would_stall_1f1b():
    # sends as long as a forward: eager-1F1B's extra warm-up forwards hide them (004 §4)
    est = [StageEstimate(3.0, 0.0, 1.0, 0.0)] * 4
    mem = [StageMemory(0, 0, 1, 4 - s, 1 + (3 - s), 1) for s in range(4)]
    c = choose(est, mem, [(1.0, 2.0, 0.0)] * 4, 8, 50.0, None)
    assert c.steps["eager-1f1b"] < c.steps["1f1b"]
    assert c.name in ("eager-1f1b", "zb-h1")


def _gpt():
    from rhino.models import get_model
    return get_model("gpt", layers=4, hidden=64)


def test_rhino_plan_chooses_a_schedule_and_says_by_how_much():
    import rhino

    m = _gpt()
    auto = rhino.plan(m.step, *m.example_args(), cluster="2x4", stages=2, microbatches=4)
    pinned = rhino.plan(m.step, *m.example_args(), cluster="2x4", stages=2, microbatches=4,
                        schedule="1f1b")
    assert pinned.schedule.value == "1f1b"
    assert auto.schedule.value != "1f1b" and auto.step_s < pinned.step_s
    assert f"schedule {auto.schedule.value}: est." in auto.decision
    assert "under 1f1b's" in auto.decision
    # the chosen schedule's activations in flight are the plan's stage memory
    from rhino.runtime.scheduling.schedules import in_flight_bound
    for s, stage in enumerate(auto.stages):
        assert stage.memory.in_flight == in_flight_bound(auto.schedule.value, 2, 4, s)


def test_a_budget_that_only_1f1b_fits_keeps_1f1b():
    import rhino

    m = _gpt()
    auto = rhino.plan(m.step, *m.example_args(), cluster="2x4", stages=2, microbatches=4)
    pinned = rhino.plan(m.step, *m.example_args(), cluster="2x4", stages=2, microbatches=4,
                        schedule="1f1b")
    need = max(s.memory.total for s in pinned.stages)
    assert max(s.memory.total for s in auto.stages) > need     # the winner holds more
    tight = rhino.plan(m.step, *m.example_args(), cluster="2x4", stages=2, microbatches=4,
                       memory_budget=need)
    assert max(s.memory.total for s in tight.stages) <= need
    assert tight.schedule.value == "1f1b" or tight.step_s <= pinned.step_s
