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
XLA folds the slices of a stack back into its pieces. A ``cond`` whose branches are cheap
and pure (``primitives.light_cond``: an update applied or skipped) is written as every
branch and a select, which computes the same: its values are then planned (and cut into
microbatches) like the rest instead of staying inside an opaque conditional. Every equation keeps its source line
and name stack (``rhino.jaxpr.private.eqn_context``), so gradient ops still look like gradient ops
and errors name the user's line. Longer scans (a loop over time steps, say) stay loops.
A ``while`` loop that counts from a literal to a literal bound by a literal step
(``primitives.while_trips``: a ``fori_loop`` written with a ``while_loop``, or gradient
accumulation over the batch's chunks) is written out the same way, its body that many
times.
``trace`` is the one way rhino traces a step: the planned program, the microbatch programs
of a pipeline and the programs a Ray actor rebuilds all unroll alike.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from rhino.jaxpr import primitives as prims
from rhino.jaxpr import private
from rhino.jaxpr.interpret import Interpreter, any_equation

# Scans of more iterations stay loops (planned as one opaque op, replicated).
UNROLL_LIMIT = 128
# The name scope of the equations that compute an iteration's index (``_index_after``).
INDEX_SCOPE = "rhino_scan_index"


def trace(fn: Callable, *args: Any, return_shape: bool = False) -> Any:
    """``jax.make_jaxpr(fn)(*args)`` with its scans unrolled and its cheap conditionals
    written as both branches and a select (see the module docstring)."""
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
        return None     # nothing to write out
    unrolled = trace(fn, *args)
    out_tree = jax.tree_util.tree_structure(shape)

    @functools.wraps(fn)
    def run(*a: Any) -> Any:
        flat = jax.tree_util.tree_leaves(a)
        outs = private.eval_jaxpr(unrolled.jaxpr, unrolled.consts, *flat)
        return jax.tree_util.tree_unflatten(out_tree, outs)
    return run


def _unrollable(eqn: Any) -> bool:
    info = prims.scan_info(eqn)
    if info is not None:
        return 0 < info[2] <= UNROLL_LIMIT
    trips = prims.while_trips(eqn)
    return trips is not None and 0 < trips <= UNROLL_LIMIT


def _has_scan(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` has something to write out: a scan to unroll, or a cheap ``cond``
    (``primitives.light_cond``) to evaluate as a select."""
    return any_equation(jaxpr, lambda e: _unrollable(e) or prims.light_cond(e))


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
    return [_whole(x) for x in _Unroller().run(jaxpr, consts, args)]


class _Unroller(Interpreter):
    """Scans written out, cheap conditionals as both branches and a select; every other
    equation bound as it is (a call or checkpoint whose body holds neither too).
    ``sliced``: ids of the stacked arrays an unrolled scan read."""

    select_light_conds = True

    def __init__(self):
        self.sliced: set[int] = set()

    def equation(self, eqn, path, invals):
        body = prims.call_body(eqn)
        if body is not None and not _has_scan(body[0]):
            return self.leaf(eqn, path, invals)      # kept as it is: nothing to unroll
        return super().equation(eqn, path, invals)

    def leaf(self, eqn, path, invals):
        return super().leaf(eqn, path, [_whole(x) for x in invals])

    def remat(self, eqn, path, body, invals):
        return super().remat(eqn, path, body, [_whole(x) for x in invals])

    def cond_as_select(self, eqn, path, invals):
        # Its branches run on a plain ``Interpreter``: a scan's stacked result (the
        # gradients of stacked layers, read by ``optax.MultiSteps``' cond) enters whole.
        return super().cond_as_select(eqn, path, [_whole(x) for x in invals])

    def remat_body(self, eqn, path, body, args):
        return [_whole(x) for x in self.run(body[0], body[1], args, path)]

    def unrolls(self, eqn):
        return _unrollable(eqn)

    def scan(self, eqn, path, invals):
        if prims.name(eqn) == prims.WHILE:          # a counted loop: its body, n times
            nc, nb, _ = prims.while_parts(eqn)
            body, body_consts = prims.while_body(eqn)
            consts = [_whole(x) for x in invals[nc:nc + nb]]
            carry = [_whole(x) for x in invals[nc + nb:]]
            for _ in range(prims.while_trips(eqn)):
                carry = [_whole(x) for x in self.run(body, body_consts, [*consts, *carry])]
            return carry
        nc, nk, length, reverse, (body, body_consts) = prims.scan_info(eqn)
        consts = [_whole(x) for x in invals[:nc]]
        carry, xs = [_whole(x) for x in invals[nc:nc + nk]], invals[nc + nk:]
        ys: list[list[Any] | None] = [None] * length
        again = [not isinstance(x, _Stack) and id(x) in self.sliced for x in xs]
        self.sliced.update(id(x) for x in xs if not isinstance(x, _Stack))
        for i in (reversed(range(length)) if reverse else range(length)):
            at = _index_after(i, length, carry) if any(again) else i
            x_i = [x.pieces[i] if isinstance(x, _Stack)
                   else jax.lax.dynamic_index_in_dim(x, at, 0, keepdims=False) if tie
                   else jax.lax.index_in_dim(x, i, 0, keepdims=False)
                   for x, tie in zip(xs, again)]
            outs = self.run(body, body_consts, [*consts, *carry, *x_i])
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
