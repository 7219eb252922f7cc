"""Building the run of one signature of an ``auto_parallel`` step.

``ParallelStep`` (``rhino.parallel_step``) traces the step for a new signature, then hands
the traced step to ``StepBuilder``, which plans it (unless a plan is given): SPMD on a mesh, or
over a cluster through ``rhino.front_door``; lowers it; and starts the run the plan and the
options call for: a ``DirectRun`` (one SPMD program, local executor) or a ``StagedRun``
(stage programs under the static schedule on threads, Ray actors or this process's stages
of a multi-controller job). The result is an ``StepEntry``: the plan, the graph and the run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax

from rhino.backends import (backend_figures, cost_model_for_devices, devices_per_host,
                            figures_for_devices)
from rhino.cluster import Cluster, check_device_count
from rhino.distributed import (DistributedError, agree_on_plan, check_cross_process_program,
                               job_devices, spans_processes)
from rhino.errors import OptionsError, RhinoError
from rhino.front_door import TracedStep, plan_on_cluster, plan_on_mesh, runnable_cost, spmd_plan
from rhino.hlo_passes import HloGraph
from rhino.hlo_passes.lower import (StageLowering, compile_spmd, key_args, lower_spmd,
                                    lower_stages)
from rhino.parallel_plan import Plan
from rhino.pipeline.api import make_cluster
from rhino.pipeline.coarsen import classify_ops
from rhino.pipeline.gradient import BoundaryOptions, check_batch_leaves, find_gradient_boundary
from rhino.planner.api import PlanOptions
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh
from rhino.planning import argument_lower_bound, fit_compiled_memory
from rhino.progress import Progress
from rhino.runtime.executors import spmd
from rhino.runtime.executors.local import LocalExecutor
from rhino.runtime.executors.runs import DirectRun, StagedRun
from rhino.runtime.executors.worker_spec import WorkerSpec
from rhino.step_options import StepOptions
from rhino.vocabulary import ExecutorKind, ScheduleKind, TransportKind


@dataclasses.dataclass
class StepEntry:
    """A compiled signature: its plan, graph and run."""

    plan: Plan
    graph: HloGraph
    out_tree: Any
    run: DirectRun | StagedRun

    def report(self) -> str:
        return "\n".join([self.plan.report(), *self.run.report_lines()])


def split_stages(step: TracedStep, plan: Plan, batch_args: Sequence[str] | None = None,
                 per_microbatch_statistics: bool = False
                 ) -> tuple[StageLowering, list[WorkerSpec]]:
    """A several-stage ``plan`` written into the traced step: its stage programs
    (``lower_stages``, after the gradient boundary and the batch leaves are checked) and
    the ``WorkerSpec`` of each stage."""
    graph = step.graph
    boundary = find_gradient_boundary(graph, BoundaryOptions(batch_args))
    check_batch_leaves(graph, boundary, plan.num_microbatches, key_args(step.traced))
    roles = classify_ops(graph, boundary).role
    lowering = lower_stages(step.traced, graph, plan, step.abstract, roles,
                            boundary.batch_params, per_microbatch_statistics)
    specs = [WorkerSpec(step.fn, lowering.abstract, lowering.assignment,
                        lowering.batch_refs, plan.num_stages, plan.num_microbatches,
                        plan.schedule.value, st.index, tuple(st.mesh.shape),
                        tuple(st.mesh.axis_names), lowering.shardings[st.index],
                        key_refs=lowering.key_refs,
                        per_microbatch_statistics=per_microbatch_statistics,
                        virtual_stages=plan.virtual_stages)
             for st in plan.stages]
    return lowering, specs


class StepBuilder:
    """Plans (unless a plan is given), lowers and starts the run of one signature."""

    def __init__(self, step: TracedStep, options: StepOptions, progress: Progress):
        self.step, self.o, self.progress = step, options, progress
        self.fn, self.traced, self.graph, self.abstract = (step.fn, step.traced, step.graph,
                                                           step.abstract)
        if options.devices is not None:
            self.devices = list(options.devices)
        else:     # a multi-controller job: every device of the job, host-major
            self.devices = job_devices() if jax.process_count() > 1 else jax.devices()
        self.multi = spans_processes(self.devices)

    def build(self) -> StepEntry:
        """The entry; in a multi-controller job, once every process has made the same plan
        (``rhino.distributed.agree_on_plan``, before anything runs)."""
        entry = self._build()
        if self.multi:
            name = getattr(self.fn, "__name__", "step")
            if entry.plan.num_stages == 1:
                check_cross_process_program(f"auto_parallel({name})'s SPMD plan")
            digest = agree_on_plan(entry.plan.to_json(search_times=False),
                                   f"auto_parallel({name})", self.o.timeout)
            self.progress(f"the {jax.process_count()} processes of the job made the same "
                          f"plan (sha256 {digest[:16]})")
        return entry

    def _check_devices(self, what: str, need: int) -> None:
        """Refuse, before any planning, a mesh or cluster of more devices than the local
        executor has (``what``: the option as the user wrote it)."""
        if self.o.executor is ExecutorKind.LOCAL:
            check_device_count(what, need, self.devices)

    def _build(self) -> StepEntry:
        o = self.o
        if o.plan is None and o.cluster is not None:
            self._check_devices(f"cluster={o.cluster!r}" if isinstance(o.cluster, str)
                                else f"cluster {o.cluster}", self._cluster().num_devices)
        elif o.plan is None and (o.mesh is not None or o.mesh_shape is not None):
            shape = tuple(o.mesh.shape) if o.mesh is not None else tuple(o.mesh_shape)
            what = f"mesh={o.mesh!r}" if o.mesh is not None else f"mesh_shape={shape}"
            self._check_devices(what, math.prod(shape))
        if o.plan is not None:
            plan = o.plan
            # Run options given explicitly replace the saved plan's.
            if o.num_microbatches is not None and plan.num_stages > 1:
                plan = dataclasses.replace(plan, num_microbatches=o.num_microbatches)
            if o.schedule is not None and o.schedule is not ScheduleKind.AUTO and \
                    o.schedule is not plan.schedule:
                if plan.virtual_stages > 1 or o.schedule is ScheduleKind.INTERLEAVED:
                    raise OptionsError(
                        f"schedule: a plan of {len(plan.stages)} stages "
                        f"({plan.virtual_stages} per device group) runs '{plan.schedule}'; "
                        f"found schedule='{o.schedule}' (interleaving is planned: plan "
                        f"again with stages= and virtual_stages=)")
                plan = dataclasses.replace(plan, schedule=o.schedule)
        elif o.cluster is None:
            return self._spmd_on_mesh()
        else:
            request = o.request
            if self.multi and request.stage_count is None:
                # Unless stages are asked for: SPMD candidates only (a pipelined plan's
                # stages must each be on one process's devices, which the search does not
                # weigh yet).
                request = dataclasses.replace(request, stages=1)
            self.progress("planning over the cluster")
            plan = plan_on_cluster(self.step, request, self._cluster(), self.progress)
            self.progress.always(plan.choice_line())
        if plan.num_stages == 1 and o.executor is ExecutorKind.LOCAL:
            return self._entry(plan, self._direct(plan))
        return self._entry(plan, self._staged(plan))

    def _entry(self, plan: Plan, run: DirectRun | StagedRun) -> StepEntry:
        return StepEntry(plan, self.graph, self.traced.out_tree, run)

    # -------------------------------------------------------------- planning
    def _cost_for(self, mesh: AbstractMesh) -> CostModel:
        """The cost model of ``mesh``: ``cost=``'s, or the figures of the devices the mesh
        runs on (its first ``N`` devices), as the lowering runs it (``runnable_cost``)."""
        o = self.o
        on = self.devices[:mesh.num_devices]
        if isinstance(o.cost, CostModel):
            cost = o.cost
        elif isinstance(o.cost, str):
            cost = backend_figures(o.cost).cost_model(mesh, devices_per_host(on))
        else:
            cost = cost_model_for_devices(on, mesh)
        cost.check(mesh, "auto_parallel")
        return runnable_cost(cost)

    def _cluster(self) -> Cluster:
        """The cluster: as given, or parsed with ``cost=``'s figures or the devices'."""
        o = self.o
        if isinstance(o.cluster, Cluster):
            return o.cluster
        figures = (backend_figures(o.cost) if isinstance(o.cost, str)
                   else figures_for_devices(self.devices))
        return make_cluster(o.cluster, figures)

    def _spmd_on_mesh(self) -> StepEntry:
        o, graph = self.o, self.graph
        given = o.mesh if o.mesh is not None else (
            AbstractMesh(o.mesh_shape) if o.mesh_shape is not None else None)
        hosts = len({d.process_index for d in self.devices}) if self.multi else None
        mesh, cost, options, why = plan_on_mesh(graph, o.request, given, len(self.devices),
                                                self._cost_for, self.progress, hosts)

        def make_plan(opts: PlanOptions) -> Plan:
            return spmd_plan(graph, mesh, cost, opts, why, self.progress)

        if o.executor is not ExecutorKind.LOCAL:
            if o.memory_budget is not None:
                raise OptionsError("memory_budget: checked on the compiled SPMD program, "
                                   "which the local executor runs; found executor "
                                   f"{o.executor}")
            plan = make_plan(options)
            return self._entry(plan, self._staged(plan))
        if o.memory_budget is None:
            plan = make_plan(options)
            return self._entry(plan, self._direct(plan))
        fit = fit_compiled_memory(lambda opts: make_plan(opts).spmd,
                                  lambda sp: (sp, self._direct(Plan.from_spmd(
                                      sp, graph.total_flops))),
                                  lambda got: got[1].memory, options, o.memory_budget,
                                  self.progress, argument_lower_bound(graph, mesh))
        spmd_plan_, run = fit.compiled
        run.budget, run.pressure = fit.budget, fit.pressure
        plan = Plan.from_spmd(spmd_plan_, graph.total_flops)
        return self._entry(dataclasses.replace(plan, decision=why) if why else plan, run)

    # -------------------------------------------------------------- runs
    def _direct(self, plan: Plan) -> DirectRun:
        self.progress("compiling the SPMD program")
        st = plan.stages[0]
        devices = self._stage_devices(plan, st.devices)
        lowered = lower_spmd(self.traced, self.graph, plan.spmd, devices, self.abstract,
                             self.o.donate)
        compiled = compile_spmd(lowered, self.graph, self.abstract)
        return DirectRun(lowered, compiled, spmd.compiled_memory(compiled),
                         multi_process=self.multi)

    def _stage_devices(self, plan: Plan, ids: Sequence[int]) -> list:
        need = max(ids) + 1
        if len(self.devices) < need:
            raise RhinoError(f"plan for {plan.cluster} ({plan.cluster.num_devices} devices): "
                             f"expected {need} local devices, found {len(self.devices)}; on "
                             f"CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                             f"{need} before importing jax")
        return [self.devices[d] for d in ids]

    def _refuse_staged(self, what: str) -> None:
        raise DistributedError(
            f"auto_parallel in a multi-controller job ({jax.process_count()} processes): "
            f"expected executor='local' (each process runs its own stages, or its shards "
            f"of one SPMD program), found {what}")

    def _staged(self, plan: Plan) -> StagedRun:
        o = self.o
        if self.multi and (plan.num_stages == 1 or o.executor is not ExecutorKind.LOCAL):
            self._refuse_staged(f"executor='{o.executor}'")
        self.progress("splitting the step into stage programs")
        lowering, specs = split_stages(self.step, plan, o.batch_args,
                                       o.per_microbatch_statistics)
        if o.executor is ExecutorKind.RAY:
            from rhino.runtime.executors.artifacts import export_stages
            from rhino.runtime.ray.executor import RayExecutor, actor_platform

            platform = actor_platform(o.ray_actor_options)
            self.progress(f"exporting the stage programs for the actors ({platform})")
            specs_out = export_stages(specs, lowering.split, platform, with_code=True)
            self.progress(f"starting {plan.num_stages} stage(s) on Ray actors, which compile "
                          f"their stage programs with one step on zeros")

            def start() -> RayExecutor:
                return RayExecutor(specs_out, plan.cluster, timeout=o.timeout,
                                   address=o.ray_address, actor_options=o.ray_actor_options,
                                   host_ids=[st.hosts for st in plan.stages],
                                   transport=o.transport.value, pin_cpus=o.ray_pin_cpus)

            def restart() -> RayExecutor:    # after an actor died (StagedRun)
                self.progress.always(f"starting {plan.num_stages} stage(s) on new Ray "
                                     f"actors (an actor of the last ones died)")
                return start()

            executor = start()
        elif self.multi:   # this process's stages; JAX's transfers to the others
            from rhino.runtime.executors.multicontroller import ProcessStages

            executor = ProcessStages(specs, lowering.split,
                                     [self._stage_devices(plan, st.devices)
                                      for st in plan.stages], o.timeout)
        else:
            workers = [spec.build(self._stage_devices(plan, st.devices), lowering.split)
                       for spec, st in zip(specs, plan.stages)]
            transport = None
            if o.transport is not TransportKind.DEVICE_PUT:
                from rhino.runtime.transfer.cross_mesh import CrossMeshTransport

                transport = CrossMeshTransport(lambda dst, ref: workers[dst].sharding(ref),
                                               len(workers), plan.cluster.devices_per_host,
                                               strategy=o.transport.value)
            executor = LocalExecutor(workers, o.timeout, transport)
        run = StagedRun(lowering, specs, executor, plan.schedule,
                        out_avals=self.traced.closed.out_avals,
                        restart=restart if o.executor is ExecutorKind.RAY else None)
        try:
            run.warm_up(self.progress.always)
        except BaseException:
            run.close()
            raise
        return run
