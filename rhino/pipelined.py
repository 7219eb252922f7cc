"""Pipelined execution of a one-device training step: ``auto_parallel(..., cluster=...)``.

First call per input signature:

1. trace the step through the equation-scoped interpreter and ingest its HLO;
2. plan it over the cluster with the pipeline planner (``rhino.plan_pipeline``: stages,
   stage meshes, each stage's SPMD plan) — or reuse a given ``PipelinePlan``;
3. map the plan's op stages and roles onto the step's jaxpr equations and cut the
   microbatch-sized step into F/B/A stage programs (``runtime.stage_programs``);
4. build one ``StageWorker`` per stage on its devices with the stage plan's shardings, and
   an executor: ``local`` (one thread per stage in this process, disjoint local devices) or
   ``ray`` (one actor per stage, ``runtime.ray_executor``).

Each call then runs the static schedule (``1f1b`` by default, ``gpipe``, ``eager-1f1b``)
over ``num_microbatches`` microbatches and returns what the step returns: the updated state
and the metrics averaged over microbatches (exact for losses that are means over the batch;
``accumulate='sum'`` for sums). ``timeline(path)`` draws the last step's measured tasks.

Example:
    >>> import rhino
    >>> from rhino.models import get_model
    >>> m = get_model("gpt", layers=4, hidden=64, heads=2, seq=16, vocab=256, batch=16)
    >>> step = rhino.auto_parallel(m.step, cluster="2x4", stages=2,
    ...                            num_microbatches=4)              # doctest: +SKIP
    >>> params, opt_state, loss = step(params, opt_state, batch)   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rhino.errors import RhinoError
from rhino.hlo_passes import HloGraph, ingest
from rhino.hlo_passes.annotate import EqnMap, ScopedFunction
from rhino.pipeline.api import make_cluster
from rhino.pipeline.cluster import Cluster
from rhino.pipeline.coarsen import classify_ops
from rhino.pipeline.gradient import BoundaryOptions, find_gradient_boundary
from rhino.pipeline.plan import PipelinePlan
from rhino.pipeline.search import PipelineOptions, plan_pipeline_graph
from rhino.runtime import spmd
from rhino.runtime.executor import (DEFAULT_TIMEOUT_S, ExecutorError, LocalExecutor,
                                    StageShardings, StageWorker)
from rhino.runtime.schedules import SCHEDULE_NAMES, make_schedule
from rhino.runtime.stage_programs import (ACCUMULATE, FlatProgram, StepSplit,
                                          assignment_from_ops, flatten, split_step)

EXECUTORS = ("local", "ray")
TRANSPORTS = ("device_put", "broadcast", "send_recv")


@dataclasses.dataclass(frozen=True)
class PipelineRunOptions:
    """Options of pipelined ``auto_parallel`` (see ``rhino.auto_parallel``).

    Attributes:
        cluster: ``"HOSTSxDEVICES"`` or a ``Cluster``.
        num_microbatches: microbatches per step (the batch arguments' leading dimension
            must divide by it).
        schedule: ``1f1b`` (default), ``gpipe`` or ``eager-1f1b``.
        executor: ``local`` or ``ray``.
        stages: the number of pipeline stages (None: the planner's choice), or a hand-given
            split ``{weight pytree path prefix: stage}`` (e.g. ``{"params['wte']": 0,
            "params['layers'][0]": 0, "params['layers'][1]": 1}``) used instead of the stage
            ILP; the stage meshes and their SPMD plans are still searched.
        plan: a ``PipelinePlan`` to reuse instead of planning.
        accumulate: ``mean`` or ``sum`` of batch-dependent values over microbatches.
        batch_args: the argument names carrying the batch (default: non-state ones).
        timeout: seconds any one wait (a value from another stage, a step) may take.
        devices: local devices (default: ``jax.devices()``); the cluster's devices are
            numbered host-major over them.
        report: print the plan report on the first call (default: env ``RHINO_REPORT``).
        ray_address: Ray cluster address for ``executor='ray'`` (None: ``rhino.init``'s or
            a local one).
        transport: how the local executor moves values between stage meshes:
            ``device_put`` (XLA's copy onto the receiver's sharding), or ``broadcast`` /
            ``send_recv``: 004's cross-mesh resharding (unit tasks, load-balanced senders;
            ``runtime.cross_mesh``).
    """

    cluster: str | Cluster = "1x8"
    num_microbatches: int = 4
    schedule: str = "1f1b"
    executor: str = "local"
    stages: Any = None
    plan: PipelinePlan | None = None
    accumulate: str = "mean"
    batch_args: tuple[str, ...] | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    devices: tuple | None = None
    report: bool | None = None
    ray_address: str | None = None
    transport: str = "device_put"

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise RhinoError(f"transport: expected one of {TRANSPORTS}, found "
                             f"{self.transport!r}")
        if self.schedule not in SCHEDULE_NAMES:
            raise RhinoError(f"schedule: expected one of {SCHEDULE_NAMES}, found "
                             f"{self.schedule!r}")
        if self.executor not in EXECUTORS:
            raise RhinoError(f"executor: expected one of {EXECUTORS}, found {self.executor!r}")
        if self.num_microbatches < 1:
            raise RhinoError(f"num_microbatches: expected >= 1, found {self.num_microbatches}")
        if self.accumulate not in ACCUMULATE:
            raise RhinoError(f"accumulate: expected one of {ACCUMULATE}, found "
                             f"{self.accumulate!r}")
        if not self.timeout > 0:
            raise RhinoError(f"timeout: expected > 0 seconds, found {self.timeout!r}")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything a process needs to build one ``StageWorker`` (picklable: a Ray actor
    re-traces the step and re-splits it; the split is deterministic).

    Attributes:
        fn: the step; abstract_mb: its arguments with microbatch-sized batch leaves.
        assignment: equation path -> (role, stage); batch_refs, num_stages,
        num_microbatches, accumulate, schedule: as in ``split_step`` / ``make_schedule``.
        stage: the stage; mesh_shape, axis_names: its mesh; shardings: its shardings.
        measure: time every task (blocking on its results).
    """

    fn: Callable
    abstract_mb: tuple
    assignment: dict
    batch_refs: tuple[int, ...]
    num_stages: int
    num_microbatches: int
    accumulate: str
    schedule: str
    stage: int
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    shardings: StageShardings
    measure: bool = True

    def split(self) -> StepSplit:
        flat = flatten(jax.make_jaxpr(self.fn)(*self.abstract_mb))
        return split_step(flat, self.assignment, self.batch_refs, self.num_stages,
                          self.num_microbatches, self.accumulate)

    def build(self, devices: Sequence[Any], split: StepSplit | None = None) -> StageWorker:
        """The worker on ``devices`` (as many as the mesh has)."""
        need = int(np.prod(self.mesh_shape))
        if len(devices) != need:
            raise ExecutorError(f"stage {self.stage}: expected {need} devices for mesh "
                                f"{self.mesh_shape}, found {len(devices)}")
        mesh = spmd.device_mesh(self.mesh_shape, self.axis_names, list(devices))
        schedule = make_schedule(self.schedule, self.num_stages, self.num_microbatches)
        return StageWorker(split or self.split(), self.stage, mesh, self.shardings, schedule,
                           self.measure)


@dataclasses.dataclass
class _Entry:
    plan: PipelinePlan
    split: StepSplit
    specs: list[WorkerSpec]
    executor: Any
    out_tree: Any


class PipelinedStep:
    """A step wrapped by ``auto_parallel(..., cluster=...)``; call it like the original."""

    def __init__(self, fn: Callable, options: PipelineRunOptions, progress_after_s: float = 2.0,
                 opt_level: str = "O2"):
        self.fn = fn
        self.options = options
        self.progress_after_s = progress_after_s
        self.opt_level = opt_level
        self._cache: dict[Any, _Entry] = {}
        self._last: _Entry | None = None
        functools.update_wrapper(self, fn)

    # ----------------------------------------------------------------- public
    def __call__(self, *args: Any) -> Any:
        entry = self._entry(args)
        flat = jax.tree_util.tree_leaves(args)
        outs = entry.executor.run(flat)
        res = []
        for o in entry.split.outputs:
            if o.source == "lit":
                res.append(jax.numpy.asarray(o.value))
            elif o.source == "arg":
                res.append(flat[o.ref])
            else:
                res.append(outs[o.ref])
        self._last = entry
        return jax.tree_util.tree_unflatten(entry.out_tree, res)

    def plan_for(self, *args: Any) -> PipelinePlan:
        """The pipeline plan used for these arguments (planning if needed)."""
        return self._entry(args).plan

    def split_for(self, *args: Any) -> StepSplit:
        """The stage programs' split for these arguments."""
        return self._entry(args).split

    @property
    def last_records(self) -> list:
        """Measured task records of the last step."""
        return [] if self._last is None else list(self._last.executor.last_records)

    @property
    def last_step_s(self) -> float:
        """Wall-clock seconds of the last step."""
        return 0.0 if self._last is None else self._last.executor.last_step_s

    def timeline(self, path: str | None = None, title: str | None = None):
        """The last step's measured schedule as an ``ExecutedTimeline``; with ``path``,
        also drawn there as a per-stage Gantt chart (PNG)."""
        from rhino.runtime.timeline import ExecutedTimeline

        if self._last is None:
            raise RhinoError("timeline: expected a step to have run, found none")
        sp = self._last.split
        tl = ExecutedTimeline(tuple(self._last.executor.last_records), self.options.schedule,
                              sp.num_stages, sp.num_microbatches)
        if path is not None:
            tl.draw(path, title=title)
        return tl

    def distributed_init(self, init_fn: Callable, *init_args: Any, example_args: tuple):
        """Create the training state directly on the stage meshes (Rhino §6.3).

        ``init_fn(*init_args)`` returns the step's leading arguments (e.g. ``(params,
        opt_state)`` for ``step(params, opt_state, batch)``); each leaf is computed by a
        program compiled for the stage that reads it first, with that stage's sharding
        (``runtime.init.distributed_init``), so no device materializes another stage's
        weights. The values equal ``jax.jit(init_fn)(*init_args)`` (partitionable threefry).

        Args:
            init_fn, init_args: the initializer and its arguments (e.g. a PRNG key).
            example_args: the step's arguments (arrays or ShapeDtypeStructs) the state is
                for; plans the step if it has not been planned yet.

        Raises:
            RhinoError: the local executor is needed, or ``init_fn``'s leaves do not match
                the step's leading argument leaves in shape and dtype.
        """
        from rhino.runtime.init import distributed_init

        entry = self._entry(tuple(example_args))
        workers = getattr(entry.executor, "workers", None)
        if workers is None:
            raise RhinoError("distributed_init: expected the local executor, found "
                             f"{self.options.executor!r} (actors initialize their own state)")
        shapes = jax.eval_shape(init_fn, *init_args)
        leaves, tree = jax.tree_util.tree_flatten(shapes)
        ex = jax.tree_util.tree_leaves(example_args)
        for k, x in enumerate(leaves):
            if k >= len(ex) or tuple(x.shape) != tuple(np.shape(ex[k])) or \
                    x.dtype != jax.numpy.result_type(ex[k]):
                found = (f"{x.shape} {x.dtype}" if k < len(ex) else "no such argument")
                want = (f"{tuple(np.shape(ex[k]))} {jax.numpy.result_type(ex[k])}"
                        if k < len(ex) else "-")
                raise RhinoError(f"distributed_init: leaf {k} of init_fn's result should be "
                                 f"the step's argument leaf {k}: expected {want}, found {found}")
        shardings = []
        for k in range(len(leaves)):
            reader = next((w for w in workers if k in entry.split.stage_args(w.stage)),
                          workers[0])
            shardings.append(reader.sharding(k))
        return distributed_init(init_fn, *init_args,
                                shardings=jax.tree_util.tree_unflatten(tree, shardings))

    def close(self) -> None:
        """Stop the executors (threads, Ray actors)."""
        for e in self._cache.values():
            e.executor.close()
        self._cache.clear()

    # ----------------------------------------------------------------- build
    def _entry(self, args: tuple) -> _Entry:
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((tuple(np.shape(x)), jax.numpy.result_type(x)) for x in leaves))
        entry = self._cache.get(key)
        if entry is None:
            entry = self._build(args)
            self._cache[key] = entry
        return entry

    def _build(self, args: tuple) -> _Entry:
        from rhino.auto_parallel import _Progress, report_wanted

        o = self.options
        name = getattr(self.fn, "__name__", "step")
        progress = _Progress(f"auto_parallel({name}, cluster)", self.progress_after_s)
        try:
            abstract = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)), args)
            progress("tracing")
            traced = ScopedFunction(self.fn, *abstract)
            graph = ingest(traced, *abstract)
            cluster = make_cluster(o.cluster)
            progress("planning the pipeline")
            plan = o.plan if o.plan is not None else self._plan(graph, cluster, progress)
            _check_plan(plan, graph)
            progress("splitting the step into stage programs")
            entry = self._split(traced, graph, plan, abstract)
        finally:
            progress.close()
        if report_wanted(o.report):
            print(plan.report(), file=sys.stderr)
        return entry

    def _plan(self, graph: HloGraph, cluster: Cluster, progress) -> PipelinePlan:
        o = self.options
        from rhino.planner.api import PlanOptions
        from rhino.planner.build import BuildOptions

        spmd_opts = PlanOptions(opt_level=self.opt_level, validate=False,
                                build=BuildOptions(strided=False))
        given = dict(o.stages) if isinstance(o.stages, dict) else None
        count = max(given.values()) + 1 if given else o.stages
        kinds = ("pipeline", "hybrid") if count not in (None, 1) else \
            ("spmd", "pipeline", "hybrid")
        opts = PipelineOptions(num_microbatches=o.num_microbatches, num_stages=count,
                               weight_stages=given if given and count > 1 else None,
                               kinds=kinds if count != 1 else ("spmd",),
                               batch_args=o.batch_args, spmd=spmd_opts, two_d=False,
                               workers=1, executor="serial")
        return plan_pipeline_graph(graph, cluster, opts, progress)

    def _split(self, traced: ScopedFunction, graph: HloGraph, plan: PipelinePlan,
               abstract: tuple) -> _Entry:
        o = self.options
        m = o.num_microbatches
        boundary = find_gradient_boundary(graph, BoundaryOptions(o.batch_args))
        roles = classify_ops(graph, boundary)
        by_name = {op.name: op.id for op in graph.ops}
        stage_of = [-1] * len(graph.ops)
        p = plan.num_stages
        if plan.kind == "spmd":
            for i in range(len(graph.ops)):
                stage_of[i] = 0
        else:
            for st in plan.stages:
                for nm in st.ops:
                    if nm in by_name:
                        stage_of[by_name[nm]] = st.index
        assignment = assignment_from_ops(traced, graph, stage_of, roles.role)
        batch_refs = tuple(sorted(graph.ops[q].arg.index for q in boundary.batch_params))
        leaves, tree = jax.tree_util.tree_flatten(abstract)
        mb_leaves = []
        for k, x in enumerate(leaves):
            if k in batch_refs:
                if not x.shape or x.shape[0] % m:
                    raise RhinoError(f"batch argument {graph.ops[boundary.batch_params[0]].arg.path}"
                                     f"...: expected a leading dimension divisible by "
                                     f"num_microbatches={m}, found shape {x.shape}")
                x = jax.ShapeDtypeStruct((x.shape[0] // m,) + tuple(x.shape[1:]), x.dtype)
            mb_leaves.append(x)
        abstract_mb = jax.tree_util.tree_unflatten(tree, mb_leaves)
        flat = flatten(jax.make_jaxpr(self.fn)(*abstract_mb))
        _check_same_program(traced, flat)
        split = split_step(flat, assignment, batch_refs, p, m, o.accumulate)
        emap = EqnMap(traced, graph)
        specs = []
        for st in plan.stages:
            shard = _stage_shardings(st.spmd, graph, emap, flat, split, st.index,
                                     plan.kind == "spmd")
            specs.append(WorkerSpec(self.fn, abstract_mb, assignment, batch_refs, p, m,
                                    o.accumulate, o.schedule, st.index, tuple(st.mesh.shape),
                                    tuple(st.mesh.axis_names), shard))
        executor = self._executor(plan, split, specs)
        return _Entry(plan, split, specs, executor, traced.out_tree)

    def _executor(self, plan: PipelinePlan, split: StepSplit, specs: list[WorkerSpec]):
        o = self.options
        if o.executor == "ray":
            from rhino.runtime.ray_executor import RayExecutor

            return RayExecutor(specs, plan.cluster, timeout=o.timeout, address=o.ray_address)
        devices = list(o.devices) if o.devices is not None else jax.devices()
        need = max(d for st in plan.stages for d in st.devices) + 1
        if len(devices) < need:
            raise RhinoError(f"cluster {plan.cluster.hosts}x{plan.cluster.devices_per_host}: "
                             f"expected {need} local devices for the local executor, found "
                             f"{len(devices)}")
        workers = [spec.build([devices[d] for d in st.devices], split)
                   for spec, st in zip(specs, plan.stages)]
        transport = None
        if o.transport != "device_put":
            from rhino.runtime.cross_mesh import CrossMeshTransport

            transport = CrossMeshTransport(lambda dst, ref: workers[dst].sharding(ref),
                                           len(workers), plan.cluster.devices_per_host,
                                           strategy=o.transport)
        return LocalExecutor(workers, o.timeout, transport)


def _check_plan(plan: PipelinePlan, graph: HloGraph) -> None:
    names = {op.name for op in graph.ops}
    missing = [n for st in plan.stages for n in st.ops if n not in names]
    if missing or any(st.spmd is None for st in plan.stages):
        what = (f"ops {missing[:3]} this program lacks" if missing
                else "stages without their SPMD plans (saved with include_spmd=False)")
        raise RhinoError(f"pipeline plan: made for {plan.program}, it has {what}; re-plan "
                         f"for this function and these argument shapes")


def _check_same_program(traced: ScopedFunction, flat: FlatProgram) -> None:
    """The microbatch-sized trace must have the same equations as the planned one."""
    full = [(p, e.primitive.name) for p, e in traced.leaf_eqns().items()]
    mine = [(fe.path, fe.eqn.primitive.name) for fe in flat.eqns]
    if full != mine:
        first = next((i for i, (a, b) in enumerate(zip(full, mine)) if a != b),
                     min(len(full), len(mine)))
        raise RhinoError(f"the step traced with microbatch-sized arguments differs from the "
                         f"step traced with the whole batch (equation {first}: "
                         f"{full[first] if first < len(full) else None} vs "
                         f"{mine[first] if first < len(mine) else None}): a pipelined step "
                         f"must not branch on the batch size")


def _stage_shardings(plan, graph: HloGraph, emap: EqnMap, flat: FlatProgram,
                     split: StepSplit, stage: int, whole: bool) -> StageShardings:
    """A stage's ExecutionPlan as PartitionSpecs on the stage's programs (microbatch
    shapes: a split that does not divide a microbatch dimension is an error)."""
    if plan is None:
        return StageShardings()
    names = plan.mesh.axis_names
    sizes = dict(zip(names, plan.mesh.shape))
    out_spec = {o.name: o.out_spec for o in plan.ops}
    ref_of = {(fe.path, k): r for fe in flat.eqns for k, r in enumerate(fe.outs)
              if r is not None}
    values: dict = {}
    refs: dict[int, Any] = {}
    bad: list[str] = []

    def pspec(spec, ref):
        if spec is None:
            return None
        try:
            ps = spmd.partition_spec(spec.without_partial(), names)
        except spmd.UnrealizableSpecError:
            return None
        shape = flat.avals[ref].shape
        for d, entry in enumerate(ps):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            n = int(np.prod([sizes[a] for a in axes])) if axes else 1
            if d >= len(shape) or shape[d] % n:
                bad.append(f"v{ref} {tuple(shape)} split {spec.to_str()}")
                return None
        return ps

    mine = {i for k in ("F", "B", "A") for i in split.task(k, stage).eqns}
    paths = {flat.eqns[i].path for i in mine}
    for (path, k), op in emap.producer.items():
        if path not in paths or (path, k) not in ref_of:
            continue
        spec = out_spec.get(graph.ops[op].name)
        ps = pspec(spec, ref_of[(path, k)])
        if ps is not None:
            values[(path, k)] = ps
            refs[ref_of[(path, k)]] = ps
    for p in plan.params:
        if p.path.startswith("cut:"):
            op = next((o.id for o in graph.ops if o.name == p.path[4:]), None)
            key = next((key for key, v in emap.producer.items() if v == op), None)
            ref = ref_of.get(key) if key is not None else None
        else:
            q = next((q for q in graph.params if graph.ops[q].arg.path == p.path), None)
            ref = graph.ops[q].arg.index if q is not None else None
        if ref is not None:
            ps = pspec(p.spec, ref)
            if ps is not None:
                refs[ref] = ps
    if bad:
        raise RhinoError(f"stage {stage}: the plan splits dimensions that a microbatch does "
                         f"not divide ({'; '.join(bad[:3])}{'...' if len(bad) > 3 else ''}); "
                         f"use a batch divisible by num_microbatches × the stage's devices or "
                         f"fewer microbatches")
    return StageShardings(values, refs)
