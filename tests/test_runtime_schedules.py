"""Pipeline schedules as data: validity invariants, bounds, error cases, JSON, simulation."""

import dataclasses
import doctest
import json

import pytest

from rhino.runtime.scheduling import schedules as sched
from rhino.runtime.scheduling.schedules import (SCHEDULE_NAMES, Schedule, ScheduleError, Task,
                                     from_stage_orders, in_flight_bound, make_schedule,
                                     simulate)

# The schedules whose backward is one task (zb-h1's B and W: tests/test_schedule_properties.py)
WHOLE = [n for n in SCHEDULE_NAMES if n not in sched.SPLIT_BACKWARD]
SIZES = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 5), (3, 4), (4, 4), (4, 8), (4, 3), (5, 12),
         (8, 16)]


def test_module_doctests_draw_the_tables():
    import rhino.runtime
    assert doctest.testmod(sched).failed == 0
    assert doctest.testmod(rhino.runtime).failed == 0


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p,m", SIZES)
def test_every_schedule_is_valid_and_meets_its_in_flight_bound_exactly(name, p, m):
    s = make_schedule(name, p, m)
    assert s.validate() is s
    for stage in range(p):
        tasks = s.stage_tasks(stage)
        assert [t.label for t in tasks if t.kind == "F"] == [f"F{j}" for j in range(m)]
        assert [t.label for t in tasks if t.kind == "B"] == [f"B{j}" for j in range(m)]
        assert tasks[-1] == Task("A", stage)
        # the bound is tight: the schedule uses exactly the memory it promises
        assert s.max_in_flight(stage) == in_flight_bound(name, p, m, stage)
        assert min(s.in_flight(stage)) >= 0 and s.in_flight(stage)[-1] == 0


@pytest.mark.parametrize("p,m", SIZES)
def test_bounds_per_schedule(p, m):
    for stage in range(p):
        assert in_flight_bound("gpipe", p, m, stage) == m
        assert in_flight_bound("1f1b", p, m, stage) == min(p - stage, m)
        assert in_flight_bound("eager-1f1b", p, m, stage) == min(2 * (p - stage) - 1, m)


@pytest.mark.parametrize("p,m", SIZES)
def test_same_clock_count_with_unit_tasks(p, m):
    # GPipe: 2(m + p - 1) clocks of F/B plus the apply row; 1F1B and eager reach the same
    clocks = {make_schedule(n, p, m).num_clocks for n in WHOLE}
    assert clocks == {2 * (m + p - 1) + 1}


def test_1f1b_matches_alpas_table():
    # Alpa's PipeDreamFlush docstring for 3 stages: (mb, stage) per clock
    s = make_schedule("1f1b", 3, 4)
    rows = [[t.label if t else None for t in row] for row in s.table[:7]]
    assert rows == [["F0", None, None], ["F1", "F0", None], ["F2", "F1", "F0"],
                    [None, None, "B0"], [None, "B0", "F1"], ["B0", "F2", "B1"],
                    ["F3", "B1", "F2"]]


def test_eager_runs_2p_minus_2s_minus_1_forwards_first():
    p, m = 4, 12
    s = make_schedule("eager-1f1b", p, m)
    for stage in range(p):
        kinds = [t.kind for t in s.stage_tasks(stage)]
        assert kinds.index("B") == min(2 * (p - stage) - 1, m)


def _swap(s: Schedule, a: tuple[int, int], b: tuple[int, int]) -> Schedule:
    table = [list(r) for r in s.table]
    (ka, sa), (kb, sb) = a, b
    table[ka][sa], table[kb][sb] = table[kb][sb], table[ka][sa]
    return dataclasses.replace(s, table=tuple(tuple(r) for r in table))


def test_validate_rejects_forward_before_previous_stage():
    s = make_schedule("gpipe", 2, 2)       # F0 on s1 is at clock 1; F1 on s1 at clock 2
    bad = _swap(s, (1, 1), (0, 1))          # move F0 of stage 1 to clock 0
    with pytest.raises(ScheduleError, match=r"F0 on stage 1 at clock 0: expected after F0 "
                                            r"on stage 0"):
        bad.validate()


def test_validate_rejects_backward_before_next_stage():
    s = make_schedule("1f1b", 2, 2)
    clock = s.clock_of()
    k0, k1 = clock[Task("B", 0, 0)], clock[Task("B", 1, 0)]
    table = [list(r) for r in s.table]
    table[k1][0], table[k0][0] = table[k0][0], table[k1][0]   # B0 on s0 at s1's B0 clock
    bad = dataclasses.replace(s, table=tuple(tuple(r) for r in table))
    with pytest.raises(ScheduleError, match="expected after"):
        bad.validate()


def test_validate_rejects_duplicate_missing_and_wrong_column():
    s = make_schedule("1f1b", 2, 2)
    table = [list(r) for r in s.table]
    k = s.clock_of()[Task("F", 0, 1)]
    table[k][0] = None
    with pytest.raises(ScheduleError, match="missing, first F1 on stage 0"):
        dataclasses.replace(s, table=tuple(map(tuple, table))).validate()
    table = [list(r) for r in s.table] + [[Task("F", 0, 0), None]]
    with pytest.raises(ScheduleError, match="expected once"):
        dataclasses.replace(s, table=tuple(map(tuple, table))).validate()
    table = [list(r) for r in s.table] + [[None, Task("F", 0, 7)]]
    with pytest.raises(ScheduleError, match="expected a stage of column 1"):
        dataclasses.replace(s, table=tuple(map(tuple, table))).validate()


def test_validate_rejects_exceeding_the_promised_in_flight_bound():
    g = make_schedule("gpipe", 3, 4)
    with pytest.raises(ScheduleError, match="stage 0: expected at most 3 microbatches in "
                                            "flight, found 4"):
        dataclasses.replace(g, name="1f1b").validate()


def test_deadlocking_orders_are_reported():
    orders = [[Task("F", 0, 0), Task("B", 0, 0), Task("F", 0, 1), Task("B", 0, 1),
               Task("A", 0)],
              [Task("F", 1, 1), Task("F", 1, 0), Task("B", 1, 0), Task("B", 1, 1),
               Task("A", 1)]]
    with pytest.raises(ScheduleError, match="deadlock"):
        from_stage_orders("1f1b", orders, 2)


def test_bad_names_and_sizes():
    with pytest.raises(ScheduleError, match="expected one of"):
        make_schedule("interleaved", 2, 2)
    with pytest.raises(ScheduleError, match="p=0"):
        make_schedule("1f1b", 0, 2)
    with pytest.raises(ScheduleError, match="expected kind"):
        Task("X", 0, 0)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_json_round_trip(name):
    s = make_schedule(name, 3, 5)
    assert Schedule.from_json(s.to_json()) == s
    d = json.loads(s.to_json())
    d["table"][0][0] = "B0"   # a backward before its forward
    with pytest.raises(ScheduleError):
        Schedule.from_json(json.dumps(d))


def test_simulate_hand_computed():
    # 2 stages, 2 mb, F=1, B=2: s0 F0[0,1] F1[1,2]; s1 F0[1,2] B0[2,4] F1[4,5] B1[5,7];
    # s0 B0[4,6] B1[7,9]
    tl = simulate(make_schedule("1f1b", 2, 2), 1.0, 2.0)
    assert tl.makespan == 9.0
    assert tl.start[Task("B", 0, 1)] == 7.0 and tl.end[Task("B", 1, 1)] == 7.0
    # a transfer of 0.5 delays every cross-stage dependency
    tl = simulate(make_schedule("gpipe", 2, 1), 1.0, 1.0, transfer_s=0.5, apply_s=0.25)
    assert tl.makespan == 1 + 0.5 + 1 + 1 + 0.5 + 1 + 0.25


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_eager_1f1b_hides_transfers_that_1f1b_waits_for(p, m):
    t = {n: simulate(make_schedule(n, p, m), 1.0, 2.0, transfer_s=0.5).makespan
         for n in WHOLE}
    t0 = {n: simulate(make_schedule(n, p, m), 1.0, 2.0).makespan for n in WHOLE}
    assert len(set(t0.values())) == 1          # no transfer cost: same latency (004 §4)
    assert t["eager-1f1b"] < t["1f1b"]          # with transfers, eager-1F1B overlaps them


def test_simulate_rejects_bad_durations():
    with pytest.raises(ScheduleError, match="expected one value or 2"):
        simulate(make_schedule("1f1b", 2, 2), [1.0, 2.0, 3.0], 1.0)
