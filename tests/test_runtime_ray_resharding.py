"""Cross-mesh resharding with every host a Ray actor (``benchmarks/ray_resharding.py``, the
Table 2 benchmark's executor).

Needs ray (skipped otherwise). One local Ray cluster (4 CPUs) and one pool of host actors
serve the module; tensors are tiny, the meshes are those of 004's Table 2.
"""

from __future__ import annotations

import pathlib
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rhino.runtime.ray.executor import init  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
from ray_resharding import (ActorExecution, HostActors, check_tiles,  # noqa: E402
                            execute_on_actors)
from rhino.runtime.transfer.resharding import (DeviceMesh, ReshardingError,  # noqa: E402
                                      expected_tiles, plan_resharding)

# The extended tier (Ray, several processes, the docs' commands, the slowest runs): run by
# .ci/run after the default suite (README, Tests: `-m "extended and not slow"`).
pytestmark = pytest.mark.extended

# case: (send spec, recv spec, send mesh, recv mesh), as benchmarks/cross_mesh_resharding.py
CASES = {
    1: ("S^0RR", "S^0RR", (2, 4), (2, 4)),
    3: ("RS^0R", "S^0RR", (2, 4), (2, 4)),
    4: ("RS^01R", "S^01RR", (2, 4), (2, 4)),
    8: ("RRR", "RRR", (2, 3), (3, 2)),
}
SHAPE = (8, 8, 4)


@pytest.fixture(scope="module")
def hosts():
    if ray.is_initialized():
        ray.shutdown()
    init(num_cpus=4, log_to_driver=False)
    pool = HostActors(5, timeout=30.0)
    yield pool
    pool.close()
    ray.shutdown()


def _case(case: int, strategy: str, shape=SHAPE):
    ss, ds, sm, dm = CASES[case]
    a = DeviceMesh.grid(sm)
    b = DeviceMesh.grid(dm, first_device=a.devices[-1] + 1, first_host=a.hosts[-1] + 1)
    data = np.random.default_rng(case).standard_normal(shape, dtype=np.float32)
    plan = plan_resharding(shape, 4, a, ss, b, ds, strategy=strategy, balancer="best")
    return plan, expected_tiles(data, a, ss), expected_tiles(data, b, ds)


@pytest.mark.parametrize("case", sorted(CASES))
def test_table2_case_on_actors(hosts, case):
    got = {}
    for strategy in ("send_recv", "broadcast"):
        plan, src, want = _case(case, strategy)
        ex = execute_on_actors(plan, src, hosts, label=f"case {case}, {strategy}")
        assert isinstance(ex, ActorExecution)
        check_tiles(ex, want, f"case {case}, {strategy}")  # every destination device
        assert ex.cross_host_bytes == plan.cross_host_bytes
        assert ex.local_bytes == plan.intra_host_bytes
        # The plan's senders: each host sent exactly the jobs the balancer gave it.
        for h, s in ex.hosts.items():
            assert s.jobs_sent == sum(x == h for x in plan.assignment.senders), (h, s)
        assert ex.seconds > 0
        got[strategy] = (plan, ex)
    (bp, bx), (sp, sx) = got["broadcast"], got["send_recv"]
    assert bx.cross_host_bytes <= sx.cross_host_bytes
    # broadcast: one object per job, fetched once per receiving host;
    # send/recv: one object per (job, destination device).
    assert bx.puts == len(bp.jobs)
    assert bx.fetches == sum(len(j.receiver_hosts) for j in bp.jobs)
    assert sx.puts == sx.fetches == sum(len(r) for r in sp.job_receivers)
    if case in (1, 3, 8):   # several destination devices per host share each slice
        assert bx.cross_host_bytes < sx.cross_host_bytes


def test_allgather_and_both_senders_used(hosts):
    # Case 3 (RS^0R -> S^0RR): both source hosts hold every slice; the best balancer
    # splits the jobs over them, and the actors follow it.
    plan, src, want = _case(3, "broadcast")
    assert set(plan.assignment.senders) == {0, 1}
    ex = execute_on_actors(plan, src, hosts, label="case 3")
    check_tiles(ex, want)
    assert ex.hosts[0].jobs_sent > 0 and ex.hosts[1].jobs_sent > 0
    plan, src, want = _case(1, "allgather")
    ex = execute_on_actors(plan, src, hosts, label="case 1, allgather")
    check_tiles(ex, want)
    assert ex.cross_host_bytes == plan.cross_host_bytes
    assert ex.local_bytes == plan.intra_host_bytes


def test_receivers_on_the_senders_host_copy_locally(hosts):
    # Destination host 1 is also a source host: its slices never go through the store.
    a = DeviceMesh.grid((2, 2))
    b = DeviceMesh.grid((2, 2), first_device=4, first_host=1)
    data = np.arange(64, dtype=np.float32).reshape(8, 8)
    plan = plan_resharding(data.shape, 4, a, "S^0R", b, "RS^0", strategy="broadcast")
    ex = execute_on_actors(plan, expected_tiles(data, a, "S^0R"), hosts, label="shared host")
    check_tiles(ex, expected_tiles(data, b, "RS^0"))
    assert ex.cross_host_bytes == plan.cross_host_bytes
    assert ex.local_bytes == plan.intra_host_bytes
    # Host 1 fetches rows 0-3 × columns 0-3 from host 0 once (4·4 float32) for its two
    # devices; rows 4-7 × columns 0-3 it holds itself: its 2 jobs need 1 object (to host 2).
    h1 = ex.hosts[1]
    assert (h1.cross_host_bytes, h1.fetches, h1.jobs_sent, h1.puts) == (4 * 4 * 4, 1, 2, 1)


def test_check_tiles_catches_a_wrong_tile(hosts):
    plan, src, want = _case(1, "broadcast")
    ex = execute_on_actors(plan, src, hosts, label="case 1")
    d = sorted(want)[2]
    bad = dict(want)
    bad[d] = want[d].copy()
    bad[d][0, 1, 2] += 1
    with pytest.raises(ReshardingError, match=rf"case 1: device {d}: tile differs at "
                                              rf"\(0, 1, 2\)"):
        check_tiles(ex, bad, "case 1")


def test_missing_source_piece_is_named(hosts):
    plan, src, want = _case(8, "broadcast")
    dev = plan.sender_devices[0]
    del src[dev]
    # On the driver, before anything runs.
    with pytest.raises(ReshardingError, match=rf"^case 8: host 0, source device {dev} "
                                              rf"\(sends jobs \[0\]\): expected a piece of "
                                              rf"shape \(8, 8, 4\)"):
        execute_on_actors(plan, src, hosts, label="case 8")
    # On the sending actor: the error names case, host and job; the receivers' waits are
    # aborted at once (no timeout), and the pool still works afterwards.
    t0 = time.monotonic()
    with pytest.raises(ReshardingError, match=rf"^case 8: host 0, job 0 \(broadcast, unit 0, "
                                              rf".*expected source device {dev} to hold a "
                                              rf"piece"):
        execute_on_actors(plan, src, hosts, label="case 8", validate=False)
    assert time.monotonic() - t0 < 10
    plan, src, want = _case(8, "broadcast")
    check_tiles(execute_on_actors(plan, src, hosts, label="case 8"), want)
