"""Batch coupling: where a step's per-example computation reads statistics of the whole batch.

A pipelined step runs compute-gradients once per microbatch and sums (or averages) what
leaves it. That is the step's meaning exactly when every example's contribution depends on
that example alone. A *batch statistic* — a value reduced over the batch (a BatchNorm mean,
a batch-wide max) — breaks it when it flows back into per-example values, into a branch
predicate, or into state the step returns: each microbatch would see its own statistic.

``find_batch_coupling`` follows the batch axis through a flattened step (the microbatch
trace, ``stage_programs.FlatProgram``), equation by equation, in forward and backward only
(apply-gradients reads the accumulated sums, after the batch is whole again). Each value is
*free* (no batch argument reaches it), *per-example* (it carries the batch along one axis),
or a *statistic* (it depends on the batch but lost the batch axis to a reduction). Reported
(with the equation and the user's source line, and where the statistic was made):

- a statistic combined with per-example values (``x - mean``);
- a ``cond``/``switch``/``while`` whose predicate or index depends on the batch;
- a cumulative op or sort along the batch axis;
- state the step returns (updated by compute-gradients) that depends on the batch, such
  as running statistics (``carried`` refs).

Statistics that only reach the step's results or apply-gradients (the loss mean, weight
gradients) are what microbatching sums: not reported. Other primitives (elementwise ops,
gathers, scatters, convolutions) keep the batch where their result has the per-example
input's batch dimension, and make a statistic where it is gone (a scatter into a weight
gradient, say). A dimension that merely has the microbatch's size is taken for the batch:
the analysis errs towards per-example values there. An unrolled scan's iteration index
reads a maximum of the carry (``unroll._index_after``) but is the same on any batch: those
equations are skipped.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from rhino.hlo_passes.stage_programs import flatten
    >>> def bn(x):
    ...     return jnp.mean((x - x.mean(0)) ** 2)
    >>> flat = flatten(jax.make_jaxpr(bn)(jnp.ones((8, 4))))
    >>> [c.what for c in find_batch_coupling(flat, batch_refs=(0,))]
    ['a statistic over the batch combined with per-example values']
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Collection, Sequence

from rhino.hlo_passes.unroll import INDEX_SCOPE
from rhino.jaxpr import primitives as prims
from rhino.jaxpr.private import eqn_source, is_literal, name_stack_text
from rhino.vocabulary import Role

_REDUCE = set(prims.REDUCTIONS) | prims.ARG_REDUCTIONS
_BRANCH = {prims.COND, prims.WHILE}


@dataclasses.dataclass(frozen=True)
class Statistic:
    """A value that lost the batch axis: where it was reduced."""

    primitive: str
    source: str | None


@dataclasses.dataclass(frozen=True)
class Coupling:
    """One place where the step's meaning depends on the whole batch.

    Attributes:
        what: the kind of coupling (see the module docstring).
        primitive / source / path: the equation that couples (primitive, user file:line,
            equation path).
        statistic: where the batch statistic it reads was made (primitive and line).
    """

    what: str
    primitive: str
    source: str | None
    path: tuple[int, ...]
    statistic: Statistic | None = None

    def describe(self) -> str:
        at = f"{self.primitive} at {self.source or 'an unknown line'}"
        made = (f" (the statistic is a {self.statistic.primitive} over the batch at "
                f"{self.statistic.source or 'an unknown line'})" if self.statistic else "")
        return f"{self.what}: {at}{made}"


def find_batch_coupling(flat: Any, batch_refs: Sequence[int],
                        roles: Sequence[Role] | None = None,
                        carried: Collection[int] = ()) -> list[Coupling]:
    """The couplings of a flattened step (see the module docstring).

    Args:
        flat: the step (``stage_programs.flatten``), traced at any batch size.
        batch_refs: flat arguments carrying the batch along axis 0.
        roles: per equation its role (``split_step``); apply-gradients equations are not
            examined. None: every equation.
        carried: result refs that are updated state (returned into an argument).
    """
    state: dict[int, Any] = {r: 0 for r in batch_refs}     # ref -> axis | Statistic
    found: list[Coupling] = []
    for i, fe in enumerate(flat.eqns):
        if roles is not None and roles[i] is Role.APPLY:
            continue
        ins = [state.get(x) if isinstance(x, int) else None for x in fe.ins]
        if all(v is None for v in ins) or _scan_index(fe.eqn):
            continue
        out, issue = _rule(fe.eqn, ins)
        if issue is not None:
            stat = next((v for v in ins if isinstance(v, Statistic)), None)
            found.append(Coupling(issue, fe.eqn.primitive.name, eqn_source(fe.eqn), fe.path,
                                  stat))
        for k, r in enumerate(fe.outs):
            if r is not None and out[k] is not None:
                v = out[k]
                state[r] = int(v) if isinstance(v, numbers.Integral) else v
    for r in carried:
        v = state.get(r)
        if v is not None:
            found.append(Coupling("state the step returns computed from the batch per "
                                  "microbatch (e.g. running statistics)", "result",
                                  None, (), v if isinstance(v, Statistic) else None))
    return found


def _scan_index(eqn: Any) -> bool:
    """An unrolled scan's iteration index, read from the carry only to order the
    iteration's slices (``unroll._index_after``): the same on any batch."""
    return INDEX_SCOPE in name_stack_text(eqn)


def _rule(eqn: Any, ins: list) -> tuple[list, str | None]:
    """(per output: axis | Statistic | None, the coupling found or None)."""
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    axes = [v for v in ins if isinstance(v, int)]
    stats = [v for v in ins if isinstance(v, Statistic)]
    made = Statistic(name, eqn_source(eqn))
    if name in _BRANCH and _predicate_depends(eqn, ins):
        return [stats[0] if stats else made] * n_out, \
            "a branch whose predicate or index depends on the batch"
    if name in _REDUCE:
        dims = prims.reduction_axes(eqn)
        if stats or not axes:
            return [stats[0] if stats else made] * n_out, None
        d = axes[0]
        if d in dims:
            return [made] * n_out, None
        return [d - sum(1 for x in dims if x < d)] * n_out, None
    if name in prims.CUMULATIVE or name == prims.SORT:
        d = eqn.params.get("axis", eqn.params.get("dimension"))
        if axes and d == axes[0]:
            return [made] * n_out, "a cumulative op or sort along the batch axis"
    if name == prims.DOT:
        return _dot(eqn, ins, made), None
    if name == prims.BROADCAST:
        v = ins[0]
        out = eqn.params["broadcast_dimensions"][v] if isinstance(v, int) else v
        return [out], None
    if name == prims.TRANSPOSE:
        v = ins[0]
        return [eqn.params["permutation"].index(v) if isinstance(v, int) else v], None
    if name in (prims.RESHAPE, prims.SQUEEZE):
        return [_reshaped(eqn, ins[0], made)], None
    # Everything else (elementwise ops, gathers, scatters, convolutions, ...): a result
    # keeps the batch where it has the per-example input's batch dimension.
    if stats and axes:
        return [axes[0]] * n_out, "a statistic over the batch combined with per-example values"
    if axes:
        k = next(j for j, v in enumerate(ins) if isinstance(v, int))
        size = eqn.invars[k].aval.shape[axes[0]]
        return [_keeps(tuple(v.aval.shape), axes[0], size, made) for v in eqn.outvars], None
    return [stats[0]] * n_out, None


def _keeps(shape: tuple, axis: int, size: int, made: Statistic) -> Any:
    """Where a result of ``shape`` holds a batch dimension of ``size`` that was ``axis`` of
    its per-example input (the same axis, else the only one of that size), or ``made``."""
    if axis < len(shape) and shape[axis] == size:
        return axis
    hits = [d for d, x in enumerate(shape) if x == size]
    return hits[0] if len(hits) == 1 else made


def _predicate_depends(eqn: Any, ins: list) -> bool:
    """Whether a ``cond``'s index or a ``while``'s loop condition reads the batch."""
    if eqn.primitive.name == prims.COND:
        return ins[0] is not None
    nc, nb, cj = prims.while_parts(eqn)
    feeds = ins[:nc] + ins[nc + nb:]
    dep = {v for v, x in zip(cj.invars, feeds) if x is not None}
    for e in cj.eqns:
        if any(v in dep for v in e.invars if not is_literal(v)):
            dep.update(e.outvars)
    return any(v in dep for v in cj.outvars if not is_literal(v))


def _dot(eqn: Any, ins: list, made: Statistic) -> list:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins[0], ins[1] if len(ins) > 1 else None
    stats = [v for v in (lhs, rhs) if isinstance(v, Statistic)]
    if stats:
        return [stats[0]]
    lr = len(eqn.invars[0].aval.shape)
    rr = len(eqn.invars[1].aval.shape)
    free_l = [d for d in range(lr) if d not in lc and d not in lb]
    free_r = [d for d in range(rr) if d not in rc and d not in rb]
    if isinstance(lhs, int):
        if lhs in lc:
            return [made]
        if lhs in lb:
            return [list(lb).index(lhs)]
        return [len(lb) + free_l.index(lhs)]
    if isinstance(rhs, int):
        if rhs in rc:
            return [made]
        if rhs in rb:
            return [list(rb).index(rhs)]
        return [len(lb) + len(free_l) + free_r.index(rhs)]
    return [None]


def _reshaped(eqn: Any, v: Any, made: Statistic) -> Any:
    if not isinstance(v, int):
        return v
    old = tuple(eqn.invars[0].aval.shape)
    new = tuple(eqn.outvars[0].aval.shape)
    if v == 0 and new and old and (new[0] % old[0] == 0 or old[0] % max(new[0], 1) == 0):
        return 0                     # the batch stays the outermost factor
    before = 1
    for x in old[:v]:
        before *= x
    acc = 1
    for k, x in enumerate(new):      # a dimension whose outer size matches: same axis
        if acc == before and x == old[v]:
            return k
        acc *= x
    return made
