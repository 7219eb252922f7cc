"""``rhino.plan``: the planning front door — a program in, one ``Plan`` out.

A function is planned through ``rhino.front_door``, the path ``auto_parallel`` plans
through too, so the plan returned is the plan that runs. Pass order::

    source (fn + example args | .hlo | .mlir | HloGraph)
        │ trace (fn) + ingest          front_door.trace_step, hlo_passes.ingest
        ▼
    HloGraph ── mesh given ──► planner.plan_graph(graph, mesh, cost) ──► SpmdPlan ──►
            │                    Plan (one stage)
            └─ cluster given ─► pipeline.plan_pipeline_graph: SPMD, pipeline and hybrid
                                candidates weighed ──► Plan (one or more stages)

The cost model is simulated CPU unless told otherwise (``cost=``, or ``backend=`` for
built-in figures, ``rhino.backends``); ``alpha=``, ``beta=`` and ``flops_per_s=`` override
its figures (``plan_cost``).

Also here, for ``auto_parallel``: user annotations as planner pins (``annotation_pins``,
from ``rhino.planner.pins``) and the compiled-memory fit (``fit_compiled_memory``).

Example:
    >>> import jax.numpy as jnp, rhino
    >>> p = rhino.plan(lambda x, w: x @ w, jnp.ones((64, 32)), jnp.ones((32, 16)),
    ...                mesh_shape=(2,))
    >>> p.kind.value, p.spmd.search.opt_level, p.spmd.mesh.shape, p.spmd.cost.backend
    ('spmd', 'O2', (2,), 'cpu')
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Mapping, Sequence

from rhino.backends import backend_figures
from rhino.cluster import Cluster
from rhino.errors import InfeasiblePlanError, OptionsError, RhinoError, format_bytes
from rhino.hlo_passes import HloGraph, analyze, ingest
from rhino.planner.pins import annotation_pins  # noqa: F401  (re-exported)
from rhino.hlo_passes.graph import dtype_bytes, flatten_shape
from rhino.front_door import (PlanRequest, TracedStep, plan_on_cluster,
                              plan_on_mesh, runnable_cost, spmd_plan, trace_step)
from rhino.front_door import choose_mesh, mesh_shapes_to_weigh  # noqa: F401  (re-exported)
from rhino.pipeline.api import make_cluster
from rhino.nnx_objects import NnxObjects
from rhino.progress import Progress
from rhino.parallel_plan import Plan
from rhino.planner.api import PlanOptions
from rhino.planner.build import BuildOptions
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh, from_jax_mesh


def plan(source: Any, *example_args: Any, mesh_shape: Sequence[int] | None = None,
         mesh: Any = None, cost: CostModel | None = None,
         backend: str | None = None, opt_level: str = "O2",
         memory_budget: int | None = None, alpha: Sequence[float] | float | None = None,
         beta: Sequence[float] | float | None = None, flops_per_s: float | None = None,
         time_limit: float = 600.0,
         build: BuildOptions | None = None, progress: Callable[[str], None] | None = None,
         cluster: str | Cluster | None = None, num_microbatches: int | None = None,
         epsilon: float = 0.1, max_stages: int | None = None,
         stages: int | Mapping[str, int] | None = None, schedule: str | None = None,
         virtual_stages: int = 1,
         batch_args: Sequence[str] | None = None,
         annotations: Mapping[str, Any] | None = None,
         min_split_flops: float | None = None, microbatches: int | None = None,
         per_microbatch_statistics: bool = False) -> Plan:
    """Plan how to run ``source`` over a device mesh with SPMD sharding, or — given a
    ``cluster`` — over hosts × devices, weighing SPMD, pipeline and hybrid plans.

    For a JAX function this is the plan ``rhino.auto_parallel(source, ...)`` runs for the
    same arguments and options (``rhino.front_door``): ``rhino.plan(step, *args, **kw)
    .to_json()`` equals ``auto_parallel(step, **kw).plan_for(*args).to_json()`` (search
    times aside: ``to_json(search_times=False)``), except that ``memory_budget`` here
    constrains the planner's estimate where ``auto_parallel`` checks the compiled program.

    Args:
        source: a JAX function (with ``example_args``), a path to a ``.hlo``/``.mlir``
            file, or an ingested ``HloGraph``.
        *example_args: example arguments (arrays, Python numbers, ShapeDtypeStructs or
            pytrees of them).
        mesh_shape: the mesh, e.g. ``(8,)`` or ``(2, 4)``; default: all local devices in one
            axis (for a count that is not a power of two, also its 2-D factorizations, the
            fastest by estimate, as ``auto_parallel`` does). Ignored when ``mesh`` is given.
        mesh: an explicit ``AbstractMesh`` (axis names and sizes), or a JAX mesh
            (``jax.make_mesh``, ``jax.sharding.AbstractMesh``) whose axis names it keeps.
        cost: the ``CostModel`` to plan with (e.g. from
            ``rhino.calibrate.calibrate_cost_model``), for the mesh's axes.
        backend: built-in figures to plan with instead (``rhino.backends``: ``cpu``,
            ``h100``, ``h200``, ``a100``, ``tpu-v4``, ``tpu-v5e``, ``tpu-v5p``); default:
            ``cost``'s, else simulated CPU. With ``cluster``, the cluster's devices.
        opt_level: ``"O2"`` or ``"O3"``.
        memory_budget: bytes per device (the planner's estimate; with a cluster each
            stage's estimated peak); raises ``InfeasiblePlanError`` if nothing fits.
        alpha, beta: per-axis latency (s) and inverse bandwidth (s/byte) overriding the cost
            model's (one number: every axis).
        flops_per_s: FLOP/s of one device overriding the cost model's (every dtype).
        time_limit: seconds per solve.
        build: options of the problem builder, replacing the ones ``auto_parallel`` can
            run (a plan made with others may not run).
        progress: called with a line of text at each phase (default: the ``rhino``
            logger at INFO once planning has taken 2 s; ``rhino.progress``).
        cluster: ``"HOSTSxDEVICES"`` (e.g. ``"2x8"``) or a ``rhino.Cluster``: the
            controller chooses SPMD, a pipeline or a hybrid (the report's first line says
            which and why).
        num_microbatches: microbatches per pipeline step (default 4, as ``auto_parallel``);
            ``microbatches`` is the same.
        epsilon, max_stages: stage imbalance tolerance and the most stages (cluster).
        stages: the number of pipeline stages, or ``{weight path prefix: stage}``.
        schedule: ``"auto"`` (default: the fastest of the others whose activations fit,
            by the plan's estimates), ``"1f1b"``, ``"gpipe"``, ``"eager-1f1b"`` or
            ``"zb-h1"`` (each backward cut into input and weight gradients, the latter run
            in bubbles), or ``"interleaved-1f1b"`` (with ``virtual_stages``).
        virtual_stages: stages of the model per device group (``interleaved-1f1b``, which
            it implies; ``stages`` then counts the device groups).
        batch_args: what carries the batch (default: the non-state, non-scalar arguments).
        annotations: ``{pytree path or named_scope name: spec}`` (``"S[x]·R"`` or a
            ``jax.sharding.PartitionSpec``) pinned in the plan.
        min_split_flops: ops of at least this many FLOPs may not run replicated.
        per_microbatch_statistics: a pipeline may let each microbatch use its own
            statistics of the batch, as ``auto_parallel``'s option (cluster).

    Returns:
        The ``Plan`` (``.report()``, ``.to_json()``): one stage for a mesh; with
        ``cluster`` the controller's choice, which may be SPMD-only (one stage) too.

    Raises:
        OptionsError: both a mesh and a cluster, both a cost model and a backend, a cost
            model for another number of axes, or malformed figures or options.
    """
    if mesh is not None and not isinstance(mesh, AbstractMesh):   # a JAX mesh
        try:
            mesh, _ = from_jax_mesh(mesh)
        except TypeError as e:
            raise OptionsError(str(e)) from None
    if microbatches is not None:
        if num_microbatches not in (None, microbatches):
            raise OptionsError(f"plan: num_microbatches={num_microbatches} and microbatches="
                               f"{microbatches} name the same option; pass one")
        num_microbatches = microbatches
    request = PlanRequest(opt_level=opt_level, time_limit=time_limit,
                           min_split_flops=min_split_flops, memory_budget=memory_budget,
                           annotations=annotations, num_microbatches=num_microbatches,
                           schedule=schedule, stages=stages, virtual_stages=virtual_stages,
                           batch_args=batch_args,
                           epsilon=epsilon, max_stages=max_stages, build=build, parallel=True,
                           per_microbatch_statistics=per_microbatch_statistics)
    name = getattr(source, "__name__", None) or (
        os.path.basename(str(source)) if isinstance(source, (str, os.PathLike)) else "step")
    shown = Progress(f"plan({name})", PROGRESS_AFTER_S) if progress is None else None
    say = progress or shown
    try:
        if cluster is not None:
            if mesh is not None or mesh_shape is not None or cost is not None:
                raise OptionsError("plan: expected a mesh (mesh_shape=/mesh=, cost=) or a "
                                   "cluster, found both; a cluster's stage meshes are "
                                   "searched with its own figures (backend=, or a "
                                   "rhino.Cluster)")
            if alpha is not None or beta is not None:
                raise OptionsError("plan: alpha=/beta= are per mesh axis; a cluster takes "
                                   "alpha_intra=, beta_inter=, ... (rhino.plan_pipeline)")
            c = make_cluster(cluster, backend, flops_per_s=flops_per_s)
            t0 = time.perf_counter()
            step = _source_graph(source, example_args, say)
            p = plan_on_cluster(step, request, c, say, ingest_s=time.perf_counter() - t0)
            if shown is not None:
                shown.always(p.choice_line())
            return p
        if mesh is None and mesh_shape is not None:
            mesh = logical_mesh(mesh_shape)
        if cost is not None and mesh is not None:
            cost.check(mesh)
        t0 = time.perf_counter()
        step = _source_graph(source, example_args, say)
        graph = step.graph if isinstance(step, TracedStep) else step
        t1 = time.perf_counter()
        analyze(graph)  # fail early on analyses; the builder recomputes what it needs
        t2 = time.perf_counter()
        n = len(_devices()) if mesh is None else mesh.num_devices
        chosen, mcost, options, why = plan_on_mesh(
            graph, request, mesh, n, lambda m: runnable_cost(plan_cost(
                m, cost, backend, alpha=alpha, beta=beta, flops_per_s=flops_per_s)), say)
        options = dataclasses.replace(options, memory_budget=request.memory_budget)
        return spmd_plan(graph, chosen, mcost, options, why, say, (t1 - t0, t2 - t1))
    finally:
        if shown is not None:
            shown.close()


PROGRESS_AFTER_S = 2.0
"""``rhino.plan`` and ``auto_parallel`` say what they are doing once they have taken this
long (``rhino.progress``); quicker work says nothing."""


def _devices() -> list:
    import jax

    return jax.devices()


def _source_graph(source: Any, example_args: tuple, progress: Callable[[str], None]
                  ) -> TracedStep | HloGraph:
    """A function traced as ``auto_parallel`` traces it; a file or graph ingested."""
    if isinstance(source, HloGraph):
        if example_args:
            raise OptionsError("plan: example arguments are only for functions; found an "
                               "HloGraph and arguments")
        return source
    if callable(source) and not isinstance(source, (str, os.PathLike)):
        objects = NnxObjects.of(example_args)
        if objects is not None:      # Flax NNX objects, as auto_parallel runs them
            source, example_args = objects.pure(source), objects.args
        return trace_step(source, example_args, progress)
    return ingest(source, *example_args)


def logical_mesh(mesh_shape: Sequence[int] | None) -> AbstractMesh:
    """The ``AbstractMesh`` of a shape (default: every local device in one axis).

    Raises:
        OptionsError: a shape the mesh does not accept.
    """
    if mesh_shape is None:
        import jax
        mesh_shape = (len(jax.devices()),)
    try:
        return AbstractMesh(tuple(int(s) for s in mesh_shape))
    except (TypeError, ValueError) as e:
        raise OptionsError(f"mesh: {e}") from None


def plan_cost(mesh: AbstractMesh, cost: CostModel | None = None, backend: str | None = None,
              **overrides: Any) -> CostModel:
    """The cost model to plan ``mesh`` with: ``cost``, else ``backend``'s built-in figures
    for the mesh (default simulated CPU), with the ``overrides`` that are not None
    (``alpha``, ``beta``: one number or one per axis; ``flops_per_s``: every dtype; any
    other ``CostModel`` field).

    Example:
        >>> plan_cost(AbstractMesh((2, 4)), backend="h100", flops_per_s=1e12).flops_for("bf16")
        1000000000000.0

    Raises:
        OptionsError: both ``cost`` and ``backend``, a cost model for another number of
            axes, or a figure the model rejects.
    """
    if cost is not None and backend is not None:
        raise OptionsError(f"plan: expected a cost model (cost=) or built-in figures "
                           f"(backend=), found both: {cost.backend!r} and {backend!r}")
    if cost is None:
        cost = backend_figures(backend or "cpu").cost_model(mesh)
    cost.check(mesh)
    fields = {k: v for k, v in overrides.items() if v is not None}
    flops = fields.pop("flops_per_s", None)
    for k in ("alpha", "beta"):
        if isinstance(fields.get(k), (int, float)):
            fields[k] = (fields[k],) * mesh.ndim
    try:
        if flops is not None:
            cost = cost.with_flops(flops)
        cost = dataclasses.replace(cost, **fields) if fields else cost
    except TypeError as e:
        raise OptionsError(f"plan: {e}") from None
    cost.check(mesh)
    return cost


# Memory pressure steps of ``memory_budget`` (see ``fit_compiled_memory``): each step μ
# plans with a Lagrangian weight μ on activation bytes and max(1e-3, 30 μ) on parameter
# and optimizer-state bytes, both in units of the mesh's cheapest β (seconds per byte).
MEMORY_PRESSURE = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0)


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    """The outcome of ``fit_compiled_memory``: the compiled result that fits, its memory
    (``runtime.executors.spmd.compiled_memory``), the budget and the pressure that met it."""

    compiled: Any
    memory: dict
    budget: int
    pressure: float


def argument_lower_bound(graph: HloGraph, mesh: AbstractMesh) -> int:
    """Per-device bytes of the compiled program's arguments under *any* plan: each entry
    parameter the program reads, split over every device of the mesh (a shard holds at
    least one element). ``memory_analysis()``'s peak (arguments + outputs + temporaries −
    donated, and donated ≤ outputs) is never below it, whatever the memory pressure.

    Example:
        >>> import jax.numpy as jnp, rhino
        >>> g = rhino.ingest(lambda w, x: x @ w, jnp.ones((64, 32)), jnp.ones((8, 64)))
        >>> argument_lower_bound(g, logical_mesh((4,)))      # (64·32 + 8·64) · 4 B / 4
        2560
    """
    n = mesh.num_devices
    users = graph.users
    outputs = set(graph.outputs)
    total = 0
    for p in graph.params:
        if not users[p] and p not in outputs:
            continue  # jax drops an unused argument from the compiled program
        for t in flatten_shape(graph.ops[p].shape):
            item = dtype_bytes(t.dtype)
            total += max(item, math.ceil(t.nbytes / n))
    return total


def fit_compiled_memory(plan_fn: Callable[[PlanOptions], Any],
                        compile_fn: Callable[[Any], Any],
                        memory_fn: Callable[[Any], dict | None], options: PlanOptions,
                        budget: int, progress: Callable[[str], None],
                        lower_bound: int = 0) -> MemoryFit:
    """The first plan, in order of rising memory pressure, whose *compiled* program fits.

    The planner's liveness estimate follows the program order, not XLA's schedule and
    buffer assignment, so it can be 10-20% off the compiled peak either way. A budget is
    therefore checked on ``memory_analysis()`` of the compiled program (argument + output
    + temp − alias bytes per device): plan, compile, measure; if it does not fit, plan again
    with more weight on memory (``MEMORY_PRESSURE``). Less pressure keeps more of the
    time-optimal plan, so the first fit is taken. A plan equal to an earlier one is not
    compiled again. Nothing fits: ``InfeasiblePlanError`` with every attempt's peak.

    A budget below ``lower_bound`` (bytes no plan can go below, e.g.
    ``argument_lower_bound``: more pressure cannot move it) is infeasible at once, before
    any plan is compiled.

    Args:
        plan_fn: options -> an SPMD plan; compile_fn: plan -> compiled result;
        memory_fn: compiled result -> its memory (None: the backend gives none).
        lower_bound: per-device bytes every plan needs.

    Raises:
        InfeasiblePlanError: below the lower bound, or no pressure gave a plan that fits.
    """
    if lower_bound > budget:
        raise InfeasiblePlanError(lower_bound, budget, "a lower bound, checked before "
                                  "planning: the program's arguments alone, each split over "
                                  "every device, and no memory pressure can shrink them")
    tried: list[str] = []
    seen: dict[tuple, tuple[float, int]] = {}
    for mu in MEMORY_PRESSURE:
        opts = dataclasses.replace(options, activation_tiebreak=mu,
                                   memory_tiebreak=max(options.memory_tiebreak, 30 * mu))
        spmd = plan_fn(opts)
        key = (tuple(p.spec for p in spmd.params),
               tuple((op.out_spec, op.in_specs) for op in spmd.ops))
        if key in seen:
            tried.append(f"μ={mu:g}: the plan of μ={seen[key][0]:g}")
            continue
        compiled = compile_fn(spmd)
        mem = memory_fn(compiled)
        if mem is None:
            raise RhinoError("auto_parallel: memory_budget is checked on the compiled "
                             "program's memory_analysis(), which this backend does not give; "
                             "use rhino.plan(..., memory_budget=...) (the planner's "
                             "estimate) instead")
        peak = mem["peak"]
        seen[key] = (mu, peak)
        tried.append(f"μ={mu:g}: {format_bytes(peak)}")
        progress(f"memory: pressure μ={mu:g} -> compiled peak {format_bytes(peak)} "
                 f"(budget {format_bytes(budget)})")
        if peak <= budget:
            return MemoryFit(compiled, mem, budget, mu)
    raise InfeasiblePlanError(min(p for _, p in seen.values()), budget,
                              "compiled peak per device at each memory pressure: " +
                              ", ".join(tried))
