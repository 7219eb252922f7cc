"""The instruction list of one pipeline stage for one step: which task runs when, and the
values it sends and receives, derived from a ``Schedule`` (which task when) and a
``StepSplit`` (what each task reads and writes). Pure: both executors run these lists, and
tests play them against each other without devices::

    stage 0: run F0 · send v12@0→1 · run F1 · send v12@1→1 · recv g7@0←1 · run B0 ...
    stage 1: recv v12@0←0 · run F0 · run B0 · send g7@0→0 · ...

Apply-gradients runs in its phases (``StepSplit.apply_phases``) after the stage's last
backward task; values accumulated over the microbatches are sent once, after the last one.
An empty task (``TaskSpec.empty``: a stage with no trained weights has no backward or apply
work) has no program and no instruction.

Example:
    >>> Instr("send", ref=12, microbatch=0, peer=1).label()
    'send v12@0→1'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from rhino.hlo_passes.stage_programs import StepSplit, is_apply
from rhino.runtime.scheduling.schedules import Schedule
from rhino.runtime.failures import ExecutorError


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
    if schedule.splits_backward and ("W", stage) not in split.tasks:
        raise ExecutorError(f"schedule {schedule.name!r}: expected stage programs with the "
                            f"backward cut into B and W (hlo_passes.backward_split), found "
                            f"whole backward programs")
    if schedule.num_chunks != split.num_stages or \
            schedule.num_microbatches != split.num_microbatches:
        raise ExecutorError(f"schedule: expected {split.num_stages} stages × "
                            f"{split.num_microbatches} microbatches (the split), found "
                            f"{schedule.num_chunks} × {schedule.num_microbatches}")
    m = split.num_microbatches
    out: list[Instr] = []
    received: set[tuple] = set()  # a value read by several tasks here is received once
    for t in schedule.chunk_tasks(stage):
        kinds = split.apply_phases[stage] if t.kind == "A" else (t.kind,)
        for kind in kinds:
            spec = split.task(kind, stage)
            if spec.empty:      # no program (``TaskSpec.empty``): nothing to run or move
                continue
            mb = None if is_apply(kind) else t.microbatch
            for i in spec.inputs:
                if i.source == "task" and i.producer[1] != stage:
                    ins = Instr("recv", ref=i.ref, microbatch=None if is_apply(i.producer[0])
                                else mb, peer=i.producer[1])
                elif i.source == "acc" and i.producer[1] != stage:
                    ins = Instr("recv", ref=i.ref, peer=i.producer[1], acc=True)
                else:
                    continue
                if ins.key not in received:
                    received.add(ins.key)
                    out.append(ins)
            out.append(Instr("run", kind, mb))
            for r in spec.outputs:
                dsts = sorted({s for k, s in split.consumers.get(r, ()) if s != stage
                               and (not is_apply(k) or is_apply(kind))})
                out.extend(Instr("send", ref=r, microbatch=mb, peer=d) for d in dsts)
            if not is_apply(kind) and mb == m - 1:
                for r in spec.accumulate:
                    dsts = sorted({s for k, s in split.consumers.get(r, ()) if is_apply(k)
                                   and s != stage})
                    out.extend(Instr("send", ref=r, peer=d, acc=True) for d in dsts)
    return out


def task_blocks(instrs: list[Instr]) -> dict[int, tuple[str, int | None]]:
    """Where each task's block of instructions starts (its receives, its program, its
    sends): index -> the ``(kind, microbatch)`` of the block's program. A stage of a device
    group that runs several (``executors.group_worker``) runs one block at a time.

    Example::

        task_blocks([recv v1@0←0, run F0, send v2@0→2, run F1, ...]) == {0: ("F", 0),
                                                                         3: ("F", 1), ...}
    """
    out: dict[int, tuple[str, int | None]] = {}
    for n, ins in enumerate(instrs):
        if ins.op == "send" or (n and instrs[n - 1].op == "recv"):
            continue
        run = next((i for i in instrs[n:] if i.op == "run"), None)
        if run is not None:
            out[n] = (run.kind, run.microbatch)
    return out


def block_of(block: tuple[str, int | None], task: Any) -> bool:
    """Whether a block of ``task_blocks`` (its program's ``(kind, microbatch)``) is part of
    schedule task ``task``: an apply task is every apply phase of its stage."""
    kind, mb = block
    if task.kind == "A":
        return is_apply(kind)
    return kind == task.kind and mb == task.microbatch


def group_order(schedule: Schedule, group: int,
                blocks: Mapping[int, Sequence[tuple[str, int | None]]]) -> list[int]:
    """The order in which device group ``group`` runs its stages' blocks of instructions
    (``blocks``: per stage, its blocks' ``(kind, microbatch)`` in its own order, as
    ``task_blocks`` gives them): one entry per block, the stage whose next block runs.

    Each forward and backward task of the group's column runs its stage's block(s) of
    that task, in the column's order. The apply tasks (at the column's end) run one phase
    of each stage at a time, in the column's order, until none is left: a later phase of
    one stage may read what an earlier phase of another computed (a global gradient norm
    clipping every stage's update), so a stage's phases cannot all run before the next
    stage's first.

    Raises:
        ExecutorError: a block no task of the column runs (a bug).
    """
    at = {c: 0 for c in blocks}
    out: list[int] = []
    applies: list[int] = []
    for t in schedule.stage_tasks(group):
        c = t.stage
        if t.kind == "A":
            applies.append(c)
            continue
        while at[c] < len(blocks[c]) and block_of(blocks[c][at[c]], t):
            out.append(c)
            at[c] += 1
    moved = True
    while moved:
        moved = False
        for c in applies:
            if at[c] < len(blocks[c]) and is_apply(blocks[c][at[c]][0]):
                out.append(c)
                at[c] += 1
                moved = True
    left = {c: blocks[c][at[c]] for c in blocks if at[c] < len(blocks[c])}
    if left:
        raise ExecutorError(f"device group {group} of {schedule.name!r}: blocks no task of "
                            f"its column runs: {left}")
    return out


def group_instructions(split: StepSplit, schedule: Schedule, group: int
                       ) -> list[tuple[int, Instr]]:
    """What device group ``group`` runs under a schedule with virtual stages, as
    ``(stage, instruction)`` in order: its stages' blocks (``task_blocks``) in
    ``group_order`` (pure; ``GroupWorker`` runs the same order)."""
    lists = {c: instructions(split, schedule, c) for c in schedule.chunks_of(group)}
    starts = {c: sorted(task_blocks(lst)) + [len(lst)] for c, lst in lists.items()}
    blocks = {c: [task_blocks(lst)[n] for n in starts[c][:-1]] for c, lst in lists.items()}
    at = {c: 0 for c in lists}           # the next block of each stage
    out: list[tuple[int, Instr]] = []
    for c in group_order(schedule, group, blocks):
        st = starts[c]
        out += [(c, i) for i in lists[c][st[at[c]]:st[at[c] + 1]]]
        at[c] += 1
    return out


def first_apply(instrs: list[Instr]) -> int:
    """The index of the first apply phase in an instruction list (its length if none)."""
    return next((n for n, i in enumerate(instrs) if i.op == "run" and is_apply(i.kind)),
                len(instrs))


def held_sends(split: StepSplit, schedule: Schedule, stage: int) -> list[Instr]:
    """The sends ``stage`` makes between its last forward/backward task and its first apply
    phase that the receiver reads in a forward or backward task: values another stage
    computes with next, while this stage has only its update left. A transport whose
    transfers share the sending host's cores with its programs holds the apply until these
    are taken (``JaxTransferTransport.wait_taken``). Values read in the receiver's apply
    phases are left out: the receiver may take them long after, and the sender's update
    would wait for that. No stage waits for one that waits for it: forward and backward
    tasks read nothing an apply phase computes.

    Example (two stages, 1F1B: stage 1 sends its last backward's gradient to stage 0 and
    then updates its weights)::

        held_sends(split, schedule, 1) == [Instr("send", ref=g, microbatch=3, peer=0)]
    """
    mine = instructions(split, schedule, stage)
    end = first_apply(mine)
    start = max((n for n, i in enumerate(mine[:end]) if i.op == "run"), default=-1) + 1
    sends = [i for i in mine[start:end] if i.op == "send"]
    out = []
    for peer in sorted({i.peer for i in sends}):
        wanted, pending = set(), []
        for i in instructions(split, schedule, peer):   # recvs feed the next task
            if i.op == "recv" and i.peer == stage:
                pending.append(i.key)
            elif i.op == "run":
                if not is_apply(i.kind):
                    wanted.update(pending)
                pending = []
        out += [i for i in sends if i.peer == peer and i.key in wanted]
    return out


def acknowledged_recvs(split: StepSplit, schedule: Schedule, stage: int) -> set[tuple]:
    """``(peer, key)`` of the values ``stage`` receives that their sender holds its apply
    for (``held_sends`` of the other stages): the receiver says when it has each."""
    return {(peer, i.key) for peer in range(split.num_stages) if peer != stage
            for i in held_sends(split, schedule, peer) if i.peer == stage}


def inputs_in_plan(task: Any, stage: int, sharding: Callable[[int], Any],
                   fn: Callable) -> Callable:
    """Task program ``fn`` of stage ``stage`` with each value from another stage
    constrained to its planned layout (``sharding(ref)``) as the program starts. A value
    may arrive in its sender's layout (``JaxTransferTransport`` with ``defer_relayout``:
    the reading program changes it); unconstrained, XLA's partitioner carried that layout
    into the ops reading it, and failed on some (a RET_CHECK on tridiagonal_solve, a CHECK
    that ended the process on a reduce-window's gradient: ``select_and_gather_add``).
    Constrained, the change is one reshard at the start and the ops see the plan's layout,
    as under the local executor."""
    import jax

    where = {k: sharding(i.ref) for k, i in enumerate(task.inputs)
             if i.source == "task" and i.producer is not None and i.producer[1] != stage}
    if not where:
        return fn

    def constrained(inputs, acc_in, mb):
        inputs = [jax.lax.with_sharding_constraint(x, where[k]) if k in where else x
                  for k, x in enumerate(inputs)]
        return fn(inputs, acc_in, mb)
    return constrained
