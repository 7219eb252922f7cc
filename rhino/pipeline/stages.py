"""Pipeline stages of a training step: the stage ILP on the coarsened graph, mapped to ops.

Pass order::

    HloGraph + GradientBoundary (gradient.py)
        │ classify_ops, coarsen (coarsen.py)    roles; units; unit DAG as a StageProblem
        ▼
        │ solve_stage_problem (stage_ilp.py)    ILP §5.1 + bound tightening §5.2
        ▼
    assign_stages      unit stages -> op stages (forward and backward ops: their unit's
                       stage); apply-gradients ops follow the stage holding most of the
                       bytes they read; crossings (tensors between stages, by kind) and
                       weights read on several stages (tied embeddings)
    check_assignment   independent validation

Example:
    >>> import rhino
    >>> from rhino.models import get_model
    >>> m = get_model("gpt", layers=4, hidden=64, heads=2, seq=16, vocab=256)
    >>> g = rhino.ingest(m.step, *m.example_args())
    >>> b = find_gradient_boundary(g)
    >>> a = assign_stages(g, b, 2, StageOptions(epsilon=0.3))
    >>> check_assignment(g, b, a)
    []
    >>> sorted({c.kind for c in a.crossings})
    ['activation', 'gradient']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from rhino.hlo_passes.graph import HloGraph
from rhino.pipeline.coarsen import (Coarsening, OpRoles, classify_ops,
                                    coarsen)
from rhino.pipeline.gradient import (GradientBoundary, find_gradient_boundary,
                                     gradient_weights)
from rhino.pipeline.stage_ilp import StageOptions, StageSolution, solve_stage_problem
from rhino.vocabulary import Role

__all__ = ["Crossing", "StageAssignment", "assign_stages", "assign_given_stages",
           "check_assignment", "find_gradient_boundary", "StageOptions"]


@dataclasses.dataclass(frozen=True)
class Crossing:
    """A tensor produced on one stage and read on others.

    Attributes:
        op: producing op id; name: its name; bytes: its size (whole batch).
        src: producing stage; dsts: reading stages (ascending).
        kind: ``activation`` (forward to forward), ``residual`` (forward value read by a
            backward op elsewhere), ``gradient`` (backward to backward), ``weight-gradient``
            (compute-gradients value read by apply-gradients elsewhere: once per step) or
            ``apply`` (apply-gradients to apply-gradients: once per step).
    """

    op: int
    name: str
    bytes: int
    src: int
    dsts: tuple[int, ...]
    kind: str

    @property
    def per_microbatch(self) -> bool:
        return self.kind in ("activation", "residual", "gradient")


@dataclasses.dataclass(frozen=True)
class StageAssignment:
    """Every op's stage, with what crosses between stages.

    Attributes:
        num_stages: ``d``.
        stage_of: per op: its stage; -1 for free ops (copied where read).
        roles: per op role (``free``/``fwd``/``bwd``/``ag``) and how it was found.
        unit_of: per op, its unit (-1: free or apply-gradients).
        num_units: units of the coarsened problem; granularity: how they were made.
        crossings: tensors between stages.
        shared_weights: ``(parameter op id, (owner stage, other readers...))`` for weights
            updated on one stage and read on others (tied embeddings): sent after each update.
        flops: per stage ``(forward, backward, apply)`` FLOPs (whole batch).
        solution: the ILP solution on the units.
    """

    num_stages: int
    stage_of: tuple[int, ...]
    roles: OpRoles
    unit_of: tuple[int, ...]
    num_units: int
    granularity: str
    crossings: tuple[Crossing, ...]
    shared_weights: tuple[tuple[int, tuple[int, ...]], ...]
    flops: tuple[tuple[float, float, float], ...]
    solution: StageSolution

    def ops_of(self, stage: int) -> list[int]:
        """Op ids assigned to ``stage`` (free ops excluded)."""
        return [i for i, s in enumerate(self.stage_of) if s == stage]

    def summary(self) -> dict[str, Any]:
        s = self.solution
        return {"num_stages": self.num_stages, "units": self.num_units,
                "granularity": self.granularity, "roles": self.roles.method,
                "status": s.status, "epsilon": s.epsilon, "cut_bytes": s.cut_bytes,
                "solve_s": s.solve_s, "imbalance": _imbalance([f + b for f, b, _ in
                                                               self.flops])}


def _imbalance(loads: Sequence[float]) -> float:
    t = sum(loads) / len(loads) if loads else 0.0
    return max(abs(x - t) for x in loads) / t if t > 0 else 0.0


def _map_apply(graph: HloGraph, roles: OpRoles, stage_of: list[int]) -> None:
    """Apply-gradients ops follow the stage holding most of the bytes they read."""
    for op in graph.ops:
        i = op.id
        if roles.role[i] != Role.APPLY:
            continue
        weight: dict[int, int] = {}
        for o in op.operands:
            s = stage_of[o]
            if s >= 0:
                weight[s] = weight.get(s, 0) + max(1, graph.ops[o].out_bytes)
        stage_of[i] = min(weight, key=lambda s: (-weight[s], s)) if weight else 0


def _crossings(graph: HloGraph, roles: OpRoles, stage_of: Sequence[int]) -> list[Crossing]:
    role = roles.role
    out = []
    for op in graph.ops:
        i = op.id
        s = stage_of[i]
        if s < 0:
            continue
        by_kind: dict[str, set[int]] = {}
        for j in graph.users[i]:
            t = stage_of[j]
            if t < 0 or t == s:
                continue
            a, b = role[i], role[j]
            if b == Role.APPLY:
                kind = "apply" if a == Role.APPLY else "weight-gradient"
            elif a == Role.FORWARD:
                kind = "activation" if b == Role.FORWARD else "residual"
            else:
                kind = "gradient"
            by_kind.setdefault(kind, set()).add(t)
        for kind, dsts in sorted(by_kind.items()):
            out.append(Crossing(i, op.name, int(op.out_bytes), s, tuple(sorted(dsts)), kind))
    return out


def assign_stages(graph: HloGraph, boundary: GradientBoundary, num_stages: int,
                  options: StageOptions = StageOptions(), granularity: str = "auto",
                  coarsening: Coarsening | None = None) -> StageAssignment:
    """Split a training step into ``num_stages`` pipeline stages.

    Args:
        graph: the training-step graph.
        boundary: its gradient boundary (``find_gradient_boundary``).
        num_stages: ``d`` ≥ 1.
        options: ILP options (ε, bound tightening, time limit, cost weights).
        granularity: ``auto``, ``layer``, ``segment`` or ``op`` (see ``coarsen``).
        coarsening: a ``coarsen`` result to reuse across stage counts.

    Returns:
        The ``StageAssignment``.

    Raises:
        StageAssignmentError: too few units or no feasible split.
    """
    roles = classify_ops(graph, boundary)
    if coarsening is None:
        coarsening = coarsen(graph, roles, granularity, boundary.state_params,
                             gradient_weights=gradient_weights(graph, boundary))
    problem = dataclasses.replace(coarsening.problem, num_stages=num_stages)
    sol = solve_stage_problem(problem, options)
    return _assignment(graph, boundary, roles, coarsening, num_stages, sol)


def _weight_paths(graph: HloGraph, boundary: GradientBoundary, roles: OpRoles
                  ) -> list[frozenset[int]]:
    """Per op, the state parameters it reads directly or through free ops (``wte.T``)."""
    state = set(boundary.state_params)
    via: list[frozenset[int]] = [frozenset()] * len(graph.ops)
    for op in graph.ops:
        i = op.id
        got = frozenset().union(*(via[o] for o in op.operands)) if op.operands else frozenset()
        if i in state:
            via[i] = frozenset((i,))
        elif roles.role[i] == Role.FREE:
            via[i] = got
    return via


def forward_weights(graph: HloGraph, boundary: GradientBoundary) -> set[str]:
    """Pytree paths of the state parameters the forward pass reads (directly or through
    free ops): the weights a hand-given split (``assign_given_stages``) can place."""
    roles = classify_ops(graph, boundary)
    via = _weight_paths(graph, boundary, roles)
    out: set[str] = set()
    for op in graph.ops:
        if roles.role[op.id] == Role.FORWARD:
            for q in via[op.id].union(*(via[o] for o in op.operands)):
                if graph.ops[q].arg is not None:
                    out.add(graph.ops[q].arg.path)
    return out


def assign_given_stages(graph: HloGraph, boundary: GradientBoundary,
                        weight_stages: dict[str, int], options: StageOptions = StageOptions(),
                        granularity: str = "auto", coarsening: Coarsening | None = None
                        ) -> StageAssignment:
    """A hand-given split: weights (by pytree path prefix) -> stage; the rest follows.

    Each unit of the coarsened graph goes to the latest stage among the weights it reads
    first (a weight belongs to its first forward reader; the longest matching prefix of
    each weight's path gives its stage; e.g.
    ``{"params['wte']": 0, "params['layers'][0]": 0, "params['layers'][1]": 1}``), at least
    that of the units it reads from; units reading no listed weight follow their inputs.
    Backward ops go with their forward counterparts, as in ``assign_stages``.

    Raises:
        StageAssignmentError: a stage out of range or left empty, no listed weight found,
            or an assignment the data flow cannot honor (a weight on an earlier stage than
            values it reads).
    """
    from rhino.pipeline.stage_ilp import StageAssignmentError

    if not weight_stages:
        raise StageAssignmentError("given stages: expected {weight path prefix: stage}, "
                                   "found an empty mapping")
    num_stages = max(weight_stages.values()) + 1
    bad = {k: v for k, v in weight_stages.items() if not isinstance(v, int) or v < 0}
    if bad:
        raise StageAssignmentError(f"given stages: expected stages >= 0, found {bad}")
    roles = classify_ops(graph, boundary)
    if coarsening is None:
        coarsening = coarsen(graph, roles, granularity, boundary.state_params,
                             gradient_weights=gradient_weights(graph, boundary))
    problem = dataclasses.replace(coarsening.problem, num_stages=num_stages)
    via = _weight_paths(graph, boundary, roles)

    def stage_of_weight(q: int) -> int | None:
        path = graph.ops[q].arg.path if graph.ops[q].arg is not None else graph.ops[q].name
        best = max((k for k in weight_stages if path.startswith(k)), key=len, default=None)
        return None if best is None else weight_stages[best]

    # A weight is placed with its first forward reader (units are numbered in topological
    # order); later readers (a tied embedding's output projection) may sit on later stages.
    first: dict[int, int] = {}
    for u, members in enumerate(coarsening.units):
        for i in members:
            if roles.role[i] != Role.FORWARD:
                continue
            for q in via[i] | frozenset(w for o in graph.ops[i].operands for w in via[o]):
                first[q] = min(first.get(q, u), u)
    used = {k: False for k in weight_stages}
    wanted: list[int | None] = [None] * problem.num_units
    for q, u in first.items():
        st = stage_of_weight(q)
        if st is None:
            continue
        path = graph.ops[q].arg.path if graph.ops[q].arg else ""
        for k in used:
            if path.startswith(k):
                used[k] = True
        wanted[u] = st if wanted[u] is None else max(wanted[u], st)
    missing = [k for k, hit in used.items() if not hit]
    if missing:
        raise StageAssignmentError(f"given stages: expected weights whose paths start with "
                                   f"{missing}, found none read by the forward pass")
    preds: dict[int, list[int]] = {}
    for a, b in problem.edges:
        preds.setdefault(b, []).append(a)
    stage = [0] * problem.num_units
    for u in problem.topological_order():
        before = max((stage[a] for a in preds.get(u, ())), default=0)
        if wanted[u] is not None and wanted[u] < before:
            raise StageAssignmentError(
                f"given stages: unit {problem.names[u]!r} has weights on stage {wanted[u]} "
                f"but reads values computed on stage {before}: forward data must flow to "
                f"the same or later stages")
        stage[u] = before if wanted[u] is None else wanted[u]
    empty = sorted(set(range(num_stages)) - set(stage))
    if empty:
        raise StageAssignmentError(f"given stages: expected every stage 0..{num_stages - 1} "
                                   f"to hold some layer, found stages {empty} empty")
    loads = problem.loads(stage)
    sol = StageSolution(tuple(stage), "given", problem.objective(stage, options),
                        problem.cut_bytes(stage), tuple(loads), _imbalance(loads), False, 0,
                        0, 0.0, 0)
    return _assignment(graph, boundary, roles, coarsening, num_stages, sol)


def _assignment(graph: HloGraph, boundary: GradientBoundary, roles: OpRoles,
                coarsening: Coarsening, num_stages: int, sol: StageSolution
                ) -> StageAssignment:
    """Unit stages -> op stages, apply ops, crossings, shared weights, FLOPs."""
    stage_of = [sol.stage_of[u] if u >= 0 else -1 for u in coarsening.unit_of]
    _map_apply(graph, roles, stage_of)
    crossings = _crossings(graph, roles, stage_of)
    # Weights each stage reads, directly or through copied (free) ops such as ``wte.T``.
    readers: dict[int, set[int]] = {}
    state = set(boundary.state_params)
    via = _weight_paths(graph, boundary, roles)
    for op in graph.ops:
        i = op.id
        if i not in state and roles.role[i] != Role.FREE and stage_of[i] >= 0:
            for w in frozenset().union(*(via[o] for o in op.operands)):
                readers.setdefault(w, set()).add(stage_of[i])
    # A weight updated on one stage (its owner) and read on others is sent after the update;
    # state that free ops update (a step count) is recomputed on every stage instead.
    from rhino.planner.build import carried_pairs
    owner = {p: stage_of[o] for o, p in carried_pairs(graph) if stage_of[o] >= 0}
    shared = tuple((p, (owner[p],) + tuple(sorted(s - {owner[p]})))
                   for p, s in sorted(readers.items()) if p in owner and s - {owner[p]})
    flops = [[0.0, 0.0, 0.0] for _ in range(num_stages)]
    col = {Role.FORWARD: 0, Role.BACKWARD: 1, Role.APPLY: 2}
    for i, s in enumerate(stage_of):
        if s >= 0:
            flops[s][col[roles.role[i]]] += graph.ops[i].flops
    return StageAssignment(num_stages, tuple(stage_of), roles, coarsening.unit_of,
                           coarsening.problem.num_units, coarsening.granularity,
                           tuple(crossings), shared, tuple(tuple(f) for f in flops), sol)


def check_assignment(graph: HloGraph, boundary: GradientBoundary,
                     assignment: StageAssignment) -> list[str]:
    """Independent checks of an assignment; returns the violations (empty: valid).

    Checked: batch-dependent ops have a stage in range and the rest none; forward edges
    never go to an earlier stage and backward edges never to a later one; the crossings are
    exactly the cut edges; units balance within the solution's ε; every op of a unit sits
    on the unit's stage.
    """
    errs: list[str] = []
    d = assignment.num_stages
    st = assignment.stage_of
    role = assignment.roles.role
    dep = boundary.batch_dependent
    for op in graph.ops:
        i = op.id
        if dep[i] and op.opcode != "parameter":
            if not 0 <= st[i] < d:
                errs.append(f"{op.name}: expected a stage in 0..{d - 1}, found {st[i]}")
        elif st[i] != -1:
            errs.append(f"{op.name}: free op expected stage -1, found {st[i]}")
    for op in graph.ops:
        j = op.id
        for i in op.operands:
            if st[i] < 0 or st[j] < 0:
                continue
            if role[i] == Role.FORWARD and role[j] == Role.FORWARD and st[j] < st[i]:
                errs.append(f"forward edge {graph.ops[i].name} -> {op.name}: stage {st[i]} -> "
                            f"{st[j]}")
            if role[i] == Role.BACKWARD and role[j] == Role.BACKWARD and st[j] > st[i]:
                errs.append(f"backward edge {graph.ops[i].name} -> {op.name}: stage {st[i]} "
                            f"-> {st[j]}")
    want = {(c.op, c.src, c.dsts) for c in _crossings(graph, assignment.roles, st)}
    have = {(c.op, c.src, c.dsts) for c in assignment.crossings}
    if want != have:
        errs.append(f"crossings: expected {len(want)} recomputed, found {len(have)} "
                    f"({len(want ^ have)} differ)")
    unit_stage: dict[int, int] = {}
    for i, u in enumerate(assignment.unit_of):
        if u >= 0:
            if unit_stage.setdefault(u, st[i]) != st[i]:
                errs.append(f"unit {u}: ops on stages {unit_stage[u]} and {st[i]}")
    sol = assignment.solution
    loads = [0.0] * d
    for i, u in enumerate(assignment.unit_of):
        if u >= 0:
            loads[st[i]] += graph.ops[i].flops
    if d > 1 and _imbalance(loads) > sol.epsilon + 1e-6:
        errs.append(f"balance: expected imbalance <= ε {sol.epsilon}, found "
                    f"{_imbalance(loads):.4f}")
    return errs
