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
paper with the receiving mesh's local copies doing the broadcast). Where both meshes have as
many devices and the target sits on one process (two stages of equal size: the common
case), the source's distinct tiles cross as they are and one layout change in the
receiving process builds the target (``process_resharding.relayout``: one dispatch instead
of a copy and an update per piece). PRNG key arrays travel as their key data
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
import itertools
import json
import os
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rhino.jaxpr.private import distributed_kv_client
from rhino.runtime.transfer.process_resharding import (Relayout, assemble, offers, process_plan,
                                              relayout, relayout_assemble, relayout_offers,
                                              relayout_wanted, wanted)
from rhino.runtime import threads
from rhino.runtime.transfer.transport import ExecutorError, Failure

_PREFIX = "rhino/xfer"
# Each transport of a process names its keys in the job's key-value store under its own
# number: the n-th transport of every process is the same executor's (every process of a
# job runs the same script, so makes its executors in the same order). Before, every
# transport of a job shared one set of names, and a job that ran a second pipelined step
# read the first one's layouts and aborts (its values never arrived).
_TRANSPORTS = itertools.count()
_SLICE_MS = 100          # the longest a wait goes without looking at abort / deadline
# Polling interval for pulled arrays becoming ready: the time from a value's arrival to the
# receiving task's dispatch (medians of the backward hand-offs of the 2-stage GPT benchmark
# on Ray, one traced run each: 2.4-3.0 ms polling every 0.5 ms, 0.7-2.3 ms every 0.1 ms;
# the receiving stage is idle then; where its own task still runs, the polls take a little
# of that task's core). Another process's abort is looked for every _SLICE_MS (a key-value
# store read: a few ms on a loaded CPU host).
_POLL_S = 0.0001
# Diagnostics: with RHINO_XFER_TRACE=DIR every process appends one JSON line per send and
# per receive (wall-clock times of each phase: asked for, arrived, assembled, done; the mode
# and layouts) to DIR/xfer-<process>.jsonl. Read with the step's task records
# (``ParallelStep.last_records``, same clock) it shows where a transfer's time goes.
_TRACE_DIR = os.environ.get("RHINO_XFER_TRACE")


def transfer_uuid(src: int, dst: int, key: tuple, sender: int = 0, receiver: int = 0
                  ) -> int:
    """The transfer's uuid (63 bits), the same in both processes: the stages, the key, and
    the sending and receiving processes (a stage may span several)."""
    digest = hashlib.blake2b(repr((src, dst, tuple(key), sender, receiver)).encode(),
                             digest_size=8).digest()
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
        defer_relayout: a value between tasks whose tiles crossed as they are
            (``relayout``) onto the target's own mesh is received in the sender's layout
            there, for the program reading it to change (``StageWorker`` programs do:
            jitted for the shardings they are given, their constraints keep the plan);
            otherwise it is put into the target sharding on arrival, a dispatch on the
            receiving stage's thread per value (0.2-0.7 ms each on CPU).

    One per process and job. Keys are ``(step, ref, microbatch)`` (``StepTransport``); a
    step number is used once (a value offered in an aborted step stays offered under its
    uuid), and ``start(step)`` at each step releases what earlier steps offered, as
    ``LocalExecutor.run`` does.
    """

    send_in_background = False   # send never waits for the value: await_pull is async

    def __init__(self, stage_process: Mapping[int, int],
                 target: Callable[[int, int], Any] | None = None,
                 address: str = "127.0.0.1:0", connect_timeout: float = 60.0,
                 defer_relayout: bool = False):
        from jax.experimental import transfer

        self._kv = distributed_kv_client()
        if self._kv is None:
            raise ExecutorError("JaxTransferTransport: call jax.distributed.initialize first")
        self._prefix = f"{_PREFIX}/{next(_TRANSPORTS)}"
        self.process = jax.process_index()
        self.stage_process = dict(stage_process)
        self.target = target
        self.defer_relayout = defer_relayout
        self._local_devices = jax.local_devices()
        host = address.rsplit(":", 1)[0]
        self.server = transfer.start_transfer_server(self._local_devices[0].client, address,
                                                     [f"{host}:0"])
        self._kv.key_value_set(f"{self._prefix}/addr/{self.process}", self.server.address(),
                               allow_overwrite=True)
        self._connect_timeout = connect_timeout
        self._conns: dict[int, Any] = {}
        self._lock = threading.Condition()
        self._steps: dict[int, _Step] = {}
        self._local: dict[tuple, Any] = {}      # (src, dst, key) -> value, same process
        self._offered: dict[int, list] = {}     # step -> arrays offered (kept alive)
        self._published: set[int] = set()     # steps whose abort this process published
        self.modes: dict[tuple, str] = {}        # key -> "whole"/"pieces" (last received)
        self._sent_layout: dict[str, Any] = {}   # layout key -> the sharding values go in
        self._layouts: dict[str, dict] = {}      # layout key -> what its sender announced
        self._expected: dict[tuple, tuple] = {}  # (src, dst, key) -> a pull made early
        # For ``wait_taken`` / ``acknowledge``: the receiving processes of each value sent,
        # the sending processes of each value received (both of the current steps only).
        self._sent_to: dict[tuple, tuple[int, ...]] = {}
        self._got_from: dict[tuple, tuple[int, ...]] = {}
        self._notes = threads.SerialWorker(f"rhino-xfer-taken-{self.process}")
        # Seconds receivers spent waiting for announcements / for pulled arrays, and sends.
        self.waited = {"announce": 0.0, "arrive": 0.0, "send": 0.0, "taken": 0.0}
        # Values whose taking this process waited for (``wait_taken``) and said
        # (``acknowledge``).
        self.held = self.acknowledged = 0
        self.deferred = 0    # values received in the sender's layout (``defer_relayout``)

    # ------------------------------------------------------------------ steps and aborts

    def job_keys(self, what: str) -> tuple[Any, str]:
        """(the job's key-value store client, a key prefix for ``what`` of this transport's
        steps, the same on every process): for the executor's own per-step records (the
        steps' outcomes, ``ProcessStages``)."""
        return self._kv, f"{self._prefix}/{what}"

    def _step(self, step: int) -> _Step:
        return self._steps.setdefault(step, _Step())

    def _trace(self, what: str, src: int, dst: int, key: tuple, **times: Any) -> None:
        if _TRACE_DIR is None:
            return
        line = json.dumps({"what": what, "src": src, "dst": dst, "key": repr(key),
                           "process": self.process, **times})
        with self._lock, open(os.path.join(_TRACE_DIR, f"xfer-{self.process}.jsonl"),
                              "a") as f:
            f.write(line + "\n")

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
            for k in [k for k in self._expected if k[2][0] == step]:
                del self._expected[k]
            self._lock.notify_all()
        if first:
            self._published.add(step)
            self._kv.key_value_set(f"{self._prefix}/abort/{step}", f"process {self.process}: "
                                   f"{why}", allow_overwrite=True)

    def _remote_abort(self, step: int) -> None:
        """Take an abort of ``step`` published by another process, if there is one."""
        try:
            why = self._kv.key_value_try_get(f"{self._prefix}/abort/{step}")
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
            for k in [k for k in self._expected if k[2][0] < step]:
                del self._expected[k]
            for d in (self._sent_to, self._got_from):
                for k in [k for k in d if k[2][0] < step]:
                    del d[k]
            old = [s for s in self._published if s < step]
            self._published.difference_update(old)
        for s in old:
            self._kv.key_value_delete(f"{self._prefix}/abort/{s}")

    def reset(self) -> None:
        """Forget every value, offer and abort (and the aborts this process published)."""
        with self._lock:
            self._steps.clear()
            self._offered.clear()
            self._local.clear()
            self._expected.clear()
            self._sent_to.clear()
            self._got_from.clear()
            old, self._published = self._published, set()
        for s in old:
            self._kv.key_value_delete(f"{self._prefix}/abort/{s}")

    def _check(self, dst: int, src: int, key: tuple) -> None:
        st = self._steps.get(key[0])
        if st is not None and st.aborted is not None:
            raise ExecutorError(f"aborted: {st.aborted}", failure=Failure.ABORTED)

    def _timeout(self, dst: int, src: int, key: tuple, timeout: float, what: str):
        return ExecutorError(f"stage {dst}: no value {_label(src, dst, key)} after "
                             f"{timeout:g} s ({what})", stage=dst, failure=Failure.TIMEOUT)

    # ------------------------------------------------------------------------ send

    def _layout_key(self, src: int, dst: int, key: tuple) -> str:
        """What a value's layout is announced under: its stages and ref, and whether it
        is a microbatch's value, its accumulated sum (``acc``: the whole batch's shape), a
        value of the whole batch, a kept result (``arg``) or a step's result (``out``); the
        same for every microbatch and step. (A value sent per microbatch and as its sum
        shared one name, so the sum was pulled in the microbatch's layout and failed.)"""
        if len(key) == 4:
            kind = key[1]
        else:   # a microbatch's value, its accumulated sum, or a value of the whole batch
            kind = "acc" if key[2] == "acc" else ("whole" if key[2] is None else "v")
        return f"{self._prefix}/layout/{src}/{dst}/{kind}/{_ref(key)}"

    def send(self, src: int, dst: int, key: tuple, value: Any) -> None:
        key = tuple(key)
        if self._same_process(src, dst):
            with self._lock:
                if self._step(key[0]).aborted is None:
                    self._local[(src, dst, key)] = value
                self._lock.notify_all()
            return
        t0 = time.monotonic()
        w0 = time.time()
        x = value
        if not isinstance(x, jax.Array):
            x = jax.device_put(x, self._local_devices[0])
        impl = None
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        name = self._layout_key(src, dst, key)
        with self._lock:
            sharding = self._sent_layout.get(name)
        if sharding is None:
            # First of its kind: announce its layout once; later ones are put in it (the
            # receiver then pulls at once: no announcement on the way of each value).
            sharding = x.sharding
            meta = {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name, "impl": impl,
                    "devices": [int(d.id) for d in np.asarray(sharding.mesh.devices).flat],
                    "mesh": list(sharding.mesh.devices.shape),
                    "axes": list(sharding.mesh.axis_names),
                    "spec": [_spec_entry(e) for e in sharding.spec]}
            # Every process of a sending stage writes the same (one global sharding).
            self._kv.key_value_set(name, json.dumps(meta), allow_overwrite=True)
            with self._lock:
                self._sent_layout[name] = sharding
        elif x.sharding != sharding:
            x = jax.device_put(x, sharding)
        if not x.size:   # nothing to move: the receiver makes it from the announced layout
            return
        tgt = self._target(dst, key)
        short = relayout(x.sharding, tgt, tuple(x.shape))
        if short is not None:
            parts = relayout_offers(short, x, self.process)
        else:
            plan = process_plan(x.sharding, tgt, x.shape, np.dtype(x.dtype).itemsize)
            parts = offers(plan, x, self.process)
        with self._lock:
            if self._step(key[0]).aborted is not None:
                return   # nobody will take it
            self._offered.setdefault(key[0], []).extend(a for v in parts.values() for a in v)
            self._sent_to[(src, dst, key)] = tuple(parts)
        for q, arrays in parts.items():
            self.server.await_pull(transfer_uuid(src, dst, key, self.process, q), arrays)
        self.waited["send"] += time.monotonic() - t0
        if _TRACE_DIR is not None:
            self._trace("send", src, dst, key, start=w0, offered=time.time())

    def _same_process(self, src: int, dst: int) -> bool:
        return self._procs(src) == self._procs(dst) == (self.process,)

    def _procs(self, stage: int) -> tuple[int, ...]:
        p = self.stage_process[stage]
        return tuple(p) if isinstance(p, (tuple, list)) else (int(p),)

    def _target(self, dst: int, key: tuple) -> Any:
        tgt = self.target(dst, _ref(key)) if self.target is not None else None
        if tgt is None:
            raise ExecutorError(f"stage {dst}: no target sharding for "
                                f"{_label(-1, dst, key)} (JaxTransferTransport's target)",
                                stage=dst)
        return tgt

    # ------------------------------------------------------------------------ recv

    def recv(self, dst: int, src: int, key: tuple, timeout: float) -> Any:
        key = tuple(key)
        deadline = time.monotonic() + timeout
        if self._same_process(src, dst):
            with self._lock:
                while (src, dst, key) not in self._local:
                    self._check(dst, src, key)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._timeout(dst, src, key, timeout, "not sent")
                    self._lock.wait(min(left, _SLICE_MS / 1000))
                return self._local.pop((src, dst, key))
        t0 = time.monotonic()
        w0 = time.time()
        with self._lock:
            early = self._expected.pop((src, dst, key), None)
        if early is None:
            meta = self._layout(src, dst, key, deadline, timeout)
            if 0 in meta["shape"]:
                # An empty value (e.g. a slice of an associative scan's carry) is never
                # offered: a transfer of no bytes never arrives.
                return jax.device_put(np.zeros(meta["shape"], meta["np_dtype"]),
                                      self._target(dst, key))
            plan, tgt, pulled = self._pull(src, dst, key, meta)
        else:
            meta, plan, tgt, pulled = early
        dtype = meta["np_dtype"]
        t1 = time.monotonic()
        self.waited["announce"] += t1 - t0
        arrays = [a for v in pulled.values() for a in v]
        look = time.monotonic() + _SLICE_MS / 1000
        while not all(a.is_ready() for a in arrays):
            if time.monotonic() > look:
                self._remote_abort(key[0])
                look = time.monotonic() + _SLICE_MS / 1000
            with self._lock:
                self._check(dst, src, key)
            if time.monotonic() > deadline:
                raise self._timeout(dst, src, key, timeout, "announced but not arrived")
            time.sleep(_POLL_S)
        w_arrived = time.time()
        with self._lock:
            self._got_from[(src, dst, key)] = tuple(pulled)
        try:
            jax.block_until_ready(arrays)  # ready: at once; raises if the sender's failed
            if isinstance(plan, Relayout):
                # (A value between tasks only: kept results and step results are
                # not read by a program first.)
                out = relayout_assemble(plan, tgt, meta["shape"], pulled,
                                        self.defer_relayout and len(key) == 3)
                self.deferred += out.sharding != tgt
            else:
                out = assemble(plan, tgt, pulled, self.process, dtype)
            # Not waited for: the task reading it is dispatched now and runs once the
            # layout change has run, without this thread waking in between.
            w_assembled = time.time()
        except ExecutorError:
            raise
        except Exception as e:
            raise ExecutorError(f"stage {src}: {type(e).__name__}: {e} (in the value "
                                f"{_label(src, dst, key)} it sent, found by stage {dst})",
                                stage=src, failure=Failure.PROGRAM) from e
        self.waited["arrive"] += time.monotonic() - t1
        if _TRACE_DIR is not None:
            self._trace("recv", src, dst, key, start=w0, early=early is not None,
                        pulled=w0 + (t1 - t0), arrived=w_arrived, assembled=w_assembled,
                        done=time.time(), mode=self.modes.get(key), pieces=len(arrays),
                        shape=meta["shape"], src_spec=str(meta["sharding"].spec),
                        target=str(tgt))
        if meta["impl"] is not None:
            out = jax.random.wrap_key_data(out, impl=meta["impl"])
        return out

    def acknowledge(self, dst: int, src: int, key: tuple) -> None:
        """Tell the sender of a value received here that this process has it (its
        ``wait_taken`` returns). Written to the job's key-value store from a thread of its
        own: the stage goes on at once."""
        key = tuple(key)
        if self._same_process(src, dst):
            return
        with self._lock:
            senders = self._got_from.pop((src, dst, key), ())
        for p in senders:
            self._notes.submit(self._kv.key_value_set,
                               self._taken_key(src, dst, key, p, self.process), "1")
            self.acknowledged += 1

    def wait_taken(self, src: int, items: Sequence[tuple[int, tuple]],
                   timeout: float) -> None:
        """Wait until every receiving process has taken the values ``items`` (``(dst,
        key)``, sent by stage ``src`` from this process) and said so (``acknowledge``).

        Why: a stage that starts its next program at once shares its host's cores with the
        transfer server that still has to send the values; on CPU hosts that delayed a value
        by the length of that program (the apply after the last backward: 9-11 ms of a
        500 ms step). Values of the same process are taken at once.

        Raises:
            ExecutorError: the step was aborted (``ABORTED``), or a value was not taken
                within ``timeout`` seconds (``TIMEOUT``).
        """
        t0 = time.monotonic()
        deadline = t0 + timeout
        for dst, key in items:
            key = tuple(key)
            with self._lock:
                receivers = self._sent_to.pop((src, dst, key), ())
            for q in receivers:
                name = self._taken_key(src, dst, key, self.process, q)
                if self._kv_wait(name, src, dst, key, deadline) is None:
                    raise ExecutorError(f"stage {src}: the value {_label(src, dst, key)} was "
                                        f"not taken by process {q} within {timeout:g} s",
                                        stage=src, failure=Failure.TIMEOUT)
                self._notes.submit(self._kv.key_value_delete, name)
                self.held += 1
        self.waited["taken"] += time.monotonic() - t0

    def _taken_key(self, src: int, dst: int, key: tuple, sender: int, receiver: int) -> str:
        return f"{self._prefix}/taken/{transfer_uuid(src, dst, key, sender, receiver)}"

    def _kv_wait(self, name: str, src: int, dst: int, key: tuple,
                 deadline: float) -> str | None:
        """The value of ``name`` in the job's key-value store, waited for in slices (an
        abort of the key's step raises between them); None once ``deadline`` passed."""
        while True:
            self._remote_abort(key[0])
            with self._lock:
                self._check(dst, src, key)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                return self._kv.blocking_key_value_get(
                    name, max(1, int(min(left * 1000, _SLICE_MS))))
            except Exception as e:  # the KV store's timeout is a generic error
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise

    def expect(self, dst: int, src: int, key: tuple) -> None:
        """Ask now for a value ``recv`` will take (where its layout is known, i.e. after
        the first of its kind), so that the pull waits at the sender for the value instead
        of being made when the receiving stage reaches it. In isolation either order takes
        about 2 ms on CPU (``benchmarks/transfer_latency.py``)."""
        key = tuple(key)
        if self._same_process(src, dst):
            return
        with self._lock:
            meta = self._layouts.get(self._layout_key(src, dst, key))
            if meta is None or (src, dst, key) in self._expected or 0 in meta["shape"]:
                return
        plan, tgt, pulled = self._pull(src, dst, key, meta)
        with self._lock:
            self._expected[(src, dst, key)] = (meta, plan, tgt, pulled)

    def _pull(self, src: int, dst: int, key: tuple, meta: dict) -> tuple:
        """Request this process's part of a value: (plan, target, sending process -> its
        arrays, not yet arrived)."""
        shape, dtype = tuple(meta["shape"]), meta["np_dtype"]
        tgt = self._target(dst, key)
        plan = relayout(meta["sharding"], tgt, shape)
        if plan is not None:   # the source's tiles cross as they are
            self.modes[key] = "whole" if not plan.copies and plan.mid.is_equivalent_to(
                tgt, len(shape)) else "relayout"
            items = relayout_wanted(plan, meta["sharding"], shape, self.process)
        else:
            plan = process_plan(meta["sharding"], tgt, shape, dtype.itemsize)
            self.modes[key] = "whole" if _tile_to_tile(plan) else "pieces"
            items = {p: [(tuple(hi - lo for lo, hi in region), dev) for region, dev in v]
                     for p, v in wanted(plan, tgt, dtype, self.process).items()}
        pulled: dict[int, list] = {}
        for p, wants in items.items():
            specs = [jax.ShapeDtypeStruct(tile, dtype,
                                          sharding=jax.sharding.SingleDeviceSharding(dev))
                     for tile, dev in wants]
            pulled[p] = self._conn(p).pull(transfer_uuid(src, dst, key, p, self.process),
                                           specs)
        return plan, tgt, pulled

    def _layout(self, src: int, dst: int, key: tuple, deadline: float,
                timeout: float) -> dict:
        """The layout the sender announced for values of this kind (waited for the first
        time, then known)."""
        name = self._layout_key(src, dst, key)
        with self._lock:
            meta = self._layouts.get(name)
        if meta is not None:
            return meta
        text = self._kv_wait(name, src, dst, key, deadline)
        if text is None:
            raise self._timeout(dst, src, key, timeout, "not announced")
        meta = json.loads(text)
        by_id = {int(d.id): d for d in jax.devices()}
        mesh = Mesh(np.array([by_id[i] for i in meta["devices"]]).reshape(meta["mesh"]),
                    tuple(meta["axes"]))
        meta["sharding"] = NamedSharding(mesh, PartitionSpec(
            *[tuple(e) if isinstance(e, list) else e for e in meta["spec"]]))
        meta["np_dtype"] = np.dtype(meta["dtype"]) if meta["dtype"] != "bfloat16" else \
            np.dtype(jax.numpy.bfloat16)
        with self._lock:
            self._layouts[name] = meta
        return meta

    def _conn(self, process: int) -> Any:
        with self._lock:
            conn = self._conns.get(process)
        if conn is None:
            addr = self._kv.blocking_key_value_get(f"{self._prefix}/addr/{process}",
                                                   int(self._connect_timeout * 1000))
            conn = self.server.connect(addr)
            with self._lock:
                self._conns.setdefault(process, conn)
        return conn


def _spec_entry(e: Any) -> Any:
    return list(e) if isinstance(e, tuple) else e


def _tile_to_tile(plan: Any) -> bool:
    """Every receiving device gets its whole tile, from a device holding exactly that tile,
    in one copy across the processes (the layouts match)."""
    copies = plan.copies()
    if any(not c.cross_host for c in copies):
        return False
    src = {d: plan.src_spec.tile(plan.shape, plan.src_mesh, i)
           for i, d in enumerate(plan.src_mesh.devices)}
    dst = {d: plan.dst_spec.tile(plan.shape, plan.dst_mesh, i)
           for i, d in enumerate(plan.dst_mesh.devices)}
    return len(copies) == len(dst) and all(
        c.region == src[c.src_device] == dst[c.dst_device] for c in copies)


def stage_targets(own: Mapping[int, Any], stage_devices: Mapping[int, Sequence[Any]],
                  layouts: Sequence[tuple]) -> Callable[[int, int], Any]:
    """``(stage, ref) -> sharding`` for ``JaxTransferTransport``: the sharding of a stage run
    here (``own``: stage -> its ``StageWorker``), and for another stage its own sharding of
    ``ref`` over its devices (``stage_devices``, global devices of the job;
    ``layouts[stage]``: mesh shape, axis names, ref -> spec): both sides of a transfer plan
    it from the same two shardings."""
    meshes = {s: Mesh(np.array(list(devs)).reshape(tuple(layouts[s][0])),
                      tuple(layouts[s][1])) for s, devs in stage_devices.items()}

    def target(s: int, ref: int) -> Any:
        if s in own:
            return own[s].sharding(ref)
        return NamedSharding(meshes[s], layouts[s][2].get(ref) or PartitionSpec())

    return target

