"""JAX's own objects in rhino (issue 48, item 4): a ``jax.sharding.Mesh`` / ``jax.make_mesh``
as ``mesh=`` (its axis names kept in plans, reports and results), keyword and static
arguments as ``jax.jit`` takes them, and the plan given back as ``NamedSharding``s and as a
plain ``jax.jit`` that compiles to rhino's program."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rhino
from rhino.errors import ArgumentError, OptionsError
from rhino.models import get_model


def _step(params, opt_state, batch, *, lr_scale=1.0, train=True):
    def loss(p):
        h = batch["x"] @ p["w1"]
        h = jax.nn.relu(h) if train else jnp.tanh(h)
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optax.sgd(0.1 * lr_scale).update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, value


def _args():
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(32, 64)).astype(np.float32) * 0.1,
              "w2": rng.normal(size=(64, 8)).astype(np.float32) * 0.1}
    batch = {"x": rng.normal(size=(64, 32)).astype(np.float32),
             "y": rng.normal(size=(64, 8)).astype(np.float32)}
    return params, optax.sgd(0.1).init(params), batch


def _close(got, want, atol=1e-6):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=atol)


def _collectives(text):
    return collections.Counter(re.findall(
        r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
        r"(?:-start)?\(", text))


def test_a_jax_mesh_keeps_its_axis_names_and_devices():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    params, opt, batch = _args()
    step = rhino.auto_parallel(_step, mesh=mesh)
    want = jax.jit(_step)(params, opt, batch)
    got = step(params, opt, batch)
    _close(got, want)
    plan = step.plan_for(params, opt, batch)
    assert plan.spmd.mesh.axis_names == ("data", "model")
    assert "Mesh(data=2, model=4)" in step.report_for(params, opt, batch)
    out_mesh = got[0]["w1"].sharding.mesh
    assert out_mesh.axis_names == ("data", "model")
    assert list(out_mesh.devices.flat) == list(mesh.devices.flat)
    # rhino.plan takes it too, and so does an abstract JAX mesh
    assert rhino.plan(_step, params, opt, batch, mesh=mesh).spmd.mesh.axis_names == \
        ("data", "model")
    abstract = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    assert rhino.auto_parallel(_step, mesh=abstract).plan_for(params, opt, batch) \
        .spmd.mesh.axis_names == ("data", "model")


def test_a_mesh_of_another_kind_or_other_devices_is_refused():
    with pytest.raises(OptionsError, match=r"mesh: expected a rhino.AbstractMesh, a "
                                           r"jax.sharding.Mesh .* found tuple"):
        rhino.auto_parallel(_step, mesh=(2, 4))
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with pytest.raises(OptionsError, match="devices: expected the devices of mesh="):
        rhino.auto_parallel(_step, mesh=mesh, devices=jax.devices()[2:4])


def test_keyword_and_static_arguments_as_jax_jit_takes_them():
    params, opt, batch = _args()
    step = rhino.auto_parallel(_step, mesh_shape=(4,), static_argnames="train")
    ref = jax.jit(_step, static_argnames="train")
    for train in (True, False, True):
        want = ref(params, opt, batch=batch, train=train, lr_scale=0.5)
        _close(step(params, opt, batch=batch, train=train, lr_scale=0.5), want)
    assert step.plans_built == 2          # one per static value
    # The plan speaks of the step's own argument names.
    plan = step.plan_for(params, opt, batch=batch, train=False, lr_scale=0.5)
    assert {p.path for p in plan.spmd.params} >= {"batch['x']", "params['w1']"}
    by_num = rhino.auto_parallel(lambda p, o, b, t: _step(p, o, b, train=t),
                                 mesh_shape=(4,), static_argnums=3)
    _close(by_num(params, opt, batch, False), ref(params, opt, batch, train=False))


def test_bad_keyword_and_static_arguments_are_refused_as_python_would():
    params, opt, batch = _args()
    with pytest.raises(OptionsError, match=r"static_argnames: expected names of _step's "
                                           r"parameters .* found \['nope'\]"):
        rhino.auto_parallel(_step, static_argnames="nope")
    with pytest.raises(OptionsError, match=r"static_argnums: expected positions"):
        rhino.auto_parallel(_step, static_argnums=7)
    step = rhino.auto_parallel(_step, mesh_shape=(4,), static_argnames="train")
    with pytest.raises(ArgumentError, match=r"unexpected keyword argument 'nope'"):
        step(params, opt, batch=batch, nope=1)
    with pytest.raises(ArgumentError, match=r"static argument 'train': expected a hashable"):
        step(params, opt, batch, train=[True])


def test_a_pipeline_takes_keyword_and_static_arguments():
    params, opt, batch = _args()
    want = jax.jit(_step, static_argnames="train")(params, opt, batch=batch, train=False)
    with rhino.auto_parallel(_step, cluster="2x4", stages=2, num_microbatches=4,
                             static_argnames="train") as step:
        got = step(params, opt, batch=batch, train=False)
        assert step.plan_for(params, opt, batch=batch, train=False).num_stages == 2
    _close(got, want)


@pytest.mark.extended
def test_the_plan_as_named_shardings_and_as_a_plain_jax_jit():
    """``shardings_for`` gives the arguments' and results' NamedShardings; ``jit_for`` is
    a jax.jit that compiles to rhino's own program: the same collectives, the same
    results, run without rhino."""
    m = get_model("gpt", layers=2, hidden=128, heads=4, seq=32, vocab=256, batch=16)
    params, opt = m.init(jax.random.PRNGKey(0))
    args = (params, opt, m.make_batch(jax.random.PRNGKey(1)))
    step = rhino.auto_parallel(m.step, mesh=jax.make_mesh((2, 4), ("data", "model")),
                               donate=False)
    ins, outs = step.shardings_for(*args)
    assert jax.tree.structure(ins) == jax.tree.structure(tuple(args))
    assert all(isinstance(s, jax.sharding.NamedSharding) for s in jax.tree.leaves(ins))
    assert {s.mesh.axis_names for s in jax.tree.leaves(outs)} == {("data", "model")}
    jitted = step.jit_for(*args)
    ours = _collectives(step.compiled_text(*args))
    assert ours and _collectives(jitted.lower(*args).compile().as_text()) == ours
    # (Adam's normalised step turns the sharded sums' rounding into ~4e-5 on a parameter)
    _close(jitted(*args), step(*args), atol=0)      # rhino's program, run as plain JAX
    _close(jitted(*args), jax.jit(m.step)(*args), atol=1e-4)
    # jax.jit of the bare step with the shardings runs (XLA places what is inside).
    _close(jax.jit(m.step, in_shardings=ins, out_shardings=outs)(*args),
           jax.jit(m.step)(*args), atol=1e-4)
    pipelined = rhino.auto_parallel(m.step, cluster="2x4", stages=2)
    with pytest.raises(rhino.RhinoError, match="shardings_for: expected a step run as one "
                                               "SPMD program"):
        pipelined.shardings_for(*args)
    pipelined.close()
