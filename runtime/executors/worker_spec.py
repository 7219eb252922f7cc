"""What a process needs to build one stage's ``StageWorker`` (``WorkerSpec``: the step, its
abstract arguments, the assignment of equations to stages, the stage's mesh and shardings).

The split is a pure function of the traced step and the assignment, so every process that
has the step's code (every process of a multi-controller job; a Ray actor rebuilding the
programs that hold host callbacks, ``runtime.executors.artifacts``) makes the same stage programs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from rhino.hlo_passes.backward_split import split_backward
from rhino.hlo_passes.stage_programs import StageShardings, StepSplit, flatten, split_step
from rhino.hlo_passes.unroll import trace
from rhino.runtime.executors.stage_worker import StageWorker
from rhino.runtime.scheduling.schedules import SPLIT_BACKWARD, make_schedule
from rhino.runtime.failures import ExecutorError


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything a process needs to build one ``StageWorker`` (picklable: a Ray actor
    re-traces the step and re-splits it; the split is deterministic).

    Attributes:
        fn: the step; abstract: its arguments (whole batch).
        assignment: equation path -> (role, stage); batch_refs, key_refs, num_stages,
        num_microbatches, per_microbatch_statistics, schedule: as in ``split_step`` /
        ``make_schedule``; virtual_stages: stages per device group (``interleaved-1f1b``:
        ``num_stages`` counts the model's stages, ``num_stages / virtual_stages`` groups).
        stage: the stage; mesh_shape, axis_names: its mesh; shardings: its shardings.
        measure: time every task (blocking on its results).
    """

    fn: Callable
    abstract: tuple
    assignment: dict
    batch_refs: tuple[int, ...]
    num_stages: int
    num_microbatches: int
    schedule: str
    stage: int
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    shardings: StageShardings
    measure: bool = True
    key_refs: tuple[int, ...] = ()
    per_microbatch_statistics: bool = False
    virtual_stages: int = 1

    def split(self) -> StepSplit:
        flat = flatten(trace(self.fn, *self.abstract),
                       platform_branches=self.per_microbatch_statistics)
        split = split_step(flat, self.assignment, self.batch_refs, self.num_stages,
                           self.num_microbatches, key_refs=self.key_refs,
                           per_microbatch_statistics=self.per_microbatch_statistics)
        if self.schedule in SPLIT_BACKWARD:
            split = split_backward(split)
        return split

    def build(self, devices: Sequence[Any], split: StepSplit | None = None) -> "StageWorker":
        """The worker on ``devices`` (as many as the mesh has)."""
        return build_worker(self, split or self.split(), devices)


def build_worker(spec: Any, split: StepSplit, devices: Sequence[Any],
                 programs: Mapping[tuple[str, bool], Any] | None = None,
                 complete: bool = True) -> "StageWorker":
    """The ``StageWorker`` of ``spec`` (a ``WorkerSpec`` or a ``StageArtifact``: its stage,
    mesh, shardings, schedule) on ``devices`` (as many as the mesh has); ``programs``,
    ``complete``: as ``StageWorker`` takes them."""
    from rhino.runtime.executors.spmd import device_mesh

    need = int(np.prod(spec.mesh_shape))
    if len(devices) != need:
        raise ExecutorError(f"stage {spec.stage}: expected {need} devices for mesh "
                            f"{spec.mesh_shape}, found {len(devices)}")
    mesh = device_mesh(spec.mesh_shape, spec.axis_names, list(devices))
    v = getattr(spec, "virtual_stages", 1)
    schedule = make_schedule(spec.schedule, spec.num_stages // v, spec.num_microbatches, v)
    return StageWorker(split, spec.stage, mesh, spec.shardings, schedule, spec.measure,
                       programs=programs, complete=complete)
