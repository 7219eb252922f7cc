"""Cross-mesh resharding between the processes of one job (004 §3 over JAX's transfers): a
value on one stage's mesh (its devices on some processes) wanted on another stage's mesh
(on other processes), with any layouts on both.

Both sides compute the same ``ReshardingPlan`` (``runtime.resharding``: unit tasks, one
cross-host copy per receiving host, senders balanced across the source hosts; hosts are the
processes) from the two shardings alone, so no message says what goes where::

    plan(src sharding, dst sharding, shape)         the same in every process
      sender process p:   for each receiving process q, the regions p sends to q, cut from
                          its shards (``offers``): one transfer of a list of arrays
      receiver process q: pulls, for each sending process p, those regions onto the devices
                          the plan names (``wanted``), copies them on to its other devices
                          that need them (the plan's chain inside a host), and builds its
                          tiles into the global array (``assemble``)

The transfers themselves (``runtime.jax_transfer``) are keyed by (stages, value, p, q).

Example (in one process, hosts pretended by ``host_of``; see the tests)::

    plan = process_plan(x.sharding, target, x.shape, x.dtype.itemsize, host_of)
    parts = offers(plan, x, process=0)     # {1: [arrays for process 1]}
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rhino.runtime.cross_mesh import mesh_and_spec
from rhino.runtime.resharding import (Box, ReshardingError, ReshardingPlan, box_slices,
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
