"""How a failed step is named, shared by every part of the runtime: ``Failure`` (what went
wrong on a stage), ``ExecutorError`` (a step that failed, with the stage to blame) and
``root_cause`` (which stage's failure to report first when several failed).

A base module: it imports nothing from the runtime's subpackages, which all may import it.
"""

from __future__ import annotations

import enum
import time
from typing import Sequence

from rhino.errors import RhinoError


RESUME = ("To resume: restore the last checkpoint (rhino.restore_checkpoint(path, like=...)) "
          "and call the step again with it: the step starts new actors")
"""How to go on after a process holding state died (every error about lost values says it)."""


class Failure(enum.IntEnum):
    """What went wrong on a stage, in the order ``root_cause`` blames them (lowest first)."""

    PROGRAM = 0   # the stage's own program (or its actor) failed
    STALLED = 1   # the stage did not finish in time (stuck in a program or a wait)
    TIMEOUT = 2   # the stage waited in vain for a value from another stage
    ABORTED = 3   # the stage was stopped because another stage failed


class ExecutorError(RhinoError):
    """A pipeline step failed or timed out on a stage.

    Attributes:
        stage: the stage the message is about (None: the executor as a whole).
        failure: a ``Failure`` (None: not a stage's failure, e.g. bad arguments).
        at: when it happened (``time.time()``), to order failures of equal kind.
    """

    def __init__(self, message: str, *, stage: int | None = None,
                 failure: Failure | None = None):
        super().__init__(message)
        self.stage, self.failure, self.at = stage, failure, time.time()


def root_cause(errors: Sequence[ExecutorError]) -> ExecutorError:
    """One error for a failed step: the root cause's message (see ``Failure``; equal kinds:
    the earliest, then the lowest stage) with the other stages' messages appended.

    >>> a = ExecutorError("stage 0, recv v1@0←1: timed out", stage=0, failure=Failure.TIMEOUT)
    >>> b = ExecutorError("stage 1, F0: ValueError: x", stage=1, failure=Failure.PROGRAM)
    >>> str(root_cause([a, b]))
    'stage 1, F0: ValueError: x (other stages: stage 0, recv v1@0←1: timed out)'
    """
    def rank(e: ExecutorError) -> tuple:
        failure = e.failure if e.failure is not None else Failure.PROGRAM
        return (int(failure), e.at, -1 if e.stage is None else e.stage)

    ordered = sorted(errors, key=rank)
    root = ordered[0]
    if len(ordered) == 1:
        return root
    others = "; ".join(str(e) for e in ordered[1:])
    out = ExecutorError(f"{root} (other stages: {others})", stage=root.stage,
                        failure=root.failure)
    out.at = root.at
    out.__cause__ = root
    return out
