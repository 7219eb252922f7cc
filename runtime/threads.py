"""Threads that never hold up the process: daemon threads and bounded, interruptible waits.

A stage may be stuck where nothing can stop it from outside: inside an XLA program, a host
callback, a transfer. Python cannot kill a thread, so the executors make sure that such a
thread never holds anything else up::

    main thread ── run(step) ──► start(stage 0) ─┐ daemon threads: the interpreter does
                                 start(stage 1) ─┤ not wait for them at exit
                 wait_any(futures, deadline) ◄───┘ short slices: Ctrl-C reaches the main
                                                   thread at once; never past the deadline

* ``start`` runs a function on a new daemon thread and returns a ``concurrent.futures``
  ``Future`` for its result.
* ``SerialWorker`` is a one-thread pool on a daemon thread (``ThreadPoolExecutor``'s
  threads are joined at interpreter exit, so one stuck call there hangs the exit).
* ``wait_any`` waits for the first of several futures, at most until a deadline, in slices
  of ``WAIT_SLICE_S``.

Example:
    >>> f = start(lambda: 6 * 7, name="answer")
    >>> done = wait_any([f], deadline=time.monotonic() + 5)
    >>> f.result()
    42
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from typing import Any, Callable, Iterable

WAIT_SLICE_S = 0.25
"""The longest single sleep of a waiting thread (so that signals are handled promptly)."""


def _run_into(future: cf.Future, fn: Callable[..., Any], args: tuple) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        future.set_exception(e)
    else:
        future.set_result(result)


def start(fn: Callable[..., Any], *args: Any, name: str) -> cf.Future:
    """Run ``fn(*args)`` on a new daemon thread named ``name``; its result as a future."""
    future: cf.Future = cf.Future()
    threading.Thread(target=_run_into, args=(future, fn, args), name=name,
                     daemon=True).start()
    return future


class SerialWorker:
    """Calls run one at a time, in order, on one daemon thread (started on first use, and
    again on the first use after ``shutdown``).

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Condition()
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._pending = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Queue ``fn(*args)``; its result as a future."""
        future: cf.Future = cf.Future()
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._loop, args=(self._queue,),
                                                name=self.name, daemon=True)
                self._thread.start()
            self._pending += 1
            self._queue.put((future, fn, args))
        return future

    def _loop(self, calls: queue.SimpleQueue) -> None:
        while True:
            item = calls.get()
            if item is None:
                return
            try:
                _run_into(*item)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Whether every call submitted so far has ended, waiting up to ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, WAIT_SLICE_S))
        return True

    def shutdown(self) -> None:
        """Let the thread end after the calls already queued; never waits (a stuck call
        stays stuck, on a daemon thread)."""
        with self._lock:
            if self._queue is not None:
                self._queue.put(None)
            self._queue, self._thread = None, None


def wait_any(futures: Iterable[cf.Future], deadline: float) -> set[cf.Future]:
    """The futures done when the first is done or at ``deadline`` (``time.monotonic()``
    clock), whichever comes first; an empty set when none finished in time. Waits in slices
    of ``WAIT_SLICE_S`` so that a ``KeyboardInterrupt`` is raised here within a slice."""
    futures = list(futures)
    while True:
        left = deadline - time.monotonic()
        done, _ = cf.wait(futures, timeout=max(0.0, min(left, WAIT_SLICE_S)),
                          return_when=cf.FIRST_COMPLETED)
        if done or left <= WAIT_SLICE_S:
            return set(done)


def wait_all(futures: Iterable[cf.Future], timeout: float) -> set[cf.Future]:
    """Wait up to ``timeout`` seconds for every future (in slices, as ``wait_any``); the
    futures still not done afterwards."""
    pending = {f for f in futures if not f.done()}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        pending -= wait_any(pending, deadline)
    return pending
