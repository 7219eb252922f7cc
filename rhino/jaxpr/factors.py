"""Sharding rules of jaxpr primitives with the microbatches as a time axis
(``rhino.jaxpr.microbatch``).

A *factor* of an equation is a set of operand and result dimensions that are cut together:
slicing every operand along its member dimension slices every result along its own (an
elementwise op's dimension ``d``, a ``dot_general``'s batch dimensions). A factor with no
result member is a *reduction*: cut along it, each part's result is a term of the whole's
(``sum``: a contracting dimension; ``max``/``min``: a reduction by them), or the whole is no
combination of the parts at all (``whole``: an ``argmax`` over the batch). An op without a
rule cannot be cut (``factors`` returns None). ``linear_groups`` lists the operands in
which an op is jointly linear: where a partial sum may pass through it unreduced.

Example:
    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((8, 3)), jnp.ones((3, 2))).eqns[0]
    >>> factors(eqn, [(8, 3), (3, 2)], [(8, 2)])
    [(((0, 0), (-1, 0)), None), (((1, 1), (-1, 1)), None), (((0, 1), (1, 0)), 'sum')]
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from rhino.jaxpr import primitives as prims
from rhino.jaxpr.interpret import Lit

# A factor: members ``(slot, dim)`` (slot i >= 0: operand i; slot -1 - k: result k) that
# are sliced together, and ``reduce`` (None, or the combining op when no result has it).
Factor = tuple[tuple[tuple[int, int], ...], str | None]


def operand_shape(x: Any, avals: Mapping[int, Any]) -> tuple[int, ...]:
    if isinstance(x, Lit):
        return tuple(np.shape(x.value))
    return tuple(avals[x].shape)


def _elementwise(ins: list[tuple], outs: list[tuple]) -> list[Factor]:
    rank = len(outs[0])
    out = []
    for d in range(rank):
        size = outs[0][d]
        members = [(i, d) for i, s in enumerate(ins) if len(s) == rank and s[d] == size]
        members += [(-1 - k, d) for k, s in enumerate(outs) if len(s) == rank]
        out.append((tuple(members), None))
    return out


def factors(eqn: Any, ins: list[tuple], outs: list[tuple],
            positions: Mapping[int, int] | None = None) -> list[Factor] | None:
    """The factors of ``eqn`` (None: no rule, it cannot be cut). ``positions``: for a
    gather or scatter, the coordinates of its index operand that are the index along one
    of that operand's dimensions (``x[arange(n), labels]``): the operand's dimension they
    address is then cut with that one (``addressed_by_position``)."""
    name = prims.name(eqn)
    p = eqn.params
    if name in prims.ELEMENTWISE or name in prims.IDENTITY_LIKE or \
            name in prims.RNG_ELEMENTWISE or name == "bitcast_convert_type":
        if name == "bitcast_convert_type" and len(ins[0]) != len(outs[0]):
            return None
        return _elementwise(ins, outs)
    if name == prims.BROADCAST:
        bd = p["broadcast_dimensions"]
        return [(((0, j), (-1, e)), None) for j, e in enumerate(bd)
                if ins[0][j] == outs[0][e]]
    if name == prims.TRANSPOSE:
        return [(((0, src), (-1, k)), None) for k, src in enumerate(p["permutation"])]
    if name == prims.SQUEEZE:
        gone = {d % len(ins[0]) for d in p["dimensions"]}
        kept = [d for d in range(len(ins[0])) if d not in gone]
        return [(((0, d), (-1, k)), None) for k, d in enumerate(kept)]
    if name == prims.RESHAPE:
        if p.get("dimensions") is not None:
            return None
        return _reshape_factors(ins[0], outs[0])
    if name in prims.REDUCTIONS:
        axes = set(prims.reduction_axes(eqn))
        kept = [d for d in range(len(ins[0])) if d not in axes]
        out = [(((0, d), (-1, k)), None) for k, d in enumerate(kept)]
        op = prims.REDUCTIONS[name]
        out += [(((0, d),), op if op in ("sum", "max", "min") else "whole") for d in axes]
        return out
    if name == prims.REDUCE:             # lax.reduce with a computation of its own
        axes = set(int(a) for a in p["dimensions"])
        k = len(outs)
        rank = len(ins[0])
        kept = [d for d in range(rank) if d not in axes]
        out = [(tuple([(i, d) for i in range(len(ins) - k)] +
                      [(-1 - r, c) for r in range(k)]), None) for c, d in enumerate(kept)]
        return out + [(tuple((i, d) for i in range(len(ins) - k)), "whole") for d in axes]
    if name in prims.LINALG_CORE:
        core = prims.LINALG_CORE[name]
        if core is None:                 # fft: its transformed dimensions are the last
            core = len(p["fft_lengths"])
        batch = len(ins[0]) - core
        out = []
        for d in range(batch):
            size = ins[0][d]
            members = [(i, d) for i, s in enumerate(ins) if len(s) > d and s[d] == size]
            members += [(-1 - k, d) for k, s in enumerate(outs) if len(s) > d and s[d] == size]
            out.append((tuple(members), None))
        return out
    if name in prims.CUDNN_ATTENTION:
        batch = ins[0][0]
        members = [(i, 0) for i, s in enumerate(ins) if s and s[0] == batch]
        members += [(-1 - k, 0) for k, s in enumerate(outs) if s and s[0] == batch]
        return [(tuple(members), None)]
    if name == prims.STACK:
        axis = int(p["axis"])
        return [(tuple([(i, d) for i in range(len(ins))] + [(-1, d + (d >= axis))]), None)
                for d in range(len(ins[0]))]
    if name == prims.UNSTACK:
        axis = int(p["axis"])
        return [(tuple([(0, d)] + [(-1 - k, d - (d > axis)) for k in range(len(outs))]), None)
                for d in range(len(ins[0])) if d != axis]
    if name == prims.TILE:
        return [(((0, d), (-1, d)), None) for d, r in enumerate(p["reps"]) if r == 1]
    if name in prims.ARG_REDUCTIONS:
        axes = set(prims.reduction_axes(eqn))
        kept = [d for d in range(len(ins[0])) if d not in axes]
        return [(((0, d), (-1, k)), None) for k, d in enumerate(kept)] + \
            [(((0, d),), "whole") for d in axes]
    along = _along_axes(name, p, ins)
    if along is not None:          # cut along every dimension but these
        rank = len(outs[0])
        return [(tuple([(i, d) for i in range(len(ins)) if len(ins[i]) == rank] +
                       [(-1 - k, d) for k in range(len(outs))]), None)
                for d in range(rank) if d not in along]
    if name == prims.DOT:
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        lf = [d for d in range(len(ins[0])) if d not in lc and d not in lb]
        rf = [d for d in range(len(ins[1])) if d not in rc and d not in rb]
        out = [(((0, a), (1, b), (-1, k)), None) for k, (a, b) in enumerate(zip(lb, rb))]
        out += [(((0, d), (-1, len(lb) + k)), None) for k, d in enumerate(lf)]
        out += [(((1, d), (-1, len(lb) + len(lf) + k)), None) for k, d in enumerate(rf)]
        out += [(((0, a), (1, b)), "sum") for a, b in zip(lc, rc)]
        return out
    if name == prims.CONV:
        dn = p["dimension_numbers"]
        lhs, rhs, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
        out = [(((0, lhs[0]), (-1, out_spec[0])), None)]
        if p["feature_group_count"] == 1 and p["batch_group_count"] == 1:
            out += [(((0, lhs[1]), (1, rhs[1])), "sum"),
                    (((1, rhs[0]), (-1, out_spec[1])), None)]
        elif p["batch_group_count"] != 1:
            return None
        return out
    if name == prims.DYNAMIC_SLICE:
        sizes = p["slice_sizes"]
        return [(((0, d), (-1, d)), None) for d in range(len(ins[0])) if sizes[d] == ins[0][d]]
    if name == prims.DYNAMIC_UPDATE_SLICE:
        return [(((0, d), (1, d), (-1, d)), None) for d in range(len(ins[0]))
                if ins[1][d] == ins[0][d]]
    if name == prims.SLICE:
        start, limit = p["start_indices"], p["limit_indices"]
        strides = p["strides"] or (1,) * len(ins[0])
        return [(((0, d), (-1, d)), None) for d in range(len(ins[0]))
                if start[d] == 0 and limit[d] == ins[0][d] and strides[d] == 1]
    if name == prims.PAD:
        return [(((0, d), (-1, d)), None) for d, (lo, hi, inner) in
                enumerate(p["padding_config"]) if (lo, hi, inner) == (0, 0, 0)]
    if name == prims.SELECT_N or name == "clamp":
        return _elementwise(ins, outs)
    if name == prims.GATHER:
        return _gather_factors(p, ins, outs, addressed_by_position(eqn, ins, positions))
    if name in prims.SCATTER_ADD or name in prims.SCATTERS:
        return _scatter_factors(name, p, ins, outs,
                                addressed_by_position(eqn, ins, positions))
    if name in prims.RNG_SHAPED or name == prims.RANDOM_UNWRAP:
        return [(((0, d), (-1, d)), None) for d in range(len(ins[0]))]
    if name == prims.RANDOM_WRAP:
        return [(((0, d), (-1, d)), None) for d in range(len(outs[0]))]
    if name in prims.REDUCE_WINDOWS:
        dims = p.get("window_dimensions")
        strides = p.get("window_strides")
        pads = p.get("padding")
        if dims is None:
            return None
        ok = [d for d in range(len(dims)) if dims[d] == 1 and strides[d] == 1
              and tuple(pads[d]) == (0, 0)
              and all(tuple(p.get(k) or (1,) * len(dims))[d] == 1
                      for k in ("base_dilation", "window_dilation"))]
        return [(tuple([(i, d) for i in range(len(ins)) if len(ins[i]) == len(dims)] +
                       [(-1 - k, d) for k in range(len(outs))]), None) for d in ok]
    return None


def _along_axes(name: str, p: Mapping, ins: list[tuple]) -> set[int] | None:
    """The dimensions an op works along (mixing their elements), for ops that treat every
    other dimension elementwise; None for other ops."""
    if name in prims.CUMULATIVE:
        return {int(p["axis"])}
    if name in (prims.SORT, prims.CONCATENATE):
        return {int(p["dimension"])}
    if name == prims.REV:
        return {int(d) for d in p["dimensions"]}
    if name == prims.TOP_K:
        return {len(ins[0]) - 1}
    if name == prims.APPROX_TOP_K:
        return {int(p["reduction_dimension"]) % len(ins[0])}
    if name == prims.SPLIT:
        return {int(p["axis"])}
    return None


def _reshape_factors(old: tuple, new: tuple) -> list[Factor]:
    """A dimension of ``old`` that is the outermost factor of a dimension of ``new``, or
    whose outermost factor a dimension of ``new`` is, with the same elements before it (a
    contiguous chunk along it stays a contiguous chunk): ``(n, s) <-> (n * s,)``."""
    out = []
    pre_new = [1]
    for x in new:
        pre_new.append(pre_new[-1] * x)
    pre = 1
    for d, x in enumerate(old):
        for e, y in enumerate(new):
            if pre_new[e] == pre and y > 1 and x > 1:
                out.append((((0, d), (-1, e)), None))
                break
        pre *= x
    return out


def addressed_by_position(eqn: Any, ins: list[tuple], positions: Mapping[int, int] | None
                          ) -> dict[int, tuple[int, int]]:
    """A gather's or scatter's operand dimensions addressed, one element each, by an index
    coordinate that is the position along an index dimension of the same size:
    operand dimension -> (index dimension, coordinate). Each index then reads its own
    element of that dimension, as a batching dimension would."""
    if not positions:
        return {}
    p = eqn.params
    dn = p["dimension_numbers"]
    operand, indices = ins[0], ins[1]
    if prims.name(eqn) == prims.GATHER:
        where, single = dn.start_index_map, dn.collapsed_slice_dims
        sizes = p["slice_sizes"]
    else:
        where, single = dn.scatter_dims_to_operand_dims, dn.inserted_window_dims
        sizes = [1 if d in single else operand[d] for d in range(len(operand))]
    out = {}
    for k, j in positions.items():
        if k >= len(where) or j >= len(indices) - 1:
            continue
        od = where[k]
        if od in single and sizes[od] == 1 and operand[od] == indices[j]:
            out[od] = (j, k)
    return out


def _gather_factors(p: Mapping, ins: list[tuple], outs: list[tuple],
                    by_position: Mapping[int, tuple[int, int]] = {}) -> list[Factor]:
    dn = p["dimension_numbers"]
    operand, indices, out = ins[0], ins[1], outs[0]
    offset = list(dn.offset_dims)
    batch_pos = [k for k in range(len(out)) if k not in offset]
    idx_batch = list(range(len(indices) - 1))          # the last is the index vector
    obd = list(getattr(dn, "operand_batching_dims", ()) or ())
    ibd = list(getattr(dn, "start_indices_batching_dims", ()) or ())
    factors: list[Factor] = []
    for k, j in enumerate(idx_batch):
        members = [(1, j), (-1, batch_pos[k])]
        if j in ibd:
            members.append((0, obd[ibd.index(j)]))
        members += [(0, od) for od, (jj, _) in by_position.items() if jj == j]
        factors.append((tuple(members), None))
    window = [d for d in range(len(operand))
              if d not in dn.collapsed_slice_dims and d not in obd]
    for k, d in enumerate(window):
        if d not in dn.start_index_map and p["slice_sizes"][d] == operand[d]:
            factors.append((((0, d), (-1, offset[k])), None))
    return factors


def _scatter_factors(name: str, p: Mapping, ins: list[tuple], outs: list[tuple],
                     by_position: Mapping[int, tuple[int, int]] = {}) -> list[Factor] | None:
    dn = p["dimension_numbers"]
    operand, indices, updates = ins[0], ins[1], ins[2]
    uwd = list(dn.update_window_dims)
    scatter_pos = [k for k in range(len(updates)) if k not in uwd]
    obd = list(getattr(dn, "operand_batching_dims", ()) or ())
    sbd = list(getattr(dn, "scatter_indices_batching_dims", ()) or ())
    add = name in prims.SCATTER_ADD
    factors: list[Factor] = []
    for k, j in enumerate(range(len(indices) - 1)):
        members = [(1, j), (2, scatter_pos[k])]
        mine = [od for od, (jj, _) in by_position.items() if jj == j]
        if j in sbd or mine:
            ods = ([obd[sbd.index(j)]] if j in sbd else []) + mine
            members += [(0, od) for od in ods] + [(-1, od) for od in ods]
            factors.append((tuple(members), None))
        elif add:
            factors.append((tuple(members), "sum"))   # examples add into the same places
    window = [d for d in range(len(operand)) if d not in dn.inserted_window_dims
              and d not in obd]
    for k, d in enumerate(window):
        if d not in dn.scatter_dims_to_operand_dims and updates[uwd[k]] == operand[d]:
            factors.append((((0, d), (2, uwd[k]), (-1, d)), None))
    return factors


# Operand groups in which an equation is jointly linear (a partial sum passes through).
def linear_groups(eqn: Any, ins: list) -> list[frozenset[int]]:
    name = prims.name(eqn)
    n = len(ins)
    everything = frozenset(range(n))
    if name in prims.LINEAR_ELEMENTWISE or name in prims.IDENTITY_LIKE or \
            name == prims.CONCATENATE:
        return [everything]
    if name == prims.CONVERT:
        return [frozenset({0})] if widening(eqn) else []
    if name in (prims.MUL, prims.DOT, prims.CONV):
        return [frozenset({0}), frozenset({1})]
    if name == prims.DIV:
        return [frozenset({0})]
    if name == prims.INTEGER_POW:
        return [frozenset({0})] if prims.is_identity_pow(eqn) else []
    if name in (prims.BROADCAST, prims.RESHAPE, prims.TRANSPOSE, prims.SQUEEZE, prims.REV,
                prims.SLICE, "reduce_sum", "cumsum", prims.DYNAMIC_SLICE, prims.GATHER,
                "reduce_window_sum", prims.SPLIT, prims.PAD):
        return [frozenset({0})]
    if name == prims.SELECT_N:
        return [frozenset(range(1, n))]
    if name == prims.DYNAMIC_UPDATE_SLICE:
        return [frozenset({0, 1})]
    if name in prims.SCATTER_ADD:
        return [frozenset({0, 2})]
    return []


def widening(eqn: Any) -> bool:
    """A ``convert_element_type`` to a floating type at least as wide as its operand's (a
    sum of converted terms is the converted sum, to rounding no coarser than the
    operand's own). A narrowing conversion rounds: a partial sum converted per term would
    round each microbatch's term, where the step rounds the total once."""
    import jax.numpy as jnp

    new = eqn.params.get("new_dtype")
    old = eqn.invars[0].aval.dtype
    if new is None or not jnp.issubdtype(new, jnp.inexact) or \
            not jnp.issubdtype(old, jnp.inexact):
        return False
    return jnp.finfo(new).bits >= jnp.finfo(old).bits and \
        jnp.finfo(new).nmant >= jnp.finfo(old).nmant and \
        jnp.issubdtype(new, jnp.complexfloating) == jnp.issubdtype(old, jnp.complexfloating)


def keeps_precision(eqn: Any) -> bool:
    """A ``reduce_precision`` to at least its operand's own precision: the identity (what
    ``rhino.grad`` marks gradients with)."""
    import jax.numpy as jnp

    if prims.name(eqn) != "reduce_precision":
        return False
    dt = eqn.invars[0].aval.dtype
    if not jnp.issubdtype(dt, jnp.floating):
        return False
    fi = jnp.finfo(dt)
    return eqn.params["exponent_bits"] >= fi.nexp and eqn.params["mantissa_bits"] >= fi.nmant


ORDER_PRESERVING = frozenset({prims.BROADCAST, prims.RESHAPE, prims.TRANSPOSE,
                               prims.SQUEEZE}) | prims.IDENTITY_LIKE
