"""Cross-mesh resharding between the processes of one job (004 §3 over JAX's transfers): a
value on one stage's mesh (its devices on some processes) wanted on another stage's mesh
(on other processes), with any layouts on both.

Both sides compute the same ``ReshardingPlan`` (``runtime.transfer.resharding``: unit tasks, one
cross-host copy per receiving host, senders balanced across the source hosts; hosts are the
processes) from the two shardings alone, so no message says what goes where::

    plan(src sharding, dst sharding, shape)         the same in every process
      sender process p:   for each receiving process q, the regions p sends to q, cut from
                          its shards (``offers``): one transfer of a list of arrays
      receiver process q: pulls, for each sending process p, those regions onto the devices
                          the plan names (``wanted``), copies them on to its other devices
                          that need them (the plan's chain inside a host), and builds its
                          tiles into the global array (``assemble``)

The transfers themselves (``runtime.transfer.jax_transfer``) are keyed by (stages, value, p, q).

A shortcut where it applies (``relayout``): when the two meshes have as many devices and
the target's devices all sit on one process, the source's distinct tiles cross as they
are, tile k onto the target's k-th device (a replicated tile once, then copied on to the
devices of its other holders' indices), and the receiving process changes the layout in
one step among its own devices (a ``device_put`` up to 1 MiB, a compiled identity above:
an all-gather or all-to-all). Every element still crosses once; the receiver makes one
call instead of a copy and a slice update per piece (``benchmarks/transfer_latency.py``:
1.4-1.8 ms against 12.9 ms for a 2 MiB value).

Example (in one process, hosts pretended by ``host_of``; see the tests)::

    plan = process_plan(x.sharding, target, x.shape, x.dtype.itemsize, host_of)
    parts = offers(plan, x, process=0)     # {1: [arrays for process 1]}
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rhino.runtime.transfer.cross_mesh import mesh_and_spec
from rhino.runtime.transfer.resharding import (Box, ReshardingError, ReshardingPlan, box_slices,
                                      box_volume, intersect_boxes, plan_resharding,
                                      tile_from_regions)


def process_of(device: Any) -> int:
    return int(device.process_index)


@functools.lru_cache(maxsize=4096)
def _plan(src: Any, dst: Any, shape: tuple[int, ...], itemsize: int,
          host_of: Callable[[Any], int]) -> ReshardingPlan:
    src_mesh, src_spec = mesh_and_spec(src, len(shape), host_of=host_of)
    dst_mesh, dst_spec = mesh_and_spec(dst, len(shape), host_of=host_of)
    return plan_resharding(shape, itemsize, src_mesh, src_spec, dst_mesh, dst_spec,
                           strategy="broadcast", balancer="greedy")


def process_plan(src: Any, dst: Any, shape: Sequence[int], itemsize: int,
                 host_of: Callable[[Any], int] = process_of) -> ReshardingPlan:
    """The plan moving a value of ``shape`` from sharding ``src`` to ``dst`` (both
    ``NamedSharding``s of disjoint device sets; a host is a process), cached: a step repeats
    its transfers."""
    return _plan(src, dst, tuple(int(s) for s in shape), int(itemsize), host_of)


def _devices(plan_sharding: Any) -> dict[int, Any]:
    return {int(d.id): d for d in np.asarray(plan_sharding.mesh.devices).flat}


def offers(plan: ReshardingPlan, x: Any, process: int) -> dict[int, list]:
    """What process ``process`` sends: receiving process -> the regions of ``x`` (its
    shards here) the plan's cross-host copies take from this process, in plan order, each
    an array on the sending device."""
    held = {int(s.device.id): s.data for s in x.addressable_shards}
    tiles = {d: plan.src_spec.tile(plan.shape, plan.src_mesh, i)
             for i, d in enumerate(plan.src_mesh.devices)}
    out: dict[int, list] = {}
    for c in plan.copies():
        if not c.cross_host or plan.src_mesh.host_of(c.src_device) != process:
            continue
        if c.src_device not in held:
            raise ReshardingError(f"resharding: the plan sends region {c.region} from device "
                                  f"{c.src_device}, which this process does not hold")
        tile, arr = tiles[c.src_device], held[c.src_device]
        part = arr if tile == c.region else arr[box_slices(c.region, tile)]
        dst_host = plan.dst_mesh.host_of(c.dst_device)
        out.setdefault(dst_host, []).append(part)
    return out


def wanted(plan: ReshardingPlan, dst: Any, dtype: Any, process: int
           ) -> dict[int, list[tuple[Box, Any]]]:
    """What process ``process`` receives: sending process -> (region, jax device) of each
    array it pulls from there, in plan order (the order ``offers`` sends them in)."""
    by_id = _devices(dst)
    out: dict[int, list[tuple[Box, Any]]] = {}
    for c in plan.copies():
        if not c.cross_host or plan.dst_mesh.host_of(c.dst_device) != process:
            continue
        src_host = plan.src_mesh.host_of(c.src_device)
        out.setdefault(src_host, []).append((c.region, by_id[c.dst_device]))
    return out


def assemble_pieces(plan: ReshardingPlan, dst: Any, received: Mapping[int, Sequence[Any]],
                    process: int, dtype: Any) -> dict[int, Any]:
    """Device id -> tile, for the devices of ``dst`` on process ``process``, from what it
    pulled (sending process -> its arrays, in ``wanted`` order): the plan's copies inside
    this process first, then each tile assembled (a region that is the whole tile is used
    as it is)."""
    import jax

    by_id = _devices(dst)
    regions = wanted(plan, dst, dtype, process)
    got: dict[int, list[tuple[Box, Any]]] = {}
    for src_host, items in regions.items():
        arrays = list(received.get(src_host, ()))
        if len(arrays) != len(items):
            raise ReshardingError(f"resharding: expected {len(items)} arrays from process "
                                  f"{src_host}, found {len(arrays)}")
        for (region, dev), a in zip(items, arrays):
            got.setdefault(int(dev.id), []).append((region, a))
    for c in plan.copies():       # the chain inside this host (broadcast)
        if c.cross_host or plan.dst_mesh.host_of(c.dst_device) != process:
            continue
        have = next((a for r, a in got.get(c.src_device, []) if r == c.region), None)
        if have is None:
            raise ReshardingError(f"resharding: device {c.src_device} should hold region "
                                  f"{c.region} to copy it on, found none")
        got.setdefault(c.dst_device, []).append(
            (c.region, jax.device_put(have, by_id[c.dst_device])))
    pieces: dict[int, Any] = {}
    for i, d in enumerate(plan.dst_mesh.devices):
        if plan.dst_mesh.host_of(d) != process:
            continue
        tile = plan.dst_spec.tile(plan.shape, plan.dst_mesh, i)
        parts = got.get(d, [])
        if sum(box_volume(b) for b, _ in parts) != box_volume(tile) or any(
                intersect_boxes(b, tile) != b for b, _ in parts):
            raise ReshardingError(f"resharding: device {d}: expected regions covering "
                                  f"{tile}, found {[b for b, _ in parts]}")
        pieces[d] = tile_from_regions(tile, parts, dtype, by_id[d])
    return pieces


def assemble(plan: ReshardingPlan, dst: Any, received: Mapping[int, Sequence[Any]],
             process: int, dtype: Any) -> Any:
    """The global array on ``dst`` from what process ``process`` pulled
    (``assemble_pieces``; its devices' tiles, the other processes' are theirs)."""
    import jax

    pieces = assemble_pieces(plan, dst, received, process, dtype)
    return jax.make_array_from_single_device_arrays(plan.shape, dst, list(pieces.values()))


@dataclasses.dataclass(frozen=True)
class Relayout:
    """How a value crosses under the shortcut of the module docstring.

    Attributes:
        mid: the sharding it arrives in: the target's devices (in their mesh order) arranged
            as the source's mesh, with the source's spec.
        first: per source device (mesh order), the first device holding the same tile; a
            tile crosses once, from that device to the target's device of the same index,
            and is copied on to the target devices of its other holders' indices.
    """

    mid: Any
    first: tuple[int, ...]

    @property
    def copies(self) -> bool:
        return any(f != k for k, f in enumerate(self.first))


@functools.lru_cache(maxsize=1024)
def relayout(src: Any, dst: Any, shape: tuple[int, ...]) -> Relayout | None:
    """The ``Relayout`` of a value of ``shape`` from ``src`` to ``dst``, where the shortcut
    applies (as many devices on both sides, the target's on one process); else None. Both
    sides compute it from the two shardings."""
    from jax.sharding import Mesh, NamedSharding

    if not (isinstance(src, NamedSharding) and isinstance(dst, NamedSharding)):
        return None
    if dst.mesh.devices.size != src.mesh.devices.size:
        return None
    if len({d.process_index for d in dst.mesh.devices.flat}) != 1:
        return None
    where = src.devices_indices_map(tuple(shape))
    seen: dict[tuple, int] = {}
    first = []
    for k, d in enumerate(src.mesh.devices.flat):
        tile = tuple((sl.start, sl.stop) for sl in where[d])
        first.append(seen.setdefault(tile, k))
    devices = np.array(list(dst.mesh.devices.flat), dtype=object).reshape(src.mesh.devices.shape)
    return Relayout(NamedSharding(Mesh(devices, src.mesh.axis_names), src.spec), tuple(first))


def relayout_offers(r: Relayout, x: Any, process: int) -> dict[int, list]:
    """What process ``process`` sends under ``r``: receiving process -> the distinct tiles
    of ``x`` this process's devices are the first holders of, in the source mesh's order."""
    held = {int(s.device.id): s.data for s in x.addressable_shards}
    out: dict[int, list] = {}
    for k, (sd, md) in enumerate(zip(x.sharding.mesh.devices.flat, r.mid.mesh.devices.flat)):
        if r.first[k] == k and sd.process_index == process:
            out.setdefault(md.process_index, []).append(held[int(sd.id)])
    return out


def relayout_wanted(r: Relayout, src: Any, shape: Sequence[int], process: int
                    ) -> dict[int, list[tuple[tuple[int, ...], Any]]]:
    """What process ``process`` receives under ``r``: sending process -> (tile shape, jax
    device) of each tile, in the order ``relayout_offers`` sends them."""
    tile = tuple(src.shard_shape(tuple(shape)))
    out: dict[int, list] = {}
    for k, (sd, md) in enumerate(zip(src.mesh.devices.flat, r.mid.mesh.devices.flat)):
        if r.first[k] == k and md.process_index == process:
            out.setdefault(sd.process_index, []).append((tile, md))
    return out


def relayout_assemble(r: Relayout, dst: Any, shape: Sequence[int],
                      received: Mapping[int, Sequence[Any]], defer: bool = False) -> Any:
    """The global array on ``dst`` from the tiles pulled under ``r`` (sending process -> its
    tiles, in ``relayout_wanted`` order): replicated tiles copied on inside this process,
    then the source's layout changed to the target's (a put, or one program). With
    ``defer``, where the tiles lie on the target's own mesh, the array is returned in the
    source's layout there: the program that reads it changes the layout (no dispatch of
    its own)."""
    import jax

    by_device = {int(next(iter(a.devices())).id): a for v in received.values() for a in v}
    mids = list(r.mid.mesh.devices.flat)
    tiles = [by_device.get(int(d.id)) for d in mids]
    extra = [k for k, f in enumerate(r.first) if f != k]
    if extra:      # one batched copy of the replicas
        moved = jax.device_put([tiles[r.first[k]] for k in extra], [mids[k] for k in extra])
        for k, a in zip(extra, moved):
            tiles[k] = a
    x = jax.make_array_from_single_device_arrays(tuple(shape), r.mid, tiles)
    if r.mid == dst or (defer and r.mid.mesh == dst.mesh):
        return x
    # Up to 1 MiB a ``device_put``, above a compiled identity. Measured in the 2-process
    # pipeline benchmark (jax 0.10.2, CPU, one core per process): the identity's dispatch
    # waited in the calling thread for the program the devices were running, so the task
    # reading the value was dispatched only after it (1.7 ms later on stage 1 after each
    # backward); the put returned at once. But the put of the 2 MiB tied-embedding
    # gradient made the apply start 6 ms after the last backward, the identity 1 ms.
    # (Alone, both take the same: 0.25 ms for 256 KiB, 1.6 ms for 2 MiB.) Either keeps the
    # target's own sharding object below (``P(None,)`` may read for ``P()``).
    y = jax.device_put(x, dst) if x.nbytes <= _PUT_BYTES else _to(dst)(x)
    return y if y.sharding == dst else jax.make_array_from_single_device_arrays(
        tuple(shape), dst, [s.data for s in y.addressable_shards])


_PUT_BYTES = 1 << 20


@functools.lru_cache(maxsize=1024)
def _to(dst: Any) -> Callable[[Any], Any]:
    import jax

    return jax.jit(lambda x: x, out_shardings=dst)
