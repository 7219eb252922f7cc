"""Tensor sharding specs (Rhino paper §4.1): per dimension the mesh axes and the stride.

A ``ShardingSpec`` says how one tensor is laid out on an ``AbstractMesh``:

* per tensor dimension a ``DimSharding(axes, stride)``: the mesh axes the dimension is split
  over (outermost first; ``()`` = not split) and the *stride*, the number of consecutive
  elements per chunk. With ``n`` = product of the axes' sizes, element ``e`` of a dimension of
  size ``D`` lives on shard ``(e // stride) % n`` (shard index mixed-radix over ``axes``,
  first axis most significant). ``stride=None`` means the maximum ``D / n``: plain blocked
  sharding. A smaller stride deals chunks of ``stride`` elements round-robin to the shards;
* ``partial``: mesh axes over which the value is a pending reduction (each device holds a
  term of a ``"sum"``, or a candidate of a ``"max"``/``"min"``);
* ``partial_groups``: which pending axes one collective reduces together. XLA reduces a
  sum left by one split dimension (a dot contracting a dimension split over ``x`` and
  ``y``) with one all-reduce over the group, but sums left by different dimensions (a
  reduction over a dimension split on ``x`` and another split on ``y``) one axis at a
  time. A group is written ``P(sum@x+y)``; axes in no group (``P(sum@x,sum@y)``) are
  reduced one at a time. Grouping says how the reduction runs, not where data lies: the
  axis roles below ignore it (``collectives.reshard`` reads it).

Every mesh axis is used at most once per spec. Replicated = no axes, no partial.

Uneven splits. A blocked split of a dimension whose size ``D`` the ``n`` shards do not
divide is what XLA's partitioner runs by padding: each shard holds ``ceil(D / n)``
elements, the last ones padding. Such a spec is valid only where asked for
(``problems(..., uneven=True)``): inside a program, for values that are neither its
arguments nor its results, since JAX refuses an uneven sharding at a ``jax.jit`` boundary
(``IndivisibleError``). Its per-axis strides and local shape are those of the padded
dimension ``padded_shape``; strided uneven splits are not offered.

Per-axis view. Equivalently, each mesh axis ``a`` has a *role*: nothing, ``("partial", r)``
or ``("dim", d, s)`` where ``s`` is the axis' own stride: element ``e`` of dim ``d`` is on
coordinate ``(e // s) % n_a`` along ``a``. For axes ``(a0, .., ak)`` on one dim with stride
``t`` the axis strides nest: ``s_ak = t``, ``s_a(k-1) = t * n_ak``, ... Two specs place every
element on the same devices iff all axis roles agree; this is what resharding and reshape
mapping (``map_reshape``) work on.

Example:
    >>> from rhino.planner.mesh import AbstractMesh
    >>> mesh = AbstractMesh((4,))
    >>> s = ShardingSpec((DimSharding((0,)), DimSharding()))
    >>> str(s), s.local_shape((8, 6), mesh)
    ('S[x]·R', (2, 6))
    >>> t = ShardingSpec.parse("R·S[x/s16]·R·P(sum@x)")
    Traceback (most recent call last):
    ...
    rhino.planner.spec.InvalidSpecError: spec 'R·S[x/s16]·R·P(sum@x)': expected each mesh axis used at most once, found axis 0 used twice
    >>> str(ShardingSpec.parse("R·S[x/s16]"))
    'R·S[x/s16]'
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Sequence

from rhino.errors import RhinoError
from rhino.planner.mesh import AbstractMesh, default_axis_names

REDUCERS = ("sum", "max", "min")

# An axis role: None (not used), ("dim", dim, axis_stride) or ("partial", reducer).
AxisRole = Any


class InvalidSpecError(RhinoError, ValueError):
    """A spec that is malformed, or does not fit a tensor shape / mesh.

    The message names the spec, what was expected and what was found.
    """


@dataclasses.dataclass(frozen=True)
class DimSharding:
    """How one tensor dimension is split.

    Attributes:
        axes: mesh axes the dimension is split over, outermost first (``()``: not split).
        stride: consecutive elements per chunk; None = maximum (blocked sharding).
    """

    axes: tuple[int, ...] = ()
    stride: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(int(a) for a in self.axes))
        if self.stride is not None:
            if not self.axes:
                raise InvalidSpecError(f"DimSharding: expected stride None for an unsplit "
                                       f"dimension, found stride {self.stride}")
            if int(self.stride) < 1:
                raise InvalidSpecError(f"DimSharding: expected stride >= 1, found "
                                       f"{self.stride}")
            object.__setattr__(self, "stride", int(self.stride))

    @property
    def is_split(self) -> bool:
        return bool(self.axes)

    def to_str(self, names: Sequence[str]) -> str:
        if not self.axes:
            return "R"
        body = ",".join(names[a] for a in self.axes)
        return f"S[{body}/s{self.stride}]" if self.stride is not None else f"S[{body}]"


_REPLICATED_DIM = DimSharding()


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingSpec:
    """The layout of one tensor on a mesh (see the module docstring).

    Attributes:
        dims: one ``DimSharding`` per tensor dimension.
        partial: ``(axis, reducer)`` pairs, sorted by axis: the value is a pending
            ``reducer`` ("sum", "max", "min") over those mesh axes.
        partial_groups: sorted tuples of two or more pending axes of one reducer that one
            collective reduces together (module docstring); other pending axes are
            reduced one at a time.

    Raises:
        InvalidSpecError: a mesh axis used twice, an unknown reducer, or a group that is
            not two or more pending axes of one reducer, disjoint from the other groups.
    """

    dims: tuple[DimSharding, ...]
    partial: tuple[tuple[int, str], ...] = ()
    partial_groups: tuple[tuple[int, ...], ...] = ()
    _key: tuple = dataclasses.field(init=False, repr=False, compare=False)
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        dims = tuple(d if isinstance(d, DimSharding) else DimSharding(*d) for d in self.dims)
        partial = tuple(sorted((int(a), str(r)) for a, r in self.partial))
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "partial", partial)
        used: list[int] = [a for d in dims for a in d.axes] + [a for a, _ in partial]
        if len(set(used)) != len(used):
            twice = next(a for a in used if used.count(a) > 1)
            raise InvalidSpecError(f"spec {self}: expected each mesh axis used at most once, "
                                   f"found axis {twice} used twice")
        for a, r in partial:
            if r not in REDUCERS:
                raise InvalidSpecError(f"spec {self}: expected a reducer in {REDUCERS}, "
                                       f"found {r!r}")
        if any(a < 0 for a in used):
            raise InvalidSpecError(f"spec {self}: expected axis indices >= 0, found {used}")
        groups = _check_groups(self, self.partial_groups, dict(partial))
        object.__setattr__(self, "partial_groups", groups)
        key = (tuple((d.axes, d.stride) for d in dims), partial, groups)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))

    @classmethod
    def unchecked(cls, dims: tuple[DimSharding, ...],
                 partial: tuple[tuple[int, str], ...] = (),
                 partial_groups: tuple[tuple[int, ...], ...] = ()) -> "ShardingSpec":
        """Construct without validation (callers guarantee canonical, valid fields)."""
        obj = object.__new__(cls)
        key = (tuple((d.axes, d.stride) for d in dims), partial, partial_groups)
        object.__setattr__(obj, "dims", dims)
        object.__setattr__(obj, "partial", partial)
        object.__setattr__(obj, "partial_groups", partial_groups)
        object.__setattr__(obj, "_key", key)
        object.__setattr__(obj, "_hash", hash(key))
        return obj

    # -- identity ---------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardingSpec):
            return NotImplemented
        return self._hash == other._hash and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    # -- constructors -----------------------------------------------------------------------
    @classmethod
    def replicated(cls, rank: int) -> "ShardingSpec":
        """The replicated spec of a rank-``rank`` tensor."""
        return cls((_REPLICATED_DIM,) * rank)

    @classmethod
    def sharded(cls, rank: int, splits: dict[int, Sequence[int] | int],
                strides: dict[int, int] | None = None,
                partial: Sequence[tuple[int, str]] = (),
                partial_groups: Sequence[Sequence[int]] = ()) -> "ShardingSpec":
        """Build a spec from ``{dim: axes}`` (an int = one axis), optional strides, and
        pending reductions (``partial_groups``: axes reduced together).

        Example:
            >>> str(ShardingSpec.sharded(2, {1: 0}, partial=[(1, "sum")]))
            'R·S[x]·P(sum@y)'
        """
        strides = strides or {}
        dims = []
        for d in range(rank):
            axes = splits.get(d, ())
            axes = (axes,) if isinstance(axes, int) else tuple(axes)
            dims.append(DimSharding(axes, strides.get(d)))
        for d in splits:
            if not 0 <= d < rank:
                raise InvalidSpecError(f"sharded(): expected dims in 0..{rank - 1}, found {d}")
        return cls(tuple(dims), tuple(partial), tuple(tuple(g) for g in partial_groups))

    # -- queries ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_replicated(self) -> bool:
        return not self.partial and not any(d.axes for d in self.dims)

    @property
    def is_partial(self) -> bool:
        return bool(self.partial)

    @property
    def used_axes(self) -> tuple[int, ...]:
        """Every mesh axis the spec uses (dims and partial), ascending."""
        return tuple(sorted([a for d in self.dims for a in d.axes] +
                            [a for a, _ in self.partial]))

    @property
    def split_axes(self) -> tuple[int, ...]:
        """Mesh axes that split some dimension, ascending."""
        return tuple(sorted(a for d in self.dims for a in d.axes))

    def without_partial(self) -> "ShardingSpec":
        """The same spec with the pending reductions done."""
        return ShardingSpec(self.dims) if self.partial else self

    def reduction_groups(self, axes: Sequence[int]) -> list[tuple[int, ...]]:
        """The collectives that reduce the pending ``axes`` (a subset of the partial
        ones): a group wholly among them is one collective, every other axis its own.

        Example:
            >>> s = ShardingSpec.parse("R·P(sum@x+y,sum@z)")
            >>> s.reduction_groups((0, 1, 2)), s.reduction_groups((1, 2))
            ([(0, 1), (2,)], [(1,), (2,)])
        """
        want = set(axes)
        out = [g for g in self.partial_groups if want.issuperset(g)]
        done = {a for g in out for a in g}
        out += [(a,) for a in sorted(want - done)]
        return sorted(out)

    def dim_shards(self, dim: int, mesh: AbstractMesh) -> int:
        """Number of shards of dimension ``dim``."""
        return mesh.group_size(self.dims[dim].axes)

    def shard_count(self, mesh: AbstractMesh) -> int:
        """Number of distinct shards (product of the sizes of the splitting axes)."""
        return math.prod(mesh.shape[a] for d in self.dims for a in d.axes)

    def local_shape(self, global_shape: Sequence[int], mesh: AbstractMesh) -> tuple[int, ...]:
        """Per-device shape of a tensor of ``global_shape`` (the spec must be valid for it,
        uneven splits allowed: their shards hold ``ceil(D / n)`` elements, padding
        included)."""
        self.check(global_shape, mesh, uneven=True)
        return tuple(-(-s // mesh.group_size(d.axes)) for s, d in zip(global_shape, self.dims))

    def uneven_dims(self, global_shape: Sequence[int], mesh: AbstractMesh) -> tuple[int, ...]:
        """The dimensions split into shards that do not divide their size (module doc)."""
        return tuple(i for i, (size, d) in enumerate(zip(global_shape, self.dims))
                     if d.axes and size % mesh.group_size(d.axes))

    def padded_shape(self, global_shape: Sequence[int], mesh: AbstractMesh) -> tuple[int, ...]:
        """``global_shape`` with each unevenly split dimension padded to whole shards."""
        out = []
        for size, d in zip(global_shape, self.dims):
            n = mesh.group_size(d.axes) if d.axes else 1
            out.append(-(-size // n) * n)
        return tuple(out)

    def problems(self, global_shape: Sequence[int], mesh: AbstractMesh,
                 uneven: bool = False) -> list[str]:
        """Why the spec does not fit ``global_shape`` on ``mesh`` (empty list: it fits).

        ``uneven``: accept blocked splits the shards do not divide, of a dimension longer
        than its shard count (XLA pads them; only inside a program, see the module doc)."""
        out = []
        if len(global_shape) != self.rank:
            return [f"expected a rank-{self.rank} tensor, found shape {tuple(global_shape)}"]
        for a in self.used_axes:
            if a >= mesh.ndim:
                out.append(f"expected axes < {mesh.ndim} for a {mesh.ndim}-D mesh, found "
                           f"axis {a}")
        if out:
            return out
        for i, (size, d) in enumerate(zip(global_shape, self.dims)):
            n = mesh.group_size(d.axes)
            if size % n and not (uneven and d.stride is None and size > n):
                out.append(f"dim {i} of size {size}: expected divisible by its {n} shards"
                           + ("" if uneven else " (an uneven split, padded, is planned only "
                              "inside a program: JAX requires a step's arguments and "
                              "results to divide)"))
            elif d.stride is not None and size % (n * d.stride):
                out.append(f"dim {i} of size {size}: expected divisible by shards x stride = "
                           f"{n} x {d.stride}")
        return out

    def is_valid(self, global_shape: Sequence[int], mesh: AbstractMesh,
                 uneven: bool = False) -> bool:
        return not self.problems(global_shape, mesh, uneven)

    def check(self, global_shape: Sequence[int], mesh: AbstractMesh,
              uneven: bool = False) -> None:
        """Raise ``InvalidSpecError`` unless the spec fits ``global_shape`` on ``mesh``."""
        p = self.problems(global_shape, mesh, uneven)
        if p:
            raise InvalidSpecError(f"spec {self.to_str(mesh)} for shape "
                                   f"{tuple(global_shape)} on {mesh}: " + "; ".join(p))

    def normalized(self, global_shape: Sequence[int], mesh: AbstractMesh) -> "ShardingSpec":
        """The same layout with maximum strides written as None (blocked)."""
        dims = []
        changed = False
        for size, d in zip(global_shape, self.dims):
            if d.stride is not None and d.stride * mesh.group_size(d.axes) == size:
                dims.append(DimSharding(d.axes))
                changed = True
            else:
                dims.append(d)
        return ShardingSpec(tuple(dims), self.partial, self.partial_groups) if changed else self

    # -- per-axis view ----------------------------------------------------------------------
    def axis_roles(self, global_shape: Sequence[int],
                   mesh: AbstractMesh) -> tuple[AxisRole, ...]:
        """Per mesh axis: None, ``("dim", d, axis_stride)`` or ``("partial", reducer)``."""
        roles: list[AxisRole] = [None] * mesh.ndim
        for a, r in self.partial:
            roles[a] = ("partial", r)
        for i, d in enumerate(self.dims):
            if not d.axes:
                continue
            n = mesh.group_size(d.axes)
            s = d.stride if d.stride is not None else -(-global_shape[i] // n)
            for a in reversed(d.axes):
                roles[a] = ("dim", i, s)
                s *= mesh.shape[a]
        return tuple(roles)

    @classmethod
    def from_axis_roles(cls, roles: Sequence[AxisRole], global_shape: Sequence[int],
                        mesh: AbstractMesh, partial_groups: Sequence[Sequence[int]] = ()
                        ) -> "ShardingSpec | None":
        """The spec with these axis roles, or None if no single-stride spec has them.

        Axes on one dimension must nest: ordered by decreasing axis stride, each stride is
        the next one times the next axis' size. The result is normalized (blocked = None).
        ``partial_groups`` (those whose axes all keep one pending reducer) are kept.
        """
        per_dim: dict[int, list[tuple[int, int]]] = {}
        partial = []
        for a, role in enumerate(roles):
            if role is None or mesh.shape[a] == 1 and role[0] == "dim":
                continue
            if role[0] == "partial":
                partial.append((a, role[1]))
            else:
                per_dim.setdefault(role[1], []).append((role[2], a))
        dims = [_REPLICATED_DIM] * len(global_shape)
        for d, lst in per_dim.items():
            lst.sort(key=lambda t: -t[0])
            for (s_out, _), (s_in, a_in) in zip(lst, lst[1:]):
                if s_out != s_in * mesh.shape[a_in]:
                    return None
            base = lst[-1][0]
            axes = tuple(a for _, a in lst)
            n = mesh.group_size(axes)
            size = global_shape[d]
            if size % n and base == -(-size // n):
                dims[d] = DimSharding(axes)            # uneven blocked (padded) split
                continue
            if size % (n * base):
                return None
            dims[d] = DimSharding(axes, None if base * n == size else base)
        red = dict(partial)
        groups = tuple(tuple(g) for g in partial_groups
                       if all(a in red for a in g) and len({red[a] for a in g}) == 1)
        return cls(tuple(dims), tuple(partial), groups)

    # -- text and JSON ----------------------------------------------------------------------
    def to_str(self, mesh: AbstractMesh | None = None) -> str:
        """Compact text, e.g. ``S[x]·R``, ``S[x,y/s64]·R``, ``R·R·P(sum@y)``, ``()``."""
        need = max(self.used_axes, default=-1) + 1
        names = list(mesh.axis_names) if mesh is not None else []
        names += [f"#{a}" for a in range(len(names), need)] if mesh is not None else list(
            default_axis_names(need))
        parts = [d.to_str(names) for d in self.dims] or ["()"]
        if self.partial:
            red = dict(self.partial)
            items = [(g[0], f"{red[g[0]]}@" + "+".join(names[a] for a in g))
                     for g in self.partial_groups]
            grouped = {a for g in self.partial_groups for a in g}
            items += [(a, f"{r}@{names[a]}") for a, r in self.partial if a not in grouped]
            parts.append("P(" + ",".join(x for _, x in sorted(items)) + ")")
        if not self.dims and self.partial:
            parts = parts[1:]
        return "·".join(parts)

    def __str__(self) -> str:
        try:
            return self.to_str()
        except (AttributeError, IndexError, KeyError):  # during __post_init__ error reporting
            return repr((self.dims, self.partial))

    def __repr__(self) -> str:
        return f"ShardingSpec({self})"

    @classmethod
    def parse(cls, text: str, mesh: AbstractMesh | None = None) -> "ShardingSpec":
        """Inverse of ``to_str`` (``.`` is accepted for ``·``; axis names from ``mesh``)."""
        names = list(mesh.axis_names) if mesh is not None else list(default_axis_names(26))
        t = text.strip().replace(" ", "")
        if t in ("()", ""):
            return cls(())
        dims: list[DimSharding] = []
        partial: list[tuple[int, str]] = []
        groups: list[tuple[int, ...]] = []

        def axis(name: str) -> int:
            if name not in names:
                raise InvalidSpecError(f"spec {text!r}: expected an axis name in {names}, "
                                       f"found {name!r}")
            return names.index(name)

        for tok in re.split(r"[·.]", t):
            if tok == "R":
                dims.append(_REPLICATED_DIM)
            elif tok == "()":
                continue
            elif m := re.fullmatch(r"S\[([\w,]+?)(?:/s(\d+))?\]", tok):
                axes = tuple(axis(x) for x in m.group(1).split(","))
                dims.append(DimSharding(axes, int(m.group(2)) if m.group(2) else None))
            elif m := re.fullmatch(r"P\(([\w@,+]+)\)", tok):
                for item in m.group(1).split(","):
                    r, _, a = item.partition("@")
                    axes = [axis(x) for x in a.split("+")]
                    partial.extend((x, r) for x in axes)
                    if len(axes) > 1:
                        groups.append(tuple(sorted(axes)))
            else:
                raise InvalidSpecError(f"spec {text!r}: expected R, S[axes], S[axes/sN] or "
                                       f"P(reducer@axis[+axis...]), found {tok!r}")
        try:
            return cls(tuple(dims), tuple(partial), tuple(groups))
        except InvalidSpecError as e:
            raise InvalidSpecError(f"spec {text!r}: " + str(e).split(": ", 1)[-1]) from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dims": [{"axes": list(d.axes), "stride": d.stride} for d in self.dims],
            "partial": [[a, r] for a, r in self.partial]}
        if self.partial_groups:
            out["partial_groups"] = [list(g) for g in self.partial_groups]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardingSpec":
        try:
            return cls(tuple(DimSharding(tuple(x["axes"]), x.get("stride")) for x in d["dims"]),
                       tuple((int(a), str(r)) for a, r in d.get("partial", ())),
                       tuple(tuple(int(a) for a in g) for g in d.get("partial_groups", ())))
        except (KeyError, TypeError) as e:
            raise InvalidSpecError(f"spec JSON: expected {{'dims': [{{'axes': [...], "
                                   f"'stride': ...}}], 'partial': [[axis, reducer]], "
                                   f"'partial_groups' (optional): [[axis, ...]]}}, found "
                                   f"{d!r} ({e})") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "ShardingSpec":
        return cls.from_dict(json.loads(text))


def padding_factor(opcode: str, specs: Sequence[Any], shapes: Sequence[Any],
                   mesh: AbstractMesh) -> float:
    """How much more than its even share of an op's work a device does where the op's
    specs (output first, then operands; tensors only) split dimensions unevenly: the
    largest, over the specs, product of ``ceil(D / n) * n / D`` over their uneven dims
    (1.0 when none is). A gather's table split does not share the work (each device looks
    up every index), so its table's padding is not counted either."""
    pairs = list(zip(specs, shapes))
    if opcode == "gather" and len(pairs) == 3:
        pairs = [pairs[0], pairs[2]]
    worst = 1.0
    for spec, shape in pairs:
        if not isinstance(spec, ShardingSpec) or not hasattr(shape, "dims"):
            continue
        f = 1.0
        for i in spec.uneven_dims(shape.dims, mesh):
            n = mesh.group_size(spec.dims[i].axes)
            size = shape.dims[i]
            f *= -(-size // n) * n / size
        worst = max(worst, f)
    return worst


def _check_groups(spec: ShardingSpec, groups: Any, reducer: dict[int, str]
                  ) -> tuple[tuple[int, ...], ...]:
    """``groups`` in normal form (sorted, of two or more axes), checked against the
    pending axes ``reducer`` (axis -> reducer)."""
    out = []
    seen: set[int] = set()
    for g in groups:
        axes = tuple(sorted(int(a) for a in g))
        if len(axes) < 2:
            continue
        if (any(a not in reducer for a in axes) or len({reducer[a] for a in axes}) != 1
                or seen.intersection(axes) or len(set(axes)) != len(axes)):
            raise InvalidSpecError(f"spec {spec}: expected each partial group to be two or "
                                   f"more pending axes of one reducer, in no other group; "
                                   f"found group {axes} with pending axes "
                                   f"{sorted(reducer.items())}")
        seen.update(axes)
        out.append(axes)
    return tuple(sorted(out))


def inner_sizes(shape: Sequence[int]) -> list[int]:
    """Product of the dims after each dim (row-major element strides)."""
    inner = [1] * len(shape)
    acc = 1
    for i in range(len(shape) - 1, -1, -1):
        inner[i] = acc
        acc *= shape[i]
    return inner


def map_linear_axis(linear_stride: int, n: int, shape: Sequence[int]) -> tuple[int, int] | None:
    """The dim and axis stride of ``shape`` that puts row-major element ``L`` on
    coordinate ``(L // linear_stride) % n``, or None if no single dim does."""
    inner = inner_sizes(shape)
    for o, (size, inn) in enumerate(zip(shape, inner)):
        if size > 1 and linear_stride % inn == 0 and (inn * size) % (linear_stride * n) == 0:
            return o, linear_stride // inn
    return None


def map_reshape(spec: ShardingSpec, in_shape: Sequence[int], out_shape: Sequence[int],
                mesh: AbstractMesh) -> ShardingSpec | None:
    """The spec of a reshape's result that needs no data movement, or None if none exists.

    A reshape keeps the row-major element order, so an axis with role ``("dim", i, s)``
    (coordinate ``(e_i // s) % n``) puts linear element ``L`` on ``(L // (inner_i*s)) % n``;
    that is ``("dim", o, inner_i*s / inner_o)`` on the output dim ``o`` whose span holds
    ``[inner_i*s, inner_i*s*n)``. Pending reductions carry over unchanged.

    Example:
        >>> mesh = AbstractMesh((4,))
        >>> heads = ShardingSpec.parse("R·R·R·S[x]·R")        # [B,S,3,heads=8,hd=16]
        >>> str(map_reshape(heads, (2, 4, 3, 8, 16), (2, 4, 384), mesh))
        'R·R·S[x/s32]'
    """
    if spec.rank != len(in_shape):
        raise InvalidSpecError(f"map_reshape: spec {spec} has rank {spec.rank}, input shape "
                               f"{tuple(in_shape)} has rank {len(in_shape)}")
    inner = inner_sizes(in_shape)
    roles = []
    for a, role in enumerate(spec.axis_roles(in_shape, mesh)):
        if role is None or role[0] == "partial":
            roles.append(role)
            continue
        _, i, s = role
        hit = map_linear_axis(inner[i] * s, mesh.shape[a], out_shape)
        if hit is None:
            return None
        roles.append(("dim", hit[0], hit[1]))
    return ShardingSpec.from_axis_roles(roles, out_shape, mesh, spec.partial_groups)
