"""Cross-mesh resharding (004 §3): unit tasks, send/recv · local-allgather · broadcast, plans,
and an executor that moves real jax arrays between meshes of one process.

A tensor laid out on a source mesh with one ``TileSpec`` is wanted on a disjoint destination
mesh with another. The pipeline of this module::

    (shape, src mesh+spec, dst mesh+spec)
        │ unit_tasks: every unique source tile ∩ every destination tile = one region,
        ▼            held by some source devices, needed by some destination devices
    UnitTask(region, src_devices, dst_devices, nbytes)
        │ jobs_for: one host-level CommJob per unit task (broadcast), per destination host
        ▼           (allgather) or per destination device (send_recv)
    CommJob ──► load_balance.balance (naive | greedy | randomized_greedy | dfs | best)
        ▼           picks a sender host per job and an order; the host simulator times it
    ReshardingPlan ──► copies(): device-to-device copies ──► execute(): jax.device_put

Meshes and tilings are kept small and self-contained:

* ``DeviceMesh``: an N-d array of logical device ids, each on a host. ``DeviceMesh.grid``
  puts row ``i`` of axis 0 on host ``i`` (004's ``(2, 4)`` = 2 hosts × 4 devices).
* ``TileSpec``: per tensor dimension, the mesh axes it is split over (004's notation:
  ``S^0`` = axis 0, ``S^01`` = axes 0 and 1, ``R`` = replicated), written ``"RS^01R"``.
  A dimension of size ``D`` split ``k`` ways is cut in blocks of ``ceil(D / k)`` (the last
  block is short: 004 pads instead). ``TileSpec.from_sharding_spec`` takes a planner
  ``ShardingSpec`` without strides or partial sums.

Example (004 Figure 2, task 1: a 4×4 matrix, ``S^01R`` on a 2×2 mesh → ``S^0R`` on another):
    >>> a = DeviceMesh.grid((2, 2))
    >>> b = DeviceMesh.grid((2, 2), first_device=4, first_host=2)
    >>> tasks = unit_tasks((4, 4), 4, a, TileSpec.parse("S^01R"), b, TileSpec.parse("S^0R"))
    >>> [(t.region, t.src_devices, t.dst_devices) for t in tasks][:2]
    [(((0, 1), (0, 4)), (0,), (4, 5)), (((1, 2), (0, 4)), (1,), (4, 5))]
    >>> plan = plan_resharding((4, 4), 4, a, "S^01R", b, "S^0R", strategy="broadcast")
    >>> plan.cross_host_bytes, plan_resharding((4, 4), 4, a, "S^01R", b, "S^0R",
    ...                                        strategy="send_recv").cross_host_bytes
    (64, 128)
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rhino.errors import RhinoError
from rhino.runtime.transfer.load_balance import Assignment, CommJob, Topology, balance

STRATEGIES = ("send_recv", "allgather", "broadcast")
Box = tuple[tuple[int, int], ...]   # per dimension [start, stop)


class ReshardingError(RhinoError, ValueError):
    """Bad meshes, specs or pieces for a resharding; says what was expected and found."""


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """Logical devices in an N-d mesh, each on a host.

    Attributes:
        shape: mesh shape, e.g. ``(2, 4)``.
        devices: logical device ids, row-major over ``shape``.
        hosts: the host of each device (same order).
    """

    shape: tuple[int, ...]
    devices: tuple[int, ...]
    hosts: tuple[int, ...]

    def __post_init__(self):
        for f in ("shape", "devices", "hosts"):
            object.__setattr__(self, f, tuple(int(x) for x in getattr(self, f)))
        n = math.prod(self.shape)
        if (not self.shape or min(self.shape) < 1 or len(self.devices) != n
                or len(self.hosts) != n or len(set(self.devices)) != n):
            raise ReshardingError(f"device mesh: expected {n} distinct devices and {n} hosts "
                                  f"for shape {self.shape}, found devices {self.devices}, "
                                  f"hosts {self.hosts}")

    @classmethod
    def grid(cls, shape: Sequence[int], first_device: int = 0, first_host: int = 0
             ) -> "DeviceMesh":
        """Consecutive device ids from ``first_device``; index ``i`` along axis 0 is on host
        ``first_host + i``."""
        shape = tuple(int(s) for s in shape)
        n, per_host = math.prod(shape), math.prod(shape[1:])
        return cls(shape, tuple(range(first_device, first_device + n)),
                   tuple(first_host + i // per_host for i in range(n)))

    def host_of(self, device: int) -> int:
        return self.hosts[self.devices.index(device)]

    def coords(self, position: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(position, self.shape))


@dataclasses.dataclass(frozen=True)
class TileSpec:
    """Per tensor dimension, the mesh axes it is split over, outermost first; ``()`` = R.

    Example:
        >>> s = TileSpec.parse("RS^{01}R"); s.dims, str(s)
        (((), (0, 1), ()), 'RS^01R')
    """

    dims: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        dims = tuple(tuple(int(a) for a in d) for d in self.dims)
        used = [a for d in dims for a in d]
        if len(used) != len(set(used)) or any(a < 0 for a in used):
            raise ReshardingError(f"tile spec {dims}: expected each mesh axis at most once, "
                                  f"found {used}")
        object.__setattr__(self, "dims", dims)

    @classmethod
    def parse(cls, text: str) -> "TileSpec":
        """``"S^0RR"``, ``"RS^{01}R"``, ``"S0RR"`` (004's notation)."""
        toks = re.findall(r"R|S\^?\{?(\d+)\}?|(.)", text.replace(" ", ""))
        if not toks or any(bad for _, bad in toks):
            raise ReshardingError(f"tile spec: expected R or S^<axes> per dimension, found "
                                  f"{text!r}")
        dims = []
        for axes, _ in toks:
            dims.append(tuple(int(c) for c in axes))
        return cls(tuple(dims))

    @classmethod
    def from_sharding_spec(cls, spec: Any) -> "TileSpec":
        """From a planner ``ShardingSpec`` with blocked dims (no strides) and no partial."""
        if spec.partial or any(d.stride is not None for d in spec.dims):
            raise ReshardingError(f"tile spec from {spec}: expected blocked dims and no "
                                  f"partial sums, found strides or partial")
        return cls(tuple(tuple(d.axes) for d in spec.dims))

    def __str__(self) -> str:
        return "".join("S^" + "".join(map(str, d)) if d else "R" for d in self.dims)

    def check(self, shape: Sequence[int], mesh: DeviceMesh) -> None:
        if len(shape) != len(self.dims) or any(a >= len(mesh.shape) for d in self.dims
                                               for a in d):
            raise ReshardingError(f"tile spec {self}: expected {len(shape)} dims over mesh "
                                  f"axes < {len(mesh.shape)}, found {len(self.dims)} dims "
                                  f"({self.dims})")

    def tile(self, shape: Sequence[int], mesh: DeviceMesh, position: int) -> Box:
        """The region held by the device at flat ``position`` of ``mesh``."""
        c = mesh.coords(position)
        box = []
        for size, axes in zip(shape, self.dims):
            k, j = 1, 0
            for a in axes:
                k, j = k * mesh.shape[a], j * mesh.shape[a] + c[a]
            block = -(-size // k)
            box.append((min(j * block, size), min((j + 1) * block, size)))
        return tuple(box)


def intersect_boxes(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def box_volume(b: Box) -> int:
    return math.prod(hi - lo for lo, hi in b)


def box_slices(b: Box, origin: Box | None = None) -> tuple[slice, ...]:
    if origin is None:
        return tuple(slice(lo, hi) for lo, hi in b)
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(b, origin))


@dataclasses.dataclass(frozen=True)
class UnitTask:
    """Send one unique data slice to every destination device that needs it (004 §2.2).

    Attributes:
        index: position in the natural order (by first destination device, then region).
        region: the slice, in global coordinates.
        src_devices: source devices holding it (replicas), in mesh order.
        dst_devices: destination devices needing it, in mesh order.
        nbytes: its size in bytes.
    """

    index: int
    region: Box
    src_devices: tuple[int, ...]
    dst_devices: tuple[int, ...]
    nbytes: int


def unit_tasks(shape: Sequence[int], itemsize: int, src_mesh: DeviceMesh, src_spec: TileSpec,
               dst_mesh: DeviceMesh, dst_spec: TileSpec) -> tuple[UnitTask, ...]:
    """Decompose a resharding into unit communication tasks.

    Source tiles partition the tensor, so each (unique source tile ∩ destination tile) region
    belongs to exactly one unit task; destination devices with the same region share it.

    Raises:
        ReshardingError: on overlapping meshes or specs that do not fit.
    """
    shape = tuple(int(s) for s in shape)
    src_spec.check(shape, src_mesh)
    dst_spec.check(shape, dst_mesh)
    common = set(src_mesh.devices) & set(dst_mesh.devices)
    if common:
        raise ReshardingError(f"resharding: expected disjoint source and destination meshes, "
                              f"found shared devices {sorted(common)}")
    holders: dict[Box, list[int]] = {}
    for i, d in enumerate(src_mesh.devices):
        holders.setdefault(src_spec.tile(shape, src_mesh, i), []).append(d)
    needed: dict[Box, tuple[tuple[int, ...], list[int]]] = {}
    for i, d in enumerate(dst_mesh.devices):
        want = dst_spec.tile(shape, dst_mesh, i)
        for tile, devs in holders.items():
            region = intersect_boxes(tile, want)
            if region is not None:
                needed.setdefault(region, (tuple(devs), []))[1].append(d)
    rank = {d: i for i, d in enumerate(dst_mesh.devices)}
    items = sorted(needed.items(), key=lambda kv: (rank[kv[1][1][0]], kv[0]))
    return tuple(UnitTask(i, region, src, tuple(dst), box_volume(region) * int(itemsize))
                 for i, (region, (src, dst)) in enumerate(items))


@dataclasses.dataclass(frozen=True)
class Copy:
    """One device-to-device copy of a region (global coordinates) for job ``job``."""

    job: int
    src_device: int
    dst_device: int
    region: Box
    cross_host: bool


@dataclasses.dataclass(frozen=True)
class ReshardingPlan:
    """A complete resharding: unit tasks, host-level jobs, their senders and order.

    Attributes:
        shape, itemsize: the tensor.
        src_mesh, src_spec, dst_mesh, dst_spec: the layouts.
        strategy: ``"send_recv"``, ``"allgather"`` or ``"broadcast"``.
        tasks: the unit tasks.
        jobs: the host-level jobs (``CommJob.unit`` indexes ``tasks``).
        job_receivers: per job, the destination devices it serves.
        assignment: the balancer's senders (hosts), order and simulated makespan.
        sender_devices: per job, the source device (on the chosen host) that sends.
        topology: the topology the plan was simulated on.
    """

    shape: tuple[int, ...]
    itemsize: int
    src_mesh: DeviceMesh
    src_spec: TileSpec
    dst_mesh: DeviceMesh
    dst_spec: TileSpec
    strategy: str
    tasks: tuple[UnitTask, ...]
    jobs: tuple[CommJob, ...]
    job_receivers: tuple[tuple[int, ...], ...]
    assignment: Assignment
    sender_devices: tuple[int, ...]
    topology: Topology

    @property
    def simulated_s(self) -> float:
        """Completion time on ``topology`` (the host-level simulator)."""
        return self.assignment.makespan

    def copies(self) -> tuple[Copy, ...]:
        """The device-level copies, job by job in the plan's order.

        broadcast: one cross-host copy per receiving host, then a chain inside the host;
        send_recv: one copy per receiving device; allgather: the slice cut in B parts, part k
        to device k of the host, then every part to every other device of the host.
        """
        host = self.dst_mesh.host_of
        out: list[Copy] = []
        for j in self.assignment.order:
            src = self.sender_devices[j]
            src_host = self.src_mesh.host_of(src)
            region = self.tasks[self.jobs[j].unit].region
            by_host: dict[int, list[int]] = {}
            for d in self.job_receivers[j]:
                by_host.setdefault(host(d), []).append(d)
            for h, devs in by_host.items():
                cross = h != src_host
                if self.strategy == "send_recv" or not cross:
                    out += [Copy(j, src, d, region, cross) for d in devs]
                elif self.strategy == "broadcast":
                    out.append(Copy(j, src, devs[0], region, True))
                    out += [Copy(j, a, b, region, False) for a, b in zip(devs, devs[1:])]
                else:
                    parts = split_box(region, len(devs))
                    out += [Copy(j, src, d, p, True) for d, p in zip(devs, parts)]
                    out += [Copy(j, a, b, p, False) for a, p in zip(devs, parts)
                            for b in devs if b != a]
        return tuple(out)

    @property
    def cross_host_bytes(self) -> int:
        return sum(box_volume(c.region) for c in self.copies() if c.cross_host) * self.itemsize

    @property
    def intra_host_bytes(self) -> int:
        return sum(box_volume(c.region) for c in self.copies() if not c.cross_host) * self.itemsize


def split_box(region: Box, parts: int) -> list[Box]:
    """Cut ``region`` in up to ``parts`` non-empty blocks along its longest dimension."""
    dim = max(range(len(region)), key=lambda i: region[i][1] - region[i][0])
    lo, hi = region[dim]
    step = -(-(hi - lo) // parts)
    out = []
    for a in range(lo, hi, step):
        r = list(region)
        r[dim] = (a, min(a + step, hi))
        out.append(tuple(r))
    return out


def jobs_for(tasks: Sequence[UnitTask], strategy: str, src_mesh: DeviceMesh,
             dst_mesh: DeviceMesh) -> tuple[tuple[CommJob, ...], tuple[tuple[int, ...], ...]]:
    """The host-level jobs of ``strategy`` and the destination devices each serves, in the
    natural order (by destination device, then region: "Alpa's order" for send/recv)."""
    if strategy not in STRATEGIES:
        raise ReshardingError(f"strategy: expected one of {STRATEGIES}, found {strategy!r}")
    rank = {d: i for i, d in enumerate(dst_mesh.devices)}
    items: list[tuple[tuple, CommJob, tuple[int, ...]]] = []
    for t in tasks:
        cands = tuple(dict.fromkeys(src_mesh.host_of(d) for d in t.src_devices))
        by_host: dict[int, list[int]] = {}
        for d in t.dst_devices:
            by_host.setdefault(dst_mesh.host_of(d), []).append(d)
        if strategy == "broadcast":
            groups = [list(t.dst_devices)]
        elif strategy == "allgather":
            groups = list(by_host.values())
        else:
            groups = [[d] for d in t.dst_devices]
        for devs in groups:
            hosts = tuple(dict.fromkeys(dst_mesh.host_of(d) for d in devs))
            counts = tuple(sum(dst_mesh.host_of(d) == h for d in devs) for h in hosts)
            job = CommJob(strategy, t.index, cands, hosts, counts, t.nbytes)
            items.append(((rank[devs[0]], t.region), job, tuple(devs)))
    items.sort(key=lambda it: it[0])
    return tuple(it[1] for it in items), tuple(it[2] for it in items)


def plan_resharding(shape: Sequence[int], itemsize: int, src_mesh: DeviceMesh,
                    src_spec: TileSpec | str, dst_mesh: DeviceMesh, dst_spec: TileSpec | str,
                    *, strategy: str = "broadcast", balancer: str = "best",
                    topology: Topology | None = None, seed: int = 0,
                    time_budget_s: float = 0.5) -> ReshardingPlan:
    """Plan a cross-mesh resharding.

    Args:
        shape, itemsize: the tensor's shape and bytes per element.
        src_mesh, src_spec, dst_mesh, dst_spec: layouts (specs as ``TileSpec`` or text).
        strategy: ``"broadcast"`` (004's), ``"allgather"`` or ``"send_recv"``.
        balancer: see ``rhino.runtime.transfer.load_balance.BALANCERS``.
        topology: bandwidths for the simulator; default ``Topology()`` (004 §5's cluster).
        seed: for the randomized greedy balancer.
        time_budget_s: for the DFS balancer.

    Returns:
        A ``ReshardingPlan``; ``plan.simulated_s`` is its simulated completion time.
    """
    src_spec = TileSpec.parse(src_spec) if isinstance(src_spec, str) else src_spec
    dst_spec = TileSpec.parse(dst_spec) if isinstance(dst_spec, str) else dst_spec
    topology = topology or Topology()
    shape = tuple(int(s) for s in shape)
    tasks = unit_tasks(shape, itemsize, src_mesh, src_spec, dst_mesh, dst_spec)
    jobs, receivers = jobs_for(tasks, strategy, src_mesh, dst_mesh)
    a = balance(jobs, topology, balancer, seed=seed, time_budget_s=time_budget_s)
    used: dict[int, int] = {}
    senders = [0] * len(jobs)
    for j in a.order:   # spread a host's jobs over its devices holding the slice
        devs = [d for d in tasks[jobs[j].unit].src_devices if src_mesh.host_of(d) == a.senders[j]]
        senders[j] = min(devs, key=lambda d: used.get(d, 0))
        used[senders[j]] = used.get(senders[j], 0) + 1
    return ReshardingPlan(shape, int(itemsize), src_mesh, src_spec, dst_mesh, dst_spec,
                          strategy, tasks, jobs, receivers, a, tuple(senders), topology)


# ---- execution on jax arrays (one process; devices stand in for hosts' devices) ----------

def default_device_of(device: int):
    """Logical device ``d`` -> ``jax.devices()[d % n]`` (meshes may share jax devices)."""
    import jax
    devs = jax.devices()
    return devs[device % len(devs)]


def distribute(data: np.ndarray, mesh: DeviceMesh, spec: TileSpec | str,
               device_of: Callable[[int], Any] = default_device_of) -> dict[int, Any]:
    """Place ``data``'s tile of every device of ``mesh`` on its jax device."""
    import jax
    spec = TileSpec.parse(spec) if isinstance(spec, str) else spec
    spec.check(data.shape, mesh)
    return {d: jax.device_put(data[box_slices(spec.tile(data.shape, mesh, i))], device_of(d))
            for i, d in enumerate(mesh.devices)}


def expected_tiles(data: np.ndarray, mesh: DeviceMesh, spec: TileSpec | str
                   ) -> dict[int, np.ndarray]:
    """What each device of ``mesh`` should hold under ``spec`` (for checks)."""
    spec = TileSpec.parse(spec) if isinstance(spec, str) else spec
    return {d: data[box_slices(spec.tile(data.shape, mesh, i))] for i, d in enumerate(mesh.devices)}


@dataclasses.dataclass(frozen=True)
class Execution:
    """What ``execute`` did.

    Attributes:
        pieces: destination device -> its tile (a jax array on its jax device).
        seconds: wall time of the copies and the assembly (results ready).
        cross_host_bytes: bytes copied between different hosts.
        num_copies: device-to-device copies made.
    """

    pieces: Mapping[int, Any]
    seconds: float
    cross_host_bytes: int
    num_copies: int


def execute(plan: ReshardingPlan, src_pieces: Mapping[int, Any],
            device_of: Callable[[int], Any] = default_device_of) -> Execution:
    """Run ``plan``: slice on the sender, ``jax.device_put`` to the receiver, in plan order;
    then every destination device assembles its tile from the regions it received.

    Args:
        plan: the resharding plan.
        src_pieces: source device -> its tile (e.g. from ``distribute``).
        device_of: logical device -> jax device.

    Raises:
        ReshardingError: a missing source piece, a copy from a device not holding its
            region, or a destination tile not exactly covered.
    """
    import jax

    shape = plan.shape
    held: dict[int, list[tuple[Box, Any]]] = {}
    for i, d in enumerate(plan.src_mesh.devices):
        if d not in src_pieces:
            raise ReshardingError(f"execute: expected a piece for source device {d}, found "
                                  f"pieces for {sorted(src_pieces)}")
        tile = plan.src_spec.tile(shape, plan.src_mesh, i)
        if tuple(src_pieces[d].shape) != tuple(hi - lo for lo, hi in tile):
            raise ReshardingError(f"execute: source device {d}: expected a piece of shape "
                                  f"{tuple(hi - lo for lo, hi in tile)}, found "
                                  f"{tuple(src_pieces[d].shape)}")
        held[d] = [(tile, src_pieces[d])]
    copies = plan.copies()
    t0 = time.perf_counter()
    received: dict[int, list[tuple[Box, Any]]] = {d: [] for d in plan.dst_mesh.devices}
    for c in copies:
        box, arr = next(((b, a) for b, a in held.get(c.src_device, [])
                         if intersect_boxes(b, c.region) == c.region), (None, None))
        if arr is None:
            raise ReshardingError(f"execute: copy for job {c.job}: expected device "
                                  f"{c.src_device} to hold region {c.region}, found "
                                  f"{[b for b, _ in held.get(c.src_device, [])]}")
        part = arr if box == c.region else arr[box_slices(c.region, box)]
        moved = jax.device_put(part, device_of(c.dst_device), may_alias=False)  # a real copy
        held.setdefault(c.dst_device, []).append((c.region, moved))
        received[c.dst_device].append((c.region, moved))
    pieces = {}
    for i, d in enumerate(plan.dst_mesh.devices):
        tile = plan.dst_spec.tile(shape, plan.dst_mesh, i)
        got = received[d]
        if sum(box_volume(b) for b, _ in got) != box_volume(tile) or any(
                intersect_boxes(b, tile) != b for b, _ in got):
            raise ReshardingError(f"execute: destination device {d}: expected regions "
                                  f"covering {tile}, found {[b for b, _ in got]}")
        pieces[d] = tile_from_regions(tile, got, next(iter(src_pieces.values())).dtype,
                                      device_of(d))
    jax.block_until_ready(list(pieces.values()))
    seconds = time.perf_counter() - t0
    cross = sum(box_volume(c.region) for c in copies if c.cross_host) * plan.itemsize
    return Execution(pieces, seconds, cross, len(copies))


def tile_from_regions(tile: Box, got: Sequence[tuple[Box, Any]], dtype: Any,
                      device: Any) -> Any:
    """A destination tile from the regions it received (global coordinates; they cover it):
    the one region as it is, else written into a buffer on ``device``."""
    import jax
    import jax.numpy as jnp

    if len(got) == 1:
        return got[0][1]
    buf = jnp.zeros(tuple(hi - lo for lo, hi in tile), dtype, device=device)
    for b, a in got:
        buf = jax.lax.dynamic_update_slice(buf, a, tuple(lo - o for (lo, _), (o, _)
                                                         in zip(b, tile)))
    return buf


def to_global_array(pieces: Mapping[int, Any], mesh: DeviceMesh, spec: TileSpec | str,
                    shape: Sequence[int], device_of: Callable[[int], Any] = default_device_of):
    """Build one ``jax.Array`` over ``mesh`` from per-device pieces
    (``jax.make_array_from_single_device_arrays``).

    Raises:
        ReshardingError: if the mesh's jax devices are not distinct or a split dimension is
            not divisible (jax arrays need even shards).
    """
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    spec = TileSpec.parse(spec) if isinstance(spec, str) else spec
    shape = tuple(int(s) for s in shape)
    jdevs = [device_of(d) for d in mesh.devices]
    if len(set(jdevs)) != len(jdevs):
        raise ReshardingError(f"to_global_array: expected {len(jdevs)} distinct jax devices "
                              f"for mesh {mesh.shape}, found {len(set(jdevs))}")
    for size, axes in zip(shape, spec.dims):
        k = math.prod(mesh.shape[a] for a in axes)
        if size % k:
            raise ReshardingError(f"to_global_array: expected dimension {size} divisible by "
                                  f"its {k} shards (spec {spec}), found remainder {size % k}")
    names = tuple(f"a{i}" for i in range(len(mesh.shape)))
    jmesh = Mesh(np.array(jdevs, dtype=object).reshape(mesh.shape), names)
    pspec = PartitionSpec(*[tuple(names[a] for a in axes) if axes else None
                            for axes in spec.dims])
    sharding = NamedSharding(jmesh, pspec)
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [pieces[d] for d in mesh.devices])
