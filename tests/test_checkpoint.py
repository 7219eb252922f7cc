"""Checkpoints (``rhino.save_checkpoint``, ``rhino.restore_checkpoint``,
``rhino.CheckpointManager``): plain orbax checkpoints keyed by the user's pytree paths,
written atomically, readable by plain orbax onto any sharding, and reading what plain orbax,
Flax and the first rhino format wrote. ``RemoteArray`` leaves are written by a stand-in for
the Ray executor (its ``save_part`` writes each stage's part as the actors do, with
``checkpoint.write_part``); ``tests/test_runtime_ray.py`` does it with Ray actors."""

from __future__ import annotations

import base64
import json
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import rhino
from rhino.runtime.state import checkpoint as ck
from rhino.runtime.state import checkpoint_parts as parts
from rhino.runtime.state.remote_array import RemoteArray

ocp = pytest.importorskip("orbax.checkpoint")


def _tree():
    """Dicts, a list, an optax state (NamedTuples, a tuple), bf16, int32 and numpy leaves."""
    params = {"blocks": [{"qkv": jnp.arange(48, dtype=jnp.bfloat16).reshape(8, 6) / 7,
                          "b": jnp.linspace(-1, 1, 8, dtype=jnp.float32)},
                         {"qkv": jnp.full((8, 6), 0.1, jnp.bfloat16),
                          "b": jnp.zeros(8, jnp.float32)}],
              "pos": jnp.arange(16, dtype=jnp.int32).reshape(8, 2)}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)).init(params)
    opt = jax.tree.map(lambda x: x + 1 if x.dtype != jnp.int32 else x, opt)
    return {"params": params, "opt": opt, "step": np.int32(7)}


def _same(a, b) -> None:
    """The same tree structure, dtypes and bits."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _abstract(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                        tree)


def test_a_nested_tree_round_trips_keyed_by_its_paths(tmp_path):
    tree = _tree()
    path = rhino.save_checkpoint(str(tmp_path / "ck"), tree)
    assert path == str(tmp_path / "ck") and os.listdir(tmp_path) == ["ck"]
    # The keys orbax recorded are the user's paths (NamedTuple fields, list indices).
    saved = ocp.StandardCheckpointer().metadata(path).item_metadata.tree
    assert saved["params"]["blocks"][0]["qkv"].shape == (8, 6)
    assert saved["opt"][1][0]["mu"]["blocks"][1]["qkv"].dtype == jnp.bfloat16
    assert saved["step"].dtype == np.int32
    assert not any(n.startswith("leaf") for n in os.listdir(path))
    # Restored with its structure (NamedTuples, tuples) from rhino's metadata, bit-exact.
    back = rhino.restore_checkpoint(path)
    _same(back, tree)
    assert type(back["opt"][1][0]).__name__ == "ScaleByAdamState"
    assert all(x.sharding == SingleDeviceSharding(jax.devices()[0])
               for x in jax.tree_util.tree_leaves(back))
    _same(rhino.restore_checkpoint(path, like=_abstract(tree, None)), tree)
    # Onto 8 devices, sharded.
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    on8 = rhino.restore_checkpoint(path, shardings=NamedSharding(mesh, P()))
    _same(on8, tree)
    assert all(len(x.sharding.device_set) == 8 for x in jax.tree_util.tree_leaves(on8))


def test_plain_orbax_reads_it_onto_one_device_and_eight(tmp_path):
    tree = _tree()
    rhino.save_checkpoint(str(tmp_path / "ck"), tree)
    reader = ocp.StandardCheckpointer()
    one = reader.restore(str(tmp_path / "ck"),
                         _abstract(tree, SingleDeviceSharding(jax.devices()[3])))
    _same(one, tree)
    assert {d.id for x in jax.tree_util.tree_leaves(one) for d in x.sharding.device_set} == {3}
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
            mesh, P("x") if x.ndim and x.shape[0] % 8 == 0 else P())), tree)
    eight = reader.restore(str(tmp_path / "ck"), abstract)
    _same(eight, tree)
    qkv = eight["params"]["blocks"][0]["qkv"]
    assert qkv.sharding.spec == P("x") and len(qkv.addressable_shards) == 8
    # Without a target: orbax's own tree of dicts and lists, the same bits.
    raw = reader.restore(str(tmp_path / "ck"))
    np.testing.assert_array_equal(np.asarray(raw["opt"][1][0]["nu"]["pos"]),
                                  np.asarray(tree["opt"][1][0].nu["pos"]))


def _failing_save(monkeypatch):
    real = ocp.Checkpointer.save

    def save(self, directory, *a, **k):
        real(self, directory, *a, **k)   # written, then the failure before the rename
        raise OSError("disk full (test)")
    monkeypatch.setattr(ocp.Checkpointer, "save", save)


def test_a_failed_save_leaves_nothing_and_a_retry_works(tmp_path, monkeypatch):
    tree = _tree()
    with monkeypatch.context() as m:
        _failing_save(m)
        with pytest.raises(rhino.CheckpointError, match=r"writing .*ck with orbax: OSError"):
            rhino.save_checkpoint(str(tmp_path / "ck"), tree)
    assert os.listdir(tmp_path) == []     # nothing at path, no temporaries
    rhino.save_checkpoint(str(tmp_path / "ck"), tree)
    _same(rhino.restore_checkpoint(str(tmp_path / "ck")), tree)
    # An existing checkpoint is not replaced without overwrite=True ...
    with pytest.raises(rhino.CheckpointError, match="overwrite=True"):
        rhino.save_checkpoint(str(tmp_path / "ck"), {"w": jnp.ones(2)})
    # ... a failing overwrite leaves the old one whole ...
    with monkeypatch.context() as m:
        _failing_save(m)
        with pytest.raises(rhino.CheckpointError, match="OSError"):
            rhino.save_checkpoint(str(tmp_path / "ck"), {"w": jnp.ones(2)}, overwrite=True)
    assert os.listdir(tmp_path) == ["ck"]
    _same(rhino.restore_checkpoint(str(tmp_path / "ck")), tree)
    # ... and a complete one replaces it.
    rhino.save_checkpoint(str(tmp_path / "ck"), {"w": jnp.ones(2)}, overwrite=True)
    assert os.listdir(tmp_path) == ["ck"]
    _same(rhino.restore_checkpoint(str(tmp_path / "ck")), {"w": jnp.ones(2)})
    # overwrite=True replaces checkpoints only.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(rhino.CheckpointError, match=r"expected a checkpoint at .*mine"):
        rhino.save_checkpoint(str(tmp_path / "mine"), {"w": jnp.ones(2)}, overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").exists()


def test_prng_keys_and_lone_arrays_are_refused(tmp_path):
    with pytest.raises(rhino.CheckpointError, match=r"leaf \['rng'\]: .*found PRNG keys"):
        rhino.save_checkpoint(str(tmp_path / "ck"), {"rng": jax.random.key(0), "w": jnp.ones(2)})
    with pytest.raises(rhino.CheckpointError, match=r"orbax saves no lone array\), found a lone"):
        rhino.save_checkpoint(str(tmp_path / "ck"), jnp.ones(2))
    with pytest.raises(rhino.CheckpointError, match=r"expected a tree with arrays in it"):
        rhino.save_checkpoint(str(tmp_path / "ck"), {"a": None})
    assert os.listdir(tmp_path) == []


class _Stages:
    """A stand-in for ``RayExecutor``: each stage's values written as its actors write them
    (``write_part``: an orbax part when the writers are the whole job, else each process's
    bytes, ``arrays.npz``, or its shards, ``shards-p<n>.npz``)."""

    def __init__(self, values: dict[tuple[int, int], jax.Array], form: str = "orbax",
                 fail_stage: int | None = None):
        self.values, self.form, self.fail_stage, self.calls = values, form, fail_stage, []

    def handle(self, stage: int, ref: int) -> RemoteArray:
        x = self.values[(stage, ref)]
        return RemoteArray(self, stage, ref, 0, x.shape, x.dtype)

    def save_part(self, directory, stage, names):
        self.calls.append((directory, stage, dict(names)))
        values = {n: self.values[(stage, ref)] for n, (_, ref) in names.items()}
        if self.form == "orbax":
            ck.write_part(directory, values)
        elif self.form == "host":
            ck.write_part(directory, values, processes=[0, 1])   # some of a job's processes
        else:
            os.makedirs(directory)
            parts.write_shards(directory, values)
        if stage == self.fail_stage:
            raise RuntimeError(f"stage {stage} (host 0): the actor died (test)")

    def release(self, *a):
        pass


def _remote_state(form, fail_stage=None):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    values = {(0, 0): jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(8, 4),
                                     NamedSharding(mesh, P("a"))),
              (0, 1): jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),
              (1, 0): jax.device_put(jnp.arange(8, dtype=jnp.int32) * 3,
                                     NamedSharding(mesh, P("b")))}
    ex = _Stages(values, form, fail_stage)
    tree = {"params": {"w": ex.handle(0, 0), "e": ex.handle(0, 1)},
            "opt": [ex.handle(1, 0)], "local": jnp.ones(3)}
    want = {"params": {"w": values[(0, 0)], "e": values[(0, 1)]}, "opt": [values[(1, 0)]],
            "local": jnp.ones(3)}
    return ex, tree, want


@pytest.mark.parametrize("form", ["orbax", "host", "shards"])
def test_remote_leaves_are_assembled_into_a_plain_orbax_checkpoint(tmp_path, form):
    ex, tree, want = _remote_state(form)
    path = rhino.save_checkpoint(str(tmp_path / "ck"), tree)
    assert sorted(stage for _, stage, _ in ex.calls) == [0, 1]
    assert all(d.startswith(str(tmp_path / ".ck.rhino-tmp-")) for d, _, _ in ex.calls)
    assert os.listdir(tmp_path) == ["ck"] and ck.PARTS not in os.listdir(path)
    _same(rhino.restore_checkpoint(path), jax.tree.map(np.asarray, want))
    plain = ocp.StandardCheckpointer().restore(path)
    _same(jax.tree.map(np.asarray, plain), jax.tree.map(np.asarray, want))


@pytest.mark.parametrize("form", ["orbax", "shards"])
def test_remote_leaves_unassembled_stay_as_parts_restored_by_rhino(tmp_path, form):
    ex, tree, want = _remote_state(form)
    path = rhino.save_checkpoint(str(tmp_path / "ck"), tree, assemble=False)
    assert sorted(os.listdir(os.path.join(path, ck.PARTS))) == ["stage0", "stage1"]
    _same(rhino.restore_checkpoint(path), jax.tree.map(np.asarray, want))
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), want)
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    on8 = rhino.restore_checkpoint(path, like=like, shardings=NamedSharding(mesh, P()))
    _same(on8, jax.tree.map(np.asarray, want))
    assert len(on8["opt"][0].sharding.device_set) == 8
    # Plain orbax reads the leaves held here; the parts' leaves are None to it.
    plain = ocp.StandardCheckpointer().restore(path)
    assert plain["params"] == {"w": None, "e": None} and plain["opt"] == [None]
    np.testing.assert_array_equal(np.asarray(plain["local"]), np.ones(3))


def test_a_stage_failing_to_write_leaves_nothing(tmp_path):
    ex, tree, _ = _remote_state("host", fail_stage=1)
    with pytest.raises(RuntimeError, match="actor died"):
        rhino.save_checkpoint(str(tmp_path / "ck"), tree)
    assert os.listdir(tmp_path) == []
    ex.fail_stage = None
    rhino.save_checkpoint(str(tmp_path / "ck"), tree)
    assert os.listdir(tmp_path) == ["ck"]


def test_the_manager_keeps_the_newest_steps_in_orbax_layout(tmp_path):
    root = str(tmp_path / "run")

    def state(s):
        return {"w": jnp.full((8, 2), s, jnp.bfloat16), "n": [np.int32(s)]}
    with rhino.CheckpointManager(root, max_to_keep=2) as mgr:
        for s in range(1, 6):
            mgr.save(s, state(s))
        assert mgr.all_steps() == [4, 5] and mgr.latest_step() == 5
        _same(mgr.restore(), jax.tree.map(jnp.asarray, state(5)))
        _same(mgr.restore(4, like=state(0)), jax.tree.map(jnp.asarray, state(4)))
        with pytest.raises(rhino.CheckpointError, match=r"step 5 saved .*overwrite=True"):
            mgr.save(5, state(50))
        with pytest.raises(rhino.CheckpointError, match=r"after the latest \(5\), found 3"):
            mgr.save(3, state(3))
        mgr.save(5, state(50), overwrite=True)
        assert mgr.all_steps() == [4, 5]
        _same(mgr.restore(), jax.tree.map(jnp.asarray, state(50)))
        with pytest.raises(rhino.CheckpointError, match=r"expected step 2, found steps \[4, 5\]"):
            mgr.restore(2)
    assert sorted(os.listdir(tmp_path)) == ["run"] and sorted(os.listdir(root)) == ["4", "5"]
    # rhino.restore_checkpoint on the directory: the latest step, or step=.
    _same(rhino.restore_checkpoint(root, step=4), jax.tree.map(jnp.asarray, state(4)))
    # Plain orbax reads it.
    with ocp.CheckpointManager(root) as plain:
        assert list(plain.all_steps()) == [4, 5] and plain.latest_step() == 5
        got = plain.restore(5, args=ocp.args.StandardRestore(
            _abstract(state(0), SingleDeviceSharding(jax.devices()[0]))))
    _same(got, jax.tree.map(jnp.asarray, state(50)))


def _plain_save(checkpointer, path, tree) -> None:
    """``checkpointer.save(path, tree)``, finished (orbax saves in the background)."""
    checkpointer.save(path, tree)
    getattr(checkpointer, "wait_until_finished", lambda: None)()   # PyTreeCheckpointer: sync
    checkpointer.close()


def test_reads_what_plain_orbax_wrote(tmp_path):
    tree = _tree()
    _plain_save(ocp.StandardCheckpointer(), str(tmp_path / "std"), tree)
    _same(rhino.restore_checkpoint(str(tmp_path / "std"), like=tree), tree)
    # Without like: orbax's structure (NamedTuples as dicts), the same leaves.
    raw = rhino.restore_checkpoint(str(tmp_path / "std"))
    assert raw["opt"][1][0]["mu"]["pos"].dtype == jnp.int32
    assert sorted(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(raw)) == \
        sorted(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree))
    _plain_save(ocp.PyTreeCheckpointer(), str(tmp_path / "py"), tree)
    _same(rhino.restore_checkpoint(str(tmp_path / "py"), like=tree), tree)
    # An orbax CheckpointManager directory: the latest step, or the one asked for.
    with ocp.CheckpointManager(str(tmp_path / "mgr")) as mgr:
        for s in (10, 20):
            mgr.save(s, args=ocp.args.StandardSave({"w": jnp.full(4, s)}))
        mgr.wait_until_finished()
    assert int(rhino.restore_checkpoint(str(tmp_path / "mgr"))["w"][0]) == 20
    assert int(rhino.restore_checkpoint(str(tmp_path / "mgr"), step=10)["w"][0]) == 10
    assert int(rhino.restore_checkpoint(str(tmp_path / "mgr" / "10"))["w"][0]) == 10


def test_reads_what_flax_wrote(tmp_path):
    from flax.training import checkpoints

    tree = _tree()
    for s in (1, 2):
        checkpoints.save_checkpoint(str(tmp_path / "fl"), jax.tree.map(lambda x: x * s, tree),
                                    step=s, keep=2)
    assert sorted(os.listdir(tmp_path / "fl")) == ["checkpoint_1", "checkpoint_2"]
    _same(rhino.restore_checkpoint(str(tmp_path / "fl"), like=tree),
          jax.tree.map(lambda x: x * 2, tree))
    _same(rhino.restore_checkpoint(str(tmp_path / "fl"), like=tree, step=1), tree)


def test_reads_an_nnx_state_saved_the_flax_way(tmp_path):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)
            self.down = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.norm(self.up(x))))

    model = Model(nnx.Rngs(0))
    _plain_save(ocp.StandardCheckpointer(), str(tmp_path / "nnx"), nnx.state(model))
    abstract_model = nnx.eval_shape(lambda: Model(nnx.Rngs(1)))
    state = rhino.restore_checkpoint(str(tmp_path / "nnx"), like=nnx.state(abstract_model))
    nnx.update(abstract_model, state)
    x = jnp.linspace(-1, 1, 12).reshape(3, 4)
    np.testing.assert_array_equal(np.asarray(abstract_model(x)), np.asarray(model(x)))
    with pytest.raises(rhino.CheckpointError, match=r"leaf \['up'\]\['kernel'\]\.value: saved as "
                                                    r"\(4, 8\) float32 \(up/kernel/value\)"):
        wrong = nnx.eval_shape(lambda: nnx.Linear(5, 8, rngs=nnx.Rngs(0)))
        rhino.restore_checkpoint(str(tmp_path / "nnx"),
                                 like={"up": nnx.state(wrong), "norm": state["norm"],
                                       "down": state["down"]})


def _save_v1(path, tree, stage_form: str):
    """A ``rhino-checkpoint/1`` checkpoint as its writer made it: leaves ``leaf<k>`` in
    parts (the first half ``local/``, an orbax checkpoint; the rest ``stage0/`` in
    ``stage_form``), ``rhino.json`` listing them with the pickled treedef."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    half = len(flat) // 2
    leaves, local, stage = [], {}, {}
    for k, (keypath, x) in enumerate(flat):
        part = "local" if k < half else "stage0"
        (local if k < half else stage)[f"leaf{k}"] = x
        leaves.append({"path": jax.tree_util.keystr(keypath), "shape": list(np.shape(x)),
                       "dtype": np.dtype(x.dtype).name, "name": f"leaf{k}", "part": part})
    ck.write_part(os.path.join(path, "local"), local)
    if stage_form == "host":
        ck.write_part(os.path.join(path, "stage0"), stage, processes=[0, 1])
    else:
        os.makedirs(os.path.join(path, "stage0"))
        parts.write_shards(os.path.join(path, "stage0"), stage)
    with open(os.path.join(path, "rhino.json"), "w") as f:
        json.dump({"format": "rhino-checkpoint/1", "leaves": leaves,
                   "treedef": base64.b64encode(pickle.dumps(treedef)).decode()}, f)


@pytest.mark.parametrize("stage_form", ["host", "shards"])
def test_the_first_format_still_restores(tmp_path, stage_form):
    tree = _tree()
    _save_v1(str(tmp_path / "old"), tree, stage_form)
    _same(rhino.restore_checkpoint(str(tmp_path / "old")), tree)
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    on8 = rhino.restore_checkpoint(str(tmp_path / "old"), like=tree,
                                   shardings=NamedSharding(mesh, P()))
    _same(on8, tree)
    with pytest.raises(rhino.CheckpointError, match=r"leaf \['params'\]\['pos'\]: saved as"):
        rhino.restore_checkpoint(str(tmp_path / "old"),
                                 like={**tree, "params": {**tree["params"],
                                                          "pos": jnp.zeros((2, 8), jnp.int32)}})


def test_errors_name_the_leaf_or_the_path(tmp_path):
    tree = _tree()
    path = rhino.save_checkpoint(str(tmp_path / "ck"), tree)
    bad = {**tree, "params": {**tree["params"], "pos": jnp.zeros((8, 3), jnp.int32)}}
    with pytest.raises(rhino.CheckpointError,
                       match=r"leaf \['params'\]\['pos'\]: saved as \(8, 2\) int32 "
                             r"\(params/pos\), found \(8, 3\) int32"):
        rhino.restore_checkpoint(path, like=bad)
    with pytest.raises(rhino.CheckpointError, match=r"leaf \['params'\]\['extra'\]: expected "
                                                    r"it in the checkpoint"):
        rhino.restore_checkpoint(path, like={**tree, "params": {**tree["params"],
                                                                "extra": jnp.ones(2)}})
    with pytest.raises(rhino.CheckpointError, match=r"saved as step but not in like"):
        rhino.restore_checkpoint(path, like={k: v for k, v in tree.items() if k != "step"})
    with pytest.raises(rhino.CheckpointError, match=r"shardings: expected \d+ \(one per leaf\)"):
        rhino.restore_checkpoint(path, shardings=[SingleDeviceSharding(jax.devices()[0])])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(rhino.CheckpointError,
                       match=r"restore_checkpoint: .*empty: expected a checkpoint: an orbax "
                             r"checkpoint directory .*found \['notes.txt'\]"):
        rhino.restore_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(rhino.CheckpointError, match=r"expected a checkpoint directory at "
                                                    r".*nowhere, found nothing"):
        rhino.restore_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(rhino.CheckpointError, match=r"step=3: expected a directory of numbered"):
        rhino.restore_checkpoint(path, step=3)
    with pytest.raises(rhino.CheckpointError, match=r"expected a path on a \(shared\) "
                                                    r"filesystem, found the URL gs://b/ck"):
        rhino.save_checkpoint("gs://b/ck", tree)
