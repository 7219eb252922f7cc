"""jax >= 0.11's coming behaviour, ``jax_remat3`` and ``jax_custom_vjp3`` on: ``jax.checkpoint``
and ``custom_vjp`` bind other primitives (``call_hi_primitive`` before differentiation; the
checkpoint inlined behind an optimization barrier after it). Checkpointed layers stay
planned (no op kept replicated for lack of a rule) and custom_vjp functions stay exact,
under SPMD and in a pipeline. (The whole suite was also run with both flags on: see
benchmarks/RESULTS.md.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino

JAX = tuple(int(x) for x in jax.__version__.split(".")[:2])
pytestmark = pytest.mark.skipif(JAX < (0, 11), reason="jax_remat3 / jax_custom_vjp3 arrived "
                                                      "in jax 0.11")


@pytest.fixture
def future():
    old = jax.config.jax_remat3, jax.config.jax_custom_vjp3
    jax.config.update("jax_remat3", True)
    jax.config.update("jax_custom_vjp3", True)
    yield
    jax.config.update("jax_remat3", old[0])
    jax.config.update("jax_custom_vjp3", old[1])


@jax.custom_vjp
def clipped_relu(x):
    return jnp.clip(x, 0.0, 6.0)


clipped_relu.defvjp(lambda x: (clipped_relu(x), x),
                    lambda x, g: (g * ((x > 0) & (x < 6)).astype(g.dtype),))


def _step(params, x, y):
    def loss(p):
        h = x
        for layer in p:
            h = jax.checkpoint(lambda h, w: clipped_relu(h @ w))(h, layer)
        return jnp.mean((h - y) ** 2)
    value, g = jax.value_and_grad(loss)(params)
    return [w - 0.1 * gw for w, gw in zip(params, g)], value


def _args(d=32, n=16):
    ks = jax.random.split(jax.random.key(0), 4)
    params = [jax.random.normal(k, (d, d)) / np.sqrt(d) for k in ks[:3]]
    return params, jax.random.normal(ks[3], (n, d)), jnp.ones((n, d)) * 0.1


def _sharded(plan) -> int:
    return sum(1 for p in plan.params if p.path.startswith("params") and
               any(d.axes for d in p.spec.dims))


def test_checkpoint_and_custom_vjp_under_spmd(future):
    big = _args(256, 64)
    planned = rhino.auto_parallel(_step, mesh_shape=(8,)).plan_for(*big).spmd
    assert not planned.unplanned, planned.unplanned
    jax.config.update("jax_remat3", False)
    jax.config.update("jax_custom_vjp3", False)
    before = rhino.auto_parallel(_step, mesh_shape=(8,)).plan_for(*big).spmd
    assert _sharded(planned) >= _sharded(before) > 0, (_sharded(planned), _sharded(before))
    jax.config.update("jax_remat3", True)
    jax.config.update("jax_custom_vjp3", True)
    params, x, y = _args()
    step = rhino.auto_parallel(_step, mesh_shape=(8,))
    p1, p2 = [jnp.array(w) for w in params], params      # p1 is donated
    for _ in range(3):
        p1, l1 = step(p1, x, y)
        p2, l2 = jax.jit(_step)(p2, x, y)
        np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    for a, b in zip(p1, p2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_checkpoint_and_custom_vjp_in_a_pipeline(future):
    params, x, y = _args()
    step = rhino.auto_parallel(_step, cluster="2x4", stages=2, num_microbatches=4,
                               timeout=300)
    try:
        p1, p2 = params, params
        for _ in range(3):
            p1, l1 = step([np.asarray(w) for w in p1], x, y)
            p2, l2 = jax.jit(_step)(p2, x, y)
            np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    finally:
        step.close()
