"""The one planning path behind both front doors, ``rhino.plan`` and ``rhino.auto_parallel``.

A plan a user inspects with ``rhino.plan(step, *args, ...)`` is the plan
``auto_parallel(step, ...)`` runs for the same arguments and options: both doors describe
what to plan as a ``PlanRequest`` and plan through the functions here::

    rhino.plan(step, *args, ...) ─────┐                       ┌─ mesh:    plan_on_mesh
                                      ├─► PlanRequest ─► trace_step ─┤
    auto_parallel(step, ...)(*args) ──┘   (one set of options)    └─ cluster: plan_on_cluster

``PlanRequest.spmd_options`` and ``PlanRequest.pipeline_options`` are the only places that
turn the user's options into the planner's (``PlanOptions``, ``BuildOptions``,
``PipelineOptions``); ``runnable_cost`` prices a mesh as the lowering runs it. What the doors
still do differently is outside the plan: ``auto_parallel`` compiles and runs it, and checks
a ``memory_budget`` on the compiled SPMD program (re-planning under rising memory pressure)
where ``rhino.plan`` constrains the planner's estimate.

Example:
    >>> import jax.numpy as jnp
    >>> req = PlanRequest(opt_level="O2", num_microbatches=2)
    >>> req.microbatches, req.pipeline_options().two_d
    (2, False)
    >>> t = trace_step(lambda w, x: (w - x.T @ (x @ w), jnp.sum(x)), (jnp.ones((8, 4)),
    ...                jnp.ones((16, 8))))
    >>> len(t.graph.params), t.abstract[1].shape
    (2, (16, 8))
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rhino.cluster import Cluster
from rhino.errors import OptionsError
from rhino.hlo_passes import HloGraph, ingest
from rhino.hlo_passes.annotate import ScopedFunction
from rhino.parallel_plan import Plan
from rhino.pipeline.gradient import BoundaryOptions, check_batch_leaves, find_gradient_boundary
from rhino.pipeline.search import PipelineOptions, plan_pipeline_graph
from rhino.planner.api import OPT_LEVELS, PlanOptions, plan_graph
from rhino.planner.build import BuildOptions
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh
from rhino.planner.pins import annotation_pins
from rhino.step_arguments import abstract_args, check_arity, signature
from rhino.vocabulary import ScheduleKind

DEFAULT_MICROBATCHES = 4
"""Microbatches per step of a pipeline when none are given (both doors, the CLI too)."""


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """The options that decide a plan, as both front doors give them.

    Attributes:
        opt_level: ``"O2"`` or ``"O3"``.
        time_limit: seconds per solve.
        min_split_flops: ops of at least this many FLOPs may not run replicated.
        memory_budget: bytes per device: with a cluster, each stage's estimated peak
            (``PipelineOptions.memory_budget``); with a mesh it is used by the door (see
            the module docstring), not here.
        annotations: ``{pytree path or named_scope name: spec}`` pinned in every plan.
        num_microbatches: microbatches per pipeline step (None: ``DEFAULT_MICROBATCHES``).
        schedule: the pipeline schedule (None: ``auto``, the planner's choice).
        stages: a stage count, or a hand-given split ``{weight path prefix: stage}``.
        virtual_stages: stages of the model per device group (``interleaved-1f1b``, which
            it implies; ``stages`` then counts the device groups): the model is cut into
            ``stages * virtual_stages`` stages, group ``g`` running ``g, g + stages, ...``.
        batch_args: what carries the batch (None: the non-state, non-scalar arguments).
        epsilon: stage imbalance tolerance of the stage ILP.
        max_stages: the most pipeline stages (None: every device).
        build: problem-builder options replacing the runnable defaults (``rhino.plan``'s
            ``build=``: a plan made with others may not be one ``auto_parallel`` can run).
        parallel: plan the pipeline search's candidates in parallel workers (only how
            fast the search runs; the plan is the same).
        per_microbatch_statistics: a pipeline may let each microbatch use its own
            estimate of a statistic of the whole batch, and pair only its own examples
            (``auto_parallel``'s option): which values a microbatch cuts depends on it.
    """

    opt_level: str = "O2"
    time_limit: float = 600.0
    min_split_flops: float | None = None
    memory_budget: int | None = None
    annotations: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    num_microbatches: int | None = None
    schedule: ScheduleKind | None = None
    stages: int | Mapping[str, int] | None = None
    virtual_stages: int = 1
    batch_args: tuple[str, ...] | None = None
    epsilon: float = 0.1
    max_stages: int | None = None
    build: BuildOptions | None = None
    parallel: bool = False
    per_microbatch_statistics: bool = False

    def __post_init__(self):
        put = functools.partial(object.__setattr__, self)
        if self.opt_level not in OPT_LEVELS:
            raise OptionsError(f"opt_level: expected one of {OPT_LEVELS}, found "
                               f"{self.opt_level!r}")
        put("time_limit", positive("time_limit (seconds)", self.time_limit))
        put("memory_budget", positive("memory_budget (bytes per device)", self.memory_budget,
                                      int, allow_none=True))
        put("min_split_flops", positive("min_split_flops (FLOPs)", self.min_split_flops,
                                        allow_none=True))
        put("num_microbatches", positive("num_microbatches", self.num_microbatches, int,
                                         allow_none=True))
        put("max_stages", positive("max_stages", self.max_stages, int, allow_none=True))
        if not (isinstance(self.epsilon, (int, float)) and self.epsilon >= 0):
            raise OptionsError(f"epsilon: expected a number >= 0, found {self.epsilon!r}")
        if self.schedule is not None:
            put("schedule", ScheduleKind.parse(self.schedule, "schedule"))
        s = self.stages
        if isinstance(s, Mapping):
            if not s or not all(isinstance(v, int) and v >= 0 for v in s.values()):
                raise OptionsError(f"stages: expected {{weight path prefix: stage >= 0}}, "
                                   f"found {dict(s)!r}")
            put("stages", dict(s))
        elif s is not None:
            put("stages", positive("stages", s, int))
        self._check_virtual(put)
        put("annotations", dict(self.annotations or {}))
        if self.batch_args is not None:
            if isinstance(self.batch_args, str):
                raise OptionsError(f"batch_args: expected a tuple of argument names or "
                                   f"paths, found the string {self.batch_args!r} (write "
                                   f"({self.batch_args!r},))")
            put("batch_args", tuple(self.batch_args))

    def _check_virtual(self, put: Callable) -> None:
        v = positive("virtual_stages", self.virtual_stages, int)
        put("virtual_stages", v)
        inter = self.schedule is ScheduleKind.INTERLEAVED
        if v == 1 and inter:
            raise OptionsError("virtual_stages: expected >= 2 with schedule "
                               "'interleaved-1f1b' (stages of the model per device group), "
                               "found 1")
        if v == 1:
            return
        if self.schedule not in (None, ScheduleKind.AUTO, ScheduleKind.INTERLEAVED):
            raise OptionsError(f"schedule: expected 'interleaved-1f1b' with virtual_stages="
                               f"{v} (the schedule of device groups running several "
                               f"stages), found '{self.schedule}'")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise OptionsError(f"stages: expected a count of device groups >= 2 with "
                               f"virtual_stages={v}, found {self.stages!r}")
        put("schedule", ScheduleKind.INTERLEAVED)

    @property
    def microbatches(self) -> int:
        return self.num_microbatches or DEFAULT_MICROBATCHES

    @property
    def stage_count(self) -> int | None:
        """The number of stages asked for (None: the planner's choice)."""
        if isinstance(self.stages, Mapping):
            return max(self.stages.values()) + 1
        return self.stages

    def build_options(self, pipeline: bool) -> BuildOptions:
        """The problem builder's options: what the lowering can run. Neither kind of
        program takes pending sums through linear ops yet. The SPMD lowering can hold a
        carried pending sum explicit (``hlo_passes/pending.py``: plans built with
        ``partial_passthrough=True`` run as priced on the zoo's MLP, GPT, VGG19, U-Net and
        DNABERT), but with it on, the search on a 2-D mesh takes 2 to 6 times as long (O3
        on the zoo GPT over (2, 4): 52 s against 8.4 s; benchmarks/RESULTS.md) for
        estimates 0.3-0.5 % lower, and 17 of the default suite's tests fail: plans whose
        uneven splits' sums XLA reduces at their source, and tests that expect the
        textbook plans the pass-through search now beats (the two-speed Megatron closed
        forms among them). Stage programs reduce a split contraction at its source. An
        SPMD program keeps strided values split only inside (``strided_interior_only``),
        and splits dimensions its shards do not divide only inside as well (``uneven``:
        JAX refuses an uneven sharding at a ``jax.jit`` boundary); stage programs have
        neither, since a stage's forward and backward tasks hand values to each other
        across such boundaries."""
        if self.build is not None:
            return self.build
        if pipeline:
            return BuildOptions(strided=False, partial_passthrough=False,
                                min_split_flops=self.min_split_flops)
        return BuildOptions(strided_interior_only=True, partial_passthrough=False,
                            uneven=True, min_split_flops=self.min_split_flops)

    def spmd_options(self, graph: HloGraph | None = None, mesh: AbstractMesh | None = None,
                     refine: bool = True, memory_budget: int | None = None) -> PlanOptions:
        """``PlanOptions`` of an SPMD plan of ``graph`` on ``mesh`` (the annotations pinned
        there; ``refine=False``: without O2's window moves, for weighing meshes)."""
        build = self.build_options(pipeline=False)
        if self.annotations and graph is not None and mesh is not None:
            pins = annotation_pins(graph, self.annotations, mesh)
            build = dataclasses.replace(build, pinned={**build.pinned, **pins})
        return PlanOptions(opt_level=self.opt_level, memory_budget=memory_budget,
                           time_limit=self.time_limit, build=build, refine=refine)

    def pipeline_options(self, divisors: Mapping | None = None) -> PipelineOptions:
        """``PipelineOptions`` of the cluster search (``divisors``: see
        ``PipelineOptions.microbatch_divisors``)."""
        given = dict(self.stages) if isinstance(self.stages, Mapping) else None
        count = self.stage_count
        kinds = (("spmd",) if count == 1 else ("pipeline", "hybrid") if count is not None
                 else ("spmd", "pipeline", "hybrid"))
        spmd = PlanOptions(opt_level=self.opt_level, time_limit=self.time_limit,
                           build=self.build_options(pipeline=True))
        return PipelineOptions(
            num_microbatches=self.microbatches, num_stages=count,
            virtual_stages=self.virtual_stages,
            memory_budget=self.memory_budget, annotations=dict(self.annotations) or None,
            weight_stages=given if given and count > 1 else None, kinds=kinds,
            batch_args=self.batch_args, spmd=spmd,
            schedule=self.schedule or ScheduleKind.AUTO, epsilon=self.epsilon,
            max_stages=self.max_stages, two_d=False,
            workers=0 if self.parallel else 1,
            executor="auto" if self.parallel else "serial",
            microbatch_divisors=dict(divisors) if divisors else None)


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A step traced at abstract arguments: ``traced`` (named equation scopes, so the ops
    the planner sees are the values the lowering constrains), its ``graph`` and the
    ``abstract`` arguments (``ShapeDtypeStruct``s, weak types kept)."""

    fn: Callable
    traced: ScopedFunction
    graph: HloGraph
    abstract: tuple


def trace_step(fn: Callable, args: tuple, progress: Callable[[str], None] | None = None
               ) -> TracedStep:
    """Trace ``fn`` at the signature of ``args`` (arrays, Python numbers or
    ``ShapeDtypeStruct``s) and ingest it.

    Raises:
        ArgumentError: arguments the step cannot bind, or a leaf that is no array.
    """
    say = progress or (lambda msg: None)
    key = signature(fn, args)
    check_arity(fn, args)
    abstract = abstract_args(key)
    say("tracing")
    traced = ScopedFunction(fn, *abstract)
    say("ingesting")
    return TracedStep(fn, traced, ingest(traced, *abstract), abstract)


def runnable_cost(cost: CostModel) -> CostModel:
    """``cost`` as the lowering runs a plan: strided values move into and out of a strided
    layout by gathering (``hlo_passes.strided``), so the planner charges that."""
    return dataclasses.replace(cost, strided_moves_all_to_all=False)


def mesh_shapes_to_weigh(n: int) -> list[tuple[int, ...]]:
    """Mesh shapes worth weighing for ``n`` devices when none is given: the 1-D mesh, and
    where ``n`` is not a power of two (6, 12, ...: a dimension of 1024 does not split 6
    ways) its 2-D factorizations too, so that a factor of 2 can still split it.

    >>> mesh_shapes_to_weigh(8), mesh_shapes_to_weigh(6)
    ([(8,)], [(6,), (2, 3), (3, 2)])
    """
    if n <= 2 or n & (n - 1) == 0:
        return [(n,)]
    return [(n,)] + [(a, n // a) for a in range(2, n // 2 + 1) if n % a == 0]


def choose_mesh(graph: HloGraph, shapes: Sequence[tuple[int, ...]],
                cost_for: Callable[[AbstractMesh], tuple[AbstractMesh, CostModel]],
                options: PlanOptions, progress: Callable[[str], None] | None = None
                ) -> tuple[AbstractMesh, str]:
    """The shape whose SPMD plan has the least estimated step time, and why (a sentence
    naming the others' estimates)."""
    tried = []
    for shape in shapes:
        mesh, cost = cost_for(AbstractMesh(shape))
        sp = plan_graph(graph, mesh, cost, options, progress)
        tried.append((sp.compute_s + sp.communication_s, tuple(shape), mesh))
    best = min(tried, key=lambda t: t[0])
    others = ", ".join(f"{sh} {t * 1e3:.3f} ms" for t, sh, _ in tried if sh != best[1])
    n = best[2].num_devices
    how = "" if options.refine or options.opt_level != "O2" else ", before window moves"
    why = (f"SPMD on mesh {best[1]}: least estimated step time ({best[0] * 1e3:.3f} ms{how}) "
           f"of the shapes of {n} devices (others: {others})")
    if progress is not None:
        progress(why)
    return best[2], why


def plan_on_mesh(graph: HloGraph, request: PlanRequest, mesh: AbstractMesh | None,
                 num_devices: int, cost_for: Callable[[AbstractMesh], CostModel],
                 progress: Callable[[str], None] | None = None,
                 hosts: int | None = None
                 ) -> tuple[AbstractMesh, CostModel, PlanOptions, str | None]:
    """The mesh, cost model and options of an SPMD plan, and why the mesh (None when it
    was given).

    Without a mesh: the 1-D mesh over ``num_devices``, or where that count is not a power
    of two (and nothing is annotated) the least estimated step time of its 2-D
    factorizations too (``choose_mesh``; weighed without O2's window moves).

    Where the devices are those of ``hosts`` hosts (a multi-controller job), the mesh of
    hosts × devices per host is weighed too (an axis inside the hosts, one across them).

    Args:
        cost_for: the cost model of a mesh (already ``runnable_cost``).
        hosts: the hosts the devices are on, host-major (None: one).
    """
    why = None
    if mesh is None:
        shapes = [] if request.annotations else mesh_shapes_to_weigh(num_devices)
        if shapes and hosts and 1 < hosts < num_devices and num_devices % hosts == 0 and \
                (hosts, num_devices // hosts) not in shapes:
            shapes.append((hosts, num_devices // hosts))
        if len(shapes) > 1:
            mesh, why = choose_mesh(graph, shapes, lambda m: (m, cost_for(m)),
                                    request.spmd_options(refine=False), progress)
        else:
            mesh = AbstractMesh((num_devices,))
    cost = cost_for(mesh)
    cost.check(mesh, "plan")
    return mesh, cost, request.spmd_options(graph, mesh), why


def spmd_plan(graph: HloGraph, mesh: AbstractMesh, cost: CostModel, options: PlanOptions,
              why: str | None = None, progress: Callable[[str], None] | None = None,
              timings: tuple[float, float] = (0.0, 0.0)) -> Plan:
    """The one-stage ``Plan`` of ``graph`` on ``mesh`` (``why``: the mesh choice)."""
    plan = Plan.from_spmd(plan_graph(graph, mesh, cost, options, progress, timings),
                          graph.total_flops)
    return dataclasses.replace(plan, decision=why) if why else plan


def plan_on_cluster(step: TracedStep | HloGraph, request: PlanRequest, cluster: Cluster,
                    progress: Callable[[str], None] | None = None,
                    ingest_s: float = 0.0) -> Plan:
    """The controller's plan over ``cluster``: SPMD, pipeline or hybrid.

    For a traced step that may be pipelined, the batch leaves are checked against the
    microbatches first (``check_batch_leaves``), and the dimensions the microbatches cut
    are found on the whole-batch trace (``rhino.jaxpr.microbatch``), so that no stage plan
    splits what a microbatch cannot hold; a step whose gradients need the whole batch at
    once is refused there, before any pipeline is searched.

    Raises:
        OptionsError: a batch leaf the microbatches do not divide (naming ``batch_args=``).
        BatchCouplingError: the gradients need a statistic of the whole batch (unless
            ``per_microbatch_statistics``).
        GradientBoundaryError, InfeasiblePlanError: as ``plan_pipeline_graph``.
    """
    from rhino.hlo_passes.lower import key_args, microbatch_divisors
    from rhino.pipeline.coarsen import classify_ops

    graph = step.graph if isinstance(step, TracedStep) else step
    divisors = None
    if isinstance(step, TracedStep) and request.stage_count != 1:
        m = request.microbatches
        boundary = find_gradient_boundary(graph, BoundaryOptions(request.batch_args))
        check_batch_leaves(graph, boundary, m, key_args(step.traced))
        divisors = microbatch_divisors(step.traced, graph, step.abstract,
                                       boundary.batch_params, m,
                                       classify_ops(graph, boundary).role,
                                       request.per_microbatch_statistics)
    options = request.pipeline_options(divisors)
    return plan_pipeline_graph(graph, cluster, options, progress, ingest_s=ingest_s)


def positive(name: str, value: Any, kind: type = float, allow_none: bool = False) -> Any:
    """``value`` as a positive ``kind`` (int: a whole number), else ``OptionsError``.

    >>> positive("stages", 2.0, int)
    2
    """
    if value is None and allow_none:
        return None
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok or not np.isfinite(float(value)) or not value > 0:
        want = "a positive integer" if kind is int else "a positive number"
        raise OptionsError(f"{name}: expected {want}{' or None' if allow_none else ''}, "
                           f"found {value!r}")
    return kind(value)
