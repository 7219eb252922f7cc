"""``rhino.auto_parallel``: run a one-device training step sharded over the local devices.

First call per input signature: trace the step to a jaxpr, lower it through the
equation-scoped interpreter (``hlo_passes.annotate``), ingest that HLO, plan (or reuse a
given plan), constrain every planned value with ``with_sharding_constraint``, compile with
XLA's SPMD partitioner, and check the compiled argument and result shardings against the plan
before anything runs. Later calls with the same signature only run. Outputs keep the plan's
shardings, so feeding them back as the next step's inputs moves nothing; training state that
is updated and returned (parameters, optimizer state) is donated and updated in place.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> @rhino.auto_parallel(mesh_shape=(2,))
    ... def step(w, x):
    ...     return w - 0.1 * (x.T @ (x @ w)), jnp.sum(x @ w)
    >>> w, loss = step(jnp.ones((4, 4)), jnp.ones((8, 4)))   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax

from rhino.errors import RhinoError
from rhino.hlo_passes import HloGraph, ingest
from rhino.hlo_passes.graph import shape_str
from rhino.hlo_passes.annotate import EqnMap, ScopedFunction
from rhino.planner.api import PlanOptions, plan_graph
from rhino.planner.build import BuildOptions, carried_pairs
from rhino.planner.collectives import reshard
from rhino.planner.mesh import AbstractMesh
from rhino.planner.plan import ExecutionPlan
from rhino.planner.spec import ShardingSpec
from rhino.runtime import spmd
from rhino.runtime.strided import StridedRealizer

REPORT_ENV = "RHINO_REPORT"


def report_wanted(flag: bool | None) -> bool:
    """Print the plan report? ``flag`` if given, else whether ``$RHINO_REPORT`` is set
    (to anything but ``0``)."""
    return flag if flag is not None else os.environ.get(REPORT_ENV, "") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class AutoParallelOptions:
    """Options of ``auto_parallel`` (see its docstring)."""

    devices: tuple | None = None
    mesh_shape: tuple[int, ...] | None = None
    mesh: AbstractMesh | None = None
    opt_level: str = "O2"
    memory_budget: int | None = None
    annotations: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    plan: ExecutionPlan | None = None
    report: bool | None = None
    donate: bool = True
    time_limit: float = 600.0
    progress_after_s: float = 2.0


class _Progress:
    """Prints phase lines to stderr once a search has run longer than ``after`` seconds."""

    def __init__(self, title: str, after: float):
        self.title, self.t0, self.phase, self.shown = title, time.perf_counter(), "", False
        self._lock = threading.Lock()
        self._timer = threading.Timer(after, self._show)
        self._timer.daemon = True
        self._timer.start()

    def _show(self) -> None:
        with self._lock:
            self.shown = True
            self._print()

    def _print(self) -> None:
        print(f"rhino: {self.title}: {self.phase} [{time.perf_counter() - self.t0:.1f} s]",
              file=sys.stderr, flush=True)

    def __call__(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            if self.shown:
                self._print()

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            if self.shown:
                self.phase = "done"
                self._print()


def _pins(graph: HloGraph, annotations: Mapping[str, Any], mesh: AbstractMesh
          ) -> dict[int, ShardingSpec]:
    """Annotations (pytree path or named-scope name -> spec) as op ids -> specs."""
    pins: dict[int, ShardingSpec] = {}
    by_path = {graph.ops[p].arg.path: p for p in graph.params if graph.ops[p].arg}
    users = graph.users
    for key, value in annotations.items():
        spec = value if isinstance(value, ShardingSpec) else ShardingSpec.parse(str(value), mesh)
        if key in by_path:
            pins[by_path[key]] = spec
            continue
        scoped = [op.id for op in graph.ops if f"/{key}/" in f"/{op.op_name}/"]
        members = set(scoped)
        exported = [i for i in scoped if i in graph.outputs
                    or any(u not in members for u in users[i])]
        if not exported:
            raise RhinoError(f"annotation {key!r}: expected a parameter pytree path (e.g. "
                             f"{next(iter(by_path), 'params[...]')!r}) or a jax.named_scope "
                             f"name used in the step; found neither")
        for i in exported:
            pins[i] = spec
    return pins


@dataclasses.dataclass
class _Entry:
    """A compiled signature."""

    plan: ExecutionPlan
    graph: HloGraph
    compiled: Any
    in_shardings: list
    out_tree: Any
    constrained: int
    hlo_text: str | None = None
    annotated: Any = None               # the step with the plan's constraints (jit-able)
    memory: dict | None = None          # compiled memory_analysis (spmd.compiled_memory)
    memory_budget: int | None = None
    pressure: float | None = None       # the memory pressure that met the budget

    def report(self) -> str:
        """The plan report, with the compiled program's memory per device."""
        from rhino.errors import format_bytes as b

        text = self.plan.report()
        m = self.memory
        if m is None:
            return text
        line = (f"  compiled memory   peak {b(m['peak'])} per device (arguments {b(m['argument'])}"
                f", outputs {b(m['output'])}, temporaries {b(m['temp'])}, donated "
                f"{b(m['alias'])})")
        if self.memory_budget is not None:
            line += (f"; budget {b(self.memory_budget)}, met at memory pressure "
                     f"μ={self.pressure:g}")
        return text + "\n" + line


class AutoParallel:
    """A step function wrapped by ``auto_parallel``; call it like the original."""

    def __init__(self, fn: Callable, options: AutoParallelOptions):
        self.fn = fn
        self.options = options
        self._cache: dict[Any, _Entry] = {}
        self._last: _Entry | None = None
        functools.update_wrapper(self, fn)

    # ----------------------------------------------------------------- public helpers
    def plan_for(self, *args: Any) -> ExecutionPlan:
        """The plan used for these arguments (planning and compiling if needed)."""
        return self._entry(args).plan

    def report_for(self, *args: Any) -> str:
        """The plan report for these arguments, with the compiled program's memory."""
        return self._entry(args).report()

    def memory_for(self, *args: Any) -> dict | None:
        """The compiled program's memory per device for these arguments (bytes:
        ``argument``, ``output``, ``temp``, ``alias``, ``peak``), from XLA's
        ``memory_analysis()``; None where the backend gives none."""
        return self._entry(args).memory

    def compiled_text(self, *args: Any) -> str:
        """The compiled, partitioned HLO for these arguments."""
        e = self._entry(args)
        if e.hlo_text is None:
            e.hlo_text = e.compiled.as_text()
        return e.hlo_text

    def __call__(self, *args: Any) -> Any:
        # Fastest path: the last signature's executable called as it is. It checks the
        # arguments itself before running (nothing is donated when it refuses): another
        # pytree or shape raises TypeError, a committed array laid out otherwise
        # ValueError; host and uncommitted arrays it places with the planned shardings.
        last = self._last
        if last is not None:
            try:
                return last.compiled(*args)
            except (TypeError, ValueError):
                pass
        flat, tree = jax.tree_util.tree_flatten(args)
        entry = self._entry(args, flat, tree)
        self._last = entry
        # Hot path: an input whose sharding object is the planned one, or one already
        # found equivalent for this signature (e.g. last step's output, fed back), is
        # passed as it is; anything else (host arrays, other shardings) is moved.
        accepted = entry.__dict__.setdefault("accepted_shardings", [None] * len(flat))
        moved = None
        for i, (x, s) in enumerate(zip(flat, entry.in_shardings)):
            sh = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
            if sh is not None and (sh is s or sh is accepted[i]):
                continue
            if sh is not None and sh.is_equivalent_to(s, x.ndim):
                accepted[i] = sh
                continue
            if moved is None:
                moved = list(flat)
            moved[i] = jax.device_put(x, s)
        if moved is not None:
            args = jax.tree_util.tree_unflatten(tree, moved)
        return entry.compiled(*args)

    # ----------------------------------------------------------------- compile
    def _mesh(self) -> tuple[AbstractMesh, list]:
        o = self.options
        devices = list(o.devices) if o.devices is not None else jax.devices()
        # Strided values run split (runtime.strided); XLA moves them into and out of a
        # strided layout by gathering, so the planner charges that.
        if o.mesh is not None:
            return dataclasses.replace(o.mesh, strided_moves_all_to_all=False), devices
        shape = o.mesh_shape or (len(devices),)
        return AbstractMesh.simulated_cpu(tuple(int(s) for s in shape),
                                          strided_moves_all_to_all=False), devices

    def _entry(self, args: tuple, flat: list | None = None, tree: Any = None) -> _Entry:
        """The compiled entry of ``args``' signature (``flat, tree``: their flattening)."""
        if flat is None:
            flat, tree = jax.tree_util.tree_flatten(args)
        # Signature: tree + (shape, dtype) per leaf; jax arrays carry canonical dtypes,
        # other leaves (numpy arrays, Python scalars) are canonicalised as jax would.
        key = (tree, tuple((x.shape, x.dtype) if isinstance(x, jax.Array) else
                           (jax.numpy.shape(x), jax.numpy.result_type(x)) for x in flat))
        entry = self._cache.get(key)
        if entry is None:
            abstract = jax.tree_util.tree_unflatten(
                tree, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in key[1]])
            entry = self._compile(abstract)
            self._cache[key] = entry
        return entry

    def _compile(self, abstract: tuple) -> _Entry:
        o = self.options
        name = getattr(self.fn, "__name__", "step")
        progress = _Progress(f"auto_parallel({name})", o.progress_after_s)
        try:
            progress("tracing")
            traced = ScopedFunction(self.fn, *abstract)
            progress("ingesting")
            graph = ingest(traced, *abstract)
            mesh, devices = self._mesh()

            def compile_plan(plan: ExecutionPlan) -> _Entry:
                progress("compiling")
                return _compile_plan(self.fn, traced, graph, plan, devices, abstract, o.donate)

            if o.plan is not None:
                _check_plan_matches(o.plan, graph)
                entry = compile_plan(o.plan)  # runs on the plan's own mesh
            else:
                pins = _pins(graph, o.annotations, mesh)
                options = PlanOptions(opt_level=o.opt_level, time_limit=o.time_limit,
                                      build=BuildOptions(strided_interior_only=True,
                                                         pinned=pins,
                                                         partial_passthrough=False))

                def make_plan(opts: PlanOptions) -> ExecutionPlan:
                    return plan_graph(graph, mesh, opts, progress)

                if o.memory_budget is None:
                    entry = compile_plan(make_plan(options))
                else:
                    entry = _fit_compiled_memory(make_plan, compile_plan, options,
                                                 o.memory_budget, progress)
            if entry.memory is None:
                entry.memory = spmd.compiled_memory(entry.compiled)
        finally:
            progress.close()
        if report_wanted(o.report):
            print(entry.report(), file=sys.stderr)
        return entry


# Memory pressure steps of ``memory_budget`` (see ``_fit_compiled_memory``): each step μ
# plans with a Lagrangian weight μ on activation bytes and max(1e-3, 30 μ) on parameter
# and optimizer-state bytes, both in units of the mesh's cheapest β (seconds per byte).
MEMORY_PRESSURE = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0)


def _fit_compiled_memory(plan_fn: Callable[[PlanOptions], ExecutionPlan],
                         compile_fn: Callable[[ExecutionPlan], "_Entry"],
                         options: PlanOptions, budget: int,
                         progress: Callable[[str], None]) -> "_Entry":
    """The first plan, in order of rising memory pressure, whose *compiled* program fits.

    The planner's liveness estimate follows the program order, not XLA's schedule and
    buffer assignment, so it can be 10-20% off the compiled peak either way. A budget is
    therefore checked on ``memory_analysis()`` of the compiled program (argument + output
    + temp − alias bytes per device): plan, compile, measure; if it does not fit, plan again
    with more weight on memory (``MEMORY_PRESSURE``). Less pressure keeps more of the
    time-optimal plan, so the first fit is taken. A plan equal to an earlier one is not
    compiled again. Nothing fits: ``InfeasiblePlanError`` with every attempt's peak.
    """
    from rhino.errors import InfeasiblePlanError, format_bytes

    tried: list[str] = []
    seen: dict[tuple, tuple[float, int]] = {}
    for mu in MEMORY_PRESSURE:
        opts = dataclasses.replace(options, activation_tiebreak=mu,
                                   memory_tiebreak=max(options.memory_tiebreak, 30 * mu))
        plan = plan_fn(opts)
        key = (tuple(p.spec for p in plan.params),
               tuple((op.out_spec, op.in_specs) for op in plan.ops))
        if key in seen:
            tried.append(f"μ={mu:g}: the plan of μ={seen[key][0]:g}")
            continue
        entry = compile_fn(plan)
        mem = spmd.compiled_memory(entry.compiled)
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
            entry.memory, entry.memory_budget, entry.pressure = mem, budget, mu
            return entry
    raise InfeasiblePlanError(min(p for _, p in seen.values()), budget,
                              "compiled peak per device at each memory pressure: " +
                              ", ".join(tried))


def _check_plan_matches(plan: ExecutionPlan, graph: HloGraph) -> None:
    """A saved plan must be for this program: the same ops and the same parameter types."""
    same_ops = len(plan.ops) == len(graph.ops) and all(
        p.name == op.name and p.opcode == op.opcode for p, op in zip(plan.ops, graph.ops))
    shapes = [shape_str(graph.ops[i].shape) for i in graph.params]
    same_params = [p.shape for p in plan.params] == shapes
    if not (same_ops and same_params):
        what = "ops" if not same_ops else "parameter shapes"
        raise RhinoError(f"plan: made for {plan.program} with {len(plan.ops)} ops and parameters "
                         f"{[p.shape for p in plan.params[:3]]}..., this program has "
                         f"{len(graph.ops)} ops and {shapes[:3]}... (different {what}); "
                         f"re-plan for this function and these argument shapes")


def _named(spec: ShardingSpec | None, jmesh, names: Sequence[str]):
    from jax.sharding import NamedSharding, PartitionSpec

    if spec is None:
        return NamedSharding(jmesh, PartitionSpec())
    return NamedSharding(jmesh, spmd.partition_spec(spec.without_partial(), names))


def _compile_plan(fn: Callable, traced: ScopedFunction, graph: HloGraph, plan: ExecutionPlan,
                  devices: list, abstract: tuple, donate: bool) -> _Entry:
    names = plan.mesh.axis_names
    jmesh = spmd.device_mesh(plan.mesh.shape, names, devices)
    emap = EqnMap(traced, graph)
    # A pending sum (partial spec) has no sharding of its own: the plan (made without
    # partial pass-through) resolves it at its consumers. Constrain it to its reduced form
    # (the partitioner then reduces right there, keeping the other splits as planned), or
    # to its consumers' spec when that is only a local slice of the reduced form (a
    # reduce-scatter, where the platform has one).
    need_of: dict[int, set] = {}
    for op, o in zip(graph.ops, plan.ops):
        for q, u in enumerate(op.operands):
            need_of.setdefault(u, set()).add(o.in_specs[q])
    constraints = {}
    for key, op_id in emap.producer.items():
        spec = plan.ops[op_id].out_spec
        if spec is None:
            continue  # tuples stay as they are
        if spec.is_partial:
            needs = need_of.get(op_id, set())
            one = next(iter(needs)) if len(needs) == 1 else None
            reduced = spec.without_partial()
            sliced = one is not None and not one.is_partial and reshard(
                reduced, one, graph.ops[op_id].shape, plan.mesh).is_free
            spec = one if sliced else reduced
        constraints[key] = spec

    # Operands resharded for their consumer: constrain the operand as the consumer's
    # strategy needs it, so the partitioner has no other way to run the consumer. The
    # consumer is whichever op of the equation reads the input: the equation's main op,
    # or an op it lowers to before it (a transpose, reshape or convert feeding a dot).
    from rhino.hlo_passes.annotate import eqn_path

    members: dict[tuple[int, ...], list[int]] = {}
    for op in graph.ops:
        if op.opcode != "parameter":
            members.setdefault(eqn_path(op.op_name), []).append(op.id)
    in_constraints = {}
    for path, ids in emap.inputs.items():
        main = emap.producer.get((path, 0))
        if main is None:
            continue
        inside = members.get(path, [main])
        for j, h in enumerate(ids):
            if h is None:
                continue
            needs = {plan.ops[m].in_specs[q] for m in inside
                     for q, x in enumerate(graph.ops[m].operands) if x == h}
            if len(needs) != 1 and h in graph.ops[main].operands:
                needs = {plan.ops[main].in_specs[graph.ops[main].operands.index(h)]}
            if len(needs) != 1:
                continue  # read in several layouts inside the equation: leave it to XLA
            need = next(iter(needs))
            if need is None or need.is_partial or need == plan.ops[h].out_spec:
                continue
            in_constraints[(path, j)] = need

    # Blocked specs are sharding constraints; strided ones keep the value split so that a
    # tiled sharding expresses them (runtime/strided.py).
    hooks = StridedRealizer(jmesh, names).hooks(constraints, in_constraints)

    in_flat = [_named(plan.params[i].spec, jmesh, names) for i in range(len(graph.params))]
    carried = {o: p for o, p in carried_pairs(graph)}
    out_flat = []
    for o in graph.outputs:
        src = carried.get(o, o)
        out_flat.append(_named(plan.ops[src].out_spec, jmesh, names))
    in_tree = jax.tree_util.tree_structure(abstract)
    in_shardings = jax.tree_util.tree_unflatten(in_tree, in_flat)
    out_shardings = jax.tree_util.tree_unflatten(traced.out_tree, out_flat)
    donate_argnums = ()
    if donate:
        carried_params = set(carried.values())
        pos = 0
        picked = []
        for k, arg in enumerate(abstract):
            n = len(jax.tree_util.tree_leaves(arg))
            ids = graph.params[pos:pos + n]
            if n and all(i in carried_params for i in ids):
                picked.append(k)
            pos += n
        donate_argnums = tuple(picked)
    annotated = traced.with_hook(*hooks)
    jitted = jax.jit(annotated, in_shardings=in_shardings,
                     out_shardings=out_shardings, donate_argnums=donate_argnums)
    compiled = jitted.lower(*abstract).compile()
    got_in = jax.tree_util.tree_leaves(compiled.input_shardings[0])
    got_out = jax.tree_util.tree_leaves(compiled.output_shardings)
    ndim_in = [len(l.shape) for l in jax.tree_util.tree_leaves(abstract)]
    paths_in = [graph.ops[p].arg.path for p in graph.params]
    spmd.check_shardings("argument", got_in, in_flat, ndim_in, paths_in)
    ndim_out = [len(graph.ops[o].shape.dims) if hasattr(graph.ops[o].shape, "dims") else 0
                for o in graph.outputs]
    spmd.check_shardings("result", got_out, out_flat, ndim_out,
                         [i.path for i in graph.output_info])
    return _Entry(plan, graph, compiled, in_flat, traced.out_tree, len(constraints),
                  annotated=annotated)


def auto_parallel(fn: Callable | None = None, *, devices: Sequence | None = None,
                  mesh_shape: Sequence[int] | None = None, mesh: AbstractMesh | None = None,
                  opt_level: str = "O2", memory_budget: int | None = None,
                  annotations: Mapping[str, Any] | None = None,
                  plan: ExecutionPlan | None = None, report: bool | None = None,
                  donate: bool = True, time_limit: float = 600.0,
                  cluster: Any = None, num_microbatches: int = 4, schedule: str = "1f1b",
                  executor: str = "local", stages: int | Mapping[str, int] | None = None,
                  pipeline_plan: Any = None, accumulate: str = "mean",
                  batch_args: Sequence[str] | None = None, timeout: float = 600.0,
                  transport: str = "device_put", ray_address: str | None = None):
    """Shard a one-device training step over the local devices, automatically.

    Usable bare (``@rhino.auto_parallel``) or with options.

    Args:
        fn: the step function (pure; pytrees of arrays in and out).
        devices: the devices to use (default: all local devices).
        mesh_shape: the device mesh, e.g. ``(8,)`` or ``(2, 4)`` (default: one axis over
            all devices).
        mesh: an explicit ``AbstractMesh`` (e.g. calibrated); overrides ``mesh_shape``.
        opt_level: ``"O2"`` (fast) or ``"O3"`` (whole-graph ILP).
        memory_budget: bytes per device the *compiled* program may use (XLA's
            ``memory_analysis()``: arguments + outputs + temporaries − donated). Plans are
            made with rising weight on memory until one fits (``MEMORY_PRESSURE``);
            ``InfeasiblePlanError`` if none does.
        annotations: semi-automatic control: ``{pytree path or named_scope name: spec}``,
            e.g. ``{"params['wte']": "S[x]·R"}``; the planner plans around them.
        plan: a saved ``ExecutionPlan`` to reuse instead of planning.
        report: print the plan report on the first call (default: env ``RHINO_REPORT``).
        donate: donate the training state that the step updates and returns.
        time_limit: seconds per solve.
        cluster: run as a pipeline over ``"HOSTSxDEVICES"`` (or a ``Cluster``): the pipeline
            planner picks stages and stage meshes, the step is cut into per-stage programs
            and run with a static schedule (see ``rhino.pipelined``). The options below
            apply only with a cluster.
        num_microbatches: microbatches per step.
        schedule: ``"1f1b"`` (default), ``"gpipe"`` or ``"eager-1f1b"``.
        executor: ``"local"`` (one process, disjoint sets of local devices) or ``"ray"``
            (one actor per stage; see ``rhino.init``).
        stages: the number of pipeline stages (default: the planner's choice), or a
            hand-given split ``{weight pytree path prefix: stage}``.
        pipeline_plan: a saved ``PipelinePlan`` to run instead of planning (a hand-edited
            stage assignment goes here).
        accumulate: ``"mean"`` (default) or ``"sum"``: how batch-dependent values (loss,
            gradients) combine over microbatches.
        batch_args: names of the arguments carrying the batch (default: non-state ones).
        timeout: seconds any wait of the pipeline executor may take.
        transport: between stage meshes of the local executor: ``"device_put"`` or 004's
            cross-mesh resharding, ``"broadcast"`` / ``"send_recv"``.
        ray_address: the Ray cluster for ``executor="ray"`` (default: ``rhino.init``'s,
            ``$RAY_ADDRESS``, or a new local one).

    Returns:
        An ``AutoParallel`` callable (``.plan_for(*args)``, ``.compiled_text(*args)``), or
        with ``cluster`` a ``PipelinedStep`` (``.plan_for``, ``.timeline(path)``).
    """
    if cluster is not None:
        from rhino.pipelined import PipelinedStep, PipelineRunOptions

        if plan is not None or annotations or memory_budget is not None or mesh is not None \
                or mesh_shape is not None:
            raise RhinoError("auto_parallel: plan, annotations, memory_budget, mesh and "
                             "mesh_shape are SPMD-only options; with cluster=... pass "
                             "pipeline_plan/stages instead")
        run = PipelineRunOptions(cluster=cluster, num_microbatches=num_microbatches,
                                 schedule=schedule, executor=executor,
                                 stages=dict(stages) if isinstance(stages, Mapping) else stages,
                                 plan=pipeline_plan, accumulate=accumulate,
                                 batch_args=tuple(batch_args) if batch_args else None,
                                 timeout=timeout, transport=transport,
                                 ray_address=ray_address,
                                 devices=tuple(devices) if devices is not None else None,
                                 report=report)
        if fn is None:
            return lambda f: PipelinedStep(f, run, opt_level=opt_level)
        return PipelinedStep(fn, run, opt_level=opt_level)
    options = AutoParallelOptions(
        devices=tuple(devices) if devices is not None else None,
        mesh_shape=tuple(mesh_shape) if mesh_shape is not None else None, mesh=mesh,
        opt_level=opt_level, memory_budget=memory_budget, annotations=dict(annotations or {}),
        plan=plan, report=report, donate=donate, time_limit=time_limit)
    if fn is None:
        return lambda f: AutoParallel(f, options)
    return AutoParallel(fn, options)
