"""Solvers for a ``ShardingProblem`` (Rhino §4.2).

Exact: ``solve_brute_force`` (tiny problems), ``solve_tree_dp`` (forests), ``reduce_exact``
(PBQP reductions R0/R1/R2 with back-substitution) and ``solve_ilp`` (highspy MILP).
Heuristic: ``solve_trw`` (tree-reweighted message passing), ``improve_local`` (ICM), and in
``rhino.planner.blocks`` ``improve_blocks`` (exact moves of small neighbourhoods); the
hierarchical O2 solver (``rhino.planner.hierarchical``) combines them.

Pipeline of ``solve_ilp``::

    ShardingProblem ──► reduce_exact (R0/R1/R2 to a fixed point) ──► core problem
        core ──► ICM start ──► highspy MILP (tight marginal pairwise form) ──► core choice
        core choice ──► Reduced.expand (back-substitution, reverse order) ──► full choice

Constraint rows are added in bulk (``addRows``; one ``addConstr`` per row costs ~13 µs and
O3 problems have 10^5-10^6 rows); binaries via ``addBinaries``, the solve via ``minimize``.

The ILP of the paper linearises ``X_u[a] * X_v[b]`` with ``A >= X_u + X_v - 1``. We use the
tight *marginal* form instead: for every edge (u, v) continuous ``A[a, b] >= 0`` with
``sum_b A[a, b] = X_u[a]`` and ``sum_a A[a, b] = X_v[b]``. Its LP relaxation is the local
marginal polytope, far tighter (exact on trees), so HiGHS solves most instances at the root.
Edge matrices that are separable (``M[a, b] = r[a] + c[b]``, e.g. all-zero) are folded into the
unary costs and get no ``A``. Infinite unary costs fix ``X = 0``; infinite edge entries get no
``A`` column, which forbids the pair through the marginal constraints.

Example:
    >>> import numpy as np
    >>> from rhino.planner.problem import Edge, ShardingProblem
    >>> p = ShardingProblem(
    ...     names=("a", "b"), labels=(("R", "S0"), ("R", "S0")),
    ...     costs=(np.array([4.0, 1.0]), np.array([4.0, 1.0])),
    ...     edges=(Edge(0, 1, np.array([[0.0, 0.0], [3.0, 0.0]])),))
    >>> solve_ilp(p).objective
    2.0
    >>> solve_brute_force(p).choice
    (1, 1)
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Callable, Iterable, Sequence

import numpy as np

from rhino.errors import RhinoError
from rhino.milp import INF, MilpModel, SolverError, SolverStatus, solve_milp
from rhino.planner.problem import Edge, ShardingProblem, Solution

__all__ = [
    "InfeasibleProblemError", "SolverTimeLimitWarning", "Reduced", "solve_brute_force",
    "reduce_exact", "solve_ilp", "solve_small_ilp", "solve_tree_dp", "solve_trw",
    "improve_local",
]

_BRUTE_FORCE_LIMIT = 2_000_000
_OBJ_SCALE = 1e3  # largest |objective coefficient| handed to HiGHS
_TRW_START_NODES = 300  # ILP cores at least this large get a TRW MIP start


class InfeasibleProblemError(RhinoError, ValueError):
    """Every assignment has infinite cost (forbidden choices or pairs leave nothing)."""


class SolverTimeLimitWarning(UserWarning):
    """The ILP hit its time limit; the incumbent (not proven optimal) was returned."""


# ----------------------------------------------------------------------------------------
# A mutable pairwise graph, the working state of the reductions.
# ----------------------------------------------------------------------------------------
class PairwiseGraph:
    """Unary cost vectors plus symmetric adjacency ``adj[i][j]`` = matrix oriented (i, j).

    ``adj[j][i]`` is always the transpose (a view) of ``adj[i][j]``; parallel edges are summed.
    """

    __slots__ = ("costs", "adj")

    def __init__(self, costs: list[np.ndarray], adj: list[dict[int, np.ndarray]]):
        self.costs = costs
        self.adj = adj

    @classmethod
    def from_parts(cls, costs: Sequence[np.ndarray],
                   edges: Iterable[tuple[int, int, np.ndarray]]) -> "PairwiseGraph":
        g = cls([np.asarray(c, dtype=np.float64) for c in costs], [{} for _ in costs])
        for u, v, m in edges:
            g.add_edge(u, v, np.asarray(m, dtype=np.float64))
        return g

    @classmethod
    def from_problem(cls, problem: ShardingProblem) -> "PairwiseGraph":
        return cls.from_parts(problem.costs, ((e.u, e.v, e.cost) for e in problem.edges))

    def add_edge(self, u: int, v: int, m: np.ndarray) -> None:
        old = self.adj[u].get(v)
        if old is not None:
            m = old + m
        self.adj[u][v] = m
        self.adj[v][u] = m.T

    def copy(self) -> "PairwiseGraph":
        return PairwiseGraph(list(self.costs), [dict(a) for a in self.adj])

    def fix(self, v: int, c: int) -> float:
        """Condition node ``v`` on choice ``c``: fold its edges into neighbours, drop it.

        Returns the constant ``costs[v][c]``. The node keeps no edges afterwards.
        """
        for x, m in self.adj[v].items():  # m oriented (v, x)
            self.costs[x] = self.costs[x] + m[c]
            del self.adj[x][v]
        self.adj[v] = {}
        return float(self.costs[v][c])

    def edges(self, nodes: Iterable[int]) -> list[tuple[int, int, np.ndarray]]:
        """Each edge among ``nodes`` once, oriented from the smaller index."""
        out = []
        for i in nodes:
            for j, m in self.adj[i].items():
                if i < j:
                    out.append((i, j, m))
        return out


def reduce_graph(g: PairwiseGraph, alive: list[bool], protected: frozenset[int],
                 max_pair: float, log: list[tuple]) -> float:
    """Apply R0/R1/R2 to a fixed point; mutates ``g``/``alive``, appends to ``log``.

    Returns the constant (sum of R0 minima) removed from the problem.
    """
    offset = 0.0
    stack = [i for i in range(len(alive)) if alive[i] and len(g.adj[i]) <= 2
             and i not in protected]
    adj, costs = g.adj, g.costs
    while stack:
        v = stack.pop()
        if not alive[v] or v in protected:
            continue
        nb = adj[v]
        d = len(nb)
        if d == 0:  # R0
            c = int(np.argmin(costs[v]))
            offset += float(costs[v][c])
            log.append((0, v, c))
        elif d == 1:  # R1: fold min_b(cost_v[b] + M[a, b]) into u
            (u, m), = nb.items()  # m oriented (v, u)
            t = costs[v][:, None] + m
            arg = np.argmin(t, axis=0)
            costs[u] = costs[u] + t[arg, np.arange(t.shape[1])]
            log.append((1, v, u, arg))
            del adj[u][v]
            if u not in protected and len(adj[u]) <= 2:
                stack.append(u)
        elif d == 2:  # R2: replace v by an edge u-w
            (u, m_vu), (w, m_vw) = nb.items()
            nu, nw = m_vu.shape[1], m_vw.shape[1]
            if nu * nw > max_pair:
                continue
            t = m_vu.T[:, :, None] + costs[v][None, :, None] + m_vw[None, :, :]
            arg = np.argmin(t, axis=1)
            e = np.take_along_axis(t, arg[:, None, :], axis=1)[:, 0, :]
            log.append((2, v, u, w, arg))
            del adj[u][v]
            del adj[w][v]
            g.add_edge(u, w, e)
            for x in (u, w):
                if x not in protected and len(adj[x]) <= 2:
                    stack.append(x)
        else:
            continue
        adj[v] = {}
        alive[v] = False
    return offset


def back_substitute(log: Sequence[tuple], choice: np.ndarray) -> np.ndarray:
    """Fill in reduced nodes of ``choice`` (shape ``(n,)`` or ``(n, batch)``), in place."""
    for entry in reversed(log):
        kind, v = entry[0], entry[1]
        if kind == 0:
            choice[v] = entry[2]
        elif kind == 1:
            choice[v] = entry[3][choice[entry[2]]]
        else:
            choice[v] = entry[4][choice[entry[2]], choice[entry[3]]]
    return choice


@dataclasses.dataclass(frozen=True)
class Reduced:
    """Result of ``reduce_exact``: an irreducible core plus the way back.

    Attributes:
        core: the remaining problem, over ``len(core_nodes)`` nodes, with folded unary costs
            and merged edges; ``core.objective(c) + offset`` is the optimum of the full problem
            with the core fixed to ``c``.
        core_nodes: original index of every core node.
        offset: constant removed by R0 (cost of isolated nodes at their argmin).
        num_nodes: node count of the original problem.
    """

    core: ShardingProblem
    core_nodes: tuple[int, ...]
    offset: float
    num_nodes: int
    log: tuple = dataclasses.field(repr=False, default=())

    def expand(self, core_choice: Sequence[int]) -> tuple[int, ...]:
        """Full assignment from a core assignment (back-substitution in reverse order)."""
        if len(core_choice) != len(self.core_nodes):
            raise ValueError(f"core assignment has {len(core_choice)} entries, core has "
                             f"{len(self.core_nodes)} nodes")
        full = np.zeros(self.num_nodes, dtype=np.int64)
        full[list(self.core_nodes)] = np.asarray(core_choice, dtype=np.int64)
        return tuple(int(c) for c in back_substitute(self.log, full))


def reduce_exact(problem: ShardingProblem, *, max_pair: int = 4096,
                 protected: Iterable[int] = ()) -> Reduced:
    """Exact PBQP reductions R0/R1/R2, repeated to a fixed point.

    R0 removes an isolated node at its argmin; R1 folds a degree-1 node into its neighbour's
    unary cost; R2 replaces a degree-2 node v (neighbours u, w) by an edge with
    ``E'[a, c] = min_b(E_uv[a, b] + cost_v[b] + E_vw[b, c])``, only when
    ``n_u * n_w <= max_pair``. Parallel edges are merged first. Runs in time linear in the
    number of reductions (a worklist of nodes of degree <= 2).

    Args:
        problem: the problem to reduce.
        max_pair: largest ``n_u * n_w`` for which R2 may create/merge an edge.
        protected: node indices never eliminated (they stay in the core).

    Returns:
        A ``Reduced`` with the core problem and ``expand`` for back-substitution.

    Example:
        >>> import numpy as np
        >>> from rhino.planner.problem import Edge, ShardingProblem
        >>> z = np.zeros((2, 2)); d = np.array([[0.0, 1.0], [1.0, 0.0]])
        >>> p = ShardingProblem(("a", "b", "c"), (("x", "y"),) * 3,
        ...     (np.array([0.0, 5.0]), np.array([3.0, 0.0]), np.array([0.0, 0.0])),
        ...     (Edge(0, 1, d), Edge(1, 2, d), Edge(0, 2, z)))
        >>> r = reduce_exact(p)
        >>> r.core.num_nodes, r.offset, r.expand(())
        (0, 1.0, (0, 1, 1))
    """
    g = PairwiseGraph.from_problem(problem)
    alive = [True] * problem.num_nodes
    log: list[tuple] = []
    offset = reduce_graph(g, alive, frozenset(protected), max_pair, log)
    core_nodes = [i for i in range(problem.num_nodes) if alive[i]]
    local = {i: k for k, i in enumerate(core_nodes)}
    core = ShardingProblem(
        names=tuple(problem.names[i] for i in core_nodes),
        labels=tuple(problem.labels[i] for i in core_nodes),
        costs=tuple(g.costs[i] for i in core_nodes),
        edges=tuple(Edge(local[i], local[j], np.ascontiguousarray(m))
                    for i, j, m in g.edges(core_nodes)))
    return Reduced(core, tuple(core_nodes), offset, problem.num_nodes, tuple(log))


def _finish(problem: ShardingProblem, choice: Sequence[int], status: SolverStatus, t0: float,
            bound: float | None) -> Solution:
    choice = tuple(int(c) for c in choice)
    obj = problem.objective(choice)
    if not np.isfinite(obj):
        raise InfeasibleProblemError(
            f"no assignment of finite cost exists ({problem.num_nodes} nodes); the best found "
            f"costs {obj}")
    if status is SolverStatus.OPTIMAL:
        bound = obj if bound is None else min(bound, obj)
    return Solution(choice, obj, status, time.perf_counter() - t0, bound)


def solve_brute_force(problem: ShardingProblem) -> Solution:
    """Enumerate every assignment (vectorised); exact, for tiny problems and tests.

    Raises:
        ValueError: more than 2e6 assignments.
        InfeasibleProblemError: every assignment costs infinity.
    """
    t0 = time.perf_counter()
    sizes = [problem.num_choices(i) for i in range(problem.num_nodes)]
    total = int(np.prod(sizes, dtype=np.float64)) if sizes else 1
    if total > _BRUTE_FORCE_LIMIT:
        raise ValueError(f"brute force needs {total} assignments, limit is "
                         f"{_BRUTE_FORCE_LIMIT}")
    n = problem.num_nodes
    acc = np.zeros(sizes if sizes else (), dtype=np.float64)

    def along(arr: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        shape = [1] * n
        for ax, s in zip(axes, arr.shape):
            shape[ax] = s
        return arr.reshape(shape)

    for i, c in enumerate(problem.costs):
        acc = acc + along(np.asarray(c, dtype=np.float64), (i,))
    for e in problem.edges:
        m = e.cost if e.u < e.v else e.cost.T
        acc = acc + along(np.asarray(m, dtype=np.float64), (min(e.u, e.v), max(e.u, e.v)))
    flat = int(np.argmin(acc)) if n else 0
    choice = np.unravel_index(flat, sizes) if n else ()
    return _finish(problem, [int(c) for c in choice], SolverStatus.OPTIMAL, t0, None)


def solve_tree_dp(problem: ShardingProblem) -> Solution:
    """Exact DP (leaf elimination, i.e. R0/R1 only) for a problem whose graph is a forest.

    Raises:
        ValueError: the undirected graph (parallel edges merged) has a cycle.
    """
    t0 = time.perf_counter()
    parent = list(range(problem.num_nodes))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for u, v in {(min(e.u, e.v), max(e.u, e.v)) for e in problem.edges}:
        ru, rv = find(u), find(v)
        if ru == rv:
            raise ValueError(f"solve_tree_dp needs a forest; edge {problem.names[u]!r}-"
                             f"{problem.names[v]!r} closes a cycle")
        parent[ru] = rv
    red = reduce_exact(problem, max_pair=0)
    assert red.core.num_nodes == 0, "leaf elimination must empty a forest"
    return _finish(problem, red.expand(()), SolverStatus.OPTIMAL, t0, None)


def improve_local(problem: ShardingProblem, choice: Sequence[int], *,
                  max_sweeps: int = 10, deadline: float | None = None) -> tuple[int, ...]:
    """Iterated conditional modes: move each node to its best choice given its neighbours.

    Never increases ``problem.objective``. Stops after ``max_sweeps`` sweeps, when a sweep
    changes nothing, or at ``deadline`` (a ``time.perf_counter()`` value).
    """
    cur = [int(c) for c in choice]
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(problem.num_nodes)]
    for e in problem.edges:
        nbrs[e.u].append((e.v, e.cost))
        nbrs[e.v].append((e.u, e.cost.T))
    order = [i for i in range(problem.num_nodes) if problem.num_choices(i) > 1]
    for _ in range(max_sweeps):
        changed = False
        for i in order:
            vec = problem.costs[i]
            for j, m in nbrs[i]:
                vec = vec + m[:, cur[j]]
            b = int(np.argmin(vec))
            old = vec[cur[i]]
            if vec[b] < old and (not np.isfinite(old) or old - vec[b] > 1e-12 * abs(old)):
                cur[i] = b
                changed = True
        if not changed or (deadline is not None and time.perf_counter() > deadline):
            break
    return tuple(cur)


def solve_trw(problem: ShardingProblem, *, rho: float | None = 0.7, max_iters: int = 300,
              patience: int = 60, damping: float = 0.5,
              time_limit: float | None = None) -> Solution:
    """Tree-reweighted min-sum message passing (parallel TRW, damped), then ICM. Heuristic.

    Every edge's messages are updated at once, vectorised over edges of equal matrix shape:
    ``m_uv(b) = min_a [E(a, b) / rho + belief_u(a) - m_vu(a)]`` with
    ``belief_u = cost_u + rho * sum of incoming messages``. ``rho`` is the edge appearance
    probability; ``None`` takes that of a spanning tree, ``(n - 1) / |E|``, and ``rho=1`` is
    plain min-sum belief propagation. The default 0.7 reached the ILP optimum on every GPT
    step core we measured (``rhino.planner.build``, 1-D mesh of 8 at 2/12/36 layers, 2x4 mesh
    at 2 layers), where the spanning-tree density (~0.53) was 1-4% worse and BP 2-5% worse.
    The belief argmin is decoded every 10 iterations and the best assignment (true
    objective) is kept; the run stops after ``patience`` iterations without improvement,
    ``max_iters``, or ``time_limit`` seconds. Infinite costs are replaced by a large finite
    penalty inside the messages only.

    Returns:
        ``Solution`` with status ``"heuristic"`` and no bound.

    Raises:
        InfeasibleProblemError: the best assignment found has infinite cost.
    """
    t0 = time.perf_counter()
    n = problem.num_nodes
    merged = _merged_edges(problem)
    if n == 0 or not merged:
        return _finish(problem, [int(np.argmin(c)) for c in problem.costs],
                       SolverStatus.HEURISTIC, t0, None)
    sizes = np.array([problem.num_choices(i) for i in range(n)])
    nmax = int(sizes.max())
    finite = [np.abs(c[np.isfinite(c)]).max(initial=0.0) for c in problem.costs]
    finite += [np.abs(m[np.isfinite(m)]).max(initial=0.0) for m in merged.values()]
    big = 1e3 * (float(max(finite)) + 1e-30) * min(n + len(merged), 1e3)
    f32 = np.float32  # messages in single precision: half the memory traffic
    unary = np.full((n, nmax), big, dtype=f32)
    for i, c in enumerate(problem.costs):
        unary[i, :len(c)] = np.minimum(c, big)
    by_shape: dict[tuple[int, int], list[tuple[int, int, np.ndarray]]] = {}
    for (u, v), m in merged.items():
        by_shape.setdefault(m.shape, []).append((u, v, m))
    if rho is None:
        rho = min(1.0, (n - 1) / len(merged))
    groups = []  # [U, V, M / rho, m_uv, m_vu, scratch]
    targets = []  # flat belief index of every message entry, in the order of ``beliefs()``
    for (nu, nv), lst in by_shape.items():
        us, vs = np.array([u for u, _, _ in lst]), np.array([v for _, v, _ in lst])
        m = (np.minimum(np.stack([m for _, _, m in lst]), big) / rho).astype(f32)
        groups.append([us, vs, m, np.zeros((len(lst), nv), f32),
                       np.zeros((len(lst), nu), f32), np.empty_like(m)])
        targets += [(vs[:, None] * nmax + np.arange(nv)).ravel(),
                    (us[:, None] * nmax + np.arange(nu)).ravel()]
    target = np.concatenate(targets)

    def beliefs() -> np.ndarray:
        flat = np.concatenate([x for g in groups for x in (g[3].ravel(), g[4].ravel())])
        return unary + f32(rho) * np.bincount(target, flat, n * nmax).reshape(n, nmax)

    best = [int(np.argmin(c)) for c in problem.costs]
    best_obj, since = problem.objective(best), 0
    for it in range(max_iters + 1):
        bel = beliefs().astype(f32)
        if it % 10 == 0:
            x = [int(c) for c in np.argmin(bel, axis=1)]
            obj = problem.objective(x)
            if obj < best_obj:
                best, best_obj, since = x, obj, 0
            else:
                since += 10
            if since >= patience or (time_limit is not None
                                     and time.perf_counter() - t0 > time_limit):
                break
        if it == max_iters:
            break
        for g in groups:
            us, vs, m, muv, mvu, tmp = g
            hu = bel[us, :m.shape[1]] - mvu
            hv = bel[vs, :m.shape[2]] - muv
            new_uv = np.add(hu[:, :, None], m, out=tmp).min(axis=1)
            new_vu = np.add(m, hv[:, None, :], out=tmp).min(axis=2)
            new_uv -= new_uv.min(axis=1, keepdims=True)
            new_vu -= new_vu.min(axis=1, keepdims=True)
            muv *= damping
            muv += (1.0 - damping) * new_uv
            mvu *= damping
            mvu += (1.0 - damping) * new_vu
    return _finish(problem, improve_local(problem, best), SolverStatus.HEURISTIC, t0, None)


def _start_choice(problem: ShardingProblem, time_limit: float, trw: bool = True
                  ) -> tuple[int, ...]:
    """MIP start: ICM from the unary argmins; on larger problems TRW if it does better
    (unless ``trw`` is False)."""
    start = improve_local(problem, [int(np.argmin(c)) for c in problem.costs], max_sweeps=5)
    if trw and problem.num_nodes >= _TRW_START_NODES:
        try:
            trw = solve_trw(problem, time_limit=0.1 * time_limit).choice
        except InfeasibleProblemError:
            return start
        start = min((start, trw), key=problem.objective)
    return start


def _merged_edges(problem: ShardingProblem) -> dict[tuple[int, int], np.ndarray]:
    merged: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        key, m = ((e.u, e.v), e.cost) if e.u < e.v else ((e.v, e.u), e.cost.T)
        m = np.asarray(m, dtype=np.float64)
        merged[key] = merged[key] + m if key in merged else m
    return merged


def _separable(m: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(r, c)`` with ``m == r[:, None] + c[None, :]`` (all finite), else None."""
    if not np.all(np.isfinite(m)):
        return None
    r = m[:, 0].copy()
    c = m[0, :] - m[0, 0]
    scale = float(np.max(np.abs(m))) if m.size else 0.0
    if np.allclose(m, r[:, None] + c[None, :], rtol=0.0, atol=1e-12 * max(scale, 1e-300)):
        return r, c
    return None


def _milp(problem: ShardingProblem, time_limit: float, mip_rel_gap: float,
          trw_start: bool = True, relax_iterations: int | None = None
          ) -> tuple[tuple[int, ...] | None, SolverStatus, float | None,
                     tuple[int, ...] | None]:
    """Solve the marginal-form MILP with HiGHS (``rhino.milp``); ``trw_start``: see
    ``_start_choice``. With ``relax_iterations`` only its LP relaxation is solved, within
    that many simplex iterations (a limit that, unlike time, gives the same answer on a
    busy machine; HiGHS does not apply it inside a MIP solve): its optimum is the MILP's
    when it is integral, which the tight marginal form often is; else the status is
    ``TIME_LIMIT`` and no choice is returned.

    Returns ``(choice or None, OPTIMAL | TIME_LIMIT, bound or None, heuristic start)``.
    """
    t0 = time.perf_counter()
    n = problem.num_nodes
    costs = [np.array(c, dtype=np.float64) for c in problem.costs]
    allowed = [np.isfinite(c) for c in costs]
    for i, ok in enumerate(allowed):
        if not ok.any():
            raise InfeasibleProblemError(f"node {problem.names[i]!r}: every choice has "
                                         f"infinite cost")
    pair_edges = []  # (u, v, matrix, allowed-pairs mask)
    for (u, v), m in _merged_edges(problem).items():
        au, av = allowed[u], allowed[v]
        sub = m[np.ix_(au, av)]
        sep = _separable(sub)
        if sep is not None:
            costs[u][au] += sep[0]
            costs[v][av] += sep[1]
        else:
            pair_edges.append((u, v, m, np.isfinite(m) & au[:, None] & av[None, :]))
    # columns: X (all node choices), then A (allowed pairs of non-separable edges)
    x_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(c) for c in costs], out=x_off[1:])
    nx = int(x_off[-1])
    x_obj = np.concatenate([np.where(ok, c, 0.0) for c, ok in zip(costs, allowed)])
    x_ub = np.concatenate([ok.astype(np.float64) for ok in allowed])
    a_obj, rows_i, rows_j, rows_v = [], [], [], []
    row = n
    col = nx
    # one-hot rows: sum_a X_i[a] = 1
    rows_i.append(np.repeat(np.arange(n), np.diff(x_off)))
    rows_j.append(np.arange(nx))
    rows_v.append(np.ones(nx))
    for u, v, m, ok in pair_edges:
        a_idx, b_idx = np.nonzero(ok)
        k = len(a_idx)
        cols = col + np.arange(k)
        a_obj.append(m[a_idx, b_idx])
        nu, nv = m.shape
        # sum_b A[a, b] - X_u[a] = 0  (rows row..row+nu-1)
        rows_i += [row + a_idx, row + np.arange(nu)]
        rows_j += [cols, x_off[u] + np.arange(nu)]
        rows_v += [np.ones(k), -np.ones(nu)]
        row += nu
        # sum_a A[a, b] - X_v[b] = 0
        rows_i += [row + b_idx, row + np.arange(nv)]
        rows_j += [cols, x_off[v] + np.arange(nv)]
        rows_v += [np.ones(k), -np.ones(nv)]
        row += nv
        col += k
    na = col - nx
    a_obj_arr = np.concatenate(a_obj) if a_obj else np.zeros(0)
    all_obj = np.concatenate([x_obj, a_obj_arr])
    scale = float(np.max(np.abs(all_obj))) if all_obj.size else 0.0
    scale = scale / _OBJ_SCALE if scale > 0 else 1.0

    ri, rj, rv = (np.concatenate(rows_i), np.concatenate(rows_j), np.concatenate(rows_v))
    order = np.lexsort((rj, ri))
    ri, rj, rv = ri[order], rj[order], rv[order]
    rhs = np.concatenate([np.ones(n), np.zeros(row - n)])
    relax = relax_iterations is not None
    start = None if relax else _start_choice(problem, time_limit, trw_start)
    warm = None
    if start is None:
        pass
    elif np.isfinite(problem.objective(start)):
        idx = np.array([x_off[i] + c for i, c in enumerate(start)], dtype=np.int32)
        warm = (idx, np.ones(len(idx)))
    else:
        start = None
    model = MilpModel(
        costs=all_obj / scale,
        lower=np.zeros(nx + na), upper=np.concatenate([x_ub, np.full(na, INF)]),
        integer=(np.arange(nx + na) < nx) & (not relax), row_lower=rhs, row_upper=rhs,
        row_starts=np.searchsorted(ri, np.arange(row)), row_index=rj, row_value=rv,
        start=None if relax else warm,
        time_limit=max(float(time_limit) - (time.perf_counter() - t0), 1e-3),
        mip_rel_gap=mip_rel_gap, iteration_limit=relax_iterations)
    res = solve_milp(model)
    if relax and res.x is not None and (res.status is not SolverStatus.OPTIMAL or np.any(
            np.minimum(res.x[:nx], 1.0 - res.x[:nx]) > 1e-6)):
        return None, SolverStatus.TIME_LIMIT, None, start   # cut short, or fractional
    if res.status is SolverStatus.INFEASIBLE:
        raise InfeasibleProblemError(f"the ILP over {n} nodes is infeasible: forbidden choices "
                                     f"and pairs leave no assignment")
    choice = None
    if res.x is not None:
        xv = res.x[:nx]
        choice = tuple(int(np.argmax(np.where(allowed[i], xv[x_off[i]:x_off[i + 1]], -1.0)))
                       for i in range(n))
    bound = res.bound * scale if res.bound is not None else None
    if res.status is SolverStatus.OPTIMAL and choice is None:
        raise SolverError(f"HiGHS reported optimal without a solution on a {n}-node problem "
                          f"({model.describe()})")
    return choice, res.status, bound, start


def solve_small_ilp(problem: ShardingProblem, *, max_entries: int, time_limit: float,
                    iterations: Callable[[int], int] | None = None,
                    mip_rel_gap: float = 1e-4) -> Solution | None:
    """``solve_ilp`` where it is quick: the optimum if the core left by ``reduce_exact``
    has at most ``max_entries`` edge-matrix entries (the pair columns of the MILP) and
    HiGHS proves it within ``time_limit`` seconds; else None (nothing is returned from a
    solve cut short). With ``iterations``, only the LP relaxation is solved, within
    ``iterations(entries)`` simplex iterations, and its optimum kept where it is integral
    (often: the marginal form is tight). The MIP start is ICM alone: on cores this small
    TRW's start did not make HiGHS faster, and cost 8% of the solve on a 4-layer GPT step.

    O2 calls it first (its step 0) with at most 60k entries and 1000 + 0.3 iterations per
    entry (a count, unlike seconds, gives the same plan on a busy machine). The relaxation
    is integral for the zoo's GPT, MoE, VGG and MLP steps on (8) and a 4-layer GPT (hidden
    512), solved in 0.16-0.27 iterations per entry and 0.3-1.3 s, against 0.9-1.5 s for
    O2's heuristic and 0.8-1.5 s for O3 (1.4% better than the heuristic on that GPT).
    Where it is fractional (Wide-ResNet, UNet, DNABERT on (8)) or cut short, the heuristic
    runs after 0.3-1.2 s.

    Example:
        >>> from rhino.planner.problem import Edge, ShardingProblem
        >>> p = ShardingProblem(("a", "b"), (("R", "S"),) * 2,
        ...                     (np.array([4.0, 1.0]), np.array([4.0, 1.0])),
        ...                     (Edge(0, 1, np.array([[0.0, 0.0], [3.0, 0.0]])),))
        >>> solve_small_ilp(p, max_entries=100, time_limit=10).objective
        2.0
    """
    t0 = time.perf_counter()
    red = reduce_exact(problem)
    core = red.core
    entries = sum(e.cost.size for e in core.edges)
    if entries > max_entries:
        return None
    if core.num_nodes == 0:
        return _finish(problem, red.expand(()), SolverStatus.OPTIMAL, t0, None)
    left = time_limit - (time.perf_counter() - t0)
    if left <= 0:
        return None
    choice, status, bound, _ = _milp(core, left, mip_rel_gap, trw_start=False,
                                     relax_iterations=None if iterations is None
                                     else max(1, int(iterations(entries))))
    if status is not SolverStatus.OPTIMAL or choice is None:
        return None
    return _finish(problem, red.expand(choice), status, t0,
                   None if bound is None else bound + red.offset)


def solve_ilp(problem: ShardingProblem, *, time_limit: float = 60.0,
              mip_rel_gap: float = 1e-4, reduce: bool = True) -> Solution:
    """Whole-graph ILP of §4.2 (tight marginal form) with highspy, after exact reductions.

    Args:
        problem: the problem.
        time_limit: seconds for HiGHS.
        mip_rel_gap: relative MIP gap at which HiGHS stops.
        reduce: apply ``reduce_exact`` first and solve only the core.

    Returns:
        ``Solution`` with status ``"optimal"``, or ``"time_limit"`` (incumbent, with a
        ``SolverTimeLimitWarning`` stating the gap).

    Raises:
        InfeasibleProblemError: no finite-cost assignment exists.
        SolverError: the time limit passed before any incumbent was found.
    """
    t0 = time.perf_counter()
    if reduce:
        red = reduce_exact(problem)
        core, offset = red.core, red.offset
    else:
        red, core, offset = None, problem, 0.0
    if core.num_nodes == 0:
        return _finish(problem, red.expand(()) if red else (), SolverStatus.OPTIMAL, t0,
                       None)
    remaining = time_limit - (time.perf_counter() - t0)
    choice, status, bound, start = _milp(core, remaining, mip_rel_gap)
    if status is SolverStatus.TIME_LIMIT:
        cands = [c for c in (choice, start) if c is not None]
        if not cands:
            raise SolverError(
                f"ILP time limit ({time_limit:.3g} s) reached before any feasible assignment "
                f"was found ({core.num_nodes} core nodes of {problem.num_nodes}); raise "
                f"time_limit or use the hierarchical solver")
        choice = min(cands, key=core.objective)
    assert choice is not None
    full = red.expand(choice) if red is not None else choice
    bound = None if bound is None else bound + offset
    sol = _finish(problem, full, status, t0, bound)
    if status is SolverStatus.TIME_LIMIT:
        gap = (f"{(sol.objective - bound) / max(abs(sol.objective), 1e-300):.2%}"
               if bound is not None else "unknown")
        warnings.warn(SolverTimeLimitWarning(
            f"ILP hit its {time_limit:.3g} s time limit on {core.num_nodes} core nodes "
            f"(of {problem.num_nodes}); returning the incumbent with objective "
            f"{sol.objective:.6g}, lower bound {bound}, gap {gap}"), stacklevel=2)
    return sol

