"""O2 on segments too dense for exact pivot tables: elimination, conditioning hints, and the
approximate-table fallback that must never fall back to exact work per pivot pair."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rhino.planner import hierarchical
from rhino.planner.hierarchical import Partition, solve_o2, solve_o3
from rhino.planner.problem import Edge, ShardingProblem

# These tests check O2's heuristic machinery on problems small enough for its step 0.
pytestmark = pytest.mark.usefixtures("heuristic_o2")


def _potts_case(rng, m=16, k=8, p=0.7, psize=8):
    """Pivot A -> a dense segment (m nodes, k choices, edge density p, Potts edge costs)
    -> pivot B -> a two-node tail, with one skip edge from the segment to the tail.

    Treewidth ~m: elimination needs factors of k**12 entries and conditioning k**10 graphs,
    far past the exact-work budget, while the ILP solves it at the root (Potts costs).
    """
    sizes = [psize] + [k] * m + [psize, 3, 3]
    a, dense, b, t1, t2 = 0, list(range(1, m + 1)), m + 1, m + 2, m + 3
    edges = [(u, v) for u, v in itertools.combinations(dense, 2) if rng.random() < p]
    edges += [(a, dense[0]), (a, dense[1]), (dense[-1], b), (dense[-2], b), (b, t1), (t1, t2),
              (dense[2], t2)]
    costs = tuple(rng.uniform(0, 10, s) for s in sizes)
    es = tuple(Edge(u, v, rng.uniform(1, 5) * (np.arange(sizes[u])[:, None] % k
                                                != np.arange(sizes[v])[None, :] % k))
               for u, v in edges)
    prob = ShardingProblem(tuple(f"n{i}" for i in range(len(sizes))),
                           tuple(tuple(f"c{j}" for j in range(s)) for s in sizes), costs, es)
    seg = [-1] + [1] * m + [-1, 2, 2]
    return prob, Partition(tuple(range(len(sizes))), tuple(seg), (a, b))


def test_dense_segment_gets_an_approximate_table_not_work_per_pair(segment_solver_stats):
    prob, part = _potts_case(np.random.default_rng(0))
    o2 = solve_o2(prob, part, time_limit=60)
    (st,) = segment_solver_stats
    # one exact attempt, abandoned at the work budget and remembered for the segment's
    # later cost variants; no decode per pivot pair (8 x 8 = 64 pairs): one per chain solve
    assert st["budget_exceeded"] == 1 and st["approx_tables"] >= 1
    chain_solves = 2 * (1 + hierarchical._MAX_PASSES)
    assert st["decodes"] <= 3 * chain_solves
    assert st["decode_ilps"] <= chain_solves
    assert o2.objective == prob.objective(o2.choice)
    o3 = solve_o3(prob, mip_rel_gap=1e-9)
    assert o3.objective <= o2.objective * (1 + 1e-9)
    assert o2.objective <= 1.02 * o3.objective


def _segment(rng, n, p, npiv):
    sizes = [int(rng.integers(2, 6)) for _ in range(n)]
    edges = [(i, j, rng.uniform(0, 10, (sizes[i], sizes[j])))
             for i, j in itertools.combinations(range(n), 2) if rng.random() < p]
    costs = [np.zeros(s) if i < npiv else rng.uniform(0, 10, s) for i, s in enumerate(sizes)]
    return hierarchical._make_segment(list(range(n)), npiv, costs, edges)


def _brute(seg, fixed):
    n = len(seg.costs)
    best = np.inf
    for rest in itertools.product(*(range(len(c)) for c in seg.costs[len(fixed):])):
        x = tuple(fixed) + rest
        v = sum(seg.costs[i][x[i]] for i in range(n))
        v += sum(m[x[i], x[j]] for i, j, m in seg.edges)
        best = min(best, v)
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_factor", [1 << 22, 30])  # elimination alone; with conditioning
def test_exact_tables_and_hinted_decodes(monkeypatch, seed, max_factor):
    monkeypatch.setattr(hierarchical, "_ELIM_MAX_FACTOR", max_factor)
    rng = np.random.default_rng(40 + seed)
    seg = _segment(rng, 7, 0.7, 2)
    solver = hierarchical._SegmentSolver(60.0, 1e-9, float("inf"))
    table = solver.table(seg)
    assert solver.stats["approx_tables"] == 0
    for fixed in itertools.product(*(range(len(seg.costs[p])) for p in range(2))):
        ref = _brute(seg, fixed)
        val, choice = solver.decode(seg, fixed)
        assert table[fixed] == pytest.approx(ref, rel=1e-9)
        assert val == pytest.approx(ref, rel=1e-9)
        got = sum(seg.costs[i][choice[i]] for i in range(len(seg.costs)))
        got += sum(m[choice[i], choice[j]] for i, j, m in seg.edges)
        assert got == pytest.approx(ref, rel=1e-9)
    assert solver.stats["decode_ilps"] == 0
