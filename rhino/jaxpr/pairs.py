"""Facts about the values of a step that decide whether pairs of the batch's examples can be
computed per microbatch (``rhino.jaxpr.microbatch``, under ``per_microbatch_statistics``).

A value over pairs (``z @ z.T``) is computed by each microbatch as its diagonal block: its
examples against its own examples, what the step computes on that microbatch alone. That
holds only where what meets the block reads it consistently; ``PairFacts`` follows, in
program order, what the pass needs to tell:

====================  ==================================================================
constant along        dimensions a value is constant along (made by a broadcast): a
                      per-example value read against pairs along such a dimension is
                      its block there too
even                  constants whose diagonal blocks are all alike: comparisons of
                      iotas along two dimensions with the same offset (``eye``, ``tril``)
                      and what elementwise ops make of them with scalars and constants;
                      an iota alone, or an offset between the two (``n / 2``), is
                      positions of the whole batch
block sums            sums over a dimension of pairs (within the block): scaled by a
                      constant, a count of the batch or a statistic they are a mean over
                      the whole batch's pairs (refused); summed further and used as a
                      statistic, a microbatch's estimate would count its pairs ``m``
                      times (refused)
====================  ==================================================================

Example:
    >>> import jax, jax.numpy as jnp
    >>> from rhino.jaxpr.interpret import flatten
    >>> flat = flatten(jax.make_jaxpr(lambda: jnp.eye(4))())
    >>> facts = PairFacts(flat.avals)
    >>> for fe in flat.eqns:
    ...     facts.update(fe, [()] * len(fe.ins), [tuple(fe.eqn.outvars[0].aval.shape)],
    ...                  False, True)
    >>> sorted(facts.steady(flat.outs[0]))           # eye(n): every block is eye(n / m)
    [0, 1]
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import numpy as np

from rhino.jaxpr import primitives as prims
from rhino.jaxpr.interpret import Lit

# What an equation over pairs of the batch's examples may be: ops that treat the pairs'
# positions alike (no index values, no windows, no random draws), and sums, maxima and
# minima within the microbatch's block.
PAIR_OPS = (prims.ELEMENTWISE | {prims.BROADCAST, prims.TRANSPOSE, prims.SQUEEZE,
                                 prims.RESHAPE, prims.DOT, prims.CONVERT}
            | {"reduce_sum", "reduce_max", "reduce_min"})

# One-operand equations a broadcast's constancy and a sum over pairs pass through as they
# are (reshapes and transposes carry a sum over pairs, not dimensions' constancy).
_CARRY = prims.IDENTITY_LIKE | {prims.CONVERT, "neg", "copy", "copy_p", prims.RESHAPE,
                                prims.TRANSPOSE, prims.SQUEEZE, prims.BROADCAST}
_COMPARE = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})


class PairFacts:
    """What ``microbatch.analyze`` knows of each value for pairs (see the module
    docstring), updated equation by equation (``update``)."""

    def __init__(self, avals: Mapping[int, Any]):
        self.avals = avals
        self.spread: dict[int, frozenset[int]] = {}   # ref -> dimensions constant along
        self.block_sums: set[int] = set()   # sums over a dimension of pairs (reshaped)
        self.pair_totals: set[int] = set()  # those, also summed further
        self.scalars: set[int] = set()      # rank 0, or broadcasts of such
        self.iotas: dict[int, tuple[int, Any]] = {}   # constant iota -> (dim, offset)
        self.even: set[int] = set()         # constants alike on every diagonal block

    def spread_of(self, x: Any) -> frozenset[int]:
        return self.spread.get(x, frozenset()) if isinstance(x, int) else frozenset()

    def steady(self, x: Any) -> frozenset[int]:
        """Dimensions along which ``x``'s diagonal blocks are what a microbatch alone
        computes: those it is constant along, or all of an even constant."""
        if isinstance(x, int) and x in self.even:
            return frozenset(range(len(self.avals[x].shape)))
        return self.spread_of(x)

    def summed_pairs(self, refs: Collection[Any]) -> bool:
        """Whether one of ``refs`` is a sum over pairs (also summed further)."""
        return any(isinstance(x, int) and x in self.pair_totals for x in refs)

    def mean_over_pairs(self, fe: Any, dep_state: Collection[int]) -> bool:
        """Whether ``fe`` scales a sum over a dimension of pairs by a constant or a count
        of the batch (a scalar computed without the training state; a learned scale is
        one of the state): ``sum(sim, 1) / n`` divides by the whole batch's count, a
        microbatch holds ``n / m`` of the pairs."""
        if prims.name(fe.eqn) not in (prims.MUL, prims.DIV):
            return False
        sums = [x for x in fe.ins if isinstance(x, int) and x in self.block_sums]
        return bool(sums) and any(
            (isinstance(x, Lit) and np.ndim(x.value) == 0) or
            (isinstance(x, int) and x in self.scalars and x not in dep_state)
            for x in fe.ins if x not in sums)

    def update(self, fe: Any, ins_shapes: list[tuple], outs_shapes: list[tuple],
               block_sum: bool, constant: bool) -> None:
        """Take in equation ``fe``: ``block_sum``, it sums over a dimension of pairs;
        ``constant``, it reads neither the batch nor the training state."""
        name = prims.name(fe.eqn)
        outs = [r for r in fe.outs if r is not None]
        if not outs:
            return
        first = fe.ins[0] if fe.ins else None
        if block_sum or (name in _CARRY and isinstance(first, int) and
                         first in self.block_sums):
            self.block_sums.update(outs)
        if any(isinstance(x, int) and (x in self.block_sums or x in self.pair_totals)
               for x in fe.ins) and (name in _CARRY or name == "reduce_sum"):
            self.pair_totals.update(outs)
        self.pair_totals.update(r for r in outs if r in self.block_sums)
        if name == prims.BROADCAST:
            old = ins_shapes[0]
            dims = fe.eqn.params["broadcast_dimensions"]
            new = {d for d in range(len(outs_shapes[0])) if d not in dims}
            new |= {dims[k] for k, n in enumerate(old) if n == 1 and
                    outs_shapes[0][dims[k]] != 1}
            self.spread[outs[0]] = frozenset(new) | frozenset(
                dims[d] for d in self.spread_of(first))
            if isinstance(first, Lit) or first in self.scalars or len(old) == 0:
                self.scalars.update(outs)
        elif name in _CARRY - {prims.RESHAPE, prims.TRANSPOSE, prims.SQUEEZE} and \
                len(fe.ins) == 1:
            self.spread[outs[0]] = self.spread_of(first)
            if isinstance(first, int) and first in self.scalars:
                self.scalars.update(outs)
        elif (name in prims.ELEMENTWISE or name == prims.SELECT_N) and len(outs) == 1 and \
                len(fe.ins) > 1:
            # Constant along a dimension where every operand is (or has size 1, or is a
            # scalar): a mask of a broadcast comparison, a select between broadcasts.
            shape = outs_shapes[0]
            along = set(range(len(shape)))
            for x, xs in zip(fe.ins, ins_shapes):
                if len(xs) == 0:
                    continue
                along &= set(self.spread_of(x)) | {d for d, n in enumerate(xs)
                                                   if n == 1 and shape[d] != 1}
            if along:
                self.spread[outs[0]] = frozenset(along)
        self.scalars.update(r for r in outs if not self.avals[r].shape)
        if constant:
            self._even(fe, outs[0])

    def _even(self, fe: Any, r: int) -> None:
        """Track iotas (with their offsets) and even constants (``r``: ``fe``'s result)."""
        name = prims.name(fe.eqn)
        ins, iotas = fe.ins, self.iotas
        if name == prims.IOTA:
            iotas[r] = (int(fe.eqn.params["dimension"]), 0)
            return
        if name in (prims.BROADCAST, prims.CONVERT) and isinstance(ins[0], int) and \
                ins[0] in iotas:
            d, off = iotas[ins[0]]
            if name == prims.BROADCAST:
                d = fe.eqn.params["broadcast_dimensions"][d]
            iotas[r] = (d, off)
            return
        if name in ("add", "sub") and len(ins) == 2:
            a, b = ins
            if isinstance(a, int) and a in iotas and isinstance(b, Lit) and \
                    np.ndim(b.value) == 0:
                d, off = iotas[a]
                sign = 1 if name == "add" else -1
                iotas[r] = (d, off + sign * np.asarray(b.value).item())
                return
            if name == "add" and isinstance(b, int) and b in iotas and \
                    isinstance(a, Lit) and np.ndim(a.value) == 0:
                d, off = iotas[b]
                iotas[r] = (d, off + np.asarray(a.value).item())
                return
        if name in _COMPARE and len(ins) == 2 and all(isinstance(x, int) and x in iotas
                                                     for x in ins):
            (da, oa), (db, ob) = iotas[ins[0]], iotas[ins[1]]
            if da != db and oa == ob:
                self.even.add(r)
            return
        if name in prims.ELEMENTWISE or name in (prims.BROADCAST, prims.TRANSPOSE) or \
                name in prims.IDENTITY_LIKE:
            def alike(k: int, x: Any) -> bool:      # even, a scalar, or constant
                if isinstance(x, Lit) or x in self.even:
                    return True
                return all(n == 1 or d in self.spread_of(x)
                           for d, n in enumerate(fe.eqn.invars[k].aval.shape))

            if any(isinstance(x, int) and x in self.even for x in ins) and all(
                    alike(k, x) for k, x in enumerate(ins)):
                self.even.add(r)


def batch_size_constants(whole: Any, micro: Any, layout: Any, backward: Collection[int] = ()
                         ) -> list[tuple[Any, str]]:
    """Where the values over pairs meet a constant that depends on the batch's size.

    Each microbatch computes its block of pairs as the step computes them on that
    microbatch alone, but every constant of the step was fixed at the whole batch: a
    ``1 / n`` that scales a value over pairs (or a per-example value made from one, before
    it is reduced over the batch), or a whole constant built from one, would count the
    whole batch's pairs where the block holds only its own. ``whole`` and ``micro`` are
    the step's flat programs (``interpret.flatten``) traced at the whole batch and at one
    microbatch; ``layout`` the whole-batch ``MicrobatchLayout``. The equations the pairs
    reach are compared literal by literal (and the whole values they read, with the
    equations computing those); a sum over the batch ends the reach, as a partial value's
    per-microbatch estimate is scaled by its own rule. ``backward``: equations of the
    backward pass and after (by index), not compared: they are linear in the loss's
    cotangent, whose ``1 / n`` (a mean's) the sum of the microbatches' gradients
    compensates, and they repeat the forward's other constants, which are compared.

    Returns:
        ``(equation of whole, why)`` per difference, in program order; one entry if the
        two traces are not the same equations (nothing could be compared).
    """
    import numpy as np

    from rhino.jaxpr import primitives as prims
    from rhino.jaxpr.interpret import Lit

    lay = layout.layout
    if len(whole.eqns) != len(micro.eqns) or any(
            prims.name(a.eqn) != prims.name(b.eqn) for a, b in zip(whole.eqns, micro.eqns)):
        first = next((a for a, b in zip(whole.eqns, micro.eqns)
                      if prims.name(a.eqn) != prims.name(b.eqn)), whole.eqns[-1])
        return [(first, "the step traces to other equations at the microbatch's size, so "
                        "the constants the pairs meet cannot be compared")]
    reach = {r for r, x in lay.items() if getattr(x, "pair", None) is not None}
    producer = {r: i for i, fe in enumerate(whole.eqns) for r in fe.outs if r is not None}
    checked: set[int] = set()
    backward = set(backward)
    for i, fe in enumerate(whole.eqns):
        if i in backward:
            continue
        refs = [x for x in fe.ins if isinstance(x, int)]
        outs = [r for r in fe.outs if r is not None]
        if any(r in reach for r in refs) or any(r in reach for r in outs):
            checked.add(i)
            reach.update(r for r in outs if lay.get(r) is not None and lay[r].kind == "split")
    todo = [x for i in checked for x in whole.eqns[i].ins
            if isinstance(x, int) and lay.get(x) is not None and lay[x].kind == "whole"]
    seen: set[int] = set()
    while todo:                       # the whole values the pairs read, and their makers
        r = todo.pop()
        if r in seen:
            continue
        seen.add(r)
        i = producer.get(r)
        if i is not None and i not in backward:
            checked.add(i)
            todo.extend(x for x in whole.eqns[i].ins if isinstance(x, int))
    found: list[tuple[Any, str]] = []
    found += _uneven_blocks(whole, micro, layout, checked, producer)
    for i in sorted(checked):
        a, b = whole.eqns[i], micro.eqns[i]
        for x, y in zip(a.ins, b.ins):
            if isinstance(x, Lit) or isinstance(y, Lit):
                same = isinstance(x, Lit) and isinstance(y, Lit) and np.array_equal(
                    np.asarray(x.value), np.asarray(y.value))
            elif x in whole.consts or y in micro.consts:
                same = x in whole.consts and y in micro.consts and np.array_equal(
                    np.asarray(whole.consts[x]), np.asarray(micro.consts[y]))
            else:
                continue
            if not same:
                shown = [np.asarray(v.value).tolist() if isinstance(v, Lit) else "an array"
                         for v in (x, y)]
                found.append((a, f"a constant that depends on the batch's size ({shown[0]} "
                                 f"at the whole batch, {shown[1]} at one microbatch) meets "
                                 f"values over pairs of the batch's examples (each microbatch "
                                 f"holds only its own pairs)"))
                break
    return found


def _constant_values(flat: Any, eqns: Collection[int]) -> dict[int, Any]:
    """ref -> value of the results of ``eqns`` computable from literals and constants alone
    (iotas, broadcasts, ``full``), in program order; the others are left out."""
    from rhino.jaxpr.interpret import Lit
    from rhino.jaxpr.private import bind

    env: dict[int, Any] = dict(flat.consts)
    for i in sorted(eqns):
        fe = flat.eqns[i]
        if not all(isinstance(x, Lit) or x in env for x in fe.ins):
            continue
        try:
            outs = bind(fe.eqn, [x.value if isinstance(x, Lit) else env[x] for x in fe.ins])
        except Exception:            # noqa: BLE001 (not computable here: left out)
            continue
        env.update((r, v) for r, v in zip(fe.outs, outs) if r is not None)
    return env


def _uneven_blocks(whole: Any, micro: Any, layout: Any, checked: Collection[int],
                   producer: Mapping[int, int]) -> list[tuple[Any, str]]:
    """Whole constants the pairs read as their microbatch's block (``Use.slice``) whose
    blocks are not what one microbatch computes (``jnp.ones((n, n)).sum(1)`` is ``n`` at the
    whole batch, ``n / m`` at one microbatch): computed at both sizes and compared."""
    import numpy as np

    m = layout.num_microbatches
    reads = [(i, j, x) for i in sorted(checked) for j, x in enumerate(whole.eqns[i].ins)
             if isinstance(x, int) and x in producer and layout.uses.get((i, j)) is not None
             and layout.uses[(i, j)].kind == "slice"]
    if not reads:
        return []
    big = _constant_values(whole, checked)
    small = _constant_values(micro, checked)
    found: list[tuple[Any, str]] = []
    for i, j, x in reads:
        y = micro.eqns[i].ins[j]
        if x not in big or not isinstance(y, int) or y not in small:
            continue
        use = layout.uses[(i, j)]
        w, v = np.asarray(big[x]), np.asarray(small[y])
        dims = [d for d in (use.axis, use.pair) if d is not None]
        for k in range(m):
            block = w
            for d in dims:
                size = w.shape[d] // m
                block = np.take(block, np.arange(k * size, (k + 1) * size), axis=d)
            if block.shape != v.shape or not np.array_equal(block, v):
                fe = whole.eqns[producer[x]]
                found.append((fe, "a whole value computed from the batch's size is not, in "
                                  f"microbatch {k}'s block, what one microbatch computes "
                                  "(it meets values over pairs of the batch's examples)"))
                break
    return found
