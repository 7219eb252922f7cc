"""The instruction list of one pipeline stage for one step: which task runs when, and the
values it sends and receives, derived from a ``Schedule`` (which task when) and a
``StepSplit`` (what each task reads and writes). Pure: both executors run these lists, and
tests play them against each other without devices::

    stage 0: run F0 · send v12@0→1 · run F1 · send v12@1→1 · recv g7@0←1 · run B0 ...
    stage 1: recv v12@0←0 · run F0 · run B0 · send g7@0→0 · ...

Apply-gradients runs in its phases (``StepSplit.apply_phases``) after the stage's last
backward task; values accumulated over the microbatches are sent once, after the last one.

Example:
    >>> Instr("send", ref=12, microbatch=0, peer=1).label()
    'send v12@0→1'
"""

from __future__ import annotations

import dataclasses

from rhino.hlo_passes.stage_programs import StepSplit, is_apply
from rhino.runtime.schedules import Schedule
from rhino.runtime.transport import ExecutorError


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
        kinds = split.apply_phases[stage] if t.kind == "A" else (t.kind,)
        for kind in kinds:
            spec = split.task(kind, stage)
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
