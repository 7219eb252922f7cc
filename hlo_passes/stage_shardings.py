"""The shardings of a stage's programs as plain data (``StageShardings``, made by
``lower.lower_stages`` from the stage's SPMD plan), and the constraints they put on the
programs ``stage_programs.task_function`` builds (``constraints``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax


@dataclasses.dataclass(frozen=True)
class StageShardings:
    """The shardings a stage uses, as PartitionSpecs on its mesh (plain data).

    Attributes:
        values: ``(equation path, result index) -> PartitionSpec`` constraints inside the
            stage's programs.
        refs: ``ref -> PartitionSpec`` for values the stage receives or is given
            (arguments, microbatch slices, values from other stages). Unlisted: replicated.
        results: ``ref -> PartitionSpec`` a step result leaves its program in where that
            differs from how it was computed: the sharding of the argument it updates
            (carried), so that the next step reads it as it is. (The SPMD path's
            ``out_shardings`` do the same; without, each step resharded such results
            outside the programs: ~5 ms of a 2-stage GPT's step on the CPU.)
    """

    values: Mapping[tuple[tuple[int, ...], int], Any] = dataclasses.field(default_factory=dict)
    refs: Mapping[int, Any] = dataclasses.field(default_factory=dict)
    results: Mapping[int, Any] = dataclasses.field(default_factory=dict)


def constraints(mesh: Any, shardings: StageShardings) -> tuple[Callable, Callable]:
    """``(constrain, finish)`` for ``task_function`` on ``mesh`` (a ``Mesh`` or an
    ``AbstractMesh``): the plan's constraints on the stage's values, and those of the
    results it hands on (``StageShardings.results``)."""
    from jax.sharding import NamedSharding

    def named(specs: Mapping) -> dict:
        return {k: NamedSharding(mesh, p) for k, p in specs.items() if p is not None}

    inside = named(shardings.values)
    leaving = named(getattr(shardings, "results", {}))   # shardings pickled before: none

    def constrain(path: tuple[int, ...], k: int, x: Any) -> Any:
        s = inside.get((path, k))
        return x if s is None else jax.lax.with_sharding_constraint(x, s)

    def finish(ref: int, x: Any) -> Any:
        s = leaving.get(ref)
        return x if s is None else jax.lax.with_sharding_constraint(x, s)

    return constrain, finish
