"""O2: Rhino's three-level subgraph merging (paper §4.3.2), and O3 (the whole-graph ILP).

Pipeline of ``solve_o2``::

    problem ──(1) exact reductions, pivots kept──► core (cones folded into their roots)
    core ──(2) segment tables: reductions, conditioning, ILP ──(3) chain DP over pivots──► A
    core ──TRW message passing (skip edges)──► B
    A, B ──skip-edge passes + ICM──► best core choice ──back-substitution + ICM──► Solution

Level 1 (cones). The paper fixes each cone root's choice and picks its members by DP over the
cone (a forest once the root is fixed), ignoring the members' edges that leave the cone. We
fold cones with the exact PBQP reductions instead (``solvers.reduce_exact``, pivots
protected): R1/R2 fold every member that hangs off its root into it — the same DP, with the
same per-root-choice back-substitution tables — and a member whose edges leave its cone is
not forced to a per-root-choice table (which measured 16% worse than O3 on a 2-layer GPT step)
but stays in the core, linked exactly. Roots that reduce (degree <= 2) are folded too, as the
reductions are exact. ``Partition.cone_of`` is validated and gives a core node whose own
segment is -1 its root's segment.

Levels 2 and 3 (segments, chain). Pivots (critical nodes) cut the chain: segment ``k`` lies
between ``pivots[k-1]`` and ``pivots[k]``. For every segment we need the table
``T_k[a, b]`` = best cost of its nodes given the left pivot's choice ``a`` and the right
pivot's choice ``b``. Instead of an ILP per ``(a, b)`` we reduce the segment with both pivots
protected: segments are nearly series-parallel, so R1/R2 collapse them to one ``a x b``
matrix. An irreducible core is conditioned on its highest-degree node (pivots included) and
reduced again, recursively, within a budget; past it, ``T_k`` falls back to one ILP
(``solve_ilp``, level 2) per pair. Once the chain DP over pivot choices has picked ``(a, b)``
for a segment, its nodes are decoded with the pivots fixed: reductions, conditioning, and
``solve_ilp`` on any core left. Tables and decodings are memoised by a hash of the segment's
re-indexed cost data, since transformer layers repeat.

Skip edges (documented approximation). An edge whose endpoints are not in one segment (or a
segment and its two pivots) does not fit the chain: in a training step, weights and
activations saved for the backward pass link forward layer k to backward layer k, and
optimizer updates link every layer to the end of the chain; on GPT steps from
``rhino.planner.build`` about 40% of the core's edges skip. The chain DP (candidate A)
ignores them (they are still counted in the objective). A chain that is locally optimal this
way can sit in the wrong global regime (e.g. sequence sharding everywhere where Megatron
tensor parallelism is cheaper once the skip edges count), which no local move escapes, so a
second candidate (B) comes from tree-reweighted min-sum message passing on the whole core
(``solvers.solve_trw``), which sees every edge. Each candidate is then refined by passes that
turn every skip edge into unary costs at the current choice of its other endpoint and re-run
the chain DP (a pass is kept only if it lowers the true objective), and by iterated
conditional modes (ICM) on the core and finally on all nodes. ICM and the passes only ever
lower the true objective. The returned ``Solution.objective`` is always
``problem.objective(choice)`` and its status is ``"heuristic"``.

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
from typing import Sequence

import numpy as np

from rhino.planner.problem import Edge, ShardingProblem, Solution
from rhino.planner.solvers import (
    InfeasibleProblemError, _back_substitute, _Graph, _reduce, improve_local, reduce_exact,
    solve_ilp, solve_trw)

__all__ = ["Partition", "solve_o2", "solve_o3"]

_SEGMENT_MAX_PAIR = 1 << 16   # R2 limit inside segments
_CONDITION_BUDGET = 2000      # recursion nodes of the conditioning fallback per table
_MAX_PASSES = 4               # skip-edge passes after the first chain DP


@dataclasses.dataclass(frozen=True)
class Partition:
    """Cones, segments and pivots of a problem (built by the planner from an HloGraph).

    ``solve_o2`` folds cones by exact reductions (see the module docstring), so ``cone_of``
    only places a node whose own segment is -1 (its root's segment, or the segment left of
    a pivot root); ``segment_of`` and ``pivots`` define the chain.

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
                             f"{len(self.segment_of)} segment_of entries, problem has {n} "
                             f"nodes")
        k = len(self.pivots)
        if len(set(self.pivots)) != k:
            raise ValueError(f"pivots repeat: {self.pivots}")
        if not all(0 <= p < n for p in self.pivots):
            raise ValueError(f"pivots out of range 0..{n - 1}: {self.pivots}")
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


def _condition(g: _Graph, alive: list[bool], budget: list[int]) -> tuple[float, np.ndarray]:
    """Exact minimum (and argmin over the alive nodes) of a small graph by conditioning.

    Conditions on the highest-degree node, reduces, recurses; raises ``_Budget`` when more
    than ``budget[0]`` graphs would be visited. Entries of dead nodes are unspecified.
    """
    budget[0] -= 1
    if budget[0] < 0:
        raise _Budget
    log: list[tuple] = []
    off = _reduce(g, alive, frozenset(), _SEGMENT_MAX_PAIR, log)
    core = [i for i, a in enumerate(alive) if a]
    choice = np.zeros(len(alive), dtype=np.int64)
    if core:
        z = max(core, key=lambda i: (len(g.adj[i]), -len(g.costs[i])))
        best_val, best = np.inf, None
        for cz in range(len(g.costs[z])):
            if not np.isfinite(g.costs[z][cz]):
                continue
            g2, alive2 = g.copy(), list(alive)
            c0 = g2.fix(z, cz)
            alive2[z] = False
            val, sub = _condition(g2, alive2, budget)
            if c0 + val < best_val:
                best_val, best = c0 + val, sub
                best[z] = cz
        if best is None:
            return np.inf, choice
        choice, off = best, off + best_val
    _back_substitute(log, choice)
    return off, choice


@dataclasses.dataclass(frozen=True)
class _Segment:
    """A segment re-indexed locally: pivots first (left, right, where present), then nodes."""

    nodes: tuple[int, ...]            # core-problem indices of the local nodes
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
        self.decoded: dict[tuple[bytes, tuple[int, ...], bool],
                           tuple[float, np.ndarray]] = {}
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

        Reductions, then conditioning (within a budget), then ``solve_ilp`` on any core
        left; with ``exact=False`` (time is up) that core gets ICM instead of the ILP.
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
            try:  # condition on high-degree nodes and reduce again, within a budget
                sub_val, sub_choice = _condition(g, alive, [_CONDITION_BUDGET])
                choice[core] = sub_choice[core]
                core, val = [], val + sub_val
            except _Budget:
                pass
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
    """Segments of a problem and the skip edges that leave them."""

    pivots: tuple[int, ...]                       # node index of each pivot
    members: tuple[tuple[int, ...], ...]          # per segment, its non-pivot nodes
    local_edges: tuple[tuple[int, ...], ...]      # per segment, indices into prob.edges
    skip_edges: tuple[int, ...]                   # indices into prob.edges


def _make_chain(prob: ShardingProblem, seg_of: Sequence[int],
                pivots: Sequence[int]) -> _Chain:
    k = len(pivots)
    pidx = {p: t for t, p in enumerate(pivots)}
    members: list[list[int]] = [[] for _ in range(k + 1)]
    for c, s in enumerate(seg_of):
        if c not in pidx:
            members[s].append(c)
    local: list[list[int]] = [[] for _ in range(k + 1)]
    skip = []
    for ei, e in enumerate(prob.edges):
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


def _solve_chain(prob: ShardingProblem, chain: _Chain, extra: list[np.ndarray],
                 solver: _SegmentSolver) -> np.ndarray:
    """Chain DP over pivot choices; returns a choice per node of ``prob``."""
    k = len(chain.pivots)
    unary = [np.asarray(c) + x for c, x in zip(prob.costs, extra)]
    segs = []
    for s in range(k + 1):
        piv = ([chain.pivots[s - 1]] if s > 0 else []) + ([chain.pivots[s]] if s < k else [])
        nodes = piv + list(chain.members[s])
        loc = {c: j for j, c in enumerate(nodes)}
        costs = [np.zeros(len(unary[c])) for c in piv] + [unary[c] for c in chain.members[s]]
        edges = [(loc[prob.edges[ei].u], loc[prob.edges[ei].v], prob.edges[ei].cost)
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
    out = np.zeros(prob.num_nodes, dtype=np.int64)
    for p, c in zip(chain.pivots, piv_choice):
        out[p] = c
    for seg, f in zip(segs, fixed):
        _, local = solver.decode(seg, f)
        for j in range(seg.npiv, len(seg.nodes)):
            out[seg.nodes[j]] = local[j]
    return out


def _skip_unary(prob: ShardingProblem, chain: _Chain, choice: np.ndarray) -> list[np.ndarray]:
    extra = [np.zeros(len(c)) for c in prob.costs]
    for ei in chain.skip_edges:
        e = prob.edges[ei]
        extra[e.u] = extra[e.u] + e.cost[:, choice[e.v]]
        extra[e.v] = extra[e.v] + e.cost[choice[e.u], :]
    return extra


def _chain_passes(prob: ShardingProblem, chain: _Chain, solver: _SegmentSolver,
                  start: np.ndarray | None, deadline: float) -> np.ndarray:
    """Chain DP (or ``start``); then skip-edge passes while they lower the objective."""
    if start is None:
        best = _solve_chain(prob, chain, [np.zeros(len(c)) for c in prob.costs], solver)
    else:
        best = start
    best_obj = prob.objective(best)
    for _ in range(_MAX_PASSES if chain.skip_edges else 0):
        if time.perf_counter() > deadline:
            break
        try:
            cand = _solve_chain(prob, chain, _skip_unary(prob, chain, best), solver)
        except InfeasibleProblemError:  # forbidden skip pairs at the current choice
            break
        obj = prob.objective(cand)
        if not obj < best_obj:
            break
        best, best_obj = cand, obj
    return best


def solve_o2(problem: ShardingProblem, partition: Partition, *, time_limit: float = 60.0,
             mip_rel_gap: float = 1e-4) -> Solution:
    """O2: exact reductions -> segment tables -> chain DP, plus TRW for skip edges -> ICM.

    Args:
        problem: the sharding problem.
        partition: cones, segments and pivots (see ``Partition``).
        time_limit: soft limit in seconds: message passing gets half of what is left after
            the chain, refinement stops when it is spent, and it caps every fallback ILP.
        mip_rel_gap: relative gap of fallback ILPs.

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
    red = reduce_exact(problem, protected=partition.pivots)
    core = red.core
    k = len(partition.pivots)
    pidx = {p: t for t, p in enumerate(partition.pivots)}
    seg = []
    for i in red.core_nodes:  # a member of a pivot's cone precedes it: left segment
        s, r = partition.segment_of[i], partition.cone_of[i]
        s = s if s >= 0 else pidx.get(r, partition.segment_of[r])
        seg.append(min(max(s, 0), k))
    loc = {node: j for j, node in enumerate(red.core_nodes)}
    chain = _make_chain(core, seg, [loc[p] for p in partition.pivots])
    solver = _SegmentSolver(time_limit, mip_rel_gap, deadline)
    cands = []
    if core.num_nodes:
        first = _chain_passes(core, chain, solver, None, deadline)
        cands.append(improve_local(core, first, max_sweeps=20, deadline=deadline))
        if chain.skip_edges and time.perf_counter() < deadline:
            left = deadline - time.perf_counter()
            try:
                trw = np.asarray(solve_trw(core, time_limit=left / 2).choice)
            except InfeasibleProblemError:
                trw = None
            if trw is not None:
                start = _chain_passes(core, chain, solver, trw, deadline)
                cands.append(improve_local(core, start, max_sweeps=20, deadline=deadline))
    best = min(cands, key=core.objective) if cands else ()
    choice = improve_local(problem, red.expand(best), max_sweeps=3, deadline=deadline)
    obj = problem.objective(choice)
    if not np.isfinite(obj):
        raise InfeasibleProblemError(f"O2 found no finite-cost assignment for "
                                     f"{problem.num_nodes} nodes (best costs {obj})")
    return Solution(choice, obj, "heuristic", time.perf_counter() - t0, None)
