"""What stages send each other and how a failure is named: the ``Transport`` protocol, the
in-process ``LocalTransport`` (and ``StepTransport``, which puts the step number in every
key). ``ExecutorError`` / ``Failure`` / ``root_cause`` live in ``rhino.runtime.failures``
and are importable from here too. Shared by the local executor (``executors/local.py``) and
the Ray actors (``ray/actor.py``).

Example:
    >>> t = LocalTransport(2)
    >>> t.send(0, 1, (1, 7, 0), "v")
    >>> t.recv(1, 0, (1, 7, 0), timeout=1.0)
    'v'
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol, Sequence

from rhino.runtime import threads
from rhino.runtime.failures import ExecutorError, Failure, root_cause  # noqa: F401 (re-exported)


class Transport(Protocol):
    """Moves values between stages (an NCCL transport would implement the same). Keys are
    ``(step, ref, microbatch)`` (see ``StepTransport``)."""

    def send(self, src: int, dst: int, key: tuple, value: Any) -> None: ...

    def recv(self, dst: int, src: int, key: tuple, timeout: float) -> Any: ...


class LocalTransport:
    """In-process mailboxes, one per stage, keyed by ``(source stage, (step, ref,
    microbatch))``; ``abort`` poisons one step and wakes every receiver waiting in it."""

    def __init__(self, num_stages: int):
        self._boxes: list[dict] = [dict() for _ in range(num_stages)]
        self._cond = threading.Condition()
        self._aborted: dict[int, str] = {}

    def send(self, src: int, dst: int, key: tuple, value: Any) -> None:
        with self._cond:
            if key[0] in self._aborted:
                return  # nobody will take it
            self._boxes[dst][(src, key)] = value
            self._cond.notify_all()

    def recv(self, dst: int, src: int, key: tuple, timeout: float) -> Any:
        step = key[0]
        deadline = time.monotonic() + timeout
        with self._cond:
            while (src, key) not in self._boxes[dst]:
                if step in self._aborted:
                    raise ExecutorError(f"aborted: {self._aborted[step]}",
                                        failure=Failure.ABORTED)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no value {_key_label(key)} from stage {src} after "
                                       f"{timeout:g} s")
                self._cond.wait(min(left, threads.WAIT_SLICE_S))
            return self._boxes[dst].pop((src, key))

    def abort(self, step: int, why: str) -> None:
        """Poison ``step``: its waiting and future ``recv`` calls raise at once."""
        with self._cond:
            self._aborted.setdefault(step, why)
            for box in self._boxes:
                for k in [k for k in box if k[1][0] == step]:
                    del box[k]
            self._cond.notify_all()

    def start(self, step: int) -> None:
        """Forget the values and aborts of the steps before ``step``."""
        with self._cond:
            for box in self._boxes:
                for k in [k for k in box if k[1][0] < step]:
                    del box[k]
            for s in [s for s in self._aborted if s < step]:
                del self._aborted[s]

    def reset(self) -> None:
        """Forget every value and abort."""
        with self._cond:
            self._aborted.clear()
            for b in self._boxes:
                b.clear()


def _key_label(key: tuple) -> str:
    step, ref, mb = key
    return f"v{ref}@{'' if mb is None else mb} of step {step}"


class StepTransport:
    """A transport as one step sees it: every key gets the step number in front, so that a
    stage thread still busy with an earlier step never mixes its values into a later one.

    Args:
        transport: the executor's transport; step: the step number.
    """

    def __init__(self, transport: Transport, step: int):
        self.transport, self.step = transport, step

    def send(self, src: int, dst: int, key: tuple, value: Any) -> None:
        self.transport.send(src, dst, (self.step, *key), value)

    def recv(self, dst: int, src: int, key: tuple, timeout: float) -> Any:
        return self.transport.recv(dst, src, (self.step, *key), timeout)

    def expect(self, dst: int, src: int, key: tuple) -> None:
        """Tell the transport a value this step will receive, where it can use that."""
        expect = getattr(self.transport, "expect", None)
        if expect is not None:
            expect(dst, src, (self.step, *key))

    def acknowledge(self, dst: int, src: int, key: tuple) -> None:
        """Tell the sender this stage has the value (where the transport has
        ``acknowledge``; see ``instructions.held_sends``)."""
        ack = getattr(self.transport, "acknowledge", None)
        if ack is not None:
            ack(dst, src, (self.step, *key))

    def wait_taken(self, src: int, items: Sequence[tuple[int, tuple]],
                   timeout: float) -> None:
        """Wait until the receivers have the values ``items`` (``(dst, key)``) sent by
        ``src``, where the transport has ``wait_taken``; at once otherwise."""
        wait = getattr(self.transport, "wait_taken", None)
        if wait is not None:
            wait(src, [(d, (self.step, *k)) for d, k in items], timeout)

    @property
    def send_in_background(self) -> bool:
        """Whether the stage should send on a thread of its own (the transport says)."""
        return getattr(self.transport, "send_in_background", False)

    def stop_waits(self, why: str) -> None:
        """Wake every wait of this step (a background send failed), where the transport
        can (``abort``)."""
        abort = getattr(self.transport, "abort", None)
        if abort is not None:
            abort(self.step, why)

