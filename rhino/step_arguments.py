"""The arguments a ``ParallelStep`` is called with: the signature it caches programs by, the
abstract arguments it traces at, and ``ArgumentError`` for arguments the step cannot take.

The signature is what ``jax.jit`` keys on: the pytree structure and, per leaf, shape, dtype
and weak type (numpy arrays and Python scalars canonicalised as jax would; a Python float
stays weakly typed, so bf16 weights minus a Python-float learning rate stay bf16).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import numpy as np

from rhino.errors import ArgumentError
from rhino.hlo_passes.ingest import arg_names


def _leaf_key(x: Any) -> tuple:
    if isinstance(x, jax.Array):          # the hot path: no abstraction needed
        return x.shape, x.dtype, getattr(x, "weak_type", False)   # key arrays have none
    if getattr(x, "rhino_remote", False):     # a result kept on Ray actors
        return tuple(x.shape), x.dtype, x.weak_type
    if getattr(x, "rhino_host_data", False):  # a batch leaf the hosts make (host_data)
        return x.shape, x.dtype, False
    aval = jax.typeof(x)
    return aval.shape, aval.dtype, aval.weak_type


def signature(fn: Callable, args: tuple) -> tuple:
    """``(treedef, ((shape, dtype, weak_type), ...))`` of ``args``.

    Raises:
        ArgumentError: a leaf that is no array, named by its path.
    """
    flat, tree = jax.tree_util.tree_flatten(args)
    try:
        return tree, tuple(_leaf_key(x) for x in flat)
    except TypeError:
        raise _argument_error(fn, args) from None


def abstract_args(key: tuple) -> Any:
    """The arguments of a signature as ``ShapeDtypeStruct``s (weak types kept)."""
    tree, leaves = key
    return jax.tree_util.tree_unflatten(
        tree, [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)
               for shape, dtype, weak in leaves])


def check_arity(fn: Callable, args: tuple) -> None:
    """Arguments that the step's signature cannot bind: ArgumentError before tracing."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        raise ArgumentError(f"{_signature_text(fn)}: expected arguments its signature binds, "
                            f"found {len(args)} positional: {e}") from None


def _signature_text(fn: Callable) -> str:
    name = getattr(fn, "__name__", "step")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return f"{name}(...)"
    star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return f"{name}({', '.join(star.get(p.kind, '') + p.name for p in params)})"


def _argument_error(fn: Callable, args: tuple) -> ArgumentError:
    """The first leaf of the arguments that is no array (a string, an object ...)."""
    names = arg_names(fn, len(args))
    for i, arg in enumerate(args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            try:
                _leaf_key(leaf)
            except TypeError:
                where = names[i] + jax.tree_util.keystr(path)
                text = repr(leaf)
                text = text if len(text) <= 60 else text[:57] + "..."
                return ArgumentError(
                    f"{_signature_text(fn)}: argument {where}: expected an array (jax or "
                    f"numpy) or a Python number in every leaf, found {type(leaf).__name__} "
                    f"{text}")
    return ArgumentError(f"{_signature_text(fn)}: expected arrays or Python numbers in "
                         f"every leaf of the arguments")


def leaf_types(args: tuple) -> dict[str, str]:
    """``path -> dtype[shape]`` of every array leaf of the step's arguments."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            out[f"args{jax.tree_util.keystr(path)}"] = f"{x.dtype}{list(np.shape(x))}"
    return out


def type_changes(old: dict[str, str], new: dict[str, str], most: int = 3) -> str:
    """The leaves whose type changed from ``old`` to ``new`` (the first ``most``)."""
    diff = [f"{k} {old.get(k, 'absent')} -> {new.get(k, 'absent')}"
            for k in list(old) + [k for k in new if k not in old] if old.get(k) != new.get(k)]
    if not diff:
        return "the same array leaves (another structure or static value)"
    return "; ".join(diff[:most]) + (f"; and {len(diff) - most} more" if len(diff) > most
                                     else "")
