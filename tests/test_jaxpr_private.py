"""Canaries: every JAX internal rhino uses (``rhino.jaxpr``), on the installed JAX. Each test
fails when the internal changes shape, so a JAX upgrade breaks here first."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhino.jaxpr import interpret
from rhino.jaxpr import primitives as prims
from rhino.jaxpr import private as jp

JAX = tuple(int(x) for x in jax.__version__.split(".")[:2])


def test_stablehlo_to_hlo_text_keeps_metadata():
    lowered = jax.jit(lambda x: jnp.tanh(x) * 2).lower(jnp.ones(4))
    text = jp.stablehlo_text_to_hlo_text(lowered.as_text(debug_info=True))
    assert text.startswith("HloModule")
    assert "tanh" in text and "op_name=" in text


def test_stablehlo_to_hlo_text_rejects_garbage():
    with pytest.raises(ValueError):
        jp.stablehlo_text_to_hlo_text("module { this is not mlir }")


def test_kept_arg_indices():
    lowered = jax.jit(lambda a, b: a * 2).lower(jnp.ones(3), jnp.ones(3))
    assert jp.kept_arg_indices(lowered) == (0,)
    kept_all = jax.jit(lambda a, b: a * 2, keep_unused=True).lower(jnp.ones(3), jnp.ones(3))
    assert jp.kept_arg_indices(kept_all) == (0, 1)


def test_kept_arg_indices_refuses_a_lowering_that_no_longer_says():
    class Lowered:
        class _lowering:
            compile_args = {"backend": "cpu"}
    with pytest.raises(RuntimeError, match="kept_var_idx"):
        jp.kept_arg_indices(Lowered())


def test_jaxpr_types_env_and_binding():
    closed = jax.make_jaxpr(lambda x: (x * 2.0, jnp.sin(x)))(jnp.ones(3))
    mul = closed.jaxpr.eqns[0]
    assert jp.is_literal(mul.invars[1]) and not jp.is_literal(mul.invars[0])
    assert jp.open_body(closed) == (closed.jaxpr, closed.consts)
    body, consts = jp.open_body(closed.jaxpr)
    assert body is closed.jaxpr and list(consts) == []
    assert jp.open_body("no body") is None
    env, read = jp.jaxpr_env(closed.jaxpr, closed.consts, [jnp.arange(3.0)])
    assert read(mul.invars[1]) == 2.0 and read(mul.invars[0]).tolist() == [0.0, 1.0, 2.0]
    assert jp.bind(mul, [jnp.arange(3.0), 2.0])[0].tolist() == [0.0, 2.0, 4.0]
    assert jp.bind_params(mul) == dict(mul.params)      # nothing to convert for a mul
    got = jp.eval_jaxpr(closed.jaxpr, closed.consts, jnp.ones(3))
    np.testing.assert_allclose(got[1], np.sin(np.ones(3)))
    from jax.extend import core as jcore
    assert jp.is_dropped(jcore.DropVar(mul.outvars[0].aval))
    assert not jp.is_dropped(mul.outvars[0]) and not jp.is_dropped(mul.invars[0])


def _line(fn):
    import inspect
    return f"{__file__}:{inspect.getsourcelines(fn)[1] + 1}"


def _user_step(x):
    return jnp.tanh(x) + 1.0


def test_eqn_source_and_context_keep_the_users_line():
    closed = jax.make_jaxpr(_user_step)(jnp.ones(3))
    tanh = closed.jaxpr.eqns[0]
    assert jp.eqn_source(tanh) == _line(_user_step)

    def again(x):
        with jp.eqn_context(tanh):
            return jp.bind(tanh, [x])[0]
    import rhino
    g = rhino.ingest(again, jnp.ones(3))
    (op,) = [o for o in g.ops if o.opcode == "tanh"]
    assert op.source == _line(_user_step)


def test_name_stack_text():
    def f(x):
        with jax.named_scope("rhino_probe"):
            return x * 3
    closed = jax.make_jaxpr(f)(jnp.ones(2))
    assert "rhino_probe" in jp.name_stack_text(closed.jaxpr.eqns[0])


def test_trace_without_name_stack_puts_constants_first():
    c = jnp.arange(3.0)
    jaxpr, consts = jp.trace_without_name_stack(lambda x: x + c, [jnp.ones(3)])
    assert len(consts) == 1 and len(jaxpr.invars) == 2 and not jaxpr.constvars
    assert jp.eval_jaxpr(jaxpr, [], *consts, jnp.ones(3))[0].tolist() == [1.0, 2.0, 3.0]


def test_scan_parts_and_info():
    def f(c, xs, k):
        return jax.lax.scan(lambda c, x: (c * x + k, c), c, xs, reverse=True)
    closed = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((5, 3)), jnp.ones(3))
    scan = next(e for e in closed.jaxpr.eqns if prims.name(e) == prims.SCAN)
    nc, nk, nx = jp.scan_parts(scan)
    assert (nc, nk, nx) == (1, 1, 1) and nc + nk + nx == len(scan.invars)
    assert scan.invars[nc + nk - 1].aval.shape == (3,)            # the carry
    info = prims.scan_info(scan)
    assert info[:4] == (1, 1, 5, True) and len(info[4][0].invars) == 3
    # the backward scan of a gradient carries more (its residuals are scanned inputs)
    g = jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(
        jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0])))(
        jnp.ones((4, 3, 3)), jnp.ones((2, 3)))
    for e in g.jaxpr.eqns:
        if prims.name(e) == prims.SCAN:
            nc, nk, nx = jp.scan_parts(e)
            assert nc + nk + nx == len(e.invars) and nk >= 1 and nx >= 1


@pytest.mark.skipif(JAX < (0, 11), reason="jax_remat3 / jax_custom_vjp3 arrived in 0.11")
def test_hi_body_of_checkpoint_and_custom_vjp():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)
    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))
    old = jax.config.jax_remat3, jax.config.jax_custom_vjp3
    jax.config.update("jax_remat3", True)
    jax.config.update("jax_custom_vjp3", True)
    try:
        closed = jax.make_jaxpr(lambda x: f(jax.checkpoint(lambda y: y * 2)(x)))(jnp.ones(3))
    finally:
        jax.config.update("jax_remat3", old[0])
        jax.config.update("jax_custom_vjp3", old[1])
    his = [e for e in closed.jaxpr.eqns if prims.name(e) == prims.HI]
    assert len(his) == 2
    bodies = [prims.call_body(e) for e in his]
    assert [prims.name(b[0].eqns[0]) for b in bodies] == ["mul", "sin"]
    got = interpret.evaluate(closed.jaxpr, closed.consts, [jnp.ones(3)])[0]
    np.testing.assert_allclose(got, np.sin(2 * np.ones(3)), rtol=1e-6)


def test_every_primitive_name_of_the_table_exists():
    """A primitive renamed or removed by JAX shows up here (names only some supported
    releases have are listed in ``VERSION_DEPENDENT``)."""
    from jax.extend.core import Primitive
    import jax.experimental.custom_partitioning  # noqa: F401 - registers more primitives

    jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0)
    installed = {o.name for o in gc.get_objects() if isinstance(o, Primitive)}
    missing = prims.all_names() - installed - prims.VERSION_DEPENDENT
    assert not missing, sorted(missing)


def test_body_accessors_on_real_equations():
    k = jnp.ones(3)
    closed = jax.make_jaxpr(lambda x: (
        jax.jit(jnp.sin)(x),
        jax.nn.relu(x),                                  # custom_jvp
        jax.checkpoint(lambda y: y * k)(x),
        jax.lax.cond(x[0] > 0, lambda y: y + 1, lambda y: y - 1, x),
        jax.lax.while_loop(lambda c: c[0] < 3, lambda c: c + 1, x),
        jax.random.bits(jax.random.key(0), (4, 2)),
        jnp.argmax(x), jnp.sum(x, axis=0)))(jnp.ones(3))
    kinds = {}
    for e in closed.jaxpr.eqns:
        if prims.call_body(e) is not None:
            kinds.setdefault("call" if prims.is_call(e) else
                             "remat" if prims.is_remat(e) else "custom", []).append(e)
    assert set(kinds) == {"call", "remat", "custom"}, [prims.name(e) for e in closed.jaxpr.eqns]
    cond = next(e for e in closed.jaxpr.eqns if prims.name(e) == prims.COND)
    assert len(prims.cond_branches(cond)) == 2 and prims.light_cond(cond)
    loop = next(e for e in closed.jaxpr.eqns if prims.name(e) == prims.WHILE)
    nc, nb, cj = prims.while_parts(loop)
    assert nc + nb + len(cj.invars) - nc == len(loop.invars) - nb
    leaves = interpret.leaf_equations(closed.jaxpr)
    bits = [e for e in leaves.values() if prims.rng_shape(e) is not None]
    assert [prims.rng_shape(e) for e in bits] == [(4, 2)]
    red = [e for e in leaves.values() if prims.name(e) in prims.REDUCTIONS
           or prims.name(e) in prims.ARG_REDUCTIONS]
    assert sorted(prims.reduction_axes(e) for e in red) == [(0,), (0,)]


def test_flatten_inlines_bodies_and_marks_checkpoints():
    closed = jax.make_jaxpr(lambda x: jax.checkpoint(lambda y: jnp.sin(y) * 2)(x) + 1)(
        jnp.ones(3))
    flat = interpret.flatten(closed)
    assert [prims.name(fe.eqn) for fe in flat.eqns] == ["sin", "mul", "add"]
    (path,) = flat.remats
    assert [fe.remat for fe in flat.eqns] == [path, path, None]
    assert isinstance(flat.eqns[1].ins[1], interpret.Lit)


def test_custom_partitioning_bodies_are_found_inside_calls():
    """The ``custom_partitioning`` equation keeps its per-shard body in ``call``, found
    inside a ``jit`` and a ``custom_vjp`` (rhino's fused attention has both)."""
    from rhino.models.attention import fused_attention

    q = jax.ShapeDtypeStruct((2, 8, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 8, 2, 16), jnp.float32)
    closed = jax.make_jaxpr(jax.jit(lambda q, k, v: fused_attention(q, k, v).sum()))(q, kv, kv)
    found = jp.custom_partitioning_bodies(closed)
    assert len(found) == 1
    fn, ins, outs, key = found[0]
    assert [s.shape for s in ins] == [(2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16)]
    assert outs == [(2, 8, 4, 16)] and key
    got = fn(*[jnp.ones(s.shape, s.dtype) for s in ins])
    assert got[0].shape == (2, 8, 4, 16)


_KV_JOB = """
import socket, sys
import jax
from rhino.jaxpr import private as jp
assert not jp.backends_initialized()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0,
                           initialization_timeout=30)
jp.kv_set("rhino-test/a", "hello")
assert jp.kv_get("rhino-test/a", 5.0) == "hello"
try:
    jp.kv_get("rhino-test/missing", 0.5)
except TimeoutError as e:
    print("timeout:", e)
else:
    sys.exit("expected a TimeoutError")
jax.devices()
assert jp.backends_initialized()
print("OK")
"""


def test_key_value_store_and_backends_in_a_job_of_one(tmp_path):
    """The jax.distributed key-value store (kv_set / kv_get with a timeout) and
    backends_initialized, in a fresh process (joining a job changes the process for good)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", _KV_JOB], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "timeout: key 'rhino-test/missing': not written within 0.5 s" in out.stdout
    assert out.stdout.strip().endswith("OK")


def test_the_key_value_store_needs_a_job():
    if jax.distributed.is_initialized():
        pytest.skip("this process joined a jax.distributed job")
    with pytest.raises(RuntimeError, match="expected a joined job"):
        jp.kv_set("rhino-test/x", "1")


def test_with_weak_type_changes_only_the_weak_type():
    import jax.numpy as jnp
    import numpy as np

    from rhino.jaxpr.private import with_weak_type

    x = jnp.arange(3, dtype=jnp.float32)
    weak = with_weak_type(x, True)
    assert weak.weak_type and weak.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(weak), np.asarray(x))
    assert not with_weak_type(weak, False).weak_type
    # As jax.jit treats a weakly typed value: bf16 minus it stays bf16.
    assert (jnp.ones(2, jnp.bfloat16) - with_weak_type(jnp.float32(1), True)).dtype == \
        jnp.bfloat16


def test_uncommitted_view_shares_a_shard_and_combines_with_other_meshes():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devs = jax.devices()
    a_mesh, b_mesh = Mesh(np.array(devs[:2]), ("x",)), Mesh(np.array(devs[2:4]), ("x",))
    a = jax.device_put(jnp.float32(6), NamedSharding(a_mesh, PartitionSpec()))
    b = jax.device_put(jnp.asarray(2.0), NamedSharding(b_mesh, PartitionSpec()))   # weak
    va, vb = jp.uncommitted_view(a), jp.uncommitted_view(b)
    assert not va.committed and va.devices() == {devs[0]} and vb.devices() == {devs[2]}
    assert vb.weak_type and vb.dtype == b.dtype
    assert va.addressable_data(0).unsafe_buffer_pointer() == \
        a.addressable_shards[0].data.unsafe_buffer_pointer()         # no copy
    assert float(va / vb) == 3.0                     # committed, they would be refused
    with pytest.raises(ValueError, match="incompatible devices"):
        a / b
    w = jax.device_put(jnp.ones(4), NamedSharding(b_mesh, PartitionSpec("x")))
    assert (w * va).sharding == w.sharding           # follows the committed array


def test_distributed_kv_client_is_none_outside_a_job():
    # Inside a job it is the coordination client (tests/test_jax_transfer.py uses it).
    assert jp.distributed_kv_client() is None


def test_effects_ordered_or_not_and_the_callbacks_they_hold():
    """``is_ordered_effect`` (JAX's ordered-effect set) through ``primitives.is_effect`` /
    ``is_ordered``, and ``callback_sites`` finding a print inside a ``cond``'s branch;
    ``pure_callback`` has no effect."""
    from jax.experimental import io_callback

    def f(x):
        jax.debug.print("{}", x[0], ordered=True)
        io_callback(lambda v: None, None, x)
        jax.debug.callback(lambda v: None, x)
        y = jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return jax.lax.cond(x[0] > 0, lambda v: (jax.debug.print("{}", v[0]), v)[1],
                            lambda v: -v, y)

    eqns = [e for e in jax.make_jaxpr(f)(jnp.ones(3)).jaxpr.eqns
            if prims.is_effect(e) or prims.callback_sites(e)]
    assert [(prims.name(e), prims.is_effect(e), prims.is_ordered(e)) for e in eqns] == [
        ("debug_print", True, True), ("io_callback", True, False),
        ("debug_callback", True, False), ("pure_callback", False, False),
        ("cond", True, False)]
    assert [prims.name(s) for s in prims.callback_sites(eqns[-1])] == ["debug_print"]
