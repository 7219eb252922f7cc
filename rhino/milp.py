"""The one HiGHS adapter: every ILP rhino solves goes through ``solve_milp``.

A ``MilpModel`` is plain data (columns with costs, bounds and integrality; rows as sparse
CSR with lower and upper bounds; an optional start). ``solve_milp`` hands it to highspy and
returns a ``MilpResult`` whose status is a ``SolverStatus``. The SPMD whole-graph ILP
(``planner.solvers``) and the pipeline stage ILP (``pipeline.stage_ilp``) both build models
and read results; neither touches highspy.

highspy differs between releases in ways that matter here (checked on 1.15.1 and 1.16.0):

- 1.16 prints a banner on **stdout** when the first ``Highs`` object of a process is made,
  whatever ``silent()`` says; the first object is therefore made with file descriptor 1
  pointed at ``/dev/null`` (once per process, under a lock), so ``rhino plan --json`` stays
  valid JSON.
- 1.16 fails a run (model status ``Not Set``) whose ``threads`` option differs from the
  thread count of HiGHS' process-wide scheduler, which the first run fixes; and a process
  forked after a run with worker threads hangs in its first run (the planner forks
  workers). Every rhino model is solved with ``threads=1``, which forks safely on both
  releases; a run refused because the user's own code fixed another thread count first is
  repeated once after ``Highs.resetGlobalScheduler``. Several models solve at once in
  separate Python threads (highspy releases the GIL).
- 1.16 can hand back the start given with ``setSolution`` as the solution of a presolved
  MIP, while reporting the better objective it found (``solve_milp`` checks and re-solves).

Example:
    >>> import numpy as np
    >>> m = MilpModel(costs=np.array([3.0, 1.0, 2.0]), lower=np.zeros(3), upper=np.ones(3),
    ...               integer=np.ones(3, bool), row_lower=np.array([2.0]),
    ...               row_upper=np.array([2.0]), row_starts=np.array([0]),
    ...               row_index=np.array([0, 1, 2]), row_value=np.ones(3))
    >>> r = solve_milp(m)
    >>> r.status, r.objective, [int(v) for v in r.x.round()]
    (<SolverStatus.OPTIMAL: 'optimal'>, 3.0, [0, 1, 1])
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time

import numpy as np

from rhino.errors import RhinoError
from rhino.vocabulary import SolverStatus


class SolverError(RhinoError):
    """HiGHS ended in a state rhino does not expect (names the status and the model)."""


@dataclasses.dataclass(frozen=True)
class MilpModel:
    """minimize ``costs · x`` s.t. ``row_lower <= A x <= row_upper``, ``lower <= x <= upper``,
    ``x[j]`` integer where ``integer[j]``.

    ``A`` is CSR: row ``r`` holds ``row_value[k]`` at column ``row_index[k]`` for
    ``row_starts[r] <= k < row_starts[r + 1]`` (the last row ends at ``len(row_index)``).
    ``start``: a feasible assignment to start from, as ``(columns, values)``.
    ``iteration_limit``: HiGHS' simplex iterations (applied to LPs, not inside a MIP solve).
    """

    costs: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    integer: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    row_starts: np.ndarray
    row_index: np.ndarray
    row_value: np.ndarray
    start: tuple[np.ndarray, np.ndarray] | None = None
    time_limit: float = 60.0
    mip_rel_gap: float = 1e-4
    iteration_limit: int | None = None

    @property
    def num_cols(self) -> int:
        return len(self.costs)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    def describe(self) -> str:
        return (f"{self.num_cols} columns ({int(np.count_nonzero(self.integer))} integer), "
                f"{self.num_rows} rows, {len(self.row_index)} nonzeros")


@dataclasses.dataclass(frozen=True)
class MilpResult:
    """The answer: ``x`` (None when no feasible point was found), its objective, HiGHS'
    dual bound (None if unknown) and the solve's wall time."""

    status: SolverStatus
    x: np.ndarray | None
    objective: float | None
    bound: float | None
    seconds: float


INF = float("inf")

_first_lock = threading.Lock()
_first_made = False


@contextlib.contextmanager
def _stdout_silenced():
    """Point file descriptor 1 at /dev/null (C-level prints included), then restore."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        try:
            import ctypes
            ctypes.CDLL(None).fflush(None)   # drop what C stdio buffered meanwhile
        except (OSError, AttributeError):
            pass
        os.dup2(saved, 1)
        os.close(saved)


def _new_highs():
    """A silent ``Highs`` object; the process's first is made with stdout silenced."""
    global _first_made
    import highspy

    if not _first_made:
        with _first_lock:
            if not _first_made:
                try:
                    with _stdout_silenced():
                        h = highspy.Highs()
                except OSError:      # no file descriptor 1 to redirect: make it as it is
                    h = highspy.Highs()
                _first_made = True
                h.silent()
                return h
    h = highspy.Highs()
    h.silent()
    return h


def solve_milp(model: MilpModel) -> MilpResult:
    """Solve ``model`` with HiGHS.

    The point returned always has the objective HiGHS reports: highspy 1.16 can hand back
    the start (``setSolution``) as the solution of a presolved MIP while reporting the
    better objective it found; such a solve is repeated without the start.

    Raises:
        SolverError: HiGHS ended with a status other than optimal, infeasible or a limit
            (named with the model's size).
    """
    t0 = time.perf_counter()
    result, reported = _run(model)
    if (result.x is not None and model.start is not None and reported is not None
            and abs(result.objective - reported) > 1e-7 * max(1.0, abs(reported))):
        left = model.time_limit - (time.perf_counter() - t0)
        result, _ = _run(dataclasses.replace(model, start=None, time_limit=max(left, 1e-3)))
    return dataclasses.replace(result, seconds=time.perf_counter() - t0)


def _run(model: MilpModel) -> tuple[MilpResult, float | None]:
    """One HiGHS run: the result and the objective HiGHS reports for it."""
    import highspy

    h = _new_highs()
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", float(model.mip_rel_gap))
    h.setOptionValue("time_limit", max(float(model.time_limit), 1e-3))
    if model.iteration_limit is not None:
        h.setOptionValue("simplex_iteration_limit", int(model.iteration_limit))
    n = model.num_cols
    h.addCols(n, np.asarray(model.costs, np.float64), np.asarray(model.lower, np.float64),
              np.asarray(model.upper, np.float64), 0, np.zeros(0, np.int32),
              np.zeros(0, np.int32), np.zeros(0))
    integer = np.asarray(model.integer, bool)
    if integer.any():
        h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), integer.astype(np.uint8))
    if model.num_rows:
        h.addRows(model.num_rows, np.asarray(model.row_lower, np.float64),
                  np.asarray(model.row_upper, np.float64), len(model.row_index),
                  np.asarray(model.row_starts, np.int32), np.asarray(model.row_index, np.int32),
                  np.asarray(model.row_value, np.float64))
    if model.start is not None:
        cols, vals = model.start
        h.setSolution(len(cols), np.asarray(cols, np.int32), np.asarray(vals, np.float64))
    S = highspy.HighsModelStatus
    t0 = time.perf_counter()
    h.run()
    st = h.getModelStatus()
    if st == S.kNotset:          # the scheduler has another thread count (see above)
        highspy.Highs.resetGlobalScheduler(True)
        h.run()
        st = h.getModelStatus()
    seconds = time.perf_counter() - t0
    if st == S.kInfeasible:
        return MilpResult(SolverStatus.INFEASIBLE, None, None, None, seconds), None
    info = h.getInfo()
    feasible = info.primal_solution_status == 2          # kSolutionStatusFeasible
    x = np.asarray(h.getSolution().col_value) if feasible else None
    bound = float(info.mip_dual_bound) if integer.any() else float(info.objective_function_value)
    bound = bound if np.isfinite(bound) else None
    objective = float(np.dot(model.costs, x)) if x is not None else None
    reported = float(info.objective_function_value) if x is not None else None
    if st == S.kOptimal and x is not None:
        return MilpResult(SolverStatus.OPTIMAL, x, objective, bound, seconds), reported
    if st in (S.kTimeLimit, S.kInterrupt, S.kIterationLimit, S.kSolutionLimit):
        return MilpResult(SolverStatus.TIME_LIMIT, x, objective, bound, seconds), reported
    raise SolverError(f"HiGHS ended with model status {h.modelStatusToString(st)!r} "
                      f"(expected optimal, infeasible or a limit) on a model of "
                      f"{model.describe()}")
