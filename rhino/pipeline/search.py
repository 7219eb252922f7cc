"""The search and the controller: every split of the cluster, costed, and the best chosen.

Phases (the paper's Fig. 2: enumerate mesh configurations, plan each in parallel, pick)::

    graph ─► gradient boundary ─► roles + coarsening (once)
          ─► for each stage count p > 1: stage ILP (§5, in parallel)
          ─► for each split (p × stage mesh): stage subgraphs -> SPMD plan per stage
             (in parallel; identical stages planned once) ; p = 1: SPMD plan of the graph;
             in waves of increasing p: a wave whose lower bound ``(m + p - 1) / m ·
             Σ FLOPs / (F · N)`` (``F`` the FLOP/s of each op's dtype) exceeds the best
             step found is pruned (with process workers every wave is queued up front,
             so workers never idle at a wave's end; a pruned wave's unstarted plans are
             dropped)
          ─► per candidate: profiles, transfers, 1F1B step, memory (candidates.py,
             cost.py)
          ─► candidates over the memory budget, once every wave is costed: re-planned with
             the SPMD planner's memory constraint (the whole graph, or the stages over
             budget), unless their plan with no limit is already no faster than the best
             feasible step (a limit only adds constraints)
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
import time
from typing import Any, Callable, Sequence

from rhino.errors import (InfeasiblePlanError, OptionsError, PlanningError, RhinoError,
                          format_bytes)
from rhino.hlo_passes.graph import HloGraph
from rhino.cluster import Cluster, MeshSplit, enumerate_splits
from rhino.pipeline.candidates import Costed, StageWork, cost_pipeline, stage_works
# Imported under its old name: a global of this module, which tests may swap.
from rhino.pipeline.candidates import cost_spmd as _cost_spmd
from rhino.pipeline.coarsen import classify_ops, coarsen
from rhino.pipeline.cost import memory_floor
from rhino.pipeline.gradient import (BoundaryOptions, GradientBoundary, find_gradient_boundary,
                                     gradient_weights)
from rhino.parallel_plan import Candidate, Plan, SearchTimes, StagePlan, decision_text
from rhino.pipeline.stage_ilp import StageAssignmentError, StageOptions
from rhino.pipeline.stages import StageAssignment, assign_given_stages, assign_stages
from rhino.planner.api import PlanOptions
from rhino.planner.build import carried_pairs
from rhino.planner.cost_model import CostModel
from rhino.planner.op_cost import OpTimes, matmul_dtype, model_flops
from rhino.planner.mesh import AbstractMesh
from rhino.planner.pins import annotation_pins
from rhino.pipeline.schedule_choice import choose, price_interleaved, with_in_flight
from rhino.pipeline.spmd_pool import SpmdPool
from rhino.progress import Countdown
from rhino.vocabulary import PlanKind, ScheduleKind

KINDS = ("spmd", "pipeline", "hybrid")
EXECUTORS = ("auto", "thread", "process", "serial")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How ``plan_pipeline_graph`` searches.

    Attributes:
        num_microbatches: ``m`` for 1F1B (the SPMD-only candidate runs the whole batch).
        schedule: the schedule the plan records; ``auto`` (the default): the fastest the
            executors run whose activations fit the budget, by the plan's estimates
            (``schedule_choice``; the search itself compares candidates under 1F1B).
        epsilon: stage imbalance tolerance of the stage ILP (§5.2).
        max_stages: the most pipeline stages (default: every device).
        num_stages: only splits with exactly this many stages (e.g. to run a pipeline of
            a given depth); None: any count up to ``max_stages``.
        virtual_stages: stages of the model per device group (``interleaved-1f1b``): each
            split of the cluster into ``num_stages`` device groups cuts the model into
            ``num_stages * virtual_stages`` stages, stage ``c`` on group ``c % num_stages``
            (``MeshSplit.virtual_stages``).
        weight_stages: a hand-given split instead of the stage ILP: ``{weight pytree path
            prefix: stage}`` (``stages.assign_given_stages``); implies ``num_stages``.
        kinds: which of ``spmd``, ``pipeline``, ``hybrid`` to weigh.
        batch_args: argument names that carry the batch (default: the non-state ones).
        boundary_method: ``auto``, ``marker`` or ``autodiff`` (see ``gradient.py``).
        granularity: coarsening of the stage ILP (see ``coarsen.py``).
        stage: stage-ILP options; its ε is replaced by ``epsilon`` and its balance weight
            by the cluster's compute/transfer ratio (``balance_weight=None``).
        balance_weight: override of the ILP balance weight (None: from the cluster).
        spmd: options of the per-stage SPMD planner (its memory budget is managed here;
            every stage plan passes the independent validator).
        two_d: also weigh 2-D stage meshes.
        memory_budget: bytes per device (default: the cluster's device memory).
        workers: parallel workers (0: one per CPU).
        executor: ``process`` (forked workers; true parallelism for the pure-Python SPMD
            planner), ``thread``, ``serial``, or ``auto``: processes where ``fork`` exists
            and the graph has over 3000 ops, else threads.
        keep_spmd: keep each stage's ``SpmdPlan`` in the result.
        prune: skip the candidates of a stage count whose lower bound (perfectly scaled
            compute with the 1F1B bubble) exceeds the best step already found, and do not
            fit to the memory budget a candidate whose plan with no memory limit is
            already no faster than the best feasible step.
        microbatch_divisors: op id -> {dim: m} for the dimensions that carry the batch
            (``auto_parallel`` finds them by tracing the step at microbatch shapes): stage
            plans only split them into shards a microbatch divides (``BuildOptions.divisors``).
        annotations: ``{pytree path or named_scope name: spec}`` (``rhino.planner.pins.
            annotation_pins``), pinned in every plan made for a mesh they fit: the SPMD
            candidate's, and each stage's for the values the stage holds. A candidate whose
            mesh a spec does not fit is infeasible, with the reason as its note.
        stage_shapes: only stage meshes of these shapes (e.g. ``((4, 4),)`` for data
            parallel 4 × tensor parallel 4 per stage); None: every shape.
    """

    num_microbatches: int = 8
    schedule: ScheduleKind = ScheduleKind.AUTO
    epsilon: float = 0.1
    max_stages: int | None = None
    num_stages: int | None = None
    virtual_stages: int = 1
    weight_stages: Any = None
    kinds: tuple[str, ...] = KINDS
    batch_args: tuple[str, ...] | None = None
    boundary_method: str = "auto"
    granularity: str = "auto"
    stage: StageOptions = StageOptions()
    balance_weight: float | None = None
    spmd: PlanOptions = PlanOptions()
    two_d: bool = True
    memory_budget: int | None = None
    workers: int = 0
    executor: str = "auto"
    keep_spmd: bool = True
    prune: bool = True
    microbatch_divisors: Any = None
    annotations: Any = None
    stage_shapes: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        if self.num_microbatches < 1:
            raise OptionsError(f"num_microbatches: expected >= 1, found {self.num_microbatches}")
        if not self.epsilon >= 0:
            raise OptionsError(f"epsilon: expected >= 0, found {self.epsilon!r}")
        if self.max_stages is not None and self.max_stages < 1:
            raise OptionsError(f"max_stages: expected >= 1, found {self.max_stages}")
        if self.num_stages is not None and self.num_stages < 1:
            raise OptionsError(f"num_stages: expected >= 1, found {self.num_stages}")
        if self.virtual_stages < 1 or (self.virtual_stages > 1 and (
                self.num_stages is None or self.num_stages < 2
                or self.weight_stages is not None)):
            raise OptionsError(f"virtual_stages: expected 1, or >= 2 with num_stages >= 2 "
                               f"device groups and the stage ILP's split, found "
                               f"{self.virtual_stages} with num_stages {self.num_stages}"
                               + (" and weight_stages" if self.weight_stages else ""))
        if self.weight_stages is not None:
            if not self.weight_stages or not all(
                    isinstance(v, int) and v >= 0 for v in self.weight_stages.values()):
                raise OptionsError(f"weight_stages: expected {{path prefix: stage >= 0}}, found "
                                 f"{self.weight_stages!r}")
            n = max(self.weight_stages.values()) + 1
            if self.num_stages not in (None, n):
                raise OptionsError(f"num_stages: expected {n} (from weight_stages), found "
                                 f"{self.num_stages}")
            object.__setattr__(self, "weight_stages", dict(self.weight_stages))
            object.__setattr__(self, "num_stages", n)
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise OptionsError(f"kinds: expected a non-empty subset of {KINDS}, found "
                             f"{self.kinds!r}")
        if self.executor not in EXECUTORS:
            raise OptionsError(f"executor: expected one of {EXECUTORS}, found {self.executor!r}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise OptionsError(f"memory_budget: expected > 0 bytes, found {self.memory_budget}")


# ------------------------------------------------------------------------------ controller
def _no_plan(costed: Sequence[Costed], cluster: Cluster, budget: int | None) -> RhinoError:
    """The error for a search with no feasible candidate, carrying the real reasons: memory
    (``InfeasiblePlanError``) when some candidate was planned and was only too big,
    otherwise why each could not be planned (``PlanningError``)."""
    sized = [c.candidate for c in costed if c.candidate.memory > 0]
    notes = "; ".join(f"{c.candidate.label.strip()}: {c.candidate.note}" for c in costed)
    if sized and budget is not None:
        return InfeasiblePlanError(min(c.memory for c in sized), budget,
                                   f"none of {len(costed)} candidates on cluster {cluster} "
                                   f"fits: {notes}")
    return PlanningError(f"pipeline search: expected a candidate that can be planned on "
                         f"cluster {cluster}, found none of {len(costed)}: {notes}")


def _device_cost(cluster: Cluster) -> CostModel:
    """The cluster's FLOP/s per dtype, as a cost model of one device."""
    return cluster.figures().cost_model((1,))


def _lower_bound(times: OpTimes, ops: Sequence[int] | None, num_stages: int,
                 num_microbatches: int, cluster: Cluster) -> float:
    """No plan of ``p`` stages beats perfectly scaled compute with the 1F1B bubble:
    ``(m + p - 1) / m · T / N`` over ``ops`` (default: all), ``T`` their seconds on one
    device at the best rates the cost model allows (``OpTimes.floor``)."""
    m = max(1, num_microbatches)
    return float((m + num_stages - 1) / m * times.floor(ops) / cluster.num_devices)


def _balance_weight(times: OpTimes, a_problem_mean: float, cluster: Cluster,
                    split: MeshSplit) -> float:
    """Compute time of a perfectly balanced stage over the transfer time of a mean tensor."""
    n = split.devices_per_stage
    t_stage = times.floor() / split.num_stages / n
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
                        ingest_s: float = 0.0) -> Plan:
    """Weigh SPMD-only, pipeline-only and hybrid plans of a training step on a cluster.

    Args:
        graph: the training step's graph.
        cluster: hosts × devices per host with link speeds, FLOP/s and memory.
        options: the search options.
        progress: called with a line of text at each phase.
        ingest_s: seconds spent ingesting (reported).

    Returns:
        The ``Plan`` of the fastest feasible candidate, listing all of them.

    Raises:
        GradientBoundaryError: pipeline candidates were asked for and the training step's
            gradient boundary cannot be found.
        InfeasiblePlanError: no candidate fits in device memory.
    """
    return _Search(graph, cluster, options, _progress(progress)).run(ingest_s)


MAX_OP_UNITS = 2000
"""The most forward ops the search makes one unit each of, when coarser units are too few
for the stage counts it weighs."""


class _Search:
    """One run of the search (see the module docstring for its phases)."""

    def __init__(self, graph: HloGraph, cluster: Cluster, options: PipelineOptions,
                 say: Callable[[str], None]):
        self.graph, self.cluster, self.options, self.say = graph, cluster, options, say
        self.m = options.num_microbatches
        self.budget = (options.memory_budget if options.memory_budget is not None
                       else cluster.memory_bytes)
        self.splits = self._splits()
        self.boundary: GradientBoundary | None = None
        self.coarse = None
        self.assignments: dict[int, StageAssignment | str] = {}
        self.works: dict[int, list[StageWork]] = {}
        self.ilp_s = self.cost_s = 0.0
        self.best_step = float("inf")
        # Candidates are planned without O2's window moves and one-axis fallback; the
        # chosen one gets them (``_refine``).
        self.spmd_opts = dataclasses.replace(options.spmd, memory_budget=None, refine=False,
                                             fold_seed=False)
        self.countdown = Countdown(say, "candidate splits planned and costed", 0)
        self._pin_cache: dict = {}
        self._device_times: OpTimes | None = None

    @property
    def device_times(self) -> OpTimes:
        """Every op's seconds on one of the cluster's devices (made once)."""
        if self._device_times is None:
            self._device_times = OpTimes(self.graph, _device_cost(self.cluster))
        return self._device_times

    def _splits(self) -> list[MeshSplit]:
        o = self.options
        most = o.max_stages if o.num_stages is None else o.num_stages
        shapes = None if o.stage_shapes is None else {tuple(x) for x in o.stage_shapes}
        splits = [s for s in enumerate_splits(self.cluster, most, o.two_d)
                  if s.kind in o.kinds and o.num_stages in (None, s.num_stages)
                  and (shapes is None or s.stage_shape in shapes)]
        if splits and o.virtual_stages > 1:   # the model cut into v stages per group
            splits = [dataclasses.replace(s, num_stages=s.num_stages * o.virtual_stages,
                                          virtual_stages=o.virtual_stages)
                      for s in splits if s.num_stages > 1]
        if not splits:
            count = (f"exactly {o.num_stages}" if o.num_stages is not None
                     else f"at most {o.max_stages}")
            only = "" if shapes is None else f" and stage meshes {sorted(shapes)}"
            raise RhinoError(f"pipeline search: expected some split of cluster {self.cluster} "
                             f"of kinds {o.kinds} with {count} stages{only}, found none")
        return splits

    @property
    def stage_counts(self) -> list[int]:
        return sorted({s.num_stages for s in self.splits if s.num_stages > 1})

    # ------------------------------------------------------------------ phases
    def run(self, ingest_s: float) -> Plan:
        t_start = time.perf_counter()
        boundary_s, coarsen_s = self._boundary_and_units()
        workers = self.options.workers or os.cpu_count() or 1
        executor = self.options.executor
        if executor == "auto":
            import multiprocessing as mp
            executor = ("process" if len(self.graph.ops) > 3000
                        and "fork" in mp.get_all_start_methods() else "thread")
        pool = SpmdPool(workers, executor)
        try:
            self._stage_ilps(workers)
            self.say(f"SPMD plans for {len(self.splits)} candidate splits ({executor}, "
                     f"{workers} workers)")
            self.countdown = Countdown(self.say, "candidate splits planned and costed",
                                       len(self.splits))
            costed = self._cost_all(pool)
            feasible = [c for c in costed if c.candidate.feasible]
            if not feasible:
                raise _no_plan(costed, self.cluster, self.budget)
            best = min(feasible, key=lambda c: (c.candidate.step_s, c.candidate.num_stages))
            at = next(j for j, c in enumerate(costed) if c is best)
            costed[at] = best = self._refine(pool, best)
        finally:
            pool.close()
        times = SearchTimes(ingest_s, boundary_s, coarsen_s, self.ilp_s, pool.seconds,
                            self.cost_s, time.perf_counter() - t_start + ingest_s,
                            len(costed), pool.made)
        self.say(f"chose {best.candidate.label.strip()} (est. "
                 f"{1e3 * best.candidate.step_s:.3f} ms)")
        return _build_plan(self.graph, self.cluster, self.options, self.boundary, best,
                           tuple(c.candidate for c in costed), times, self.budget)

    def _boundary_and_units(self) -> tuple[float, float]:
        """The gradient boundary and the stage ILP's units (when pipelines are weighed)."""
        if not self.stage_counts:
            return 0.0, 0.0
        o, graph = self.options, self.graph
        t0 = time.perf_counter()
        self.boundary = find_gradient_boundary(graph, BoundaryOptions(o.batch_args,
                                                                      o.boundary_method))
        b = self.boundary
        self.say(f"gradient boundary ({b.method}): {len(b.compute)} compute-gradients ops, "
                 f"{len(b.apply)} apply-gradients ops, {len(b.gradients)} gradients")
        t1 = time.perf_counter()
        roles = classify_ops(graph, b)
        grads = gradient_weights(graph, b)
        self.coarse = coarsen(graph, roles, o.granularity, b.state_params,
                              gradient_weights=grads)
        # Too few units to balance the largest stage count (a small model whose layers
        # form one chain, weights without layer indices): finer units, where they are few
        # enough for the stage ILP.
        need = 2 * max(self.stage_counts)
        if o.granularity == "auto" and self.coarse.problem.num_units < need:
            for finer in ("segment", "op"):
                if finer == "op" and len(roles.ids("fwd")) > MAX_OP_UNITS:
                    break
                c = coarsen(graph, roles, finer, b.state_params, gradient_weights=grads)
                if c.problem.num_units > self.coarse.problem.num_units:
                    self.coarse = c
                if c.problem.num_units >= need:
                    break
        self.say(f"coarsened the forward/backward graph into "
                 f"{self.coarse.problem.num_units} units ({self.coarse.granularity})")
        return t1 - t0, time.perf_counter() - t1

    def _stage_ilps(self, workers: int) -> None:
        """One stage assignment per stage count (threads: HiGHS releases the GIL)."""
        counts = self.stage_counts
        if not counts:
            return
        self.say(f"stage ILPs for {counts} stages (ε {self.options.epsilon:g})")
        with cf.ThreadPoolExecutor(max(1, min(workers, len(counts)))) as ex:
            for p, a, secs in ex.map(self._assign, counts):
                self.assignments[p] = a
                self.ilp_s += secs
        carried = carried_pairs(self.graph)
        self.works = {p: stage_works(self.graph, self.boundary, a, carried)
                      for p, a in self.assignments.items() if isinstance(a, StageAssignment)}

    def _assign(self, p: int) -> tuple[int, StageAssignment | str, float]:
        o, graph = self.options, self.graph
        sp = next(s for s in self.splits if s.num_stages == p)
        weight = o.balance_weight
        if weight is None:
            weight = _balance_weight(self.device_times, self.coarse.problem.mean_tensor_bytes(),
                                     self.cluster, sp)
        opts = dataclasses.replace(o.stage, epsilon=o.epsilon, balance_weight=weight)
        t = time.perf_counter()
        try:
            if o.weight_stages is not None:
                a = assign_given_stages(graph, self.boundary, o.weight_stages, opts,
                                        coarsening=self.coarse)
            else:
                a = assign_stages(graph, self.boundary, p, opts, coarsening=self.coarse)
        except StageAssignmentError as e:
            return p, str(e), time.perf_counter() - t
        return p, a, time.perf_counter() - t

    def _cost_all(self, pool: "SpmdPool") -> list[Costed]:
        """SPMD plans and costs, in waves of equal stage count by increasing lower bound; a
        wave whose lower bound exceeds the best step found is pruned. With process workers
        every wave's plans are queued at the start, wave by wave, so a worker that finishes
        its part of one wave starts on the next; a pruned wave's plans that have not
        started are dropped. Candidates over the memory budget are fitted by ``_fit_all``:
        before a wave those that could beat it, the rest at the end."""
        graph, b = self.graph, self.boundary
        cg_ops = list(b.compute) if b is not None else None
        by_k: dict[int, Costed] = {}
        waves = []
        for p in sorted({sp.num_stages for sp in self.splits}):
            wave = [k for k, sp in enumerate(self.splits) if sp.num_stages == p]
            lb = _lower_bound(self.device_times, None if p == 1 else cg_ops, p,
                              1 if p == 1 else self.m, self.cluster)
            a = self.assignments.get(p)
            if p > 1 and not isinstance(a, StageAssignment):
                by_k.update({k: self._unplanned(k, str(a), lb) for k in wave})
                self.countdown.advance(len(wave), f"{p} stages: no stage assignment")
            else:    # in this process (serial, threads) a wave is planned when reached
                waves.append((p, wave, lb, self._submit_wave(pool, p, wave, lb)
                              if pool.processes else None))
        for p, wave, lb, queued in waves:
            self._fit_all(pool, by_k, below=lb)    # those that could beat this whole wave
            if self.options.prune and lb > self.best_step:
                if queued is not None:
                    pool.withdraw([h for hs in queued[0].values() for h in hs.values()])
                note = (f"pruned: at least {1e3 * lb:.3f} ms (compute over all devices with "
                        f"the 1F1B bubble) > best {1e3 * self.best_step:.3f} ms")
                by_k.update({k: self._unplanned(k, note, lb) for k in wave})
                self.say(f"pruned {len(wave)} candidates with {p} stages (lower bound "
                         f"{1e3 * lb:.3f} ms > best {1e3 * self.best_step:.3f} ms)")
                self.countdown.advance(len(wave), f"{p} stages pruned")
            else:
                handles, refused = queued or self._submit_wave(pool, p, wave, lb)
                by_k.update(self._finish_wave(pool, p, wave, lb, handles, refused))
        self._fit_all(pool, by_k)
        return [by_k[k] for k in range(len(self.splits))]

    def _unplanned(self, k: int, note: str, lb: float) -> Costed:
        sp = self.splits[k]
        return Costed(Candidate(sp.kind, sp.num_stages, sp.stage_shape, note=note,
                                lower_bound_s=lb), sp)

    def _pins(self, mesh: AbstractMesh) -> dict:
        """The annotations as op id -> spec on ``mesh`` (OptionsError: one does not fit)."""
        if not self.options.annotations:
            return {}
        key = (mesh.shape, mesh.axis_names)
        if key not in self._pin_cache:
            try:
                self._pin_cache[key] = annotation_pins(self.graph, self.options.annotations,
                                                       mesh)
            except OptionsError as e:
                self._pin_cache[key] = e
        got = self._pin_cache[key]
        if isinstance(got, OptionsError):
            raise got
        return got

    def _submit_wave(self, pool: "SpmdPool", p: int, wave: list[int], lb: float
                     ) -> tuple[dict[int, dict[int, Any]], dict[int, Costed]]:
        """Queue the SPMD plans of one wave: handles per split and stage, and the splits
        refused before planning (an annotation their mesh cannot hold)."""
        jobs, refused = [], {}
        for k in wave:
            sp = self.splits[k]
            mesh, cost = sp.stage_mesh(self.cluster), sp.stage_cost(self.cluster)
            try:
                pins = self._pins(mesh)
            except OptionsError as e:
                refused[k] = Costed(Candidate(sp.kind, sp.num_stages, sp.stage_shape,
                                              note=str(e), lower_bound_s=lb), sp)
                continue
            if p == 1:
                floor = memory_floor(self.graph) // mesh.num_devices
                if self.budget is not None and floor > self.budget:   # not planned
                    refused[k] = Costed(Candidate(sp.kind, 1, sp.stage_shape, memory=floor, note=(
                        f"needs at least {format_bytes(floor)} > budget {format_bytes(self.budget)}"
                        f" (the step's peak values over {mesh.num_devices} devices)"),
                        lower_bound_s=lb), sp)
                    continue
                jobs.append((k, 0, self.graph, mesh, cost, self._spmd_options(pins), ""))
            else:
                jobs += [(k, w.index, w.sub.graph, mesh, cost,
                          self._stage_options(w, pins=pins), repr(w.carried))
                         for w in self.works[p]]
        # Largest first (ops × mesh axes), so the pool's last jobs are short ones.
        handles: dict[int, dict[int, Any]] = {}
        for k, s_idx, g_, mesh, cost, opts, extra in sorted(
                jobs, key=lambda j: -len(j[2].ops) * j[3].ndim):
            handles.setdefault(k, {})[s_idx] = pool.submit(g_, mesh, cost, opts, extra, p)
        return handles, refused

    def _finish_wave(self, pool: "SpmdPool", p: int, wave: list[int], lb: float,
                     handles: dict[int, dict[int, Any]], refused: dict[int, Costed]
                     ) -> dict[int, Costed]:
        out = {}
        for k in wave:
            if k in refused:
                out[k] = refused[k]
                self.countdown.advance(1, f"{refused[k].candidate.label.strip()} refused")
                continue
            hs = [handles[k][i] for i in sorted(handles[k])]
            c = self._cost_split(pool, k, p, hs, lb)
            out[k] = c
            self.countdown.advance(1, c.candidate.label.strip())
            if c.candidate.feasible:
                self.best_step = min(self.best_step, c.candidate.step_s)
        return out

    def _stage_options(self, w: StageWork, budget: int | None = None,
                       pins: dict | None = None) -> PlanOptions:
        div = self.options.microbatch_divisors or {}
        sub_div = {k: div[src] for k, src in enumerate(w.sub.origin) if src in div}
        pinned = dict(self.spmd_opts.build.pinned)
        pinned.update({k: pins[src] for k, src in enumerate(w.sub.origin) if src in (pins or {})})
        return dataclasses.replace(self.spmd_opts, memory_budget=budget,
                                   build=dataclasses.replace(self.spmd_opts.build,
                                                             carried=w.carried,
                                                             divisors=sub_div, pinned=pinned))

    def _cost_split(self, pool: "SpmdPool", k: int, p: int, hs: list, lb: float
                    ) -> Costed:
        sp = self.splits[k]
        if p == 1:
            return self._cost_whole(pool, sp, hs[0], lb)[0]
        ws = self.works[p]
        plans = [pool.result(h, w.sub.graph)[0] for h, w in zip(hs, ws)]
        return self._cost_stages(sp, p, plans, lb)

    def _cost_whole(self, pool: "SpmdPool", sp: MeshSplit, handle: Any, lb: float
                    ) -> tuple[Costed, str]:
        """An SPMD candidate costed from its whole-graph plan (and the planner's error)."""
        plan, err = pool.result(handle, self.graph)
        t = time.perf_counter()
        c = _cost_spmd(sp, plan, err, self.budget, lb)
        self.cost_s += time.perf_counter() - t
        return c, err

    def _fit_all(self, pool: "SpmdPool", by_k: dict[int, Costed],
                 below: float = float("inf")) -> None:
        """Re-plan the candidates over the memory budget whose step with no memory limit is
        under ``below`` with the SPMD memory constraint (the whole graph for SPMD, the
        stages over budget for pipelines). The search calls it before each wave with the
        wave's lower bound (a fitted candidate that fast may prune the wave) and at the
        end for the rest. A memory limit only adds constraints to a plan, so a candidate
        whose plan with no limit is already no faster than the best feasible step is not
        fitted (with ``prune``); its note says so. The rest are fitted fastest first (all
        queued at once with parallel workers); one not yet started when a fitted one
        beats it is dropped the same way."""
        over = sorted((k for k, c in by_k.items()
                       if c.free_step is not None and c.free_step < below),
                      key=lambda k: by_k[k].free_step)
        if self.budget is None or not over:
            return
        todo = [k for k in over if not self._not_fitted(by_k, k)]
        self.say(f"memory: fitting {len(todo)} of {len(over)} candidates over the budget "
                 f"(the rest are no faster than the best even with no limit)")
        # In parallel, every fit is queued now; serially, each when reached, after the
        # fits before it may have lowered the best step.
        queued = {k: self._submit_fit(pool, k, by_k[k]) for k in todo} if pool.parallel else {}
        for k in todo:
            if self._not_fitted(by_k, k):
                pool.withdraw([h for _, h in queued.get(k, [])])
                continue
            handles = queued.get(k) or self._submit_fit(pool, k, by_k[k])
            c = by_k[k]
            sp, p = c.split, c.candidate.num_stages
            if p == 1:
                got, err = self._cost_whole(pool, sp, handles[0][1], c.candidate.lower_bound_s)
                if got.plans is None:    # keep the unconstrained plan's size for the report
                    got = dataclasses.replace(got, candidate=dataclasses.replace(
                        c.candidate, note=f"{c.candidate.note}; {err}"))
            else:
                plans = list(c.plans)
                for st, h in handles:
                    fitted, _ = pool.result(h, c.works[st].sub.graph)
                    if fitted is not None:
                        plans[st] = fitted
                got = self._cost_stages(sp, p, plans, c.candidate.lower_bound_s)
            by_k[k] = dataclasses.replace(got, free_step=None)    # fitted: done with it
            if got.candidate.feasible:
                self.best_step = min(self.best_step, got.candidate.step_s)

    def _not_fitted(self, by_k: dict[int, Costed], k: int) -> bool:
        """Mark candidate ``k`` not fitted when its no-limit step is no faster than the
        best (and ``prune`` allows it); True if so."""
        c = by_k[k]
        if not self.options.prune or c.free_step < self.best_step:
            return False
        ms = 1e3
        by_k[k] = dataclasses.replace(c, free_step=None, candidate=dataclasses.replace(
            c.candidate, note=f"{c.candidate.note}; not fitted: with no memory limit its "
            f"plan takes {ms * c.free_step:.3f} ms >= best {ms * self.best_step:.3f} ms, "
            f"and a memory limit only adds constraints"))
        return True

    def _submit_fit(self, pool: "SpmdPool", k: int, c: Costed) -> list:
        """(stage, handle) of the memory-constrained plans of candidate ``k``."""
        sp, p = c.split, c.candidate.num_stages
        mesh, cost = sp.stage_mesh(self.cluster), sp.stage_cost(self.cluster)
        pins = self._pins(mesh)
        if p == 1:
            return [(0, pool.submit(self.graph, mesh, cost,
                                    self._spmd_options(pins, self.budget), "", p))]
        return [(st, pool.submit(c.works[st].sub.graph, mesh, cost,
                                 self._stage_options(c.works[st], self.budget, pins),
                                 repr(c.works[st].carried), p))
                for st, mem in enumerate(c.memories) if mem.total > self.budget]

    def _refine(self, pool: "SpmdPool", best: Costed) -> Costed:
        """The chosen candidate re-planned with O2's window moves (``PlanOptions.refine``)
        and one-axis fallback (``fold_seed``), each plan with the memory budget it was
        planned for; kept if feasible and no slower by the search's estimate (a stage
        plan's objective weighs its parts otherwise than the pipeline's step does)."""
        o = self.options.spmd
        if not (o.refine or o.fold_seed) or o.opt_level != "O2" or not best.plans:
            return best
        extra = dict(refine=o.refine, fold_seed=o.fold_seed)
        sp, p = best.split, best.candidate.num_stages
        mesh, cost = sp.stage_mesh(self.cluster), sp.stage_cost(self.cluster)
        pins = self._pins(mesh)
        self.say("refining the chosen plan with O2's window moves")
        lb = best.candidate.lower_bound_s
        if p == 1:
            opts = self._spmd_options(pins, best.plans[0].memory_budget)
            got = self._cost_whole(pool, sp, pool.submit(
                self.graph, mesh, cost, dataclasses.replace(opts, **extra), "", p), lb)[0]
        else:
            hs = [pool.submit(w.sub.graph, mesh, cost, dataclasses.replace(
                self._stage_options(w, pl.memory_budget, pins), **extra),
                repr(w.carried), p) for w, pl in zip(best.works, best.plans)]
            plans = [pool.result(h, w.sub.graph)[0] for h, w in zip(hs, best.works)]
            if any(pl is None for pl in plans):
                return best
            got = self._cost_stages(sp, p, plans, lb)
        ms = 1e3 * best.candidate.step_s
        if not got.candidate.feasible or got.candidate.step_s > best.candidate.step_s:
            why = (f"est. {1e3 * got.candidate.step_s:.3f} ms, not below {ms:.3f} ms"
                   if got.candidate.feasible else got.candidate.note)
            self.say(f"refined plan kept out ({why})")
            return best
        note = "; ".join(x for x in (got.candidate.note, f"refined by O2's window moves "
                                     f"(est. {ms:.3f} ms before)") if x)
        return dataclasses.replace(got, free_step=best.free_step,
                                   candidate=dataclasses.replace(got.candidate, note=note))

    def _spmd_options(self, pins: dict, budget: int | None = None) -> PlanOptions:
        """The options of a whole-graph (SPMD candidate) plan."""
        opts = dataclasses.replace(self.spmd_opts, memory_budget=budget)
        if pins:
            opts = dataclasses.replace(opts, build=dataclasses.replace(
                opts.build, pinned={**opts.build.pinned, **pins}))
        return opts

    def _cost_stages(self, sp: MeshSplit, p: int, plans: list, lb: float) -> Costed:
        b = self.boundary
        t = time.perf_counter()
        c = cost_pipeline(self.graph, self.cluster, sp, self.assignments[p], self.works[p],
                          plans, b.state_args, self.m, self.budget, lb)
        self.cost_s += time.perf_counter() - t
        return c


def _build_plan(graph: HloGraph, cluster: Cluster, options: PipelineOptions,
                boundary: GradientBoundary | None, best: Costed, cands: tuple[Candidate, ...],
                times: SearchTimes, budget: int | None) -> Plan:
    sp = best.split
    summary = boundary.summary(graph) if boundary is not None else {}
    decision = decision_text(best.candidate, cands, KINDS)
    if sp.num_stages == 1:
        plan = Plan.from_spmd(best.plans[0], graph.total_flops, cluster,
                              sp.devices(cluster, 0), cands, decision, times, summary)
        return dataclasses.replace(plan, step_s=best.candidate.step_s, memory_budget=budget,
                                   epsilon=options.epsilon, epsilon_used=options.epsilon)
    a = best.assignment
    memories, schedule, step_s = list(best.memories), options.schedule, best.candidate.step_s
    flops = [a.flops[w.index] for w in best.works]
    if sp.virtual_stages > 1:
        price = price_interleaved(best.estimates, best.memories, flops,
                                  options.num_microbatches, sp.virtual_stages, step_s)
        over = [g for g, x in enumerate(price.group_peaks) if budget is not None and x > budget]
        if over:
            raise InfeasiblePlanError(
                price.group_peaks[over[0]], budget,
                f"interleaved-1f1b: device group {over[0]} holds the state and activations "
                f"of its {sp.virtual_stages} stages; fewer virtual stages or microbatches, "
                f"or more device groups")
        schedule, step_s = ScheduleKind.INTERLEAVED, price.step_s
        memories = [with_in_flight(mm, k) for mm, k in zip(memories, price.in_flight)]
        decision = f"{decision}; {price.text()}"
        won = dataclasses.replace(best.candidate, step_s=step_s,
                                  memory=max(price.group_peaks))
        cands = tuple(won if c == best.candidate else c for c in cands)
    elif schedule is ScheduleKind.AUTO:
        choice = choose(best.estimates, best.memories, flops, options.num_microbatches,
                        step_s, budget)
        schedule, step_s = ScheduleKind(choice.name), choice.step_s
        memories = [with_in_flight(mm, k) for mm, k in zip(memories, choice.in_flight)]
        decision = f"{decision}; {choice.text()}"
        # the winner's row under its schedule: the bubble (and hidden sends) it saves
        won = dataclasses.replace(
            best.candidate, step_s=step_s, memory=max(mm.total for mm in memories),
            bubble_s=max(0.0, best.candidate.bubble_s - (best.candidate.step_s - step_s)))
        cands = tuple(won if c == best.candidate else c for c in cands)
    stages = []
    for w, pl, est, mem in zip(best.works, best.plans, best.estimates, memories):
        extra = set(w.sub.inputs) | set(w.sub.duplicated)
        ops = tuple(graph.ops[i].name for i in w.sub.origin if i not in extra)
        stages.append(StagePlan(w.index, sp.devices(cluster, w.index), sp.hosts(cluster, w.index),
                                pl.mesh, pl.cost, ops, dict(w.counts), tuple(a.flops[w.index]),
                                w.weights, est, mem, pl if options.keep_spmd else None))
    shared = tuple((graph.ops[q].arg.path if graph.ops[q].arg else graph.ops[q].name, s)
                   for q, s in a.shared_weights)
    return Plan(graph.name, graph.origin, PlanKind(best.candidate.kind), cluster,
                tuple(stages), num_microbatches=options.num_microbatches,
                schedule=schedule, step_s=step_s, memory_budget=budget, boundary=summary, crossings=tuple(best.cross), shared_weights=shared,
                epsilon=options.epsilon, epsilon_used=a.solution.epsilon, candidates=cands,
                decision=decision, search=times, model_flops=model_flops(graph),
                matmul_dtype=matmul_dtype(graph), virtual_stages=sp.virtual_stages)
