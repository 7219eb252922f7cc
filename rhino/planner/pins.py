"""User annotations as planner pins: ``{pytree path or jax.named_scope name: spec}`` ->
``{op id: ShardingSpec}`` for ``BuildOptions.pinned`` (``auto_parallel(annotations=...)``,
the SPMD planner and every stage plan of the pipeline search)."""

from __future__ import annotations

from typing import Any, Mapping

from rhino.errors import OptionsError, RhinoError
from rhino.hlo_passes.graph import HloGraph
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spec import ShardingSpec


def annotation_pins(graph: HloGraph, annotations: Mapping[str, Any], mesh: AbstractMesh
                    ) -> dict[int, ShardingSpec]:
    """Annotations (pytree path or ``jax.named_scope`` name -> spec) as op id -> spec.

    Raises:
        RhinoError: a key naming neither a parameter nor a scope.
        OptionsError: a spec that does not fit the value's shape on the mesh (rank, or a
            dimension its shards do not divide).
    """
    pins: dict[int, ShardingSpec] = {}
    by_path = {graph.ops[p].arg.path: p for p in graph.params if graph.ops[p].arg}
    users = graph.users
    for key, value in annotations.items():
        try:
            spec = value if isinstance(value, ShardingSpec) else \
                ShardingSpec.parse(str(value), mesh)
        except ValueError as e:
            raise OptionsError(f"annotation {key!r}: {e}") from None
        if key in by_path:
            _check_fits(key, spec, graph.ops[by_path[key]], mesh)
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
            _check_fits(key, spec, graph.ops[i], mesh)
            pins[i] = spec
    return pins


def _check_fits(key: str, spec: ShardingSpec, op: Any, mesh: AbstractMesh) -> None:
    dims = getattr(op.shape, "dims", None)
    if dims is None:
        return  # a tuple value: the planner says it stays replicated
    problems = spec.problems(dims, mesh)
    if problems:
        what = op.arg.path if op.arg is not None else f"{op.name} ({op.opcode})"
        raise OptionsError(f"annotation {key!r}: {spec.to_str(mesh)} does not fit {what} of "
                           f"shape {tuple(dims)} on mesh {mesh}: " + "; ".join(problems))
