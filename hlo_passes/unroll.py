"""Scans over layers unrolled: the step's jaxpr with every ``lax.scan`` of at most
``UNROLL_LIMIT`` iterations written out, iteration by iteration.

A scan lowers to an XLA while loop, which the planner cannot see into: everything the loop
touches (the stacked weights, their gradients and optimizer state) would stay replicated.
Written out, each iteration's equations are planned like those of a step written with a
Python loop, and the stacked arrays are read a slice per iteration (a scan that reads an
array an earlier scan read, at an index tied to its carry, so that XLA reads the slice
when the iteration starts: ``_index_after``) and rebuilt by stacking::

    scan(body, carry, xs) ──► for i in order: carry, y_i = body(carry, xs[i])
                              ys = stack(y_0 .. y_{L-1})

It computes what the scan computes (the same equations, in the same order per iteration);
XLA folds the slices of a stack back into its pieces. Every equation keeps its source line
and name stack (``_jax_private.eqn_context``), so gradient ops still look like gradient ops
and errors name the user's line. Longer scans (a loop over time steps, say) stay loops.
``trace`` is the one way rhino traces a step: the planned program, the microbatch programs
of a pipeline and the programs a Ray actor rebuilds all unroll alike.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from rhino._jax_private import eqn_context, jaxpr_env, trace_without_name_stack

# Scans of more iterations stay loops (planned as one opaque op, replicated).
UNROLL_LIMIT = 128
# The name scope of the equations that compute an iteration's index (``_index_after``).
INDEX_SCOPE = "rhino_scan_index"
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr"}
_REMAT = frozenset({"remat", "checkpoint", "remat2"})


def trace(fn: Callable, *args: Any, return_shape: bool = False) -> Any:
    """``jax.make_jaxpr(fn)(*args)`` with its scans unrolled (see the module docstring)."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    if _has_scan(closed.jaxpr):
        leaves = jax.tree_util.tree_leaves(args)
        closed = jax.make_jaxpr(lambda *flat: eval_unrolled(closed.jaxpr, closed.consts,
                                                            flat))(*leaves)
    return (closed, shape) if return_shape else closed


def unrolled_function(fn: Callable, *args: Any) -> Callable | None:
    """``fn`` with its scans unrolled, as a function of the same pytree arguments (for
    lowering it whole, e.g. ``rhino.ingest``); None when ``fn`` has no scan to unroll."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    if not _has_scan(closed.jaxpr):
        return None
    unrolled = trace(fn, *args)
    out_tree = jax.tree_util.tree_structure(shape)

    @functools.wraps(fn)
    def run(*a: Any) -> Any:
        flat = jax.tree_util.tree_leaves(a)
        outs = jax.core.eval_jaxpr(unrolled.jaxpr, unrolled.consts, *flat)
        return jax.tree_util.tree_unflatten(out_tree, outs)
    return run


def _unrollable(eqn: Any) -> bool:
    return eqn.primitive.name == "scan" and 0 < eqn.params["length"] <= UNROLL_LIMIT


def _body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    name = eqn.primitive.name
    key = "jaxpr" if name in _REMAT else _CALLS.get(name)
    body = eqn.params.get(key) if key else None
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, body.consts
    if isinstance(body, jcore.Jaxpr):
        return body, ()
    return None


def _has_scan(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if _unrollable(eqn):
            return True
        body = _body(eqn)
        if body is not None and _has_scan(body[0]):
            return True
    return False


class _Stack:
    """A scan's stacked result kept as its per-iteration pieces until something other
    than another unrolled scan's per-iteration slicing reads it (the residuals a forward
    scan hands to the backward scan are never stacked and sliced again: stacking them
    would hold every residual twice at the end of the forward pass)."""

    def __init__(self, pieces: list[Any]):
        self.pieces, self._whole = pieces, None

    def whole(self) -> Any:
        if self._whole is None:
            self._whole = jnp.stack(self.pieces)
        return self._whole


def _whole(x: Any) -> Any:
    return x.whole() if isinstance(x, _Stack) else x


def eval_unrolled(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate ``jaxpr`` binding every equation as it is, except scans (unrolled) and
    calls or checkpoints holding one (their bodies evaluated the same way; a checkpoint is
    bound again around its unrolled body, so that XLA still recomputes it)."""
    return [_whole(x) for x in _eval(jaxpr, consts, args, set())]


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], sliced: set) -> list[Any]:
    env, read = jaxpr_env(jaxpr, consts, args)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        body = _body(eqn)
        with eqn_context(eqn):
            if _unrollable(eqn):
                outs = _unroll_scan(eqn, invals, sliced)
            elif body is not None and _has_scan(body[0]) and eqn.primitive.name not in _REMAT:
                outs = _eval(body[0], body[1], invals, sliced)
            else:
                outs = _bind_whole(eqn, body, [_whole(x) for x in invals])
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _bind_whole(eqn: Any, body: Any, invals: list) -> list[Any]:
    """An equation bound as it is (a checkpoint around a scan: around its unrolled body)."""
    if body is not None and eqn.primitive.name in _REMAT and _has_scan(body[0]):
        inner, cs = trace_without_name_stack(
            lambda *a: eval_unrolled(body[0], body[1], a), invals)
        outs = eqn.primitive.bind(*cs, *invals, **dict(eqn.params, jaxpr=inner))
    else:
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _unroll_scan(eqn: Any, invals: list, sliced: set) -> list[Any]:
    p = eqn.params
    nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
    body = p["jaxpr"]
    consts = [_whole(x) for x in invals[:nc]]
    carry, xs = [_whole(x) for x in invals[nc:nc + nk]], invals[nc + nk:]
    ys: list[list[Any] | None] = [None] * length
    again = [not isinstance(x, _Stack) and id(x) in sliced for x in xs]
    sliced.update(id(x) for x in xs if not isinstance(x, _Stack))
    for i in (reversed(range(length)) if p["reverse"] else range(length)):
        at = _index_after(i, length, carry) if any(again) else i
        x_i = [x.pieces[i] if isinstance(x, _Stack)
               else jax.lax.dynamic_index_in_dim(x, at, 0, keepdims=False) if tie
               else jax.lax.index_in_dim(x, i, 0, keepdims=False)
               for x, tie in zip(xs, again)]
        outs = _eval(body.jaxpr, body.consts, [*consts, *carry, *x_i], sliced)
        carry, ys[i] = [_whole(x) for x in outs[:nk]], [_whole(x) for x in outs[nk:]]
    return carry + [_Stack([ys[i][k] for i in range(length)])
                    for k in range(len(eqn.outvars) - nk)]


def _index_after(i: int, length: int, carry: list[Any]) -> Any:
    """Index ``i``, computed from the carry: where a scan reads a stacked array that an
    earlier unrolled scan read too (the backward scan reading the forward's weights).

    With constant indices XLA sees the backward scan's slice of a stacked weight as the
    forward scan's (the same slice of the same array), keeps one copy and holds it from
    the forward pass to the backward one, so that the stacked weights are held twice at the
    peak (whole, and as per-layer copies): on GPT 3 x 256 the compiled peak was 8% over the
    unrolled step's, with remat 22%. An optimization barrier does not help: XLA on CPU
    drops it before CSE. An index that depends on the carry is never folded, so each
    backward iteration reads its own slice once the carry is there, and the slice lives
    only as long as the iteration needs it. The first scan to read an array keeps constant
    indices (its slices die within it).

    The index is ``min(i, length - 1 + (s != s))`` with ``s`` the largest float carry's
    maximum: ``i`` whatever ``s`` is (NaN included). A maximum rather than one element:
    it costs a 4-byte all-reduce per iteration where the carry is split (the planner
    prices it), where reading one element of a split carry would gather it whole. Without
    a float carry the index stays the constant ``i``. The equations are named under
    ``INDEX_SCOPE``, so the batch-coupling check does not take the maximum for a
    statistic of the batch (the index is ``i`` on any batch).
    """
    leaves = [c for c in carry if c.size and jnp.issubdtype(c.dtype, jnp.floating)]
    if not leaves:
        return i
    with jax.named_scope(INDEX_SCOPE):
        s = jnp.max(max(leaves, key=lambda c: c.size))
        return jnp.minimum(jnp.int32(i), jnp.int32(length - 1) + (s != s).astype(jnp.int32))
