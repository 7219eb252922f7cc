"""O2's segments and their chain (levels 2 and 3 of ``rhino.planner.hierarchical``).

::

    Segment, make_segment   a segment re-indexed locally (pivots first), with the hashes that
                            memoise its tables and decodes
    approx_table            the upper-bound table of a segment too dense for the exact one
    Chain, make_chain       the segments between pivots and the skip edges that leave them
    chain_passes            the chain DP over pivot choices, then skip-edge passes

The exact tables and decodes come from the caller's segment solver (``SegmentTables``:
``hierarchical``'s, which memoises them under its work budgets).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Protocol, Sequence

import numpy as np

from rhino.planner.problem import Edge, ShardingProblem
from rhino.planner.solvers import InfeasibleProblemError, solve_trw

_ICM_SWEEPS = 20              # sweeps of the batched ICM of an approximate table
MAX_PASSES = 4                # skip-edge passes after the first chain DP


@dataclasses.dataclass(frozen=True)
class Segment:
    """A segment re-indexed locally: pivots first (left, right, where present), then nodes."""

    nodes: tuple[int, ...]            # core-problem indices of the local nodes
    npiv: int
    costs: tuple[np.ndarray, ...]     # pivots' unary costs zeroed (the chain DP adds them)
    edges: tuple[tuple[int, int, np.ndarray], ...]
    key: bytes                        # hash of the cost data: memoises tables and decodes
    shape_key: bytes                  # hash of sizes and edge endpoints: the exact work


def make_segment(nodes: list[int], npiv: int, costs: list[np.ndarray],
                 edges: list[tuple[int, int, np.ndarray]]) -> Segment:
    h = hashlib.blake2b(digest_size=20)
    shape = [len(nodes), npiv] + [len(c) for c in costs]
    edges = sorted(edges, key=lambda t: (t[0], t[1]))
    for i, j, m in edges:
        shape += [i, j]
    for c in costs:
        h.update(np.ascontiguousarray(c, dtype=np.float64).tobytes())
    for i, j, m in edges:
        h.update(np.ascontiguousarray(m, dtype=np.float64).tobytes())
    shape_key = hashlib.blake2b(np.array(shape, np.int64).tobytes(), digest_size=20).digest()
    h.update(shape_key)
    return Segment(tuple(nodes), npiv, tuple(costs), tuple(edges), h.digest(), shape_key)


def approx_table(seg: Segment, deadline: float) -> np.ndarray:
    """Upper-bound table of a segment too dense for the exact one: the cost, per pivot
    choice, of batched ICM started from TRW's choice of the non-pivot nodes.

    Every entry is the cost of a real assignment of the segment, so the chain DP's value
    for a pick is never below the decoded (exact) one; the pivot pairs share one sweep of
    vectorised array operations, so this costs milliseconds where a solve per pair took
    minutes.
    """
    n, npiv = len(seg.costs), seg.npiv
    sizes = [len(seg.costs[p]) for p in range(npiv)]
    sub = ShardingProblem(tuple(f"n{i}" for i in range(n)),
                          tuple(("",) * len(c) for c in seg.costs), seg.costs,
                          tuple(Edge(i, j, m) for i, j, m in seg.edges))
    try:
        seed = np.asarray(solve_trw(sub, time_limit=max(
            min(5.0, deadline - time.perf_counter()), 0.1)).choice)
    except InfeasibleProblemError:
        seed = np.array([int(np.argmin(c)) for c in seg.costs])
    pairs = np.indices(sizes).reshape(npiv, int(np.prod(sizes)))
    cur = np.repeat(seed[:, None], pairs.shape[1], axis=1)
    cur[:npiv] = pairs
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for i, j, m in seg.edges:
        nbrs[i].append((j, m))
        nbrs[j].append((i, m.T))
    cols = np.arange(cur.shape[1])
    for _ in range(_ICM_SWEEPS):
        changed = False
        for i in range(npiv, n):
            vec = np.repeat(np.asarray(seg.costs[i])[:, None], cur.shape[1], axis=1)
            for j, m in nbrs[i]:
                vec = vec + m[:, cur[j]]
            b = np.argmin(vec, axis=0)
            old, new = vec[cur[i], cols], vec[b, cols]
            move = (new < old) & (~np.isfinite(old) | (old - new > 1e-12 * np.abs(old)))
            if move.any():
                cur[i] = np.where(move, b, cur[i])
                changed = True
        if not changed:
            break
    val = np.zeros(cur.shape[1])
    for i in range(n):
        val = val + np.asarray(seg.costs[i])[cur[i]]
    for i, j, m in seg.edges:
        val = val + m[cur[i], cur[j]]
    return val.reshape(sizes)


class SegmentTables(Protocol):
    """What the chain DP asks of a segment solver: a segment's min-cost table over its
    pivots' choices, and its best cost and local choices with the pivots fixed."""

    def table(self, seg: Segment) -> np.ndarray: ...

    def decode(self, seg: Segment, fixed: tuple[int, ...]) -> tuple[float, np.ndarray]: ...


@dataclasses.dataclass(frozen=True)
class Chain:
    """Segments of a problem and the skip edges that leave them."""

    pivots: tuple[int, ...]                       # node index of each pivot
    members: tuple[tuple[int, ...], ...]          # per segment, its non-pivot nodes
    local_edges: tuple[tuple[int, ...], ...]      # per segment, indices into prob.edges
    skip_edges: tuple[int, ...]                   # indices into prob.edges


def make_chain(prob: ShardingProblem, seg_of: Sequence[int],
               pivots: Sequence[int]) -> Chain:
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
    return Chain(tuple(pivots), tuple(tuple(m) for m in members),
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


def _solve_chain(prob: ShardingProblem, chain: Chain, extra: list[np.ndarray],
                 solver: SegmentTables) -> np.ndarray:
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
        segs.append(make_segment(nodes, len(piv), costs, edges))
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


def _skip_unary(prob: ShardingProblem, chain: Chain, choice: np.ndarray) -> list[np.ndarray]:
    extra = [np.zeros(len(c)) for c in prob.costs]
    for ei in chain.skip_edges:
        e = prob.edges[ei]
        extra[e.u] = extra[e.u] + e.cost[:, choice[e.v]]
        extra[e.v] = extra[e.v] + e.cost[choice[e.u], :]
    return extra


def chain_passes(prob: ShardingProblem, chain: Chain, solver: SegmentTables,
                 start: np.ndarray | None, deadline: float) -> np.ndarray:
    """Chain DP (or ``start``); then skip-edge passes while they lower the objective."""
    if start is None:
        best = _solve_chain(prob, chain, [np.zeros(len(c)) for c in prob.costs], solver)
    else:
        best = start
    best_obj = prob.objective(best)
    for _ in range(MAX_PASSES if chain.skip_edges else 0):
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
