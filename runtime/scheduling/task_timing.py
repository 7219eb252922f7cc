"""When a stage's tasks ran: a dispatched program is timed without stalling dispatch (a
watcher thread polls its results, ``ready_at``), and the step's records are put together
at its end (``measured``): a task starts at the latest of its dispatch, the end of the
stage's previous task and the arrival of the values it received, and ends when its results
are ready. Used by ``runtime.executors.stage_worker.StageWorker``.

Example:
    >>> import concurrent.futures as cf
    >>> from rhino.runtime.scheduling.timeline import TaskRecord
    >>> f = cf.Future(); f.set_result(2.0)
    >>> [r.start for r in measured([Pending(TaskRecord(0, "F0", 1.0, 1.0, 0, "forward"), f)],
    ...                             0, 1.0, lambda r, left: r)]
    [1.0]
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from typing import Any, Callable

import jax

from rhino.runtime.scheduling.timeline import TaskRecord
from rhino.runtime.failures import ExecutorError, Failure


@dataclasses.dataclass(frozen=True)
class Pending:
    """A dispatched task (or a received value: ``peer`` sent it) whose end time a watcher
    thread will report (``done``: a future of ``time.perf_counter()``)."""

    record: TaskRecord
    done: Any
    peer: int | None = None


ANNOTATION_PREFIX = "rhino"


def annotate(stage: int, label: str) -> Any:
    """A ``jax.profiler.TraceAnnotation`` naming a task, ``rhino stage1 B3``: with
    ``jax.profiler`` tracing, each task's dispatch (a program call, a send, a receive)
    appears under this name in the trace; otherwise it costs a context manager."""
    return jax.profiler.TraceAnnotation(f"{ANNOTATION_PREFIX} stage{stage} {label}")


def done_now() -> cf.Future:
    """A future already holding the present time."""
    f: cf.Future = cf.Future()
    f.set_result(time.perf_counter())
    return f


POLL_S = (2e-5, 5e-4, 0.05)
"""Polling of ``ready_at``: first pause, longest pause in the first second, and after."""


def all_ready(tree: Any) -> bool:
    """Whether every array of ``tree`` is ready now (computed, or arrived)."""
    return all(x.is_ready() for x in _arrays(tree))


def _arrays(tree: Any) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "is_ready")]


def ready_at(tree: Any, timeout: float | None = None) -> float:
    """When every array of ``tree`` is ready (``time.perf_counter()``); a failed program's
    error is raised. Polls ``is_ready()`` instead of blocking inside XLA: a daemon thread
    blocked in a C++ wait that returns while the interpreter shuts down is torn down
    through C++ frames and aborts the process; one sleeping in Python ends cleanly.

    Raises:
        TimeoutError: not ready within ``timeout`` seconds (None: wait as long as it takes).
    """
    leaves = _arrays(tree)
    start = time.monotonic()
    pause = POLL_S[0]
    for x in leaves:
        while not x.is_ready():
            waited = time.monotonic() - start
            if timeout is not None and waited > timeout:
                raise TimeoutError(f"not ready within {timeout:g} s")
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1] if waited < 1.0 else POLL_S[2])
    jax.block_until_ready(leaves)  # ready: returns at once, or raises a program's error
    return time.perf_counter()


def measured(records: list, stage: int, timeout: float,
             other: Callable[[Any, float], TaskRecord]) -> list[TaskRecord]:
    """The step's records of ``stage``, measured: a ``Pending`` task ends when its results
    are ready and starts at the latest of its dispatch, the end of the stage's previous task
    (a stage's devices run one program at a time) and the arrival of the values it received;
    any other entry is ``other(entry, seconds left)``. Waits at most ``timeout`` in all.

    Raises:
        ExecutorError: a received value (``TIMEOUT``) or a task's results (``STALLED``)
            not ready in time, naming the stage and the record.
    """
    out: list[TaskRecord] = []
    prev_end = inputs_ready = float("-inf")
    deadline = time.monotonic() + timeout
    for r in records:
        if not isinstance(r, Pending):
            out.append(other(r, max(0.0, deadline - time.monotonic())))
            continue
        try:
            ready = r.done.result(timeout=max(0.0, deadline - time.monotonic())) \
                if r.done is not None else r.record.end
        except (TimeoutError, cf.TimeoutError) as e:
            if r.peer is not None:  # the sender's program never finished
                raise ExecutorError(f"stage {stage}, {r.record.label}: the value from stage "
                                    f"{r.peer} was not ready within {timeout:g} s",
                                    stage=stage, failure=Failure.TIMEOUT) from e
            raise ExecutorError(f"stage {stage}, {r.record.label}: its results were not "
                                f"ready within {timeout:g} s", stage=stage,
                                failure=Failure.STALLED) from e
        if r.record.kind == "recv":
            inputs_ready = max(inputs_ready, ready)
            r = r.record
        else:
            start = max(r.record.start, prev_end, inputs_ready)
            prev_end, inputs_ready = ready, float("-inf")
            r = dataclasses.replace(r.record, start=start, end=max(ready, start))
        out.append(r)
    return out
