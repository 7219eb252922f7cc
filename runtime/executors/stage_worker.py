"""One pipeline stage's worker: ``StageWorker`` runs the stage's instruction list once per
step through a ``Transport``.

Both executors (``executors/local.py``, one thread per stage in this process, and the Ray
actors, ``ray/actor.py``) run the same per-stage *instruction lists* (``instructions``),
derived from a ``Schedule`` (which task when) and a ``StepSplit`` (what each task reads and
writes)::

    stage 0: run F(mb0) · send v12@mb0→1 · run F(mb1) · send ... · recv g7@mb0←1 · run B(mb0) ...
    stage 1: recv v12@mb0←0 · run F(mb0) · run B(mb0) · send g7@mb0→0 · ...

A ``StageWorker`` owns one stage: its mesh, its compiled programs (one per task kind, with
and without the gradient accumulators; compiled on first use), the training state it reads,
and per microbatch the values still awaited by a later task (released after their last
reader ran, so 1F1B holds at most its in-flight microbatches' activations). Transports:

* ``LocalTransport``: one process; a value is handed over in memory and put on the
  receiving mesh with the receiver's sharding (``jax.device_put``: a cross-mesh copy).
* the Ray executor (``ray/executor.py``): device to device through JAX's transfer servers,
  every actor one process of one ``jax.distributed`` job (``transfer/jax_transfer.py``).

Every wait has a timeout; every mailbox key carries the step number, and ``abort`` poisons
one step, so a stage still busy with a failed step can neither send into nor abort a later
one.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import time
from typing import Any, Generator, Mapping, Sequence

import jax
import numpy as np

from rhino.runtime.scheduling.schedules import Schedule
from rhino.hlo_passes import stage_effects
from rhino.hlo_passes.stage_programs import (StageShardings, StepSplit, constraints,
                                             finish_acc, is_apply, prologue_function,
                                             task_function)
from rhino.runtime import threads
from rhino.runtime.executors.host_effects import EffectsRunner
from rhino.runtime.scheduling.instructions import (Instr, acknowledged_recvs, first_apply,
                                                   held_sends, inputs_in_plan, instructions,
                                                   task_blocks)
from rhino.runtime.scheduling.task_timing import (Pending, all_ready, annotate, done_now,
                                                  measured, ready_at)
from rhino.runtime.transfer.placement import place
from rhino.runtime.transfer.transport import ExecutorError, Failure, Transport
from rhino.runtime.scheduling.timeline import TaskRecord

DEFAULT_TIMEOUT_S = 600.0
CLOSE_GRACE_S = 2.0
"""How long ``close()`` (and an interrupted step) waits for stage threads to stop."""


def _zeros(shape: tuple[int, ...], dtype: Any) -> Any:
    """Zeros of ``shape`` (numpy; for a typed PRNG key dtype, keys made of zero bits)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.numpy.zeros(shape, dtype)
    return np.zeros(shape, dtype)


def _abstract(x: Any) -> Any:
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=sharding,
                                weak_type=getattr(x, "weak_type", False))


class StageWorker:
    """Runs one stage's instruction list (see the module docstring).

    Args:
        split: the step split; stage: which stage; mesh: its ``jax.sharding.Mesh``;
        shardings: its ``StageShardings``; schedule: the static schedule.
        measure: time each task (a watcher thread waits for its results, so dispatch of the
            next task is not held up).
        programs: ``(kind, with_acc) -> callable``: the stage's programs compiled from its
            artifacts (``runtime.executors.artifacts``); without, each is jitted from ``split`` on
            first use.
        complete: ``programs`` are all there is (else those missing, the programs holding
            host callbacks, are jitted from ``split``: ``stage_effects``).
    """

    def __init__(self, split: StepSplit, stage: int, mesh: Any, shardings: StageShardings,
                 schedule: Schedule, measure: bool = True,
                 programs: Mapping[tuple[str, bool], Any] | None = None,
                 complete: bool = True):
        from jax.sharding import NamedSharding, PartitionSpec

        self.split, self.stage, self.mesh, self.schedule = split, stage, mesh, schedule
        self.measure = measure
        self.instrs = instructions(split, schedule, stage)
        self._named = lambda spec: NamedSharding(mesh, spec if spec is not None
                                                 else PartitionSpec())
        self._ref_sharding = {r: self._named(p) for r, p in shardings.refs.items()}
        self._constrain, self._finish = constraints(mesh, shardings)
        self._replicated = self._named(None)
        # Compiled from artifacts (``runtime.executors.artifacts``), or jitted from the split on
        # use.
        self._from_artifacts = programs is not None and complete
        self._programs: dict[tuple[str, bool], Any] = dict(programs or {})
        # Deserialized exports (``jax.jit(exported.call)``) get inputs in the plan's layout:
        # relaid out inside the inlined module, a LAPACK custom call's failed XLA's verifier.
        self._exported = programs is not None
        # Programs binding host callbacks: the warm-up runs their quiet variants, and
        # effects programs run after apply tasks on the mesh's first device.
        self._quiet = stage_effects.quiet_kinds(split, stage, self._programs)
        self._effects = EffectsRunner(split, stage, mesh)
        refused = stage_effects.check_mesh(split, stage, int(np.prod(mesh.devices.shape)))
        if refused is not None:
            raise ExecutorError(f"stage {stage}: {refused}", stage=stage)
        # How many tasks of this stage read each (ref, microbatch) value: released after.
        self._readers: dict[int, int] = {}
        mine = [t for (k, s), t in split.tasks.items() if s == stage]
        for t in mine:
            for i in t.inputs:
                if i.source in ("task", "batch"):
                    self._readers[i.ref] = self._readers.get(i.ref, 0) + 1
        for t in mine:
            for r in t.outputs:
                self._readers.setdefault(r, 0)
        self._sliced = split.sliced_batch_args(stage)
        self._whole = split.whole_batch_args(stage)
        self._prologue = split.prologues[stage]
        self._last_send = {ins.key: n for n, ins in enumerate(self.instrs) if ins.op == "send"}
        # Values the stage waits to see taken before its apply, and those it says it has
        # (where the transport can: see ``instructions.held_sends``).
        self._held = [(ins.peer, ins.key) for ins in held_sends(split, schedule, stage)]
        self._acked = acknowledged_recvs(split, schedule, stage)
        self._first_apply = first_apply(self.instrs)
        self._blocks = task_blocks(self.instrs)
        self._results = frozenset(o.ref for o in split.outputs if o.source == "task")
        # A daemon thread: one stuck program never holds up the interpreter's exit.
        self._watch = threads.SerialWorker(f"rhino-stage{stage}-timer")
        self._sender: threads.SerialWorker | None = None   # see run_step (background sends)
        self._state: dict[int, Any] = {}
        self._state_src: dict[int, int] = {}
        self._seen: dict[tuple[str, bool], Any] = {}  # program -> its abstract arguments

    def sharding(self, ref: int) -> Any:
        return self._ref_sharding.get(ref, self._replicated)

    def program(self, kind: str, with_acc: bool, quiet: bool = False) -> Any:
        """The program of task ``kind`` (``quiet``: its variant whose host callbacks give
        zeros, where it binds some)."""
        quiet = quiet and kind in self._quiet
        key = (stage_effects.QUIET + kind if quiet else kind, with_acc)
        fn = self._programs.get(key)
        if fn is not None:
            return fn
        task = self.split.task(kind, self.stage)
        if task.empty:    # instruction lists never run one: asking for it is a bug
            raise ExecutorError(f"stage {self.stage}: task {task.label} is empty (no "
                                f"equations, outputs or accumulators): it has no program",
                                stage=self.stage)
        if self._from_artifacts:
            raise ExecutorError(f"stage {self.stage}: no program {kind}"
                                f"{'+acc' if with_acc else ''} among its artifacts "
                                f"{sorted(self._programs)}", stage=self.stage)
        fn = jax.jit(inputs_in_plan(task, self.stage, self.sharding, task_function(
            self.split, task, with_acc, self._constrain, self._finish, quiet)),
            donate_argnums=(1,) if with_acc else ())
        self._programs[key] = fn
        return fn

    def prologue_program(self, quiet: bool = False) -> Any:
        """The stage's prologue, jitted (None when it computes nothing; ``quiet``: as
        ``program``)."""
        quiet = quiet and "P" in self._quiet
        key = (stage_effects.QUIET + "P" if quiet else "P", False)
        fn = self._programs.get(key)
        if fn is None and self._prologue.outputs and not self._from_artifacts:
            fn = jax.jit(prologue_function(self.split, self.stage, self._constrain, quiet))
            self._programs[key] = fn
        return fn

    def zero_args(self) -> dict[int, Any]:
        """Zeros for every argument this stage reads (whole-batch shapes): a step on them
        compiles every program and sets up every collective (``warm_up``)."""
        out: dict[int, Any] = {}
        for r in self.split.stage_args(self.stage):
            aval = self.split.flat.avals[r]
            out[r] = _zeros(tuple(aval.shape), aval.dtype)
        return out

    def memory(self) -> dict[str, int]:
        """This stage's memory per device, in bytes, from its compiled programs (those it
        has run: call after a step), each value counted at its shard's size in the layout
        it has here: ``state`` (the arguments it holds), ``accumulators`` (the gradient
        accumulators its backward programs carry from one microbatch to the next),
        ``handed`` (what a forward task leaves for its microbatch's backward task, per
        microbatch), ``in_flight`` (the most microbatches the schedule keeps handed values
        for), ``temp`` (the largest program's temporaries, XLA's ``memory_analysis``) and
        ``peak`` = state + accumulators + in_flight × handed + temp. Recomputation
        (``jax.checkpoint``) shows in ``handed``: a checkpointed region hands its inputs
        only, its backward recomputes the rest."""
        from rhino.runtime.scheduling.schedules import in_flight_bound

        sp = self.split
        avals = sp.flat.avals

        def local(shape, dtype, sharding) -> int:
            shard = sharding.shard_shape(tuple(shape)) if sharding is not None else shape
            return int(np.prod(shard, dtype=np.int64)) * np.dtype(dtype).itemsize

        state = sum(local(avals[r].shape, avals[r].dtype, self.sharding(r))
                    for r in sp.stage_args(self.stage) if r not in sp.batch_refs)
        temp = 0
        handed_refs: dict[int, int] = {}     # what the backward (B, and W if cut) reads of F
        carried: dict[str, int] = {}
        for (kind, with_acc), seen in self._seen.items():
            if kind == "P":
                continue
            inputs, acc_in, _ = seen
            if kind in ("B", "W"):
                task = sp.task(kind, self.stage)
                for i, x in zip(task.inputs, inputs):
                    if i.source == "task" and i.producer == ("F", self.stage):
                        handed_refs[i.ref] = local(x.shape, x.dtype, x.sharding)
            if with_acc:
                carried[kind] = sum(local(x.shape, x.dtype, x.sharding) for x in acc_in)
        handed = sum(handed_refs.values())
        # a cut backward's B and W carry their accumulators side by side
        backward = carried.get("B", 0) + carried.get("W", 0) if self.schedule.splits_backward \
            else carried.get("B", 0)
        accumulators = max([backward] + [v for k, v in carried.items() if k not in "BW"])
        for (kind, with_acc), args in self._seen.items():
            prog = self.prologue_program() if kind == "P" else self.program(kind, with_acc)
            mem = prog.lower(*args).compile().memory_analysis()
            temp = max(temp, int(getattr(mem, "temp_size_in_bytes", 0) or 0))
        if self.schedule.virtual_stages > 1:   # this stage's part of its group's column
            flight = self.schedule.chunk_in_flight(self.stage)
        else:
            flight = in_flight_bound(self.schedule.name, sp.num_stages, sp.num_microbatches,
                                     self.stage)
        return {"state": state, "accumulators": accumulators, "handed": handed,
                "in_flight": flight, "temp": temp,
                "peak": state + accumulators + flight * handed + temp}

    def collectives(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Per program this stage ran (``F``, ``B+acc``, ...), the collectives of its compiled
        HLO: ``kind -> (count, bytes per device)`` (``runtime.executors.spmd.summarize``)."""
        from rhino.runtime.executors.spmd import count_collectives, summarize

        out = {}
        for (kind, with_acc), args in sorted(self._seen.items()):
            text = self.program(kind, with_acc).lower(*args).compile().as_text()
            out[kind + ("+acc" if with_acc else "")] = summarize(count_collectives(text))
        return out

    # ------------------------------------------------------------------ one step
    def _place_args(self, args: Mapping[int, Any]) -> tuple[dict, dict]:
        """State on this mesh (kept across steps when the same array comes back) and the
        batch arguments read whole (the microbatches: ``_place_batch``)."""
        m = self.split.num_microbatches
        whole: dict[int, Any] = {}
        for r, x in args.items():
            if r in self.split.batch_refs:
                n = np.shape(x)[0]
                if n % m:
                    raise ExecutorError(f"batch argument #{r}: expected a leading dimension "
                                        f"divisible by {m} microbatches, found {n}")
                if r in self._whole:
                    whole[r] = place(x, self.sharding(r))
            elif self._state_src.get(r) is not x:  # the object itself is kept: no id reuse
                self._state[r] = place(x, self.sharding(r))
                self._state_src[r] = x
        return self._state, whole

    def _place_batch(self, args: Mapping[int, Any], microbatches: Sequence[int]) -> dict:
        """``(ref, microbatch) ->`` that microbatch's slice of each batch argument, on
        this mesh, for ``microbatches``."""
        m = self.split.num_microbatches
        keys, slices, targets = [], [], []
        for r, x in args.items():
            if r not in self.split.batch_refs or r not in self._sliced:
                continue
            host = np.asarray(x)
            size = np.shape(x)[0] // m
            for k in microbatches:
                keys.append((r, k))
                slices.append(host[k * size:(k + 1) * size])
                targets.append(self.sharding(r))
        if not keys:
            return {}
        if not self._replicated.is_fully_addressable:   # a multi-process mesh
            return {k: place(x, t) for k, x, t in zip(keys, slices, targets)}
        # One call places every slice (fewer dispatches than one per slice).
        return dict(zip(keys, jax.device_put(slices, targets)))

    def _run_prologue(self, state: Mapping[int, Any], whole: dict[int, Any],
                      quiet: bool = False) -> TaskRecord | None:
        """The stage's prologue on the whole batch: its values join ``whole``."""
        fn = self.prologue_program(quiet)
        if fn is None:
            return None
        args = [whole[r] if r in whole else state[r] for r in self._prologue.inputs]
        t0 = time.perf_counter()
        if ("P", False) not in self._seen:
            self._seen[("P", False)] = jax.tree_util.tree_map(_abstract, (args,))
        outs = fn(args)
        whole.update(zip(self._prologue.outputs, outs))
        done = self._watch.submit(ready_at, outs) if self.measure else done_now()
        return Pending(TaskRecord(self.stage, "P", t0, t0, None, "prologue"), done)

    @property
    def blocks(self) -> list[tuple[str, int | None]]:
        """The ``(kind, microbatch)`` of each of its task blocks, in order (``steps``
        yields them; ``instructions.task_blocks``)."""
        return [self._blocks[n] for n in sorted(self._blocks)]

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages this worker runs (its own; a ``GroupWorker`` runs several)."""
        return (self.stage,)

    def run_step(self, args: Mapping[int, Any], transport: Transport,
                 timeout: float = DEFAULT_TIMEOUT_S, warm_up: bool = False
                 ) -> tuple[dict[int, Any], list[TaskRecord]]:
        """Run this stage's instructions once (``steps`` to the end).

        Args:
            args: flat argument ref -> array for the arguments this stage reads.
            transport: moves values between stages.
            timeout: seconds to wait for any one value.
            warm_up: a step on zeros before the first (``zero_args``): host callbacks are
                not called (quiet programs, no effects programs: ``stage_effects``).

        Returns:
            (the step's results this stage produces: ref -> array, measured task records).

        Raises:
            ExecutorError: naming this stage and the instruction that failed or timed out.
        """
        blocks = self.steps(args, transport, timeout, warm_up)
        while True:
            try:
                next(blocks)
            except StopIteration as done:
                return done.value

    def steps(self, args: Mapping[int, Any], transport: Transport,
              timeout: float = DEFAULT_TIMEOUT_S, warm_up: bool = False
              ) -> Generator[tuple[str, int | None] | None, None,
                             tuple[dict[int, Any], list[TaskRecord]]]:
        """``run_step`` one task at a time: a generator that yields before each task's
        block of instructions (its receives, its program, its sends) that task's
        ``(kind, microbatch)``, and ``None`` before the step's end (the results, waiting
        for the programs to finish); it returns what ``run_step`` returns. A
        ``GroupWorker`` runs the stages of one device group this way, interleaved in the
        order of the group's column of the schedule."""
        # A transport that can ask for values before they are sent (JAX's transfer
        # server: the pull then waits at the sender) is told every value this step will
        # receive: those of the first task now, the others once that task is on its way.
        # Likewise the first microbatch is placed before the first task, the others after.
        expect = getattr(transport, "expect", None)
        first = next((n for n, ins in enumerate(self.instrs) if ins.op == "run"),
                     len(self.instrs))
        later = [ins for ins in self.instrs[first:] if ins.op == "recv"]
        if expect is not None:
            for ins in self.instrs[:first]:
                if ins.op == "recv":
                    expect(self.stage, ins.peer, ins.key)
        state, whole = self._place_args(args)
        m0 = (self.instrs[first].microbatch or 0) if first < len(self.instrs) else 0
        batch = self._place_batch(args, [m0])
        values: dict[tuple[int, Any], Any] = {}
        left: dict[tuple[int, Any], int] = {}
        accs: dict[int, Any] = {}
        records: list[TaskRecord] = []
        effects: list[tuple[Instr, Any]] = []    # effects programs run: (task, their token)
        try:
            rec = self._run_prologue(state, whole, warm_up)
        except Exception as e:
            raise self._error(Instr("run", "P"), f"{type(e).__name__}: {e}",
                              Failure.PROGRAM) from e
        if rec is not None:
            records.append(rec)
        # A transport whose send waits for the value (to copy it to the host) sends on a
        # thread of its own, in order, so this thread dispatches the next task meanwhile.
        background = getattr(transport, "send_in_background", False)
        acknowledge = getattr(transport, "acknowledge", None)
        wait_taken = getattr(transport, "wait_taken", None)
        taken: list[tuple[int, tuple]] = []
        if background and self._sender is None:
            self._sender = threads.SerialWorker(f"rhino-stage{self.stage}-sender")
        for n, ins in enumerate(self.instrs):
            if n in self._blocks:
                yield self._blocks[n]
            try:
                if ins.op == "recv":
                    t0 = time.perf_counter()
                    with annotate(self.stage, ins.label()):
                        x = transport.recv(self.stage, ins.peer, ins.key, timeout)
                    if (ins.peer, ins.key) in self._acked and acknowledge is not None:
                        taken.append((ins.peer, ins.key))   # said after the next dispatch
                    x = self._place_received(ins, x)
                    if ins.acc:
                        accs[ins.ref] = x
                    else:
                        values[(ins.ref, ins.microbatch)] = x
                        left[(ins.ref, ins.microbatch)] = self._readers.get(ins.ref, 1)
                    rec = TaskRecord(self.stage, ins.label(), t0, time.perf_counter(),
                                     ins.microbatch, "recv")
                    # When the value is ready on this mesh (the copy may still run): the
                    # task reading it cannot start before. One that is ready already (JAX's
                    # transfers wait for the arrival) is timed now, without a watcher's
                    # call (its wake-up took the stage's thread ~0.3 ms per value).
                    if self.measure:
                        done = done_now() if all_ready(x) else self._watch.submit(ready_at, x)
                        rec = Pending(rec, done, ins.peer)
                    records.append(rec)
                elif ins.op == "send":
                    x = accs[ins.ref] if ins.acc else values[(ins.ref, ins.microbatch)]
                    if background:
                        sending = self._sender.submit(self._send, transport, ins, x)
                        sending.add_done_callback(functools.partial(
                            self._stop_if_failed, transport, ins))
                        records.append(_Sending(ins, sending))
                    else:
                        records.append(self._send(transport, ins, x))
                    k = (ins.ref, ins.microbatch)
                    if not ins.acc and left.get(k, 1) <= 0 and not self._awaited(k) and \
                            self._last_send[ins.key] == n:
                        values.pop(k, None)
                else:
                    if n == self._first_apply and self._held and wait_taken is not None:
                        wait_taken(self.stage, self._held, timeout)
                    records.append(self._run(ins, state, batch, whole, values, left, accs,
                                             timeout, warm_up, effects))
                    if n == first:
                        if expect is not None:
                            for r in later:
                                expect(self.stage, r.peer, r.key)
                        batch.update(self._place_batch(args, [
                            k for k in range(self.split.num_microbatches) if k != m0]))
                    for peer, key in taken:
                        acknowledge(self.stage, peer, key)
                    taken.clear()
            except Exception as e:
                failed = self._failed_send(records)   # the root cause, if there is one
                named = failed if failed is not None else self._name_error(ins, e)
                if named is e:
                    raise
                raise named from e
        yield None
        outs: dict[int, Any] = {}
        for o in self.split.outputs:
            if o.producer is None or o.producer[1] != self.stage:
                continue
            if o.source == "acc":
                outs[o.ref] = finish_acc(self.split, o.ref, accs[o.ref])
            elif o.source == "task":
                outs[o.ref] = values[(o.ref, None)]
            elif o.source == "pre":
                outs[o.ref] = whole[o.ref]
        # Freed now, while the last task runs, instead of as this returns (a few hundred
        # buffers: ~2 ms of a 2-stage GPT's step end).
        values.clear()
        accs.clear()
        batch.clear()
        # The step ends when its callbacks have run.
        self._effects.wait(effects, timeout, lambda ins, what: self._error(
            ins, what, Failure.PROGRAM))
        try:
            return outs, self._timed(records, timeout)
        except ExecutorError:
            raise
        except Exception as e:  # a program failed while running asynchronously
            raise ExecutorError(f"stage {self.stage}: {type(e).__name__}: {e}",
                                stage=self.stage, failure=Failure.PROGRAM) from e

    def _send(self, transport: Transport, ins: Instr, x: Any) -> TaskRecord:
        t0 = time.perf_counter()
        with annotate(self.stage, ins.label()):
            transport.send(self.stage, ins.peer, ins.key, x)
        return TaskRecord(self.stage, ins.label(), t0, time.perf_counter(), ins.microbatch,
                          "send")

    def _name_error(self, ins: Instr, e: Exception) -> ExecutorError:
        """``e`` as an error naming this stage and ``ins``; one that already names a stage
        (a peer's failed value) as it is, but this stage's own timeout (JAX's transfers
        name the stage) with the instruction too, as every transport's reads."""
        if isinstance(e, ExecutorError):
            own = f"stage {self.stage}: "
            if e.stage == self.stage and e.failure is Failure.TIMEOUT and \
                    str(e).startswith(own):
                return self._error(ins, f"timed out: {str(e)[len(own):]}", Failure.TIMEOUT)
            if e.stage is not None:
                return e
            return self._error(ins, str(e), e.failure or Failure.PROGRAM)
        if isinstance(e, TimeoutError):
            return self._error(ins, f"timed out: {e}", Failure.TIMEOUT)
        return self._error(ins, f"{type(e).__name__}: {e}", Failure.PROGRAM)  # a program

    def _error(self, ins: Instr, what: str, failure: Failure) -> ExecutorError:
        return ExecutorError(f"stage {self.stage}, {ins.label()}: {what}", stage=self.stage,
                             failure=failure)

    def _place_received(self, ins: Instr, x: Any) -> Any:
        """A received value on this stage's mesh (one there already, in any layout, is
        taken as it is: the programs reading it change the layout, ``defer_relayout``;
        except for exported programs, which get it in the plan's layout: ``_exported``).
        If that fails because the value itself is the result of a failed program (it ran
        asynchronously on the sending stage), the sender is blamed, not this stage."""
        if getattr(getattr(x, "sharding", None), "mesh", None) == self.mesh and (
                not self._exported or x.sharding == self.sharding(ins.ref)):
            return x
        try:
            return place(x, self.sharding(ins.ref))
        except Exception as e:
            try:
                ready_at(x, timeout=CLOSE_GRACE_S)
            except TimeoutError:
                raise e from None
            except Exception as failed:
                what = "acc" if ins.acc else ("" if ins.microbatch is None else ins.microbatch)
                raise ExecutorError(
                    f"stage {ins.peer}: {type(failed).__name__}: {failed} (in the value "
                    f"v{ins.ref}@{what} it sent, found by stage {self.stage} at "
                    f"{ins.label()})", stage=ins.peer, failure=Failure.PROGRAM) from failed
            raise e

    def _run(self, ins: Instr, state, batch, whole, values, left, accs,
             timeout: float = DEFAULT_TIMEOUT_S, quiet: bool = False,
             effects: list | None = None) -> TaskRecord:
        task = self.split.task(ins.kind, self.stage)
        mb = ins.microbatch
        inputs = []
        used = []
        for i in task.inputs:
            if i.source == "arg":
                inputs.append(state[i.ref])
            elif i.source == "batch":
                inputs.append(batch[(i.ref, mb)])
            elif i.source == "pre":
                inputs.append(whole[i.ref])
            elif i.source == "acc":
                inputs.append(accs[i.ref])  # as accumulated: the program finishes it
            else:
                key = (i.ref, None if is_apply(i.producer[0]) else mb)
                inputs.append(values[key])
                used.append(key)
        with_acc = not is_apply(ins.kind) and mb is not None and mb > 0
        acc_in = [accs[r] for r in task.accumulate] if with_acc else []
        t0 = time.perf_counter()
        mb_arg = np.int32(0 if mb is None else mb)
        if (ins.kind, with_acc) not in self._seen:
            self._seen[(ins.kind, with_acc)] = jax.tree_util.tree_map(
                _abstract, (inputs, acc_in, mb_arg))
        with annotate(self.stage, ins.label()):
            outs, new = self.program(ins.kind, with_acc, quiet)(inputs, acc_in, mb_arg)
        if task.effects and not quiet and effects is not None:
            handed = outs[len(outs) - len(task.effect_inputs):] if task.effect_inputs else []
            effects.append((ins, self._effects.run(ins.kind, handed)))
        # Timed without stalling dispatch: a watcher thread waits for the results while
        # this thread goes on to the next instruction (see _timed).
        # (Its accumulators are not waited on there: the next microbatch's call donates
        # them; all results of one execution become ready together. A task with no
        # other result returns a token for this, ``task_function``; without one, as from
        # programs saved before, this thread waits.)
        done = None
        if self.measure and outs:
            done = self._watch.submit(ready_at, outs)
        elif self.measure:
            ready_at(new, timeout=timeout)
            done = done_now()
        key_mb = None if is_apply(ins.kind) else mb
        for r, x in zip(task.outputs, outs):
            values[(r, key_mb)] = x
            left[(r, key_mb)] = self._readers.get(r, 0)
        accs.update(zip(task.accumulate, new))
        for key in used:  # release values whose last reader on this stage ran
            left[key] -= 1
            if left[key] <= 0 and not self._awaited(key):
                values.pop(key, None)
        kind = {"F": "forward", "B": "backward", "W": "backward"}.get(ins.kind, "apply")
        return Pending(TaskRecord(self.stage, ins.label(), t0, t0, mb, kind), done)

    def _timed(self, records: list, timeout: float) -> list[TaskRecord]:
        """Measured records (``task_timing.measured``); a background send's record is
        taken when its turn comes (``_sent``: its failure, named)."""
        return measured(records, self.stage, timeout,
                        lambda r, left: self._sent(r, left) if isinstance(r, _Sending) else r)

    def _stop_if_failed(self, transport: Transport, ins: Instr, done: cf.Future) -> None:
        """A background send that failed stops the stage's waits in this step
        (``stop_waits``, where the transport has it), so the stage reports the failure at
        once instead of waiting for values that may depend on it. (A done-callback: the
        future is settled before the waits wake.)"""
        e = done.exception()
        stop = getattr(transport, "stop_waits", None)
        if e is not None and stop is not None:
            stop(f"stage {self.stage}, {ins.label()} failed: {type(e).__name__}: {e}")

    def _failed_send(self, records: list) -> ExecutorError | None:
        """The named error of the first background send that has failed, if any."""
        for r in records:
            if isinstance(r, _Sending) and r.done.done() and r.done.exception() is not None:
                try:
                    self._sent(r, 0.0)
                except ExecutorError as e:
                    return e
        return None

    def _sent(self, r: "_Sending", timeout: float) -> TaskRecord:
        """The record of a send made in the background; its failure, named."""
        try:
            return r.done.result(timeout=timeout)
        except (TimeoutError, cf.TimeoutError) as e:
            raise self._error(r.ins, f"not sent within {timeout:g} s", Failure.TIMEOUT) from e
        except Exception as e:
            named = self._name_error(r.ins, e)
            if named is e:
                raise
            raise named from e

    def idle(self, timeout: float) -> bool:
        """Whether every program this stage dispatched has finished (its timer thread has
        seen them all end), waiting up to ``timeout`` seconds."""
        return self._watch.wait_idle(timeout)

    def close(self) -> None:
        """Stop the timer and sender threads (after the calls already queued; never
        waits)."""
        self._watch.shutdown()
        if self._sender is not None:
            self._sender.shutdown()

    def _awaited(self, key) -> bool:
        """A step result (never released early)."""
        return key[0] in self._results


@dataclasses.dataclass(frozen=True)
class _Sending:
    """A send made on the sender thread: ``done`` gives its record."""

    ins: Instr
    done: cf.Future



