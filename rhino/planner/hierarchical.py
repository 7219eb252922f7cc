"""O2: Rhino's three-level subgraph merging (paper §4.3.2), and O3 (the whole-graph ILP).

Pipeline of ``solve_o2``::

    problem ──(0) small core with an integral LP relaxation? its optimum──► Solution
    problem ──(1) exact reductions, pivots kept──► core (cones folded into their roots)
    core ──(2) segment tables: reductions, elimination, conditioning ──(3) chain DP──► A
    core ──TRW message passing (skip edges)──► B
    A, B ──skip-edge passes + ICM──► the better one ──block, window moves + ICM──► core choice
    core choice ──back-substitution + ICM──► Solution

Step 0 (small problems): O3's LP relaxation within a budget of simplex iterations, kept
where integral, which proves it optimal (``solvers.solve_small_ilp`` says when and why).

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
matrix. An irreducible core is solved exactly by min-sum variable elimination (greedy
min-size order, pivots kept as table axes) when its largest factor stays under
``_ELIM_MAX_FACTOR`` entries; otherwise we condition on its highest-degree node (pivots
included), reduce again and recurse. Where the table conditioned on a non-pivot node it
records that node's best choice per pivot pair (a hint), so decoding a pair later fixes it
and eliminates the rest, cheaply and exactly. The whole exact computation has a work budget
(``_EXACT_WORK``, in factor entries, ~1-2 s); the quick MoE step on mesh (2, 4) has one
segment (a 29-node core of 9-24 choices per node, treewidth ~5) that needs 1.7e8 of it.

Approximate tables (documented approximation). A segment past the budget gets an upper-bound
table instead (``chain.approx_table``): TRW's choice of its non-pivot nodes, improved by ICM
for all pivot pairs at once in vectorised sweeps; every entry is the cost of a real
assignment. Such a segment is remembered by its shape (sizes and edge endpoints, which fix
the exact work), so its cost variants (skip-edge passes, repeated layers) skip the exact
attempt. Only the pivot pair the chain DP picks is then decoded exactly (reductions,
elimination within a small budget, else ``solve_ilp`` on the core), once per chain solve.
The former fallback, reductions + conditioning + an ILP for every one of the ~900 pivot
pairs, took 690 s on that MoE step; see ``benchmarks/o2_hard_segments.py``.

Once the chain DP over pivot choices has picked ``(a, b)`` for a segment, its nodes are
decoded with the pivots fixed as above. Tables and decodings are memoised by a hash of the
segment's re-indexed cost data, since transformer layers repeat.

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
conditional modes (ICM) on the core. The better candidate then gets exact moves of every
node's neighbourhood (``blocks.improve_blocks``: up to 8 nodes within 2 edges re-chosen
jointly, since a group such as a QKV projection's dot, reshape and slices can only move
together), ICM; where the chain has skip edges, joint re-choices of forward layer k with
backward layer k and their parameters (``windows.improve_windows``), ICM; finally ICM on
all nodes. ICM, the block and window moves and the passes never raise the true objective.
The returned ``Solution.objective`` is always ``problem.objective(choice)``; its status is
``"heuristic"``.

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
import time

import numpy as np

from rhino.milp import SolverStatus
from rhino.planner.blocks import improve_blocks
from rhino.planner.chain import Segment, approx_table, chain_passes, make_chain
from rhino.planner.elimination import (BudgetExceeded, charge, eliminate, eliminated_choice,
                                       elimination_order, pivot_table)
from rhino.planner.problem import Edge, ShardingProblem, Solution
from rhino.planner.solvers import (
    InfeasibleProblemError, PairwiseGraph, back_substitute, improve_local, reduce_exact,
    reduce_graph, solve_ilp, solve_small_ilp, solve_trw)
from rhino.planner.windows import improve_windows
# Moved to chain.py; still here under their old names, which tests read.
from rhino.planner.chain import MAX_PASSES as _MAX_PASSES  # noqa: F401
from rhino.planner.chain import make_segment as _make_segment  # noqa: F401

__all__ = ["Partition", "solve_o2", "solve_o3"]

_SEGMENT_MAX_PAIR = 1 << 16   # R2 limit inside segments
_EXACT_WORK = 3e8             # work budget of an exact table or decode (factor entries)
_NODE_WORK = 1e5              # work charged per conditioning node (copy + reductions)
_HARD_DECODE_WORK = 1e7       # budget of a decode in a segment whose table exceeded it
_ELIM_MAX_FACTOR = 1 << 22    # entries (float64) of the largest factor elimination builds
_SMALL_ILP_ENTRIES = 60_000   # step 0: core pair entries the ILP is handed (module doc)
_SMALL_ILP_ITERATIONS = (1000, 0.3)   # its budget: simplex iterations, a + b per entry


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
# Levels 2 + 3: exact segment tables and decodes (segments and the chain DP: chain.py)
# ----------------------------------------------------------------------------------------
def _table(g: PairwiseGraph, alive: list[bool], piv: tuple[int, ...], off: float,
           budget: list[float]) -> tuple[np.ndarray, tuple | None]:
    """Exact min-cost table over the protected pivots ``piv``: reductions, then variable
    elimination when its factors stay small, else conditioning on the highest-degree node
    and recursion. Raises ``BudgetExceeded`` past ``budget[0]`` units of work.

    Returns the table and a hint for ``_hinted_fixes``: the best choice of every non-pivot
    node conditioned on, per pivot choice (None when nothing was conditioned on).
    """
    off += reduce_graph(g, alive, frozenset(piv), _SEGMENT_MAX_PAIR, [])
    core = [i for i, a in enumerate(alive) if a and i not in piv]
    if not core:
        return pivot_table(g, piv, off), None
    order, largest, work = elimination_order(g, alive, piv)
    if largest <= _ELIM_MAX_FACTOR:
        charge(budget, work)
        return eliminate(g, alive, piv, order) + off, None
    charge(budget, _NODE_WORK)
    z = max(core + list(piv), key=lambda i: (len(g.adj[i]), -len(g.costs[i])))
    rest = tuple(p for p in piv if p != z)
    results, kids = [], []
    for cz in range(len(g.costs[z])):
        g2, alive2 = g.copy(), list(alive)
        c0 = g2.fix(z, cz)
        alive2[z] = False
        t, h = _table(g2, alive2, rest, off + c0, budget)
        results.append(t)
        kids.append(h)
    if z in piv:
        hint = None if all(h is None for h in kids) else (z, piv, None, kids)
        return np.stack(results, axis=piv.index(z)), hint
    stacked = np.stack(results)
    arg = np.argmin(stacked, axis=0)
    used = set(np.unique(arg).tolist())
    kids = [h if cz in used else None for cz, h in enumerate(kids)]
    return np.asarray(np.take_along_axis(stacked, arg[None], axis=0)[0]), (z, piv, arg, kids)


def _hinted_fixes(hint: tuple | None, fixed: dict[int, int]) -> dict[int, int]:
    """The pivot choices ``fixed`` plus the best choices the table's conditioning found for
    the non-pivot nodes it conditioned on (exact: the rest is then solved given them)."""
    fixed = dict(fixed)
    while hint is not None:
        z, piv, arg, kids = hint
        if arg is not None:
            fixed[z] = int(arg[tuple(fixed[p] for p in piv)])
        hint = kids[fixed[z]]
    return fixed


def _condition(g: PairwiseGraph, alive: list[bool], budget: list[float]
               ) -> tuple[float, np.ndarray]:
    """Exact minimum (and argmin over the alive nodes) of a small graph.

    Reduces; eliminates the rest when its factors stay small; else conditions on the
    highest-degree node and recurses. Raises ``BudgetExceeded`` past ``budget[0]`` units of work
    (factor entries; ``_NODE_WORK`` per conditioning node). Entries of dead nodes are
    unspecified.
    """
    charge(budget, _NODE_WORK)
    log: list[tuple] = []
    off = reduce_graph(g, alive, frozenset(), _SEGMENT_MAX_PAIR, log)
    core = [i for i, a in enumerate(alive) if a]
    choice = np.zeros(len(alive), dtype=np.int64)
    order, largest, work = elimination_order(g, alive, ()) if core else ([], 1.0, 0.0)
    if core and largest <= _ELIM_MAX_FACTOR:
        charge(budget, work)
        steps: list[tuple] = []
        off += float(eliminate(g, alive, (), order, steps))
        eliminated_choice(steps, choice)
    elif core:
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
    back_substitute(log, choice)
    return off, choice


class _ExactMemo:
    """Exact segment results shared by every solve in this process, keyed by the segment's
    cost-data hash (a pure function of it): exact tables with their conditioning hints,
    shapes whose exact table exceeded the budget, and decodes that needed no time-limited
    ILP (or whose ILP proved optimality). The plans of one search repeat segments across
    solves: a split's first, middle and last stages hold the same layers, and memory fitting
    re-solves one problem. Bounded to ``limit`` bytes of arrays, oldest dropped first.
    Approximate tables are not shared: they depend on the solve's deadline."""

    def __init__(self, limit: int = 256 << 20):
        self.limit, self.used = limit, 0
        self.tables: dict[bytes, tuple[np.ndarray, tuple | None]] = {}
        self.decoded: dict[tuple, tuple[float, np.ndarray]] = {}
        self.hard: set[bytes] = set()
        self.budgets: tuple = ()

    def check(self) -> None:
        """Forget everything if the work budgets that shaped it have changed."""
        budgets = (_EXACT_WORK, _NODE_WORK, _HARD_DECODE_WORK, _ELIM_MAX_FACTOR,
                   _SEGMENT_MAX_PAIR)
        if budgets != self.budgets:
            self.clear()
            self.budgets = budgets

    def _room(self, nbytes: int) -> None:
        self.used += nbytes
        while self.used > self.limit and (self.tables or self.decoded):
            d = self.tables if self.tables else self.decoded
            v = d.pop(next(iter(d), None), None)     # (threads may race here: harmless)
            if v is not None:
                self.used -= v[0].nbytes if d is self.tables else v[1].nbytes

    def put_table(self, key: bytes, table: np.ndarray, hint: tuple | None) -> None:
        if key not in self.tables:
            self.tables[key] = (table, hint)
            self._room(table.nbytes)

    def put_decode(self, key: tuple, val: float, choice: np.ndarray) -> None:
        if key not in self.decoded:
            self.decoded[key] = (val, choice.copy())
            self._room(choice.nbytes)

    def clear(self) -> None:
        self.tables.clear()
        self.decoded.clear()
        self.hard.clear()
        self.used = 0


_EXACT = _ExactMemo()


class _SegmentSolver:
    """Tables and decodings of segments, memoised by the segment's cost-data hash.

    A segment whose exact table exceeds the work budget ``_EXACT_WORK`` is remembered by its
    shape (sizes and edge endpoints, which fix the work), so that the same segment with
    other costs (the skip-edge passes add unary terms; repeated layers) goes straight to
    ``chain.approx_table`` and its decodes try elimination only briefly before the ILP.

    ``stats`` counts: ``tables`` built (``table_hits`` memoised), ``approx_tables``,
    ``budget_exceeded`` (exact attempts abandoned), ``decodes``, ``decode_ilps`` (decodes
    whose core needed ``solve_ilp``) and ``decode_icm`` (past the deadline: ICM instead).
    """

    def __init__(self, time_limit: float, mip_rel_gap: float, deadline: float):
        self.time_limit, self.mip_rel_gap, self.deadline = time_limit, mip_rel_gap, deadline
        self.tables: dict[bytes, np.ndarray] = {}
        self.hints: dict[bytes, tuple] = {}  # conditioning choices of exact tables
        self.decoded: dict[tuple[bytes, tuple[int, ...], bool],
                           tuple[float, np.ndarray]] = {}
        self.stats = {"tables": 0, "table_hits": 0, "approx_tables": 0, "budget_exceeded": 0,
                      "decodes": 0, "decode_ilps": 0, "decode_icm": 0}
        _EXACT.check()

    def table(self, seg: Segment) -> np.ndarray:
        if seg.key in self.tables:
            self.stats["table_hits"] += 1
            return self.tables[seg.key]
        shared = _EXACT.tables.get(seg.key)
        if shared is not None:
            self.stats["table_hits"] += 1
            t, hint = shared
            if hint is not None:
                self.hints[seg.key] = hint
            self.tables[seg.key] = t
            return t
        self.stats["tables"] += 1
        t = None
        if seg.shape_key not in _EXACT.hard:   # shapes whose exact table exceeded the budget
            g = PairwiseGraph.from_parts(seg.costs, seg.edges)
            try:
                t, hint = _table(g, [True] * len(seg.costs), tuple(range(seg.npiv)), 0.0,
                                 [_EXACT_WORK])
                if hint is not None:
                    self.hints[seg.key] = hint
                _EXACT.put_table(seg.key, t, hint)
            except BudgetExceeded:
                self.stats["budget_exceeded"] += 1
                _EXACT.hard.add(seg.shape_key)
        if t is None:
            self.stats["approx_tables"] += 1
            t = approx_table(seg, self.deadline)
        self.tables[seg.key] = t
        return t

    def decode(self, seg: Segment, fixed: tuple[int, ...],
               exact: bool = True) -> tuple[float, np.ndarray]:
        """Best cost and local choices of the segment with its pivots fixed to ``fixed``.

        Reductions, then elimination / conditioning (within a work budget, small for a
        segment whose table exceeded it), then ``solve_ilp`` on any core left; with
        ``exact=False`` (time is up) that core gets ICM instead of the ILP.
        """
        key = (seg.key, tuple(int(f) for f in fixed), exact)
        if key in self.decoded:
            return self.decoded[key]
        shared = _EXACT.decoded.get(key[:2])
        if shared is not None:
            self.decoded[key] = shared
            return shared
        self.stats["decodes"] += 1
        pure = True      # the hints come from exact tables; the budgets are fixed
        n = len(seg.costs)
        g = PairwiseGraph.from_parts(seg.costs, seg.edges)
        alive = [True] * n
        val = 0.0
        choice = np.zeros(n, dtype=np.int64)
        fixes = _hinted_fixes(self.hints.get(seg.key), dict(enumerate(int(f) for f in fixed)))
        for v, c in fixes.items():
            val += g.fix(v, c)
            alive[v] = False
            choice[v] = c
        log: list[tuple] = []
        val += reduce_graph(g, alive, frozenset(), _SEGMENT_MAX_PAIR, log)
        core = [i for i in range(n) if alive[i]]
        if core:
            budget = [_HARD_DECODE_WORK if seg.shape_key in _EXACT.hard else _EXACT_WORK]
            try:
                sub_val, sub_choice = _condition(g, alive, budget)
                choice[core] = sub_choice[core]
                core, val = [], val + sub_val
            except BudgetExceeded:
                pass
        if core:
            loc = {i: k for k, i in enumerate(core)}
            sub = ShardingProblem(
                tuple(f"n{i}" for i in core), tuple(("",) * len(g.costs[i]) for i in core),
                tuple(g.costs[i] for i in core),
                tuple(Edge(loc[i], loc[j], m) for i, j, m in g.edges(core)))
            left = max(min(self.time_limit, self.deadline - time.perf_counter()), 0.1)
            if exact:
                self.stats["decode_ilps"] += 1
                try:
                    sol = solve_ilp(sub, time_limit=left, mip_rel_gap=self.mip_rel_gap,
                                    reduce=False)
                    choice[core], val = sol.choice, val + sol.objective
                    pure = pure and sol.status == SolverStatus.OPTIMAL
                except InfeasibleProblemError:
                    val = np.inf
            else:
                self.stats["decode_icm"] += 1
                guess = improve_local(sub, [int(np.argmin(c)) for c in sub.costs])
                choice[core], val = guess, val + sub.objective(guess)
                pure = False
        back_substitute(log, choice)
        self.decoded[key] = (val, choice)
        if pure and np.isfinite(val):
            _EXACT.put_decode(key[:2], val, choice)
        return val, choice


def solve_o2(problem: ShardingProblem, partition: Partition, *, time_limit: float = 60.0,
             mip_rel_gap: float = 1e-4, windows: bool = True) -> Solution:
    """O2: exact reductions -> segment tables -> chain DP, plus TRW for skip edges -> ICM.

    Args:
        problem: the sharding problem.
        partition: cones, segments and pivots (see ``Partition``).
        time_limit: soft limit in seconds: message passing gets half of what is left after
            the chain, refinement stops when it is spent, and it caps every fallback ILP.
        mip_rel_gap: relative gap of fallback ILPs.
        windows: end with the mirrored-window moves (``windows.improve_windows``); on a
            layered training step they cost about as much again as the rest of O2.

    Returns:
        A ``Solution`` with ``objective == problem.objective(choice)``: status
        ``"optimal"`` from step 0, else ``"heuristic"``.

    Raises:
        ValueError: malformed partition.
        InfeasibleProblemError: no finite-cost assignment was found.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    partition.check(problem)
    a, b = _SMALL_ILP_ITERATIONS
    small = solve_small_ilp(problem, max_entries=_SMALL_ILP_ENTRIES, mip_rel_gap=mip_rel_gap,
                            time_limit=time_limit / 4, iterations=lambda n: a + b * n)
    if small is not None:
        return dataclasses.replace(small, seconds=time.perf_counter() - t0)
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
    chain = make_chain(core, seg, [loc[p] for p in partition.pivots])
    solver = _SegmentSolver(time_limit, mip_rel_gap, deadline)
    cands = []
    if core.num_nodes:
        first = chain_passes(core, chain, solver, None, deadline)
        cands.append(improve_local(core, first, max_sweeps=20, deadline=deadline))
        if chain.skip_edges and time.perf_counter() < deadline:
            left = deadline - time.perf_counter()
            try:
                trw = np.asarray(solve_trw(core, time_limit=left / 2).choice)
            except InfeasibleProblemError:
                trw = None
            if trw is not None:
                start = chain_passes(core, chain, solver, trw, deadline)
                cands.append(improve_local(core, start, max_sweeps=20, deadline=deadline))
    best = min(cands, key=core.objective) if cands else ()
    if cands:   # block moves, then mirrored windows (module docstring); ICM after each
        best = improve_local(core, improve_blocks(core, best, deadline=deadline),
                             max_sweeps=20, deadline=deadline)
        if windows and chain.skip_edges and time.perf_counter() < deadline:
            best = improve_windows(core, best, seg, chain.pivots, deadline=deadline)
    choice = improve_local(problem, red.expand(best), max_sweeps=3, deadline=deadline)
    obj = problem.objective(choice)
    if not np.isfinite(obj):
        raise InfeasibleProblemError(f"O2 found no finite-cost assignment for "
                                     f"{problem.num_nodes} nodes (best costs {obj})")
    return Solution(choice, obj, SolverStatus.HEURISTIC, time.perf_counter() - t0, None)
