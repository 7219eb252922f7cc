"""Cross-mesh transfers between pipeline stages with 004's resharding (unit tasks, broadcast,
load-balanced senders), as a ``Transport`` of the local executor.

A value leaves its stage laid out by the sending mesh's sharding and is wanted on the
receiving stage's mesh with the receiver's sharding (the stage plans may differ). This
transport turns the pair into a ``ReshardingPlan`` (``runtime.transfer.resharding``: every unique
source tile ∩ destination tile is a unit task; ``broadcast`` sends each unit once per
destination host and lets that host fan it out; senders are balanced across the source
host's devices), cached per (shape, dtype, shardings) since a step repeats its transfers,
and runs it on the jax arrays (``resharding.execute``), giving the receiver a ``jax.Array``
already in its layout. ``strategy="send_recv"`` sends every destination device its own copy.

Hosts: the device ids of the cluster numbered host-major (``devices_per_host`` per host),
as the pipeline planner numbers them.

Example:
    >>> t = CrossMeshTransport(lambda dst, ref: None, num_stages=2, devices_per_host=4)
    >>> t.strategy
    'broadcast'
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from rhino.runtime.transfer.transport import LocalTransport
from rhino.runtime.transfer.resharding import (STRATEGIES, DeviceMesh, ReshardingError, TileSpec,
                                      execute, plan_resharding, to_global_array)


def mesh_and_spec(sharding: Any, ndim: int, devices_per_host: int = 0,
                  host_of: Callable[[Any], int] | None = None
                  ) -> tuple[DeviceMesh, TileSpec]:
    """A ``NamedSharding`` as resharding's ``DeviceMesh`` + ``TileSpec``; a device's host is
    ``host_of(device)``, else its id over ``devices_per_host``."""
    mesh = sharding.mesh
    devs = list(np.asarray(mesh.devices).flat)
    ids = tuple(int(d.id) for d in devs)
    hosts = tuple(host_of(d) for d in devs) if host_of is not None else \
        tuple(i // devices_per_host for i in ids)
    dmesh = DeviceMesh(tuple(mesh.devices.shape), ids, hosts)
    names = list(mesh.axis_names)
    entries = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    dims = []
    for e in entries[:ndim]:
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        dims.append(tuple(names.index(a) for a in axes))
    return dmesh, TileSpec(tuple(dims))


class CrossMeshTransport(LocalTransport):
    """In-process mailboxes; each value is resharded onto the receiver's layout on send.

    Args:
        target: ``(dst stage, ref) -> NamedSharding`` the receiver wants the value in.
        num_stages: stages (one mailbox each).
        devices_per_host: for the host of each device id.
        strategy: ``broadcast`` (default) or ``send_recv`` (or ``allgather``).
        balancer: sender load balancer (``runtime.transfer.load_balance.BALANCERS``).
    """

    def __init__(self, target: Callable[[int, int], Any], num_stages: int,
                 devices_per_host: int, strategy: str = "broadcast", balancer: str = "greedy"):
        if strategy not in STRATEGIES:
            raise ReshardingError(f"strategy: expected one of {STRATEGIES}, found {strategy!r}")
        super().__init__(num_stages)
        self.target, self.devices_per_host = target, devices_per_host
        self.strategy, self.balancer = strategy, balancer
        self._plans: dict = {}
        self._lock = threading.Lock()
        self.moved_bytes = 0
        self.cross_host_bytes = 0

    def send(self, src: int, dst: int, key: tuple, value: Any) -> None:
        _, ref, _ = key  # (step, ref, microbatch)
        super().send(src, dst, key, self.reshard(value, self.target(dst, ref)))

    def reshard(self, x: Any, target: Any) -> Any:
        """``x`` (a jax array on one mesh) on ``target``'s mesh and layout."""
        import jax

        if target is None or not getattr(x, "shape", ()) or not hasattr(x.sharding, "mesh"):
            return jax.device_put(x, target) if target is not None else x
        key = (tuple(x.shape), str(x.dtype), x.sharding, target)
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                src_mesh, src_spec = mesh_and_spec(x.sharding, x.ndim, self.devices_per_host)
                dst_mesh, dst_spec = mesh_and_spec(target, x.ndim, self.devices_per_host)
                plan = plan_resharding(x.shape, x.dtype.itemsize, src_mesh, src_spec,
                                       dst_mesh, dst_spec, strategy=self.strategy,
                                       balancer=self.balancer)
                self._plans[key] = plan
        by_id = {d.id: d for d in x.sharding.mesh.devices.flat}
        by_id.update({d.id: d for d in target.mesh.devices.flat})
        pieces = {int(s.device.id): s.data for s in x.addressable_shards}
        done = execute(plan, pieces, device_of=lambda d: by_id[d])
        with self._lock:
            self.moved_bytes += sum(int(np.prod([hi - lo for lo, hi in c.region]))
                                    for c in plan.copies()) * plan.itemsize
            self.cross_host_bytes += done.cross_host_bytes
        out = to_global_array(done.pieces, plan.dst_mesh, plan.dst_spec, x.shape,
                              device_of=lambda d: by_id[d])
        return jax.device_put(out, target)  # same devices and layout: relabels the mesh
