"""Distributed initialization (Rhino §6.3): parameters created on their own devices, equal to
a single-device init with the same seed."""

import doctest
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rhino.errors import RhinoError
from rhino.models import get_model
import rhino.runtime.state.sharded_init as init_module
from rhino.runtime.state.sharded_init import (DistributedInitError, check_threefry_partitionable,
                                distributed_init, init_programs)


def test_module_doctests():
    assert doctest.testmod(init_module).failed == 0


@pytest.fixture(scope="module")
def gpt():
    return get_model("gpt", layers=2, hidden=64, heads=2, seq=16, vocab=256)


@pytest.fixture(scope="module")
def meshes():
    devs = jax.devices()
    assert len(devs) >= 8, "conftest should give 8 simulated CPU devices"
    return (Mesh(np.array(devs[:4]).reshape(2, 2), ("dp", "tp")),
            Mesh(np.array(devs[4:8]).reshape(2, 2), ("dp", "tp")))


def layer_shardings(mesh, sharded: bool):
    rep = NamedSharding(mesh, P())
    if not sharded:
        return rep  # a prefix: the whole layer replicated on the stage
    return {"ln1": rep, "ln2": rep, "b1": NamedSharding(mesh, P("tp")), "b2": rep,
            "wqkv": NamedSharding(mesh, P(None, "tp")), "wo": NamedSharding(mesh, P("tp", None)),
            "w1": NamedSharding(mesh, P(None, ("dp", "tp"))),
            "w2": NamedSharding(mesh, P(("dp", "tp"), None))}


def two_stage_shardings(meshes):
    """Stage 0 (devices 0-3): embeddings + layer 0; stage 1 (devices 4-7): layer 1 + ln_f."""
    m0, m1 = meshes
    return {"wte": NamedSharding(m0, P("tp", None)), "wpe": NamedSharding(m0, P()),
            "layers": [layer_shardings(m0, True),
                       {**layer_shardings(m1, True), "wo": NamedSharding(m1, P())}],
            "ln_f": NamedSharding(m1, P())}


def local_shape(shape, sharding):
    return tuple(d // math.prod(sharding.mesh.shape[a] for a in
                                (() if e is None else (e,) if isinstance(e, str) else e))
                 for d, e in zip(shape, tuple(sharding.spec) + (None,) * len(shape)))


def test_gpt_two_stages_bit_exact_and_placed(gpt, meshes):
    key = jax.random.key(42)
    init = gpt.config.init_params
    ref = jax.jit(init)(key)
    shardings = two_stage_shardings(meshes)
    out = distributed_init(init, key, shardings=shardings)

    assert jax.tree.structure(out) == jax.tree.structure(ref)
    flat_sh = jax.tree.leaves(jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub),
                                           shardings, ref,
                                           is_leaf=lambda x: isinstance(x, NamedSharding)))
    for got, want, sh in zip(jax.tree.leaves(out), jax.tree.leaves(ref), flat_sh):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # bit-exact
        assert got.dtype == want.dtype
        assert got.sharding == sh
        assert {s.device for s in got.addressable_shards} == set(sh.mesh.devices.flat)
        for shard in got.addressable_shards:
            assert shard.data.shape == local_shape(want.shape, sh)

    # the two stages own disjoint device sets
    ids = lambda tree: {d.id for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set}
    assert ids([out["wte"], out["wpe"], out["layers"][0]]) == {0, 1, 2, 3}
    assert ids([out["layers"][1], out["ln_f"]]) == {4, 5, 6, 7}
    # a sharded leaf really is split: wte [256, 64] over tp=2 -> [128, 64] per device
    assert {s.data.shape for s in out["wte"].addressable_shards} == {(128, 64)}
    assert {s.data.shape for s in out["layers"][0]["w1"].addressable_shards} == {(64, 64)}


def _array_sizes(hlo_text):
    """Element counts of every array shape in an HLO text."""
    return [math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            for dims in re.findall(r"\b(?:f32|u32|s32|u64|bf16|f16|pred)\[([\d,]*)\]", hlo_text)]


def test_programs_one_per_stage_and_no_full_copies(gpt, meshes):
    init = gpt.config.init_params
    key = jax.random.key(0)
    shardings = two_stage_shardings(meshes)
    progs = init_programs(init, key, shardings=shardings)
    assert [p.device_ids for p in progs] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    n_leaves = len(jax.tree.leaves(jax.eval_shape(init, key)))
    assert sorted(i for p in progs for i in p.leaf_indices) == list(range(n_leaves))
    assert all("['wte']" not in path for path in progs[1].leaf_paths)

    for prog in progs:
        compiled = prog.lower().compile()
        text = compiled.as_text()
        outs = prog.run()
        largest_local = max(math.prod(local_shape(o.shape, o.sharding)) for o in outs)
        # every array in the per-device program, intermediates included, is no larger than the
        # largest local shard: no device materializes a full copy of a sharded leaf
        assert max(_array_sizes(text)) <= largest_local, prog.device_ids
        root = [line for line in text.splitlines() if "ROOT" in line][-1]
        assert root.count("f32[") == len(prog.leaf_indices)  # other stage's leaves eliminated
    assert "f32[128,64]" in progs[0].lower().compile().as_text()  # local wte shard


def test_same_device_set_two_meshes_one_program(meshes):
    m0, _ = meshes
    flat = Mesh(np.array(list(m0.devices.flat)), ("x",))
    init = lambda key: {"a": jax.random.normal(key, (8, 4)), "b": jax.random.uniform(key, (4, 8))}
    sh = {"a": NamedSharding(m0, P("dp", "tp")), "b": NamedSharding(flat, P(None, "x"))}
    assert len(init_programs(init, jax.random.key(3), shardings=sh)) == 1
    out = distributed_init(init, jax.random.key(3), shardings=sh)
    ref = jax.jit(init)(jax.random.key(3))
    for name in "ab":
        # Equal up to float rounding: the partitioned program may evaluate the normal's
        # inverse-erf polynomial with other contractions (jax 0.12: 2.4e-7 off).
        np.testing.assert_allclose(np.asarray(out[name]), np.asarray(ref[name]), rtol=1e-6,
                                   atol=1e-6)
        assert out[name].sharding == sh[name]


def test_committed_key_and_single_prefix(meshes):
    _, m1 = meshes
    key = jax.device_put(jax.random.key(7), jax.devices()[0])  # committed to a stage-0 device
    init = lambda key: (jax.random.normal(key, (16, 4)), jnp.arange(4.0))
    out = distributed_init(init, key, shardings=NamedSharding(m1, P()))
    ref = jax.jit(init)(key)
    for got, want in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding.device_set == set(m1.devices.flat)


def test_tree_mismatch_is_error(gpt, meshes):
    shardings = two_stage_shardings(meshes)
    del shardings["ln_f"]
    with pytest.raises(DistributedInitError, match="expected a sharding for it") as e:
        distributed_init(gpt.config.init_params, jax.random.key(0), shardings=shardings)
    assert isinstance(e.value, RhinoError) and e.value.found == "none"
    assert e.value.where == "output ['ln_f']['bias']"


def test_extra_shardings_entry_is_error(gpt, meshes):
    shardings = two_stage_shardings(meshes)
    shardings["layers"][1]["w3"] = NamedSharding(meshes[1], P())
    with pytest.raises(DistributedInitError, match="no such sub-tree") as e:
        distributed_init(gpt.config.init_params, jax.random.key(0), shardings=shardings)
    assert e.value.where == "shardings['layers'][1]['w3']"


def test_non_sharding_leaf_is_error(meshes):
    init = lambda key: {"a": jnp.zeros(4), "b": jnp.ones(4)}
    with pytest.raises(DistributedInitError, match="found a leaf None"):
        distributed_init(init, jax.random.key(0),
                         shardings={"a": NamedSharding(meshes[0], P()), "b": None})


def test_indivisible_dimension_is_error():
    mesh3 = Mesh(np.array(jax.devices()[:3]), ("x",))
    init = lambda key: {"w": jax.random.normal(key, (64, 8))}
    with pytest.raises(DistributedInitError) as e:
        distributed_init(init, jax.random.key(0), shardings=NamedSharding(mesh3, P("x")))
    assert "divisible by 3" in e.value.expected and e.value.found == "size 64"
    assert "['w']" in e.value.where


def test_rank_mismatch_is_error(meshes):
    init = lambda key: jnp.zeros(4)
    with pytest.raises(DistributedInitError, match="rank <= 1"):
        distributed_init(init, jax.random.key(0), shardings=NamedSharding(meshes[0], P("dp", "tp")))


def test_legacy_threefry_is_refused():
    check_threefry_partitionable()  # jax's default
    init = lambda key: jax.random.normal(key, (4,))
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    with jax.threefry_partitionable(False):
        with pytest.raises(DistributedInitError, match="jax_threefry_partitionable"):
            distributed_init(init, jax.random.key(0), shardings=NamedSharding(mesh, P("x")))
