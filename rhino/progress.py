"""Progress of long work, through Python's ``logging`` (logger ``rhino``, level INFO).

Where the lines go follows the application's logging set-up:

* nothing configured (no handler on the root logger) and stderr a terminal: rhino shows
  its INFO lines there, as ``rhino: ...`` (the ``rhino`` logger's level is set to INFO on
  first use unless it was set before);
* nothing configured and stderr not a terminal (a pipe, a CI log, nohup, SLURM, ``ray job
  submit``): warnings, as Python's default is, and the phase lines of long work
  (``Progress``, once it has run longer than its threshold): those are exactly what a user
  waiting on a log file needs, and quick work still says nothing;
* logging configured (``logging.basicConfig(...)``, pytest): the records go to its
  handlers like any library's.

``logging.getLogger("rhino").setLevel(logging.WARNING)`` silences the progress lines;
``setLevel(logging.INFO)`` shows them anywhere. The command line shows them unless
``--quiet``.

``Progress`` says which phase a long piece of work is in, once it has run longer than a
threshold (quick work says nothing); ``Countdown`` says how far a counted phase is (``k
of n``) and estimates what remains.

Example:
    >>> p = Progress("plan(step)", after=60.0)
    >>> p("solving"); p.close()          # quick: says nothing
    >>> said = []
    >>> c = Countdown(said.append, "SPMD plans", 4, every=0.0)
    >>> c.advance(); said[-1].startswith("SPMD plans: 1 of 4 done")
    True
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable

LOGGER_NAME = "rhino"


class _TerminalHandler(logging.Handler):
    """Writes ``rhino: message`` to the current ``sys.stderr``, but only while the
    application has configured no logging of its own (no handler on the root logger);
    otherwise the record reaches the application's handlers by propagation."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("rhino: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never break the work it reports
            self.handleError(record)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def get_logger() -> logging.Logger:
    """The ``rhino`` logger, set up on first use (see the module docstring): a handler that
    writes to stderr while no logging is configured, and level INFO on a terminal unless
    a level was set before."""
    log = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _TerminalHandler) for h in log.handlers):
        log.addHandler(_TerminalHandler())
        if log.level == logging.NOTSET and _stderr_is_terminal():
            log.setLevel(logging.INFO)
    return log


def info(message: str) -> None:
    """Log ``message`` at INFO on the ``rhino`` logger."""
    get_logger().info(message)


class Progress:
    """Says ``TITLE: PHASE [t s]`` at each phase (INFO on the ``rhino`` logger), once the
    work has run longer than ``after`` seconds (then also the phase it is in at that
    moment). ``after=0`` says every phase."""

    def __init__(self, title: str, after: float):
        self.title, self.t0, self.phase = title, time.perf_counter(), ""
        self.shown = after <= 0
        self._lock = threading.Lock()
        self._timer = None
        if not self.shown:
            self._timer = threading.Timer(after, self._show)
            self._timer.daemon = True
            self._timer.start()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _show(self) -> None:
        with self._lock:
            self.shown = True
            if self.phase:
                self._say()

    def _say(self) -> None:
        message = f"{self.title}: {self.phase} [{self.elapsed:.1f} s]"
        log = get_logger()
        if log.isEnabledFor(logging.INFO):
            log.info(message)
        elif log.level == logging.NOTSET and not logging.getLogger().handlers:
            # Nobody chose a level or set up logging and stderr is not a terminal (a log
            # file): long work's phase lines still go there (module docstring).
            log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, message, (),
                                      None))

    def __call__(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            if self.shown:
                self._say()

    def always(self, message: str) -> None:
        """Say ``message`` now, however quick the work has been (a decision the user
        should see, such as what a cluster run chose)."""
        with self._lock:
            self.phase = message
            self._say()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if self.shown and self.phase and self.phase != "done":
                self.phase = "done"
                self._say()


class Countdown:
    """``k of n`` for a counted phase, with an estimate of what remains (the mean time per
    item so far times the items left), said through ``say`` at most every ``every``
    seconds, and always for the last item.

    Args:
        say: where the line goes (e.g. a ``Progress`` or ``info``).
        what: the items, e.g. ``"SPMD plans of candidate splits"``.
        total: how many there are.
        every: the shortest pause between two lines (seconds).
    """

    def __init__(self, say: Callable[[str], None], what: str, total: int, every: float = 5.0):
        self.say, self.what, self.total, self.every = say, what, max(int(total), 0), every
        self.done = 0
        self.t0 = self._last = time.perf_counter()

    def advance(self, k: int = 1, label: str = "") -> None:
        """``k`` more items are done (``label``: the last one, named in the line)."""
        self.done = min(self.total, self.done + k)
        now = time.perf_counter()
        if self.done < self.total and now - self._last < self.every:
            return
        self._last = now
        spent = now - self.t0
        left = self.total - self.done
        eta = (f"about {spent / self.done * left:.0f} s left" if self.done and left
               else "finished" if not left else "")
        self.say(f"{self.what}: {self.done} of {self.total} done"
                 + (f" (last: {label})" if label else "") + f", {spent:.0f} s so far"
                 + (f", {eta}" if eta else ""))
