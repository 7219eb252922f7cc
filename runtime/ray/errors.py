"""How the Ray executor names a failure: a dead actor, a stage's own error (its traceback
cut to the exception, the root cause first), without Ray's colour codes and labels."""

from __future__ import annotations

import re

from rhino.runtime.failures import ExecutorError, Failure


def unlabelled(text: str, label: str) -> str:
    """``text`` without a leading ``label: ``.

    >>> unlabelled("stage 1: expected 4 devices", "stage 1")
    'expected 4 devices'
    """
    return text[len(label) + 2:] if text.startswith(label + ": ") else text


def is_dead(ray, e: BaseException | None) -> bool:
    return isinstance(e, ray.exceptions.RayActorError)


def why_failed(ray, e: BaseException) -> str:
    """A one-line reason: the original exception of a task, or how an actor died."""
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    if isinstance(e, ray.exceptions.RayActorError):
        text = ANSI.sub("", str(e)).strip()
        if getattr(e, "actor_init_failed", False):
            # The creation task's traceback ends with the exception raised in __init__.
            raised = [ln.strip() for ln in text.splitlines() if RAISED.match(ln.strip())]
            what = RAISED.sub(r"\1", raised[-1]) if raised else text.splitlines()[0]
            return f"the actor failed to start ({what})"
        first = text.splitlines()[0] if text else ""
        return f"the actor died ({type(e).__name__}: {first})"
    text = str(e)
    return text if isinstance(e, ExecutorError) else f"{type(e).__name__}: {text}"


ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAISED = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception): )")


def stage_error(ray, stage: int, e: BaseException, label: str | None = None
                 ) -> ExecutorError:
    """``stage s: ...`` (``label``) as an ``ExecutorError``; a StageWorker's error already
    names stage and task (and says what kind of failure it was)."""
    why = why_failed(ray, e)
    label = label or f"stage {stage}"
    cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
    named = isinstance(cause, ExecutorError) and cause.stage is not None
    msg = why if named or why.startswith(f"stage {stage}") else f"{label}: {why}"
    out = ExecutorError(msg, stage=cause.stage if named else stage,
                        failure=(cause.failure if isinstance(cause, ExecutorError) else None)
                        or Failure.PROGRAM)
    if isinstance(cause, ExecutorError):
        out.at = cause.at
    return out
