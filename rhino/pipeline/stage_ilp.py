"""The stage-assignment ILP of Rhino §5.1 with the bound tightening of §5.2, on a unit DAG.

``StageProblem`` is the named data object: units (coarsened forward ops) with their compute,
the unit DAG's edges, and the tensors that would cross stages, each with its bytes, the
producing unit and the consuming units. It knows nothing about HLO; ``stages.py`` builds
it from a graph.

Formulation (``d`` stages numbered 0..d-1, ``c_u`` compute of unit u, ``T = Σ c / d``)::

    B_u ∈ {lb_u..ub_u} integer        stage of unit u             (§5.1)
    X_us ∈ {0,1}, Σ_s X_us = 1, B_u = Σ_s s·X_us                  (one-hot, for loads)
    B_v - B_u ≥ 0                     every edge u -> v           (§5.1)
    F_uv ≤ B_v - B_u ≤ M_uv·F_uv      F_uv ∈ {0,1}, M_uv = ub_v - lb_u   (big-M, §5.1)
    Z_ts ≥ X_vs - X_us                any other tensor t of u read by units v: one
                                      transfer per stage that reads it and is not u's
    (1-ε)·T ≤ L_s = Σ_u c_u·X_us ≤ (1+ε)·T,   Tmax ≥ L_s             (balance; the
                                      lower bound is at least min_stage_load·T)
    minimize  (Σ F_uv·bytes_uv + Σ Z_ts·bytes_t) / B̄  +  balance_weight · Tmax / T

``bytes_uv`` sums the tensors of u whose only consuming unit is v (one transfer when cut;
an edge ``v -> u`` serves too: a backward tensor flows from a later stage to an earlier
one); a tensor read by several units gets ``Z`` so it is paid once per destination stage,
not once per edge as the paper's per-edge sum would. Tensors add no ordering constraint:
only ``edges`` do. ``B̄`` is the mean size of the tensors, so one typical tensor weighs 1.
With ``balance_weight = 0`` the objective is the paper's pure communication volume; the
default (0.05) keeps volume first and, among cuts of equal volume, prefers the better
balanced one (a stage 10% over ``T`` costs 0.005: half a percent of a typical tensor).
Everything is scaled to O(1) (loads in units of ``T``, bytes of ``B̄``): with raw FLOPs
(1e12) and bytes the solver's tolerances swallow the differences.

Bound tightening (§5.2), with ``A_u`` / ``D_u`` the ancestor / descendant units of u::

    lb_u = max(0,   floor(Σ_{A_u} c / T - ε))
    ub_u = min(d-1, d - 1 - floor(Σ_{D_u} c / T - ε))

The upper bound mirrors the lower one from the end of the pipeline (the descendants' work
must fit in the stages after u); the paper prints it with stages counted from the end. The
bounds are then propagated along edges (``lb_v ≥ lb_u``, ``ub_u ≤ ub_v``). They remove the
``X_us`` outside ``[lb_u, ub_u]``: the heuristic of §5.2, exact when ε is generous.

Example:
    >>> p = StageProblem(names=("a", "b", "c", "d"), compute=(1.0, 1.0, 1.0, 1.0),
    ...                  edges=((0, 1), (1, 2), (2, 3)),
    ...                  tensors=(CutTensor(0, (1,), 8), CutTensor(1, (2,), 2),
    ...                           CutTensor(2, (3,), 8)), num_stages=2)
    >>> sol = solve_stage_problem(p, StageOptions(epsilon=0.5))
    >>> sol.stage_of, sol.cut_bytes
    ((0, 0, 1, 1), 2)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Sequence

import numpy as np

from rhino.errors import RhinoError
from rhino.milp import INF, MilpModel, SolverStatus, solve_milp


class StageAssignmentError(RhinoError):
    """No stage assignment exists (too few units, or infeasible even with relaxed ε)."""


@dataclasses.dataclass(frozen=True)
class CutTensor:
    """A value that crosses stages when its producer and a consumer are on different stages.

    Attributes:
        producer: the unit producing it.
        consumers: the other units reading it (distinct, without the producer).
        bytes: its size.
        label: a name for reports (the producing op's name).
    """

    producer: int
    consumers: tuple[int, ...]
    bytes: int
    label: str = ""


@dataclasses.dataclass(frozen=True)
class StageOptions:
    """How the stage ILP is built and solved.

    Attributes:
        epsilon: imbalance tolerance: each stage's compute within ``(1 ± ε)·T``; also the
            slack (in stages) of the §5.2 bounds.
        tighten: apply the §5.2 bounds (False: the plain §5.1 problem).
        relax: when infeasible, retry with ε doubled (up to ``max_epsilon``) and report the
            ε used, rather than fail.
        max_epsilon: the largest ε tried.
        time_limit: seconds per solve; the best solution found is used on timeout.
        mip_rel_gap: relative MIP gap at which a solve stops.
        balance_weight: weight of the bottleneck stage's load (in units of ``T``) against
            the cut volume (in units of the mean tensor size); 0: the paper's pure volume.
        warm_start: give HiGHS the prefix-sum split as a starting solution.
        min_stage_load: every stage gets at least this share of ``T`` even when ε ≥ 1 (no
            empty stage: with volume first, an empty stage would save a cut).
    """

    epsilon: float = 0.2
    tighten: bool = True
    relax: bool = True
    max_epsilon: float = 4.0
    time_limit: float = 60.0
    mip_rel_gap: float = 1e-4
    balance_weight: float = 0.05
    warm_start: bool = True
    min_stage_load: float = 0.1

    def __post_init__(self):
        if not self.epsilon >= 0:
            raise ValueError(f"epsilon: expected >= 0, found {self.epsilon!r}")
        if not self.time_limit > 0:
            raise ValueError(f"time_limit: expected > 0 seconds, found {self.time_limit!r}")
        if not self.balance_weight >= 0:
            raise ValueError(f"balance_weight: expected >= 0, found {self.balance_weight!r}")


@dataclasses.dataclass(frozen=True)
class StageProblem:
    """The stage-assignment problem on a DAG of units (see the module docstring).

    Attributes:
        names: one name per unit.
        compute: FLOPs of each unit.
        edges: ``(u, v)``: unit v reads a value of unit u (the DAG; u != v).
        tensors: the values that may cross stages.
        num_stages: ``d``.
    """

    names: tuple[str, ...]
    compute: tuple[float, ...]
    edges: tuple[tuple[int, int], ...]
    tensors: tuple[CutTensor, ...]
    num_stages: int

    def __post_init__(self):
        n = len(self.names)
        if len(self.compute) != n:
            raise ValueError(f"StageProblem: expected {n} compute values, found "
                             f"{len(self.compute)}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: expected >= 1, found {self.num_stages}")
        for u, v in self.edges:
            if not (0 <= u < n and 0 <= v < n) or u == v:
                raise ValueError(f"StageProblem edge: expected two distinct units in 0..{n - 1},"
                                 f" found ({u}, {v})")

    @property
    def num_units(self) -> int:
        return len(self.names)

    def topological_order(self) -> list[int]:
        """Units in a topological order of the edges.

        Raises:
            ValueError: the edges have a cycle.
        """
        n = self.num_units
        indeg = [0] * n
        succ: list[list[int]] = [[] for _ in range(n)]
        for u, v in set(self.edges):
            succ[u].append(v)
            indeg[v] += 1
        ready = [u for u in range(n) if indeg[u] == 0]
        ready.reverse()
        order = []
        while ready:
            u = ready.pop()
            order.append(u)
            for v in sorted(succ[u], reverse=True):
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        if len(order) != n:
            raise ValueError("StageProblem: expected a DAG, found a cycle among the units")
        return order

    def reach_compute(self) -> tuple[np.ndarray, np.ndarray]:
        """(Σ compute of the ancestors, Σ compute of the descendants) of each unit,
        the unit itself excluded (bitsets over units)."""
        n = self.num_units
        order = self.topological_order()
        pred: list[list[int]] = [[] for _ in range(n)]
        succ: list[list[int]] = [[] for _ in range(n)]
        for u, v in set(self.edges):
            pred[v].append(u)
            succ[u].append(v)
        weights = np.asarray(self.compute, dtype=np.float64)
        nbytes = (n + 7) // 8

        def sums(bits: list[int]) -> np.ndarray:
            out = np.empty(n)
            for u in range(n):
                arr = np.unpackbits(np.frombuffer(bits[u].to_bytes(nbytes, "little"),
                                                  dtype=np.uint8), bitorder="little")[:n]
                out[u] = float(arr @ weights)
            return out

        anc = [0] * n
        for u in order:
            acc = 0
            for p in pred[u]:
                acc |= anc[p] | (1 << p)
            anc[u] = acc
        desc = [0] * n
        for u in reversed(order):
            acc = 0
            for s in succ[u]:
                acc |= desc[s] | (1 << s)
            desc[u] = acc
        return sums(anc), sums(desc)

    def bounds(self, epsilon: float, tighten: bool = True) -> tuple[list[int], list[int]]:
        """(lb, ub) stage bounds per unit: §5.2 when ``tighten``, else ``0, d-1``."""
        n, d = self.num_units, self.num_stages
        if not tighten or d == 1:
            return [0] * n, [d - 1] * n
        total = float(sum(self.compute))
        per_stage = total / d if total > 0 else 1.0
        anc, desc = self.reach_compute()
        lb = [max(0, math.floor(a / per_stage - epsilon + 1e-9)) for a in anc]
        ub = [min(d - 1, d - 1 - math.floor(x / per_stage - epsilon + 1e-9)) for x in desc]
        lb = [min(x, d - 1) for x in lb]
        ub = [max(x, 0) for x in ub]
        order = self.topological_order()
        pred: list[list[int]] = [[] for _ in range(n)]
        succ: list[list[int]] = [[] for _ in range(n)]
        for u, v in set(self.edges):
            pred[v].append(u)
            succ[u].append(v)
        for v in order:
            for u in pred[v]:
                lb[v] = max(lb[v], lb[u])
        for u in reversed(order):
            for v in succ[u]:
                ub[u] = min(ub[u], ub[v])
        for u in range(n):
            if lb[u] > ub[u]:
                lb[u] = ub[u] = min(max((lb[u] + ub[u]) // 2, 0), d - 1)
        return lb, ub

    # ------------------------------------------------------------------ evaluation
    def cut_bytes(self, stage_of: Sequence[int]) -> int:
        """Bytes crossing stages: each tensor once per stage reading it other than its own."""
        total = 0
        for t in self.tensors:
            s = stage_of[t.producer]
            dests = {stage_of[v] for v in t.consumers} - {s}
            total += t.bytes * len(dests)
        return int(total)

    def loads(self, stage_of: Sequence[int]) -> list[float]:
        out = [0.0] * self.num_stages
        for u, s in enumerate(stage_of):
            out[s] += self.compute[u]
        return out

    def imbalance(self, stage_of: Sequence[int]) -> float:
        """max_s |L_s - T| / T."""
        loads = self.loads(stage_of)
        t = sum(loads) / self.num_stages
        return max(abs(x - t) for x in loads) / t if t > 0 else 0.0

    def mean_tensor_bytes(self) -> float:
        """``B̄``: the mean size of the tensors (1 when there are none)."""
        sizes = [t.bytes for t in self.tensors if t.bytes > 0]
        return float(sum(sizes)) / len(sizes) if sizes else 1.0

    def objective(self, stage_of: Sequence[int], options: StageOptions) -> float:
        """``cut bytes / B̄ + balance_weight · max load / T`` (the ILP's objective)."""
        t = sum(self.compute) / self.num_stages
        bal = options.balance_weight * max(self.loads(stage_of)) / t if t > 0 else 0.0
        return self.cut_bytes(stage_of) / self.mean_tensor_bytes() + bal

    def violations(self, stage_of: Sequence[int], epsilon: float,
                   min_stage_load: float = 0.0) -> list[str]:
        """What an assignment breaks: range, monotone edges, balance (ε, and every stage
        at least ``min_stage_load · T``); empty: valid."""
        out = []
        d = self.num_stages
        if len(stage_of) != self.num_units:
            return [f"expected {self.num_units} stages, found {len(stage_of)}"]
        for u, s in enumerate(stage_of):
            if not 0 <= s < d:
                out.append(f"unit {self.names[u]}: stage {s} outside 0..{d - 1}")
        for u, v in self.edges:
            if stage_of[v] < stage_of[u]:
                out.append(f"edge {self.names[u]} -> {self.names[v]}: stage {stage_of[u]} -> "
                           f"{stage_of[v]} goes backward")
        if self.imbalance(stage_of) > epsilon + 1e-9:
            out.append(f"imbalance {self.imbalance(stage_of):.3f} > ε {epsilon}")
        if d > 1 and not out:
            loads = self.loads(stage_of)
            t = sum(loads) / d
            low = [s for s, x in enumerate(loads) if x < min_stage_load * t - 1e-9 * t]
            if low:
                out.append(f"stage {low[0]} load {loads[low[0]] / t:.3f}·T < "
                           f"{min_stage_load}·T")
        return out


@dataclasses.dataclass(frozen=True)
class StageSolution:
    """A solved stage assignment.

    Attributes:
        stage_of: stage of each unit.
        status: ``OPTIMAL``, ``TIME_LIMIT`` (best found) or ``BRUTE_FORCE``.
        objective: the objective (seconds) of ``stage_of``.
        cut_bytes: bytes crossing stages.
        loads: compute (FLOPs) of each stage.
        epsilon: the ε the solution satisfies (larger than asked if relaxed).
        tightened: whether the §5.2 bounds were used.
        num_vars: columns of the ILP (after bound tightening).
        free_choices: ``Σ_u (ub_u - lb_u + 1)``: stage choices left by the bounds.
        solve_s: seconds in HiGHS (all ε rounds); rounds: solves made.
    """

    stage_of: tuple[int, ...]
    status: SolverStatus
    objective: float
    cut_bytes: int
    loads: tuple[float, ...]
    epsilon: float
    tightened: bool
    num_vars: int
    free_choices: int
    solve_s: float
    rounds: int


class _Rows:
    """Sparse rows for ``Highs.addRows``."""

    def __init__(self):
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.starts: list[int] = []
        self.idx: list[int] = []
        self.val: list[float] = []

    def add(self, cols: Sequence[int], vals: Sequence[float], lo: float, hi: float) -> None:
        self.starts.append(len(self.idx))
        self.idx.extend(cols)
        self.val.extend(vals)
        self.lo.append(lo)
        self.hi.append(hi)


def _solve_once(problem: StageProblem, options: StageOptions, epsilon: float
                ) -> tuple[tuple[int, ...] | None, str, int, int, float]:
    """One HiGHS solve: (stage_of or None if infeasible, status, columns, choices, seconds)."""
    inf = INF
    n, d = problem.num_units, problem.num_stages
    lb, ub = problem.bounds(epsilon, options.tighten)
    total = float(sum(problem.compute))
    per_stage = total / d if total > 0 else 1.0
    w_byte = 1.0 / problem.mean_tensor_bytes()
    w_flop = options.balance_weight
    comp = [c / per_stage for c in problem.compute]      # loads in units of T

    cost: list[float] = []
    col_lo: list[float] = []
    col_hi: list[float] = []
    integrality: list[int] = []

    def col(c: float, lo: float, hi: float, integer: bool) -> int:
        cost.append(c)
        col_lo.append(lo)
        col_hi.append(hi)
        integrality.append(1 if integer else 0)
        return len(cost) - 1

    rows = _Rows()
    b_col = [col(0.0, lb[u], ub[u], True) for u in range(n)]
    x_col: list[dict[int, int]] = []
    for u in range(n):
        xs = {s: col(0.0, 0.0, 1.0, True) for s in range(lb[u], ub[u] + 1)}
        x_col.append(xs)
        rows.add(list(xs.values()), [1.0] * len(xs), 1.0, 1.0)
        rows.add([b_col[u]] + list(xs.values()), [1.0] + [-float(s) for s in xs], 0.0, 0.0)
    # Edges: monotone (§5.1). Cut indicators: big-M F on an edge for a tensor read by one
    # unit joined to its producer by an edge (either direction: backward tensors flow from
    # later to earlier stages); one-hot Z for every other tensor.
    edge_set = set(problem.edges)
    for u, v in sorted(edge_set):
        rows.add([b_col[v], b_col[u]], [1.0, -1.0], 0.0, inf)
    edge_bytes: dict[tuple[int, int], int] = {}
    multi: list[CutTensor] = []
    for t in problem.tensors:
        cons = tuple(dict.fromkeys(c for c in t.consumers if c != t.producer))
        if not cons or t.bytes <= 0:
            continue
        if len(cons) == 1 and (t.producer, cons[0]) in edge_set:
            key = (t.producer, cons[0])
        elif len(cons) == 1 and (cons[0], t.producer) in edge_set:
            key = (cons[0], t.producer)
        else:
            multi.append(dataclasses.replace(t, consumers=cons))
            continue
        edge_bytes[key] = edge_bytes.get(key, 0) + t.bytes
    f_col: dict[tuple[int, int], int] = {}
    for (u, v), nbytes in sorted(edge_bytes.items()):
        big_m = ub[v] - lb[u]
        if big_m <= 0:
            continue
        f = col(w_byte * nbytes, 0.0, 1.0, True)
        f_col[(u, v)] = f
        rows.add([b_col[v], b_col[u], f], [1.0, -1.0, -1.0], 0.0, inf)           # F ≤ Bv-Bu
        rows.add([b_col[v], b_col[u], f], [1.0, -1.0, -float(big_m)], -inf, 0.0)  # ≤ M·F
    z_cols: list[tuple[int, CutTensor, int]] = []
    for t in multi:
        u = t.producer
        stages = sorted({s for v in t.consumers for s in x_col[v]})
        for s in stages:
            z = col(w_byte * t.bytes, 0.0, 1.0, False)
            z_cols.append((z, t, s))
            for v in t.consumers:
                if s not in x_col[v]:
                    continue
                cols, vals = [z, x_col[v][s]], [1.0, -1.0]
                if s in x_col[u]:
                    cols.append(x_col[u][s])
                    vals.append(1.0)
                rows.add(cols, vals, 0.0, inf)          # Z ≥ X_vs - X_us
    tmax = col(w_flop, 0.0, inf, False)
    lo_load, hi_load = max(1.0 - epsilon, options.min_stage_load), 1.0 + epsilon
    for s in range(d):
        cols = [x_col[u][s] for u in range(n) if s in x_col[u] and comp[u] != 0]
        vals = [comp[u] for u in range(n) if s in x_col[u] and comp[u] != 0]
        rows.add(cols, vals, max(0.0, lo_load) if d > 1 else -inf, hi_load if d > 1 else inf)
        rows.add(cols + [tmax], vals + [-1.0], -inf, 0.0)

    start = None
    if options.warm_start:
        split = _prefix_split(problem, lb, ub)
        if split is not None:
            vals = np.zeros(len(cost))
            for u, s in enumerate(split):
                vals[b_col[u]] = s
                vals[x_col[u][s]] = 1.0
            for (u, v), f in f_col.items():
                vals[f] = 1.0 if split[v] != split[u] else 0.0
            for z, t, s in z_cols:
                vals[z] = 1.0 if (split[t.producer] != s and any(
                    split[v] == s for v in t.consumers)) else 0.0
            vals[tmax] = max(problem.loads(split)) / per_stage
            start = (np.arange(len(cost)), vals)
    model = MilpModel(
        costs=np.asarray(cost), lower=np.asarray(col_lo), upper=np.asarray(col_hi),
        integer=np.asarray(integrality, bool), row_lower=np.asarray(rows.lo),
        row_upper=np.asarray(rows.hi), row_starts=np.asarray(rows.starts),
        row_index=np.asarray(rows.idx), row_value=np.asarray(rows.val), start=start,
        time_limit=options.time_limit, mip_rel_gap=options.mip_rel_gap)
    res = solve_milp(model)
    choices = sum(ub[u] - lb[u] + 1 for u in range(n))
    if res.x is None:
        return None, res.status, model.num_cols, choices, res.seconds
    stage_of = tuple(int(round(res.x[b_col[u]])) for u in range(n))
    return stage_of, res.status, model.num_cols, choices, res.seconds


def _prefix_split(problem: StageProblem, lb: Sequence[int], ub: Sequence[int]
                  ) -> tuple[int, ...] | None:
    """Stages by compute prefix along a topological order, clamped into the bounds."""
    d = problem.num_stages
    total = float(sum(problem.compute))
    if total <= 0:
        return None
    per = total / d
    acc = 0.0
    out = [0] * problem.num_units
    for u in problem.topological_order():
        s = min(d - 1, int((acc + 0.5 * problem.compute[u]) / per))
        s = min(max(s, lb[u]), ub[u])
        out[u] = s
        acc += problem.compute[u]
    if any(out[v] < out[u] for u, v in problem.edges):
        return None
    return tuple(out)


def _least_load(problem: StageProblem) -> float:
    """Half the smallest positive unit's share of the mean stage load: a stage holding
    any unit with work holds at least that (what every stage must hold when no split
    reaches ``min_stage_load``)."""
    total = sum(problem.compute)
    work = [c for c in problem.compute if c > 0]
    return 0.5 * min(work) * problem.num_stages / total if work and total > 0 else 0.0


def solve_stage_problem(problem: StageProblem, options: StageOptions = StageOptions()
                        ) -> StageSolution:
    """Solve the stage ILP with highspy (relaxing ε on infeasibility if allowed).

    Raises:
        StageAssignmentError: fewer units than stages, or infeasible up to ``max_epsilon``.
    """
    d = problem.num_stages
    if problem.num_units < d:
        raise StageAssignmentError(f"stage assignment: expected at least {d} units to split "
                                   f"into {d} stages, found {problem.num_units}")
    eps = options.epsilon
    total_s = 0.0
    rounds = 0
    while True:
        rounds += 1
        stage_of, status, ncol, choices, secs = _solve_once(problem, options, eps)
        total_s += secs
        if stage_of is not None:
            break
        least = _least_load(problem)
        if options.relax and eps >= options.max_epsilon and options.min_stage_load > least:
            # One unit holds nearly all the work (a factorization in a tiny model): no
            # split gives every stage a tenth of the mean; the least unbalanced split that
            # leaves no stage without work is still the pipeline asked for.
            last = dataclasses.replace(options, min_stage_load=least)
            stage_of, status, ncol, choices, secs = _solve_once(problem, last, float(d))
            total_s += secs
            if stage_of is not None:
                eps = problem.imbalance(stage_of)
                break
        if not options.relax or eps >= options.max_epsilon:
            relaxed = (f" (relaxed from the ε={options.epsilon:g} asked, doubling up to "
                       f"{options.max_epsilon:g})" if eps > options.epsilon else "")
            raise StageAssignmentError(
                f"stage assignment: expected a split of {problem.num_units} units into {d} "
                f"stages balanced within ε={eps:g}{relaxed}, found "
                + ("none exists" if status is SolverStatus.INFEASIBLE else
                   f"none within the {options.time_limit:g} s time limit"))
        eps = min(options.max_epsilon, max(2 * eps, 0.05))
    return StageSolution(stage_of, status, problem.objective(stage_of, options),
                         problem.cut_bytes(stage_of), tuple(problem.loads(stage_of)), eps,
                         options.tighten and d > 1, ncol, choices, total_s, rounds)


def solve_brute_force(problem: StageProblem, options: StageOptions = StageOptions()
                      ) -> StageSolution:
    """Enumerate every assignment (tiny problems: ``d ** units`` ≤ 2e6), for tests.

    Uses the plain constraints (monotone edges, balance within ``options.epsilon``, every
    stage at least ``options.min_stage_load · T``).

    Raises:
        StageAssignmentError: nothing is feasible.
        ValueError: the problem is too large to enumerate.
    """
    n, d = problem.num_units, problem.num_stages
    if d ** n > 2_000_000:
        raise ValueError(f"brute force: expected d**units <= 2e6, found {d}**{n}")
    best, best_obj = None, math.inf
    t0 = time.perf_counter()
    for stage_of in itertools.product(range(d), repeat=n):
        if problem.violations(stage_of, options.epsilon, options.min_stage_load):
            continue
        obj = problem.objective(stage_of, options)
        if obj < best_obj - 1e-15:
            best, best_obj = stage_of, obj
    if best is None:
        raise StageAssignmentError(f"brute force: expected a feasible split into {d} stages "
                                   f"within ε={options.epsilon}, found none")
    return StageSolution(tuple(best), SolverStatus.BRUTE_FORCE, best_obj, problem.cut_bytes(best),
                         tuple(problem.loads(best)), options.epsilon, False, 0, d * n,
                         time.perf_counter() - t0, 1)
