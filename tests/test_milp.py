"""The HiGHS adapter (``rhino.milp``): one way of solving that every highspy release we pin
or test (1.15, 1.16) gets right."""

import doctest
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rhino import milp
from rhino.milp import MilpModel, SolverError, SolverStatus, solve_milp


def _choose(k: int, costs, start=None) -> MilpModel:
    """Pick exactly ``k`` of ``len(costs)`` binaries at least cost."""
    n = len(costs)
    return MilpModel(costs=np.asarray(costs, float), lower=np.zeros(n), upper=np.ones(n),
                     integer=np.ones(n, bool), row_lower=np.array([float(k)]),
                     row_upper=np.array([float(k)]), row_starts=np.array([0]),
                     row_index=np.arange(n), row_value=np.ones(n), start=start)


def test_doctest():
    assert doctest.testmod(milp).failed == 0


def test_optimal_infeasible_and_the_statuses_are_enums():
    r = solve_milp(_choose(2, [5.0, 1.0, 3.0, 2.0]))
    assert r.status is SolverStatus.OPTIMAL and r.objective == 3.0
    assert sorted(np.flatnonzero(r.x.round())) == [1, 3]
    bad = solve_milp(_choose(5, [1.0, 2.0]))
    assert bad.status is SolverStatus.INFEASIBLE and bad.x is None
    assert SolverStatus("time_limit") is SolverStatus.TIME_LIMIT and str(SolverStatus.OPTIMAL) == "optimal"


def test_a_worse_start_never_comes_back_as_the_answer():
    """highspy 1.16 hands back the start of a presolved MIP while reporting the optimum;
    the adapter returns a point with the optimum's objective either way."""
    rng = np.random.default_rng(0)
    costs = rng.uniform(1, 10, 40)
    worst = np.argsort(costs)[-5:]
    r = solve_milp(_choose(5, costs, start=(worst, np.ones(5))))
    assert r.status is SolverStatus.OPTIMAL
    assert r.objective == pytest.approx(np.sort(costs)[:5].sum())
    assert r.objective == pytest.approx(float(costs @ r.x))


def test_threads_of_an_earlier_highs_run_do_not_break_later_solves():
    """1.16: a run whose threads option differs from the first run's ended 'Not Set'
    (here the user's own HiGHS run, with the default threads, comes first)."""
    code = textwrap.dedent("""
        import highspy, numpy as np
        from rhino.milp import solve_milp, MilpModel
        h = highspy.Highs(); h.silent()
        h.addBinaries(3, obj=[1.0, 2.0, 3.0], ub=[1.0, 1.0, 1.0])
        h.run()
        m = MilpModel(np.array([3.0, 1.0]), np.zeros(2), np.ones(2), np.ones(2, bool),
                      np.array([1.0]), np.array([1.0]), np.array([0]), np.array([0, 1]),
                      np.ones(2))
        print(solve_milp(m).status.value, file=__import__("sys").stderr)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().endswith("optimal")


def test_no_banner_on_stdout():
    """1.16 prints 'Running HiGHS ... Copyright' on stdout for a process's first Highs
    object, whatever silent() says; `rhino plan --json` must stay JSON."""
    code = ("import numpy as np\n"
            "from rhino.milp import solve_milp, MilpModel\n"
            "m = MilpModel(np.array([1.0]), np.zeros(1), np.ones(1), np.ones(1, bool),"
            " np.zeros(0), np.zeros(0), np.zeros(0, int), np.zeros(0, int), np.zeros(0))\n"
            "solve_milp(m); solve_milp(m)\n"
            "print('only this')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "only this\n"


def test_a_forked_worker_solves():
    """The planner forks workers after solving in the parent (1.16 hung there when a
    parent run had started HiGHS' worker threads)."""
    code = textwrap.dedent("""
        import concurrent.futures as cf, multiprocessing as mp, numpy as np
        from rhino.milp import solve_milp, MilpModel
        m = MilpModel(np.array([3.0, 1.0]), np.zeros(2), np.ones(2), np.ones(2, bool),
                      np.array([1.0]), np.array([1.0]), np.array([0]), np.array([0, 1]),
                      np.ones(2))
        solve_milp(m)
        with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as ex:
            print([ex.submit(solve_milp, m).result(timeout=60).status.value
                   for _ in range(3)])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['optimal', 'optimal', 'optimal']"


def test_an_unexpected_status_is_a_named_solver_error(monkeypatch):
    import highspy

    monkeypatch.setattr(highspy.Highs, "getModelStatus",
                        lambda self: highspy.HighsModelStatus.kNotset)
    with pytest.raises(SolverError, match=r"model status 'Not Set'.*2 columns"):
        solve_milp(_choose(1, [1.0, 2.0]))
