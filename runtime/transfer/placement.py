"""Placing a step's arguments and values on a stage's devices (``place``), a global
``jax.Array`` of a multi-controller job included (``whole_here``). Used by the executors
(``runtime.executors.local``) and the runs (``runtime.executors.runs``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rhino.runtime.failures import ExecutorError, Failure


def place(x: Any, sharding: Any) -> Any:
    """``x`` with ``sharding``. On a mesh spanning processes, a host value is placed by each
    process from its own copy, reading only the shards its devices hold (other rows may
    differ between processes: ``jax.device_put`` would refuse that)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x    # what device_put returns too, without its ~20 µs of dispatch
    if isinstance(x, jax.Array) and not x.is_fully_addressable and \
            sharding.is_fully_addressable:
        x = whole_here(x)     # a global array onto this process's devices
    if sharding.is_fully_addressable or isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    # dtype: a process holding no shard of the mesh has nothing to read it from
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index],
                                        dtype=host.dtype)


def whole_here(x: Any) -> Any:
    """A global ``jax.Array`` (over several processes' devices) as a numpy value, from the
    shards this process holds, where they cover it (replicated across the processes, or
    split only within each); else ``ExecutorError``: its other rows are on other processes.
    """
    boxes = {tuple((s.start or 0, x.shape[d] if s.stop is None else s.stop)
                   for d, s in enumerate(sh.index)): sh for sh in x.addressable_shards}
    held = sum(int(np.prod([b - a for a, b in box], dtype=np.int64)) for box in boxes)
    if held < int(np.prod(x.shape, dtype=np.int64)):
        raise ExecutorError(
            f"an argument {x.dtype}{list(x.shape)}: a global jax.Array of which this process "
            f"holds only some elements ({x.sharding}), needed whole on this process's "
            f"stage: pass it replicated over the processes, or as numpy or this process's "
            f"own arrays", failure=Failure.PROGRAM)
    out = np.empty(x.shape, x.dtype)
    for sh in boxes.values():
        out[sh.index] = np.asarray(sh.data)
    return out
