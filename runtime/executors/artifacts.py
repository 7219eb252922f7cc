"""Stage programs as artifacts: every program of a stage (``F``, ``B``, ``B+acc``, the apply
phases, the prologue) exported once where the step is planned, shipped as bytes, compiled
where it runs. A process that runs a stage from its ``StageArtifact`` never imports,
unpickles or traces the user's code (but for a stage binding host callbacks, which
``jax.export`` cannot serialize: ``StageArtifact.rebuild``): the artifact is plain data
(``pickle`` of rhino's own dataclasses and ``jax.export`` serializations), so a model class
defined in the training script's ``__main__`` or a closure over it costs nothing on the
actors.

Pass order::

    driver:  StepSplit (traced, split) ─► signatures (jax.eval_shape, task by task, in
             dependency order) ─► jax.export of each program on an AbstractMesh of the
             stage's shape (its sharding constraints inside) ─► StageArtifact (bytes)
    worker:  StageArtifact ─► StageWorker(programs = jax.jit(deserialized.call)) on its
             devices: the caller's jit places the arguments as they come (their shardings),
             the exported body keeps every constraint of the plan

Nothing of the user's step survives in the artifact: ``split.flat`` keeps its abstract
values only (``strip``), the microbatch layout loses its bind parameters. A plan and its
artifacts can be saved (``save``) and run later by any process with rhino and the same JAX
(``load``; ``StageArtifact.build`` checks both).

Example:
    >>> arts = export_stages(specs, split, platform="cpu")        # doctest: +SKIP
    >>> save("run/", arts); arts = load("run/")                   # doctest: +SKIP
    >>> worker = arts[0].build(jax.devices()[:4])                 # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any, Mapping, Sequence

import numpy as np

from rhino.errors import RhinoError
from rhino.hlo_passes import stage_effects
from rhino.hlo_passes.stage_programs import (StageShardings, StepSplit, constraints,
                                             is_apply, prologue_function, task_function)

ARTIFACT_FORMAT = 1
"""Bumped when ``StageArtifact``'s fields change meaning; ``load`` refuses other formats."""

_FILE = "stages.rhino"


class ArtifactError(RhinoError):
    """A stage program that cannot be exported, or an artifact this process cannot run."""


@dataclasses.dataclass(frozen=True)
class StageArtifact:
    """One stage, ready to run without the user's code.

    Attributes:
        stage: the stage; mesh_shape, axis_names: its mesh; shardings: its shardings.
        split: the step split with every equation dropped (``strip``): which task reads
            and writes what, the abstract values, the microbatch shapes.
        schedule, num_stages, num_microbatches: as ``make_schedule`` takes them;
            virtual_stages: stages per device group (``interleaved-1f1b``: ``num_stages``
            counts the model's stages, ``num_stages / virtual_stages`` groups), as in
            ``WorkerSpec``.
        programs: ``(kind, with_acc) -> jax.export serialization``; the prologue is
            ``("P", False)``.
        platform: what the programs were lowered for (``cpu``, ``cuda``, ``rocm``, ``tpu``).
        jax_version: the JAX that exported them (serializations are read by the same).
        measure: time every task.
        rebuild: the stage's ``WorkerSpec`` pickled with its step (cloudpickle), where
            programs bind host callbacks, which ``jax.export`` cannot serialize: the
            process running the stage re-traces the step and jits those (``build``);
            ``programs`` hold their quiet variants (``stage_effects``) for the warm-up.
        callbacks: those callbacks (``debug_callback at train.py:12``), for messages.
    """

    stage: int
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    shardings: StageShardings
    split: StepSplit
    schedule: str
    num_stages: int
    num_microbatches: int
    programs: Mapping[tuple[str, bool], bytes]
    platform: str
    jax_version: str
    measure: bool = True
    format: int = ARTIFACT_FORMAT
    rebuild: bytes | None = None
    callbacks: tuple[str, ...] = ()
    virtual_stages: int = 1

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.programs.values())

    def check(self) -> None:
        """Refuse an artifact this process cannot run (another JAX, another platform)."""
        import jax

        if self.format != ARTIFACT_FORMAT:
            raise ArtifactError(f"stage {self.stage}: artifact format {self.format}, this "
                                f"rhino reads format {ARTIFACT_FORMAT}")
        if self.jax_version != jax.__version__:
            raise ArtifactError(f"stage {self.stage}: programs exported by jax "
                                f"{self.jax_version}, this process has jax {jax.__version__}; "
                                f"export and run with the same JAX")
        here = this_platform()
        if here != self.platform:
            raise ArtifactError(f"stage {self.stage}: programs lowered for "
                                f"'{self.platform}', this process runs on '{here}'")

    def programs_on(self) -> dict[tuple[str, bool], Any]:
        """The stage's programs, deserialized and jitted (the accumulators donated)."""
        import jax
        from jax import export

        self.check()
        out = {}
        for (kind, with_acc), blob in self.programs.items():
            exp = export.deserialize(bytearray(blob))
            out[(kind, with_acc)] = jax.jit(exp.call, donate_argnums=(1,) if with_acc
                                            else ())
        return out

    def build(self, devices: Sequence[Any]) -> Any:
        """The ``StageWorker`` on ``devices`` (as many as the mesh has), its programs
        compiled from the artifact (those binding host callbacks jitted from the step
        re-traced here: ``rebuild``)."""
        from rhino.runtime.executors.worker_spec import build_worker

        programs = self.programs_on()
        if self.rebuild is None:
            return build_worker(self, self.split, devices, programs=programs)
        from rhino.hlo_passes.stage_effects import same_tasks

        try:
            split = _cloudpickle().loads(self.rebuild).split()
        except Exception as e:
            raise ArtifactError(f"stage {self.stage}: its programs binding host callbacks "
                                f"({', '.join(self.callbacks)}) are built here from the "
                                f"step's code, which failed: {type(e).__name__}: {e}") from e
        differs = same_tasks(self.split, split, self.stage)
        if differs is not None:
            raise ArtifactError(f"stage {self.stage}: the step traced here splits "
                                f"differently from the driver's ({differs} reads or writes "
                                f"other values): its host callbacks "
                                f"({', '.join(self.callbacks)}) cannot run here")
        return build_worker(self, split, devices, programs=programs, complete=False)


def this_platform() -> str:
    """This process's JAX backend as ``jax.export`` names platforms (``gpu`` is ``cuda``)."""
    import jax

    backend = jax.default_backend()
    return {"gpu": "cuda"}.get(backend, backend)


def strip(split: StepSplit) -> StepSplit:
    """``split`` without the user's program: no equations, constants or inlined calls (they
    hold the user's functions), the microbatch layout without bind parameters or the
    per-microbatch bodies of control flow (jaxprs, read only while the programs are traced).
    What a ``StageWorker`` reads of a split is left: tasks, outputs, refs, abstract values,
    shapes."""
    import jax

    flat = split.flat
    avals = {r: jax.ShapeDtypeStruct(tuple(a.shape), a.dtype,
                                     weak_type=bool(getattr(a, "weak_type", False)))
             for r, a in flat.avals.items()}
    bare = dataclasses.replace(flat, eqns=(), consts={}, outs=(), avals=avals, remats={},
                               calls={})
    layout = dataclasses.replace(split.layout, params={}, bodies={})
    return dataclasses.replace(split, flat=bare, layout=layout)


def _aval(a: Any, shape: Sequence[int] | None = None) -> Any:
    import jax

    return jax.ShapeDtypeStruct(tuple(a.shape if shape is None else shape), a.dtype,
                                weak_type=bool(getattr(a, "weak_type", False)))


def signatures(split: StepSplit) -> dict[tuple[str, int, bool], tuple]:
    """The abstract arguments of every stage program: ``(kind, stage, with_acc) ->
    (inputs, accs, mb)`` as ``StageWorker._run`` passes them (``("P", stage, False) ->
    (args,)`` for a prologue), found with ``jax.eval_shape`` task by task in dependency
    order, so a value's abstract type is what its producer returns."""
    import jax

    avals = split.flat.avals
    mb0 = np.int32(0)
    out: dict[tuple[str, int, bool], tuple] = {}
    whole: dict[int, dict[int, Any]] = {}            # stage -> ref -> whole value
    for s in range(split.num_stages):
        whole[s] = {r: _aval(avals[r]) for r in split.whole_batch_args(s)}
        pro = split.prologues[s]
        if pro.outputs:
            args = [whole[s].get(r, _aval(avals[r])) for r in pro.inputs]
            res = jax.eval_shape(prologue_function(split, s), args)
            whole[s].update(zip(pro.outputs, res))
            out[("P", s, False)] = (args,)
    made: dict[tuple[str, int], dict[int, Any]] = {}     # task -> ref -> its output
    accs: dict[tuple[str, int], dict[int, Any]] = {}     # task -> ref -> its accumulator
    todo = [key for key, t in split.tasks.items() if not t.empty]
    while todo:
        ready = [k for k in todo if all(i.producer in made for i in split.tasks[k].inputs
                                        if i.source in ("task", "acc"))]
        if not ready:
            raise ArtifactError(f"stage programs {sorted(todo)}: their inputs come from "
                                f"each other (no task can be traced first)")
        for kind, s in ready:
            task = split.tasks[(kind, s)]
            inputs = []
            for i in task.inputs:
                if i.source == "arg":
                    inputs.append(_aval(avals[i.ref]))
                elif i.source == "batch":
                    inputs.append(_aval(avals[i.ref], split.microbatch_shape(i.ref)))
                elif i.source == "pre":
                    inputs.append(whole[s][i.ref])
                elif i.source == "acc":
                    inputs.append(accs[i.producer][i.ref])
                else:
                    inputs.append(made[i.producer][i.ref])
            fn = task_function(split, task, False)
            outs, new = jax.eval_shape(fn, inputs, [], mb0)
            made[(kind, s)] = dict(zip(task.outputs, outs))
            accs[(kind, s)] = dict(zip(task.accumulate, new))
            out[(kind, s, False)] = (inputs, [], mb0)
            if not is_apply(kind) and split.num_microbatches > 1:
                out[(kind, s, True)] = (inputs, list(new), mb0)
            todo.remove((kind, s))
    return out


def _abstract_mesh(shape: Sequence[int], names: Sequence[str]) -> Any:
    from jax.sharding import AbstractMesh, AxisType

    return AbstractMesh(tuple(shape), tuple(names), axis_types=(AxisType.Auto,) * len(shape))


def export_stage(split: StepSplit, stage: int, mesh_shape: Sequence[int],
                 axis_names: Sequence[str], shardings: StageShardings, schedule: str,
                 platform: str, measure: bool = True,
                 sigs: Mapping[tuple[str, int, bool], tuple] | None = None,
                 spec: Any = None, virtual_stages: int = 1) -> StageArtifact:
    """``stage``'s programs exported for ``platform`` on an abstract mesh of its shape.
    Programs binding host callbacks are exported as their quiet variants, with ``spec``
    (the stage's ``WorkerSpec``) pickled for the process running the stage to jit them
    (``StageArtifact.rebuild``); without ``spec`` such a stage is refused, naming them.
    ``virtual_stages``: stages per device group (``WorkerSpec.virtual_stages``)."""
    import jax
    from jax import export

    sigs = signatures(split) if sigs is None else sigs
    mesh = _abstract_mesh(mesh_shape, axis_names)
    constrain, finish = constraints(mesh, shardings)
    loud = stage_effects.quiet_kinds(split, stage)
    callbacks = stage_effects.stage_callbacks(split, stage)
    rebuild = None
    if callbacks:
        if spec is None or not hasattr(spec, "fn"):
            raise ArtifactError(
                f"stage {stage}: its programs bind host callbacks ({', '.join(callbacks)}), "
                f"which jax.export cannot serialize, and saved stage programs do not hold "
                f"the step's code to rebuild them: remove them from the step to save it")
        rebuild = _cloudpickle().dumps(spec)

    programs: dict[tuple[str, bool], bytes] = {}
    for (kind, s, with_acc), args in sigs.items():
        if s != stage:
            continue
        quiet = kind in loud
        if kind == "P":
            fn = jax.jit(prologue_function(split, stage, constrain, quiet))
        else:
            fn = jax.jit(task_function(split, split.task(kind, stage), with_acc, constrain,
                                       finish, quiet), donate_argnums=(1,) if with_acc else ())
        label = kind + ("+acc" if with_acc else "")
        kind = stage_effects.QUIET + kind if quiet else kind
        try:
            exp = export.export(fn, platforms=[platform],
                                disabled_checks=_custom_calls_allowed())(*args)
            programs[(kind, with_acc)] = bytes(exp.serialize())
        except Exception as e:
            raise ArtifactError(f"stage {stage}, program {label}: cannot be exported for "
                                f"{platform}: {type(e).__name__}: {e}") from e
    return StageArtifact(stage, tuple(mesh_shape), tuple(axis_names), shardings,
                         strip(split), schedule, split.num_stages, split.num_microbatches,
                         programs, platform, jax.__version__, measure, rebuild=rebuild,
                         callbacks=callbacks, virtual_stages=int(virtual_stages))


def _cloudpickle() -> Any:
    """cloudpickle (Ray's own where it is not installed on its own): pickles a step defined
    in a script or a closure by value."""
    try:
        import cloudpickle
    except ImportError:
        try:
            from ray import cloudpickle
        except ImportError as e:
            raise ArtifactError("stage programs binding host callbacks are saved with the "
                                "step's code, pickled by cloudpickle: pip install "
                                "cloudpickle, or 'rhino[ray]' (Ray brings it)") from e
    return cloudpickle


def _custom_calls_allowed() -> list:
    """Every custom call target may appear: the artifact is run by the JAX that exported it
    (``StageArtifact.check``), so the cross-version stability ``jax.export`` guards by
    default does not apply."""
    from jax import export

    return [export.DisabledSafetyCheck.custom_call("ALL")]   # jax.export's wildcard


def export_stages(specs: Sequence[Any], split: StepSplit, platform: str,
                  with_code: bool = False) -> list[StageArtifact]:
    """One artifact per ``WorkerSpec`` of ``specs`` (all of one step split); ``with_code``:
    a stage whose programs bind host callbacks carries its ``WorkerSpec`` to rebuild them
    (``export_stage``; Ray actors), else it is refused (saved programs)."""
    sigs = signatures(split)
    return [export_stage(split, sp.stage, sp.mesh_shape, sp.axis_names, sp.shardings,
                         sp.schedule, platform, sp.measure, sigs,
                         sp if with_code else None, getattr(sp, "virtual_stages", 1))
            for sp in specs]


def save(directory: str, artifacts: Sequence[StageArtifact]) -> str:
    """Write ``artifacts`` to ``directory`` (created); returns the file's path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, _FILE)
    with open(path + ".tmp", "wb") as f:
        pickle.dump({"format": ARTIFACT_FORMAT, "stages": list(artifacts)}, f)
    os.replace(path + ".tmp", path)
    return path


def load(directory: str) -> list[StageArtifact]:
    """The artifacts ``save`` wrote to ``directory``."""
    path = os.path.join(directory, _FILE)
    if not os.path.exists(path):
        raise ArtifactError(f"{directory}: expected saved stage programs ({_FILE}), found "
                            f"none")
    with open(path, "rb") as f:
        got = pickle.load(f)
    if not isinstance(got, dict) or got.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"{path}: expected rhino stage artifacts of format "
                            f"{ARTIFACT_FORMAT}, found "
                            f"{got.get('format') if isinstance(got, dict) else type(got)}")
    return list(got["stages"])


class SavedPipeline:
    """Saved stage artifacts run in this process by the local executor, without the step's
    code: called with the step's arguments (any pytree with the step's leaves, in order),
    it returns the step's results as a flat list (``jax.tree_util.tree_leaves`` order).

    Args:
        stages: the artifacts, or the directory ``save`` wrote them to.
        devices: per stage, the devices of its mesh (default: this process's devices, stage
            after stage, as many as each mesh has). Stages may share devices.
        timeout: seconds any wait may take.
    """

    def __init__(self, stages: Sequence[StageArtifact] | str,
                 devices: Sequence[Sequence[Any]] | None = None, timeout: float | None = None):
        import jax

        from rhino.runtime.executors.local import DEFAULT_TIMEOUT_S, LocalExecutor
        from rhino.runtime.executors.runs import Handover

        self.stages = load(stages) if isinstance(stages, str) else list(stages)
        sizes = [int(np.prod(a.mesh_shape)) for a in self.stages]
        if devices is None:
            local = jax.local_devices()
            if sum(sizes) > len(local):
                raise ArtifactError(f"{len(self.stages)} stages of {sizes} devices: expected "
                                    f"{sum(sizes)} devices in this process, found "
                                    f"{len(local)} (give devices= per stage to share them)")
            first = np.cumsum([0] + sizes)
            devices = [local[first[s]:first[s + 1]] for s in range(len(sizes))]
        if len(devices) != len(self.stages):
            raise ArtifactError(f"devices: expected one list per stage ({len(self.stages)}), "
                                f"found {len(devices)}")
        self.workers = [a.build(list(d)) for a, d in zip(self.stages, devices)]
        self.executor = LocalExecutor(self.workers, timeout or DEFAULT_TIMEOUT_S)
        self.handover = Handover()

    def __call__(self, *args: Any) -> list:
        import jax

        from rhino.runtime.executors.runs import step_results

        flat = self.handover.back(jax.tree_util.tree_leaves(args))
        return self.handover.give(step_results(self.stages[0].split, flat,
                                               self.executor.run(flat)))

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> "SavedPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def export_init(init_fn: Any, init_args: tuple, refs: Sequence[int], art: StageArtifact
                ) -> bytes:
    """The initializer of ``art``'s stage as an artifact: ``init_fn(*init_args)``'s leaves
    ``refs`` (those the stage reads), each made with the stage's sharding for it (on an
    abstract mesh of the stage's shape), exported for its platform. ``run_init`` runs it
    where the stage is, so the actors never receive ``init_fn`` itself."""
    import jax
    from jax import export
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _abstract_mesh(art.mesh_shape, art.axis_names)
    refs = list(refs)
    outs = [NamedSharding(mesh, art.shardings.refs.get(k) or PartitionSpec()) for k in refs]

    def mine(*a):
        leaves = jax.tree_util.tree_leaves(init_fn(*a))
        return [leaves[k] for k in refs]

    try:
        exp = export.export(jax.jit(mine, out_shardings=outs), platforms=[art.platform],
                            disabled_checks=_custom_calls_allowed())(*init_args)
    except Exception as e:
        raise ArtifactError(f"stage {art.stage}, its initializer: cannot be exported for "
                            f"{art.platform}: {type(e).__name__}: {e}") from e
    return bytes(exp.serialize())


def run_init(blob: bytes, init_args: tuple, shardings: Sequence[Any]) -> list:
    """Run an ``export_init`` artifact: its leaves, each with its sharding."""
    import jax
    from jax import export

    exp = export.deserialize(bytearray(blob))
    return list(jax.jit(exp.call, out_shardings=list(shardings))(*init_args))
