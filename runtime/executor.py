"""Executors: run a static pipeline schedule of stage programs on device meshes.

Both executors run the same per-stage *instruction lists* (``instructions``), derived from a
``Schedule`` (which task when) and a ``StepSplit`` (what each task reads and writes)::

    stage 0: run F(mb0) · send v12@mb0→1 · run F(mb1) · send ... · recv g7@mb0←1 · run B(mb0) ...
    stage 1: recv v12@mb0←0 · run F(mb0) · run B(mb0) · send g7@mb0→0 · ...

A ``StageWorker`` owns one stage: its mesh, its compiled programs (one per task kind, with
and without the gradient accumulators; compiled on first use), the training state it reads,
and per microbatch the values still awaited by a later task (released after their last
reader ran, so 1F1B holds at most its in-flight microbatches' activations). It runs its
instruction list once per step through a ``Transport``:

* ``LocalTransport``: one process; a value is handed over in memory and put on the
  receiving mesh with the receiver's sharding (``jax.device_put``: a cross-mesh copy).
* the Ray executor (``ray_executor.py``) moves host copies through the object store.

``LocalExecutor`` runs one thread per stage (meshes are disjoint sets of local devices; the
threads only dispatch and wait). Every wait has a timeout; an error on one stage stops the
others at their next wait and is raised naming the stage and the task.

Example:
    >>> from rhino.runtime.schedules import one_f_one_b
    >>> # instructions(split, one_f_one_b(2, 4), stage=0)  -> [Instr('run', 'F', 0), ...]
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import numpy as np

from rhino.errors import RhinoError
from rhino.runtime.schedules import Schedule, make_schedule
from rhino.hlo_passes.stage_programs import (StageShardings, StepSplit, finish_sum, flatten,
                                             split_step, task_function)
from rhino.runtime.timeline import TaskRecord

DEFAULT_TIMEOUT_S = 600.0


class ExecutorError(RhinoError):
    """A pipeline step failed or timed out on a stage."""


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction of a stage.

    Attributes:
        op: ``run``, ``send`` or ``recv``.
        kind: ``F``/``B``/``A`` (run); microbatch: its microbatch (None for ``A`` and for
            values of apply tasks); ref: the value (send/recv); peer: the other stage;
            acc: the value is an accumulated sum (sent once per step).
    """

    op: str
    kind: str = ""
    microbatch: int | None = None
    ref: int | None = None
    peer: int | None = None
    acc: bool = False

    @property
    def key(self) -> tuple:
        return (self.ref, "acc" if self.acc else self.microbatch)

    def label(self) -> str:
        if self.op == "run":
            return f"{self.kind}{'' if self.microbatch is None else self.microbatch}"
        arrow = "→" if self.op == "send" else "←"
        what = "acc" if self.acc else ("" if self.microbatch is None else self.microbatch)
        return f"{self.op} v{self.ref}@{what}{arrow}{self.peer}"


def instructions(split: StepSplit, schedule: Schedule, stage: int) -> list[Instr]:
    """The instruction list of ``stage`` for one step (pure; see the module docstring)."""
    if schedule.num_stages != split.num_stages or \
            schedule.num_microbatches != split.num_microbatches:
        raise ExecutorError(f"schedule: expected {split.num_stages} stages × "
                            f"{split.num_microbatches} microbatches (the split), found "
                            f"{schedule.num_stages} × {schedule.num_microbatches}")
    m = split.num_microbatches
    out: list[Instr] = []
    received: set[tuple] = set()  # a value read by several tasks here is received once
    for t in schedule.stage_tasks(stage):
        spec = split.task(t.kind, stage)
        mb = None if t.kind == "A" else t.microbatch
        for i in spec.inputs:
            if i.source == "task" and i.producer[1] != stage:
                ins = Instr("recv", ref=i.ref, microbatch=mb if i.producer[0] != "A"
                            else None, peer=i.producer[1])
            elif i.source == "acc" and i.producer[1] != stage:
                ins = Instr("recv", ref=i.ref, peer=i.producer[1], acc=True)
            else:
                continue
            if ins.key not in received:
                received.add(ins.key)
                out.append(ins)
        out.append(Instr("run", t.kind, mb))
        for r in spec.outputs:
            dsts = sorted({s for k, s in split.consumers.get(r, ()) if s != stage
                           and (k != "A" or t.kind == "A")})
            out.extend(Instr("send", ref=r, microbatch=mb, peer=d) for d in dsts)
        if t.kind != "A" and mb == m - 1:
            for r in spec.accumulate:
                dsts = sorted({s for k, s in split.consumers.get(r, ()) if k == "A"
                               and s != stage})
                out.extend(Instr("send", ref=r, peer=d, acc=True) for d in dsts)
    return out


class Transport(Protocol):
    """Moves values between stages (an NCCL transport would implement the same)."""

    def send(self, src: int, dst: int, key: tuple, value: Any) -> None: ...

    def recv(self, dst: int, src: int, key: tuple, timeout: float) -> Any: ...


class LocalTransport:
    """In-process mailboxes, one per stage; ``abort`` wakes every waiting receiver."""

    def __init__(self, num_stages: int):
        self._boxes: list[dict] = [dict() for _ in range(num_stages)]
        self._cond = threading.Condition()
        self._aborted: str | None = None

    def send(self, src: int, dst: int, key: tuple, value: Any) -> None:
        with self._cond:
            self._boxes[dst][(src, key)] = value
            self._cond.notify_all()

    def recv(self, dst: int, src: int, key: tuple, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (src, key) not in self._boxes[dst]:
                if self._aborted is not None:
                    raise ExecutorError(f"aborted: {self._aborted}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no value {key} from stage {src} after {timeout:.0f} s")
                self._cond.wait(left)
            return self._boxes[dst].pop((src, key))

    def abort(self, why: str) -> None:
        with self._cond:
            self._aborted = why
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self._aborted = None
            for b in self._boxes:
                b.clear()


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything a process needs to build one ``StageWorker`` (picklable: a Ray actor
    re-traces the step and re-splits it; the split is deterministic).

    Attributes:
        fn: the step; abstract_mb: its arguments with microbatch-sized batch leaves.
        assignment: equation path -> (role, stage); batch_refs, num_stages,
        num_microbatches, accumulate, schedule: as in ``split_step`` / ``make_schedule``.
        stage: the stage; mesh_shape, axis_names: its mesh; shardings: its shardings.
        measure: time every task (blocking on its results).
        rng_shapes: whole-batch shapes of batch-shaped random bits (``split_step``).
    """

    fn: Callable
    abstract_mb: tuple
    assignment: dict
    batch_refs: tuple[int, ...]
    num_stages: int
    num_microbatches: int
    accumulate: str
    schedule: str
    stage: int
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    shardings: StageShardings
    measure: bool = True
    rng_shapes: Mapping = dataclasses.field(default_factory=dict)

    def split(self) -> StepSplit:
        flat = flatten(jax.make_jaxpr(self.fn)(*self.abstract_mb))
        return split_step(flat, self.assignment, self.batch_refs, self.num_stages,
                          self.num_microbatches, self.accumulate, self.rng_shapes)

    def build(self, devices: Sequence[Any], split: StepSplit | None = None) -> "StageWorker":
        """The worker on ``devices`` (as many as the mesh has)."""
        from rhino.runtime.spmd import device_mesh

        need = int(np.prod(self.mesh_shape))
        if len(devices) != need:
            raise ExecutorError(f"stage {self.stage}: expected {need} devices for mesh "
                                f"{self.mesh_shape}, found {len(devices)}")
        mesh = device_mesh(self.mesh_shape, self.axis_names, list(devices))
        schedule = make_schedule(self.schedule, self.num_stages, self.num_microbatches)
        return StageWorker(split or self.split(), self.stage, mesh, self.shardings, schedule,
                           self.measure)


class StageWorker:
    """Runs one stage's instruction list (see the module docstring).

    Args:
        split: the step split; stage: which stage; mesh: its ``jax.sharding.Mesh``;
        shardings: its ``StageShardings``; schedule: the static schedule.
        measure: time each task (a watcher thread waits for its results, so dispatch of the
            next task is not held up).
    """

    def __init__(self, split: StepSplit, stage: int, mesh: Any, shardings: StageShardings,
                 schedule: Schedule, measure: bool = True):
        from jax.sharding import NamedSharding, PartitionSpec

        self.split, self.stage, self.mesh, self.schedule = split, stage, mesh, schedule
        self.measure = measure
        self.instrs = instructions(split, schedule, stage)
        self._named = lambda spec: NamedSharding(mesh, spec if spec is not None
                                                 else PartitionSpec())
        self._ref_sharding = {r: self._named(p) for r, p in shardings.refs.items()}
        self._value_sharding = {k: self._named(p) for k, p in shardings.values.items()}
        self._replicated = self._named(None)
        self._programs: dict[tuple[str, bool], Any] = {}
        # How many tasks of this stage read each (ref, microbatch) value: released after.
        self._readers: dict[int, int] = {}
        for k in ("F", "B", "A"):
            for i in split.task(k, stage).inputs:
                if i.source in ("task", "batch"):
                    self._readers[i.ref] = self._readers.get(i.ref, 0) + 1
        for k in ("F", "B", "A"):
            for r in split.task(k, stage).outputs:
                self._readers.setdefault(r, 0)
        self._last_send = {ins.key: n for n, ins in enumerate(self.instrs) if ins.op == "send"}
        self._results = frozenset(o.ref for o in split.outputs if o.source == "task")
        self._watch = cf.ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix=f"rhino-stage{stage}-timer")
        self._state: dict[int, Any] = {}
        self._state_src: dict[int, int] = {}

    def sharding(self, ref: int) -> Any:
        return self._ref_sharding.get(ref, self._replicated)

    def program(self, kind: str, with_acc: bool) -> Any:
        key = (kind, with_acc)
        fn = self._programs.get(key)
        if fn is None:
            task = self.split.task(kind, self.stage)
            cons = self._value_sharding

            def constrain(path, k, x):
                s = cons.get((path, k))
                return x if s is None else jax.lax.with_sharding_constraint(x, s)

            donate = (1,) if with_acc else ()
            fn = jax.jit(task_function(self.split, task, with_acc, constrain),
                         donate_argnums=donate)
            self._programs[key] = fn
        return fn

    # ------------------------------------------------------------------ one step
    def _place_args(self, args: Mapping[int, Any]) -> tuple[dict, dict]:
        """State on this mesh (kept across steps when the same array comes back), and the
        batch cut into microbatches on this mesh."""
        m = self.split.num_microbatches
        keys, slices, targets = [], [], []
        for r, x in args.items():
            if r in self.split.batch_refs:
                n = np.shape(x)[0]
                if n % m:
                    raise ExecutorError(f"batch argument #{r}: expected a leading dimension "
                                        f"divisible by {m} microbatches, found {n}")
                host = np.asarray(x)
                size = n // m
                for k in range(m):
                    keys.append((r, k))
                    slices.append(host[k * size:(k + 1) * size])
                    targets.append(self.sharding(r))
            elif self._state_src.get(r) is not x:  # the object itself is kept: no id reuse
                self._state[r] = jax.device_put(x, self.sharding(r))
                self._state_src[r] = x
        # One call places every microbatch slice (fewer dispatches than one per slice).
        batch = dict(zip(keys, jax.device_put(slices, targets))) if keys else {}
        return self._state, batch

    def run_step(self, args: Mapping[int, Any], transport: Transport,
                 timeout: float = DEFAULT_TIMEOUT_S) -> tuple[dict[int, Any], list[TaskRecord]]:
        """Run this stage's instructions once.

        Args:
            args: flat argument ref -> array for the arguments this stage reads.
            transport: moves values between stages.
            timeout: seconds to wait for any one value.

        Returns:
            (the step's results this stage produces: ref -> array, measured task records).

        Raises:
            ExecutorError: naming this stage and the instruction that failed or timed out.
        """
        state, batch = self._place_args(args)
        values: dict[tuple[int, Any], Any] = {}
        left: dict[tuple[int, Any], int] = {}
        accs: dict[int, Any] = {}
        records: list[TaskRecord] = []
        t_step = time.perf_counter()
        for n, ins in enumerate(self.instrs):
            try:
                if ins.op == "recv":
                    t0 = time.perf_counter()
                    x = transport.recv(self.stage, ins.peer, ins.key, timeout)
                    x = jax.device_put(x, self.sharding(ins.ref))
                    if ins.acc:
                        accs[ins.ref] = x
                    else:
                        values[(ins.ref, ins.microbatch)] = x
                        left[(ins.ref, ins.microbatch)] = self._readers.get(ins.ref, 1)
                    rec = TaskRecord(self.stage, ins.label(), t0, time.perf_counter(),
                                     ins.microbatch, "recv")
                    # When the value is ready on this mesh (the copy may still run): the
                    # task reading it cannot start before.
                    records.append(_Pending(rec, self._watch.submit(_ready_at, x))
                                   if self.measure else rec)
                elif ins.op == "send":
                    t0 = time.perf_counter()
                    x = accs[ins.ref] if ins.acc else values[(ins.ref, ins.microbatch)]
                    transport.send(self.stage, ins.peer, ins.key, x)
                    k = (ins.ref, ins.microbatch)
                    if not ins.acc and left.get(k, 1) <= 0 and not self._awaited(k) and \
                            self._last_send[ins.key] == n:
                        values.pop(k, None)
                    records.append(TaskRecord(self.stage, ins.label(), t0, time.perf_counter(),
                                              ins.microbatch, "send"))
                else:
                    records.append(self._run(ins, state, batch, values, left, accs))
            except ExecutorError as e:
                raise ExecutorError(f"stage {self.stage}, {ins.label()}: {e}") from e
            except TimeoutError as e:
                raise ExecutorError(f"stage {self.stage}, {ins.label()}: timed out: {e}") \
                    from e
            except Exception as e:  # a program failed: say where
                raise ExecutorError(f"stage {self.stage}, {ins.label()}: "
                                    f"{type(e).__name__}: {e}") from e
        outs: dict[int, Any] = {}
        for o in self.split.outputs:
            if o.producer is None or o.producer[1] != self.stage:
                continue
            if o.source == "acc":
                outs[o.ref] = finish_sum(self.split, o.ref, accs[o.ref])
            elif o.source == "task":
                outs[o.ref] = values[(o.ref, None)]
        del t_step
        try:
            return outs, self._timed(records, timeout)
        except Exception as e:  # a program failed while running asynchronously
            raise ExecutorError(f"stage {self.stage}: {type(e).__name__}: {e}") from e

    def _run(self, ins: Instr, state, batch, values, left, accs) -> TaskRecord:
        task = self.split.task(ins.kind, self.stage)
        mb = ins.microbatch
        inputs = []
        used = []
        for i in task.inputs:
            if i.source == "arg":
                inputs.append(state[i.ref])
            elif i.source == "batch":
                inputs.append(batch[(i.ref, mb)])
            elif i.source == "acc":
                inputs.append(accs[i.ref])  # raw sum: the program takes the mean
            else:
                key = (i.ref, mb if i.producer[0] != "A" else None)
                inputs.append(values[key])
                used.append(key)
        with_acc = ins.kind != "A" and mb is not None and mb > 0
        acc_in = [accs[r] for r in task.accumulate] if with_acc else []
        t0 = time.perf_counter()
        outs, new = self.program(ins.kind, with_acc)(inputs, acc_in,
                                                     np.int32(0 if mb is None else mb))
        # Timed without stalling dispatch: a watcher thread waits for the results while
        # this thread goes on to the next instruction (see _timed).
        # (Its accumulators are not waited on there: the next microbatch's call donates
        # them; all results of one execution become ready together.)
        done = None
        if self.measure and outs:
            done = self._watch.submit(_ready_at, outs)
        elif self.measure:
            jax.block_until_ready(new)
            done = _done_now()
        key_mb = None if ins.kind == "A" else mb
        for r, x in zip(task.outputs, outs):
            values[(r, key_mb)] = x
            left[(r, key_mb)] = self._readers.get(r, 0)
        accs.update(zip(task.accumulate, new))
        for key in used:  # release values whose last reader on this stage ran
            left[key] -= 1
            if left[key] <= 0 and not self._awaited(key):
                values.pop(key, None)
        kind = {"F": "forward", "B": "backward", "A": "apply"}[ins.kind]
        return _Pending(TaskRecord(self.stage, ins.label(), t0, t0, mb, kind), done)

    def _timed(self, records: list, timeout: float) -> list[TaskRecord]:
        """Measured records: a task ends when its results are ready and starts at the
        latest of its dispatch, the end of the stage's previous task (a stage's devices run
        one program at a time) and the arrival of the values it received."""
        out: list[TaskRecord] = []
        prev_end = inputs_ready = float("-inf")
        for r in records:
            if isinstance(r, _Pending) and r.record.kind == "recv":
                inputs_ready = max(inputs_ready, r.done.result(timeout=timeout))
                r = r.record
            elif isinstance(r, _Pending):
                end = r.done.result(timeout=timeout) if r.done is not None else r.record.end
                start = max(r.record.start, prev_end, inputs_ready)
                prev_end, inputs_ready = end, float("-inf")
                r = dataclasses.replace(r.record, start=start, end=max(end, start))
            out.append(r)
        return out

    def _awaited(self, key) -> bool:
        """A step result (never released early)."""
        return key[0] in self._results


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A dispatched task whose end time a watcher thread will report."""

    record: TaskRecord
    done: Any


def _done_now() -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_result(time.perf_counter())
    return f


def _ready_at(tree: Any) -> float:
    jax.block_until_ready(tree)
    return time.perf_counter()


class LocalExecutor:
    """All stages in this process, one thread each (see the module docstring).

    Args:
        workers: one ``StageWorker`` per stage, in stage order.
        timeout: seconds any one wait may take.
        transport: how values move (default ``LocalTransport``: ``jax.device_put`` onto the
            receiver's layout; ``cross_mesh.CrossMeshTransport``: 004's resharding).
    """

    def __init__(self, workers: Sequence[StageWorker], timeout: float = DEFAULT_TIMEOUT_S,
                 transport: LocalTransport | None = None):
        self.workers = list(workers)
        self.timeout = timeout
        self.transport = transport or LocalTransport(len(self.workers))
        self._pool = cf.ThreadPoolExecutor(max_workers=len(self.workers),
                                           thread_name_prefix="rhino-stage")
        self.last_records: list[TaskRecord] = []
        self.last_step_s = 0.0

    def run(self, flat_args: Sequence[Any]) -> dict[int, Any]:
        """One step: flat arguments in, ``ref -> value`` of the step's stage results out."""
        self.transport.reset()
        split = self.workers[0].split
        t0 = time.perf_counter()
        futures = []
        for w in self.workers:
            args = {r: flat_args[r] for r in split.stage_args(w.stage)}
            futures.append(self._pool.submit(self._guarded, w, args))
        outs: dict[int, Any] = {}
        records: list[TaskRecord] = []
        errors = []
        for w, f in zip(self.workers, futures):
            try:
                o, rec = f.result(timeout=self.timeout * 2)
                outs.update(o)
                records.extend(rec)
            except cf.TimeoutError:
                self.transport.abort(f"stage {w.stage} did not finish")
                errors.append(ExecutorError(f"stage {w.stage}: the step did not finish "
                                            f"within {2 * self.timeout:.0f} s"))
            except ExecutorError as e:
                errors.append(e)
        if errors:
            # The root cause: a failure that is not another stage's abort, earliest first.
            first = [e for e in errors if "aborted:" not in str(e)] or errors
            if len(errors) > 1:
                others = "; ".join(str(e) for e in errors if e is not first[0])
                raise ExecutorError(f"{first[0]} (other stages: {others})") from first[0]
            raise first[0]
        jax.block_until_ready(outs)
        self.last_step_s = time.perf_counter() - t0
        self.last_records = records
        return outs

    def _guarded(self, worker: StageWorker, args):
        try:
            return worker.run_step(args, self.transport, self.timeout)
        except Exception as e:
            self.transport.abort(str(e))
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False)
