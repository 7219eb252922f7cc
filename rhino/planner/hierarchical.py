"""O2: Rhino's three-level subgraph merging (paper §4.3.2), and O3 (the whole-graph ILP).

Levels::

    nodes ──(1) cone DP──► cone super-nodes ──(2)+(3) segment tables + chain DP──► root choices
                                                    │ skip edges: unary passes, then ICM
    root choices ──► members' choices (level-1 tables) ──► node ICM ──► Solution

Level 1 (cones). For every cone and every choice of its root, the members' choices minimise
unary + in-cone edge costs. The caller guarantees that once the root is fixed the in-cone
edges form a forest, so R1/R2 reductions with the root protected fold every member into the
root exactly (``solvers._reduce``), and back-substitution, vectorised over all root choices,
yields a table ``member choice = table[root choice]``. The cones become the nodes of a
*super-problem* whose edges are the cross-cone edges evaluated at those tables; its objective
equals the original objective of the expanded assignment exactly. (A cone that violates the
property falls back to one exact ILP per root choice, with a warning.)

Levels 2 and 3 (segments, chain). Each cone belongs to the segment of its root; pivots
(critical nodes) cut the chain: segment ``k`` lies between ``pivots[k-1]`` and ``pivots[k]``.
For every segment we need the table ``T_k[a, b]`` = best cost of its cones given the left
pivot's choice ``a`` and the right pivot's choice ``b``. Instead of an ILP per ``(a, b)`` we
reduce the segment with both pivots protected: segments are nearly series-parallel, so R1/R2
collapse them to one ``a x b`` matrix. An irreducible core is conditioned on its
highest-degree node (pivots included) and reduced again, recursively, within a budget; past
it, ``T_k`` falls back to one ILP (``solve_ilp``, level 2) per pair. Once the chain DP over
pivot choices has picked ``(a, b)`` for a segment, its cones are decoded by reductions with the
pivots fixed, plus ``solve_ilp`` on any core. Tables and decodings are memoised by a hash of
the segment's re-indexed cost data, since transformer layers repeat.

Skip edges (documented approximation). A cross-cone edge whose endpoints are not in one
segment (or a segment and its two pivots) — a weight used in forward layer k and backward
layer k, an activation saved for backward — does not fit the chain. Pass 0 ignores them in
the DP (they are still counted in the objective). Each further pass turns every skip edge
into unary costs on both endpoints, evaluated at the other endpoint's choice in the current
best assignment, and re-runs the chain DP; a pass is kept only if it lowers the true
objective, and passes stop at the first one that does not. Then iterated conditional modes
(ICM) over cone super-nodes and finally over single nodes run; ICM only ever lowers the true
objective. The returned ``Solution.objective`` is always ``problem.objective(choice)`` and its
status is ``"heuristic"``.

Example:
    >>> import numpy as np
    >>> from rhino.planner.problem import Edge, ShardingProblem
    >>> d = np.array([[0.0, 1.0], [1.0, 0.0]])
    >>> p = ShardingProblem(("a", "b", "c"), (("R", "S"),) * 3,
    ...     (np.array([0.0, 2.0]), np.array([1.0, 0.0]), np.array([1.0, 0.0])),
    ...     (Edge(0, 1, d), Edge(1, 2, d)))
    >>> part = Partition(cone_of=(0, 1, 2), segment_of=(0, -1, 1), pivots=(1,))
    >>> solve_o2(p, part).objective == solve_o3(p).objective == 1.0
    True
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import warnings
from typing import Sequence

import numpy as np

from rhino.planner.problem import Edge, ShardingProblem, Solution
from rhino.planner.solvers import (
    InfeasibleProblemError, _back_substitute, _Graph, _reduce, improve_local, reduce_exact,
    solve_ilp)

__all__ = ["Partition", "solve_o2", "solve_o3"]

_SEGMENT_MAX_PAIR = 1 << 16   # R2 limit inside cones and segments (super-node pairs)
_CONDITION_BUDGET = 2000      # recursion nodes of the conditioning fallback per table
_MAX_PASSES = 4               # skip-edge passes after pass 0
_MAX_ROUNDS = 8               # steered level-1 rounds


@dataclasses.dataclass(frozen=True)
class Partition:
    """Cones, segments and pivots of a problem (built by the planner from an HloGraph).

    Attributes:
        cone_of: per node, the node index of its cone's root (a root maps to itself).
        segment_of: per node, segment index >= 0, or -1 for pivots (critical nodes).
        pivots: pivot (critical node) indices in chain order; segment k lies between
            ``pivots[k-1]`` and ``pivots[k]`` (segment 0 before the first, segment
            ``len(pivots)`` after the last).
    """

    cone_of: tuple[int, ...]
    segment_of: tuple[int, ...]
    pivots: tuple[int, ...]

    def check(self, problem: ShardingProblem) -> None:
        """Raise ValueError unless the partition is well formed for ``problem``."""
        n = problem.num_nodes
        if len(self.cone_of) != n or len(self.segment_of) != n:
            raise ValueError(f"partition has {len(self.cone_of)} cone_of and "
                             f"{len(self.segment_of)} segment_of entries, problem has {n} nodes")
        k = len(self.pivots)
        if len(set(self.pivots)) != k:
            raise ValueError(f"pivots repeat: {self.pivots}")
        for i, r in enumerate(self.cone_of):
            if not 0 <= r < n or self.cone_of[r] != r:
                raise ValueError(f"node {problem.names[i]!r}: cone root {r} is not a root "
                                 f"(cone_of[root] must equal root)")
        pivot_set = set(self.pivots)
        for p in self.pivots:
            if self.cone_of[p] != p or self.segment_of[p] != -1:
                raise ValueError(f"pivot {problem.names[p]!r} must be a cone root with "
                                 f"segment -1; got cone {self.cone_of[p]}, segment "
                                 f"{self.segment_of[p]}")
        for r in set(self.cone_of) - pivot_set:
            if not 0 <= self.segment_of[r] <= k:
                raise ValueError(f"cone root {problem.names[r]!r}: segment {self.segment_of[r]}"
                                 f" is outside 0..{k} ({k} pivots)")


def solve_o3(problem: ShardingProblem, *, time_limit: float = 600.0,
             mip_rel_gap: float = 1e-4) -> Solution:
    """O3: the whole-graph ILP (``solve_ilp`` with exact reductions)."""
    return solve_ilp(problem, time_limit=time_limit, mip_rel_gap=mip_rel_gap, reduce=True)


# ----------------------------------------------------------------------------------------
# Level 1: cones
# ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Cones:
    roots: list[int]              # cone k -> root node
    cone: np.ndarray              # node -> cone index
    table: list[np.ndarray]       # node -> its choice per choice of its cone's root
    cost: list[np.ndarray]        # cone -> cost per root choice (unary + in-cone edges)


def _solve_cones(problem: ShardingProblem, cone_of: Sequence[int], time_limit: float,
                 mip_rel_gap: float, guide: np.ndarray | None = None) -> _Cones:
    """Level 1. ``guide`` (a full assignment) adds, to every member, its cross-cone edges
    evaluated at the guide's choices of the other endpoints; this only steers which member
    choices the tables keep: the cone costs are always recomputed exactly (unary + in-cone).
    """
    roots = sorted(set(cone_of))
    cidx = {r: k for k, r in enumerate(roots)}
    cone = np.array([cidx[r] for r in cone_of], dtype=np.int64)
    members: list[list[int]] = [[r] for r in roots]
    for i, r in enumerate(cone_of):
        if i != r:
            members[cidx[r]].append(i)
    inner: list[list[Edge]] = [[] for _ in roots]
    steer: dict[int, np.ndarray] = {}
    for e in problem.edges:
        if cone[e.u] == cone[e.v]:
            inner[cone[e.u]].append(e)
        elif guide is not None:
            if cone_of[e.u] != e.u:
                add = e.cost[:, guide[e.v]]
                steer[e.u] = steer[e.u] + add if e.u in steer else add
            if cone_of[e.v] != e.v:
                add = e.cost[guide[e.u], :]
                steer[e.v] = steer[e.v] + add if e.v in steer else add
    table: list[np.ndarray] = [np.zeros(0, np.int64)] * problem.num_nodes
    cost: list[np.ndarray] = []
    for k, mem in enumerate(members):
        nr = problem.num_choices(mem[0])
        if len(mem) == 1 and not inner[k]:
            table[mem[0]] = np.arange(nr)
            cost.append(np.asarray(problem.costs[mem[0]], dtype=np.float64))
            continue
        loc = {node: j for j, node in enumerate(mem)}
        edges = [(loc[e.u], loc[e.v], e.cost) for e in inner[k]]
        unary = [problem.costs[i] + steer[i] if i in steer else problem.costs[i] for i in mem]
        g = _Graph.from_parts(unary, edges)
        alive = [True] * len(mem)
        log: list[tuple] = []
        _reduce(g, alive, frozenset({0}), _SEGMENT_MAX_PAIR, log)
        if sum(alive) == 1:
            ch = np.zeros((len(mem), nr), dtype=np.int64)
            ch[0] = np.arange(nr)
            _back_substitute(log, ch)
        else:
            ch = _cone_by_ilp(problem, mem, inner[k], unary, time_limit, mip_rel_gap)
        c = np.zeros(nr)
        for j, node in enumerate(mem):
            table[node] = ch[j]
            c = c + np.asarray(problem.costs[node], dtype=np.float64)[ch[j]]
        for e in inner[k]:
            c = c + e.cost[ch[loc[e.u]], ch[loc[e.v]]]
        cost.append(c)
    return _Cones(roots, cone, table, cost)


def _cone_by_ilp(problem: ShardingProblem, mem: list[int], inner: list[Edge],
                 unary: list[np.ndarray], time_limit: float, mip_rel_gap: float) -> np.ndarray:
    """Fallback for a cone that is not a forest once its root is fixed: one ILP per choice."""
    warnings.warn(f"cone rooted at {problem.names[mem[0]]!r} ({len(mem)} nodes) is not a "
                  f"forest once its root is fixed; solving it by one ILP per root choice",
                  RuntimeWarning, stacklevel=3)
    loc = {node: j for j, node in enumerate(mem)}
    nr = problem.num_choices(mem[0])
    ch = np.zeros((len(mem), nr), dtype=np.int64)
    for r in range(nr):
        if not np.isfinite(unary[0][r]):
            continue
        fixed = np.full(nr, np.inf)
        fixed[r] = unary[0][r]
        sub = ShardingProblem(
            tuple(problem.names[i] for i in mem), tuple(problem.labels[i] for i in mem),
            (fixed,) + tuple(unary[1:]), tuple(Edge(loc[e.u], loc[e.v], e.cost) for e in inner))
        try:
            ch[:, r] = solve_ilp(sub, time_limit=time_limit, mip_rel_gap=mip_rel_gap).choice
        except InfeasibleProblemError:
            ch[0, r] = r  # cost stays infinite: the root choice is effectively forbidden
    return ch


def _super_problem(problem: ShardingProblem, cones: _Cones) -> ShardingProblem:
    """Cones as nodes; cross-cone edges evaluated at the members' tables."""
    acc: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        cu, cv = int(cones.cone[e.u]), int(cones.cone[e.v])
        if cu == cv:
            continue
        m = e.cost[np.ix_(cones.table[e.u], cones.table[e.v])]
        key = (cu, cv) if cu < cv else (cv, cu)
        if cu > cv:
            m = m.T
        acc[key] = acc[key] + m if key in acc else m
    return ShardingProblem(
        names=tuple(problem.names[r] for r in cones.roots),
        labels=tuple(problem.labels[r] for r in cones.roots),
        costs=tuple(cones.cost),
        edges=tuple(Edge(u, v, m) for (u, v), m in sorted(acc.items())))


# ----------------------------------------------------------------------------------------
# Levels 2 + 3: segment tables and the chain DP
# ----------------------------------------------------------------------------------------
class _Budget(Exception):
    pass


def _pivot_table(g: _Graph, piv: tuple[int, ...], off: float) -> np.ndarray:
    if not piv:
        return np.array(off)
    if len(piv) == 1:
        return g.costs[piv[0]] + off
    p, q = piv
    t = g.costs[p][:, None] + g.costs[q][None, :] + off
    m = g.adj[p].get(q)
    return t if m is None else t + m


def _table(g: _Graph, alive: list[bool], piv: tuple[int, ...], off: float,
           budget: list[int]) -> np.ndarray:
    """Exact min-cost table over the protected pivots ``piv`` (reductions + conditioning)."""
    off += _reduce(g, alive, frozenset(piv), _SEGMENT_MAX_PAIR, [])
    core = [i for i, a in enumerate(alive) if a and i not in piv]
    if not core:
        return _pivot_table(g, piv, off)
    budget[0] -= 1
    if budget[0] < 0:
        raise _Budget
    z = max(core + list(piv), key=lambda i: (len(g.adj[i]), -len(g.costs[i])))
    rest = tuple(p for p in piv if p != z)
    results = []
    for cz in range(len(g.costs[z])):
        g2, alive2 = g.copy(), list(alive)
        c0 = g2.fix(z, cz)
        alive2[z] = False
        results.append(_table(g2, alive2, rest, off + c0, budget))
    if z in piv:
        return np.stack(results, axis=piv.index(z))
    return np.minimum.reduce(results)


@dataclasses.dataclass(frozen=True)
class _Segment:
    """A segment re-indexed locally: pivots first (left, right, where present), then cones."""

    nodes: tuple[int, ...]            # super-problem indices of the local nodes
    npiv: int
    costs: tuple[np.ndarray, ...]     # pivots' unary costs zeroed (the chain DP adds them)
    edges: tuple[tuple[int, int, np.ndarray], ...]
    key: bytes


def _make_segment(nodes: list[int], npiv: int, costs: list[np.ndarray],
                  edges: list[tuple[int, int, np.ndarray]]) -> _Segment:
    h = hashlib.blake2b(digest_size=20)
    h.update(np.array([len(nodes), npiv], np.int64).tobytes())
    for c in costs:
        h.update(np.int64(len(c)).tobytes())
        h.update(np.ascontiguousarray(c, dtype=np.float64).tobytes())
    edges = sorted(edges, key=lambda t: (t[0], t[1]))
    for i, j, m in edges:
        h.update(np.array([i, j, *m.shape], np.int64).tobytes())
        h.update(np.ascontiguousarray(m, dtype=np.float64).tobytes())
    return _Segment(tuple(nodes), npiv, tuple(costs), tuple(edges), h.digest())


class _SegmentSolver:
    """Tables and decodings of segments, memoised by the segment's cost-data hash."""

    def __init__(self, time_limit: float, mip_rel_gap: float, deadline: float):
        self.time_limit, self.mip_rel_gap, self.deadline = time_limit, mip_rel_gap, deadline
        self.tables: dict[bytes, np.ndarray] = {}
        self.decoded: dict[tuple[bytes, tuple[int, ...]], tuple[float, np.ndarray]] = {}
        self.stats = {"tables": 0, "table_hits": 0, "ilp_tables": 0, "decodes": 0}

    def table(self, seg: _Segment) -> np.ndarray:
        if seg.key in self.tables:
            self.stats["table_hits"] += 1
            return self.tables[seg.key]
        self.stats["tables"] += 1
        g = _Graph.from_parts(seg.costs, seg.edges)
        piv = tuple(range(seg.npiv))
        try:
            t = _table(g, [True] * len(seg.costs), piv, 0.0, [_CONDITION_BUDGET])
        except _Budget:
            self.stats["ilp_tables"] += 1
            sizes = [len(seg.costs[p]) for p in piv]
            t = np.empty(sizes)
            for idx in np.ndindex(*sizes):
                exact = time.perf_counter() < self.deadline
                t[idx] = self.decode(seg, idx, exact=exact)[0]
        self.tables[seg.key] = t
        return t

    def decode(self, seg: _Segment, fixed: tuple[int, ...],
               exact: bool = True) -> tuple[float, np.ndarray]:
        """Best cost and local choices of the segment with its pivots fixed to ``fixed``.

        Reductions, then ``solve_ilp`` on any irreducible core; with ``exact=False`` (time
        is up) the core gets ICM from its unary argmins instead of the ILP.
        """
        key = (seg.key, tuple(int(f) for f in fixed), exact)
        if key in self.decoded:
            return self.decoded[key]
        self.stats["decodes"] += 1
        n = len(seg.costs)
        g = _Graph.from_parts(seg.costs, seg.edges)
        alive = [True] * n
        val = 0.0
        for p, c in enumerate(fixed):
            val += g.fix(p, int(c))
            alive[p] = False
        log: list[tuple] = []
        val += _reduce(g, alive, frozenset(), _SEGMENT_MAX_PAIR, log)
        choice = np.zeros(n, dtype=np.int64)
        choice[:len(fixed)] = fixed
        core = [i for i in range(n) if alive[i]]
        if core:
            loc = {i: k for k, i in enumerate(core)}
            sub = ShardingProblem(
                tuple(f"n{i}" for i in core), tuple(("",) * len(g.costs[i]) for i in core),
                tuple(g.costs[i] for i in core),
                tuple(Edge(loc[i], loc[j], m) for i, j, m in g.edges(core)))
            left = max(min(self.time_limit, self.deadline - time.perf_counter()), 0.1)
            if exact:
                try:
                    sol = solve_ilp(sub, time_limit=left, mip_rel_gap=self.mip_rel_gap,
                                    reduce=False)
                    choice[core], val = sol.choice, val + sol.objective
                except InfeasibleProblemError:
                    val = np.inf
            else:
                guess = improve_local(sub, [int(np.argmin(c)) for c in sub.costs])
                choice[core], val = guess, val + sub.objective(guess)
        _back_substitute(log, choice)
        self.decoded[key] = (val, choice)
        return val, choice


@dataclasses.dataclass(frozen=True)
class _Chain:
    """Segments of the super-problem and the skip edges that leave them."""

    pivots: tuple[int, ...]                       # super-node index of each pivot
    members: tuple[tuple[int, ...], ...]          # per segment, its non-pivot super-nodes
    local_edges: tuple[tuple[int, ...], ...]      # per segment, indices into sup.edges
    skip_edges: tuple[int, ...]                   # indices into sup.edges


def _make_chain(sup: ShardingProblem, seg_of: Sequence[int], pivots: Sequence[int]) -> _Chain:
    k = len(pivots)
    pidx = {p: t for t, p in enumerate(pivots)}
    members: list[list[int]] = [[] for _ in range(k + 1)]
    for c, s in enumerate(seg_of):
        if c not in pidx:
            members[s].append(c)
    local: list[list[int]] = [[] for _ in range(k + 1)]
    skip = []
    for ei, e in enumerate(sup.edges):
        su = ("p", pidx[e.u]) if e.u in pidx else ("s", seg_of[e.u])
        sv = ("p", pidx[e.v]) if e.v in pidx else ("s", seg_of[e.v])
        seg = _edge_segment(su, sv)
        if seg is None:
            skip.append(ei)
        else:
            local[seg].append(ei)
    return _Chain(tuple(pivots), tuple(tuple(m) for m in members),
                  tuple(tuple(x) for x in local), tuple(skip))


def _edge_segment(a: tuple[str, int], b: tuple[str, int]) -> int | None:
    """The segment an edge belongs to, or None for a skip edge."""
    if a[0] == "s" and b[0] == "s":
        return a[1] if a[1] == b[1] else None
    if a[0] == "p" and b[0] == "p":
        lo, hi = sorted((a[1], b[1]))
        return hi if hi == lo + 1 else None
    t, s = (a[1], b[1]) if a[0] == "p" else (b[1], a[1])
    return s if s in (t, t + 1) else None


def _solve_chain(sup: ShardingProblem, chain: _Chain, extra: list[np.ndarray],
                 solver: _SegmentSolver) -> np.ndarray:
    """Chain DP over pivot choices; returns a choice per super-node."""
    k = len(chain.pivots)
    unary = [np.asarray(c) + x for c, x in zip(sup.costs, extra)]
    segs = []
    for s in range(k + 1):
        piv = ([chain.pivots[s - 1]] if s > 0 else []) + ([chain.pivots[s]] if s < k else [])
        nodes = piv + list(chain.members[s])
        loc = {c: j for j, c in enumerate(nodes)}
        costs = [np.zeros(len(unary[c])) for c in piv] + [unary[c] for c in chain.members[s]]
        edges = [(loc[sup.edges[ei].u], loc[sup.edges[ei].v], sup.edges[ei].cost)
                 for ei in chain.local_edges[s]]
        segs.append(_make_segment(nodes, len(piv), costs, edges))
    tables = [solver.table(seg) for seg in segs]
    if k == 0:
        fixed: list[tuple[int, ...]] = [()]
        piv_choice: list[int] = []
    else:
        pu = [unary[p] for p in chain.pivots]
        value = tables[0] + pu[0]
        back = []
        for s in range(1, k):
            tot = value[:, None] + tables[s]
            arg = np.argmin(tot, axis=0)
            back.append(arg)
            value = tot[arg, np.arange(tot.shape[1])] + pu[s]
        value = value + tables[k]
        last = int(np.argmin(value))
        if not np.isfinite(value[last]):
            raise InfeasibleProblemError("the chain DP found no finite-cost choice of pivots")
        piv_choice = [last]
        for arg in reversed(back):
            piv_choice.append(int(arg[piv_choice[-1]]))
        piv_choice.reverse()
        fixed = [((piv_choice[s - 1],) if s > 0 else ()) + ((piv_choice[s],) if s < k else ())
                 for s in range(k + 1)]
    out = np.zeros(sup.num_nodes, dtype=np.int64)
    for p, c in zip(chain.pivots, piv_choice):
        out[p] = c
    for seg, f in zip(segs, fixed):
        _, local = solver.decode(seg, f)
        for j in range(seg.npiv, len(seg.nodes)):
            out[seg.nodes[j]] = local[j]
    return out


def _skip_unary(sup: ShardingProblem, chain: _Chain, choice: np.ndarray) -> list[np.ndarray]:
    extra = [np.zeros(len(c)) for c in sup.costs]
    for ei in chain.skip_edges:
        e = sup.edges[ei]
        extra[e.u] = extra[e.u] + e.cost[:, choice[e.v]]
        extra[e.v] = extra[e.v] + e.cost[choice[e.u], :]
    return extra


def _chain_passes(sup: ShardingProblem, chain: _Chain, solver: _SegmentSolver,
                  start: np.ndarray | None, deadline: float) -> np.ndarray:
    """Chain DP; then skip-edge passes while they lower the super-problem's objective."""
    if start is None:
        best = _solve_chain(sup, chain, [np.zeros(len(c)) for c in sup.costs], solver)
    else:
        best = start
    best_obj = sup.objective(best)
    for _ in range(_MAX_PASSES if chain.skip_edges else 0):
        if time.perf_counter() > deadline:
            break
        cand = _solve_chain(sup, chain, _skip_unary(sup, chain, best), solver)
        obj = sup.objective(cand)
        if not obj < best_obj:
            break
        best, best_obj = cand, obj
    return best


def solve_o2(problem: ShardingProblem, partition: Partition, *, time_limit: float = 60.0,
             mip_rel_gap: float = 1e-4, max_rounds: int = _MAX_ROUNDS) -> Solution:
    """O2: exact reductions -> cone DP -> segment tables -> chain DP -> ICM.

    Args:
        problem: the sharding problem.
        partition: cones, segments and pivots (see ``Partition``).
        time_limit: soft limit in seconds; refinement rounds and passes stop when it is
            spent, and it caps every fallback ILP.
        mip_rel_gap: relative gap of fallback ILPs.
        max_rounds: rounds of level 1 steered by the previous round's assignment
            (1 = the three levels once, plus ICM).

    Returns:
        A ``Solution`` with status ``"heuristic"`` and ``objective ==
        problem.objective(choice)``.

    Raises:
        ValueError: malformed partition.
        InfeasibleProblemError: no finite-cost assignment was found.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    partition.check(problem)
    roots = sorted(set(partition.cone_of))
    red = reduce_exact(problem, protected=roots)
    loc = {node: k for k, node in enumerate(red.core_nodes)}
    core_part = Partition(
        cone_of=tuple(loc[partition.cone_of[i]] for i in red.core_nodes),
        segment_of=tuple(partition.segment_of[i] for i in red.core_nodes),
        pivots=tuple(loc[p] for p in partition.pivots))
    core_choice = _solve_core(red.core, core_part, time_limit, mip_rel_gap, max_rounds,
                              deadline)
    choice = improve_local(problem, red.expand(core_choice), max_sweeps=3, deadline=deadline)
    obj = problem.objective(choice)
    if not np.isfinite(obj):
        raise InfeasibleProblemError(f"O2 found no finite-cost assignment for "
                                     f"{problem.num_nodes} nodes (best costs {obj})")
    return Solution(choice, obj, "heuristic", time.perf_counter() - t0, None)


def _solve_core(problem: ShardingProblem, partition: Partition, time_limit: float,
                mip_rel_gap: float, max_rounds: int, deadline: float) -> tuple[int, ...]:
    """The three levels plus steered rounds, on a problem whose cone roots are all kept."""
    solver = _SegmentSolver(time_limit, mip_rel_gap, deadline)
    best: tuple[int, ...] | None = None
    best_obj = np.inf
    for _ in range(max(1, max_rounds)):
        guide = None if best is None else np.asarray(best)
        cones = _solve_cones(problem, partition.cone_of, time_limit, mip_rel_gap, guide)
        sup = _super_problem(problem, cones)
        cidx = {r: k for k, r in enumerate(cones.roots)}
        chain = _make_chain(sup, [partition.segment_of[r] for r in cones.roots],
                            [cidx[p] for p in partition.pivots])
        start = None if guide is None else guide[cones.roots]
        roots = _chain_passes(sup, chain, solver, start, deadline)
        roots = np.asarray(improve_local(sup, roots, max_sweeps=20, deadline=deadline))
        choice = [int(cones.table[i][roots[cones.cone[i]]]) for i in range(problem.num_nodes)]
        cand = improve_local(problem, choice, max_sweeps=3, deadline=deadline)
        obj = problem.objective(cand)
        improved = obj < best_obj and (best is None or best_obj - obj > 1e-9 * abs(best_obj))
        if obj < best_obj:
            best, best_obj = cand, obj
        if not improved or time.perf_counter() > deadline:
            break
    assert best is not None
    return best
