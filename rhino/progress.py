"""Progress lines for long work: nothing for quick work, a line per phase once it is slow.

Example:
    >>> p = Progress("plan(step)", after=60.0)
    >>> p("solving"); p.close()          # quick: prints nothing
"""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """Prints ``rhino: TITLE: PHASE [t s]`` to stderr at each phase, once the work has run
    longer than ``after`` seconds (then also the phase it is in at that moment)."""

    def __init__(self, title: str, after: float):
        self.title, self.t0, self.phase, self.shown = title, time.perf_counter(), "", False
        self._lock = threading.Lock()
        self._timer = threading.Timer(after, self._show)
        self._timer.daemon = True
        self._timer.start()

    def _show(self) -> None:
        with self._lock:
            self.shown = True
            self._print()

    def _print(self) -> None:
        print(f"rhino: {self.title}: {self.phase} [{time.perf_counter() - self.t0:.1f} s]",
              file=sys.stderr, flush=True)

    def __call__(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            if self.shown:
                self._print()

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            if self.shown:
                self.phase = "done"
                self._print()
