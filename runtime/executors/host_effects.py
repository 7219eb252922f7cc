"""Effects programs on a stage: the host effects of an apply task (``TaskSpec.effects``:
debug prints and callbacks, ``io_callback`` whose result is dropped) run after the task, on
the first device of the stage's mesh, once per step (``hlo_passes.stage_effects``)::

    apply task A ─► its outputs ─► sent / kept as usual
                └─► its effect inputs (totals, concatenations) ─► first device ─►
                    effects program (callbacks in program order) ─► token

``jax.jit`` runs a callback of a program on many devices once, on one device, and an ordered
one only in a one-device program: the effects program is that program. On a mesh spanning
processes the inputs are replicated first (every process of the stage) and only the process
holding the first device runs it. The step ends when the token is ready (the callbacks have
returned), as a jitted step ends after its callbacks; a callback's error is the step's.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from rhino.hlo_passes import stage_effects
from rhino.runtime.scheduling.task_timing import ready_at
from rhino.runtime.failures import ExecutorError


class EffectsRunner:
    """The effects programs of one stage (jitted from ``split`` on first use).

    Args:
        split: the step split (with its equations: an artifact's stripped split has none);
        stage: the stage; mesh: its mesh.
    """

    def __init__(self, split: Any, stage: int, mesh: Any):
        from jax.sharding import NamedSharding, PartitionSpec

        self.split, self.stage = split, stage
        self.first = mesh.devices.flat[0]
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._programs: dict[str, Any] = {}

    def program(self, kind: str) -> Any:
        """The effects program of apply task ``kind``."""
        fn = self._programs.get(kind)
        if fn is None:
            if not self.split.flat.eqns:
                raise ExecutorError(f"stage {self.stage}: task {kind} has host effects, and "
                                    f"its effects program needs the step's code (an "
                                    f"artifact saved without it cannot run them)",
                                    stage=self.stage)
            from jax.sharding import SingleDeviceSharding

            fn = jax.jit(stage_effects.effects_function(self.split, self.split.task(
                kind, self.stage)), out_shardings=SingleDeviceSharding(self.first))
            self._programs[kind] = fn
        return fn

    def run(self, kind: str, handed: Sequence[Any]) -> Any:
        """Task ``kind``'s effects program on ``handed`` (its effect inputs, as the task
        returned them). Returns its token (None where another process runs it)."""
        first = self.first
        if self._replicated.is_fully_addressable:
            handed = jax.device_put(list(handed), first)
        else:
            handed = jax.jit(lambda xs: xs, out_shardings=self._replicated)(list(handed))
            if first.process_index != jax.process_index():
                return None
            handed = [next(s.data for s in x.addressable_shards if s.device == first)
                      for x in handed]
        return self.program(kind)(handed)

    @staticmethod
    def wait(tokens: Sequence[tuple[Any, Any]], timeout: float, error: Any) -> None:
        """Wait for the tokens ``(instruction, token)`` of the effects programs run; a
        failed one raises ``error(instruction, message)``."""
        for ins, token in tokens:
            if token is None:
                continue
            try:
                ready_at(token, timeout=timeout)
            except Exception as e:
                raise error(ins, f"its host effects: {type(e).__name__}: {e}") from e
