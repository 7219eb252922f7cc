"""Stage-to-stage transport inside ONE ``jax.distributed`` job: values move device to device
through JAX's transfer server (``jax.experimental.transfer``), keyed by an explicit uuid, with
no host copy in rhino, no sockets of ours and no Ray object store.

Why not ``jax.device_put(x, sharding_on_the_other_process)``: a cross-process device_put is
matched between processes by a per-process counter, not by anything the caller names.
``PjRtTransferServer::CopyArraysForCrossHost`` (xla/python/transfer/pjrt_transfer_server.cc)
takes ``uuid = CreateNewTransferKey()`` (``next_transfer_key_++``) for every
(destination, source) process pair of every call, in EVERY process of the job ("The transfer
key must be incremented in all processes, regardless of whether they participate"). So every
process must make the same cross-process device_puts in the same order, from one thread.
Checked (jax 0.10.2, CPU, 2 processes): process 0 ``send a, send b, recv c`` against process 1
``recv a, send c, recv b`` (1F1B) deadlocks after ``a``; two same-shaped sends taken in the
other order are silently swapped. A pipeline's stages do not agree on one order, so this
module uses the uuid-keyed pull API instead:

* the sender calls ``TransferServer.await_pull(uuid, arrays)`` (asynchronous: the arrays need
  not be computed yet) and announces the value in the job's key-value store (shape, dtype,
  PRNG key implementation, which layout it offers);
* the receiver waits for the announcement (in slices, so a timeout or an ``abort`` ends the
  wait), ``connect(peer).pull(uuid, specs)`` straight onto its own devices, and waits for the
  arrays with ``is_ready()`` against the same deadline.

The uuid is a hash of (source stage, destination stage, (step, ref, microbatch)): both sides
compute it, so any order of sends and receives, from any thread, matches.

Layouts: when the target sharding (``target(stage, ref)``) gives each device, in device
order, the same block of the array as the source does, and no block is replicated, the whole
array is pulled onto the target sharding (one pull, no reassembly). Otherwise the sender
offers its distinct shards as single-device arrays; the receiver pulls each onto the target
device that needs most of it, and each target device builds its block from the pieces that
overlap it (device-to-device copies and slices in the receiving process), then
``jax.make_array_from_single_device_arrays``. Every element crosses between the processes
once, whatever the replication on either side (the unit tasks of the cross-mesh resharding
paper with the receiving mesh's local copies doing the broadcast). PRNG key arrays travel as their key data
(``uint32``) and are wrapped again on arrival. Stages of the same process exchange values in
memory (``place`` puts them on the receiving mesh).

Example (in each process of a 2-process job, after ``jax.distributed.initialize``)::

    t = JaxTransferTransport(stage_process={0: 0, 1: 1},
                             target=lambda stage, ref: worker.sharding(ref))
    outs, _ = worker.run_step(args, StepTransport(t, step), timeout=60)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from rhino.jaxpr.private import distributed_kv_client
from rhino.runtime.transport import ExecutorError, Failure

_PREFIX = "rhino/xfer"
_SLICE_MS = 100          # the longest a wait goes without looking at abort / deadline
_POLL_S = 0.0005         # polling interval for pulled arrays becoming ready


def transfer_uuid(src: int, dst: int, key: tuple) -> int:
    """The transfer's uuid (63 bits), the same in both processes."""
    digest = hashlib.blake2b(repr((src, dst, tuple(key))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _ref(key: tuple) -> int:
    """The value a key names: ``(step, ref, microbatch)``, or another stage's kept result
    or a step's result, ``(step, "arg" | "out", its step, ref)``."""
    return key[1] if len(key) == 3 else key[-1]


def _label(src: int, dst: int, key: tuple) -> str:
    if len(key) == 3:
        step, ref, mb = key
        return f"v{ref}@{'' if mb is None else mb} of step {step} (stage {src}→{dst})"
    return f"{key} (stage {src}→{dst})"


def _blocks(sharding: Any, shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """The block of ``shape`` each device of ``sharding`` holds, in device order."""
    out = []
    for idx in sharding.devices_indices_map(shape).values():
        out.append(tuple(sl.indices(n)[:2] for sl, n in zip(idx, shape)))
    return out


def _overlap(a, b) -> tuple[tuple[int, int], ...] | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _size(block) -> int:
    return int(np.prod([hi - lo for lo, hi in block], dtype=np.int64))


@dataclasses.dataclass
class _Step:
    aborted: str | None = None


class JaxTransferTransport:
    """A ``Transport`` between the stages of one ``jax.distributed`` job (see the module
    docstring). Every process of the job that runs a stage creates one (it starts this
    process's transfer server and publishes its address in the job's key-value store).

    Args:
        stage_process: stage -> the process index that runs it.
        target: ``(stage, ref) -> jax.sharding.Sharding`` the value ``ref`` should have on
            ``stage``; for a PRNG key array, the same sharding is used for its key data. The
            receiver needs it; the sender uses it to offer the whole array when the layouts
            match (otherwise it offers its distinct shards).
        address: where this process's transfer server listens ("host:port"; port 0: any).
        connect_timeout: seconds to wait for the peers' addresses.

    One per process and job. Keys are ``(step, ref, microbatch)`` (``StepTransport``); a
    step number is used once (a value offered in an aborted step stays offered under its
    uuid), and ``start(step)`` at each step releases what earlier steps offered, as
    ``LocalExecutor.run`` does.
    """

    send_in_background = False   # send never waits for the value: await_pull is async

    def __init__(self, stage_process: Mapping[int, int],
                 target: Callable[[int, int], Any] | None = None,
                 address: str = "127.0.0.1:0", connect_timeout: float = 60.0):
        from jax.experimental import transfer

        self._kv = distributed_kv_client()
        if self._kv is None:
            raise ExecutorError("JaxTransferTransport: call jax.distributed.initialize first")
        self.process = jax.process_index()
        self.stage_process = dict(stage_process)
        self.target = target
        self._local_devices = jax.local_devices()
        host = address.rsplit(":", 1)[0]
        self.server = transfer.start_transfer_server(self._local_devices[0].client, address,
                                                     [f"{host}:0"])
        self._kv.key_value_set(f"{_PREFIX}/addr/{self.process}", self.server.address(),
                               allow_overwrite=True)
        self._connect_timeout = connect_timeout
        self._conns: dict[int, Any] = {}
        self._lock = threading.Condition()
        self._steps: dict[int, _Step] = {}
        self._local: dict[tuple, Any] = {}      # (src, dst, key) -> value, same process
        self._offered: dict[int, list] = {}     # step -> arrays offered (kept alive)
        self._published: set[int] = set()     # steps whose abort this process published
        self.modes: dict[tuple, str] = {}        # key -> "whole"/"pieces" (last received)

    # ------------------------------------------------------------------ steps and aborts

    def _step(self, step: int) -> _Step:
        return self._steps.setdefault(step, _Step())

    def abort(self, step: int, why: str) -> None:
        """Poison ``step`` in every process of the job: its waiting and future ``recv``
        calls raise (here at once, in the other processes within a wait slice)."""
        with self._lock:
            st = self._step(step)
            first = st.aborted is None
            if first:
                st.aborted = why
            for k in [k for k in self._local if k[2][0] == step]:
                del self._local[k]
            self._lock.notify_all()
        if first:
            self._published.add(step)
            self._kv.key_value_set(f"{_PREFIX}/abort/{step}", f"process {self.process}: "
                                   f"{why}", allow_overwrite=True)

    def _remote_abort(self, step: int) -> None:
        """Take an abort of ``step`` published by another process, if there is one."""
        try:
            why = self._kv.key_value_try_get(f"{_PREFIX}/abort/{step}")
        except Exception:   # NOT_FOUND
            return
        with self._lock:
            st = self._step(step)
            if st.aborted is None:
                st.aborted = why

    def start(self, step: int) -> None:
        """Forget the values, offers and aborts of the steps before ``step``."""
        with self._lock:
            for s in [s for s in self._steps if s < step]:
                del self._steps[s]
            for s in [s for s in self._offered if s < step]:
                del self._offered[s]
            for k in [k for k in self._local if k[2][0] < step]:
                del self._local[k]
            old = [s for s in self._published if s < step]
            self._published.difference_update(old)
        for s in old:
            self._kv.key_value_delete(f"{_PREFIX}/abort/{s}")

    def reset(self) -> None:
        """Forget every value, offer and abort (and the aborts this process published)."""
        with self._lock:
            self._steps.clear()
            self._offered.clear()
            self._local.clear()
            old, self._published = self._published, set()
        for s in old:
            self._kv.key_value_delete(f"{_PREFIX}/abort/{s}")

    def _check(self, dst: int, src: int, key: tuple) -> None:
        st = self._steps.get(key[0])
        if st is not None and st.aborted is not None:
            raise ExecutorError(f"aborted: {st.aborted}", failure=Failure.ABORTED)

    def _timeout(self, dst: int, src: int, key: tuple, timeout: float, what: str):
        return ExecutorError(f"stage {dst}: no value {_label(src, dst, key)} after "
                             f"{timeout:g} s ({what})", stage=dst, failure=Failure.TIMEOUT)

    # ------------------------------------------------------------------------ send

    def send(self, src: int, dst: int, key: tuple, value: Any) -> None:
        key = tuple(key)
        if self.stage_process[dst] == self.process:
            with self._lock:
                if self._step(key[0]).aborted is None:
                    self._local[(src, dst, key)] = value
                self._lock.notify_all()
            return
        x = value
        if not isinstance(x, jax.Array):
            x = jax.device_put(x, self._local_devices[0])
        impl = None
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        if not x.is_fully_addressable:
            raise ExecutorError(f"stage {src}: the value {_label(src, dst, key)} is not on "
                                f"this process's devices only", stage=src)
        shape = tuple(x.shape)
        blocks = _blocks(x.sharding, shape)
        tgt = self.target(dst, _ref(key)) if self.target is not None else None
        # Whole only without replicas: a replicated block crosses once and is copied on
        # the receiving side (device to device there), as in the pieces path.
        if tgt is not None and len(tgt.device_set) == len(blocks) and \
                len(set(blocks)) == len(blocks) and _blocks(tgt, shape) == blocks:
            mode, offered, pieces = "whole", [x], []
        else:
            mode, offered, pieces = "pieces", [], []
            seen = set()
            for shard in x.addressable_shards:
                block = tuple(sl.indices(n)[:2] for sl, n in zip(shard.index, shape))
                if block in seen:
                    continue
                seen.add(block)
                offered.append(shard.data)
                pieces.append(block)
        uuid = transfer_uuid(src, dst, key)
        with self._lock:
            if self._step(key[0]).aborted is not None:
                return   # nobody will take it
            self._offered.setdefault(key[0], []).extend(offered)
        self.server.await_pull(uuid, offered)
        meta = {"shape": shape, "dtype": np.dtype(x.dtype).name, "impl": impl, "mode": mode,
                "pieces": pieces, "from": self.process}
        self._kv.key_value_set(f"{_PREFIX}/v/{uuid}", json.dumps(meta))

    # ------------------------------------------------------------------------ recv

    def recv(self, dst: int, src: int, key: tuple, timeout: float) -> Any:
        key = tuple(key)
        deadline = time.monotonic() + timeout
        if self.stage_process[src] == self.process:
            with self._lock:
                while (src, dst, key) not in self._local:
                    self._check(dst, src, key)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._timeout(dst, src, key, timeout, "not sent")
                    self._lock.wait(min(left, _SLICE_MS / 1000))
                return self._local.pop((src, dst, key))
        uuid = transfer_uuid(src, dst, key)
        name = f"{_PREFIX}/v/{uuid}"
        while True:
            self._remote_abort(key[0])
            with self._lock:
                self._check(dst, src, key)
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout(dst, src, key, timeout, "not announced")
            try:
                meta = self._kv.blocking_key_value_get(
                    name, max(1, int(min(left * 1000, _SLICE_MS))))
                break
            except Exception as e:  # the KV store's timeout is a generic error
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise
        self._kv.key_value_delete(name)
        meta = json.loads(meta)
        self.modes[key] = meta["mode"]
        out = self._pull(dst, src, key, uuid, meta)
        polls = 0
        while not out.is_ready():
            polls += 1
            if polls % 200 == 0:
                self._remote_abort(key[0])
            with self._lock:
                self._check(dst, src, key)
            if time.monotonic() > deadline:
                raise self._timeout(dst, src, key, timeout, "announced but not arrived")
            time.sleep(_POLL_S)
        try:
            out.block_until_ready()   # ready: at once; raises if the sender's program failed
        except Exception as e:
            raise ExecutorError(f"stage {src}: {type(e).__name__}: {e} (in the value "
                                f"{_label(src, dst, key)} it sent, found by stage {dst})",
                                stage=src, failure=Failure.PROGRAM) from e
        if meta["impl"] is not None:
            out = jax.random.wrap_key_data(out, impl=meta["impl"])
        return out

    def _conn(self, process: int) -> Any:
        with self._lock:
            conn = self._conns.get(process)
        if conn is None:
            addr = self._kv.blocking_key_value_get(f"{_PREFIX}/addr/{process}",
                                                   int(self._connect_timeout * 1000))
            conn = self.server.connect(addr)
            with self._lock:
                self._conns.setdefault(process, conn)
        return conn

    def _pull(self, dst: int, src: int, key: tuple, uuid: int, meta: dict) -> Any:
        shape, dtype = tuple(meta["shape"]), np.dtype(meta["dtype"])
        conn = self._conn(meta["from"])
        tgt = self.target(dst, _ref(key)) if self.target is not None else None
        if tgt is None:
            raise ExecutorError(f"stage {dst}: no target sharding for {_label(src, dst, key)}"
                                f" (JaxTransferTransport's target)", stage=dst)
        if meta["mode"] == "whole":
            spec = jax.ShapeDtypeStruct(shape, dtype, sharding=tgt)
            return conn.pull(uuid, [spec])[0]
        pieces = [tuple(tuple(b) for b in p) for p in meta["pieces"]]
        devices = list(tgt.devices_indices_map(shape).keys())
        blocks = _blocks(tgt, shape)
        # Each piece goes to the target device that needs most of it.
        homes = []
        for p in pieces:
            best = max(range(len(devices)),
                       key=lambda i: _size(_overlap(p, blocks[i]) or ((0, 0),)))
            homes.append(devices[best])
        specs = [jax.ShapeDtypeStruct(tuple(hi - lo for lo, hi in p), dtype,
                                      sharding=jax.sharding.SingleDeviceSharding(d))
                 for p, d in zip(pieces, homes)]
        got = conn.pull(uuid, specs)
        arrays = []
        for d, block in zip(devices, blocks):
            if d.process_index != self.process:
                continue
            arrays.append(_assemble(block, dtype, d, [
                (p, g, o) for p, g in zip(pieces, got)
                if (o := _overlap(p, block)) is not None]))
        return jax.make_array_from_single_device_arrays(shape, tgt, arrays)


def _assemble(block, dtype, device, parts) -> Any:
    """The array of ``block`` on ``device`` from (piece block, piece array, overlap) parts."""
    import jax.numpy as jnp

    if len(parts) == 1 and parts[0][0] == block:
        return jax.device_put(parts[0][1], device)
    shape = tuple(hi - lo for lo, hi in block)
    out = jax.device_put(jnp.zeros(shape, dtype), device)
    for piece, arr, ov in parts:
        src = tuple(slice(lo - p0, hi - p0) for (lo, hi), (p0, _) in zip(ov, piece))
        dst = tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(ov, block))
        out = out.at[dst].set(jax.device_put(arr[src], device))
    return out


def stage_targets(own: Mapping[int, Any], devices: Sequence[Any],
                  layouts: Sequence[tuple]) -> Callable[[int, int], Any]:
    """``(stage, ref) -> sharding`` for ``JaxTransferTransport``: the sharding of a stage run
    here (``own``: stage -> its ``StageWorker``), and for another stage one laid out as its
    (``layouts[stage]``: mesh shape, axis names, ref -> spec) over ``devices`` (this
    process's, where it has as many; else None: the value is sent as pieces), so a sender
    knows when the receiver wants the shards exactly as it holds them."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    def target(s: int, ref: int) -> Any:
        if s in own:
            return own[s].sharding(ref)
        shape, names, specs = layouts[s]
        if int(np.prod(shape)) != len(devices):
            return None
        mesh = Mesh(np.array(list(devices)).reshape(tuple(shape)), tuple(names))
        return NamedSharding(mesh, specs.get(ref) or PartitionSpec())

    return target
