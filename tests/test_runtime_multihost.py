"""Meshes that span hosts on Ray: one actor per host, every actor of a run one process of one
``jax.distributed`` job (gloo collectives on CPU between the hosts of a mesh), the training
state kept on the actors.

Hosts are simulated by actors with their own device count on one local Ray cluster (4 CPUs,
started once for the module). Needs ray (skipped otherwise).
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import jax  # noqa: E402

import rhino  # noqa: E402
from rhino.models import get_model  # noqa: E402
from rhino.runtime.executors.local import ExecutorError, LocalTransport  # noqa: E402
from rhino.runtime.ray.executor import RayExecutor, RemoteArray, fetch, init  # noqa: E402

# The extended tier (Ray, several processes, the docs' commands, the slowest runs): run by
# .ci/run after the default suite (README, Tests: `-m "extended and not slow"`).
pytestmark = pytest.mark.extended

GPT = dict(layers=4, hidden=64, heads=2, seq=16, vocab=256, batch=16)
# Trained state against jax.jit: 10% of one Adam step (lr 1e-3). An element whose gradient
# is near Adam's eps (1e-8) moves by lr * g / (|g| + eps), so the order of a sum alone moves
# it by a good part of a step: layers[3]['w2'][71, 39] has |g| = 7.5e-9 at step 1, and its
# value after it is 5.2e-5 from a float64 run under the 2x4 SPMD plan (2.7e-5 under the
# plan before O2's window moves, 2.8e-6 under jax.jit). The losses keep rtol 1e-4.
STATE_ATOL = 1e-4


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(fetch(tree))]


def _train(step, m, params, opt, batches):
    losses = []
    for b in batches:
        params, opt, loss = step(params, opt, b)
        losses.append(float(loss))
    return params, opt, losses


def _train_both(step, m, params, opt, batches):
    """Train with ``step`` and with single-device jax.jit: equal losses and final state."""
    p1, o1, l1 = _train(step, m, params, opt, batches)
    p2, o2, l2 = _train(jax.jit(m.step), m, params, opt, batches)
    np.testing.assert_allclose(l1, l2, rtol=1e-4, atol=5e-5)
    for a, b in zip(_leaves((p1, o1)), _leaves((p2, o2))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=STATE_ATOL)
    return p1, o1


def _batches(m, n):
    return [m.make_batch(jax.random.PRNGKey(100 + i)) for i in range(n)]


def test_whole_cluster_spmd_spans_two_hosts_and_matches_one_device(ray_cluster):
    """GPT, cluster 2x4, one SPMD stage: 2 actors × 4 devices in one jax.distributed job;
    10 Adam steps equal single-device jax.jit; the compiled programs' collectives equal
    the same stage programs compiled in this process on 8 local devices; per step the
    driver sends the batch and receives the loss (and Adam's step counter) only."""
    m = get_model("gpt", **GPT)
    params, opt = m.init(jax.random.PRNGKey(0))
    batches = _batches(m, 10)
    step = rhino.auto_parallel(m.step, cluster="2x4", stages=1, executor="ray",
                               timeout=120.0)
    try:
        p1, o1 = _train_both(step, m, params, opt, batches)
        ex = step._last.run.executor
        assert isinstance(ex, RayExecutor) and ex.owners == [(0, 0), (0, 1)]
        d = ex._describe
        assert [(x["devices"], x["global_devices"]) for x in d] == [(4, 8), (4, 8)]
        assert d[0]["pid"] != d[1]["pid"] != os.getpid()
        # The state stays on the actors.
        leaves = jax.tree_util.tree_leaves((p1, o1))
        assert all(isinstance(x, RemoteArray) for x in leaves if np.ndim(x) > 0)
        batch_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(batches[-1]))
        assert batch_bytes <= ex.last_sent_bytes <= batch_bytes + 64, ex.last_sent_bytes
        assert 0 < ex.last_received_bytes <= 64, ex.last_received_bytes
        # Each host is sent only the rows of the batch its devices hold: halves.
        rows = [x["rows"] for x in d]
        assert rows[0] and rows[0].keys() == rows[1].keys(), rows
        for r in rows[0]:
            got = sorted(rows[0][r] + rows[1][r])
            assert got[0][0] == 0 and all(a[1] == b[0] for a, b in zip(got, got[1:])), got
        # Collectives: multi-process compile == in-process 8-device compile.
        got = ex.collectives()[0]
        spec = step._last.run.specs[0]
        local = spec.build(jax.devices()[:8])
        local.run_step(local.zero_args(), LocalTransport(1), 120.0)
        want = local.collectives()
        assert got == want and any(want.values()), (got, want)
    finally:
        step.close()
    with pytest.raises(ExecutorError, match="closed"):
        np.asarray(jax.tree_util.tree_leaves(p1)[0])


# UNet runs with -m slow (the default suite's time): GPT covers the multi-host stage path
# here. So do the lost-host restore, distributed init on the actors and one-node-per-host
# placement (12-34 s each); the default suite keeps this test, the whole-cluster SPMD run
# and the remote-results test.
@pytest.mark.parametrize("model", ["gpt", pytest.param("unet", marks=pytest.mark.slow)])
def test_pipeline_stages_each_spanning_two_hosts_match_one_device(ray_cluster, model):
    """Cluster 4x2, 2 stages × 4 devices: each stage 2 actors × 2 devices (4 actors, one
    jax.distributed job); values cross stages through JAX's transfer servers, each
    receiving host pulling the pieces its devices need. GPT ties its embedding (read by
    both stages: sent actor to actor at the start of the step, not through the driver)."""
    m = get_model("unet", batch=16) if model == "unet" else get_model("gpt", **GPT)
    params, opt = m.init(jax.random.PRNGKey(0))
    batches = _batches(m, 4)
    step = rhino.auto_parallel(m.step, cluster="4x2", stages=2, num_microbatches=4,
                               executor="ray", timeout=120.0)
    try:
        p1, o1 = _train_both(step, m, params, opt, batches)
        ex = step._last.run.executor
        assert ex.owners == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [x["global_devices"] for x in ex._describe] == [8, 8, 8, 8]
        plan = step.plan_for(params, opt, batches[0])
        assert [len(s.hosts) for s in plan.stages] == [2, 2]
        batch_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(batches[-1]))
        # The batch, plus 0-d values one stage returned and the other reads (Adam's count).
        assert batch_bytes <= ex.last_sent_bytes <= batch_bytes + 64, ex.last_sent_bytes
        assert 0 < ex.last_received_bytes <= 64, ex.last_received_bytes
        # Every host of both stages sent and received through JAX's transfers
        # (activations forward; gradients and the tied embedding back).
        moved = [d["jax_transfers"] for d in ray.get([a.describe.remote()
                                                      for a in ex.actors])]
        assert all(t["sent"] > 0 and t["received"] > 0 for t in moved), moved
    finally:
        step.close()


def test_remote_results_live_until_dropped(ray_cluster):
    """An old step's results stay fetchable while the driver holds them, passing them back
    in moves nothing, and dropping them releases them on the actors."""
    m = get_model("mlp")
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    ref = jax.jit(m.step)
    with rhino.auto_parallel(m.step, cluster="2x2", stages=1, executor="ray",
                             timeout=120.0) as step:
        first = step(params, opt, batch)
        p, o, _ = first
        for _ in range(3):
            p, o, _ = step(p, o, batch)
        ex = step._last.run.executor
        assert ex.last_sent_bytes == 0 and ex.last_kept > 0   # the same batch object
        want = ref(params, opt, batch)
        for a, b in zip(_leaves(first), _leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        # Passed again, the first step's results start a step from there, on the actors.
        again = step(*first[:2], batch)
        for a, b in zip(_leaves(again), _leaves(ref(*want[:2], batch))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        before = ray.get(ex.groups[0][0].describe.remote())["kept"]
        del first, again, p, o
        import gc

        gc.collect()
        assert ex._dropped, "dropped handles are released with the next step"
        out = step(*m.init(jax.random.PRNGKey(0)), batch)
        assert not ex._dropped
        after = ray.get(ex.groups[0][0].describe.remote())["kept"]
        n = len(jax.tree_util.tree_leaves(out))
        assert before >= 3 * n - 3 and after <= n + 2, (before, after, n)


@pytest.mark.slow
def test_lost_host_then_restore_continues_with_no_step_lost(ray_cluster, tmp_path):
    """GPT over 2 hosts (2x4 SPMD), a checkpoint after every step written by the actors.
    One host's actor is killed during step 6 of 10: the step fails naming the stage and
    host, the actors are released (the only stage was lost: nothing left to read); a new step restored from step 5's checkpoint finishes
    the run, and losses and final state equal an uninterrupted run. The checkpoint then
    restores onto 8 local devices and onto one device, exactly."""
    import signal
    import threading

    m = get_model("gpt", **GPT)
    params, opt = m.init(jax.random.PRNGKey(0))
    batches = _batches(m, 10)
    p2, o2, want = _train(jax.jit(m.step), m, params, opt, batches)

    def make():
        return rhino.auto_parallel(m.step, cluster="2x4", stages=1, executor="ray",
                                   timeout=60.0)

    losses: list[float] = []
    step = make()
    p, o = params, opt
    try:
        for i in range(10):
            if i == 5:   # step 6: SIGKILL host 1's actor while it runs
                ex = step._last.run.executor
                pid = ex._describe[1]["pid"]
                threading.Timer(0.02, os.kill, (pid, signal.SIGKILL)).start()
                with pytest.raises(ExecutorError) as err:
                    for _ in range(50):  # the kill lands in this step or the next call
                        step(p, o, batches[i])
                assert re.search(r"stage 0 \(host [01]\): the actor died", str(err.value)), \
                    str(err.value)
                assert _all_released(ex.actors)
                break
            p, o, loss = step(p, o, batches[i])
            losses.append(float(loss))
            rhino.save_checkpoint(str(tmp_path / f"step{i + 1}"), (p, o))
    finally:
        step.close()
    assert len(losses) == 5
    p, o = rhino.restore_checkpoint(str(tmp_path / "step5"), like=(params, opt))
    with make() as step:
        for i in range(5, 10):
            p, o, loss = step(p, o, batches[i])
            losses.append(float(loss))
        final = _leaves((p, o))
    np.testing.assert_allclose(losses, want, rtol=1e-4, atol=5e-5)
    for a, b in zip(final, _leaves((p2, o2))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=STATE_ATOL)
    # Step 5's checkpoint onto 8 local devices (sharded) and onto one device: same bits.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    on8 = rhino.restore_checkpoint(str(tmp_path / "step5"),
                                   shardings=NamedSharding(mesh, PartitionSpec()))
    on1 = rhino.restore_checkpoint(str(tmp_path / "step5"))
    assert jax.tree_util.tree_structure(on1) == jax.tree_util.tree_structure((params, opt))
    for a, b in zip(jax.tree_util.tree_leaves(on8), jax.tree_util.tree_leaves(on1)):
        assert len(a.sharding.device_set) == 8 and len(b.sharding.device_set) == 1
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(rhino.CheckpointError, match="expected a new directory"):
        rhino.save_checkpoint(str(tmp_path / "step5"), (params, opt))
    with pytest.raises(rhino.CheckpointError, match=r"leaf .*saved as"):
        rhino.restore_checkpoint(str(tmp_path / "step5"), like=(opt, params))


def _all_released(actors, within: float = 30.0) -> bool:
    """Every actor dead within ``within`` seconds (``ray.kill`` is asynchronous: a call
    sent just after it may still be served)."""
    deadline = time.monotonic() + within
    while any(_alive(a) for a in actors):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _alive(actor) -> bool:
    try:
        ray.get(actor.describe.remote(), timeout=10)
        return True
    except Exception:  # noqa: BLE001 - dead, killed or gone
        return False


def test_a_cluster_with_too_few_nodes_is_refused_before_any_actor(ray_cluster, monkeypatch):
    import types

    import rhino.runtime.ray.executor as rx
    from rhino.cluster import Cluster

    monkeypatch.setattr(rx, "init", lambda *a, **k: rx.RayInfo("10.0.0.1:6379", 2, 8.0))
    specs = [types.SimpleNamespace(mesh_shape=(4,), stage=s) for s in range(2)]
    # Record every actor class made instead of reading the cluster's free CPUs: the actors
    # of the tests before this one are released asynchronously, so those counts move.
    made = []
    monkeypatch.setattr(ray, "remote", lambda *a, **k: made.append(a) or pytest.fail(
        "an actor class was made before the plan was refused"))
    with pytest.raises(ExecutorError, match=r"runs on 4 hosts, the Ray cluster has 2 alive "
                                            r"nodes"):
        RayExecutor(specs, Cluster(4, 2), timeout=30.0)
    with pytest.raises(ExecutorError, match=r"stage 0: expected a number of hosts dividing"):
        RayExecutor(specs, Cluster(1, 4), timeout=30.0, hosts=[3, 1])
    assert made == []   # no actor was started


@pytest.mark.slow
def test_distributed_init_makes_the_state_on_the_actors(ray_cluster):
    """§6.3 on Ray: the state is created by each stage's actors with its shardings (stages
    spanning 2 hosts), equal to one-device init; the first step sends only the batch."""
    m = get_model("gpt", **GPT)
    key = jax.random.PRNGKey(0)
    batch = m.make_batch(jax.random.PRNGKey(1))
    abstract = jax.eval_shape(m.init, key)
    with rhino.auto_parallel(m.step, cluster="4x2", stages=2, num_microbatches=4,
                             executor="ray", timeout=120.0) as step:
        params, opt = step.distributed_init(m.init, key, example_args=(*abstract, batch))
        ex = step._entry((*abstract, batch)).run.executor
        assert all(isinstance(x, RemoteArray) for x in jax.tree_util.tree_leaves((params, opt)))
        assert ex.fetched_bytes == 0
        p1, o1, l1 = step(params, opt, batch)
        batch_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(batch))
        assert ex.last_sent_bytes <= batch_bytes + 64, ex.last_sent_bytes
        want = jax.jit(m.init)(key)
        for a, b in zip(_leaves((params, opt)), _leaves(want)):
            np.testing.assert_array_equal(a, b)
        p2, o2, l2 = jax.jit(m.step)(*want, batch)
        np.testing.assert_allclose(float(l1), float(l2), rtol=1e-4, atol=5e-5)
        for a, b in zip(_leaves((p1, o1)), _leaves((p2, o2))):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=STATE_ATOL)


@pytest.mark.slow
def test_on_several_nodes_each_plan_host_is_a_node_of_its_own(ray_cluster):
    """A Ray cluster of 2 nodes (``ray.cluster_utils``, both on this machine): the 2x2 plan's
    two hosts go to the two nodes through a placement group; the step matches jax.jit.
    (Runs last in this module: it replaces the module's Ray instance.)"""
    from ray.cluster_utils import Cluster as RayCluster

    from rhino.runtime.ray.cluster import quiet_fork_warning

    ray.shutdown()
    with quiet_fork_warning():      # Ray starts the nodes' processes from this one (fork+exec)
        nodes = RayCluster(initialize_head=True, head_node_args={"num_cpus": 2})
        nodes.add_node(num_cpus=2)
    try:
        init(nodes.address, timeout=60.0)
        deadline = time.monotonic() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.monotonic() < deadline, "the second node never joined"
            time.sleep(0.5)
        info = init(nodes.address)
        assert info.nodes == 2
        m = get_model("mlp")
        params, opt = m.init(jax.random.PRNGKey(0))
        batch = m.make_batch(jax.random.PRNGKey(1))
        with rhino.auto_parallel(m.step, cluster="2x2", stages=1, executor="ray",
                                 timeout=120.0) as step:
            got = step(params, opt, batch)
            ex = step._last.run.executor
            assert len({d["node"] for d in ex._describe}) == 2, ex._describe
            assert ex.placement_group is not None
            for a, b in zip(_leaves(got), _leaves(jax.jit(m.step)(params, opt, batch))):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    finally:
        ray.shutdown()
        nodes.shutdown()
