"""Strided specs in the compiled program: values kept with their strided dimension split.

A strided split of a dimension of size ``D`` over ``n`` shards with stride ``t`` puts element
``e`` on shard ``(e // t) % n`` (``planner.spec``). No tiled sharding expresses that on the
``D``-sized dimension, but on the same data reshaped to ``(D / (n t), n, t)`` it is the
plain split of the middle dimension. So a strided value is *held split*: a ``Split`` keeps
the array in that shape (with the tiled sharding as a constraint) and its logical shape.
While it is split:

* elementwise equations run on the split arrays (every operand of the logical shape is
  reshaped the same way; scalars stay as they are), so the result stays split and no
  flat intermediate exists for XLA to re-layout;
* a ``reshape`` equation reads the split array directly: reshape(reshape(x)) is one reshape
  to XLA, e.g. ``[B, 3, heads, hd]`` → ``[B, 3H]`` → ``[B, 3, heads, hd]`` is the identity,
  and a split of the heads passes through with no collective;
* any other equation gets the value back in its logical shape (``unsplit``), and so do the
  program's results. Where the planner allows strided specs only on elementwise and reshape
  values (``BuildOptions.strided_interior_only``, as ``auto_parallel`` plans) that is only
  where the plan itself reshards.

Example:
    >>> import jax.numpy as jnp
    >>> from rhino.planner.spec import ShardingSpec, DimSharding
    >>> spec = ShardingSpec((DimSharding(()), DimSharding((0,), 64)))
    >>> split_layout(spec, (2, 1536), {0: 8})
    ((2, 3, 8, 64), [(), (), (0,), ()])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from rhino.errors import RhinoError
from rhino.jaxpr import primitives as prims
from rhino.jaxpr.private import bind
from rhino.planner.spec import ShardingSpec

from rhino.hlo_passes.pending import Pending, PendingOps, Producer, pending_axes, resolve

# jaxpr primitives applied element by element, whose operands (other than scalars) all
# have the result's shape.
ELEMENTWISE = prims.ELEMENTWISE


def is_strided(spec: Any) -> bool:
    return isinstance(spec, ShardingSpec) and any(d.stride is not None for d in spec.dims)


def split_layout(spec: ShardingSpec, shape: Sequence[int], axis_sizes: Mapping[int, int]
                 ) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """(split shape, mesh axes per split dim): each strided dim ``D`` (``n`` shards, stride
    ``t``) becomes ``(D / (n t), n, t)`` with its axes on the middle dim."""
    out_shape: list[int] = []
    axes: list[tuple[int, ...]] = []
    spec = spec.without_partial()
    if len(spec.dims) != len(shape):
        raise RhinoError(f"strided spec {spec.to_str()}: expected {len(spec.dims)} dims, "
                         f"found shape {tuple(shape)}")
    for size, d in zip(shape, spec.dims):
        if d.stride is None:
            out_shape.append(int(size))
            axes.append(tuple(d.axes))
            continue
        n = 1
        for a in d.axes:
            n *= int(axis_sizes[a])
        if size % (n * d.stride):
            raise RhinoError(f"strided spec {spec.to_str()}: dim of size {size} is not "
                             f"divisible by {n} shards x stride {d.stride}")
        out_shape += [int(size) // (n * d.stride), n, int(d.stride)]
        axes += [(), tuple(d.axes), ()]
    return tuple(out_shape), axes


@dataclasses.dataclass(frozen=True)
class Split:
    """A value of logical shape ``shape`` held as ``array`` in a split shape."""

    array: Any
    shape: tuple[int, ...]


def unsplit(x: Any) -> Any:
    return x.array.reshape(x.shape) if isinstance(x, Split) else x


class StridedRealizer:
    """Constraints (blocked, strided or pending) and the binder that keeps strided values
    split and carried pending sums explicit (``hlo_passes.pending``).

    Args:
        jmesh: the ``jax.sharding.Mesh``.
        axis_names: the plan's mesh axis names (index -> name).
    """

    def __init__(self, jmesh, axis_names: Sequence[str]):
        self.jmesh, self.names = jmesh, tuple(axis_names)
        self.sizes = dict(enumerate(jmesh.devices.shape))
        self._shardings: dict = {}
        self.producers: Mapping[tuple, Producer] = {}
        self.layouts: Mapping[tuple, Sequence] = {}
        self.pending = PendingOps(jmesh, self.names, self._sharding)

    def _sharding(self, axes: Sequence[tuple[int, ...]]):
        from jax.sharding import NamedSharding, PartitionSpec

        key = tuple(axes)
        s = self._shardings.get(key)
        if s is None:
            entries = [None if not a else self.names[a[0]] if len(a) == 1 else
                       tuple(self.names[i] for i in a) for a in key]
            while entries and entries[-1] is None:
                entries.pop()
            s = self._shardings[key] = NamedSharding(self.jmesh, PartitionSpec(*entries))
        return s

    def constrain(self, x: Any, spec: ShardingSpec) -> Any:
        """``x`` (array, ``Split`` or ``Pending``) laid out as ``spec``: strided specs give a
        ``Split``; a pending spec keeps a ``Pending`` pending (anything else is reduced)."""
        import jax

        if isinstance(x, Pending):
            if pending_axes(spec) is not None:
                return self.pending.layout(x, spec)
            x = resolve(x)
        if not is_strided(spec):
            arr = unsplit(x)
            axes = [tuple(d.axes) for d in spec.without_partial().dims]
            return jax.lax.with_sharding_constraint(arr, self._sharding(axes))
        shape = x.shape if isinstance(x, Split) else tuple(x.shape)
        split_shape, axes = split_layout(spec, shape, self.sizes)
        if isinstance(x, Split) and tuple(x.array.shape) == split_shape:
            arr = x.array
        else:
            arr = unsplit(x).reshape(split_shape)
        return Split(jax.lax.with_sharding_constraint(arr, self._sharding(axes)), shape)

    def bind(self, eqn, invals: list, params: dict, path: tuple[int, ...] = ()) -> list:
        """Run ``eqn``; split inputs stay split through elementwise equations and are read
        directly by reshapes (see the module docstring); pending sums pass through linear
        equations, and the plan's producers of carried pending sums make them explicit
        (``hlo_passes.pending``)."""
        pending = any(isinstance(v, Pending) for v in invals)
        split = any(isinstance(v, Split) for v in invals)
        if path in self.producers and not pending and not split:
            outs = self.pending.produce(eqn, invals, params, self.producers[path])
            if outs is not None:
                return outs
        if pending or path in self.layouts:
            if not split:
                target, layouts, takes = self.layouts.get(path, (None, (), ()))
                outs = self.pending.through(eqn, invals, params, layouts, target, takes)
                if outs is not None:
                    return outs
            invals = [resolve(v) for v in invals]
        splits = [v for v in invals if isinstance(v, Split)]
        if splits:
            first = splits[0]
            name = prims.name(eqn)
            if name in ELEMENTWISE and all(s.shape == first.shape and
                                           s.array.shape == first.array.shape for s in splits):
                args = []
                for v in invals:
                    if isinstance(v, Split):
                        args.append(v.array)
                    elif tuple(getattr(v, "shape", ())) == first.shape:
                        args.append(v.reshape(first.array.shape))
                    elif tuple(getattr(v, "shape", ())) == ():
                        args.append(v)
                    else:
                        break
                else:
                    outs = bind(eqn, args, params)
                    return [Split(o, first.shape) if tuple(o.shape) == first.array.shape
                            else o for o in outs]
            elif name == prims.RESHAPE and len(invals) == 1:
                return bind(eqn, [first.array], params)
            invals = [unsplit(v) for v in invals]
        return bind(eqn, invals, params)

    def hooks(self, out_specs: Mapping[tuple, ShardingSpec],
              in_specs: Mapping[tuple, ShardingSpec],
              producers: Mapping[tuple, Producer] | None = None,
              layouts: Mapping[tuple, Sequence] | None = None
              ) -> tuple[Callable, Callable, Callable, Callable]:
        """(out hook, in hook, binder, finish) for ``ScopedFunction.with_hook``;
        ``producers``: equation path -> how it makes a carried pending sum; ``layouts``:
        equation path -> (the pending axes it works over, each input's spec as produced,
        whether the plan reads each input pending), for ``PendingOps.through``."""
        self.producers = dict(producers or {})
        self.layouts = dict(layouts or {})

        def hook(path, k, x):
            spec = out_specs.get((path, k))
            return x if spec is None else self.constrain(x, spec)

        def in_hook(path, j, x):
            spec = in_specs.get((path, j))
            return x if spec is None else self.constrain(x, spec)

        def finish(x):
            return unsplit(resolve(x))

        return hook, in_hook, self.bind, finish
