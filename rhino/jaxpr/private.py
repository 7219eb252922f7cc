"""Every use of JAX's private or unstable API in rhino (``jax._src``, ``jax.extend.core``,
``jax.core``, equation parameters whose layout changed between releases).

A JAX upgrade that changes one of these breaks here, and ``tests/test_jaxpr_private.py`` has
a canary per function that fails on the installed JAX when it does. Checked on jax 0.10.2
(Python 3.11) and 0.12.0.1 (Python 3.12).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

# ------------------------------------------------------------------------------ jaxpr types


def _jcore():
    from jax.extend import core as jcore
    return jcore


def is_literal(v: Any) -> bool:
    """A literal operand of an equation (its value is ``v.val``)."""
    return isinstance(v, _jcore().Literal)


def is_dropped(v: Any) -> bool:
    """An equation result nothing reads (``_`` in a printed jaxpr)."""
    return isinstance(v, _jcore().DropVar)


def open_body(body: Any) -> tuple[Any, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of a body parameter: a ``ClosedJaxpr``, an open ``Jaxpr`` (no
    constants), or anything else (None)."""
    jcore = _jcore()
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, body.consts
    if isinstance(body, jcore.Jaxpr):
        return body, ()
    return None


def jaxpr_env(jaxpr: Any, consts: Any, args: Any) -> tuple[dict, Any]:
    """The environment an interpreter of ``jaxpr`` starts from (constants and arguments
    bound) and its ``read`` (a literal's value, else the variable's)."""
    literal = _jcore().Literal
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, literal) else env[v]
    return env, read


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """``jax.core.eval_jaxpr``: every equation bound as it is."""
    import jax
    return jax.core.eval_jaxpr(jaxpr, consts, *args)


def bind(eqn: Any, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
    """Bind ``eqn``'s primitive on ``invals`` (with ``params``, default the equation's
    own, as ``get_bind_params`` gives them); always a list of results."""
    prim = eqn.primitive
    if params is None:
        params = prim.get_bind_params(eqn.params)
    outs = prim.bind(*invals, **params)
    return list(outs) if prim.multiple_results else [outs]


def bind_params(eqn: Any) -> dict:
    """The parameters ``eqn``'s primitive is bound with (bodies as bind wants them)."""
    return dict(eqn.primitive.get_bind_params(eqn.params))


def is_ordered_effect(effect: Any) -> bool:
    """An ordered effect (``jax.debug.print(..., ordered=True)``, ``io_callback(...,
    ordered=True)``): JAX threads a runtime token through the programs holding one."""
    from jax._src import effects

    return effects.ordered_effects.contains(effect)


# ------------------------------------------------------------------------------ sources
def eqn_context(eqn: Any):
    """The context ``jax.core.eval_jaxpr`` binds an equation in: its source traceback and
    name stack (so re-evaluated ops keep the user's file:line), and its extra context."""
    from jax._src import source_info_util

    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack = contextlib.ExitStack()
    stack.enter_context(source_info_util.user_context(eqn.source_info.traceback,
                                                      name_stack=name_stack))
    ctx = getattr(eqn, "ctx", None)
    if ctx is not None and getattr(ctx, "manager", None) is not None:
        stack.enter_context(ctx.manager)
    return stack


def name_stack_text(eqn: Any) -> str:
    """``eqn``'s name stack as text (``jvp(layer)/transpose(...)``)."""
    return str(eqn.source_info.name_stack)


_INSTALLED = ("site-packages", "dist-packages")


def eqn_source(eqn: Any) -> str | None:
    """``file:line`` of the user code that made a jaxpr equation (None if unknown).

    The innermost frame outside JAX, the standard library and installed packages: the
    line of the user's own step (``nn.BatchNorm(...)(x)``), not the library's inside,
    wherever the library is installed. (JAX's own ``user_frame`` keeps a library frame in
    a virtualenv but skips it when site-packages sits under the interpreter's stdlib
    directory.) Falls back to JAX's choice when every frame is a library's."""
    from jax._src import source_info_util

    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    if not frames:
        return None
    own = [f for f in frames
           if not any(part in _INSTALLED for part in f.file_name.replace("\\", "/").split("/"))]
    frame = (own or frames)[0]
    return f"{frame.file_name}:{frame.start_line}"


def trace_without_name_stack(fn: Any, args: Any) -> tuple[Any, list]:
    """``fn`` traced at ``args``' types to an open jaxpr whose constants come first among its
    inputs (the form a call-like primitive such as ``remat2`` binds), with the name stack
    started afresh (the caller's scopes are the enclosing equation's, added when lowering)."""
    import jax
    from jax._src import source_info_util
    from jax._src.interpreters import partial_eval as pe

    with source_info_util.reset_name_stack():
        closed = jax.make_jaxpr(fn)(*args)
    return pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


# ------------------------------------------------------------------------------ parameters
def scan_parts(eqn: Any) -> tuple[int, int, int]:
    """``(constants, carry, scanned inputs)`` counts of a ``scan`` equation's operands.

    jax ≤ 0.11 names the counts (``num_consts``, ``num_carry``); jax 0.12 describes the
    operands as a flat tree (``ft_in``: constants, carry, xs)."""
    p = eqn.params
    n = len(eqn.invars)
    if "num_consts" in p:
        nc, nk = p["num_consts"], p["num_carry"]
        return nc, nk, n - nc - nk
    parts = p["ft_in"].update(list(range(n))).unpack()
    return tuple(len(list(part)) for part in parts)  # type: ignore[return-value]


def hi_body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """The body of a ``call_hi_primitive`` equation (jax ≥ 0.11 under ``jax_remat3`` /
    ``jax_custom_vjp3``: ``jax.checkpoint`` and ``custom_vjp`` functions applied without
    differentiation): the checkpointed function, or the custom_vjp function's primal."""
    prim = eqn.params.get("_prim")
    params = getattr(prim, "params", None) or {}
    body = params.get("jaxpr")
    if body is None and params.get("traced") is not None:
        body = getattr(params["traced"], "jaxpr", None)
    return open_body(body) if body is not None else None


def hi_remat_params(eqn: Any) -> dict | None:
    """``{"policy", "prevent_cse"}`` of a ``call_hi_primitive`` equation that is a
    ``jax.checkpoint`` (jax ≥ 0.11 under ``jax_remat3``: its ``_prim`` is a ``RematTraced``
    holding the body, the policy and ``prevent_cse``); None for any other equation."""
    if eqn.primitive.name != "call_hi_primitive":
        return None
    prim = eqn.params.get("_prim")
    params = getattr(prim, "params", None) or {}
    if not type(prim).__name__.startswith("Remat") or "prevent_cse" not in params:
        return None
    return {"policy": params.get("policy"), "prevent_cse": bool(params["prevent_cse"])}


# ------------------------------------------------------------------------------ lowering
def stablehlo_text_to_hlo_text(mlir_text: str) -> str:
    """Convert a StableHLO/MHLO MLIR module (text) to HLO text with metadata.

    Raises:
        ValueError: with the MLIR parser's message when the text is not a valid module.
    """
    from jax._src.lib import _jax, hlo  # private: the MLIR -> XlaComputation bridge

    try:
        comp = _jax.mlir.mlir_module_to_xla_computation(
            mlir_text, use_tuple_args=False, return_tuple=False)
    except Exception as e:  # the bridge raises XlaRuntimeError / ValueError variants
        raise ValueError(str(e)) from e
    opts = hlo.HloPrintOptions.short_parsable()
    opts.print_metadata = True
    return comp.as_hlo_module().to_string(opts)


def kept_arg_indices(lowered: Any) -> tuple[int, ...] | None:
    """Flat indices of the arguments a jitted function's lowering kept (None: all kept).

    Raises:
        RuntimeError: the lowering no longer says which arguments it kept (a JAX upgrade
            moved ``_lowering.compile_args['kept_var_idx']``): silently taking every
            argument as kept would misalign parameters.
    """
    lowering = getattr(lowered, "_lowering", None)
    compile_args = getattr(lowering, "compile_args", None)
    if compile_args is None or "kept_var_idx" not in compile_args:
        raise RuntimeError("kept_arg_indices: expected the lowering's compile_args to hold "
                           "'kept_var_idx', found "
                           + ("no compile_args" if compile_args is None
                              else f"keys {sorted(compile_args)[:8]}"))
    kept = compile_args["kept_var_idx"]
    return None if kept is None else tuple(sorted(kept))


CUSTOM_PARTITIONING = "custom_partitioning"


def custom_partitioning_bodies(closed: Any) -> list[tuple[Any, list, list, str]]:
    """The per-shard bodies of the ``custom_partitioning`` equations of a traced function
    (``ClosedJaxpr``) and of every jaxpr it holds, in program order: ``(fn,
    argument ShapeDtypeStructs, result shapes, key)`` each, ``fn`` the body as a function of
    its arguments and ``key`` its text (the calls of repeated layers share one body).
    Reads the equation's ``call`` parameter (a ``ClosedJaxpr``)."""
    import jax

    jcore = _jcore()
    found: list = []

    def walk(j: Any) -> None:
        j = j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j
        for eqn in j.eqns:
            if eqn.primitive.name == CUSTOM_PARTITIONING:
                body = eqn.params["call"]
                ins = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                       for v in body.jaxpr.invars]
                outs = [tuple(v.aval.shape) for v in body.jaxpr.outvars]
                found.append((jcore.jaxpr_as_fun(body), ins, outs, str(body)))
                continue
            if eqn.primitive.name == "call_hi_primitive":     # remat3 / custom_vjp3
                inner = hi_body(eqn)
                if inner is not None:
                    walk(inner[0])
                continue
            for v in eqn.params.values():
                for x in (v if isinstance(v, (list, tuple)) else (v,)):
                    if isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                        walk(x)
    walk(closed)
    return found


# ------------------------------------------------------------------------------ processes
def backends_initialized() -> bool:
    """Whether JAX has created its backends in this process (``jax.devices()``, an array or
    a computation has happened): after that, ``jax.distributed.initialize`` can no longer
    make this process part of a multi-process job."""
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def _kv_client() -> Any:
    client = distributed_kv_client()
    if client is None:
        raise RuntimeError("the jax.distributed key-value store: expected a joined job "
                           "(jax.distributed.initialize), found none")
    return client


def kv_set(key: str, value: str) -> None:
    """Write ``key`` in the ``jax.distributed`` job's key-value store (the coordination
    service every process of the job reaches). A key is written once.

    Raises:
        RuntimeError: no ``jax.distributed`` job; or the store's error (the key exists).
    """
    _kv_client().key_value_set(key, value)


def kv_get(key: str, timeout_s: float) -> str:
    """Wait up to ``timeout_s`` seconds for ``key`` in the job's key-value store and return
    its value.

    Raises:
        TimeoutError: no process wrote ``key`` in time.
        RuntimeError: no ``jax.distributed`` job.
    """
    client = _kv_client()
    try:
        return client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
    except Exception as e:   # jax's runtime error (DEADLINE_EXCEEDED), not a public type
        if "DEADLINE_EXCEEDED" in str(e) or "imed out" in str(e):
            raise TimeoutError(f"key {key!r}: not written within {timeout_s:g} s") from e
        raise


# ------------------------------------------------------------------------------ weak types
def with_weak_type(x: Any, weak: bool) -> Any:
    """The jax array ``x`` weakly typed (``weak``) or not, its dtype and value unchanged:
    JAX has no public way to make a weakly typed array of a given value (a Python number
    does it for 0-d values of the default dtypes only)."""
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(x, x.dtype, weak_type=weak)


# ------------------------------------------------------------------------------ placement
def uncommitted_view(x: Any) -> Any:
    """The replicated jax array ``x`` (e.g. 0-d) as an *uncommitted* array on the first
    device holding it, sharing that device's buffer (no copy). An uncommitted array is what
    ``jax.jit`` returns for host inputs: a later computation moves it to the devices of the
    committed arrays it meets (or to the default device) instead of refusing them as
    "incompatible devices". JAX makes uncommitted arrays of host values only
    (``jax.device_put`` of a device array commits it)."""
    from jax._src import array

    shard = x.addressable_shards[0].data
    return array.ArrayImpl(shard.aval, shard.sharding, [shard], committed=False)


# ------------------------------------------------------------------------ jax.distributed


def distributed_kv_client() -> Any:
    """The key-value store client of this process's ``jax.distributed`` job (None when
    ``jax.distributed.initialize`` was not called): ``key_value_set(key, value)``,
    ``blocking_key_value_get(key, timeout_ms)``, ``key_value_delete(key)``. Used by
    ``rhino.runtime.transfer.jax_transfer`` to exchange transfer-server addresses and announce
    values."""
    from jax._src import distributed
    return distributed.global_state.client
