"""One device group of an interleaved schedule: ``GroupWorker`` runs the stages the group
holds, one task at a time, in the order of the group's column of the schedule.

Under ``interleaved-1f1b`` the model is cut into ``p v`` stages and device group ``g`` holds
stages ``g, g + p, ...`` (``Schedule.chunks_of``), each a ``StageWorker`` with its own
programs and state on the group's one mesh. A ``GroupWorker`` drives their ``steps``
generators: for each task of the group's column (``F3/s2``: the forward of microbatch 3 on
stage 2) it runs that stage's next block of instructions (its receives, its program, its
sends), so the group dispatches its stages' programs in the schedule's order, as one thread
(or one process, or one Ray actor per host) per group. A value between two stages of one
group moves as between any two stages: through the transport, which keeps it on the group's
devices (``LocalTransport`` hands it over; ``JaxTransferTransport`` between stages of one
process never leaves the process).

Executors take it in place of the group's stage workers (``group_units``): the local
executor runs one thread per group, ``rhino.launch`` one process per group, the Ray executor
one actor per group and host (``runtime.ray.actor``). The order is
``instructions.group_instructions``' (pure; the tests play it).

Example::

    group 0 of interleaved-1f1b, p = 2, v = 2, m = 2:
        F0/s0 · F1/s0 · F0/s2 · F1/s2 · B0/s2 · B1/s2 · B0/s0 · B1/s0 · A/s0 · A/s2
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rhino.runtime.executors.stage_worker import DEFAULT_TIMEOUT_S, StageWorker
from rhino.runtime.failures import ExecutorError
from rhino.runtime.scheduling.instructions import group_order
from rhino.runtime.scheduling.timeline import TaskRecord
from rhino.runtime.transfer.transport import Transport


class GroupWorker:
    """The stage workers of one device group, run in their column's order (see the module
    docstring). It is used where a ``StageWorker`` is (``run_step``, ``idle``, ``close``);
    ``stage`` is the group's first stage, ``stages`` all of them.

    Raises:
        ExecutorError: workers of several groups, or not every stage of the group.
    """

    def __init__(self, workers: Sequence[StageWorker]):
        self.workers = sorted(workers, key=lambda w: w.stage)
        if not self.workers:
            raise ExecutorError("a device group: expected its stage workers, found none")
        first = self.workers[0]
        self.split, self.schedule = first.split, first.schedule
        self.group = self.schedule.group_of(first.stage)
        self.stage = first.stage
        want = self.schedule.chunks_of(self.group)
        if self.stages != want:
            raise ExecutorError(f"device group {self.group} of {self.schedule.name!r}: "
                                f"expected the workers of stages {list(want)}, found "
                                f"{list(self.stages)}", stage=first.stage)
        self.mesh = first.mesh
        # per block (its receives, its program, its sends) the stage that runs it
        self.order = group_order(self.schedule, self.group,
                                 {w.stage: w.blocks for w in self.workers})
        # The last step's tasks as dispatched: (stage, "F3"), ..., (stage, "A") per phase.
        self.last_order: list[tuple[int, str]] = []

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(w.stage for w in self.workers)

    def run_step(self, args: Mapping[int, Any], transport: Transport,
                 timeout: float = DEFAULT_TIMEOUT_S, warm_up: bool = False
                 ) -> tuple[dict[int, Any], list[TaskRecord]]:
        """Run the group's column once: ``StageWorker.run_step`` of every stage of the
        group, their tasks interleaved in the column's order.

        Args:
            args: flat argument ref -> array, for every argument the group's stages read.

        Returns:
            (the step's results these stages produce, their task records).
        """
        split = self.split
        gens = {w.stage: w.steps({r: args[r] for r in split.stage_args(w.stage)},
                                 transport, timeout, warm_up) for w in self.workers}
        upcoming: dict[int, Any] = {}
        self.last_order = []
        for s, g in gens.items():      # places each stage's arguments, runs its prologue
            upcoming[s] = next(g)
        for s in self.order:
            kind, mb = upcoming[s]
            self.last_order.append((s, kind if mb is None else f"{kind}{mb}"))
            upcoming[s] = next(gens[s])
        outs: dict[int, Any] = {}
        records: list[TaskRecord] = []
        for s, g in gens.items():
            if upcoming[s] is not None:   # a task the column does not have: a bug
                raise ExecutorError(f"stage {s}: task {upcoming[s]} is not in device group "
                                    f"{self.group}'s column of {self.schedule.name!r}",
                                    stage=s)
            try:
                next(g)
            except StopIteration as done:
                o, rec = done.value
                outs.update(o)
                records.extend(rec)
        return outs, self._one_device_group(records)

    def _one_device_group(self, records: list[TaskRecord]) -> list[TaskRecord]:
        """The records with the group's programs one after another: each stage's own are
        (``task_timing.measured``), but two stages of the group share its devices, so a
        program starts no earlier than the one dispatched before it on any of them ends."""
        import dataclasses

        runs = {(r.stage, r.label): n for n, r in enumerate(records)
                if r.kind in ("forward", "backward", "apply")}
        out, last = list(records), None
        for key in self.last_order:
            n = runs.get(key)
            if n is None:
                continue
            r = out[n]
            if last is not None and r.start < last:
                r = out[n] = dataclasses.replace(r, start=min(last, r.end))
            last = r.end if last is None else max(last, r.end)
        return out

    def idle(self, timeout: float) -> bool:
        """Whether every program of the group's stages has finished (``StageWorker.idle``),
        waiting up to ``timeout`` seconds in all."""
        import time

        deadline = time.monotonic() + timeout
        return all(w.idle(max(0.0, deadline - time.monotonic())) for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.close()


def group_units(workers: Sequence[StageWorker]) -> list:
    """What an executor runs, one thread (or process) each: the workers themselves, or
    under a schedule with virtual stages one ``GroupWorker`` per device group."""
    workers = list(workers)
    if not workers or workers[0].schedule.virtual_stages == 1:
        return workers
    schedule = workers[0].schedule
    by_group: dict[int, list[StageWorker]] = {}
    for w in workers:
        by_group.setdefault(schedule.group_of(w.stage), []).append(w)
    return [GroupWorker(ws) for _, ws in sorted(by_group.items())]


def device_groups(specs: Sequence[Any]) -> dict[int, tuple[int, ...]]:
    """Per device group, keyed by its first stage, the stages it runs: ``virtual_stages``
    (``WorkerSpec`` / ``StageArtifact``) ``v`` over ``n`` stages makes ``p = n / v`` groups,
    group ``g`` running ``g, g + p, ...`` (``Schedule.chunks_of``); one stage each
    without.

    >>> device_groups([type("S", (), {"virtual_stages": 2})()] * 4)
    {0: (0, 2), 1: (1, 3)}
    """
    n = len(specs)
    v = int(getattr(specs[0], "virtual_stages", 1) or 1) if n else 1
    if v < 1 or n % v:
        raise ExecutorError(f"virtual_stages: expected a divisor of the {n} stages, found {v}")
    p = n // v
    return {g: tuple(range(g, n, p)) for g in range(p)}
