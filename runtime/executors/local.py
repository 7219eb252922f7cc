"""Executors: run a static pipeline schedule of stage programs on device meshes.

Both executors run the same per-stage *instruction lists* (``instructions``), derived from a
``Schedule`` (which task when) and a ``StepSplit`` (what each task reads and writes)::

    stage 0: run F(mb0) · send v12@mb0→1 · run F(mb1) · send ... · recv g7@mb0←1 · run B(mb0) ...
    stage 1: recv v12@mb0←0 · run F(mb0) · run B(mb0) · send g7@mb0→0 · ...

A ``StageWorker`` (``executors/stage_worker.py``) owns one stage and runs its instruction
list once per step through a ``Transport`` (``LocalTransport`` here: one process, a value
handed over in memory and put on the receiving mesh with the receiver's sharding).

``LocalExecutor`` runs one thread per stage (meshes are disjoint sets of local devices; the
threads only dispatch and wait); under virtual stages (``interleaved-1f1b``) one per device
group, running the group's stages in its column's order (``group_worker.GroupWorker``). Every wait has a timeout; an error on one stage stops the
others at their next wait and is raised naming the stage and the task.

Failures (both executors): every mailbox key carries the step number, and ``abort`` poisons
one step, so a stage still busy with a failed step can neither send into nor abort a
later one. Stage threads are daemon threads (``runtime.threads``) that the executor waits
for only up to a deadline: a stage stuck inside a program never holds up ``close()``, the
interpreter's exit or Ctrl-C; the executor then refuses further steps. Of several stages'
errors the root cause is raised first (``root_cause``): a stage whose own program failed
(or whose actor died), then a stage that did not finish, then one that timed out waiting,
then those aborted because of another::

    stage 1, B2: XlaRuntimeError: ... (other stages: stage 0, recv v7@2←1: aborted: ...)

Example:
    >>> from rhino.runtime.scheduling.schedules import one_f_one_b
    >>> # instructions(split, one_f_one_b(2, 4), stage=0)  -> [Instr('run', 'F', 0), ...]
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any, Sequence

from rhino.runtime import threads
from rhino.runtime.executors.group_worker import group_units
from rhino.runtime.executors.stage_worker import (CLOSE_GRACE_S, DEFAULT_TIMEOUT_S,
                                                  StageWorker)
from rhino.runtime.scheduling.instructions import Instr, instructions
from rhino.runtime.scheduling.task_timing import ready_at
from rhino.runtime.scheduling.timeline import TaskRecord
from rhino.runtime.transfer.placement import place
from rhino.runtime.transfer.transport import (ExecutorError, Failure, LocalTransport,
                                              StepTransport, Transport, root_cause)

__all__ = ["ExecutorError", "Failure", "LocalTransport", "StepTransport", "Transport",
           "root_cause", "Instr", "instructions", "place", "StageWorker",
           "LocalExecutor", "DEFAULT_TIMEOUT_S"]

ABORT_GRACE_S = 10.0
"""After a stage failed, how long the local executor waits for the others to stop."""


class LocalExecutor:
    """All stages in this process, one daemon thread each (see the module docstring).

    Usable as a context manager (``close()`` on exit).

    Args:
        workers: one ``StageWorker`` per stage, in stage order.
        timeout: seconds any one wait may take; a step may take ``2 × timeout``.
        transport: how values move (default ``LocalTransport``: ``jax.device_put`` onto the
            receiver's layout; ``cross_mesh.CrossMeshTransport``: 004's resharding).
        grace: after a stage failed, seconds the others get to stop before the step is
            given up; and how long the next step waits for a stage still running a failed
            step (stuck in a program or a wait) before it is refused, naming that stage.
            A failed step costs that step: the next one runs once every stage is idle.
    """

    def __init__(self, workers: Sequence[StageWorker], timeout: float = DEFAULT_TIMEOUT_S,
                 transport: LocalTransport | None = None, grace: float = ABORT_GRACE_S):
        self.workers = list(workers)
        # One thread each: a stage, or under virtual stages a device group's stages.
        self.units = group_units(self.workers)
        self.timeout = timeout
        self.grace = grace
        self.transport = transport or LocalTransport(len(self.workers))
        self.last_records: list[TaskRecord] = []
        self.last_step_s = 0.0
        self._step = 0
        self._running: dict[cf.Future, int] = {}   # the last step's stage threads -> stage
        self._ran = 0                                # the step they run(ran)
        self._closed = False

    def __enter__(self) -> "LocalExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(self, flat_args: Sequence[Any], warm_up: bool = False, step: int | None = None
            ) -> dict[int, Any]:
        """One step: flat arguments in, ``ref -> value`` of the step's stage results out
        (``warm_up``: a step on zeros that calls no host callback, ``StageWorker.run_step``;
        ``step``: its number, given by a caller that counts steps itself, else the next).

        Raises:
            ExecutorError: a stage failed, timed out or did not finish within
                ``2 × timeout`` (the root cause first, see ``root_cause``); the executor is
                closed; or a stage of an earlier step is still stuck.
            KeyboardInterrupt: interrupted (the step is aborted; its stages get
                ``CLOSE_GRACE_S`` to stop).
        """
        if self._closed:
            raise ExecutorError("the local executor is closed")
        self._step = self._step + 1 if step is None else step
        step = self._step
        stuck = self._settle(self.grace)
        if stuck:
            raise ExecutorError(f"stage(s) {stuck} still running step {self._ran} (failed; "
                                f"stuck in a program or a wait) after {self.grace:g} s more: "
                                f"step {step} cannot run until they stop; the arguments "
                                f"of step {self._ran} are as they were, call again later",
                                stage=stuck[0], failure=Failure.STALLED)
        self._ran = step
        self.transport.start(step)
        split = self.workers[0].split
        t0 = time.perf_counter()
        self._running = {}
        for w in self.units:
            args = {r: flat_args[r] for s in w.stages for r in split.stage_args(s)}
            self._running[threads.start(self._stage, w, args, step, warm_up,
                                        name=f"rhino-stage{w.stage}-step{step}")] = w.stage
        try:
            results = self._wait(step, t0)
        except KeyboardInterrupt:
            self.transport.abort(step, "interrupted (KeyboardInterrupt)")
            self._settle(CLOSE_GRACE_S)
            raise
        outs: dict[int, Any] = {}
        records: list[TaskRecord] = []
        for s in sorted(results):
            o, rec = results[s]
            outs.update(o)
            records.extend(rec)
        self.last_step_s = time.perf_counter() - t0
        self.last_records = records
        return outs

    def _stage(self, worker: StageWorker, args: dict, step: int, warm_up: bool = False
               ) -> tuple[dict, list]:
        """One stage's step, on its own thread; a failure aborts the step at once."""
        try:
            outs, records = worker.run_step(args, StepTransport(self.transport, step),
                                            self.timeout, warm_up)
            try:
                ready_at(outs, timeout=self.timeout)
            except TimeoutError as e:
                raise ExecutorError(f"stage {worker.stage}: its results were not ready within "
                                    f"{self.timeout:g} s", stage=worker.stage,
                                    failure=Failure.STALLED) from e
            return outs, records
        except BaseException as e:
            self.transport.abort(step, str(e))
            raise

    def _wait(self, step: int, t0: float) -> dict[int, tuple]:
        """Every stage's result, or the root cause of the failure (see ``run``)."""
        start = time.monotonic()
        deadline = start + 2 * self.timeout
        pending = dict(self._running)
        results: dict[int, tuple] = {}
        errors: list[ExecutorError] = []
        failed = False
        while pending:
            done = threads.wait_any(pending, deadline)
            if not done:
                stuck = sorted(pending.values())
                took = time.monotonic() - start
                errors += [ExecutorError(f"stage {s}: the step did not finish within "
                                         f"{took:.0f} s", stage=s, failure=Failure.STALLED)
                           for s in stuck]
                self.transport.abort(step, f"stage(s) {stuck} did not finish")
                break
            for f in done:
                s = pending.pop(f)
                try:
                    results[s] = f.result()
                except ExecutorError as e:
                    errors.append(e)
                except Exception as e:  # noqa: BLE001 - outside a StageWorker's wrapping
                    errors.append(ExecutorError(f"stage {s}: {type(e).__name__}: {e}",
                                                stage=s, failure=Failure.PROGRAM))
            if errors and not failed:
                # The others are aborted at their next wait: give them ``grace``.
                failed = True
                deadline = min(deadline, time.monotonic() + self.grace)
        if errors:
            raise root_cause(errors)
        return results

    def _settle(self, bound: float) -> list[int]:
        """Wait up to ``bound`` seconds for the last step's stage threads; the stages
        still running afterwards (stuck, for now)."""
        deadline = time.monotonic() + bound
        left = threads.wait_all(self._running, bound)
        stuck = {self._running[f] for f in left}
        # A program still running keeps its stage's devices busy: the next step would queue
        # behind it (its timer thread waits for it).
        stuck |= {w.stage for w in self.workers if w.stage not in stuck and
                  not w.idle(max(0.0, deadline - time.monotonic()))}
        return sorted(stuck)

    def close(self) -> None:
        """Abort a step still running here, wait at most ``CLOSE_GRACE_S`` for its stage
        threads (daemon threads: one stuck in a program is left behind, it holds nothing
        up) and stop the workers' timer threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if any(not f.done() for f in self._running):
            # Only a step still running here is aborted: the abort of a step that ended
            # reaches the other processes of a job, where that step may not have ended yet
            # (it ended one test of a job with "aborted: process 1: the executor was
            # closed" while process 0 finished the same step).
            self.transport.abort(self._ran, "the executor was closed")
        self._settle(CLOSE_GRACE_S)
        for w in self.workers:
            w.close()
