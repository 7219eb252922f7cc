"""Batches made on the hosts (``rhino.host_data``): each Ray actor calls the user's
function for the rows its devices hold and places them; the driver sends only a request
(no batch bytes; its size does not depend on the batch size) and receives only the step's
0-d results. The runs equal ``jax.jit`` on the same batches, made on the driver."""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino
from rhino.runtime.state.host_data import HostRequest, host_data, materialize

D_IN, HIDDEN, D_OUT = 16, 32, 4


def mlp_step(params, batch):
    """Plain SGD on an MLP: no 0-d state, so the only 0-d result is the loss."""
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        out = h @ p["w2"]
        return jnp.mean((out - batch["y"]) ** 2) + 0.0 * jnp.sum(batch["ids"])

    loss, g = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda w, d: w - 0.1 * d, params, g), loss


def mlp_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (D_IN, HIDDEN)) / 4,
            "w2": jax.random.normal(k2, (HIDDEN, D_OUT)) / 6}


def like(batch_size):
    return {"x": jax.ShapeDtypeStruct((batch_size, D_IN), jnp.float32),
            "y": jax.ShapeDtypeStruct((batch_size, D_OUT), jnp.float32),
            "ids": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}


def make_rows(req: HostRequest) -> dict:
    """Row ``i`` of step ``s`` is a function of (s, i) only: any host makes the same rows.
    With ``$RHINO_TEST_ROWS_LOG`` set, each call is logged there (one JSON line)."""
    log = os.environ.get("RHINO_TEST_ROWS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"stage": req.stage, "host": req.host, "hosts": req.hosts,
                                "step": req.step, "rows": req.rows, "pid": os.getpid()})
                    + "\n")
    idx = np.concatenate([np.arange(a, b) for a, b in req.rows])
    x = np.stack([np.random.default_rng([req.step, int(i)]).normal(size=D_IN)
                  for i in idx]).astype(np.float32)
    y = np.sin(x[:, :D_OUT] * 3.0)
    return {"x": x, "y": y, "ids": idx.astype(np.int64)}     # int64: cast to int32


# ------------------------------------------------------------------ without a cluster
def test_host_data_is_a_batch_of_placeholders_with_the_batch_signature():
    from rhino.step_arguments import signature

    b = host_data(make_rows, like(8), step=3)
    whole = materialize(b)
    assert signature(mlp_step, (mlp_params(), b)) == signature(mlp_step, (mlp_params(), whole))
    assert whole["ids"].dtype == np.int32 and whole["ids"].tolist() == list(range(8))
    # Rows asked for are the same rows as in the whole batch.
    ids, x, _ = b["x"].source.rows(HostRequest(0, 1, 2, 3, ((2, 4), (6, 8)), 8))  # leaf order
    np.testing.assert_array_equal(ids, np.array([2, 3, 6, 7]))
    np.testing.assert_array_equal(x, whole["x"][[2, 3, 6, 7]])


def test_a_function_returning_other_rows_is_named():
    def bad(req):
        return {"x": np.zeros((1, D_IN), np.float32), "y": np.zeros((1, D_OUT), np.float32),
                "ids": np.zeros(1, np.int32)}

    with pytest.raises(ValueError, match=r"result\['ids'\] for step 0, stage 0 host 0 .*: "
                                         r"expected int32\[8\], found int32\[1\]"):
        materialize(host_data(bad, like(8)))
    with pytest.raises(ValueError, match="should have the 3 leaves of like"):
        materialize(host_data(lambda req: {"x": np.zeros((8, D_IN))}, like(8)))


@pytest.mark.parametrize("options", [dict(cluster="2x4", stages=2, num_microbatches=2),
                                     dict(mesh_shape=(8,))])
def test_host_data_on_the_local_executor_equals_jit(options):
    """Stage programs and a directly run SPMD program (which donates the state: two
    copies) both take a host_data batch, made here."""
    ref = jax.jit(mlp_step)
    want, got = mlp_params(), mlp_params()
    with rhino.auto_parallel(mlp_step, timeout=120.0, **options) as step:
        for i in range(2):
            batch = host_data(make_rows, like(16), step=i)
            got, loss = step(got, batch)
            want, wloss = ref(want, materialize(batch))
            np.testing.assert_allclose(float(loss), float(wloss), rtol=1e-5)
        assert step.plans_built == 1
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ on a local Ray cluster
def _ray(request):
    ray = pytest.importorskip("ray")
    request.getfixturevalue("ray_cluster")
    # The actors unpickle the step and make_rows: this module travels by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.extended
def test_ray_hosts_make_the_batch_and_the_driver_sends_none_of_it(request):
    """Two stages, one actor each: per step the driver sends no batch bytes (nor state:
    it stays on the actors), a control message of the same size for a batch 4x larger,
    and receives the loss only (4 bytes); the run equals jax.jit."""
    _ray(request)
    ref = jax.jit(mlp_step)
    step = rhino.auto_parallel(mlp_step, cluster="2x4", stages=2, num_microbatches=2,
                               executor="ray", timeout=120.0)
    control = {}
    try:
        for size in (16, 64):
            want = got = mlp_params()
            for i in range(3):
                batch = host_data(make_rows, like(size), step=i)
                got, loss = step(got, batch)
                want, wloss = ref(want, materialize(batch))
                np.testing.assert_allclose(float(loss), float(wloss), rtol=1e-5)
            ex = step._last.run.executor
            batch_bytes = sum(x.nbytes for x in jax.tree.leaves(materialize(batch)))
            assert ex.last_sent_bytes == 0            # no batch, no state
            assert ex.last_received_bytes == np.dtype(np.float32).itemsize   # the loss
            assert ex.last_control_bytes < batch_bytes / 4
            control[size] = ex.last_control_bytes
            for a, b in zip(jax.tree.leaves(rhino.fetch(got)), jax.tree.leaves(want)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        # The request names rows, not their values: the same size for 4x the rows.
        assert control[16] == control[64], control
        assert step.plans_built == 2
    finally:
        step.close()


@pytest.mark.slow
def test_ray_hosts_of_one_stage_each_make_their_own_rows(request, tmp_path, monkeypatch):
    """One stage whose mesh spans the two hosts (one jax.distributed job): each host asks
    for the rows of its own devices only (half the batch each), and the step equals
    jax.jit."""
    _ray(request)
    log = tmp_path / "rows.jsonl"
    env = {"env_vars": {"RHINO_TEST_ROWS_LOG": str(log)}}
    ref = jax.jit(mlp_step)
    from jax.sharding import PartitionSpec as P

    # The batch split over the stage's 8 devices (data parallel): each host holds half.
    split = {"batch['x']": P("x", None), "batch['y']": P("x", None), "batch['ids']": P("x")}
    step = rhino.auto_parallel(mlp_step, cluster="2x4", stages=1, executor="ray",
                               timeout=120.0, ray_actor_options={"runtime_env": env},
                               annotations=split)
    try:
        want = got = mlp_params()
        for i in range(2):
            batch = host_data(make_rows, like(16), step=i)
            got, loss = step(got, batch)
            want, wloss = ref(want, materialize(batch))
            np.testing.assert_allclose(float(loss), float(wloss), rtol=1e-5)
        ex = step._last.run.executor
        assert ex.last_sent_bytes == 0 and len(ex.actors) == 2
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        last = [c for c in calls if c["step"] == 1]
        assert sorted(c["host"] for c in last) == [0, 1]
        assert all(c["hosts"] == 2 for c in last)
        rows = {c["host"]: [tuple(r) for r in c["rows"]] for c in last}
        covered = sorted(i for r in rows.values() for a, b in r for i in range(a, b))
        assert covered == list(range(16)), rows        # each row made by one host
        for n in range(2):     # the rows its devices hold, as the actor says (half each)
            assert rows[n] == [(8 * n, 8 * n + 8)]
            assert set(map(tuple, ex._describe[n]["rows"].values())) == {tuple(rows[n])}
        for a, b in zip(jax.tree.leaves(rhino.fetch(got)), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    finally:
        step.close()
