"""The search's candidates: each split's stage subgraphs, and its estimated step and memory.

``plan_pipeline_graph`` (``search.py``) plans every split of the cluster; this module holds
what it makes of one split:

    StageAssignment ─► stage_works: per stage its subgraph (free ops copied, program outputs
                       nobody computes with stage 0), carried pairs, roles and weights
    SPMD plans      ─► cost_pipeline: per-stage profiles, per-microbatch collectives,
                       cross-stage transfers, the 1F1B step and the memory per stage
                       (``cost.py``'s model) ─► Costed
    an SPMD plan    ─► cost_spmd: the SPMD-only candidate ─► Costed
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from rhino.errors import format_bytes
from rhino.hlo_passes.graph import HloGraph, shape_str
from rhino.hlo_passes.subgraph import CUT_PREFIX, Subgraph, extract_subgraph
from rhino.cluster import Cluster, MeshSplit
from rhino.pipeline.cost import (StageProfile, gather_seconds, in_flight, pipeline_step,
                                 profile_stage, stage_memory, transfer_seconds)
from rhino.pipeline.gradient import GradientBoundary
from rhino.parallel_plan import Candidate, CrossTensor, StageEstimate, StageMemory
from rhino.pipeline.stages import StageAssignment
from rhino.planner.collectives import collective_cost
from rhino.planner.spmd_plan import SpmdPlan
from rhino.vocabulary import Role


# ------------------------------------------------------------------------------ stages
@dataclasses.dataclass
class StageWork:
    """One stage of one stage count: its subgraph and what the cost model needs."""

    index: int
    sub: Subgraph
    carried: tuple[tuple[int, int], ...]
    apply_ops: set[str]
    gradient_ops: set[str]
    forward_ops: set[str]
    backward_ops: set[str]
    batch_dependent: set[str]
    counts: dict[str, int]
    weights: tuple[str, ...]


def stage_works(graph: HloGraph, boundary: GradientBoundary, a: StageAssignment,
                carried: Sequence[tuple[int, int]]) -> list[StageWork]:
    role = a.roles.role
    free = [i for i, r in enumerate(role) if r == Role.FREE]
    # Program outputs nobody assigned computes (e.g. the optimizer's step count) go with
    # stage 0, which copies what they need.
    orphans = [o for o in dict.fromkeys(graph.outputs) if a.stage_of[o] < 0
               and graph.ops[o].opcode != "parameter"]
    dep = boundary.batch_dependent
    grads = set(boundary.gradients)
    state = set(boundary.state_params)
    out = []
    for s in range(a.num_stages):
        ops = a.ops_of(s) + (orphans if s == 0 else [])
        sub = extract_subgraph(graph, ops, duplicate=free, name=f"{graph.name}.stage{s}")
        index = {src: k for k, src in enumerate(sub.origin)}
        cut = {index[i] for i in sub.inputs}
        pairs = tuple((index[o], index[p]) for o, p in carried
                      if o in index and p in index and index[o] not in cut)
        counts = {"forward": sum(1 for i in ops if role[i] == Role.FORWARD),
                  "backward": sum(1 for i in ops if role[i] == Role.BACKWARD),
                  "apply": sum(1 for i in ops if role[i] == Role.APPLY),
                  "copied": len(sub.duplicated)}
        weights = tuple(graph.ops[i].arg.path for i in sub.duplicated
                        if graph.ops[i].opcode == "parameter" and i in state
                        and graph.ops[i].arg is not None)
        out.append(StageWork(
            s, sub, pairs, {graph.ops[i].name for i in ops if role[i] == Role.APPLY},
            {graph.ops[i].name for i in ops if i in grads},
            {graph.ops[i].name for i in ops if role[i] == Role.FORWARD},
            {graph.ops[i].name for i in ops if role[i] == Role.BACKWARD},
            {op.name for op in sub.graph.ops if dep[sub.origin[op.id]]},
            counts, weights))
    return out


# ------------------------------------------------------------------------------ costing
@dataclasses.dataclass
class Costed:
    candidate: Candidate
    split: MeshSplit
    plans: list[SpmdPlan] | None = None
    profiles: list[StageProfile] | None = None
    estimates: list[StageEstimate] | None = None
    memories: list[StageMemory] | None = None
    cross: list[CrossTensor] | None = None
    assignment: StageAssignment | None = None
    works: list[StageWork] | None = None
    free_step: float | None = None   # over the budget: the step estimated with no memory limit


def cost_pipeline(graph: HloGraph, cluster: Cluster, split: MeshSplit, a: StageAssignment,
                  works: list[StageWork], plans: list[SpmdPlan],
                  state_args: Sequence[str], m: int, budget: int | None,
                  lower_bound: float = 0.0) -> Costed:
    p = split.num_stages
    mesh, cost = split.stage_mesh(cluster), split.stage_cost(cluster)
    n = split.devices_per_stage
    profiles = [profile_stage(w.sub.graph, pl, w.apply_ops, w.gradient_ops, state_args,
                              w.forward_ops, w.backward_ops)
                for w, pl in zip(works, plans)]
    # Per-microbatch collectives: batch-independent tensors (weights gathered) keep their size.
    micro = []
    for w, pl in zip(works, plans):
        total = 0.0
        for c in pl.collectives:
            if c.consumer.startswith("<") or c.consumer in w.apply_ops:
                continue
            axes = tuple(mesh.axis_index(x) for x in c.axes)
            scale = m if c.tensor in w.batch_dependent else 1
            total += collective_cost(c.kind, axes, c.bytes / scale, mesh, cost)
        micro.append(total)
    cut_specs = [{q.path[len(CUT_PREFIX):]: q.spec for q in pl.params
                  if q.path.startswith(CUT_PREFIX)} for pl in plans]
    send = [0.0] * p
    step_send = [0.0] * p
    cross: list[CrossTensor] = []
    seen: set[tuple[int, int]] = set()
    for c in a.crossings:
        op = graph.ops[c.op]
        per_mb = c.per_microbatch
        secs = 0.0
        for d in c.dsts:
            if (c.op, d) in seen:
                continue
            seen.add((c.op, d))
            alpha, beta = split.link(cluster, c.src, d)
            nbytes = c.bytes / m if per_mb else c.bytes
            secs += transfer_seconds(nbytes, n, n, alpha, beta)
            secs += gather_seconds(nbytes, cut_specs[d].get(op.name), mesh, cost)
        if per_mb:
            send[c.src] += secs
        else:
            step_send[c.src] += secs
        cross.append(CrossTensor(op.name, shape_str(op.shape), c.bytes, c.src, c.dsts, c.kind,
                                 secs, op.source or ""))
    for pid, stages in a.shared_weights:   # updated on its owner, sent to the others
        nbytes = graph.ops[pid].out_bytes
        for d in stages[1:]:
            alpha, beta = split.link(cluster, stages[0], d)
            step_send[stages[0]] += transfer_seconds(nbytes, n, n, alpha, beta)
    estimates, memories = [], []
    for s, pr in enumerate(profiles):
        est = StageEstimate(pr.microbatch_compute_s(m, cost.program_seconds()), micro[s],
                            send[s], pr.apply_compute_s + cost.program_seconds()
                            + pr.step_comm_s + step_send[s])
        k = in_flight(s, p, m)
        memories.append(stage_memory(pr, k, m))
        estimates.append(est)
    parts = pipeline_step([e.microbatch_s for e in estimates], m, [e.apply_s for e in estimates])
    b = max(range(p), key=lambda s: estimates[s].microbatch_s)
    peak = max(x.total for x in memories)
    over = [s for s, x in enumerate(memories) if budget is not None and x.total > budget]
    note = (f"stage {over[0]} needs {format_bytes(memories[over[0]].total)} > budget "
            f"{format_bytes(budget)}" if over else "")
    if a.solution.rounds > 1:
        note = (note + "; " if note else "") + f"ε relaxed to {a.solution.epsilon:g}"
    cand = Candidate(split.kind, p, split.stage_shape, feasible=not over,
                     step_s=None if over else parts["step"],
                     compute_s=m * estimates[b].compute_s,
                     communication_s=m * estimates[b].communication_s,
                     transfer_s=m * estimates[b].send_s, bubble_s=parts["fill"],
                     apply_s=parts["apply"], memory=int(peak), note=note,
                     lower_bound_s=lower_bound)
    return Costed(cand, split, plans, profiles, estimates, memories, cross, a, works,
                  parts["step"] if over else None)


def cost_spmd(split: MeshSplit, plan: SpmdPlan | None, err: str,
              budget: int | None, lower_bound: float = 0.0) -> Costed:
    if plan is None:
        cand = Candidate("spmd", 1, split.stage_shape, note=err or "no plan",
                         lower_bound_s=lower_bound)
        return Costed(cand, split)
    mem = plan.memory.peak
    feasible = budget is None or mem <= budget
    note = "" if feasible else f"needs {format_bytes(mem)} > budget {format_bytes(budget)}"
    cand = Candidate("spmd", 1, split.stage_shape, feasible=feasible,
                     step_s=plan.step_time_s if feasible else None, compute_s=plan.compute_s,
                     communication_s=plan.communication_s, memory=int(mem), note=note,
                     lower_bound_s=lower_bound)
    return Costed(cand, split, plans=[plan], free_step=None if feasible else plan.step_time_s)
