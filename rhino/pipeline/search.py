"""The search and the controller: every split of the cluster, costed, and the best chosen.

Phases (the paper's Fig. 2: enumerate mesh configurations, plan each in parallel, pick)::

    graph ─► gradient boundary ─► roles + coarsening (once)
          ─► for each stage count p > 1: stage ILP (§5, in parallel)
          ─► for each split (p × stage mesh): stage subgraphs -> SPMD plan per stage
             (in parallel; identical stages planned once) ; p = 1: SPMD plan of the graph;
             in waves of increasing p: a wave whose lower bound ``(m + p - 1) / m ·
             FLOPs / (F · N)`` exceeds the best step found is pruned unplanned
          ─► per candidate: profiles, transfers, 1F1B step, memory (cost.py); a stage over
             the memory budget is re-planned with the SPMD planner's memory constraint
          ─► controller: the feasible candidate with the least estimated step time

Example:
    >>> import rhino
    >>> from rhino.models import get_model
    >>> m = get_model("mlp", batch=64, hidden=64, layers=2)
    >>> g = rhino.ingest(m.step, *m.example_args())
    >>> p = plan_pipeline_graph(g, Cluster.parse("1x4"), PipelineOptions(max_stages=2))
    >>> sorted({c.kind for c in p.candidates})
    ['hybrid', 'spmd']
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import threading
import time
import warnings
from typing import Any, Callable, Sequence

from rhino.errors import InfeasiblePlanError, RhinoError, format_bytes
from rhino.hlo_passes.graph import HloGraph, shape_str
from rhino.hlo_passes.subgraph import CUT_PREFIX, Subgraph, extract_subgraph, structural_key
from rhino.pipeline.cluster import Cluster, MeshSplit, enumerate_splits
from rhino.pipeline.coarsen import AG, BWD, FREE, FWD, classify_ops, coarsen
from rhino.pipeline.cost import (StageProfile, gather_seconds, in_flight, pipeline_step,
                                 profile_stage, transfer_seconds)
from rhino.pipeline.gradient import (BoundaryOptions, GradientBoundary, find_gradient_boundary,
                                     gradient_weights)
from rhino.pipeline.plan import (Candidate, CrossTensor, PipelinePlan, SearchTimes,
                                 StageEstimate, StageMemory, StagePlan)
from rhino.pipeline.stage_ilp import StageAssignmentError, StageOptions
from rhino.pipeline.stages import StageAssignment, assign_given_stages, assign_stages
from rhino.planner.api import PlanOptions, plan_graph
from rhino.planner.build import BuildOptions, carried_pairs
from rhino.planner.collectives import collective_cost
from rhino.planner.mesh import AbstractMesh
from rhino.planner.plan import ExecutionPlan

KINDS = ("spmd", "pipeline", "hybrid")
EXECUTORS = ("auto", "thread", "process", "serial")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How ``plan_pipeline_graph`` searches.

    Attributes:
        num_microbatches: ``m`` for 1F1B (the SPMD-only candidate runs the whole batch).
        epsilon: stage imbalance tolerance of the stage ILP (§5.2).
        max_stages: the most pipeline stages (default: every device).
        num_stages: only splits with exactly this many stages (e.g. to run a pipeline of
            a given depth); None: any count up to ``max_stages``.
        weight_stages: a hand-given split instead of the stage ILP: ``{weight pytree path
            prefix: stage}`` (``stages.assign_given_stages``); implies ``num_stages``.
        kinds: which of ``spmd``, ``pipeline``, ``hybrid`` to weigh.
        batch_args: argument names that carry the batch (default: the non-state ones).
        boundary_method: ``auto``, ``marker`` or ``autodiff`` (see ``gradient.py``).
        granularity: coarsening of the stage ILP (see ``coarsen.py``).
        stage: stage-ILP options; its ε is replaced by ``epsilon`` and its balance weight
            by the cluster's compute/transfer ratio (``balance_weight=None``).
        balance_weight: override of the ILP balance weight (None: from the cluster).
        spmd: options of the per-stage SPMD planner (its memory budget is managed here).
        two_d: also weigh 2-D stage meshes.
        memory_budget: bytes per device (default: the cluster's device memory).
        workers: parallel workers (0: one per CPU).
        executor: ``process`` (forked workers; true parallelism for the pure-Python SPMD
            planner), ``thread``, ``serial``, or ``auto``: processes where ``fork`` exists
            and the graph has over 3000 ops, else threads.
        keep_spmd: keep each stage's ``ExecutionPlan`` in the result.
        prune: skip the candidates of a stage count whose lower bound (perfectly scaled
            compute with the 1F1B bubble) exceeds the best step already found.
    """

    num_microbatches: int = 8
    epsilon: float = 0.1
    max_stages: int | None = None
    num_stages: int | None = None
    weight_stages: Any = None
    kinds: tuple[str, ...] = KINDS
    batch_args: tuple[str, ...] | None = None
    boundary_method: str = "auto"
    granularity: str = "auto"
    stage: StageOptions = StageOptions()
    balance_weight: float | None = None
    spmd: PlanOptions = PlanOptions(validate=False)
    two_d: bool = True
    memory_budget: int | None = None
    workers: int = 0
    executor: str = "auto"
    keep_spmd: bool = True
    prune: bool = True

    def __post_init__(self):
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches: expected >= 1, found {self.num_microbatches}")
        if not self.epsilon >= 0:
            raise ValueError(f"epsilon: expected >= 0, found {self.epsilon!r}")
        if self.max_stages is not None and self.max_stages < 1:
            raise ValueError(f"max_stages: expected >= 1, found {self.max_stages}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages: expected >= 1, found {self.num_stages}")
        if self.weight_stages is not None:
            if not self.weight_stages or not all(
                    isinstance(v, int) and v >= 0 for v in self.weight_stages.values()):
                raise ValueError(f"weight_stages: expected {{path prefix: stage >= 0}}, found "
                                 f"{self.weight_stages!r}")
            n = max(self.weight_stages.values()) + 1
            if self.num_stages not in (None, n):
                raise ValueError(f"num_stages: expected {n} (from weight_stages), found "
                                 f"{self.num_stages}")
            object.__setattr__(self, "weight_stages", dict(self.weight_stages))
            object.__setattr__(self, "num_stages", n)
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise ValueError(f"kinds: expected a non-empty subset of {KINDS}, found "
                             f"{self.kinds!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor: expected one of {EXECUTORS}, found {self.executor!r}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget: expected > 0 bytes, found {self.memory_budget}")


# ------------------------------------------------------------------------------ SPMD pool
def _plan_task(graph: HloGraph, mesh: AbstractMesh, options: PlanOptions
               ) -> tuple[ExecutionPlan | None, str, float]:
    t0 = time.perf_counter()
    try:
        return plan_graph(graph, mesh, options), "", time.perf_counter() - t0
    except InfeasiblePlanError as e:
        return None, str(e), time.perf_counter() - t0


def _rename_plan(plan: ExecutionPlan, src: HloGraph, dst: HloGraph) -> ExecutionPlan:
    """A plan made for ``src`` applied to the structurally identical ``dst``."""
    names = {a.name: b.name for a, b in zip(src.ops, dst.ops)}
    paths = {}
    for a, b in zip(src.params, dst.params):
        pa, pb = src.ops[a].arg, dst.ops[b].arg
        paths[pa.path if pa else src.ops[a].name] = pb.path if pb else dst.ops[b].name
    ops = tuple(dataclasses.replace(o, name=names.get(o.name, o.name)) for o in plan.ops)
    params = tuple(dataclasses.replace(p, path=paths.get(p.path, p.path)) for p in plan.params)
    colls = tuple(dataclasses.replace(c, tensor=names.get(c.tensor, c.tensor),
                                      consumer=names.get(c.consumer, c.consumer))
                  for c in plan.collectives)
    unplanned = tuple(dataclasses.replace(u, name=names.get(u.name, u.name))
                      for u in plan.unplanned)
    return dataclasses.replace(plan, program=dst.name, ops=ops, params=params,
                               collectives=colls, unplanned=unplanned)


def _picklable(options: PlanOptions) -> dict[str, Any]:
    """PlanOptions as plain data (its BuildOptions holds a mappingproxy, which does not
    pickle) for worker processes."""
    build = {f.name: getattr(options.build, f.name) for f in dataclasses.fields(BuildOptions)}
    build["pinned"] = dict(build["pinned"])
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(PlanOptions)}
    fields["build"] = build
    return fields


def _plan_task_in_worker(graph: HloGraph, mesh: AbstractMesh, fields: dict[str, Any]
                         ) -> tuple[ExecutionPlan | None, str, float]:
    fields = dict(fields, build=BuildOptions(**fields["build"]))
    return _plan_task(graph, mesh, PlanOptions(**fields))


class _SpmdPool:
    """Runs SPMD plans in parallel, planning structurally identical stages once.

    ``process`` workers are forked (the planner is pure Python: threads would share one
    core under the GIL); ``thread`` and ``serial`` run in this process.
    """

    def __init__(self, workers: int, executor: str):
        self.lock = threading.Lock()
        self.futures: dict[tuple, tuple[cf.Future, HloGraph]] = {}
        self.seconds = 0.0
        self.made = 0
        self.processes = False
        if executor == "process" and workers > 1:
            import multiprocessing as mp
            self.pool: cf.Executor | None = cf.ProcessPoolExecutor(
                workers, mp_context=mp.get_context("fork"))
            self.processes = True
        elif executor == "serial" or workers <= 1:
            self.pool = None
        else:
            self.pool = cf.ThreadPoolExecutor(workers)

    def submit(self, graph: HloGraph, mesh: AbstractMesh, options: PlanOptions,
               extra: str = "") -> tuple[cf.Future, HloGraph]:
        key = (structural_key(graph, extra), mesh, repr(options))
        with self.lock:
            got = self.futures.get(key)
            if got is None:
                if self.pool is None:
                    fut: cf.Future = cf.Future()
                    fut.set_result(_plan_task(graph, mesh, options))
                elif self.processes:
                    # Workers fork lazily here. JAX warns at every fork of a process that
                    # imported it; the workers only run the pure-Python planner, never JAX.
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
                        fut = self.pool.submit(_plan_task_in_worker, graph, mesh,
                                               _picklable(options))
                else:
                    fut = self.pool.submit(_plan_task, graph, mesh, options)
                got = (fut, graph)
                self.futures[key] = got
                self.made += 1
        return got

    def result(self, handle: tuple[cf.Future, HloGraph], graph: HloGraph
               ) -> tuple[ExecutionPlan | None, str]:
        fut, src = handle
        plan, err, secs = fut.result()
        with self.lock:
            if not getattr(fut, "_rhino_counted", False):
                self.seconds += secs
                fut._rhino_counted = True   # type: ignore[attr-defined]
        if plan is not None and src is not graph:
            plan = _rename_plan(plan, src, graph)
        return plan, err

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------------------ stages
@dataclasses.dataclass
class _StageWork:
    """One stage of one stage count: its subgraph and what the cost model needs."""

    index: int
    sub: Subgraph
    carried: tuple[tuple[int, int], ...]
    apply_ops: set[str]
    gradient_ops: set[str]
    batch_dependent: set[str]
    counts: dict[str, int]
    weights: tuple[str, ...]


def _stage_works(graph: HloGraph, boundary: GradientBoundary, a: StageAssignment,
                 carried: Sequence[tuple[int, int]]) -> list[_StageWork]:
    role = a.roles.role
    free = [i for i, r in enumerate(role) if r == FREE]
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
        counts = {"forward": sum(1 for i in ops if role[i] == FWD),
                  "backward": sum(1 for i in ops if role[i] == BWD),
                  "apply": sum(1 for i in ops if role[i] == AG),
                  "copied": len(sub.duplicated)}
        weights = tuple(graph.ops[i].arg.path for i in sub.duplicated
                        if graph.ops[i].opcode == "parameter" and i in state
                        and graph.ops[i].arg is not None)
        out.append(_StageWork(
            s, sub, pairs, {graph.ops[i].name for i in ops if role[i] == AG},
            {graph.ops[i].name for i in ops if i in grads},
            {op.name for op in sub.graph.ops if dep[sub.origin[op.id]]},
            counts, weights))
    return out


# ------------------------------------------------------------------------------ costing
@dataclasses.dataclass
class _Costed:
    candidate: Candidate
    split: MeshSplit
    plans: list[ExecutionPlan] | None = None
    profiles: list[StageProfile] | None = None
    estimates: list[StageEstimate] | None = None
    memories: list[StageMemory] | None = None
    cross: list[CrossTensor] | None = None
    assignment: StageAssignment | None = None
    works: list[_StageWork] | None = None


def _cost_pipeline(graph: HloGraph, cluster: Cluster, split: MeshSplit, a: StageAssignment,
                   works: list[_StageWork], plans: list[ExecutionPlan],
                   state_args: Sequence[str], m: int, budget: int | None,
                   lower_bound: float = 0.0) -> _Costed:
    p = split.num_stages
    mesh = split.stage_mesh(cluster)
    n = split.devices_per_stage
    profiles = [profile_stage(w.sub.graph, pl, w.apply_ops, w.gradient_ops, state_args)
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
            total += collective_cost(c.kind, axes, c.bytes / scale, mesh)
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
            secs += gather_seconds(nbytes, cut_specs[d].get(op.name), mesh)
        if per_mb:
            send[c.src] += secs
        else:
            step_send[c.src] += secs
        cross.append(CrossTensor(op.name, shape_str(op.shape), c.bytes, c.src, c.dsts, c.kind,
                                 secs))
    for pid, stages in a.shared_weights:   # updated on its owner, sent to the others
        nbytes = graph.ops[pid].out_bytes
        for d in stages[1:]:
            alpha, beta = split.link(cluster, stages[0], d)
            step_send[stages[0]] += transfer_seconds(nbytes, n, n, alpha, beta)
    estimates, memories = [], []
    for s, pr in enumerate(profiles):
        est = StageEstimate(pr.compute_s / m, micro[s], send[s],
                            pr.apply_compute_s + pr.step_comm_s + step_send[s])
        k = in_flight(s, p, m)
        per_mb = (pr.activation_bytes + pr.input_bytes) // m
        total = pr.state_bytes + pr.gradient_bytes + k * per_mb
        estimates.append(est)
        memories.append(StageMemory(pr.state_bytes, pr.gradient_bytes, per_mb, k, total))
    parts = pipeline_step([e.microbatch_s for e in estimates], m, [e.apply_s for e in estimates])
    b = max(range(p), key=lambda s: estimates[s].microbatch_s)
    peak = max(x.total for x in memories)
    over = [s for s, x in enumerate(memories) if budget is not None and x.total > budget]
    note = (f"stage {over[0]} needs {format_bytes(memories[over[0]].total)} > budget "
            f"{format_bytes(budget)}" if over else "")
    if a.solution.rounds > 1:
        note = (note + "; " if note else "") + f"ε relaxed to {a.solution.epsilon:g}"
    cand = Candidate(split.kind, p, split.stage_shape, not over,
                     None if over else parts["step"], m * estimates[b].compute_s,
                     m * estimates[b].communication_s, m * estimates[b].send_s, parts["fill"],
                     parts["apply"], int(peak), note, lower_bound)
    return _Costed(cand, split, plans, profiles, estimates, memories, cross, a, works)


def _cost_spmd(split: MeshSplit, plan: ExecutionPlan | None, err: str,
               budget: int | None, lower_bound: float = 0.0) -> _Costed:
    if plan is None:
        cand = Candidate("spmd", 1, split.stage_shape, False, None, 0.0, 0.0, 0.0, 0.0, 0.0, 0,
                         err or "no plan", lower_bound)
        return _Costed(cand, split)
    mem = plan.memory.peak
    feasible = budget is None or mem <= budget
    note = "" if feasible else f"needs {format_bytes(mem)} > budget {format_bytes(budget)}"
    cand = Candidate("spmd", 1, split.stage_shape, feasible,
                     plan.step_time_s if feasible else None, plan.compute_s,
                     plan.communication_s, 0.0, 0.0, 0.0, int(mem), note, lower_bound)
    return _Costed(cand, split, plans=[plan])


# ------------------------------------------------------------------------------ controller
def _decision(winner: Candidate, cands: Sequence[Candidate]) -> str:
    ms = 1e3
    parts = [f"{winner.kind} pp={winner.num_stages} × ({'x'.join(map(str, winner.stage_mesh))})"
             f" has the least estimated step time, {ms * winner.step_s:.3f} ms"]
    for kind in KINDS:
        if kind == winner.kind:
            continue
        others = [c for c in cands if c.kind == kind]
        feas = [c for c in others if c.feasible]
        if feas:
            best = min(feas, key=lambda c: c.step_s)
            comps = {"compute": best.compute_s - winner.compute_s,
                     "communication": best.communication_s - winner.communication_s,
                     "transfers": best.transfer_s - winner.transfer_s,
                     "bubble": best.bubble_s - winner.bubble_s,
                     "apply/sync": best.apply_s - winner.apply_s}
            top = max(comps, key=lambda k: comps[k])
            parts.append(f"best {kind} pp={best.num_stages} × "
                         f"({'x'.join(map(str, best.stage_mesh))}) {ms * best.step_s:.3f} ms "
                         f"({best.step_s / winner.step_s:.2f}×; mostly +{ms * comps[top]:.3f}"
                         f" ms of {top})")
        elif others and all(c.note.startswith("pruned") for c in others):
            lb = min(c.lower_bound_s for c in others)
            parts.append(f"every {kind} candidate pruned: even with perfect scaling its "
                         f"compute and 1F1B bubble take at least {ms * lb:.3f} ms")
        elif others:
            parts.append(f"no {kind} candidate fits ({others[0].note})")
    return "; ".join(parts)


def _lower_bound(flops: float, num_stages: int, num_microbatches: int,
                 cluster: Cluster) -> float:
    """No plan of ``p`` stages beats perfectly scaled compute with the 1F1B bubble:
    ``(m + p - 1) / m · flops / (F · N)``."""
    m = max(1, num_microbatches)
    return (m + num_stages - 1) / m * flops / (cluster.flops_per_s * cluster.num_devices)


def _balance_weight(graph: HloGraph, a_problem_mean: float, cluster: Cluster,
                    split: MeshSplit) -> float:
    """Compute time of a perfectly balanced stage over the transfer time of a mean tensor."""
    total = graph.total_flops
    n = split.devices_per_stage
    t_stage = total / split.num_stages / (cluster.flops_per_s * n)
    beta = max(cluster.beta_intra, cluster.beta_inter if split.num_stages > 1 else 0.0)
    t_tensor = beta * a_problem_mean / n
    if t_tensor <= 0:
        return 1000.0
    return float(min(1000.0, max(0.05, t_stage / t_tensor)))


def _progress(progress: Callable[[str], None] | None) -> Callable[[str], None]:
    return progress or (lambda msg: None)


def plan_pipeline_graph(graph: HloGraph, cluster: Cluster,
                        options: PipelineOptions = PipelineOptions(),
                        progress: Callable[[str], None] | None = None,
                        ingest_s: float = 0.0) -> PipelinePlan:
    """Weigh SPMD-only, pipeline-only and hybrid plans of a training step on a cluster.

    Args:
        graph: the training step's graph.
        cluster: hosts × devices per host with link speeds, FLOP/s and memory.
        options: the search options.
        progress: called with a line of text at each phase.
        ingest_s: seconds spent ingesting (reported).

    Returns:
        The ``PipelinePlan`` of the fastest feasible candidate, listing all of them.

    Raises:
        GradientBoundaryError: pipeline candidates were asked for and the training step's
            gradient boundary cannot be found.
        InfeasiblePlanError: no candidate fits in device memory.
    """
    say = _progress(progress)
    t_start = time.perf_counter()
    m = options.num_microbatches
    budget = options.memory_budget if options.memory_budget is not None else cluster.memory_bytes
    most = options.max_stages if options.num_stages is None else options.num_stages
    splits = [s for s in enumerate_splits(cluster, most, options.two_d)
              if s.kind in options.kinds
              and options.num_stages in (None, s.num_stages)]
    if not splits:
        count = (f"exactly {options.num_stages}" if options.num_stages is not None
                 else f"at most {options.max_stages}")
        raise RhinoError(f"pipeline search: expected some split of cluster {cluster} of kinds "
                         f"{options.kinds} with {count} stages, found none")
    stage_counts = sorted({s.num_stages for s in splits if s.num_stages > 1})
    t0 = time.perf_counter()
    boundary = roles = coarse = None
    if stage_counts:
        boundary = find_gradient_boundary(graph, BoundaryOptions(options.batch_args,
                                                                 options.boundary_method))
        say(f"gradient boundary ({boundary.method}): {len(boundary.compute)} compute-gradients"
            f" ops, {len(boundary.apply)} apply-gradients ops, {len(boundary.gradients)} "
            f"gradients")
    t1 = time.perf_counter()
    if boundary is not None:
        roles = classify_ops(graph, boundary)
        coarse = coarsen(graph, roles, options.granularity, boundary.state_params,
                         gradient_weights=gradient_weights(graph, boundary))
        say(f"coarsened the forward/backward graph into {coarse.problem.num_units} units "
            f"({coarse.granularity})")
    t2 = time.perf_counter()
    workers = options.workers or os.cpu_count() or 1
    executor = options.executor
    if executor == "auto":
        import multiprocessing as mp
        executor = ("process" if len(graph.ops) > 3000 and "fork" in mp.get_all_start_methods()
                    else "thread")
    pool = _SpmdPool(workers, executor)
    carried = carried_pairs(graph)
    state_args = boundary.state_args if boundary is not None else tuple(
        dict.fromkeys(a.path.split("[", 1)[0] for a in (graph.ops[q].arg for q in graph.params)
                      if a is not None))
    ilp_s = 0.0
    assignments: dict[int, StageAssignment | str] = {}
    try:
        # Stage ILPs, one per stage count (threads: highspy releases the GIL).
        def solve(p: int) -> tuple[int, StageAssignment | str, float]:
            sp = next(s for s in splits if s.num_stages == p)
            weight = options.balance_weight
            if weight is None:
                weight = _balance_weight(graph, coarse.problem.mean_tensor_bytes(), cluster, sp)
            opts = dataclasses.replace(options.stage, epsilon=options.epsilon,
                                       balance_weight=weight)
            t = time.perf_counter()
            try:
                if options.weight_stages is not None:
                    a = assign_given_stages(graph, boundary, options.weight_stages, opts,
                                            coarsening=coarse)
                else:
                    a = assign_stages(graph, boundary, p, opts, coarsening=coarse)
            except StageAssignmentError as e:
                return p, str(e), time.perf_counter() - t
            return p, a, time.perf_counter() - t

        if stage_counts:
            say(f"stage ILPs for {stage_counts} stages (ε {options.epsilon:g})")
            with cf.ThreadPoolExecutor(max(1, min(workers, len(stage_counts)))) as ex:
                for p, a, secs in ex.map(solve, stage_counts):
                    assignments[p] = a
                    ilp_s += secs
        works = {p: _stage_works(graph, boundary, a, carried)
                 for p, a in assignments.items() if isinstance(a, StageAssignment)}
        # SPMD plans, in waves of equal stage count by increasing lower bound; a wave
        # whose lower bound exceeds the best step found is pruned without planning.
        say(f"SPMD plans for {len(splits)} candidate splits ({executor}, {workers} workers)")
        spmd_opts = dataclasses.replace(options.spmd, memory_budget=None)
        cg_flops = (sum(graph.ops[i].flops for i in boundary.compute)
                    if boundary is not None else graph.total_flops)
        cost_s = 0.0
        best_step = float("inf")
        by_k: dict[int, _Costed] = {}
        for p in sorted({sp.num_stages for sp in splits}):
            wave = [k for k, sp in enumerate(splits) if sp.num_stages == p]
            lb = _lower_bound(graph.total_flops if p == 1 else cg_flops, p,
                              1 if p == 1 else m, cluster)
            a = assignments.get(p)
            if p > 1 and not isinstance(a, StageAssignment):
                for k in wave:
                    sp = splits[k]
                    by_k[k] = _Costed(Candidate(sp.kind, p, sp.stage_shape, False, None, 0, 0,
                                                0, 0, 0, 0, str(a), lb), sp)
                continue
            if options.prune and lb > best_step:
                for k in wave:
                    sp = splits[k]
                    by_k[k] = _Costed(Candidate(
                        sp.kind, p, sp.stage_shape, False, None, 0, 0, 0, 0, 0, 0,
                        f"pruned: at least {1e3 * lb:.3f} ms (compute over all devices with "
                        f"the 1F1B bubble) > best {1e3 * best_step:.3f} ms", lb), sp)
                say(f"pruned {len(wave)} candidates with {p} stages (lower bound "
                    f"{1e3 * lb:.3f} ms > best {1e3 * best_step:.3f} ms)")
                continue
            handles: dict[int, dict[int, Any]] = {}
            jobs = []
            for k in wave:
                sp = splits[k]
                mesh = sp.stage_mesh(cluster)
                if p == 1:
                    opts = dataclasses.replace(options.spmd, memory_budget=budget)
                    jobs.append((k, 0, graph, mesh, opts, ""))
                else:
                    for w in works[p]:
                        jobs.append((k, w.index, w.sub.graph, mesh, dataclasses.replace(
                            spmd_opts, build=dataclasses.replace(spmd_opts.build,
                                                                 carried=w.carried)),
                            repr(w.carried)))
            # Largest first (ops × mesh axes), so the pool's last jobs are short ones.
            for k, s_idx, g_, mesh, opts, extra in sorted(
                    jobs, key=lambda j: -len(j[2].ops) * j[3].ndim):
                handles.setdefault(k, {})[s_idx] = pool.submit(g_, mesh, opts, extra)
            for k in wave:
                sp = splits[k]
                hs = [handles[k][i] for i in sorted(handles[k])]
                if p == 1:
                    plan, err = pool.result(hs[0], graph)
                    tc = time.perf_counter()
                    c = _cost_spmd(sp, plan, err, budget, lb)
                    cost_s += time.perf_counter() - tc
                else:
                    ws = works[p]
                    plans = [pool.result(h, w.sub.graph)[0] for h, w in zip(hs, ws)]
                    tc = time.perf_counter()
                    c = _cost_pipeline(graph, cluster, sp, a, ws, plans, state_args, m, budget,
                                       lb)
                    cost_s += time.perf_counter() - tc
                    if not c.candidate.feasible and budget is not None:
                        # Re-plan the stages over budget with the SPMD memory constraint.
                        mesh = sp.stage_mesh(cluster)
                        replanned = list(plans)
                        for st, mem in enumerate(c.memories):
                            if mem.total > budget:
                                opts = dataclasses.replace(
                                    spmd_opts, memory_budget=budget,
                                    build=dataclasses.replace(spmd_opts.build,
                                                              carried=ws[st].carried))
                                got, _ = pool.result(pool.submit(
                                    ws[st].sub.graph, mesh, opts, repr(ws[st].carried)),
                                    ws[st].sub.graph)
                                if got is not None:
                                    replanned[st] = got
                        tc = time.perf_counter()
                        c = _cost_pipeline(graph, cluster, sp, a, ws, replanned, state_args, m,
                                           budget, lb)
                        cost_s += time.perf_counter() - tc
                by_k[k] = c
                if c.candidate.feasible:
                    best_step = min(best_step, c.candidate.step_s)
        costed = [by_k[k] for k in range(len(splits))]
    finally:
        pool.close()
    feasible = [c for c in costed if c.candidate.feasible]
    if not feasible:
        need = min((c.candidate.memory for c in costed if c.candidate.memory > 0), default=0)
        raise InfeasiblePlanError(need, budget or 0, f"none of {len(costed)} candidates on "
                                  f"cluster {cluster} fits")
    best = min(feasible, key=lambda c: (c.candidate.step_s, c.candidate.num_stages))
    cands = tuple(c.candidate for c in costed)
    t_end = time.perf_counter()
    times = SearchTimes(ingest_s, t1 - t0, t2 - t1, ilp_s, pool.seconds, cost_s,
                        t_end - t_start + ingest_s, len(costed), pool.made)
    say(f"chose {best.candidate.label.strip()} (est. {1e3 * best.candidate.step_s:.3f} ms)")
    return _build_plan(graph, cluster, options, boundary, best, cands, times, budget)


def _build_plan(graph: HloGraph, cluster: Cluster, options: PipelineOptions,
                boundary: GradientBoundary | None, best: _Costed, cands: tuple[Candidate, ...],
                times: SearchTimes, budget: int | None) -> PipelinePlan:
    sp = best.split
    summary = boundary.summary(graph) if boundary is not None else {}
    if sp.num_stages == 1:
        plan = best.plans[0]
        c = best.candidate
        mem = StageMemory(plan.memory.parameters, 0, plan.memory.peak - plan.memory.parameters,
                          1, plan.memory.peak)
        est = StageEstimate(plan.compute_s, plan.communication_s, 0.0, 0.0)
        stage = StagePlan(0, sp.devices(cluster, 0), sp.hosts(cluster, 0), plan.mesh,
                          tuple(op.name for op in graph.ops if op.opcode != "parameter"),
                          {"forward": 0, "backward": 0, "apply": 0, "copied": 0},
                          (graph.total_flops, 0.0, 0.0),
                          tuple(p.path for p in plan.params), est, mem,
                          plan if options.keep_spmd else None)
        return PipelinePlan(graph.name, graph.origin, cluster, "spmd", 1, 1, options.epsilon,
                            options.epsilon, summary, (stage,), (), (), c.step_s, budget, cands,
                            _decision(c, cands), times)
    a = best.assignment
    stages = []
    for w, pl, est, mem in zip(best.works, best.plans, best.estimates, best.memories):
        extra = set(w.sub.inputs) | set(w.sub.duplicated)
        ops = tuple(graph.ops[i].name for i in w.sub.origin if i not in extra)
        stages.append(StagePlan(w.index, sp.devices(cluster, w.index), sp.hosts(cluster, w.index),
                                pl.mesh, ops, dict(w.counts), tuple(a.flops[w.index]),
                                w.weights, est, mem, pl if options.keep_spmd else None))
    shared = tuple((graph.ops[q].arg.path if graph.ops[q].arg else graph.ops[q].name, s)
                   for q, s in a.shared_weights)
    return PipelinePlan(graph.name, graph.origin, cluster, best.candidate.kind, sp.num_stages,
                        options.num_microbatches, options.epsilon, a.solution.epsilon, summary,
                        tuple(stages), tuple(best.cross), shared, best.candidate.step_s, budget,
                        cands, _decision(best.candidate, cands), times)
