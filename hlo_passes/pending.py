"""Pending sums in the compiled program: values kept as their devices' partial sums.

A plan may leave a contraction's sum pending (``P(sum@x)``: each device along ``x`` holds a
partial sum) and carry it through linear equations — a scaling, a bias add, a select, a
reduction, a reshape — to where a smaller value is reduced. No sharding constraint says
"pending": under ``jax.jit`` XLA's partitioner reduces a split contraction right at its
dot. So a carried pending value is *held explicit*: a ``Pending`` keeps the ``n`` partial
sums as a leading dimension of size ``n`` split over the pending mesh axes (one slice per
device group), and the sum over that dimension is the value. XLA then has nothing to
reduce until that sum is taken, where the plan reduces it, as one all-reduce (or
reduce-scatter) of that value.

* The equation that makes the sum — a ``dot_general`` or convolution whose contracted
  dimension is split over the pending axes, a ``reduce_sum`` over a split dimension, a
  ``gather`` from a table split along the dimensions it indexes (a vocabulary-parallel
  embedding, ``take_along_axis`` from split logits) — runs on each device's own blocks (a
  ``shard_map`` over the mesh, ``PendingOps._local``), its partial result becoming the
  device's slice: nothing moves. Where one equation lowers to several ops (a fill-mode
  gather: the gather, then a select of it or the fill value), the op inside it that
  makes the sum is the producer (``lower._sum_maker``).
* Linear equations run slice by slice: ``reduce_sum``, ``reshape``, ``transpose``,
  ``broadcast_in_dim``, ``squeeze``, ``neg``, floating ``convert_element_type``; ``mul``
  and ``div`` by a value held whole; ``add``, ``sub``, ``select_n`` with pending or whole
  operands. A whole operand is held pending first (``PendingOps.hold``) so that the sum
  over slices counts it once: split over exactly the pending axes, each slice keeps its
  own shard in place (zeros elsewhere, nothing moves); otherwise slice 0 holds all of it
  (local only where it is whole on those axes).
* Anything else reads the sum (``resolve``, taken once per value however many read it),
  and so do the program's results: a pending value never leaves the program, and an
  equation rhino cannot carry a sum through gets the value the step means. A producer it
  cannot run this way (a strided or uneven split, a gather with wider slices) makes
  the value whole, as XLA would, and its readers take it so: the step computes the same
  thing, at the price of a reduction at the source.

Plans built with pass-through (``rhino.plan(..., build=BuildOptions(
partial_passthrough=True))``) run with it; ``auto_parallel``'s own plans keep
``partial_passthrough=False`` for now (``PlanRequest.build_options`` says why), and stage
programs reduce a split contraction at its source.

Summation order differs from the single-device step's (the partial sums are added last),
as it does for any split contraction.

Example:
    >>> import jax.numpy as jnp
    >>> p = Pending(jnp.ones((4, 3)), (3,), (0,))
    >>> resolve(p).tolist()
    [4.0, 4.0, 4.0]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

from rhino.jaxpr import primitives as prims
from rhino.jaxpr import private
from rhino.planner.spec import ShardingSpec

SUM = "sum"

# Equations a pending sum passes through slice by slice (each operand that is pending).
_UNARY = frozenset({"neg", "copy", "copy_p", "reduce_sum", "reshape", "transpose",
                    "broadcast_in_dim", "squeeze", "convert_element_type"})
_ADDITIVE = prims.SUMS       # add, add_any, sub
# ... and those that move or cut its elements (a pad pads with zeros, the rest is held)
_SLICING = frozenset({"slice", "split", "pad", "rev"})


@dataclasses.dataclass(frozen=True)
class Pending:
    """A value of shape ``shape`` held as ``array`` [n, *shape]: the sum over dimension 0,
    which is split over mesh ``axes`` (major first; ``n`` their product)."""

    array: Any
    shape: tuple[int, ...]
    axes: tuple[int, ...]
    # the sum, once taken: every reader of a pending value gets the same reduced value
    # (XLA would otherwise reduce it once per reader)
    _sum: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def n(self) -> int:
        return int(self.array.shape[0])


def resolve(x: Any) -> Any:
    """The value itself: a ``Pending``'s sum over its slices; anything else as it is."""
    if not isinstance(x, Pending):
        return x
    if not x._sum:
        x._sum.append(x.array.sum(axis=0))
    return x._sum[0]


def pending_axes(spec: ShardingSpec) -> tuple[int, ...] | None:
    """The mesh axes of a spec's pending sum, or None where it cannot be held explicit
    (no pending sum, a max or min pending, or a strided dimension)."""
    if not spec.is_partial or any(r != SUM for _, r in spec.partial):
        return None
    if any(d.stride is not None for d in spec.dims):
        return None
    return tuple(a for a, _ in spec.partial)


@dataclasses.dataclass(frozen=True)
class Producer:
    """An equation that makes a carried pending sum: a ``dot_general``, convolution or
    ``reduce_sum`` whose operands' specs (``in_specs``, per equation input) split the
    contraction over the pending ``axes``."""

    axes: frozenset[int]
    in_specs: tuple[ShardingSpec | None, ...]


class PendingOps:
    """Runs equations on ``Pending`` values (see the module docstring).

    Args:
        jmesh: the ``jax.sharding.Mesh``.
        names: the plan's mesh axis names (index -> name).
        sharding: dim entries -> the ``NamedSharding`` of that layout, where an entry is a
            tuple of mesh axes (empty: whole); ``StridedRealizer``'s, cached.
    """

    def __init__(self, jmesh: Any, names: Sequence[str],
                 sharding: Callable[[Sequence[tuple[int, ...]]], Any]):
        self.jmesh, self.names = jmesh, tuple(names)
        self.sizes = dict(enumerate(jmesh.devices.shape))
        self._sharding = sharding

    def _block(self, axes: Sequence[int]) -> Any:
        """Inside a ``shard_map``: this device's block index along ``axes`` (major
        first)."""
        import jax

        k = 0
        for a in axes:
            k = k * self.sizes[a] + jax.lax.axis_index(self.names[a])
        return k

    def _first(self, axes: Sequence[int]) -> Any:
        """Inside a ``shard_map``: whether this device is the first along every one of
        ``axes`` (the one whose slice holds a whole value)."""
        import jax
        import jax.numpy as jnp

        return functools.reduce(jnp.logical_and,
                                [jax.lax.axis_index(self.names[a]) == 0 for a in axes])

    def _constrain(self, x: Any, entries: Sequence[tuple[int, ...]]) -> Any:
        import jax

        return jax.lax.with_sharding_constraint(x, self._sharding(entries))

    def _pspec(self, entries: Sequence[tuple[int, ...]]):
        return self._sharding(entries).spec

    # ----------------------------------------------------------------- layouts
    def layout(self, p: Pending, spec: ShardingSpec) -> Pending:
        """``p`` held over ``spec``'s pending axes and laid out as its dimensions."""
        want = pending_axes(spec)
        assert want is not None
        if set(want) != set(p.axes):
            p = self.regroup(p, want)
        dims = [tuple(d.axes) for d in spec.dims]
        return Pending(self._constrain(p.array, [p.axes] + dims), p.shape, p.axes)

    def regroup(self, p: Pending, want: Sequence[int]) -> Pending:
        """``p`` pending over ``want`` only: the slices of the axes it leaves are summed
        (their reduction happens here), and axes it adds hold the value in one slice."""
        keep = [a for a in p.axes if a in set(want)]
        if len(keep) < len(p.axes):
            arr = p.array.reshape(tuple(self.sizes[a] for a in p.axes) + p.shape)
            drop = tuple(i for i, a in enumerate(p.axes) if a not in set(want))
            arr = arr.sum(axis=drop)
            p = Pending(arr.reshape((-1,) + p.shape), p.shape, tuple(keep))
        new = tuple(a for a in want if a not in set(keep))
        if not new:
            return p
        return self.hold(resolve(p), tuple(p.axes) + new)

    def hold(self, value: Any, axes: tuple[int, ...],
             layout: ShardingSpec | None = None) -> Pending:
        """A whole value as a pending sum over ``axes`` (``extend`` from no axes), laid out
        as ``layout`` says it is; where that cannot be done in place, slice 0 holds it all
        (which moves it unless it is whole on those axes)."""
        import jax.numpy as jnp

        held = self.extend(Pending(value[None], tuple(value.shape), ()), axes,
                           None if layout is None else layout.dims)
        if held is not None:
            return held
        n = math.prod(self.sizes[a] for a in axes)
        first = jnp.arange(n).reshape((n,) + (1,) * value.ndim) == 0
        arr = jnp.where(first, value[None], jnp.zeros((), value.dtype))
        return Pending(arr, tuple(value.shape), tuple(axes))

    def extend(self, p: Pending, target: Sequence[int], dims: Sequence | None
               ) -> Pending | None:
        """``p`` pending over ``target`` (a superset of its axes, in that order), moving
        nothing: a new axis that splits a dimension of ``p`` (its minor axis there, per
        ``dims``, the layout ``p`` has) leaves that dimension, each slice keeping its own
        block in place and zeros elsewhere; a new axis that splits nothing keeps the value
        in its slice 0. None where ``dims`` is unknown or does not divide the shape, or a
        pending axis would still split a dimension."""
        import jax
        import jax.numpy as jnp

        new = [a for a in target if a not in p.axes]
        if not new:
            return self._aligned(p, tuple(target)) if set(target) == set(p.axes) else None
        whole = None if dims is None else self._dim_entries(dims, p.shape)
        if whole is None:
            return None
        entries = [list(e) for e in whole]
        if any(a in e for e in entries for a in p.axes):
            return None
        removed: dict[int, list[int]] = {}
        placed: set[int] = set()
        changed = True
        while changed:
            changed = False
            for a in new:
                if a in placed:
                    continue
                for d, e in enumerate(entries):
                    if e and e[-1] == a:
                        e.pop()
                        removed.setdefault(d, []).append(a)
                        placed.add(a)
                        changed = True
                        break
        if any(a in e for e in entries for a in target):
            return None
        first_only = [a for a in new if a not in placed]
        out_axes = tuple(p.axes) + tuple(new)
        in_entries = [tuple(p.axes)] + whole
        out_entries = [out_axes] + [tuple(e) for e in entries]
        sizes = self.sizes

        def body(x):
            blk = x[0]
            full, offs = list(blk.shape), [0] * blk.ndim
            for d, rem in removed.items():     # removed minor first: major first here
                full[d] = blk.shape[d] * math.prod(sizes[a] for a in rem)
                offs[d] = self._block(rem[::-1]) * blk.shape[d]
            out = jax.lax.dynamic_update_slice(jnp.zeros(full, blk.dtype), blk, offs)
            if first_only:
                out = jnp.where(self._first(first_only), out, jnp.zeros((), out.dtype))
            return out[None]

        arr = jax.shard_map(body, mesh=self.jmesh, in_specs=(self._pspec(in_entries),),
                            out_specs=self._pspec(out_entries), check_vma=False)(p.array)
        return self._aligned(Pending(arr, p.shape, out_axes), tuple(target))

    # ----------------------------------------------------------------- producers
    def produce(self, eqn: Any, invals: list, params: dict, prod: Producer) -> list | None:
        """The equation's result as a ``Pending``, or None where its operands do not split
        the contraction as the plan says (the caller then binds it as it is)."""
        name = prims.name(eqn)
        if len(eqn.outvars) != 1 or any(isinstance(v, Pending) for v in invals):
            return None
        def run(*xs):       # the equation itself, on one device's blocks
            return private.bind(eqn, list(xs), params)[0]

        if name == "dot_general" and len(invals) == 2:
            return self._dot(run, eqn, invals, params, prod)
        if name == "reduce_sum" and len(invals) == 1:
            return self._reduce(run, eqn, invals, params, prod)
        if name == "conv_general_dilated" and len(invals) == 2:
            return self._conv(run, eqn, invals, params, prod)
        if name == "gather" and len(invals) == 2:
            return self._gather(eqn, invals, params, prod)
        if name in ("scatter-add", "scatter_add") and len(invals) == 3:
            return self._scatter_add(eqn, invals, params, prod)
        return None

    def _entries(self, spec: ShardingSpec | None, shape: Sequence[int]
                 ) -> list[tuple[int, ...]] | None:
        """A whole (not pending) spec's mesh axes per dimension, or None where a
        ``shard_map`` cannot take it (strided, or a dimension its shards do not divide)."""
        if spec is None or spec.is_partial:
            return None
        return self._dim_entries(spec.dims, shape)

    def _dim_entries(self, dims: Sequence, shape: Sequence[int]
                     ) -> list[tuple[int, ...]] | None:
        """Each dimension's mesh axes, or None where one is strided or its shards do not
        divide it (``shard_map`` takes neither)."""
        if len(dims) != len(shape):
            return None
        out = []
        for size, d in zip(shape, dims):
            if d.stride is not None or size % math.prod(self.sizes[a] for a in d.axes):
                return None
            out.append(tuple(d.axes))
        return out

    def _local(self, fn: Callable, invals: Sequence[Any], entries: Sequence[list],
               out_entries: list, axes: tuple[int, ...], shape: tuple[int, ...]
               ) -> list | None:
        """``fn`` on each device's own blocks (a ``shard_map`` over the whole mesh), its
        partial result as slice ``i`` of a ``Pending`` over ``axes``: nothing moves."""
        import jax

        used = [a for e in out_entries for a in e] + list(axes)
        if len(used) != len(set(used)) or set(axes) == set():
            return None

        def body(*xs):
            return fn(*xs)[None]

        out = jax.shard_map(body, mesh=self.jmesh,
                            in_specs=tuple(self._pspec(e) for e in entries),
                            out_specs=self._pspec([tuple(axes)] + list(out_entries)),
                            check_vma=False)(*invals)
        return [Pending(out, tuple(shape), tuple(axes))]

    def _dot(self, run, eqn, invals, params, prod: Producer):
        lhs, rhs = invals
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        le, re_ = (self._entries(s, x.shape) for s, x in zip(prod.in_specs[:2], invals))
        if le is None or re_ is None:
            return None
        if any(le[a] != re_[b] for a, b in zip(lc, rc)) or \
                any(le[a] != re_[b] for a, b in zip(lb, rb)):
            return None
        axes = tuple(a for c in lc for a in le[c])
        if set(axes) != prod.axes:
            return None
        lfree = [d for d in range(lhs.ndim) if d not in set(lc) | set(lb)]
        rfree = [d for d in range(rhs.ndim) if d not in set(rc) | set(rb)]
        out_entries = [le[d] for d in lb] + [le[d] for d in lfree] + [re_[d] for d in rfree]
        shape = tuple(eqn.outvars[0].aval.shape)
        return self._local(run, invals, [le, re_], out_entries, axes, shape)

    def _conv(self, run, eqn, invals, params, prod: Producer):
        """A convolution whose contracted feature dimension (``lhs_spec[1]`` and
        ``rhs_spec[1]`` of its dimension numbers: the input channels, or the batch of a
        weight gradient) is split over the pending axes, and its window dimensions whole."""
        if params.get("feature_group_count", 1) != 1 or params.get("batch_group_count", 1) != 1:
            return None
        lhs, rhs = invals
        dn = params["dimension_numbers"]
        le, re_ = (self._entries(s, x.shape) for s, x in zip(prod.in_specs[:2], invals))
        if le is None or re_ is None or le[dn.lhs_spec[1]] != re_[dn.rhs_spec[1]]:
            return None
        if any(le[d] for d in dn.lhs_spec[2:]) or any(re_[d] for d in dn.rhs_spec[2:]):
            return None
        axes = le[dn.lhs_spec[1]]
        if set(axes) != prod.axes:
            return None
        shape = tuple(eqn.outvars[0].aval.shape)
        out_entries: list = [()] * len(shape)
        out_entries[dn.out_spec[0]] = le[dn.lhs_spec[0]]
        out_entries[dn.out_spec[1]] = re_[dn.rhs_spec[0]]
        return self._local(run, invals, [le, re_], out_entries, axes, shape)

    def _gather(self, eqn, invals, params, prod: Producer):
        """A ``gather`` from a table split over the pending axes along dimensions it indexes
        with slices of size 1 (a vocabulary-parallel embedding, ``take_along_axis`` from
        split logits): each device gathers from its own block with its indices offset by
        the block's start; an index outside the block gives zero, so the slices sum to the
        row. Where the gather fills (``mode`` fill), slice 0 holds the fill value where an
        index falls outside the whole table; where it clips, the indices are clipped to
        the whole table first. Other split dimensions: whole slices of the table (the
        output's offset dimensions) and batching dimensions split as the indices are."""
        import jax
        import jax.numpy as jnp

        operand, idx = invals
        dn, sizes = params["dimension_numbers"], params["slice_sizes"]
        mode = params.get("mode")
        modes = jax.lax.GatherScatterMode
        if mode not in (modes.FILL_OR_DROP, modes.CLIP, modes.PROMISE_IN_BOUNDS) or \
                not jnp.issubdtype(operand.dtype, jnp.floating):
            return None       # (an integer table's default fill is not NaN)
        oe, ie = (self._entries(s, x.shape) for s, x in zip(prod.in_specs[:2], invals))
        if oe is None or ie is None or ie[-1]:
            return None
        index_map = tuple(dn.start_index_map)
        batching = tuple(dn.operand_batching_dims)
        axes = tuple(a for d in index_map for a in oe[d])
        if set(axes) != prod.axes or any(oe[d] and sizes[d] != 1 for d in index_map):
            return None
        for d, e in enumerate(oe):
            if not e or d in index_map:
                continue
            if d in batching:
                if ie[dn.start_indices_batching_dims[batching.index(d)]] != e:
                    return None
            elif d in dn.collapsed_slice_dims or sizes[d] != operand.shape[d]:
                return None
        shape = tuple(eqn.outvars[0].aval.shape)
        offset_of = iter(d for d in range(operand.ndim)
                         if d not in dn.collapsed_slice_dims and d not in batching)
        batch_of = iter(range(idx.ndim - 1))
        out_entries = []
        for k in range(len(shape)):
            if k in dn.offset_dims:
                d = next(offset_of)
                out_entries.append(() if d in index_map else oe[d])
            else:
                out_entries.append(ie[next(batch_of)])
        used = [a for e in out_entries for a in e] + list(axes)
        if len(used) != len(set(used)):
            return None
        top = jnp.asarray([operand.shape[d] - sizes[d] for d in index_map])
        local_params = {**params, "mode": modes.FILL_OR_DROP}
        fills = mode == modes.FILL_OR_DROP
        fill = params.get("fill_value")
        fill = jnp.nan if fill is None and fills else fill
        batch_out = [k for k in range(len(shape)) if k not in dn.offset_dims]

        def body(table, ix):
            inside = jnp.all((ix >= 0) & (ix <= top), axis=-1)
            if not fills:
                ix = jnp.clip(ix, 0, top)
            starts = [self._block(oe[d]) * table.shape[d] for d in index_map]
            got = private.bind(eqn, [table, ix - jnp.asarray(starts, ix.dtype)],
                               {**local_params, "fill_value": 0})[0]
            if fills:
                held = jax.lax.broadcast_in_dim(inside, got.shape, tuple(batch_out))
                got = jnp.where(held | ~self._first(axes), got, jnp.asarray(fill, got.dtype))
            return got[None]

        out = jax.shard_map(body, mesh=self.jmesh,
                            in_specs=(self._pspec(oe), self._pspec(ie)),
                            out_specs=self._pspec([tuple(axes)] + out_entries),
                            check_vma=False)(operand, idx)
        return [Pending(out, shape, tuple(axes))]

    def _scatter_add(self, eqn, invals, params, prod: Producer):
        """A ``scatter-add`` whose updates (and indices) are split over the pending axes
        along their scatter dimensions (an embedding's gradient from a split batch): each
        device adds its own updates into the table, slice 0 into the table it starts from
        and the others into zeros, so the slices sum to the whole scatter. The table's
        window dimensions may be split as the updates' are."""
        import jax
        import jax.numpy as jnp

        operand, idx, upd = invals
        dn = params["dimension_numbers"]
        table = prod.in_specs[0]
        table = None if table is None else table.without_partial()
        oe = self._entries(table, operand.shape)
        ie, ue = (self._entries(s, x.shape) for s, x in zip(prod.in_specs[1:3], invals[1:]))
        if oe is None or ie is None or ue is None or ie[-1]:
            return None
        window = tuple(dn.update_window_dims)
        scatter = [d for d in range(upd.ndim) if d not in window]
        if len(scatter) != idx.ndim - 1 or any(ue[d] != ie[k] for k, d in enumerate(scatter)):
            return None
        axes = tuple(a for d in scatter for a in ue[d])
        if set(axes) != prod.axes or any(oe[d] for d in dn.operand_batching_dims):
            return None
        op_window = [d for d in range(operand.ndim)
                     if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
        for wd, od in zip(window, op_window):
            if ue[wd] != oe[od] or (oe[od] and (od in dn.scatter_dims_to_operand_dims or
                                               upd.shape[wd] != operand.shape[od])):
                return None
        used = [a for e in oe for a in e] + list(axes)
        if len(used) != len(set(used)):
            return None
        def body(base, ix, up):
            base = jnp.where(self._first(axes), base, jnp.zeros((), base.dtype))
            return private.bind(eqn, [base, ix, up], params)[0][None]

        out = jax.shard_map(body, mesh=self.jmesh,
                            in_specs=(self._pspec(oe), self._pspec(ie), self._pspec(ue)),
                            out_specs=self._pspec([tuple(axes)] + oe),
                            check_vma=False)(operand, idx, upd)
        return [Pending(out, tuple(eqn.outvars[0].aval.shape), tuple(axes))]

    def _reduce(self, run, eqn, invals, params, prod: Producer):
        (x,) = invals
        red = tuple(params["axes"])
        e = self._entries(prod.in_specs[0], x.shape)
        if e is None:
            return None
        axes = tuple(a for d in red for a in e[d])
        if set(axes) != prod.axes:
            return None
        out_entries = [e[d] for d in range(x.ndim) if d not in set(red)]
        shape = tuple(eqn.outvars[0].aval.shape)
        return self._local(run, invals, [e], out_entries, axes, shape)

    # ----------------------------------------------------------------- pass-through
    def through(self, eqn: Any, invals: list, params: dict,
                layouts: Sequence[ShardingSpec | None] = (),
                target: Sequence[int] | None = None,
                takes: Sequence[bool | None] = ()) -> list | None:
        """The equation on its pending operands slice by slice, or None where a sum cannot
        pass through it (the caller resolves the operands and binds it). ``layouts``: each
        input's spec as produced; ``target``: the pending axes the plan has the equation
        work over (default: its first pending operand's); ``takes``: whether the plan
        has it read each input pending. Operands pending over fewer axes, whole ones
        added in and whole ones the plan reads pending are held over ``target`` in place
        where their layout allows (``extend``)."""
        import jax
        import jax.numpy as jnp

        name = prims.name(eqn)
        pend = [v for v in invals if isinstance(v, Pending)]
        if not all(jnp.issubdtype(v.array.dtype, jnp.floating) for v in pend):
            return None
        if not pend and not target:
            return None
        axes = tuple(target) if target else pend[0].axes
        if (len(eqn.outvars) != 1 and name != "split") or not all(
                jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.outvars):
            return None

        def lay(j):
            return layouts[j] if j is not None and j < len(layouts) else None

        def taken(j, v):     # a whole input the plan reads pending: held so
            if isinstance(v, Pending) or not (j < len(takes) and takes[j]):
                return v
            if not hasattr(v, "ndim") or v.ndim != len(eqn.invars[j].aval.shape) \
                    or not jnp.issubdtype(v.dtype, jnp.floating):
                return v
            return self.hold(v, axes, lay(j))

        if name in _UNARY or name in _SLICING or name in ("mul", "div"):
            invals = [taken(j, v) for j, v in enumerate(invals)]
        if not any(isinstance(v, Pending) for v in invals) and name not in _ADDITIVE \
                and name not in ("select_n", "concatenate"):
            return None

        def over(j, v):      # a pending operand over exactly ``axes``
            if set(v.axes) - set(axes):
                v = self.regroup(v, [a for a in v.axes if a in set(axes)] or axes)
            if set(v.axes) == set(axes):
                return self._aligned(v, axes)
            spec = lay(j)
            got = self.extend(v, axes, None if spec is None else spec.dims)
            return got if got is not None else self.regroup(v, axes)

        invals = [over(j, v) if isinstance(v, Pending) else v for j, v in enumerate(invals)]
        shape = tuple(eqn.outvars[0].aval.shape)
        n = math.prod(self.sizes[a] for a in axes)

        def whole(v):      # a whole operand beside the slices: every slice sees it
            return v[None] if getattr(v, "ndim", 0) else v

        dtype = eqn.outvars[0].aval.dtype

        def once(j, v, like=shape):   # a whole addend, held pending: its slices sum to it
            spec = lay(j)
            v = jnp.asarray(v, dtype)
            if v.ndim != len(like):      # a scalar: slice 0 holds it
                v, spec = v.reshape((1,) * len(like)), None
            held = self.hold(v, axes, spec).array   # broadcast (size-1 dims) after
            return jnp.broadcast_to(held, (n,) + tuple(like))

        if name in _SLICING and isinstance(invals[0], Pending):
            outs = self._cut(name, invals, params, once)
            if outs is None or [tuple(o.shape) for o in outs] != \
                    [(n,) + tuple(v.aval.shape) for v in eqn.outvars]:
                return None
            return [Pending(o, tuple(o.shape[1:]), axes) for o in outs]
        if name == "concatenate":
            parts = [v.array if isinstance(v, Pending) else
                     once(j, v, tuple(eqn.invars[j].aval.shape)) for j, v in enumerate(invals)]
            out = jax.lax.concatenate(parts, params["dimension"] + 1)
            return [Pending(out, shape, axes)] if tuple(out.shape) == (n,) + shape else None

        if name in _UNARY and len(invals) == 1:
            x = invals[0].array
            if name in ("neg",):
                out = -x
            elif name in ("copy", "copy_p"):
                out = x
            elif name == "reduce_sum":
                out = x.sum(axis=tuple(d + 1 for d in params["axes"]))
            elif name == "reshape":
                if params.get("dimensions") is not None:
                    return None
                out = x.reshape((n,) + tuple(params["new_sizes"]))
            elif name == "transpose":
                out = jax.lax.transpose(x, (0,) + tuple(d + 1 for d in params["permutation"]))
            elif name == "broadcast_in_dim":
                out = jax.lax.broadcast_in_dim(
                    x, (n,) + tuple(params["shape"]),
                    (0,) + tuple(d + 1 for d in params["broadcast_dimensions"]))
            elif name == "squeeze":
                out = jax.lax.squeeze(x, tuple(d + 1 for d in params["dimensions"]))
            elif name == "convert_element_type":
                if not jnp.issubdtype(params["new_dtype"], jnp.floating):
                    return None
                out = x.astype(params["new_dtype"])
            else:
                return None
        elif name in _ADDITIVE and len(invals) == 2:
            a, b = (v.array if isinstance(v, Pending) else once(j, v)
                    for j, v in enumerate(invals))
            out = a - b if name == "sub" else a + b
        elif name in ("mul", "div") and len(invals) == 2:
            a, b = invals
            if isinstance(b, Pending) and (name == "div" or isinstance(a, Pending)):
                return None
            if isinstance(a, Pending):
                out = a.array * whole(b) if name == "mul" else a.array / whole(b)
            else:
                out = whole(a) * b.array
        elif name == "select_n" and not isinstance(invals[0], Pending):
            which = whole(invals[0])
            cases = [v.array if isinstance(v, Pending) else once(j, v)
                     for j, v in enumerate(invals) if j > 0]
            out = jax.lax.select_n(jnp.broadcast_to(which, (n,) + shape)
                                   if getattr(which, "ndim", 0) else which, *cases)
        else:
            return None
        if tuple(out.shape) != (n,) + shape:
            return None
        return [Pending(out, shape, axes)]

    @staticmethod
    def _cut(name: str, invals: list, params: dict, once: Callable) -> list | None:
        """A ``slice``, ``split``, ``pad`` or ``rev`` of a pending operand's slices (its
        leading dimension untouched). A pad pads each slice with zeros, and slice 0
        holds the padding value (``once``)."""
        import jax
        import jax.numpy as jnp

        x = invals[0].array
        if name == "slice":
            strides = params.get("strides")
            return [jax.lax.slice(x, (0,) + tuple(params["start_indices"]),
                                  (x.shape[0],) + tuple(params["limit_indices"]),
                                  None if strides is None else (1,) + tuple(strides))]
        if name == "split":
            return list(jax.lax.split(x, tuple(params["sizes"]), axis=params["axis"] + 1))
        if name == "rev":
            return [jax.lax.rev(x, tuple(d + 1 for d in params["dimensions"]))]
        if name == "pad" and len(invals) == 2 and not isinstance(invals[1], Pending):
            config = ((0, 0, 0),) + tuple(tuple(c) for c in params["padding_config"])
            out = jax.lax.pad(x, jnp.zeros((), x.dtype), config)
            try:
                if float(invals[1]) == 0.0:
                    return [out]
            except (TypeError, jax.errors.ConcretizationTypeError):
                pass       # a traced padding value
            edge = jax.lax.pad(jnp.zeros(x.shape[1:], x.dtype),
                               jnp.asarray(invals[1], x.dtype), config[1:])
            return [out + once(None, edge, tuple(edge.shape))]
        return None

    def _aligned(self, p: Pending, axes: tuple[int, ...]) -> Pending:
        """``p`` with its slices in the order of ``axes`` (the same set)."""
        if p.axes == tuple(axes):
            return p
        arr = p.array.reshape(tuple(self.sizes[a] for a in p.axes) + p.shape)
        perm = tuple(p.axes.index(a) for a in axes)
        import jax

        arr = jax.lax.transpose(arr, perm + tuple(range(len(perm), arr.ndim)))
        return Pending(arr.reshape((-1,) + p.shape), p.shape, tuple(axes))

