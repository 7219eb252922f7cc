"""Every use of JAX/XLA private API in rhino lives here, so a JAX upgrade breaks one place.

``tests/test_jax_private.py`` exercises each function on the installed JAX.
"""

from __future__ import annotations

from typing import Any


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
    """Flat indices of the arguments a jitted function's lowering kept (None: all kept)."""
    lowering = getattr(lowered, "_lowering", None)
    compile_args = getattr(lowering, "compile_args", None) or {}
    kept = compile_args.get("kept_var_idx")
    return None if kept is None else tuple(sorted(kept))


def eqn_context(eqn: Any):
    """The context ``jax.core.eval_jaxpr`` binds an equation in: its source traceback and
    name stack (so re-evaluated ops keep the user's file:line), and its extra context."""
    import contextlib

    from jax._src import source_info_util

    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack = contextlib.ExitStack()
    stack.enter_context(source_info_util.user_context(eqn.source_info.traceback,
                                                      name_stack=name_stack))
    ctx = getattr(eqn, "ctx", None)
    if ctx is not None and getattr(ctx, "manager", None) is not None:
        stack.enter_context(ctx.manager)
    return stack


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


def jaxpr_env(jaxpr: Any, consts: Any, args: Any) -> tuple[dict, Any]:
    """The environment an interpreter of ``jaxpr`` starts from (constants and arguments
    bound) and its ``read`` (a literal's value, else the variable's)."""
    from jax.extend import core as jcore

    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]
    return env, read
