"""Per-equation rules of the microbatch analysis (``rhino.jaxpr.microbatch``): given the
layouts of an equation's operands over the microbatches, the layouts of its results and how
it reads each operand (``micro_rule``; over pairs of the batch, ``_pairs``), or the operands
whose totals it needs; the bind parameters of an equation bound at microbatch shapes
(``_rewrite``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, Mapping

import numpy as np

from rhino.jaxpr import bodies
from rhino.jaxpr import primitives as prims
from rhino.jaxpr.factors import (ORDER_PRESERVING, addressed_by_position, factors,
                                 keeps_precision, linear_groups)
from rhino.jaxpr.interpret import Lit
from rhino.jaxpr.layouts import LOCAL, TOTAL, Layout, Outcome, Use, partial, split
from rhino.jaxpr.pairs import PAIR_OPS
from rhino.jaxpr.private import bind_params



def makes_zero(fe: Any, zero: set[int]) -> bool:
    """Results that are zeros: a broadcast or conversion of a literal 0 or of zeros."""
    name = prims.name(fe.eqn)
    if name not in (prims.BROADCAST, prims.CONVERT, "copy") or len(fe.ins) != 1:
        return False
    x = fe.ins[0]
    if isinstance(x, Lit):
        return bool(np.all(np.asarray(x.value) == 0))
    return x in zero


def total_rule(fe: Any, ins: list[Layout]) -> Outcome:
    """Computed once per step after the microbatches: partial operands summed, split ones
    put together."""
    uses = {}
    for j, x in enumerate(ins):
        if x.kind == "partial":
            uses[j] = Use("total")
        elif x.kind == "split":
            uses[j] = Use("concat", x.axis)
        elif x.kind == "local":
            uses[j] = Use("mean")             # each microbatch's own: their average
    return Outcome([TOTAL] * len(fe.outs), uses)


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the analysis knows of a program's values that the rules ask about.

    Attributes:
        zero: refs that are zeros.
        is_data: whether a ref is computed from the batch alone (no training state).
        spread: the dimensions along which a value's diagonal blocks are what a microbatch
            alone computes (``PairFacts.steady``).
        constant: the dimensions a value is constant along (a broadcast's): its chunk is
            the same for every microbatch.
        divisible: whether an index operand is a multiple of ``k``.
        positions: for an index array whose last dimension lists the coordinates, the
            coordinates that are the index along one of its dimensions (``arange(n)`` in
            ``x[arange(n), labels]``): component -> that dimension.
        analyze: the analysis (``microbatch.analyze``), for the bodies of control flow.
    """

    zero: Collection[int] = frozenset()
    is_data: Callable[[Any], bool] = lambda x: False
    spread: Callable[[Any], Collection[int]] = lambda x: ()
    constant: Callable[[Any], Collection[int]] = lambda x: ()
    divisible: Callable[[Any, int], bool] = lambda x, k: False
    positions: Callable[[Any], Mapping[int, int]] = lambda x: {}
    analyze: Callable[..., Any] | None = None


def micro_rule(fe: Any, ins: list[Layout], ins_shapes: list[tuple], outs_shapes: list[tuple],
               m: int, facts: Facts, pairs: bool = False) -> Outcome:
    """An equation with a per-microbatch operand: its results' layouts and how it reads
    its operands, or the operands whose totals it needs. ``pairs``: an equation pairing
    the examples of the batch is computed per microbatch on its own pairs (``_pairs``)."""
    zero, spread, constant, divisible = facts.zero, facts.spread, facts.constant, \
        facts.divisible
    n_out = len(fe.outs)
    partials = [j for j, x in enumerate(ins) if x.kind == "partial"]
    splits = [j for j, x in enumerate(ins) if x.kind == "split"]
    name = prims.name(fe.eqn)
    if (name in prims.IDENTITY_LIKE and len(fe.ins) == n_out) or keeps_precision(fe.eqn):
        return Outcome(list(ins), {})            # values passed on as they are
    nested = bodies.rule(fe.eqn, ins, m, lambda j: _is_zero(fe.ins[j], zero), facts.analyze)
    if nested is not None:
        return nested
    if partials:
        if splits:
            return Outcome([], {}, needs_total=tuple(partials),
                            reason="a statistic over the batch combined with per-example "
                                   "values")
        ops = {ins[j].op for j in partials}
        if ops != {"sum"}:
            if len(ops) == 1 and name in ORDER_PRESERVING and len(fe.ins) == 1:
                return Outcome([ins[0]] * n_out, {})
            return Outcome([], {}, needs_total=tuple(partials),
                            reason="a maximum or minimum over the batch used further")
        pset = set(partials)
        for g in linear_groups(fe.eqn, fe.ins):
            if pset <= g and all(j in pset or _is_zero(fe.ins[j], zero) for j in g) and \
                    not any(ins[j].kind == "local" for j in g):
                return Outcome([partial("sum")] * n_out, {})
        return Outcome([], {}, needs_total=tuple(partials),
                        reason="a sum over the batch used non-linearly")
    if not splits:                                   # local (and whole) operands only
        return Outcome([LOCAL] * n_out, {})
    if name == prims.RESHAPE and ins[0].pair is None:
        got = None
        old, lay0 = ins_shapes[0], ins[0]
        dims = fe.eqn.params.get("dimensions")
        if dims is not None and lay0.kind == "split":    # a transpose, then the reshape
            old = tuple(old[d] for d in dims)
            lay0 = dataclasses.replace(lay0, axis=list(dims).index(lay0.axis))
        got = reshape_layout(old, outs_shapes[0], lay0, m)
        if got is None:
            return _unsupported(fe, ins, splits, f"reshape from {ins_shapes[0]} to "
                                                 f"{outs_shapes[0]} moves the examples of "
                                                 f"{ins[0]} apart")
        params = bind_params(fe.eqn)
        sizes = list(params["new_sizes"])
        sizes[got.axis] //= m
        params["new_sizes"] = tuple(sizes)
        return Outcome([got], {}, params)
    if name in (prims.SLICE, prims.DYNAMIC_SLICE) and ins[0].group and \
            ins[0].axis is not None:
        return _block_slice(fe, ins, ins_shapes, m, divisible)
    along = _along_split(fe, ins, ins_shapes, outs_shapes, m)
    if along is not None:
        return along
    groups = {ins[j].group for j in splits}
    if len(groups) > 1:
        return _unsupported(fe, ins, splits, f"{name} combines values of the batch split "
                                             f"in different groups")
    group = groups.pop()
    index_at = facts.positions(fe.ins[1]) if name in prims.INDEXING and len(fe.ins) > 1 \
        else {}
    rules = factors(fe.eqn, ins_shapes, outs_shapes, index_at)
    if rules is None:
        return _unsupported(fe, ins, splits, f"a per-example value enters {name}, which "
                                             f"cannot be cut into microbatches")
    hit: list | None = []
    for j in splits:
        for d in ins[j].dims:
            fa = next((fa for fa in rules if (j, d) in fa[0]), None)
            if fa is None:
                hit = None
                break
            if fa not in hit:
                hit.append(fa)
        if hit is None:
            break
    over_pairs = any(ins[j].pair is not None for j in splits)
    if pairs and (over_pairs or (hit is not None and len(hit) == 2)):
        return _pairs(fe, ins, ins_shapes, outs_shapes, m, hit or [], spread)
    if any(ins[j].pair is not None for j in splits):
        return _unsupported(fe, ins, splits, f"{name} mixes the examples of the batch "
                                             f"(over pairs of them)")
    first = splits[0]
    f = next((fa for fa in rules if (first, ins[first].axis) in fa[0]), None)
    if f is None or not all((j, ins[j].axis) in f[0] for j in splits):
        got = _unsupported(fe, ins, splits, f"{name} mixes the examples of the batch "
                                            f"(along the dimension split into microbatches)")
        got.pairable = hit is not None and len(hit) == 2 and name in PAIR_OPS
        return got
    members, reduce = f
    size = ins_shapes[first][ins[first].axis]
    uses: dict[int, Use] = {}
    for slot, d in members:
        if slot < 0 or ins[slot].kind == "split":
            continue
        if ins_shapes[slot][d] != size:
            return _unsupported(fe, ins, splits, f"{name} reads a value along the batch "
                                                 f"at another size")
        uses[slot] = Use("slice", d,          # a local value: its own chunk too
                         steady=d in constant(fe.ins[slot]) and ins[slot].kind == "whole",
                         group=group)
    # An index coordinate that is the position along the batch addresses the operand's
    # split dimension: each microbatch's positions are made its own (less its offset).
    by_position = addressed_by_position(fe.eqn, ins_shapes, index_at)
    for od, (j, k) in by_position.items():
        if (0, od) in members and (1, j) in members:
            u = uses.get(1)
            uses[1] = dataclasses.replace(u or Use("rebase"),
                                          rebase=(k, ins_shapes[0][od] // m))
    res = {-1 - slot: d for slot, d in members if slot < 0}
    if reduce in ("sum", "max", "min") and not res:
        if reduce == "sum" and prims.name(fe.eqn) in prims.SCATTER_ADD and \
                not _is_zero(fe.ins[0], zero) and ins[0].kind != "partial":
            return _unsupported(fe, ins, splits, "examples scattered into a value that is "
                                                 "not zeros")
        return Outcome([partial(reduce)] * n_out, uses)
    if reduce == "whole" or not res:
        return _unsupported(fe, ins, splits, f"{name} reduces over the batch")
    if len(res) != n_out:
        return _unsupported(fe, ins, splits, f"{name} gives results not cut with the batch")
    outs: list[Layout] = []
    for k in range(n_out):
        if outs_shapes[k][res[k]] % m:
            return _unsupported(fe, ins, splits, f"{name}'s result dimension "
                                                 f"{outs_shapes[k][res[k]]} is not divisible "
                                                 f"by {m} microbatches")
        outs.append(split(res[k], group=group))
    if group and name == prims.GATHER:
        return _unsupported(fe, ins, splits, "a gather from values of the batch split in "
                                             "groups")
    return Outcome(outs, uses, _rewrite(fe.eqn, ins, ins_shapes, outs_shapes, res, m))


def reshape_layout(old: tuple, new: tuple, lay: Layout, m: int) -> Layout | None:
    """The layout of ``reshape(x, new)`` for ``x`` of shape ``old`` split as ``lay`` (a
    dimension cut into ``m`` chunks, or into ``m`` chunks of each of ``group`` blocks), or
    None where the microbatch's elements are no such cut of the result.

    The dimensions a reshape rewrites in one piece (a run of old dimensions whose product
    is a run of new ones) are read as one flat dimension: there a microbatch holds a chunk
    of each of ``G`` blocks of ``B`` elements (``G`` = the product of the old dimensions
    before the split one, times its groups). That is a cut of new dimension ``h`` in ``t``
    groups where the new dimensions before ``h`` make ``G / t`` of the blocks and the rest
    of each block runs along ``h``.

    Example:
        >>> str(reshape_layout((16, 8), (4, 4, 8), split(0, group=4), 4))
        'split(1)'
        >>> str(reshape_layout((4, 4, 8), (16, 8), split(1), 4))
        'split(0 in 4 groups)'
        >>> reshape_layout((16, 8), (4, 4, 8), split(0), 2) is None   # (4 chunks of 2 rows)
        False
    """
    import math

    d, g = lay.axis, lay.group or 1
    if d is None or lay.pair is not None:
        return None
    # the run of old dims [a, c] holding d, and the new dims [p, q] with the same product
    a = p = 0
    while True:
        c, q = a, p
        po = old[a] if a < len(old) else 1
        pn = new[p] if p < len(new) else 1
        while po != pn:
            if po < pn:
                c += 1
                if c >= len(old):
                    return None
                po *= old[c]
            else:
                q += 1
                if q >= len(new):
                    return None
                pn *= new[q]
        if c >= d:
            break
        a, p = c + 1, q + 1
    if q >= len(new):
        return None
    n = old[d]
    if n % (g * m):
        return None
    big = math.prod(old[a:d]) * g                        # blocks
    block = (n // g) * math.prod(old[d + 1:c + 1])       # elements per block
    chunk = block // m
    for h in range(p, q + 1):
        before, after = math.prod(new[p:h]), math.prod(new[h + 1:q + 1])
        if big % before or new[h] % (big // before) or chunk % after:
            continue
        t = big // before
        if block == (new[h] // t) * after and (new[h] // t) % m == 0:
            return split(h, group=t)
    return None


def _along_split(fe: Any, ins: list[Layout], ins_shapes: list[tuple],
                 outs_shapes: list[tuple], m: int) -> Outcome | None:
    """Two ways of taking examples along the split dimension that keep every microbatch's
    examples its own: a concatenation of equally many examples from each operand (its
    result split in as many groups: each microbatch holds its chunk of each part, data
    augmentation by concatenated copies) and a strided slice whose stride divides a
    microbatch's chunk (each takes every ``k``-th of its own). None for anything else."""
    name = prims.name(fe.eqn)
    p = fe.eqn.params
    x = ins[0]
    if x.kind != "split" or x.pair is not None:
        return None
    d = x.axis
    if name == prims.CONCATENATE and int(p["dimension"]) == d:
        if any(y != x for y in ins) or len({s[d] for s in ins_shapes}) != 1:
            return None
        return Outcome([split(d, group=len(ins) * (x.group or 1))], {})
    if name == prims.SPLIT and int(p["axis"]) == d:        # its inverse
        k = len(fe.outs)
        if not x.group or x.group % k or len(set(p["sizes"])) != 1:
            return None
        params = bind_params(fe.eqn)
        params["sizes"] = tuple(n // m for n in p["sizes"])
        return Outcome([split(d, group=x.group // k)] * k, {}, params)
    if name == prims.PAD and x.group is None:      # a strided slice's transpose
        lo, hi, inner = p["padding_config"][d]
        n, step = ins_shapes[0][d], inner + 1
        if inner and 0 <= lo < step and hi == step - 1 - lo and (n // m) * m == n and \
                all(c == (0, 0, 0) for k, c in enumerate(p["padding_config"]) if k != d):
            return Outcome([split(d)], {})
    if name == prims.SLICE and x.group is None and len(fe.ins) == 1:
        start, limit = p["start_indices"][d], p["limit_indices"][d]
        stride = (p["strides"] or (1,) * len(ins_shapes[0]))[d]
        n = ins_shapes[0][d]
        chunk = n // m
        if stride > 1 and start < stride and limit == n and n % stride == 0 and \
                chunk % stride == 0:
            params = bind_params(fe.eqn)
            params["limit_indices"] = tuple(chunk if k == d else v
                                            for k, v in enumerate(p["limit_indices"]))
            return Outcome([split(d)], {}, params)
    return None


def _block_slice(fe: Any, ins: list[Layout], ins_shapes: list[tuple], m: int,
                 divisible: Callable[[Any, int], bool]) -> Outcome:
    """A slice or dynamic slice of one block along a dimension split in groups (a loop
    taking the batch's chunks one by one): each microbatch takes its chunk of the block,
    at the block's offset divided by ``m``."""
    name = prims.name(fe.eqn)
    x = ins[0]
    d, g = x.axis, x.group
    n = ins_shapes[0][d]
    block = n // g
    p = bind_params(fe.eqn)
    splits = [j for j, y in enumerate(ins) if y.kind == "split"]
    why = (f"{name} of the batch split in {g} groups, along its examples, that is not one "
           f"whole group")
    if any(y.per_microbatch for y in ins[1:]):
        return _unsupported(fe, ins, splits, why)
    if name == prims.SLICE:
        start, limit = p["start_indices"][d], p["limit_indices"][d]
        strides = p["strides"] or (1,) * len(ins_shapes[0])
        if limit - start != block or start % block or strides[d] != 1:
            return _unsupported(fe, ins, splits, why)
        p["start_indices"] = tuple(v // m if k == d else v
                                   for k, v in enumerate(p["start_indices"]))
        p["limit_indices"] = tuple((start + block) // m if k == d else v
                                   for k, v in enumerate(p["limit_indices"]))
        return Outcome([split(d)], {}, p)
    if p["slice_sizes"][d] != block or not divisible(fe.ins[1 + d], block):
        return _unsupported(fe, ins, splits, why)
    p["slice_sizes"] = tuple(v // m if k == d else v for k, v in enumerate(p["slice_sizes"]))
    return Outcome([split(d)], {1 + d: Use("divided")}, p)


def _pairs(fe: Any, ins: list[Layout], ins_shapes: list[tuple], outs_shapes: list[tuple],
           m: int, hit: list, spread: Callable[[Any], Collection[int]]) -> Outcome:
    """An equation whose per-example operands meet along two factors (``per_microbatch_
    statistics``): ``z @ z.T`` pairs every example with every example. Each microbatch
    computes the diagonal block (its examples against its own examples), what the step
    computes on that microbatch alone: a result keeping both factors is split along both
    dimensions by the same microbatch index; one reduced by a sum, maximum or minimum
    within the block is split along the other (no partial value: no other microbatch
    holds a term of it); both reduced, a partial value. A whole operand is read as its
    diagonal block (iota comparisons are the same on every block), a per-example operand
    along its other dimension only where it is constant along it (a broadcast). Anything
    else is unsupported (named): index values (global positions of the batch), a reshape
    merging a dimension of pairs, a contraction of pairs with a value of the whole batch's
    positions, an operand of another size."""
    name = prims.name(fe.eqn)
    splits = [j for j, x in enumerate(ins) if x.kind == "split"]
    if name in prims.INDEXING:
        return _unsupported(fe, ins, splits, f"{name} addresses values over pairs of the "
                                             f"batch's examples by index values (positions "
                                             f"of the whole batch, outside a microbatch's "
                                             f"own pairs)")
    if name not in PAIR_OPS:
        return _unsupported(fe, ins, splits, f"{name} on values over pairs of the batch's "
                                             f"examples (it addresses positions of the "
                                             f"whole batch)")
    if len(hit) != 2:
        return _unsupported(fe, ins, splits, f"{name} mixes the examples of the batch "
                                             f"(over pairs of them)")
    cut: dict[int, list[int]] = {}
    kept: list[dict[int, int]] = []
    reduced: list[str | None] = []
    for members, reduce in hit:
        slots = [(s, d) for s, d in members if s >= 0]
        size = next(ins_shapes[s][d] for s, d in slots
                    if ins[s].kind == "split" and d in ins[s].dims)
        for s, d in slots:
            x = ins[s]
            if ins_shapes[s][d] != size:
                return _unsupported(fe, ins, splits, f"{name} reads a value along the batch "
                                                     f"at another size")
            if x.kind == "split" and d in x.dims:
                continue
            if reduce is not None and x.kind == "whole":
                return _unsupported(fe, ins, splits, f"{name} contracts pairs of the batch's "
                                                     f"examples with a value over the whole "
                                                     f"batch's positions")
            if x.kind == "whole" or (x.kind == "split" and d in spread(fe.ins[s])):
                cut.setdefault(s, []).append(d)
                continue
            return _unsupported(fe, ins, splits, f"{name} reads a per-example value along "
                                                 f"the positions of the batch against pairs "
                                                 f"of its examples (a microbatch holds only "
                                                 f"its own pairs)")
        res = {-1 - s: d for s, d in members if s < 0}
        if res:
            kept.append(res)
        else:
            reduced.append(reduce)
    uses = {s: Use("slice", d[0], d[1] if len(d) > 1 else None) for s, d in cut.items()}
    n_out = len(fe.outs)
    if any(len(r) != n_out for r in kept):
        return _unsupported(fe, ins, splits, f"{name} gives results not cut with the batch")
    if any(op not in ("sum", "max", "min") for op in reduced) or len(set(reduced)) > 1:
        return _unsupported(fe, ins, splits, f"{name} reduces over pairs of the batch")
    block_sum = name in prims.REDUCTIONS and reduced == ["sum"]
    if not kept:
        return Outcome([partial(reduced[0])] * n_out, uses, block_sum=block_sum)
    dims = [tuple(r[k] for r in kept) for k in range(n_out)]
    for k, ds in enumerate(dims):
        if any(outs_shapes[k][d] % m for d in ds):
            return _unsupported(fe, ins, splits, f"{name}'s result {outs_shapes[k]} is not "
                                                 f"divisible by {m} microbatches")
    params = None
    key = _SHAPE_PARAMS.get(name)
    if key is not None:
        params = bind_params(fe.eqn)
        sizes = list(params[key])
        for d in dims[0]:
            sizes[d] //= m
        params[key] = tuple(sizes)
    return Outcome([split(*ds) for ds in dims], uses, params, block_sum=block_sum)


def _unsupported(fe: Any, ins: list[Layout], splits: list[int], reason: str) -> Outcome:
    return Outcome([], {}, needs_total=tuple(splits), reason=reason)


def _is_zero(x: Any, zero: set[int]) -> bool:
    if isinstance(x, Lit):
        return bool(np.all(np.asarray(x.value) == 0))
    return x in zero


# Primitives whose named parameter lists their result's sizes (a dynamic slice's and a
# slice's along dimensions kept whole: the split one runs to its end).
_SHAPE_PARAMS = {prims.BROADCAST: "shape", prims.RESHAPE: "new_sizes",
                 prims.DYNAMIC_SLICE: "slice_sizes", prims.SLICE: "limit_indices"}


def _rewrite(eqn: Any, ins: list[Layout], ins_shapes: list[tuple], outs_shapes: list[tuple],
             res: Mapping[int, int], m: int) -> dict | None:
    """Bind parameters of ``eqn`` at microbatch shapes, where they name a result shape
    (None: its own parameters fit)."""
    name = prims.name(eqn)
    params = bind_params(eqn)
    key = _SHAPE_PARAMS.get(name)
    if key is not None:          # the parameter lists the result's sizes: cut the split one
        sizes = list(params[key])
        sizes[res[0]] //= m
        params[key] = tuple(sizes)
        return params
    split_in = next((j, x.axis) for j, x in enumerate(ins) if x.kind == "split")
    if name == prims.GATHER:
        j, d = split_in
        if j == 0 and params["slice_sizes"][d] == ins_shapes[0][d] and \
                d not in (getattr(params["dimension_numbers"], "operand_batching_dims", ())
                          or ()):                  # a window along the split dimension
            sizes = list(params["slice_sizes"])
            sizes[d] //= m
            params["slice_sizes"] = tuple(sizes)
            return params
        return None
    return None
