"""Exact min-sum variable elimination on a ``PairwiseGraph``, within a work budget.

The exact core of O2's segment tables and decodes (``rhino.planner.hierarchical``)::

    elimination_order   greedy min-size order of the free nodes, its largest factor, its work
    eliminate           the min-cost table over the kept nodes (optionally the argmin steps)
    eliminated_choice   back-substitution of those steps into a choice
    pivot_table         the table when only the kept (pivot) nodes are left
    charge              spends work from a budget; raises ``BudgetExceeded`` past it

The budgets themselves (how much work, how large a factor) are the caller's.
"""

from __future__ import annotations

import numpy as np

from rhino.planner.solvers import PairwiseGraph


class BudgetExceeded(Exception):
    """A work budget (``charge``) is spent."""


def pivot_table(g: PairwiseGraph, piv: tuple[int, ...], off: float) -> np.ndarray:
    if not piv:
        return np.array(off)
    if len(piv) == 1:
        return g.costs[piv[0]] + off
    p, q = piv
    t = g.costs[p][:, None] + g.costs[q][None, :] + off
    m = g.adj[p].get(q)
    return t if m is None else t + m


def charge(budget: list[float], work: float) -> None:
    budget[0] -= work
    if budget[0] < 0:
        raise BudgetExceeded


def elimination_order(g: PairwiseGraph, alive: list[bool], keep: tuple[int, ...]
                      ) -> tuple[list[int], float, float]:
    """Greedy min-size order of the alive nodes outside ``keep``, its largest factor and
    its work (the factors' total entries).

    A node's factor spans it and its current neighbours (``keep`` included); eliminating it
    joins those neighbours pairwise, as min-sum variable elimination does.
    """
    nb = {i: set(g.adj[i]) for i, a in enumerate(alive) if a}
    size = {i: len(g.costs[i]) for i in nb}
    todo = set(nb) - set(keep)
    order, largest, work = [], 1.0, 0.0
    while todo:
        best, v = np.inf, -1
        for u in todo:
            c = float(size[u])
            for x in nb[u]:
                c *= size[x]
            if c < best:
                best, v = c, u
        largest, work = max(largest, best), work + best
        rest = nb.pop(v)
        for x in rest:
            nb[x].discard(v)
            nb[x] |= rest - {x}
        todo.discard(v)
        order.append(v)
    return order, largest, work


def eliminate(g: PairwiseGraph, alive: list[bool], keep: tuple[int, ...], order: list[int],
              steps: list[tuple] | None = None) -> np.ndarray:
    """Exact min-sum variable elimination of ``order`` (from ``elimination_order``).

    Returns the min-cost table over ``keep`` (one axis per kept node, in ``keep``'s order;
    a 0-d array when ``keep`` is empty). With ``steps``, appends ``(v, scope, argmin)`` per
    eliminated node for ``eliminated_choice``.
    """
    nodes = [i for i, a in enumerate(alive) if a]
    size = {i: len(g.costs[i]) for i in nodes}
    factors: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    of: dict[int, set[int]] = {i: set() for i in nodes}
    for i in nodes:
        of[i].add(len(factors))
        factors[len(factors)] = ((i,), g.costs[i])
    for i, j, m in g.edges(nodes):
        of[i].add(len(factors))
        of[j].add(len(factors))
        factors[len(factors)] = ((i, j), m)
    fid = len(factors)

    def aligned(scope: tuple[int, ...], s: tuple[int, ...], arr: np.ndarray) -> np.ndarray:
        pos = [scope.index(x) for x in s]
        shape = [1] * len(scope)
        for x in s:
            shape[scope.index(x)] = size[x]
        return np.transpose(arr, np.argsort(pos)).reshape(shape)

    for v in order:
        fs = sorted(of.pop(v))
        scope = (v,) + tuple(sorted({x for f in fs for x in factors[f][0]} - {v}))
        total = np.zeros([size[x] for x in scope])
        for f in fs:
            s, arr = factors.pop(f)
            total += aligned(scope, s, arr)
            for x in s:
                if x != v:
                    of[x].discard(f)
        if steps is None:
            new = total.min(axis=0)
        else:
            arg = np.argmin(total, axis=0)
            steps.append((v, scope[1:], arg))
            new = np.take_along_axis(total, arg[None], axis=0)[0]
        factors[fid] = (scope[1:], new)
        for x in scope[1:]:
            of[x].add(fid)
        fid += 1
    out = np.zeros([size[x] for x in keep])
    for s, arr in factors.values():
        out = out + aligned(keep, s, arr)
    return out


def eliminated_choice(steps: list[tuple], choice: np.ndarray) -> None:
    """Back-substitution of ``eliminate``'s steps into ``choice`` (kept nodes set)."""
    for v, scope, arg in reversed(steps):
        choice[v] = arg[tuple(int(choice[x]) for x in scope)]
