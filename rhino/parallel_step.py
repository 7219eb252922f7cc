"""``rhino.auto_parallel``: one step type, ``ParallelStep``, for every parallel execution.

First call per input signature::

    step fn + arguments
      │ trace + ingest        front_door.trace_step (as rhino.plan traces it)
      ▼
    HloGraph ─► the Plan      given (plan=), or planned through rhino.front_door, the path
      │                       rhino.plan takes too (StepOptions.request): SPMD on a mesh
      │                       priced by the cost model of the devices it runs on
      │                       (rhino.backends; or cost=), with annotations and a
      │                       compiled-memory budget (rhino.planning), or over a cluster
      │                       (the controller: SPMD, pipeline or hybrid; what it chose and
      │                       why is logged before anything compiles)
      ▼
    lowering                  hlo_passes.lower: the plan written into the step
      ▼
    the run, which follows from the plan and the options:
      one stage, executor local ─► DirectRun: the compiled SPMD program, called directly
      otherwise                 ─► StagedRun: per-stage F/B/A programs under the static
                                    schedule; one thread per stage (local) or one Ray
                                    actor per stage (ray); compiled before the first step

Later calls with the same signature only run. Results keep the plan's shardings, so feeding
them back as the next step's arguments moves nothing; with ``donate=True`` (default) the
training state that is updated and returned is donated and updated in place.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> @rhino.auto_parallel(mesh_shape=(2,))
    ... def step(w, x):
    ...     return w - 0.1 * (x.T @ (x @ w)), jnp.sum(x @ w)
    >>> type(step).__name__
    'ParallelStep'
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from rhino.cluster import Cluster
from rhino.errors import RhinoError
from rhino.front_door import trace_step
from rhino.nnx_objects import NnxObjects
from rhino.parallel_plan import Plan
from rhino.planner.cost_model import CostModel
from rhino.progress import Progress, get_logger
from rhino.runtime.executors.local import DEFAULT_TIMEOUT_S
from rhino.runtime.state.host_data import has_host_data, materialize
from rhino.runtime.executors.runs import DirectRun, StagedRun
from rhino.step_arguments import leaf_types, signature, type_changes
from rhino.step_builder import StepBuilder, StepEntry
from rhino.step_call import BoundCall, CallBinder
from rhino.step_options import StepOptions, report_wanted
from rhino.vocabulary import ExecutorKind




# ------------------------------------------------------------------------------ the step
class ParallelStep:
    """A step wrapped by ``auto_parallel``; call it like the original (positional
    arguments). A context manager: leaving the ``with`` block calls ``close()``, which
    stops the executors (stage threads, Ray actors)::

        with rhino.auto_parallel(m.step, cluster="2x4", stages=2) as step:
            params, opt, loss = step(params, opt, batch)

    Attributes:
        plans_built: how many argument signatures (pytree structure; per leaf shape, dtype
            and weak type, as ``jax.jit`` keys its cache) this step has planned, lowered
            and started a run for. A call whose signature was seen before plans nothing:
            the results of a call (arrays, ``RemoteArray`` handles kept on Ray actors)
            have the signature ``jax.jit`` gives them, so passed back as the next call's
            state they take the same plan.
    """

    def __init__(self, fn: Callable, options: StepOptions):
        self.fn = fn
        self.options = options
        self._cache: dict[Any, StepEntry] = {}
        self.plans_built = 0
        self._last: StepEntry | None = None
        self._direct: Any = None      # the last signature's executable, when it is direct
        self._binder = CallBinder(fn, options.static_argnums, options.static_argnames)
        # Name, docstring and __wrapped__ only: the wrapped object's own attributes (an
        # eqx.filter_jit wrapper has `fn`) must not replace this step's.
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, call = self._bind(args, kwargs)
        # Fastest path: the last signature's executable called as it is. It checks the
        # arguments itself before running (nothing is donated when it refuses): another
        # pytree or shape raises TypeError, a committed array laid out otherwise
        # ValueError; host and uncommitted arrays it places with the planned shardings.
        direct = self._direct
        if direct is not None and call is None:
            try:
                return direct(*args)
            except (TypeError, ValueError):
                pass
        objects = NnxObjects.of(args)
        if objects is not None:      # Flax NNX objects: updated in place, as nnx.jit does
            return objects.finish(self._run(objects.args, objects, call))
        return self._run(args, None, call)

    def _bind(self, args: tuple, kwargs: dict) -> tuple[tuple, BoundCall | None]:
        """(the dynamic arguments, the bound call) of a call with keywords or static
        arguments (``rhino.step_call``); (``args``, None) for a plain positional call."""
        if not kwargs and not self._binder.needed:
            return args, None
        call = self._binder.bind(args, kwargs)
        return call.args, call

    def _run(self, args: tuple, objects: NnxObjects | None = None,
             call: BoundCall | None = None) -> Any:
        entry = self._entry(args, objects, call)
        self._last = entry
        if not getattr(getattr(entry.run, "executor", None), "takes_host_data", False):
            # host_data batches: made here, for every row, where no host makes its own.
            leaves = jax.tree_util.tree_leaves(args)
            if has_host_data(leaves):
                args = materialize(args)
        if isinstance(entry.run, DirectRun):
            # Across processes every call places host values itself (each process writes
            # only its own devices' shards), so the executable is not called bare.
            bare = not entry.run.multi_process and objects is None and call is None
            self._direct = entry.run.compiled if bare else None
            return entry.run(args)
        self._direct = None
        return jax.tree_util.tree_unflatten(entry.out_tree, entry.run(args))

    # ----------------------------------------------------------------- public helpers
    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan used for these arguments (planning and compiling if needed)."""
        return self._entry_of(args, kwargs).plan

    def report_for(self, *args: Any, **kwargs: Any) -> str:
        """The plan report for these arguments (with the compiled program's memory for an
        SPMD program run directly)."""
        return self._entry_of(args, kwargs).report()

    def memory_for(self, *args: Any, **kwargs: Any) -> dict | None:
        """The compiled SPMD program's memory per device for these arguments (bytes:
        ``argument``, ``output``, ``temp``, ``alias``, ``peak``) from XLA's
        ``memory_analysis()``; None where the backend gives none or the step runs as
        stage programs."""
        run = self._entry_of(args, kwargs).run
        return run.memory if isinstance(run, DirectRun) else None

    def stage_memory_for(self, *args: Any, **kwargs: Any) -> list[dict] | None:
        """Per stage of a pipelined step, the planner's memory estimate beside what the
        stage's compiled programs hold: ``[{"stage": i, "estimate": StageMemory,
        "compiled": dict | None}]`` (bytes per device; ``compiled`` is
        ``StageWorker.memory()``: state, accumulators, handed, in_flight, temp, peak).
        Compiled figures are read from the programs a step has run, on the local
        executor, whose stage workers are in this process (None elsewhere: call the step
        once first). None for a step run as one SPMD program."""
        entry = self._entry_of(args, kwargs)
        if entry.plan.num_stages == 1:
            return None
        workers = getattr(entry.run.executor, "workers", None) \
            if self.options.executor is ExecutorKind.LOCAL and jax.process_count() == 1 \
            else None
        return [dict(stage=st.index, estimate=st.memory,
                     compiled=workers[i].memory() if workers is not None else None)
                for i, st in enumerate(entry.plan.stages)]

    def shardings_for(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """The plan's ``NamedSharding``s of the step's arguments and of its results, as
        pytrees shaped like them (a tuple with one entry per argument, and the results'
        structure): ``jax.jit(step, in_shardings=ins, out_shardings=outs)`` lays out the
        step's inputs and outputs as the plan does, but places the values inside by
        XLA's propagation, which may choose other collectives; ``jit_for`` pins them too.
        For a step run as one SPMD program; with keywords or static arguments, the
        arguments rhino traces (the dynamic ones, in parameter order)."""
        low = self._lowering(args, kwargs, "shardings_for")
        return (jax.tree_util.tree_unflatten(low.in_tree, low.in_shardings),
                jax.tree_util.tree_unflatten(low.out_tree, low.out_shardings))

    def jit_for(self, *args: Any, **kwargs: Any) -> Any:
        """The plan as a plain ``jax.jit``: the step with the plan's sharding constraints
        written in, its ``in_shardings``/``out_shardings`` (``shardings_for``) and the
        donated state. It compiles to the program rhino runs (the same collectives) and
        runs without rhino's runtime: lower it, inspect it, call it in your own loop."""
        return self._lowering(args, kwargs, "jit_for").jit()

    def _lowering(self, args: tuple, kwargs: dict, what: str) -> Any:
        run = self._entry_of(args, kwargs).run
        if not isinstance(run, DirectRun):
            raise RhinoError(f"{what}: expected a step run as one SPMD program, found stage "
                             f"programs (plan_for(...).stages[i].spmd holds each stage's "
                             f"plan)")
        return run.lowering

    def compiled_text(self, *args: Any, **kwargs: Any) -> str:
        """The compiled, partitioned HLO of a directly run SPMD program."""
        run = self._entry_of(args, kwargs).run
        if not isinstance(run, DirectRun):
            raise RhinoError("compiled_text: expected a one-stage plan run directly, found "
                             f"{self._entry_of(args, kwargs).plan.num_stages} stage(s) run as stage "
                             f"programs")
        return run.compiled_text()

    def split_for(self, *args: Any, **kwargs: Any):
        """The stage programs' split (``StepSplit``) for these arguments."""
        run = self._entry_of(args, kwargs).run
        if not isinstance(run, StagedRun):
            raise RhinoError("split_for: expected a step run as stage programs, found a "
                             "one-stage SPMD program run directly")
        return run.lowering.split

    @property
    def last_records(self) -> list:
        """Measured task records of the last step (stage programs only)."""
        run = None if self._last is None else self._last.run
        return list(run.executor.last_records) if isinstance(run, StagedRun) else []

    @property
    def last_step_s(self) -> float:
        """Wall-clock seconds of the last step (stage programs only)."""
        run = None if self._last is None else self._last.run
        return run.executor.last_step_s if isinstance(run, StagedRun) else 0.0

    def timeline(self, path: str | None = None, title: str | None = None,
                 trace: str | None = None):
        """The last step's measured schedule as an ``ExecutedTimeline``; with ``path``,
        also drawn there as a per-stage Gantt chart (PNG; a path ending ``.json`` gets the
        trace events instead); with ``trace``, written there as Chrome / Perfetto trace
        events (JSON: open it in ui.perfetto.dev or chrome://tracing). Under virtual stages
        (``interleaved-1f1b``) a row is a device group and each task names its stage of the
        model (``F3/s2``), as the schedule's table does."""
        from rhino.runtime.scheduling.timeline import ExecutedTimeline

        run = None if self._last is None else self._last.run
        if not isinstance(run, StagedRun):
            raise RhinoError("timeline: expected a step run as stage programs to have run, "
                             "found " + ("none" if run is None else "a directly run SPMD "
                                         "program"))
        sp = run.lowering.split
        records, rows = tuple(run.executor.last_records), sp.num_stages
        v = self._last.plan.virtual_stages
        if v > 1:        # one row per device group (stage c runs on group c % p)
            rows = sp.num_stages // v
            records = tuple(dataclasses.replace(r, stage=r.stage % rows,
                                                label=f"{r.label}/s{r.stage}")
                            for r in records)
        tl = ExecutedTimeline(records, str(run.schedule), rows, sp.num_microbatches)
        if path is not None and str(path).endswith(".json"):
            tl.write_trace(path)
        elif path is not None:
            tl.draw(path, title=title)
        if trace is not None:
            tl.write_trace(trace)
        return tl

    def save_stages(self, directory: str, *args: Any, platform: str | None = None) -> str:
        """Export the stage programs planned for these arguments to ``directory``: a plan
        and its programs that ``rhino.runtime.executors.artifacts.SavedPipeline`` runs later, in a
        process that never imports the step's code (the same JAX is needed). ``platform``:
        what to lower for (default: this process's backend, e.g. ``cpu``, ``cuda``).
        Returns the file's path."""
        from rhino.runtime.executors import artifacts
        run = self._entry_of(args).run
        if not isinstance(run, StagedRun):
            raise RhinoError("save_stages: expected a step run as stage programs, found a "
                             "one-stage SPMD program run directly")
        platform = platform or artifacts.this_platform()
        arts = artifacts.export_stages(run.specs, run.lowering.split, platform)
        return artifacts.save(directory, arts)

    def distributed_init(self, init_fn: Callable, *init_args: Any, example_args: tuple):
        """Create the training state directly on its devices (Rhino §6.3).

        ``init_fn(*init_args)`` returns the step's leading arguments (e.g. ``(params,
        opt_state)`` for ``step(params, opt_state, batch)``); each leaf is computed by a
        program compiled for the devices that hold it, with the plan's sharding, so no
        device materializes another stage's weights. The values equal
        ``jax.jit(init_fn)(*init_args)`` (partitionable threefry).

        Args:
            init_fn, init_args: the initializer and its arguments (e.g. a PRNG key).
            example_args: the step's arguments (arrays or ShapeDtypeStructs) the state is
                for; plans the step if it has not been planned yet.

        Raises:
            RhinoError: ``init_fn``'s leaves do not match the step's leading argument leaves
                in shape and dtype.

        With the Ray executor the leaves are made on the actors (each stage the leaves it
        reads, on its devices) and come back as ``RemoteArray`` handles.
        """
        from rhino.runtime.state.sharded_init import distributed_init

        entry = self._entry(tuple(example_args))
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
        init_state = getattr(getattr(entry.run, "executor", None), "init_state", None)
        if init_state is not None:    # Ray: each stage's actors make the leaves it reads
            made = entry.run.typed_args(init_state(init_fn, init_args, len(leaves)))
            return jax.tree_util.tree_unflatten(tree, made)
        shardings = entry.run.shardings(len(leaves))
        return distributed_init(init_fn, *init_args,
                                shardings=jax.tree_util.tree_unflatten(tree, shardings))

    def __enter__(self) -> "ParallelStep":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the executors (threads, Ray actors); bounded: a stage stuck in a program is
        left behind on a daemon thread and holds nothing up. The step can be called again
        afterwards (it builds its executors anew)."""
        for e in self._cache.values():
            e.run.close()
        self._cache.clear()
        self._last, self._direct = None, None

    # ----------------------------------------------------------------- build
    _last_types: dict[str, str] = {}   # the last planned signature's leaves (leaf_types)

    def _entry_of(self, args: tuple, kwargs: dict | None = None) -> StepEntry:
        """The entry of the arguments as the user passes them (NNX objects or not;
        keywords and static arguments bound: ``rhino.step_call``)."""
        args, call = self._bind(args, kwargs or {})
        objects = NnxObjects.of(args)
        return self._entry(args, None, call) if objects is None else \
            self._entry(objects.args, objects, call)

    def _entry(self, args: tuple, objects: NnxObjects | None = None,
               call: BoundCall | None = None) -> StepEntry:
        fn = self.fn if call is None else call.fn
        key = signature(self.fn, args)
        if call is not None:
            key = (key, call.key)
        if objects is not None:
            key = (key, objects.static)
        entry = self._cache.get(key)
        if entry is None:
            shapes = leaf_types(args)
            if self._cache:
                name = getattr(self.fn, "__name__", "step")
                get_logger().warning(
                    f"auto_parallel({name}): arguments of new shapes or dtypes, planned and "
                    f"compiled again (a plan per signature: {len(self._cache) + 1} now): "
                    + type_changes(self._last_types, shapes))
            self._last_types = shapes
            entry = self._build(args, fn if objects is None else objects.pure(fn))
            self._cache[key] = entry
            self.plans_built += 1
        return entry

    def _build(self, args: tuple, fn: Callable) -> StepEntry:
        o = self.options
        name = getattr(self.fn, "__name__", "step")
        progress = Progress(f"auto_parallel({name})", o.progress_after_s)
        try:
            step = trace_step(fn, args, progress)
            entry = StepBuilder(step, o, progress).build()
        finally:
            progress.close()
        if report_wanted(o.report):
            print(entry.report(), file=sys.stderr)
        return entry


def auto_parallel(fn: Callable | None = None, *, devices: Sequence | None = None,
                  mesh_shape: Sequence[int] | None = None, mesh: Any = None,
                  cost: CostModel | str | None = None,
                  cluster: str | Cluster | None = None, opt_level: str = "O2",
                  memory_budget: int | None = None,
                  annotations: Mapping[str, Any] | None = None, plan: Plan | None = None,
                  report: bool | None = None, donate: bool = True, time_limit: float = 600.0,
                  num_microbatches: int | None = None, schedule: str | None = None,
                  executor: str = "local",
                  stages: int | Mapping[str, int] | None = None, virtual_stages: int = 1,
                  accumulate: Any = None,
                  batch_args: Sequence[str] | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                  transport: str | None = None, ray_address: str | None = None,
                  ray_actor_options: Mapping[str, Any] | None = None,
                  ray_pin_cpus: bool | None = None,
                  per_microbatch_statistics: bool = False,
                  min_split_flops: float | None = None,
                  static_argnums: int | Sequence[int] = (),
                  static_argnames: str | Sequence[str] = ()):
    """Run a one-device training step over many devices, automatically.

    Usable bare (``@rhino.auto_parallel``) or with options; the options are checked here,
    before anything is traced. Returns a ``ParallelStep`` whatever the options.

    Args:
        fn: the step function (pure; pytrees of arrays in and out). Flax NNX objects
            in its arguments are updated in place after each call, as ``nnx.jit`` does
            (``rhino.nnx_objects``).
        devices: the devices to use (default: all local devices).
        mesh_shape: an SPMD mesh over the devices, e.g. ``(8,)`` or ``(2, 4)`` (default:
            one axis over all devices).
        mesh: an explicit mesh, overriding ``mesh_shape``: a ``jax.sharding.Mesh``
            (``jax.make_mesh``: its axis names, and its devices in its order), a
            ``jax.sharding.AbstractMesh`` or a ``rhino.AbstractMesh`` (axis names and
            sizes).
        cost: what the mesh's collectives and compute cost: a ``CostModel`` (e.g.
            ``rhino.calibrate.calibrate_cost_model``) or the name of built-in figures
            (``"h100"``, ``"tpu-v5e"``, ... ``rhino.backends``). Default: the figures of
            the devices it runs on (platform and device kind; simulated CPU on CPU).
        cluster: plan over ``"HOSTSxDEVICES"`` (or a ``Cluster``) instead: the controller
            chooses SPMD, a pipeline or a hybrid, whichever it estimates fastest, and logs
            what it chose and why (``stages=`` fixes the stage count); a pipeline is cut
            into per-stage programs, compiled before the first step and run with a static
            schedule. Text gets the figures of ``cost``'s name or of the devices.
        opt_level: ``"O2"`` (fast) or ``"O3"`` (whole-graph ILP).
        memory_budget: bytes per device the *compiled* SPMD program may use (XLA's
            ``memory_analysis()``: arguments + outputs + temporaries − donated). Plans are
            made with rising weight on memory until one fits
            (``rhino.planning.MEMORY_PRESSURE``); ``InfeasiblePlanError`` if none does.
            With ``cluster=``: the pipeline search's estimate of each stage's peak (state,
            gradients, activations in flight) must fit (default: the cluster's device
            memory); it is not checked on compiled programs there.
        annotations: ``{pytree path or named_scope name: spec}``, e.g.
            ``{"params['wte']": "S[x]·R"}`` or ``{"params['wte']": PartitionSpec('x',
            None)}`` (a Flax NNX path with or without its ``.value``); the planner plans
            around them. With
            ``cluster=``: in the SPMD candidate's plan and in each stage's plan for the
            values that stage holds (stage meshes are 1-D, axis ``x``); a candidate whose
            mesh a spec does not fit is left out, its report line says why.
        plan: a saved ``Plan`` to run instead of planning (its stages, microbatches and
            schedule; a hand-edited stage assignment goes here).
        report: print the plan report on the first call (default: env ``RHINO_REPORT``).
        donate: donate the training state that the step updates and returns (an SPMD
            program deletes the arrays passed in after every call; stage programs keep
            them).
        time_limit: seconds per solve.
        num_microbatches: microbatches per step of a pipeline (default: a given plan's,
            else 4).
        schedule: ``"auto"`` (the planner's choice), ``"1f1b"``, ``"gpipe"``,
            ``"eager-1f1b"``, ``"zb-h1"`` or ``"interleaved-1f1b"`` (with
            ``virtual_stages``; default: a given plan's, else ``"auto"``).
        executor: ``"local"`` (this process: the SPMD program called directly, or one
            thread per stage over disjoint local devices) or ``"ray"`` (one actor per stage
            and host, per device group with ``virtual_stages``; see ``rhino.init``).
        stages: the number of pipeline stages (default: the planner's choice), or a
            hand-given split ``{weight pytree path prefix: stage}``.
        virtual_stages: stages of the model per device group (``interleaved-1f1b``, which
            it implies; ``stages`` then counts the device groups): the model is cut into
            ``stages * virtual_stages`` stages and group ``g`` runs ``g, g + stages, ...``
            in Megatron's order (local executor: a thread per group; ``rhino.launch``: a
            process per group; Ray: an actor per group and host).
        accumulate: no longer an option (an error if given): a pipelined step computes
            what the step computes on the whole batch, each value by its own rule.
        batch_args: what carries the batch: argument names, or pytree paths inside them
            (e.g. ``("batch['tokens']", "batch['labels']")``); default: non-state arguments.
            PRNG keys are never split into microbatches.
        timeout: seconds any wait of a pipeline executor may take.
        transport: how values move between stage meshes. Local executor:
            ``"device_put"`` (default) or 004's cross-mesh resharding, ``"broadcast"`` /
            ``"send_recv"``. Ray executor: ``"jax"`` (default and only one: every actor in
            one ``jax.distributed`` job, values device to device through JAX's transfer
            servers; the nodes must reach each other on any port). The Ray executor's
            former ``"object_store"`` and ``"direct"`` were removed (an error says so).
        ray_address: the Ray cluster for ``executor="ray"`` (default: ``rhino.init``'s,
            ``$RAY_ADDRESS``, or a new local one).
        ray_actor_options: ``.options(...)`` of every Ray actor (one per host of each
            stage mesh), e.g. ``{"num_gpus": 8}`` on GPU nodes (the actor then uses the GPUs
            Ray gives it instead of simulated host devices) or ``{"resources": {...}}``.
        ray_pin_cpus: actors simulating hosts on one node split its cores, one share each
            (None, default: where there are enough cores; True: required; False: never;
            ``RayExecutor``'s ``pin_cpus``).
        per_microbatch_statistics: a pipelined step whose gradients depend on a value of
            the whole batch (BatchNorm statistics, a whole-batch softmax) is refused
            (``BatchCouplingError``, naming the op and its source line) unless this
            accepts that each microbatch uses its own estimate of it (as gradient
            accumulation does); a value pairing the examples with each other (``z @
            z.T``) is then each microbatch's own pairs (its diagonal block), what is not
            computable so (positions of the whole batch, a mean over pairs) still refused
            (``rhino.jaxpr.microbatch``).
        min_split_flops: ops of at least this many FLOPs must not run whole on every
            device (their replicated choices are removed): for cost models where compute
            is nearly free next to communication, under which replicating heavy work
            looks cheapest.
        static_argnums, static_argnames: arguments that are configuration, not arrays
            (a ``training`` flag, a config object), as ``jax.jit`` takes them: hashable
            values, each distinct value planned and compiled on its own; the step's
            other arguments may be passed by keyword too.

    Returns:
        A ``ParallelStep`` (``.plan_for(*args)``, ``.report_for(*args)``, ``.timeline()``).

    Raises:
        OptionsError: an option out of range, or options that exclude each other.
    """
    options = StepOptions(
        devices=devices, mesh_shape=tuple(mesh_shape) if mesh_shape is not None else None,
        mesh=mesh, cost=cost, cluster=cluster, opt_level=opt_level,
        memory_budget=memory_budget,
        annotations=annotations or {}, plan=plan, report=report, donate=donate,
        time_limit=time_limit, num_microbatches=num_microbatches, schedule=schedule,
        executor=executor, stages=stages, virtual_stages=virtual_stages,
        accumulate=accumulate, batch_args=batch_args,
        timeout=timeout, transport=transport, ray_address=ray_address,
        ray_actor_options=ray_actor_options, ray_pin_cpus=ray_pin_cpus,
        per_microbatch_statistics=per_microbatch_statistics, min_split_flops=min_split_flops,
        static_argnums=(static_argnums,) if isinstance(static_argnums, int)
        else tuple(static_argnums),
        static_argnames=(static_argnames,) if isinstance(static_argnames, str)
        else tuple(static_argnames))
    if fn is None:
        return lambda f: ParallelStep(f, options)
    return ParallelStep(fn, options)
