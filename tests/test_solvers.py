"""Solvers: brute force, exact reductions, ILP, tree DP, and O2 vs O3.

Every exact solver is checked against brute force on tiny random problems; every O2 answer is
checked for validity (one in-range choice per node, objective == problem.objective) and
against O3.
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from rhino.milp import SolverError, SolverStatus
from rhino.planner import hierarchical
from rhino.planner.blocks import improve_blocks
from rhino.planner.hierarchical import Partition, solve_o2, solve_o3
from rhino.planner.problem import Edge, ShardingProblem
from rhino.planner.solvers import (
    InfeasibleProblemError, SolverTimeLimitWarning, improve_local, reduce_exact,
    solve_brute_force, solve_ilp, solve_small_ilp, solve_tree_dp, solve_trw)
from rhino.planner.windows import improve_windows, mirrored_windows

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "solver_micro.py"

# These tests check O2's heuristic machinery on problems small enough for its step 0.
pytestmark = pytest.mark.usefixtures("heuristic_o2")


def _load_generator():
    spec = importlib.util.spec_from_file_location("solver_micro", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_gpt_like


# ---- random problem makers -----------------------------------------------------------------
def _problem(sizes, edges, rng, p_inf=0.0, scale=10.0) -> ShardingProblem:
    n = len(sizes)
    costs = []
    for s in sizes:
        c = rng.uniform(0, scale, s)
        c[rng.random(s) < p_inf] = np.inf
        costs.append(c)
    es = []
    for u, v in edges:
        m = rng.uniform(0, scale, (sizes[u], sizes[v]))
        m[rng.random(m.shape) < p_inf] = np.inf
        es.append(Edge(u, v, m))
    return ShardingProblem(tuple(f"n{i}" for i in range(n)),
                           tuple(tuple(f"c{k}" for k in range(s)) for s in sizes),
                           tuple(costs), tuple(es))


def _sizes(rng, n, limit=200_000):
    while True:
        sizes = [int(rng.choice([1, 2, 3, 3, 4, 5, 6, 7])) for _ in range(n)]
        if np.prod(sizes, dtype=np.float64) <= limit:
            return sizes


def _random_dag(rng, n, p_edge=0.4):
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < p_edge]
    if edges and rng.random() < 0.3:  # a parallel edge in the opposite direction
        u, v = edges[0]
        edges.append((v, u))
    return edges


def _series_parallel(rng, n):
    edges = [(0, 1)]
    nxt = 2
    while nxt < n:
        u, v = edges[int(rng.integers(len(edges)))]
        if rng.random() < 0.5:
            edges.remove((u, v))
        edges += [(u, nxt), (nxt, v)]
        nxt += 1
    return edges


def _tree(rng, n):
    return [(int(rng.integers(v)), v) if rng.random() < 0.5 else (v, int(rng.integers(v)))
            for v in range(1, n)]


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


# ---- 1. ILP == brute force ----------------------------------------------------------------
@pytest.mark.parametrize("seed", range(36))
def test_ilp_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    prob = _problem(_sizes(rng, n), _random_dag(rng, n), rng, p_inf=0.15 if seed % 3 else 0.0)
    try:
        ref = solve_brute_force(prob)
    except InfeasibleProblemError:
        for reduce in (True, False):
            with pytest.raises(InfeasibleProblemError):
                solve_ilp(prob, reduce=reduce)
        return
    for reduce in (True, False):
        sol = solve_ilp(prob, reduce=reduce, mip_rel_gap=1e-9)
        assert sol.status == "optimal"
        assert _same(sol.objective, ref.objective), (reduce, sol.objective, ref.objective)
        assert _same(sol.objective, prob.objective(sol.choice))
        assert sol.bound is not None and sol.bound <= sol.objective + 1e-9


def test_brute_force_refuses_large():
    rng = np.random.default_rng(0)
    prob = _problem([10] * 7, [(0, 1)], rng)
    with pytest.raises(ValueError, match="brute force"):
        solve_brute_force(prob)


# ---- 2. reductions ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_reduce_exact_trees_and_series_parallel(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 9))
    edges = _tree(rng, n) if seed % 2 else _series_parallel(rng, n)
    prob = _problem(_sizes(rng, n), edges, rng)
    red = reduce_exact(prob)
    assert red.core.num_nodes == 0  # series-parallel graphs and trees collapse completely
    full = red.expand(())
    assert _same(prob.objective(full), solve_brute_force(prob).objective)
    assert _same(prob.objective(full), red.offset)


@pytest.mark.parametrize("seed", range(10))
def test_reduce_exact_core_invariant(seed):
    """objective(expand(c)) == core.objective(c) + offset for every core assignment c."""
    rng = np.random.default_rng(200 + seed)
    n = 8
    edges = _random_dag(rng, n, 0.5) + [(0, 7)]
    prob = _problem(_sizes(rng, n), edges, rng)
    red = reduce_exact(prob, max_pair=4096)
    for _ in range(20):
        c = [int(rng.integers(red.core.num_choices(i))) for i in range(red.core.num_nodes)]
        assert _same(prob.objective(red.expand(c)), red.core.objective(c) + red.offset)
    best = solve_brute_force(red.core) if red.core.num_nodes else None
    full = red.expand(best.choice if best else ())
    assert _same(prob.objective(full), solve_brute_force(prob).objective)


def test_reduce_respects_protected_and_pair_limit():
    rng = np.random.default_rng(3)
    prob = _problem([3, 4, 3], [(0, 1), (1, 2)], rng)
    red = reduce_exact(prob, protected=[1])
    assert red.core_nodes == (1,)
    cycle = _problem([5, 5, 5, 5], [(0, 1), (1, 2), (2, 3), (3, 0)], rng)
    assert reduce_exact(cycle, max_pair=10).core.num_nodes == 4  # 5 x 5 > 10 stops R2
    assert reduce_exact(cycle).core.num_nodes == 0


@pytest.mark.parametrize("seed", range(8))
def test_tree_dp(seed):
    rng = np.random.default_rng(300 + seed)
    n = int(rng.integers(1, 9))
    prob = _problem(_sizes(rng, n), _tree(rng, n)[: max(0, n - 1 - seed % 2)], rng)
    assert _same(solve_tree_dp(prob).objective, solve_brute_force(prob).objective)


def test_tree_dp_rejects_cycle():
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match="forest"):
        solve_tree_dp(_problem([2, 2, 2], [(0, 1), (1, 2), (2, 0)], rng))


def test_improve_local_never_worse():
    rng = np.random.default_rng(5)
    prob = _problem(_sizes(rng, 8), _random_dag(rng, 8, 0.6), rng)
    start = [0] * 8
    assert prob.objective(improve_local(prob, start)) <= prob.objective(start)


@pytest.mark.parametrize("seed", range(6))
def test_improve_blocks_never_worse_and_exact_on_a_neighbourhood(seed):
    rng = np.random.default_rng(40 + seed)
    # A small tree: every node lies within 2 edges of node 0, so one block move re-chooses
    # the whole problem and reaches the optimum wherever it starts.
    star = [(0, i) for i in range(1, 4)] + [(1, 4), (2, 5)]
    prob = _problem([int(x) for x in rng.integers(2, 6, 6)], star, rng)
    start = tuple(int(x) for x in rng.integers(0, [prob.num_choices(i) for i in range(6)]))
    best = solve_brute_force(prob).objective
    assert _same(prob.objective(improve_blocks(prob, start)), best)
    # Larger random graphs: never worse than where it starts, nor than ICM from there.
    big = _problem(_sizes(rng, 14, limit=1e12), _random_dag(rng, 14, 0.25), rng)
    s0 = improve_local(big, [0] * 14)
    assert big.objective(improve_blocks(big, s0)) <= big.objective(s0)


def test_block_moves_switch_a_group_that_only_pays_off_together():
    """A chain whose middle five nodes must switch at once: each alone saves 2 and pays 6 on
    its two edges, so ICM stays put; the group together saves 10 for 6."""
    n = 9
    same = np.array([[0.0, 3.0], [3.0, 0.0]])
    costs = [np.array([0.0, 100.0]), np.array([0.0, 100.0])]
    costs += [np.array([2.0, 0.0]) for _ in range(5)]
    costs += [np.array([0.0, 100.0]), np.array([0.0, 100.0])]
    edges = [Edge(i, i + 1, same) for i in range(n - 1)]
    # The group's ends are also tied, so the middle is a cycle and not folded by reductions.
    edges.append(Edge(2, 6, np.zeros((2, 2))))
    prob = ShardingProblem(tuple(f"n{i}" for i in range(n)), (("a", "b"),) * n,
                           tuple(costs), tuple(edges))
    start = (0,) * n
    assert improve_local(prob, start) == start
    o3 = solve_o3(prob).objective
    assert _same(prob.objective(improve_blocks(prob, start)), o3)


def test_mirrored_windows_switch_a_group_split_between_far_segments():
    """A weight group split across the chain: 5 nodes in segment 1 (forward), 5 in segment
    4 (backward, linked to segment 1 by a skip edge), and a parameter in segment 0 tied to
    both ends; all 11 must agree (30 per disagreeing edge), and only the parameter gains
    from switching (-20, the others pay 1 each). No block move (8 nodes, 2 edges around
    one) and no single move pays; the window (segment 1, its mirror 4, their neighbours,
    the parameter within reach in segment 0) switches the whole group, the optimum."""
    agree = np.array([[0.0, 30.0], [30.0, 0.0]])
    fwd, bwd, param = list(range(5)), list(range(5, 10)), 10
    pivots = [11, 12, 13, 14]
    n = 15
    costs = [np.array([0.0, 1.0]) for _ in range(10)] + [np.array([0.0, -20.0])]
    costs += [np.zeros(1) for _ in pivots]
    edges = [Edge(a, a + 1, agree) for a in fwd[:-1]] + [Edge(b, b + 1, agree)
                                                       for b in bwd[:-1]]
    edges += [Edge(fwd[-1], bwd[0], agree), Edge(param, fwd[0], agree),
              Edge(param, bwd[-1], agree)]
    prob = ShardingProblem(tuple(f"n{i}" for i in range(n)),
                           tuple(("a", "b") if i < 11 else ("p",) for i in range(n)),
                           tuple(costs), tuple(edges))
    seg_of = [1] * 5 + [4] * 5 + [0] + [1, 2, 3, 4]
    start = (0,) * n
    assert improve_blocks(prob, improve_local(prob, start)) == start
    windows = mirrored_windows(prob, seg_of, pivots)
    assert any(set(fwd + bwd + [param]) <= set(w) for w in windows), windows
    got = improve_windows(prob, start, seg_of, pivots)
    assert got[:11] == (1,) * 11
    assert _same(prob.objective(got), solve_brute_force(prob).objective)


def _layered_groups(layers: int) -> tuple[ShardingProblem, list[int], list[int]]:
    """``layers`` copies of the group above: layer i's forward nodes in segment i, its
    backward nodes in the mirror segment 2 * layers + 1 - i, its parameter in segment 0;
    plus a segment-0 constant every layer reads (a hub, neutral to every choice)."""
    agree = np.array([[0.0, 30.0], [30.0, 0.0]])
    k = 2 * layers
    costs: list[np.ndarray] = []
    edges: list[Edge] = []
    seg_of: list[int] = []
    hub = 11 * layers
    for i in range(1, layers + 1):
        base = len(costs)
        costs += [np.array([0.0, 1.0]) for _ in range(10)] + [np.array([0.0, -20.0])]
        seg_of += [i] * 5 + [k + 1 - i] * 5 + [0]
        edges += [Edge(base + a, base + a + 1, agree) for a in range(9)]
        edges += [Edge(base + 10, base, agree), Edge(base + 10, base + 9, agree),
                  Edge(hub, base, np.zeros((2, 2))), Edge(hub, base + 9, np.zeros((2, 2)))]
    costs.append(np.array([0.0, 0.0]))
    seg_of.append(0)
    pivots = list(range(len(costs), len(costs) + k))
    costs += [np.zeros(1) for _ in pivots]
    seg_of += list(range(1, k + 1))
    n = len(costs)
    prob = ShardingProblem(tuple(f"n{i}" for i in range(n)),
                           tuple(("a", "b")[:len(c)] for c in costs), tuple(costs), tuple(edges))
    return prob, seg_of, pivots


def test_mirrored_windows_solve_equal_layers_once_and_leave_hubs_fixed(monkeypatch):
    """Six equal layers: every layer's group switches (the optimum, -10 per layer), the
    constant read by all of them joins no window, and windows that are equal problems (the
    first and last pairs of layers, the two in the middle) are solved once: 2 message
    passings for 4 windows."""
    import rhino.planner.windows as windows
    prob, seg_of, pivots = _layered_groups(8)
    hub = 88
    found = windows.mirrored_windows(prob, seg_of, pivots, cap=45)
    assert not any(hub in w for w in found), found
    for i in range(8):
        assert any(set(range(11 * i, 11 * i + 11)) <= set(w) for w in found), (i, found)
    calls = []
    monkeypatch.setattr(windows, "solve_trw",
                        lambda sub, **kw: calls.append(sub) or solve_trw(sub, **kw))
    start = (0,) * prob.num_nodes
    got = windows.improve_windows(prob, start, seg_of, pivots, cap=45)
    assert got[:88] == (1,) * 88
    assert _same(prob.objective(got), prob.objective(start) - 80)
    assert len(calls) < len(found), len(calls)


def test_block_moves_leave_an_infinite_cost_that_only_a_group_can_leave():
    """Neighbours must agree (infinity otherwise) and the start's first choice of ``a`` is
    forbidden: every single-node move keeps the cost infinite, the group's is finite."""
    agree = np.array([[0.0, np.inf], [np.inf, 0.0]])
    prob = ShardingProblem(("a", "b", "c"), (("x", "y"),) * 3,
                           (np.array([np.inf, 1.0]), np.zeros(2), np.zeros(2)),
                           (Edge(0, 1, agree), Edge(1, 2, agree)))
    assert improve_local(prob, (0, 0, 0)) == (0, 0, 0)
    assert improve_blocks(prob, (0, 0, 0)) == (1, 1, 1)


# ---- 3. O2 vs O3 -----------------------------------------------------------------------------
def _chain_case(rng, n, every, extra):
    """A path 0-1-...-n-1 (plus some i->i+2 edges inside segments); single-node cones."""
    pivots = list(range(every, n - 1, every))
    pset = set(pivots)
    edges = [(i, i + 1) for i in range(n - 1)]
    edges += [(i, i + 2) for i in range(n - 2)
              if rng.random() < extra and i + 1 not in pset and i not in pset
              and i + 2 not in pset]
    seg, k = [], 0
    for i in range(n):
        seg.append(-1 if i in pset else k)
        k += i in pset
    prob = _problem([int(rng.choice([2, 3, 5, 7])) for _ in range(n)], edges, rng)
    return prob, Partition(tuple(range(n)), tuple(seg), tuple(pivots))


@pytest.mark.parametrize("seed", range(8))
def test_o2_equals_o3_on_chains(seed):
    rng = np.random.default_rng(400 + seed)
    prob, part = _chain_case(rng, 30, int(rng.integers(2, 6)), 0.3)
    o2, o3 = solve_o2(prob, part), solve_o3(prob, mip_rel_gap=1e-9)
    assert _same(o2.objective, prob.objective(o2.choice))
    assert _same(o2.objective, o3.objective)


@pytest.mark.parametrize("seed", range(8))
def test_o2_equals_o3_on_single_cone(seed):
    rng = np.random.default_rng(500 + seed)
    n = int(rng.integers(3, 12))
    root = n - 1
    # member i feeds a later node (its consumer); some members also feed the root directly
    edges = [(i, int(rng.integers(i + 1, n))) for i in range(n - 1)]
    edges += [(i, root) for i in range(n - 2) if rng.random() < 0.3 and edges[i][1] != root]
    prob = _problem([int(rng.choice([2, 3, 7])) for _ in range(n)], edges, rng)
    part = Partition((root,) * n, (0,) * n, ())
    o2, o3 = solve_o2(prob, part), solve_o3(prob, mip_rel_gap=1e-9)
    assert _same(o2.objective, o3.objective)


def _k4(costs: np.ndarray, rng) -> ShardingProblem:
    """Two labels on K4 (every node of degree 3: no exact reduction folds it)."""
    return ShardingProblem(tuple("abcd"), (("x", "y"),) * 4,
                           tuple(rng.uniform(0, 3, 2) for _ in range(4)),
                           tuple(Edge(u, v, costs) for u in range(4) for v in range(u + 1, 4)))


@pytest.mark.parametrize("seed", range(3))
def test_o2_hands_small_problems_to_the_ilp(monkeypatch, seed):
    """Step 0: a small core whose LP relaxation is integral (two labels that like to
    agree: submodular, so the marginal polytope is exact) gets the optimum, status
    "optimal"; past the size limit, the iteration budget or the time limit, the
    heuristic runs."""
    prob = _k4(np.array([[0.0, 4.0], [4.0, 0.0]]), np.random.default_rng(650 + seed))
    part = Partition((0, 1, 2, 3), (0, 0, 0, 0), ())
    best = solve_brute_force(prob).objective
    monkeypatch.setattr(hierarchical, "_SMALL_ILP_ENTRIES", 10**6)
    small = solve_o2(prob, part)
    assert small.status == "optimal" and _same(small.objective, best)
    assert small.objective == prob.objective(small.choice)
    many = lambda n: 100 * n  # noqa: E731
    assert _same(solve_small_ilp(prob, max_entries=100, time_limit=60,
                                 iterations=many).objective, best)
    assert solve_small_ilp(prob, max_entries=100, time_limit=60, iterations=lambda n: 1) is None
    assert solve_small_ilp(prob, max_entries=100, time_limit=1e-9) is None
    assert solve_small_ilp(prob, max_entries=10, time_limit=60, iterations=many) is None
    monkeypatch.setattr(hierarchical, "_SMALL_ILP_ENTRIES", 0)
    assert solve_o2(prob, part).status == "heuristic"


def test_small_ilp_refuses_a_fractional_relaxation():
    """Two labels that must differ on every edge of K4 (which no exact reduction folds):
    the LP's optimum is all halves at cost 0, no assignment reaches it, so only the MIP
    proves an optimum."""
    prob = _k4(np.array([[4.0, 0.0], [0.0, 4.0]]), np.random.default_rng(660))
    assert solve_small_ilp(prob, max_entries=100, time_limit=60, iterations=lambda n: 10**4) is None
    exact = solve_small_ilp(prob, max_entries=100, time_limit=60)
    assert exact.status == "optimal" and _same(exact.objective, solve_brute_force(prob).objective)


def _layered_case(rng, layers, width, n_skip):
    """Layers of cones between pivots, plus skip edges between far layers."""
    cone_of, seg, pivots, edges = [], [], [], []
    prev_pivot = None
    for l in range(layers):
        k = len(pivots)
        roots = []
        for _ in range(width):
            r = len(cone_of) + 2
            a, b = r - 2, r - 1  # member chain a -> b -> r
            cone_of += [r, r, r]
            seg += [k, k, k]
            edges += [(a, b), (b, r)]
            if prev_pivot is not None:
                edges.append((prev_pivot, a))
            roots.append(r)
        p = len(cone_of)
        cone_of.append(p)
        seg.append(-1)
        edges += [(r, p) for r in roots]
        pivots.append(p)
        prev_pivot = p
    n = len(cone_of)
    for _ in range(n_skip):
        u, v = sorted(int(x) for x in rng.choice(n, 2, replace=False))
        edges.append((u, v))
    prob = _problem([int(rng.choice([2, 3, 4])) for _ in range(n)], edges, rng)
    return prob, Partition(tuple(cone_of), tuple(seg), tuple(pivots))


@pytest.mark.parametrize("seed", range(6))
def test_o2_valid_with_skip_edges(seed):
    rng = np.random.default_rng(600 + seed)
    prob, part = _layered_case(rng, 5, 2, 8)
    o2 = solve_o2(prob, part)
    assert len(o2.choice) == prob.num_nodes
    assert all(0 <= c < prob.num_choices(i) for i, c in enumerate(o2.choice))
    assert o2.objective == prob.objective(o2.choice)
    o3 = solve_o3(prob, mip_rel_gap=1e-9)
    assert o3.objective <= o2.objective + 1e-9
    assert o2.objective <= 1.15 * o3.objective


@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_o2_close_to_o3_on_synthetic_gpt(mesh):
    prob, part = _load_generator()(2 if mesh == "1d" else 1, mesh=mesh, pad=2)
    o2, o3 = solve_o2(prob, part), solve_o3(prob)
    assert o2.objective == prob.objective(o2.choice)
    assert o3.objective <= o2.objective * (1 + 1e-4)
    assert o2.objective <= 1.03 * o3.objective


def _k4_chain(rng):
    """Segments that are K4s (irreducible by R1/R2) between pivots."""
    edges, seg, pivots = [], [], []
    n = 0
    for s in range(3):
        a, b = n, n + 1
        seg += [s, s]
        edges += [(a, b)]
        if pivots:
            edges += [(pivots[-1], a), (pivots[-1], b)]
        p = n + 2
        seg.append(-1)
        edges += [(a, p), (b, p)]
        pivots.append(p)
        n += 3
    prob = _problem([3] * n, edges, rng)
    return prob, Partition(tuple(range(n)), tuple(seg), tuple(pivots))


def test_o2_irreducible_segments(monkeypatch, segment_solver_stats):
    rng = np.random.default_rng(8)
    prob, part = _k4_chain(rng)
    ref = solve_brute_force(prob).objective
    # no skip edges: the chain DP alone is exact, by elimination
    assert _same(solve_o2(prob, part).objective, ref)
    # no budget for exact tables: approximate tables, each segment decoded once (with the
    # pivots the chain DP picked), never once per pivot pair
    monkeypatch.setattr(hierarchical, "_EXACT_WORK", 0)
    monkeypatch.setattr(hierarchical, "_HARD_DECODE_WORK", 0)
    before = len(segment_solver_stats)
    o2 = solve_o2(prob, part)
    assert o2.objective == prob.objective(o2.choice)
    assert o2.objective <= 1.05 * ref
    (st,) = segment_solver_stats[before:]
    assert st["approx_tables"] >= 2 and st["budget_exceeded"] == 1  # remembered by shape
    assert st["decodes"] <= 4 and st["decode_ilps"] <= st["decodes"]


def test_o2_irreducible_cone():
    """Members 0..3 form a K4 under root 4: O2 stays exact (conditioning, no pivots)."""
    rng = np.random.default_rng(9)
    edges = [(u, v) for u in range(4) for v in range(u + 1, 4)] + [(3, 4), (0, 4)]
    prob = _problem([2, 3, 2, 3, 3], edges, rng)
    part = Partition((4,) * 5, (0,) * 5, ())
    assert _same(solve_o2(prob, part).objective, solve_brute_force(prob).objective)


@pytest.mark.parametrize("seed", range(6))
def test_trw(seed):
    rng = np.random.default_rng(700 + seed)
    n = int(rng.integers(2, 9))
    prob = _problem(_sizes(rng, n), _tree(rng, n) if seed % 2 else _random_dag(rng, n), rng)
    sol, ref = solve_trw(prob, rho=1.0 if seed % 2 else None), solve_brute_force(prob)
    assert sol.objective == prob.objective(sol.choice) and sol.status == "heuristic"
    assert sol.objective >= ref.objective - 1e-9
    if seed % 2:  # min-sum BP is exact on trees
        assert _same(sol.objective, ref.objective)


def test_partition_checked():
    rng = np.random.default_rng(10)
    prob = _problem([2, 2, 2], [(0, 1), (1, 2)], rng)
    with pytest.raises(ValueError, match="not a root"):
        solve_o2(prob, Partition((1, 2, 2), (0, 0, 0), ()))
    with pytest.raises(ValueError, match="pivot"):
        solve_o2(prob, Partition((0, 1, 2), (0, 0, 1), (1,)))


# ---- 4. time limit ---------------------------------------------------------------------------
def test_time_limit_returns_incumbent_with_warning():
    rng = np.random.default_rng(11)
    n = 80
    edges = sorted({(u, v) for u in range(n) for v in rng.choice(n, 6) if u < v})
    prob = _problem([7] * n, edges, rng)
    with pytest.warns(SolverTimeLimitWarning, match="gap"):
        sol = solve_ilp(prob, time_limit=0.01, reduce=False)
    assert sol.status == "time_limit"
    assert sol.objective == prob.objective(sol.choice)


def test_time_limit_without_incumbent_raises(monkeypatch):
    """HiGHS stopped by its limit with no feasible point, and no finite start either: an
    error naming the time limit (not a made-up assignment). HiGHS itself may or may not find
    an incumbent within a tiny limit, so its answer is fixed here."""
    from rhino.milp import MilpResult
    from rhino.planner import solvers
    rng = np.random.default_rng(12)
    n = 80
    edges = sorted({(u, v) for u in range(n) for v in rng.choice(n, 6) if u < v})
    prob = _problem([7] * n, edges, rng, p_inf=0.3)
    no_start = tuple([0] * prob.num_nodes)
    assert not np.isfinite(prob.objective(no_start))     # the start is no fallback
    monkeypatch.setattr(solvers, "_start_choice", lambda p, t, trw=True: no_start)
    seen = []

    def limited(model):
        seen.append(model)
        return MilpResult(SolverStatus.TIME_LIMIT, None, None, None, 0.001)
    monkeypatch.setattr(solvers, "solve_milp", limited)
    with pytest.raises(SolverError, match="time limit .* before any feasible assignment"):
        solve_ilp(prob, time_limit=0.5, reduce=False)
    assert len(seen) == 1 and seen[0].start is None


# ---- 5. infinite costs -----------------------------------------------------------------------
def test_infinite_costs_respected():
    inf = np.inf
    # without the infinities (0, 0) would cost 0 and (0, 2) 5; the optimum is (1, 0) = 4
    prob = ShardingProblem(
        ("a", "b"), (("x", "y", "z"), ("x", "y", "z")),
        (np.array([0.0, 1.0, 5.0]), np.array([0.0, 2.0, inf])),
        (Edge(0, 1, np.array([[inf, 5.0, 0.0], [3.0, 5.0, 5.0], [5.0, 5.0, 5.0]])),))
    for sol in (solve_ilp(prob), solve_ilp(prob, reduce=False), solve_brute_force(prob),
                solve_o2(prob, Partition((0, 1), (0, -1), (1,))), solve_tree_dp(prob)):
        assert sol.choice == (1, 0) and sol.objective == 4.0, sol
    dead = ShardingProblem(("a", "b"), (("x",), ("x", "y")),
                           (np.array([0.0]), np.array([1.0, 1.0])),
                           (Edge(0, 1, np.array([[inf, inf]])),))
    for solve in (solve_ilp, solve_brute_force, solve_tree_dp,
                  lambda p: solve_ilp(p, reduce=False)):
        with pytest.raises(InfeasibleProblemError):
            solve(dead)


@pytest.mark.parametrize("seed", range(4))
def test_o2_infinite_skip_edges(seed):
    """Forbidden pairs on skip edges: O2 stays feasible and valid."""
    rng = np.random.default_rng(800 + seed)
    prob, part = _layered_case(rng, 4, 2, 10)
    edges = list(prob.edges)
    for k in range(len(edges) - 10, len(edges)):  # the skip edges
        m = edges[k].cost.copy()
        m[rng.random(m.shape) < 0.4] = np.inf
        m[0, 0] = 0.0  # keep a feasible pair
        edges[k] = Edge(edges[k].u, edges[k].v, m)
    prob = ShardingProblem(prob.names, prob.labels, prob.costs, tuple(edges))
    o2, o3 = solve_o2(prob, part), solve_o3(prob, mip_rel_gap=1e-9)
    assert np.isfinite(o2.objective) and o2.objective == prob.objective(o2.choice)
    assert o3.objective <= o2.objective + 1e-9


def test_o2_shares_exact_segment_results_between_solves(segment_solver_stats):
    """Exact tables and decodes are memoised per process by the segment's cost data: a
    second solve of the same problem (a split's stages repeat layers; memory fitting
    re-solves) builds none, and finds the same choice."""
    rng = np.random.default_rng(8)
    prob, part = _k4_chain(rng)
    hierarchical._EXACT.clear()
    first, second = solve_o2(prob, part), solve_o2(prob, part)
    a, b = segment_solver_stats[-2:]
    assert a["tables"] >= 2 and a["decodes"] >= 1
    assert b["tables"] == 0 and b["decodes"] == 0 and b["table_hits"] >= a["tables"]
    assert tuple(first.choice) == tuple(second.choice)
    assert first.objective == second.objective


def test_the_shared_memo_forgets_results_made_under_other_budgets(monkeypatch,
                                                                   segment_solver_stats):
    rng = np.random.default_rng(8)
    prob, part = _k4_chain(rng)
    solve_o2(prob, part)
    monkeypatch.setattr(hierarchical, "_EXACT_WORK", 0)
    monkeypatch.setattr(hierarchical, "_HARD_DECODE_WORK", 0)
    solve_o2(prob, part)
    st = segment_solver_stats[-1]
    assert st["approx_tables"] >= 2 and st["budget_exceeded"] == 1   # no exact tables reused


def test_o2_equals_o3_where_a_group_must_move_together():
    """DNABERT on mesh (8) at 100 FLOP per byte: O2 without block moves was 2.4% above O3 (a
    QKV projection's dot, reshape and slices switch sharding only together)."""
    import rhino
    from rhino.models import get_model
    from rhino.planner.api import PlanOptions, plan_graph
    from rhino.planner.cost_model import CostModel
    from rhino.planner.mesh import AbstractMesh

    m = get_model("dnabert")
    graph = rhino.ingest(m.step, *m.example_args())
    base = CostModel.simulated_cpu(1, memory_bytes=None)
    cost = base.with_flops(100.0 / max(base.beta))
    obj = {level: plan_graph(graph, AbstractMesh((8,)), cost,
                             PlanOptions(opt_level=level)).search.objective
           for level in ("O2", "O3")}
    assert obj["O2"] <= obj["O3"] * (1 + 1e-6), obj


def test_plan_options_refine_must_be_a_bool():
    from rhino.errors import OptionsError
    from rhino.planner.api import PlanOptions
    assert PlanOptions().refine is True and PlanOptions(refine=False).refine is False
    with pytest.raises(OptionsError, match="refine: expected True or False, found 'no'"):
        PlanOptions(refine="no")
