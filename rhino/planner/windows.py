"""Exact moves of mirrored segment windows: O2's step for groups that span the chain.

A training step's chain runs forward layer k, then (much later) backward layer k, then the
optimizer; skip edges link the three (a weight to its uses in both passes, its gradient to
its Adam update). Where the optimum switches a whole weight group (a norm's scale with its
Adam state, the forward ops and the backward ops that carry its channel split), the nodes
that change lie in segments far apart on the chain: block moves (``blocks.py``, 2 edges
around one node) and the skip-edge passes of the chain DP (one side held fixed while the
other moves) cannot reach it. On UNet with mesh (2, 4) at 100 FLOP per byte, four such
groups (105-116 nodes each, 1.2-2% of the step apiece) kept O2 5.8% above O3.

``improve_windows`` re-chooses windows jointly with everything else held fixed: a window is
a run of segments together with their *mirrors* (the segment each is linked to by the most
skip edges: forward layer k's is backward layer k), the segments either side of every one
of them, the pivots between, and the catch-all segment 0 nodes (parameters, optimizer
updates) within ``hops`` edges of those through segment 0, except *hubs*: a segment-0 node
tied to more than ``hub`` chain segments outside the window (a constant or a broadcast
every layer reads) stays fixed and is folded in. The run grows while the window stays
within ``cap`` nodes (one layer pair on UNet, several of VGG's small layers). Edges to the
nodes outside are folded into unary costs at their current choices and the window is
solved by tree-reweighted message passing (``solvers.solve_trw``) and ICM; a move is kept
only if it lowers the window's cost, and the result only if it lowers the whole objective,
so ``problem.objective`` never rises.

Repeated layers give repeated windows: a window whose folded problem equals one already
solved takes that answer (``_Digests`` keys a window by its content). Hubs kept out of the
windows are what makes the windows of equal layers equal. On GPT 48 x 8192 on an 8x8 mesh
(whole-graph SPMD candidate of ``benchmarks/plan_at_scale.py``) 195 windows a sweep need 41
message passings (14 s), and with ICM after them the objective falls from 6.40 to 4.92;
letting hubs in cost 257 passings (89 s) for 4.97.

Why message passing. The window ILP found the same moves but cost 6 s a window (the
marginal LP of a 300-node window with 64-choice nodes has 285,000 columns; 78 s for UNet's
13 windows, as long as O3 on the whole step); cutting each node to its 8 or 16 locally
best choices made it fast and found nothing (the better choices only pay off jointly);
exact elimination runs past 1e8 factor entries. TRW sees every edge of the window and
took 4.7 s for all 13, reaching O3's objective on that step.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from typing import Sequence

import numpy as np

from rhino.planner.blocks import not_worse
from rhino.planner.problem import Edge, ShardingProblem
from rhino.planner.solvers import InfeasibleProblemError, improve_local, solve_trw

__all__ = ["improve_windows", "mirrored_windows"]


def mirrored_windows(problem: ShardingProblem, seg_of: Sequence[int],
                     pivots: Sequence[int], *, cap: int = 320, hops: int = 4,
                     hub: int = 4) -> list[list[int]]:
    """The windows ``improve_windows`` solves (see the module docstring), as sorted node
    lists. ``seg_of[i]`` is node ``i``'s chain segment (0 .. len(pivots)); pivot ``t`` lies
    between segments ``t`` and ``t + 1``."""
    k = len(pivots)
    pset = set(pivots)
    members: list[list[int]] = [[] for _ in range(k + 1)]
    for i, s in enumerate(seg_of):
        if i not in pset:
            members[s].append(i)
    nbrs: list[set[int]] = [set() for _ in range(problem.num_nodes)]
    links: Counter = Counter()
    for e in problem.edges:
        nbrs[e.u].add(e.v)
        nbrs[e.v].add(e.u)
        if e.u in pset or e.v in pset:
            continue
        a, b = sorted((seg_of[e.u], seg_of[e.v]))
        if a > 0 and b - a > 1:
            links[a, b] += 1
    reach = [frozenset(seg_of[j] for j in nbrs[i] if seg_of[j] > 0) for i in range(len(nbrs))]
    mirror: dict[int, int] = {}
    for (a, b), _ in sorted(links.items(), key=lambda kv: -kv[1]):
        mirror.setdefault(a, b)
        mirror.setdefault(b, a)

    def window(first: int, last: int) -> list[int]:
        segs = set()
        for s in range(first, last + 1):
            for t in (s, mirror.get(s, s)):
                segs.update(x for x in (t - 1, t, t + 1) if 1 <= x <= k)
        nodes = {i for s in segs for i in members[s]}
        nodes.update(pivots[t] for s in segs for t in (s - 1, s) if 0 <= t < k)
        frontier = list(nodes)
        for _ in range(hops):
            grown = [j for i in frontier for j in nbrs[i] if j not in nodes and j not in pset
                     and seg_of[j] == 0 and len(reach[j] - segs) <= hub]
            nodes.update(grown)
            frontier = grown
        return sorted(nodes)

    out, done, s = [], set(), 1
    while s <= k:
        if s not in mirror or mirror[s] < s:
            s += 1
            continue
        last, best = s, window(s, s)
        while last + 1 <= k and last + 1 in mirror and mirror[last + 1] > last + 1:
            grown = window(s, last + 1)
            if len(grown) > cap:
                break
            last, best = last + 1, grown
        key = tuple(best)
        if key not in done:
            done.add(key)
            out.append(best)
        s += max(1, (last - s + 1) // 2)
    return out


def _window_problem(problem: ShardingProblem, choice: np.ndarray, nodes: Sequence[int],
                    incident: list[list[int]]) -> ShardingProblem:
    """The window's nodes with the edges to the others folded in at their choices."""
    loc = {n: j for j, n in enumerate(nodes)}
    costs = [np.array(problem.costs[n], dtype=np.float64) for n in nodes]
    inner: dict[tuple[int, int], np.ndarray] = {}
    for ei in sorted({ei for n in nodes for ei in incident[n]}):
        e = problem.edges[ei]
        if e.u in loc and e.v in loc:
            key = (loc[e.u], loc[e.v])
            inner[key] = inner[key] + e.cost if key in inner else e.cost
        elif e.u in loc:
            costs[loc[e.u]] += e.cost[:, choice[e.v]]
        else:
            costs[loc[e.v]] += e.cost[choice[e.u], :]
    return ShardingProblem(names=tuple(problem.names[n] for n in nodes),
                           labels=tuple(problem.labels[n] for n in nodes),
                           costs=tuple(costs),
                           edges=tuple(Edge(u, v, m) for (u, v), m in inner.items()))


def improve_windows(problem: ShardingProblem, choice: Sequence[int], seg_of: Sequence[int],
                    pivots: Sequence[int], *, cap: int = 320, hops: int = 4,
                    window_time: float = 5.0, sweeps: int = 2,
                    deadline: float | None = None
                    ) -> tuple[int, ...]:
    """Moves of mirrored segment windows (see the module docstring).

    A window whose folded problem is identical to one already solved (a repeated layer with
    the same choices around it, or a window nothing has changed since the last sweep) takes
    the earlier answer instead of solving again: the key is every cost the window sees, so
    the answer is the one the solver would give (on GPT 48 x 8192 on 8x8, 41 message
    passings for 2 sweeps of 195 windows).

    Args:
        problem, choice: the problem and a choice for every node.
        seg_of, pivots: the chain (``seg_of[i]`` in 0 .. len(pivots)).
        cap: most nodes in a window; hops: how far a window reaches into segment 0.
        window_time: time limit of one window's message passing.
        sweeps: most sweeps over the windows (a sweep that moves nothing ends them).
        deadline: ``time.perf_counter()`` value after which no window is started.

    Returns:
        A choice whose objective is at most ``problem.objective(choice)``, after ICM.
    """
    start = np.array([int(c) for c in choice], dtype=np.int64)
    cur = start.copy()
    incident: list[list[int]] = [[] for _ in range(problem.num_nodes)]
    for ei, e in enumerate(problem.edges):
        incident[e.u].append(ei)
        incident[e.v].append(ei)
    digest = _Digests(problem)
    solved: dict[bytes, np.ndarray] = {}
    windows = mirrored_windows(problem, seg_of, pivots, cap=cap, hops=hops)
    for _ in range(sweeps):
        moved = False
        for nodes in windows:
            sub = _window_problem(problem, cur, nodes, incident)
            key = digest.window(sub, nodes, incident)
            found = solved.get(key)
            if found is None:
                left = window_time if deadline is None else min(
                    window_time, deadline - time.perf_counter())
                if left <= 0:
                    break
                try:
                    found = improve_local(sub, solve_trw(sub, time_limit=left).choice,
                                          max_sweeps=20, deadline=deadline)
                except InfeasibleProblemError:
                    found = cur[nodes]
                found = solved[key] = np.asarray(found, dtype=np.int64)
            if np.array_equal(found, cur[nodes]):
                continue
            if sub.objective(found) < sub.objective(cur[nodes]):
                cur[nodes] = found
                moved = True
        if not moved:
            break
    # The moves were accepted on window objectives; the whole one decides (rounding).
    return improve_local(problem, not_worse(problem, start, cur), max_sweeps=20,
                         deadline=deadline)


class _Digests:
    """Content keys of folded window problems, with each inner edge's costs hashed once."""

    def __init__(self, problem: ShardingProblem):
        self.problem = problem
        self.edges: dict[int, bytes] = {}

    def window(self, sub: ShardingProblem, nodes: Sequence[int],
               incident: list[list[int]]) -> bytes:
        """A key equal for two windows whose folded problems (``sub``) are equal: the
        unary costs in single precision (the same sums taken in another order agree) and
        the inner edges by content."""
        p = self.problem
        loc = {n: j for j, n in enumerate(nodes)}
        h = hashlib.blake2b(digest_size=16)
        for c in sub.costs:
            h.update(np.asarray(c, dtype=np.float32).tobytes())
        for ei in sorted({ei for n in nodes for ei in incident[n]}):
            e = p.edges[ei]
            if e.u in loc and e.v in loc:
                if ei not in self.edges:
                    self.edges[ei] = hashlib.blake2b(
                        np.ascontiguousarray(e.cost).tobytes(), digest_size=16).digest()
                h.update(np.array([loc[e.u], loc[e.v]], dtype=np.int64).tobytes())
                h.update(self.edges[ei])
        return h.digest()
