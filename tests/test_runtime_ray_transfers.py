"""The Ray executor's JAX transport: the stage actors join one ``jax.distributed`` job and
every value between stages moves device to device through JAX's transfer servers
(``transport="jax"``), none through Ray's object store (every ``ray.put`` of the actors'
processes recorded). Split from ``test_runtime_ray.py``; the same local Ray cluster
(``ray_cluster`` of ``conftest.py``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import jax  # noqa: E402

import rhino  # noqa: E402
from rhino.models import get_model  # noqa: E402
from rhino.runtime.ray import executor as ray_executor  # noqa: E402

# The extended tier, like test_runtime_ray.py.
pytestmark = pytest.mark.extended

GPT = dict(layers=4, hidden=64, heads=2, seq=16, vocab=256, batch=16)


def _recording_actor():
    """``StageActor`` whose process records every ``ray.put`` of an array made in it (type
    and shape; ``array_puts()``). ``array_puts(probe=True)`` first puts one itself: proof
    that the recording sees a put. Defined here, so Ray ships it by value."""
    base = ray_executor.StageActor

    class RecordingStageActor(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            import ray as ray_here

            from rhino.runtime.state.remote_array import PackedKey

            self.puts: list[tuple[str, tuple]] = []
            put = ray_here.put

            def recording_put(value, *a, **k):
                if isinstance(value, PackedKey) or getattr(value, "shape", None) is not None:
                    self.puts.append((type(value).__name__, tuple(np.shape(getattr(
                        value, "data", value)))))
                return put(value, *a, **k)
            ray_here.put = recording_put

        def array_puts(self, probe: bool = False) -> list:
            if probe:
                import ray as ray_here

                ray_here.put(np.zeros(3))
            return list(self.puts)

    return RecordingStageActor


def _ray_jax_transport_run(monkeypatch, model, steps, cluster="2x4", checkpoint=None, **kw):
    """``model`` pipelined in 2 stages on ``cluster`` (``transport="jax"``), ``steps`` steps
    against jax.jit; returns the actors' ``describe()``, each with ``array_puts``: the
    arrays its process put in Ray's object store (``_recording_actor``). With
    ``checkpoint`` (a directory), the final state is saved there, restored and compared."""
    monkeypatch.setattr(ray_executor, "StageActor", _recording_actor())
    m = get_model(model, **({"batch": 16} if model == "unet" else GPT))
    params, opt = m.init(jax.random.PRNGKey(0))
    batches = [m.make_batch(jax.random.PRNGKey(1 + i)) for i in range(steps)]
    step = rhino.auto_parallel(m.step, cluster=cluster, stages=2, num_microbatches=4,
                               schedule="1f1b",   # the tests read 1F1B's held sends
                               executor="ray", transport="jax", timeout=120, **kw)
    ref = jax.jit(m.step)
    try:
        p1, o1, p2, o2 = params, opt, params, opt
        for i, b in enumerate(batches):
            p1, o1, l1 = step(p1, o1, b)
            p2, o2, l2 = ref(p2, o2, b)
            np.testing.assert_allclose(float(l1), float(l2), rtol=1e-4, atol=5e-5,
                                       err_msg=f"step {i}")
        got = rhino.fetch((p1, o1))
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves((p2, o2))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
        if checkpoint is not None:
            rhino.save_checkpoint(str(checkpoint), (p1, o1))
            back = rhino.restore_checkpoint(str(checkpoint), like=(params, opt))
            for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(got)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        ex = step._last.run.executor
        found = ray.get([a.describe.remote() for a in ex.actors])
        puts = ray.get([a.array_puts.remote() for a in ex.actors])
        # The recording works: a put of an array in an actor is seen.
        assert ray.get(ex.actors[0].array_puts.remote(probe=True)) == \
            puts[0] + [("ndarray", (3,))]
        for d, p in zip(found, puts):
            d["array_puts"] = p
        return found
    finally:
        step.close()


def test_gpt_between_actors_through_jax_transfers(ray_cluster, monkeypatch):
    """The two stage actors join one ``jax.distributed`` job and every value between them
    moves device to device through JAX's transfer servers (``runtime.transfer.jax_transfer``): 5
    GPT steps equal jax.jit; every value one stage sent through them the other received
    through them; and no actor put an array in Ray's object store (every ``ray.put`` of
    their processes recorded). The two stages' meshes are of one size, so every value
    crossed as the sender's tiles (``whole`` or ``relayout``), none piece by piece; those
    whose layout differs stay in the sender's on arrival (``defer_relayout``): the stage's
    programs reading them change it, and still equal jax.jit. Stage 1 held its update each step until stage 0 said it
    had the gradients of the last backward (``instructions.held_sends``); stage 0 held
    nothing."""
    found = _ray_jax_transport_run(monkeypatch, "gpt", 5)
    assert [d["global_devices"] for d in found] == [8, 8]      # one job of both actors
    for d in found:
        assert d["jax_transfers"]["sent"] > 0 and d["jax_transfers"]["received"] > 0, d
        assert d["array_puts"] == [], d
        assert set(d["jax_transfers"]["modes"]) <= {"whole", "relayout"}, d
    assert "relayout" in found[1]["jax_transfers"]["modes"], found
    assert found[1]["jax_transfers"]["deferred"] > 0, found
    t0, t1 = found[0]["jax_transfers"], found[1]["jax_transfers"]
    assert t0["sent"] == t1["received"] and t1["sent"] == t0["received"], found
    assert t1["held"] >= 5 and t0["acknowledged"] == t1["held"], found
    assert t0["held"] == 0 and t1["acknowledged"] == 0, found


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["2x4", "4x2"])
def test_unet_between_actors_through_jax_transfers(ray_cluster, monkeypatch, cluster):
    """UNet (skip tensors cross the boundary), each stage on one actor × 4 devices (2x4) or
    on 2 actors × 2 devices (4x2): 5 steps equal jax.jit, every value through JAX's transfer
    servers, no array put in the object store. On 2x4 the actors are not pinned to cores
    (``ray_pin_cpus=False``: each may use every core)."""
    unpinned = cluster == "2x4"
    found = _ray_jax_transport_run(monkeypatch, "unet", 5, cluster=cluster,
                                   **({"ray_pin_cpus": False} if unpinned else {}))
    assert len(found) == {"2x4": 2, "4x2": 4}[cluster]
    for d in found:
        assert d["jax_transfers"]["sent"] > 0 and d["jax_transfers"]["received"] > 0, d
        assert d["array_puts"] == [], d
    if unpinned:
        assert [d["cpus"] for d in found] == [tuple(sorted(os.sched_getaffinity(0)))] * 2


@pytest.mark.slow
def test_stages_spanning_hosts_through_jax_transfers(ray_cluster, monkeypatch, tmp_path):
    """A 4x2 cluster: each stage on 2 actors × 2 devices, the 4 actors one job; a value goes
    from each sending host straight to the receiving hosts that need its pieces
    (``runtime.transfer.process_resharding``'s plan, computed alike on both sides); 5 GPT steps
    equal jax.jit, no array put in the object store. A checkpoint of the state: each
    stage's two hosts write their shards with orbax waiting for those two processes only
    (``checkpoint.write_part``), and it restores exactly."""
    found = _ray_jax_transport_run(monkeypatch, "gpt", 5, cluster="4x2",
                                   checkpoint=tmp_path / "ck")
    assert len(found) == 4 and {d["global_devices"] for d in found} == {8}
    for d in found:
        assert d["jax_transfers"]["sent"] > 0 and d["jax_transfers"]["received"] > 0, d
        assert d["array_puts"] == [], d
