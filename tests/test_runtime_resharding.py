"""Cross-mesh resharding (004 §3): unit tasks, strategies, load balancers, simulator, and real
data movement between meshes of the 8 simulated CPU devices (tests/conftest.py)."""

import doctest
import random

import jax
import numpy as np
import pytest

from rhino.runtime.transfer import load_balance as lb
from rhino.runtime.transfer import resharding as rs
from rhino.runtime.transfer.load_balance import (BALANCERS, JOB_KINDS, CommJob, LoadBalanceError,
                                        Topology, balance, brute_force, dfs, simulate)
from rhino.runtime.transfer.resharding import (STRATEGIES, DeviceMesh, ReshardingError, TileSpec,
                                      default_device_of, distribute, execute, expected_tiles,
                                      plan_resharding, to_global_array, unit_tasks)

# 004 Table 2
CASES = {
    1: ("S^0RR", "S^0RR", (2, 4), (2, 4)),
    2: ("RRR", "S^0RR", (2, 4), (2, 4)),
    3: ("RS^0R", "S^0RR", (2, 4), (2, 4)),
    4: ("RS^01R", "S^01RR", (2, 4), (2, 4)),
    5: ("S^1RR", "S^0RR", (2, 4), (2, 4)),
    6: ("S^0RR", "S^0RR", (2, 4), (3, 4)),
    7: ("S^1RR", "RRR", (1, 4), (2, 4)),
    8: ("RRR", "RRR", (2, 3), (3, 2)),
    9: ("RS^0R", "RRS^0", (2, 4), (2, 4)),
}
PAPER = (1024, 1024, 512)


def meshes(case):
    _, _, sm, dm = CASES[case]
    a = DeviceMesh.grid(sm)
    return a, DeviceMesh.grid(dm, first_device=a.devices[-1] + 1, first_host=a.hosts[-1] + 1)


def test_module_doctests():
    assert doctest.testmod(rs).failed == 0
    assert doctest.testmod(lb).failed == 0


def test_eight_simulated_devices():
    assert len(jax.devices()) == 8


# ---- tilings and unit tasks ---------------------------------------------------------------

def test_tile_spec_parse_print_and_tiles():
    assert TileSpec.parse("S^0RR").dims == ((0,), (), ())
    assert TileSpec.parse("RS^{01}R") == TileSpec.parse("RS01R")
    assert str(TileSpec.parse("RRS^1")) == "RRS^1"
    with pytest.raises(ReshardingError, match="expected R or S"):
        TileSpec.parse("SxR")
    with pytest.raises(ReshardingError, match="at most once"):
        TileSpec.parse("S^0S^0")
    m = DeviceMesh.grid((2, 4))
    s = TileSpec.parse("S^01R")
    assert [s.tile((16, 3), m, i)[0] for i in range(8)] == [(2 * i, 2 * i + 2) for i in range(8)]
    # uneven: 10 rows over 3 hosts -> blocks of 4, 4, 2 (004 pads instead)
    m3 = DeviceMesh.grid((3, 2))
    assert [TileSpec.parse("S^0R").tile((10, 2), m3, i)[0] for i in (0, 2, 4)] == \
        [(0, 4), (4, 8), (8, 10)]
    with pytest.raises(ReshardingError, match="expected 2 dims over mesh axes < 2"):
        TileSpec.parse("S^2R").check((4, 4), m)


def test_from_sharding_spec():
    from rhino.planner.spec import ShardingSpec
    assert TileSpec.from_sharding_spec(ShardingSpec.parse("S[x,y]·R")).dims == ((0, 1), ())
    with pytest.raises(ReshardingError, match="no partial"):
        TileSpec.from_sharding_spec(ShardingSpec.parse("R·S[x/s2]"))


def test_figure_2_unit_tasks():
    a = DeviceMesh.grid((2, 2))
    b = DeviceMesh.grid((2, 2), first_device=4, first_host=2)
    t1 = unit_tasks((4, 4), 1, a, TileSpec.parse("S^01R"), b, TileSpec.parse("S^0R"))
    assert len(t1) == 4 and t1[0].dst_devices == (4, 5) and t1[2].dst_devices == (6, 7)
    assert [t.src_devices for t in t1] == [(0,), (1,), (2,), (3,)]
    # Task 2: S^0R on B -> S^0S^1 on A: two unique slices, each needed by two devices
    t2 = unit_tasks((4, 4), 1, b, TileSpec.parse("S^0R"), a, TileSpec.parse("S^0S^1"))
    assert {t.src_devices for t in t2} == {(4, 5), (6, 7)}
    assert sorted(t.dst_devices for t in t2) == [(0,), (1,), (2,), (3,)]


def test_meshes_must_be_disjoint():
    a = DeviceMesh.grid((2, 2))
    with pytest.raises(ReshardingError, match="disjoint"):
        unit_tasks((4, 4), 4, a, TileSpec.parse("RR"), a, TileSpec.parse("RR"))
    with pytest.raises(ReshardingError, match="distinct devices"):
        DeviceMesh((2,), (0, 0), (0, 0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_unit_tasks_partition_each_destination_tile(case):
    ss, ds, _, _ = CASES[case]
    a, b = meshes(case)
    shape = (24, 16, 8)
    tasks = unit_tasks(shape, 4, a, TileSpec.parse(ss), b, TileSpec.parse(ds))
    regions = [t.region for t in tasks]
    assert len(set(regions)) == len(regions)          # unique slices
    for i, d in enumerate(b.devices):
        tile = TileSpec.parse(ds).tile(shape, b, i)
        mine = [t for t in tasks if d in t.dst_devices]
        assert sum(t.nbytes for t in mine) == 4 * np.prod([hi - lo for lo, hi in tile])
    for t in tasks:   # every listed holder really holds the region
        for d in t.src_devices:
            tile = TileSpec.parse(ss).tile(shape, a, a.devices.index(d))
            assert all(lo <= r0 and r1 <= hi for (lo, hi), (r0, r1) in zip(tile, t.region))


# ---- data correctness: every case, every strategy, on the simulated devices -----------------

@pytest.mark.parametrize("case", sorted(CASES))
def test_table2_every_destination_device_holds_the_right_data(case):
    ss, ds, _, _ = CASES[case]
    a, b = meshes(case)
    shape = (24, 16, 8)
    data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    src = distribute(data, a, ss)
    want = expected_tiles(data, b, ds)
    bytes_by = {}
    for strategy in STRATEGIES:
        plan = plan_resharding(shape, 4, a, ss, b, ds, strategy=strategy, balancer="greedy")
        ex = execute(plan, src)
        for d, v in want.items():
            assert ex.pieces[d].devices() == {default_device_of(d)}
            np.testing.assert_array_equal(np.asarray(ex.pieces[d]), v)
        assert ex.cross_host_bytes == plan.cross_host_bytes
        bytes_by[strategy] = plan.cross_host_bytes
        if case != 6:   # (3, 4) needs 12 distinct jax devices
            g = to_global_array(ex.pieces, b, ds, shape)
            np.testing.assert_array_equal(np.asarray(g), data)
    assert bytes_by["broadcast"] == bytes_by["allgather"] <= bytes_by["send_recv"]


@pytest.mark.parametrize("case", [4, 6])
def test_uneven_tiles(case):
    ss, ds, _, _ = CASES[case]
    a, b = meshes(case)
    shape = (20, 6, 4)      # 20 rows over 8 (case 4) or 3 (case 6) shards: uneven blocks
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ex = execute(plan_resharding(shape, 4, a, ss, b, ds, balancer="best", time_budget_s=0.2),
                 distribute(data, a, ss))
    for d, v in expected_tiles(data, b, ds).items():
        np.testing.assert_array_equal(np.asarray(ex.pieces[d]), v)
    with pytest.raises(ReshardingError, match="divisible|distinct"):
        to_global_array(ex.pieces, b, ds, shape)


def test_broadcast_cross_host_bytes_are_one_copy_per_receiving_host():
    for case in CASES:
        ss, ds, _, _ = CASES[case]
        a, b = meshes(case)
        plan = plan_resharding(PAPER, 4, a, ss, b, ds, balancer="greedy")
        expect = sum(t.nbytes * len({b.host_of(d) for d in t.dst_devices}) for t in plan.tasks)
        assert plan.cross_host_bytes == expect
        sr = plan_resharding(PAPER, 4, a, ss, b, ds, strategy="send_recv", balancer="greedy")
        assert sr.cross_host_bytes == sum(t.nbytes * len(t.dst_devices) for t in sr.tasks)
        for j, dev in enumerate(plan.sender_devices):   # senders hold their slice
            assert dev in plan.tasks[plan.jobs[j].unit].src_devices
            assert a.host_of(dev) == plan.assignment.senders[j]


def test_execute_rejects_missing_or_misshapen_pieces():
    a, b = meshes(1)
    data = np.zeros((8, 4, 2), np.float32)
    plan = plan_resharding(data.shape, 4, a, "S^0RR", b, "S^0RR", balancer="naive")
    src = distribute(data, a, "S^0RR")
    with pytest.raises(ReshardingError, match="expected a piece for source device 0"):
        execute(plan, {k: v for k, v in src.items() if k != 0})
    with pytest.raises(ReshardingError, match="expected a piece of shape"):
        execute(plan, {**src, 0: jax.numpy.zeros((1, 1, 1))})


# ---- simulator, hand-computed ---------------------------------------------------------------

def test_durations_hand_computed():
    topo = Topology(nic_bandwidth=2.0, intra_bandwidth=8.0, host_nic_bandwidth=((5, 1.0),))
    bc = CommJob("broadcast", 0, (0,), (1, 2), (1, 1), 4.0)
    assert bc.duration(0, topo) == 2.0                       # one pipelined copy: t
    assert bc.duration(0, Topology(2.0, 8.0, pipeline_chunks=4)) == 2.0 * (1 + 2 / 4)
    assert CommJob("broadcast", 0, (0,), (1,), (4,), 4.0).duration(
        0, Topology(2.0, 1.0)) == 4.0                          # intra forwarding is slower
    ag = CommJob("allgather", 0, (0,), (1,), (4,), 4.0)
    assert ag.duration(0, topo) == 2.0 + 4.0 / 8.0 * 3 / 4   # t + all-gather inside
    assert CommJob("send_recv", 0, (0,), (5,), (1,), 4.0).duration(0, topo) == 4.0  # slow NIC
    assert CommJob("send_recv", 0, (3,), (3,), (1,), 4.0).duration(3, topo) == 0.5  # intra


def test_simulate_order_semantics_hand_computed():
    topo = Topology(nic_bandwidth=1.0)
    # 004 case 3 in miniature: hosts 0, 1 send; 2, 3 receive; slices (r, c) on host c to r
    jobs = [CommJob("broadcast", i, (c,), (2 + r,), (4,), 1.0)
            for i, (r, c) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)])]
    natural = simulate(jobs, [0, 1, 0, 1], [0, 1, 2, 3], topo)
    assert natural.start == (0.0, 1.0, 1.0, 2.0) and natural.makespan == 3.0
    swapped = simulate(jobs, [0, 1, 0, 1], [0, 3, 1, 2], topo)
    assert swapped.makespan == 2.0
    # a job whose receivers are all on its sender's host uses no NIC
    local = CommJob("broadcast", 4, (2,), (2,), (3,), 10.0)
    sim = simulate(jobs + [local], [0, 1, 0, 1, 2], [4, 0, 3, 1, 2], topo)
    assert sim.start[4] == 0.0 and sim.end[4] == 10.0 / topo.intra_bandwidth
    with pytest.raises(LoadBalanceError, match="expected a sender among"):
        simulate(jobs, [1, 1, 0, 1], [0, 1, 2, 3], topo)
    with pytest.raises(LoadBalanceError, match="permuting"):
        simulate(jobs, [0, 1, 0, 1], [0, 1, 2], topo)


def test_table2_case3_and_case4_simulated_times():
    topo = Topology()
    a, b = meshes(3)
    t = (PAPER[0] * PAPER[1] * PAPER[2] * 4 / 4) / topo.nic_bandwidth   # one quarter
    best = plan_resharding(PAPER, 4, a, "RS^0R", b, "S^0RR", balancer="best")
    assert best.simulated_s == pytest.approx(2 * t)
    naive = plan_resharding(PAPER, 4, a, "RS^0R", b, "S^0RR", balancer="naive")
    assert naive.simulated_s == pytest.approx(3 * t)
    sr = plan_resharding(PAPER, 4, a, "RS^0R", b, "S^0RR", strategy="send_recv",
                         balancer="greedy")
    assert sr.simulated_s == pytest.approx(15 * t)      # B0's 8 copies, then B1's 8 from 7t
    a, b = meshes(4)
    t64 = (PAPER[0] * PAPER[1] * PAPER[2] * 4 / 64) / topo.nic_bandwidth
    d = plan_resharding(PAPER, 4, a, "RS^01R", b, "S^01RR", balancer="dfs", time_budget_s=5)
    assert d.assignment.complete and d.simulated_s == pytest.approx(32 * t64)   # optimal


# ---- load balancers vs brute force ----------------------------------------------------------

def _random_jobs(rng, n):
    jobs = []
    for u in range(n):
        kind = rng.choice(JOB_KINDS)
        cands = tuple(rng.sample([0, 1, 2], rng.randint(1, 2)))
        hosts = tuple(sorted(rng.sample([2, 3, 4], rng.randint(1, 2)))) if kind == "broadcast" \
            else (rng.choice([2, 3, 4]),)
        jobs.append(CommJob(kind, u, cands, hosts, tuple(rng.randint(1, 3) for _ in hosts),
                            float(rng.choice([1, 2, 3]))))
    return jobs


def test_dfs_matches_brute_force_and_nothing_beats_it():
    rng = random.Random(7)
    topo = Topology(nic_bandwidth=1.0, intra_bandwidth=10.0)
    for _ in range(60):
        jobs = _random_jobs(rng, rng.randint(1, 5))
        opt = brute_force(jobs, topo)
        d = dfs(jobs, topo, time_budget_s=5.0)
        assert d.complete and d.makespan == pytest.approx(opt.makespan)
        for name in BALANCERS:
            got = balance(jobs, topo, name, seed=rng.randint(0, 99))
            assert got.makespan >= opt.makespan - 1e-12
            assert got.makespan == pytest.approx(
                simulate(jobs, got.senders, got.order, topo).makespan)


def test_balancers_on_table2_case2_style_choice():
    # two holders, two receivers: naive sends both from host 0; the others split
    topo = Topology(nic_bandwidth=1.0)
    jobs = [CommJob("broadcast", i, (0, 1), (2 + i,), (4,), 1.0) for i in range(2)]
    assert balance(jobs, topo, "naive").makespan == 2.0
    for name in ("greedy", "randomized_greedy", "dfs", "best"):
        assert balance(jobs, topo, name).makespan == 1.0


def test_dfs_time_budget_returns_best_found():
    rng = random.Random(3)
    jobs = _random_jobs(rng, 30)
    a = dfs(jobs, Topology(), time_budget_s=0.05)
    assert len(a.order) == 30 and sorted(a.order) == list(range(30))
    assert a.makespan == pytest.approx(simulate(jobs, a.senders, a.order, Topology()).makespan)


def test_unknown_balancer_and_bad_topology():
    with pytest.raises(LoadBalanceError, match="expected one of"):
        balance([], Topology(), "ilp")
    with pytest.raises(LoadBalanceError, match="positive finite"):
        Topology(nic_bandwidth=0.0)
    with pytest.raises(ReshardingError, match="expected one of"):
        plan_resharding((4,), 4, DeviceMesh.grid((2,)), "R", DeviceMesh.grid((2,), 2, 2), "R",
                        strategy="p2p")
