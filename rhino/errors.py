"""The errors rhino raises. Each says what was expected, what was found, and where.

Hierarchy::

    RhinoError
    ├── HloParseError        malformed HLO / StableHLO input (file, line, expected, found)
    ├── IngestError          a source rhino cannot turn into a graph (bad path, bad args)
    ├── UnsupportedOpError   an op a pass cannot handle (op, source line)
    ├── InfeasiblePlanError  no plan fits the memory budget (memory needed, budget)
    ├── PlanningError        no candidate could be planned (each one's reason)
    ├── OptionsError         an option out of range or of the wrong kind (also a ValueError)
    ├── PlanMismatchError    a plan made for another program, or naming a value it lacks
    └── LoweringError        a plan's spec that cannot be written into the program
        └── BatchCouplingError   a pipelined step whose meaning needs the whole batch

Modules add their own below these (``SolverError``, ``ExecutorError``, ...).
"""

from __future__ import annotations


class RhinoError(Exception):
    """Base class of every error rhino raises on purpose."""


class HloParseError(RhinoError):
    """Malformed HLO or StableHLO text.

    Attributes:
        path: the file (or ``"<string>"``) being read.
        line: 1-based line number of the offending line, or None if not line-specific.
        expected: what the parser expected to find.
        found: what it found instead.
    """

    def __init__(self, path: str, line: int | None, expected: str, found: str):
        self.path, self.line, self.expected, self.found = path, line, expected, found
        where = f"{path}:{line}" if line is not None else path
        found_short = found if len(found) <= 160 else found[:157] + "..."
        super().__init__(f"{where}: expected {expected}, found {found_short!r}")


class IngestError(RhinoError):
    """A source that cannot be ingested (unknown file kind, missing file, bad arguments)."""


class UnsupportedOpError(RhinoError):
    """An op a pass cannot handle.

    Attributes:
        opcode: the HLO opcode.
        source: ``file:line`` of the user code that produced it, if known.
    """

    def __init__(self, opcode: str, source: str | None, detail: str = ""):
        self.opcode, self.source = opcode, source
        where = f" (from {source})" if source else ""
        super().__init__(f"unsupported op {opcode!r}{where}{': ' + detail if detail else ''}")


class InfeasiblePlanError(RhinoError):
    """No plan fits the per-device memory budget.

    Attributes:
        needed_bytes: per-device memory that is needed at least: the least any plan the
            search tried needs, or a lower bound no plan can go below (the detail says).
        budget_bytes: the budget that was asked for.
    """

    def __init__(self, needed_bytes: float, budget_bytes: float, detail: str = ""):
        self.needed_bytes, self.budget_bytes = needed_bytes, budget_bytes
        super().__init__(
            f"no plan fits the memory budget: needs at least {format_bytes(needed_bytes)} "
            f"per device, budget is {format_bytes(budget_bytes)}"
            + (f" ({detail})" if detail else ""))


class PlanningError(RhinoError):
    """No candidate plan could be made; the message gives each candidate's reason."""


class OptionsError(RhinoError, ValueError):
    """An option out of range or of the wrong kind (raised when the options are built)."""


class ArgumentError(RhinoError, TypeError):
    """Arguments a step cannot be called with (missing or extra arguments, a leaf that is no
    array); the message names the argument and its pytree path."""


class PlanMismatchError(RhinoError):
    """A plan that does not fit the program it is applied to (another program, or a value
    the program lacks); the message names the value and what the program has instead."""


class LoweringError(RhinoError):
    """A plan's spec that cannot be written into the program (names the value)."""


class BatchCouplingError(LoweringError):
    """A step whose per-example computation reads statistics of the whole batch (BatchNorm,
    a branch on a batch-dependent predicate, ...): microbatching would change what it
    computes. The message names the op, its source line and where the statistic is made."""


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``; plain bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"
