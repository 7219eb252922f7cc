"""The sharding problem as a named data object, independent of HLO and of meshes.

A ``ShardingProblem`` is a pairwise-cost labelling problem: every node (a planned op) picks
one of its choices (strategies); the objective is the sum of the chosen unary costs plus,
for every edge (producer u -> consumer v), ``edge.cost[choice_u, choice_v]`` (resharding).
The planner (``rhino.planner.build``) makes one from an HloGraph and a mesh; the solvers
(``rhino.planner.solvers``, ``rhino.planner.hierarchical``) never see HLO.

Example:
    >>> import numpy as np
    >>> p = ShardingProblem(
    ...     names=("a", "b"), labels=(("R", "S0"), ("R", "S0")),
    ...     costs=(np.array([4.0, 1.0]), np.array([4.0, 1.0])),
    ...     edges=(Edge(0, 1, np.array([[0.0, 0.0], [3.0, 0.0]])),))
    >>> p.objective((1, 1))
    2.0
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rhino.milp import SolverStatus


@dataclasses.dataclass(frozen=True)
class Edge:
    """A producer -> consumer dependency with a cost for every pair of choices.

    Attributes:
        u: producer node index; v: consumer node index (u != v).
        cost: float array of shape ``(num_choices(u), num_choices(v))``.
    """

    u: int
    v: int
    cost: np.ndarray


@dataclasses.dataclass(frozen=True)
class ShardingProblem:
    """Nodes with choices, unary costs, and pairwise edge costs.

    Attributes:
        names: one name per node (the op name).
        labels: per node, a readable label per choice (e.g. ``"S0[x] x R -> S0[x]"``).
        costs: per node, float array of unary costs (compute + communication inside the op).
        edges: pairwise costs; at most one Edge per ordered (u, v) pair.
        memory: optional per node float array of bytes per device each choice keeps resident
            (parameters, optimizer state); used by memory-aware solvers.
    """

    names: tuple[str, ...]
    labels: tuple[tuple[str, ...], ...]
    costs: tuple[np.ndarray, ...]
    edges: tuple[Edge, ...]
    memory: tuple[np.ndarray, ...] | None = None

    def __post_init__(self):
        n = len(self.names)
        if len(self.labels) != n or len(self.costs) != n:
            raise ValueError(f"names, labels and costs must have one entry per node ({n}); got "
                             f"{len(self.labels)} labels and {len(self.costs)} cost vectors")
        for i, (lab, c) in enumerate(zip(self.labels, self.costs)):
            if len(lab) == 0 or len(lab) != len(c):
                raise ValueError(f"node {self.names[i]!r}: {len(lab)} labels but {len(c)} costs "
                                 f"(need at least one choice)")
        for e in self.edges:
            if not (0 <= e.u < n and 0 <= e.v < n) or e.u == e.v:
                raise ValueError(f"edge ({e.u}, {e.v}) out of range for {n} nodes")
            want = (len(self.costs[e.u]), len(self.costs[e.v]))
            if e.cost.shape != want:
                raise ValueError(f"edge {self.names[e.u]!r}->{self.names[e.v]!r}: cost shape "
                                 f"{e.cost.shape}, expected {want}")

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    def num_choices(self, i: int) -> int:
        return len(self.costs[i])

    def objective(self, choice: Sequence[int]) -> float:
        """Total cost of an assignment (one choice index per node)."""
        if len(choice) != self.num_nodes:
            raise ValueError(f"assignment has {len(choice)} entries, problem has "
                             f"{self.num_nodes} nodes")
        total = sum(float(self.costs[i][c]) for i, c in enumerate(choice))
        total += sum(float(e.cost[choice[e.u], choice[e.v]]) for e in self.edges)
        return total

    def restricted(self, keep: Sequence[Sequence[int]]) -> "ShardingProblem":
        """The problem with node ``i`` limited to its choices ``keep[i]`` (in that order):
        choice ``c`` of the result is choice ``keep[i][c]`` here.

        Example:
            >>> p = ShardingProblem(("a",), (("R", "S", "T"),), (np.array([3.0, 1.0, 2.0]),), ())
            >>> p.restricted([[2, 0]]).costs[0].tolist()
            [2.0, 3.0]
        """
        if len(keep) != self.num_nodes or any(len(k) == 0 for k in keep):
            raise ValueError(f"restricted: expected a non-empty list of choices for each of "
                             f"the {self.num_nodes} nodes, found {len(keep)} lists")
        idx = [np.asarray(k, dtype=np.intp) for k in keep]
        return ShardingProblem(
            self.names, tuple(tuple(lab[j] for j in k) for lab, k in zip(self.labels, idx)),
            tuple(c[k] for c, k in zip(self.costs, idx)),
            tuple(Edge(e.u, e.v, e.cost[np.ix_(idx[e.u], idx[e.v])]) for e in self.edges),
            None if self.memory is None else tuple(m[k] for m, k in zip(self.memory, idx)))

    def neighbors(self) -> list[list[int]]:
        """Undirected adjacency lists (edge indices per node)."""
        adj: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for k, e in enumerate(self.edges):
            adj[e.u].append(k)
            adj[e.v].append(k)
        return adj


@dataclasses.dataclass(frozen=True)
class Solution:
    """A solver's answer.

    Attributes:
        choice: chosen choice index per node.
        objective: ``problem.objective(choice)``.
        status: ``OPTIMAL``, ``TIME_LIMIT`` (incumbent returned) or ``HEURISTIC``
            (a ``rhino.milp.SolverStatus``).
        seconds: wall time of the solve.
        bound: best lower bound known (== objective when optimal), or None.
    """

    choice: tuple[int, ...]
    objective: float
    status: SolverStatus
    seconds: float
    bound: float | None = None
