"""α-β costs of collectives, and the collectives that turn one sharding spec into another.

Cost model (per collective over a group of mesh axes ``G`` with ``n`` = product of their
sizes on the mesh, and from the ``CostModel``: ``α_G`` and ``β_G`` = the α and β of the
slowest axis, as one collective over the group is launched once, or where the cost model's
roofline holds measured figures for the group's link, the collective's kind and ``n``
devices (``rhino.calibrate``), those — and where it holds a measured curve of time by
size, that curve in place of ``x·β_G`` for the formula's bytes ``x``; ``B`` =
``Collective.bytes``)::

    all-reduce       α_G + 2 (n-1)/n · B · β_G     (ring: reduce-scatter + all-gather)
    all-gather       α_G +   (n-1)/n · B · β_G
    reduce-scatter   α_G +   (n-1)/n · B · β_G
    all-to-all       α_G +   (n-1)/n · B · β_G     (each device keeps 1/n, sends the rest)

``α`` is charged once per collective (launch and synchronisation), so one all-reduce is
cheaper than the reduce-scatter + all-gather pair it is equivalent to in bandwidth: plain
data parallelism beats ZeRO-style splitting when memory does not force it. The bandwidth
terms are the ring algorithm's on a one-port model (a device sends and receives at
``1/β`` bytes/s at a time), which is also what the all-to-all term uses.

Byte convention (``Collective.bytes``, comparable with collectives counted in compiled
HLO): the per-device size of the *larger* buffer, i.e. all-reduce: the local operand;
all-gather: the gathered result; reduce-scatter: the operand before scattering;
all-to-all: the local operand.

Resharding (``reshard``) works axis by axis on the specs' axis roles (see ``spec.py``):

    source role on axis a   target role        step
    same                    same               nothing
    none / partial          partial            nothing (free: keep on one device, zero the rest)
    dim                     partial            nothing (free: zero-pad the local shard)
    none                    dim                local slice (free)
    partial                 dim                reduce-scatter (all-reduce + local slice
                                               where ``cost.native_reduce_scatter`` is False)
    dim d                   dim d' (or stride) all-to-all (a permutation: 1/n stays), also
                                               for a group of axes moving together to one
                                               dim in their order; when several axes move
                                               apart, all-gather then slice (XLA's
                                               fallback does exactly that);
                                               into or out of a strided spec with the cost
                                               model's ``strided_moves_all_to_all`` False,
                                               the same
    partial                 none / other red.  all-reduce, one per group of the source's
                                               ``partial_groups`` and one per other axis
                                               (as XLA does: a sum one split dimension
                                               leaves is reduced over its group at once,
                                               sums different dimensions leave one axis
                                               at a time)
    partial (finer groups)  partial (grouped)  the source's reduction, as above: a pending
                                               sum cannot become one reduced at once
                                               without being reduced
    dim                     none               all-gather, one per source dim (a dim
                                               split over several axes at once)
    (a slice into one dim beside a gather of another: the gather first, of the
    whole tensor, as XLA runs it)

Uneven splits (``spec.py``) are priced on the padded tensor, as XLA runs them: each dim
split unevenly on either side is padded to a multiple of both sides' shard counts on it,
and the steps above move the padded shards (a 50257-row table split over 8 gathers 8
shards of 6283 rows).

Steps run in that order of effect on size (slices and reduce-scatters first, gathers last),
and axes needing the same step are grouped into one collective.

Example:
    >>> from rhino.planner.cost_model import CostModel
    >>> from rhino.planner.mesh import AbstractMesh
    >>> from rhino.planner.spec import ShardingSpec
    >>> from rhino.hlo_passes.graph import TensorType
    >>> mesh, cost = AbstractMesh((4,)), CostModel((1e-5,), (1e-9,))
    >>> p = reshard(ShardingSpec.parse("R·R·P(sum@x)"), ShardingSpec.parse("R·R"),
    ...             TensorType("f32", (256, 256)), mesh, cost)
    >>> [(c.kind, c.bytes) for c in p.collectives], round(p.cost, 9)
    ([('all-reduce', 262144)], 0.000403216)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from rhino.hlo_passes.graph import TensorType
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spec import InvalidSpecError, ShardingSpec

ALL_REDUCE = "all-reduce"
ALL_GATHER = "all-gather"
REDUCE_SCATTER = "reduce-scatter"
ALL_TO_ALL = "all-to-all"
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)


def collective_cost(kind: str, axes: Sequence[int], nbytes: float, mesh: AbstractMesh,
                    cost: CostModel, alpha_share: float = 1.0) -> float:
    """Seconds of one collective of ``kind`` over the device group spanning ``axes``.

    Args:
        kind: one of ``KINDS``.
        axes: mesh axes of the group (a group of one device costs 0).
        nbytes: ``Collective.bytes`` (see the module docstring).
        mesh: the mesh (group sizes).
        cost: its cost model (α and β per axis).
        alpha_share: the part of the latency α this collective pays: ``1/K`` for one of
            ``K`` collectives XLA combines into one (``build.combined_reductions``).
    """
    n = mesh.group_size(axes)
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    if kind == ALL_REDUCE:
        x = 2.0 * frac * nbytes
    elif kind in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
        x = frac * nbytes
    else:
        raise ValueError(f"collective kind: expected one of {KINDS}, found {kind!r}")
    measured = cost.measured_collective(kind, axes, n, x, alpha_share)
    if measured is not None:
        return measured
    a, b = cost.collective_alpha_beta(kind, axes, n)
    return a * alpha_share + x * b


def all_reduce_cost(nbytes: float, axes: Sequence[int], mesh: AbstractMesh,
                    cost: CostModel) -> float:
    """``collective_cost("all-reduce", axes, nbytes, mesh, cost)``."""
    return collective_cost(ALL_REDUCE, axes, nbytes, mesh, cost)


def all_gather_cost(nbytes: float, axes: Sequence[int], mesh: AbstractMesh,
                    cost: CostModel) -> float:
    """Cost of gathering a tensor whose full per-device size is ``nbytes``."""
    return collective_cost(ALL_GATHER, axes, nbytes, mesh, cost)


def reduce_scatter_cost(nbytes: float, axes: Sequence[int], mesh: AbstractMesh,
                        cost: CostModel) -> float:
    """Cost of reduce-scattering a per-device operand of ``nbytes``."""
    return collective_cost(REDUCE_SCATTER, axes, nbytes, mesh, cost)


def all_to_all_cost(nbytes: float, axes: Sequence[int], mesh: AbstractMesh,
                    cost: CostModel) -> float:
    """Cost of an all-to-all of a per-device operand of ``nbytes``."""
    return collective_cost(ALL_TO_ALL, axes, nbytes, mesh, cost)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a resharding.

    Attributes:
        kind: ``all-reduce``, ``all-gather``, ``reduce-scatter`` or ``all-to-all``.
        axes: mesh axes of the device group.
        bytes: per-device bytes, by the convention of the module docstring.
        reducer: ``sum``/``max``/``min`` for reductions, else None.
        cost: seconds (α-β model).
        alpha_share: the part of α charged (below 1 where XLA combines it with others).
    """

    kind: str
    axes: tuple[int, ...]
    bytes: int
    reducer: str | None
    cost: float
    alpha_share: float = 1.0


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """The collectives turning one spec into another, in order, and their total cost."""

    collectives: tuple[Collective, ...]
    cost: float

    @property
    def is_free(self) -> bool:
        return not self.collectives


_FREE = ReshardPlan((), 0.0)


def reshard(src: ShardingSpec | tuple, dst: ShardingSpec | tuple, tensor: TensorType | tuple,
            mesh: AbstractMesh, cost: CostModel, alpha_share: float = 1.0) -> ReshardPlan:
    """Collectives and cost to turn a tensor laid out as ``src`` into ``dst``.

    Args:
        src: the producer's spec (a tuple of specs for a tuple-shaped value).
        dst: the spec the consumer needs.
        tensor: the tensor's type (a tuple of types for tuple-shaped values).
        mesh: the mesh.
        cost: its cost model.
        alpha_share: the part of each collective's α charged (``collective_cost``).

    Raises:
        InvalidSpecError: a spec does not fit the tensor, or a tuple spec meets an array.
    """
    if isinstance(src, tuple) or isinstance(dst, tuple):
        if not (isinstance(src, tuple) and isinstance(dst, tuple)) or len(src) != len(dst):
            raise InvalidSpecError(f"reshard: expected two tuple specs of one length for a "
                                   f"tuple value, found {src!r} -> {dst!r}")
        plans = [reshard(s, d, t, mesh, cost, alpha_share) for s, d, t in zip(src, dst, tensor)]
        colls = tuple(c for p in plans for c in p.collectives)
        return ReshardPlan(colls, sum(p.cost for p in plans)) if colls else _FREE
    if src == dst:
        return _FREE
    for spec in (src, dst):
        spec.check(tensor.dims, mesh, uneven=True)
    padded, remat = _padded_move(src, dst, tensor, mesh)
    shape = padded.dims
    return _plan(src.axis_roles(shape, mesh), dst.axis_roles(shape, mesh), padded, mesh,
                 cost, _gather_moves(src, dst, cost), _groups(src, dst), alpha_share, remat)


def _padded_move(src: ShardingSpec, dst: ShardingSpec, tensor: TensorType,
                 mesh: AbstractMesh) -> tuple[TensorType, bool]:
    """The tensor a move between ``src`` and ``dst`` runs on (``padded_tensor``) and
    whether XLA rematerializes it for an uneven split (``_uneven_remat``)."""
    padded = padded_tensor(src, dst, tensor, mesh)
    return padded, padded is not tensor and _uneven_remat(src, dst, tensor, mesh)


def padded_tensor(src: ShardingSpec, dst: ShardingSpec, tensor: TensorType,
                  mesh: AbstractMesh) -> TensorType:
    """``tensor`` with each dim that ``src`` or ``dst`` splits unevenly padded to a multiple
    of both specs' shard counts on it (the tensor itself when neither is uneven)."""
    dims = list(tensor.dims)
    changed = False
    for i, size in enumerate(dims):
        counts = [mesh.group_size(s.dims[i].axes) for s in (src, dst) if s.dims[i].axes]
        if any(size % n for n in counts):
            m = math.lcm(*counts)
            dims[i] = -(-size // m) * m
            changed = True
    return TensorType(tensor.dtype, tuple(dims)) if changed else tensor


def _uneven_remat(src: ShardingSpec, dst: ShardingSpec, tensor: TensorType,
                  mesh: AbstractMesh) -> bool:
    """Whether XLA moves between ``src`` and ``dst`` by gathering and slicing (its "full
    rematerialization") because of an uneven split: a dim split unevenly on either side
    that keeps no axis in place, gains or loses one, or trades it for another, unless one
    side leaves it whole (a local slice, or a gather) and the axes it gains or loses move
    alone (an all-to-all of one axis between two dims, each held by that axis alone); or
    a local slice of one axis beside a gather or move of another (checked on jax 0.10.2
    by the generated steps of ``tests/test_uneven.py``). ``_plan`` then gathers every
    moving axis before it slices."""
    dims = tensor.dims
    for i in set(src.uneven_dims(dims, mesh)) | set(dst.uneven_dims(dims, mesh)):
        sa, da = src.dims[i].axes, dst.dims[i].axes
        if sa == da:
            continue
        if sa and da:
            return True
        here, there = (src, dst) if sa else (dst, src)   # the side splitting dim i, the other
        for a in sa or da:
            j = next((k for k, d in enumerate(there.dims) if a in d.axes), None)
            if j is not None and (len(there.dims[j].axes) > 1 or here.dims[j].axes):
                return True
    # A local slice beside a gather or a move, of any dim (``_plan`` alone takes only a
    # gather of another dim for even splits): XLA gathers first and slices the whole.
    where_src = {a: k for k, d in enumerate(src.dims) for a in d.axes}
    where_dst = {a: k for k, d in enumerate(dst.dims) for a in d.axes}
    sliced = any(a not in where_src and a not in dict(src.partial) for a in where_dst)
    moved = any(where_dst.get(a) != k for a, k in where_src.items())
    return sliced and moved


def _groups(src: ShardingSpec, dst: ShardingSpec) -> tuple | None:
    """The reduction groups ``_plan`` needs: None when neither spec has any."""
    if not (src.partial_groups or dst.partial_groups):
        return None
    return src, dst.partial_groups


def _strided(spec: ShardingSpec) -> bool:
    return any(d.stride is not None for d in spec.dims)


def _gather_moves(src: ShardingSpec, dst: ShardingSpec, cost: CostModel) -> bool:
    return not cost.strided_moves_all_to_all and (_strided(src) or _strided(dst))


def _plan(rs: tuple, rd: tuple, tensor: TensorType, mesh: AbstractMesh, cost: CostModel,
          gather_moves: bool = False, groups: tuple | None = None,
          alpha_share: float = 1.0, remat: bool = False) -> ReshardPlan:
    """``reshard`` on axis roles (see the module docstring for the steps); ``groups``:
    None, or the source spec and the target's ``partial_groups`` (``_groups``)."""
    regroup: set[int] = set()
    if groups is not None:
        src, dst_groups = groups
        for g in dst_groups:   # pending on both sides, reduced together only on the target
            if all(rs[a] == rd[a] for a in g) and not any(
                    set(g) <= set(h) for h in src.partial_groups):
                regroup.update(g)
    if rs == rd and not regroup:
        return _FREE
    total = tensor.nbytes
    split = [r is not None and r[0] == "dim" and mesh.shape[a] > 1 for a, r in enumerate(rs)]

    def local() -> int:
        return total // math.prod(mesh.shape[a] for a in range(mesh.ndim) if split[a])

    slices, scatters, a2a, reduces, gathers = [], {}, [], {}, []
    for a in range(mesh.ndim):
        s, d = rs[a], rd[a]
        if a in regroup and mesh.shape[a] > 1:
            reduces.setdefault(s[1], []).append(a)     # reduce, then re-pend for free
            continue
        if s == d or mesh.shape[a] == 1:
            continue
        s_kind = None if s is None else s[0]
        d_kind = None if d is None else d[0]
        if d_kind == "partial" and s_kind != "partial":
            continue                                   # free: zero-pad / keep on one device
        if s_kind is None and d_kind == "dim":
            slices.append(a)
        elif s_kind == "partial" and d_kind == "dim":
            scatters.setdefault(s[1], []).append(a)
        elif s_kind == "dim" and d_kind == "dim":
            a2a.append(a)
        elif s_kind == "partial":                      # -> none, or another reducer
            reduces.setdefault(s[1], []).append(a)
        else:                                          # dim -> none
            gathers.append(a)
    out: list[Collective] = []
    gather_moves = gather_moves or remat
    # A local slice into one dim beside a gather of another: XLA's partitioner gathers
    # the whole and slices after (checked on jax 0.10.2: S[y]·R -> R·S[x] on (2, 4)
    # all-gathers the full tensor); a slice of the dim being gathered comes first.
    slice_first = not remat and not (slices and gathers and any(
        rd[a][1] not in {rs[b][1] for b in gathers} for a in slices))
    for a in slices if slice_first else ():   # else: slice after gathering (below)
        split[a] = True
    for red, axes in sorted(scatters.items()):
        b = local()
        # Platforms without a reduce-scatter pass (XLA:CPU) all-reduce and slice locally.
        kind = REDUCE_SCATTER if cost.native_reduce_scatter else ALL_REDUCE
        out.append(Collective(kind, tuple(axes), b, red,
                              collective_cost(kind, axes, b, mesh, cost, alpha_share),
                              alpha_share))
        for a in axes:
            split[a] = True
    if a2a and not gather_moves and _moves_as_one(a2a, rs, rd):
        b = local()
        out.append(Collective(ALL_TO_ALL, tuple(a2a), b, None,
                              collective_cost(ALL_TO_ALL, a2a, b, mesh, cost, alpha_share),
                              alpha_share))
    elif a2a:
        # XLA's partitioner moves one mesh axis, or a group of axes together, between
        # dims with an all-to-all; moving several apart it "fully rematerializes": gathers
        # the tensor, then slices.
        gathers = sorted(set(gathers) | set(a2a))
    for red, axes in sorted(reduces.items()):
        # XLA's partitioner reduces a sum that one split dimension left over several axes
        # with one all-reduce over the group, and sums left by different dimensions one
        # axis at a time: the source's partial_groups say which.
        b = local()
        parts = ([(a,) for a in axes] if groups is None
                 else groups[0].reduction_groups(axes))
        for g in parts:
            out.append(Collective(ALL_REDUCE, g, b, red,
                                  collective_cost(ALL_REDUCE, g, b, mesh, cost, alpha_share),
                                  alpha_share))
    # One all-gather per source dim (XLA gathers a dim split over several axes at once,
    # and two split dims one after the other, the minor one first).
    by_dim: dict[int, list[int]] = {}
    for a in gathers:
        by_dim.setdefault(rs[a][1], []).append(a)
    for d in sorted(by_dim, reverse=True):
        axes = by_dim[d]
        for a in axes:
            split[a] = False
        b = local()
        out.append(Collective(ALL_GATHER, tuple(axes), b, None,
                              collective_cost(ALL_GATHER, axes, b, mesh, cost, alpha_share),
                              alpha_share))
    if not out:
        return _FREE
    return ReshardPlan(tuple(out), float(sum(c.cost for c in out)))


def _moves_as_one(axes: Sequence[int], rs: tuple, rd: tuple) -> bool:
    """Whether ``axes`` move from one dim to one other dim, in the same order (major
    first): one all-to-all over the group (checked on jax 0.10.2: ``S[x,y]`` from dim 2
    to dim 1 of a (2, 4) mesh compiles to one all-to-all over the 8 devices)."""
    if len(axes) == 1:
        return True
    if len({rs[a][1] for a in axes}) != 1 or len({rd[a][1] for a in axes}) != 1:
        return False
    return sorted(axes, key=lambda a: -rs[a][2]) == sorted(axes, key=lambda a: -rd[a][2])


class ReshardCostTable:
    """Memoised ``reshard(...).cost`` for one mesh and cost model (owned by one build; not
    thread-safe).

    Example:
        >>> from rhino.planner.mesh import AbstractMesh
        >>> t = ReshardCostTable(AbstractMesh((2,)), CostModel.simulated_cpu(1))
        >>> r = ShardingSpec.replicated(1)
        >>> t.cost(r, r, TensorType("f32", (4,)))
        0.0
    """

    def __init__(self, mesh: AbstractMesh, cost: CostModel):
        cost.check(mesh, "ReshardCostTable")
        self.mesh, self.cost_model = mesh, cost
        self._memo: dict[tuple, float] = {}
        self._roles: dict[tuple, tuple] = {}

    def _roles_of(self, spec: ShardingSpec, tensor: TensorType) -> tuple:
        key = (spec, tensor.dims)
        got = self._roles.get(key)
        if got is None:
            spec.check(tensor.dims, self.mesh, uneven=True)
            got = (spec.axis_roles(tensor.dims, self.mesh), bool(
                spec.uneven_dims(tensor.dims, self.mesh)))
            self._roles[key] = got
        return got

    def cost(self, src, dst, tensor, alpha_share: float = 1.0) -> float:
        """``reshard(src, dst, tensor, mesh, cost, alpha_share).cost``, memoised."""
        if src is dst or src == dst:
            return 0.0
        key = (src, dst, tensor, alpha_share)
        got = self._memo.get(key)
        if got is None:
            if isinstance(src, tuple) or isinstance(dst, tuple):
                got = reshard(src, dst, tensor, self.mesh, self.cost_model, alpha_share).cost
            else:
                (rs, us), (rd, ud) = self._roles_of(src, tensor), self._roles_of(dst, tensor)
                remat = False
                if us or ud:
                    tensor, remat = _padded_move(src, dst, tensor, self.mesh)
                    rs = src.axis_roles(tensor.dims, self.mesh)
                    rd = dst.axis_roles(tensor.dims, self.mesh)
                got = _plan(rs, rd, tensor, self.mesh, self.cost_model,
                            _gather_moves(src, dst, self.cost_model), _groups(src, dst),
                            alpha_share, remat).cost
            self._memo[key] = got
        return got

    def __len__(self) -> int:
        return len(self._memo)
