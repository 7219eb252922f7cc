"""The actor side of the Ray executor: one ``StageActor`` per host of a stage's mesh (under
``interleaved-1f1b``, per host of a device group's mesh: the actor runs all the group's
stages).

A stage whose mesh sits on one host is one actor holding that many devices. A stage whose
mesh spans ``H`` hosts is ``H`` actors, one per host, each holding that host's devices, and
every one of them runs the same stage programs on the stage's one global mesh
(multi-controller SPMD). Every actor of the run, whatever its stage, is one process of one
``jax.distributed`` job (the coordinator on the first actor, a free port of its node; gloo
collectives between the CPU processes of a stage spanning hosts)::

    stage 0 (mesh 2x4 over 2 hosts):  actor (0, host 0) ─┐ one mesh of 8 devices ┐
                                      actor (0, host 1) ─┘                       ├ one job
    stage 1 (mesh (4,) on 1 host):    actor (1, host 0) ── one mesh of 4 devices ┘

* Set-up is three calls: ``node_cpus()`` on every actor (its node and cores, for the
  driver to split a node's cores between the actors simulating hosts there),
  ``coordinator()`` on the first actor (its node's address and a free port), then
  ``setup(...)`` on every actor at once: keeping to its cores (``pin_process``, before JAX
  starts its backend), joining the job (bounded by ``timeout``), unpickling the
  ``StageArtifact`` only after that, building the ``StageWorker`` and compiling its
  programs, so the first step is not a compile.
* Values between stages move device to device through JAX's transfer servers
  (``runtime.transfer.jax_transfer``: each sending host offers its pieces, each receiving host
  pulls those its devices need); nothing of them goes through the host, the object store
  or a socket of rhino's.
* Results stay in the actors (``kept``, by (step, ref)). What goes back to the driver per
  step (one pickled blob each way, ``run_step``): 0-d results (losses, counters, metrics)
  as numpy, kept one step more (the driver may pass them back), and, until the driver has
  them, the shapes and dtypes of the others. Those others are kept until the driver
  releases them (its handle was dropped, or the step failed elsewhere); ``fetch`` returns
  them.
* Collectives of one job must be entered in the same order by all its processes: the driver
  runs one step or one fetch at a time per executor, and an actor runs them on one thread.
* Interleaved 1F1B (``virtual_stages > 1``): device group ``g`` holds stages ``g, g + p,
  ...`` on one mesh, so its actors build every one of those stages' ``StageWorker`` from
  their artifacts and run them as one ``GroupWorker`` (``group_units``: the group's column
  order). Values between two stages of the group stay in the actor's process (the
  transport's stage -> processes map sends each stage to its group's actors); the kept
  results of all the group's stages are one store (refs are the step's, not a stage's).
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from typing import Any, Mapping, Sequence

import numpy as np

from rhino.runtime.transfer.transport import ExecutorError, Failure, StepTransport
from rhino.runtime.ray.cluster import import_ray, usable_cores
from rhino.runtime.state.remote_array import PackedKey, dtype_name, unpack_key


GLOO_CHATTER = rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks"
"""What gloo prints on stdout for every process of a job at every connection (a line per
rank, whatever the log level): left out of the actors' output (``drop_output_lines``)."""

JOB_HEARTBEAT_S = 7 * 24 * 3600
"""Seconds without a heartbeat after which JAX's coordination service ends the whole job.
Ray detects a dead actor (the driver's error names it); a shorter heartbeat would make the
death of one actor, or a stage stopped for a while, end the living ones and lose the state
they hold."""

_FILTER_CODE = """
import re, sys
drop = re.compile(sys.argv[1].encode("latin-1"))
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    if not drop.match(line):
        out.write(line)
        out.flush()
"""


def drop_output_lines(pattern: bytes, fd: int = 1) -> None:
    """Leave the lines matching ``pattern`` out of what this process writes to ``fd``
    (stdout by default; C++ writers included): ``fd`` becomes a pipe into a small filter
    process that copies every other line to where ``fd`` pointed. The filter is a process
    of its own, so it also drains what a crashing actor writes last (it ends when the
    actor's end of the pipe closes). Started with ``subprocess`` without a pre-exec hook:
    nothing of JAX is forked. Once per process and ``fd``; with ``$RHINO_SHOW_GLOO`` set,
    nothing is dropped."""
    if fd in _FILTERS or os.environ.get("RHINO_SHOW_GLOO"):
        return
    import subprocess
    import sys

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    former = os.dup(fd)
    try:
        filt = subprocess.Popen([sys.executable, "-c", _FILTER_CODE,
                                 pattern.decode("latin-1")], stdin=subprocess.PIPE,
                                stdout=former, close_fds=True)
    finally:
        os.close(former)
    os.dup2(filt.stdin.fileno(), fd)
    _FILTERS[fd] = filt


_FILTERS: dict[int, Any] = {}     # fd -> this process's filter (kept alive with the process)


def host_value(x: Any) -> Any:
    """A jax array's whole value as numpy (a typed PRNG key array as a ``PackedKey`` of its
    bits: numpy has no key type). Where it is split across processes, every process of the
    job must call this (an all-gather); the answer is the same on each."""
    import jax

    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return PackedKey(host_value(jax.random.key_data(x)), str(jax.random.key_impl(x)))
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def pin_process(cpus: Sequence[int]) -> None:
    """Every thread of this process (and so every thread it starts later) onto ``cpus``
    (Linux: an affinity is per thread)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cpus))
        except (ProcessLookupError, PermissionError):  # ended meanwhile / not ours
            pass


def take_rows(x: np.ndarray, rows: Sequence[tuple[int, int]]) -> np.ndarray:
    """The rows ``[a, b)`` of ``x``, one after the other.

    >>> take_rows(np.arange(6), ((0, 2), (4, 5))).tolist()
    [0, 1, 4]
    """
    return np.concatenate([x[a:b] for a, b in rows], axis=0)


def _whole(part: np.ndarray, n: int, rows: Sequence[tuple[int, int]]) -> np.ndarray:
    """``take_rows``' inverse: ``n`` rows, ``part``'s where they came from, zeros elsewhere."""
    part = np.asarray(part)
    out = np.zeros((n, *part.shape[1:]), part.dtype)
    k = 0
    for a, b in rows:
        out[a:b] = part[k:k + b - a]
        k += b - a
    return out


class CountedTransport:
    """A transport that counts what it moved (``sent``, ``received``): what ``describe()``
    and the tests read to see that values between stages went through it."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.counts = {"sent": 0, "received": 0}
        self.send_in_background = getattr(inner, "send_in_background", False)

    def send(self, src: int, dst: int, key: tuple, value: Any) -> None:
        self.inner.send(src, dst, key, value)
        self.counts["sent"] += 1

    def recv(self, dst: int, src: int, key: tuple, timeout: float) -> Any:
        out = self.inner.recv(dst, src, key, timeout)
        self.counts["received"] += 1
        return out

    def expect(self, dst: int, src: int, key: tuple) -> None:
        self.inner.expect(dst, src, key)

    def acknowledge(self, dst: int, src: int, key: tuple) -> None:
        self.inner.acknowledge(dst, src, key)

    def wait_taken(self, src: int, items: Any, timeout: float) -> None:
        self.inner.wait_taken(src, items, timeout)

    def abort(self, step: int, why: str) -> None:
        self.inner.abort(step, why)

    def start(self, step: int) -> None:
        self.inner.start(step)


def stages_name(stages: Sequence[int]) -> str:
    """``stage 1``, or for a device group's stages ``stages 1, 3``.

    >>> stages_name((1,)), stages_name((1, 3))
    ('stage 1', 'stages 1, 3')
    """
    stages = tuple(stages)
    return f"stage {stages[0]}" if len(stages) == 1 else \
        f"stages {', '.join(map(str, stages))}"


class StageActor:
    """One host of one stage (or of one device group's stages), in its own process (wrapped
    by ``ray.remote`` at run time).

    Args:
        stage: the stage; rank: this host within the stage; hosts: the stage's hosts;
        stages: every stage this actor runs (a device group's under ``interleaved-1f1b``,
        ``stage`` its first; default ``(stage,)``).
    """

    def __init__(self, stage: int, rank: int = 0, hosts: int = 1,
                 stages: Sequence[int] | None = None):
        self.stage, self.rank, self.hosts = stage, rank, hosts
        self.stages = tuple(stages) if stages else (stage,)
        self.where = stages_name(self.stages) + (f" (host {rank} of {hosts})" if hosts > 1
                                                 else "")
        self.worker = None    # the StageWorker, or a device group's GroupWorker
        self.workers: dict[int, Any] = {}   # stage -> its StageWorker
        self.stage_args: dict[int, tuple[int, ...]] = {}   # stage -> the refs it reads
        self.jt: CountedTransport | None = None  # between stages: JAX's transfers (setup)
        self.kept: dict[tuple[int, int], Any] = {}  # (step, ref) -> a result (jax array)
        self.inline: set[tuple[int, int]] = set()    # those sent back whole
        self.args: tuple[int, ...] = ()
        self.processes: tuple[int, ...] = ()   # this stage's processes of the job
        self.outputs: tuple[int, ...] = ()
        self.sources: dict[int, Any] = {}   # host_data functions, by the driver's token

    def coordinator(self) -> str:
        """``host:port`` for the run's ``jax.distributed`` job: this node, a free port."""
        from rhino.distributed import free_port

        ip = import_ray().util.get_node_ip_address()
        return f"{ip}:{free_port('')}"

    def node_cpus(self) -> tuple[str, tuple[int, ...]]:
        """This actor's node and the cores it may run on (none where the OS cannot say)."""
        return import_ray().get_runtime_context().get_node_id(), usable_cores()

    def setup(self, spec_blob: bytes, devices: int, job: tuple, timeout: float,
              cpus: Sequence[int] | None = None) -> dict:
        """Keep to ``cpus`` (if given; before JAX starts its backend, whose thread pools
        are sized to them), join the run's ``jax.distributed`` job, build the stage worker
        on this host's ``devices`` devices (of the stage's global mesh), compile its
        programs; ``describe()``. ``job``: ``(coordinator, processes, this process, stage ->
        its processes, per stage (mesh shape, axis names, ref -> spec))``: every actor of
        the run is one process of the job (a run of one actor too) and values between
        stages move through JAX's transfer servers (``runtime.transfer.jax_transfer``).
        ``spec_blob``: the pickled ``StageArtifact``, or a list of them, one per stage of
        ``stages`` (a device group: they share the mesh and run as one ``GroupWorker``)."""
        if cpus:
            pin_process(cpus)
        import jax

        # CPU: a stage of one host keeps its collectives in the process (with gloo, JAX's
        # default in a job, they would go through sockets: 2x slower programs).
        self._join(job[0], job[1], job[2], timeout, "gloo" if self.hosts > 1 else None)
        arts = pickle.loads(spec_blob)      # StageArtifacts: rhino's data, no user code
        arts = list(arts) if isinstance(arts, (list, tuple)) else [arts]
        local = jax.local_devices()
        if len(local) < devices:
            raise ExecutorError(f"{self.where}: expected {devices} devices in the actor, "
                                f"found {len(local)} (XLA_FLAGS="
                                f"{os.environ.get('XLA_FLAGS', '')!r})", stage=self.stage,
                                failure=Failure.PROGRAM)
        # This stage's processes of the run's job (a checkpoint part is written by them).
        self.processes = tuple(job[3][self.stage])
        if self.hosts > 1:
            procs = set(self.processes)
            # Host-major: the mesh's first axis runs across hosts, as the plan assumes.
            mesh_devices = sorted((d for d in jax.devices() if d.process_index in procs),
                                  key=lambda d: (d.process_index, d.id))
        else:
            mesh_devices = local[:devices]
        from rhino.runtime.executors.group_worker import group_units

        split = arts[0].split
        self.workers = {a.stage: a.build(mesh_devices) for a in arts}
        units = group_units([self.workers[s] for s in self.stages])
        if len(units) != 1:
            raise ExecutorError(f"{self.where}: expected the stages of one device group, "
                                f"found {len(units)} groups", stage=self.stage,
                                failure=Failure.PROGRAM)
        self.worker = units[0]
        mine = set(self.stages)
        self.outputs = tuple(o.ref for o in split.outputs if o.producer is not None
                             and o.producer[1] in mine and o.source in ("task", "acc"))
        self.stage_args = {s: tuple(split.stage_args(s)) for s in self.stages}
        self.args = tuple(dict.fromkeys(r for s in self.stages for r in self.stage_args[s]))
        self.rows = self._batch_rows(split) if self.hosts > 1 else {}
        from rhino.runtime.transfer.jax_transfer import JaxTransferTransport, stage_targets

        by_process: dict[int, list] = {}
        for d in jax.devices():
            by_process.setdefault(d.process_index, []).append(d)
        stage_devices = {s: [d for p in procs for d in sorted(by_process[p],
                                                              key=lambda d: d.id)]
                         for s, procs in job[3].items()}
        self.jt = CountedTransport(JaxTransferTransport(
            job[3], target=stage_targets(self.workers, stage_devices, job[4]),
            address=f"{import_ray().util.get_node_ip_address()}:0",
            connect_timeout=timeout, defer_relayout=True))
        return self.describe()

    def _join(self, coordinator: str, processes: int, process: int, timeout: float,
              collectives: str | None) -> None:
        """Join the run's ``jax.distributed`` job (bounded by ``timeout``), CPU collectives
        set."""
        import jax

        drop_output_lines(GLOO_CHATTER)
        jax.config.update("jax_cpu_collectives_implementation", collectives)
        try:
            # Ray tells the driver when an actor dies; JAX's own heartbeat would end every
            # other process of the job 100 s after one died (or stopped), taking the
            # state they hold with them: left to Ray (JOB_HEARTBEAT_S).
            jax.distributed.initialize(coordinator, num_processes=processes,
                                       process_id=process,
                                       initialization_timeout=max(1, int(timeout)),
                                       heartbeat_timeout_seconds=JOB_HEARTBEAT_S)
        except Exception as e:
            raise ExecutorError(f"{self.where}: could not join the run's jax.distributed job "
                                f"at {coordinator} within {timeout:.0f} s: "
                                f"{type(e).__name__}: {e}", stage=self.stage,
                                failure=Failure.PROGRAM) from e

    def _batch_rows(self, split: Any) -> dict[int, tuple[tuple[int, int], ...]]:
        """Per batch argument whose rows this host's devices do not all need: the rows
        (``[start, stop)`` ranges of the whole batch) they do need, microbatch by microbatch;
        the driver then sends only those (``run_step``'s ``partial``). A device group's
        stages reading one batch argument need the rows any of them needs."""
        m = split.num_microbatches
        out = {}
        whole = {r for s in self.stages for r in split.whole_batch_args(s)}
        sliced = dict.fromkeys(r for s in self.stages for r in split.sliced_batch_args(s))
        for r in sliced:
            if r not in self.args or r in whole:     # read whole: every row is needed
                continue
            shape = split.microbatch_shape(r)
            size = shape[0]
            spans = set()
            for s in self.stages:
                if r not in self.stage_args[s]:
                    continue
                for index in self.workers[s].sharding(r).addressable_devices_indices_map(
                        shape).values():
                    start, stop, _ = (index[0] if index else slice(None)).indices(size)
                    spans.add((start, stop))
            merged: list[list[int]] = []
            for a, b in sorted(spans):
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            if merged != [[0, size]]:
                out[r] = tuple((k * size + a, k * size + b) for k in range(m)
                               for a, b in merged)
        return out

    def describe(self) -> dict:
        import jax

        return {"stage": self.stage, "stages": self.stages, "rank": self.rank,
                "hosts": self.hosts, "args": self.args, "stage_args": dict(self.stage_args),
                "outputs": self.outputs, "pid": os.getpid(),
                "host": socket.gethostname(), "devices": jax.local_device_count(),
                "global_devices": jax.device_count(), "kept": len(self.kept),
                "platform": jax.devices()[0].platform,
                "node": import_ray().get_runtime_context().get_node_id(),
                "rows": getattr(self, "rows", {}), "cpus": usable_cores(),
                "jax_transfers": dict(self.jt.counts, **self.jt.inner.waited,
                                      modes=sorted(set(self.jt.inner.modes.values())),
                                      held=self.jt.inner.held,
                                      deferred=self.jt.inner.deferred,
                                      acknowledged=self.jt.inner.acknowledged)
                if self.jt is not None else {}}

    def _transport(self, step: int) -> StepTransport:
        return StepTransport(self.jt, step)

    def abort(self, step: int, why: str) -> None:
        """Stop this actor's waits of ``step`` (another stage failed, or Ctrl-C)."""
        if self.jt is not None:
            self.jt.abort(step, why)

    def _start(self, step: int) -> None:
        if self.jt is not None:
            self.jt.start(step)

    def warm_up(self, timeout: float) -> float:
        """Run the stage once on zeros (step 0, results dropped): every program compiled
        and every collective's communicator set up before the first step. Seconds."""
        t0 = time.perf_counter()
        self._start(0)
        zeros: dict[int, Any] = {}
        for w in self.workers.values():
            zeros.update(w.zero_args())
        outs, _ = self.worker.run_step(zeros, self._transport(0), timeout, warm_up=True)
        import jax

        jax.block_until_ready(outs)
        return time.perf_counter() - t0

    def collectives(self, stage: int | None = None) -> dict:
        """Per compiled program of ``stage`` (default: this actor's first), ``kind ->
        (count, bytes)``."""
        return self.workers[self.stage if stage is None else stage].collectives()

    def run_step(self, control: bytes, *values: Any) -> bytes:
        """``_step`` with its arguments but ``values`` pickled in ``control`` (one blob is
        far cheaper for Ray to pass than a few hundred small entries); its answer pickled
        the same way."""
        return pickle.dumps(self._step(*pickle.loads(control), *values),
                            protocol=pickle.HIGHEST_PROTOCOL)

    def _step(self, step: int, timeout: float, kept: Mapping[int, tuple[int, int]],
              release: Sequence[tuple[int, int]], drop_steps: Sequence[int],
              keep_from: int, keep_arrays: bool, partial: Mapping[int, int],
              push: Sequence[tuple[int, tuple[int, int], Sequence[int]]],
              pull: Mapping[int, tuple[int, int, int]], refs: Sequence[int],
              want_meta: bool, hosted: Mapping[int, tuple] = None,
              ship: Mapping[int, bytes] = None, *values: Any) -> tuple:
        """One step: ``refs[i] -> values[i]`` (resolved by Ray) and ``kept``: argument ref
        -> (step, ref) of a result this actor kept. ``partial``: batch arguments sent as
        only this host's rows (``describe()["rows"]``), ref -> the whole batch's size; the
        other rows are zeros here (no device of this host reads them). First drops the
        results ``release`` names, those of ``drop_steps`` (failed steps: what they were
        given is kept) and 0-d ones older than ``keep_from``, the last step that finished
        (the driver may pass its 0-d results back). ``push``: kept results (holding stage,
        (step, ref), reading stages) other stages read this step, sent to them first (a
        tied weight, actor to actor); ``pull``: argument ref -> (stage, step, ref) of such
        a result from another stage, waited for here (by the first of this actor's stages
        reading it).
        ``hosted``: batch arguments this actor makes itself (``rhino.host_data``), ref ->
        (source token, leaf, user step, rows, whole batch size); ``ship``: source token ->
        its cloudpickled ``fn``, the first time this actor needs it.

        Returns:
            (results sent back: ref -> numpy (0-d ones only with ``keep_arrays``), the
            others' ref -> (shape, dtype name) if ``want_meta`` (they do not change between
            steps) else None, task records on the ``time.time()`` clock, seconds the stage
            spent); the host values only from the stage's first host.
        """
        import jax

        self._start(step)
        t0 = time.perf_counter()
        dropped = set(drop_steps)
        gone = set(release) | {k for k in self.kept if k[0] in dropped} | \
            {k for k in self.inline if k[0] < keep_from}
        for k in gone:
            self.kept.pop(k, None)
            self.inline.discard(k)
        # A program of a failed step still running here (a stuck callback) would hold this
        # step's programs up behind it: refused, naming it; the state stays.
        if not self.worker.idle(timeout):
            raise ExecutorError(f"{self.where}: a program of an earlier, failed step is "
                                f"still running (stuck in a program or a callback) after "
                                f"{timeout:g} s more: step {step} cannot run until it stops; "
                                f"the state it was given is kept", stage=self.stage,
                                failure=Failure.STALLED)
        args = {r: unpack_key(v) for r, v in zip(refs, values)}
        for r, n in partial.items():
            args[r] = _whole(args[r], n, self.rows[r])
        args.update(self._host_rows(hosted or {}, ship or {}))
        missing = [r for r, k in kept.items() if tuple(k) not in self.kept]
        if missing:
            raise ExecutorError(f"{self.where}: the driver referred to kept results for "
                                f"arguments {missing}; this actor does not have them")
        args.update({r: self.kept[tuple(k)] for r, k in kept.items()})
        transport = self._transport(step)
        for r, (src, k, ref) in pull.items():   # asked for before they are sent
            transport.expect(self.reader(r), src, ("arg", k, ref))
        for holder, k, readers in push:
            k = tuple(k)
            if k not in self.kept:
                raise ExecutorError(f"{self.where}: expected the kept result (step, ref) "
                                    f"{k} that stage(s) {list(readers)} read, found none "
                                    f"(released)", stage=holder)
            for dst in readers:
                transport.send(holder, dst, ("arg", *k), self.kept[k])
        for r, (src, k, ref) in pull.items():
            try:
                args[r] = transport.recv(self.reader(r), src, ("arg", k, ref), timeout)
            except TimeoutError as e:
                raise ExecutorError(f"{self.where}: argument #{r} (result v{ref} of step {k} "
                                    f"on stage {src}) did not come: {e}", stage=self.stage,
                                    failure=Failure.TIMEOUT) from e
        outs, records = self.worker.run_step(args, transport, timeout)
        jax.block_until_ready(outs)
        host, meta = {}, {}
        for r, x in outs.items():
            self.kept[(step, r)] = x
            if keep_arrays and np.ndim(x) > 0:
                if want_meta:   # the same every step: the driver asks once
                    meta[r] = (tuple(x.shape), dtype_name(x))
            else:
                host[r] = host_value(x)
                self.inline.add((step, r))
        secs = time.perf_counter() - t0
        meta = meta if want_meta else None
        if self.rank != 0:
            return {}, meta, [], secs
        # perf_counter is per machine: the driver moves the records to the wall clock
        # (when they are read: making ~40 records here took ~0.2 ms of the step's end).
        shift = time.time() - time.perf_counter()
        return host, meta, (shift, [(r.stage, r.label, r.start, r.end, r.microbatch,
                                     r.kind) for r in records]), secs

    def reader(self, ref: int) -> int:
        """The first of this actor's stages reading argument ``ref`` (a value another
        stage sends for it is sent to that stage)."""
        return next((s for s in self.stages if ref in self.stage_args.get(s, ())),
                    self.stage)

    def _host_rows(self, hosted: Mapping[int, tuple], ship: Mapping[int, bytes]
                   ) -> dict[int, np.ndarray]:
        """The batch arguments ``hosted`` made here by their ``host_data`` functions (one
        call per source, step and rows): each the whole batch's shape, this host's rows
        filled (zeros elsewhere: no device of this host reads them; ``place`` then puts
        only this host's shards on a mesh spanning hosts)."""
        from rhino.runtime.state.host_data import HostRequest

        for token, blob in ship.items():
            self.sources[token] = import_ray().cloudpickle.loads(blob)
        used = {h[0] for h in hosted.values()}
        self.sources = {k: v for k, v in self.sources.items() if k in used}
        made: dict[tuple, list[np.ndarray]] = {}
        out = {}
        for r, (token, leaf, user_step, rows, size) in hosted.items():
            key = (token, user_step, rows)
            if key not in made:
                source = self.sources.get(token)
                if source is None:
                    raise ExecutorError(f"{self.where}: expected the host_data function "
                                        f"#{token}, found none (it was not sent)",
                                        stage=self.stage)
                req = HostRequest(self.stage, self.rank, self.hosts, user_step,
                                  tuple(tuple(x) for x in rows), size)
                try:
                    made[key] = source(req)
                except Exception as e:
                    raise ExecutorError(f"{self.where}: the host_data function failed on "
                                        f"{req}: {type(e).__name__}: {e}",
                                        stage=self.stage, failure=Failure.PROGRAM) from e
            part = made[key][leaf]
            whole = rows == ((0, size),)
            out[r] = part if whole else _whole(part, size, rows)
        return out

    def init_state(self, blob: bytes) -> dict[int, tuple]:
        """Create step argument leaves directly on this actor's devices with their planned
        shardings: ``blob`` holds the initializer's arguments and, per stage of this actor
        that makes some, ``(stage, program, refs)``: the user's initializer as the driver
        exported it for that stage's leaves ``refs`` (``artifacts.export_init``; plain
        pickle: no user code here), run one after the other; kept as step 0's results.
        Returns ref -> (shape, dtype name) (from the first host)."""
        import jax

        from rhino.runtime.executors.artifacts import run_init

        args, parts = pickle.loads(blob)
        args = jax.tree_util.tree_map(lambda x: unpack_key(x), args,
                                      is_leaf=lambda x: isinstance(x, PackedKey))
        out = {}
        for stage, program, refs in parts:
            refs = list(refs)
            worker = self.workers[stage]
            values = run_init(program, args, [worker.sharding(k) for k in refs])
            for k, v in zip(refs, values):
                self.kept[(0, k)] = v
                out[k] = (tuple(v.shape), dtype_name(v))
        return out if self.rank == 0 else {}

    def save_part(self, directory: str, names: Mapping[str, tuple[int, int]]) -> int:
        """Write the kept results ``names`` (name -> (step, ref)) as one orbax checkpoint,
        every host of the stage (or device group) its own shards
        (``runtime.state.checkpoint``). Bytes held here."""
        from rhino.runtime.state.checkpoint import write_part

        missing = [n for n, k in names.items() if tuple(k) not in self.kept]
        if missing:
            raise ExecutorError(f"{self.where}: expected kept results for {missing}, found "
                                f"none (released)", stage=self.stage)
        values = {n: self.kept[tuple(k)] for n, k in names.items()}
        write_part(directory, values, self.processes)
        return sum(int(np.prod(s.data.shape)) * s.data.dtype.itemsize
                   for x in values.values() for s in x.addressable_shards)

    def fetch(self, keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
        """The kept results ``keys`` ((step, ref)) as numpy (every host of the stage takes
        part; the first returns them)."""
        missing = [tuple(k) for k in keys if tuple(k) not in self.kept]
        if missing:
            raise ExecutorError(f"{self.where}: expected kept results (step, ref) "
                                f"{missing}, found none (released)", stage=self.stage)
        out = {tuple(k): host_value(self.kept[tuple(k)]) for k in keys}
        return out if self.rank == 0 else {}
