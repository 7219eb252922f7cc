"""User annotations as planner pins: ``{pytree path or jax.named_scope name: spec}`` ->
``{op id: ShardingSpec}`` for ``BuildOptions.pinned`` (``auto_parallel(annotations=...)``,
the SPMD planner and every stage plan of the pipeline search)."""

from __future__ import annotations

import re
from typing import Any, Mapping

from rhino.errors import OptionsError, RhinoError
from rhino.hlo_passes.graph import HloGraph
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spec import ShardingSpec


def annotation_pins(graph: HloGraph, annotations: Mapping[str, Any], mesh: AbstractMesh
                    ) -> dict[int, ShardingSpec]:
    """Annotations (pytree path or ``jax.named_scope`` name -> spec) as op id -> spec.

    A spec is rhino's notation (``"S[x]·R"``, a ``ShardingSpec``) or a
    ``jax.sharding.PartitionSpec`` over the mesh's axis names (``P('x', None)``). A path of
    a Flax NNX leaf may leave out its ``.value``.

    Raises:
        RhinoError: a key naming neither a parameter nor a scope.
        OptionsError: a spec that does not fit the value's shape on the mesh (rank, or a
            dimension its shards do not divide, where the value is an argument or a
            result: a value inside the step may be split unevenly over one axis).
    """
    pins: dict[int, ShardingSpec] = {}
    by_path = {graph.ops[p].arg.path: p for p in graph.params if graph.ops[p].arg}
    # Flax NNX state leaves end in ``.value`` (``params['kernel'].value``): a path names
    # its leaf with or without it.
    by_path.update({path[:-len(VALUE)]: p for path, p in list(by_path.items())
                    if path.endswith(VALUE) and path[:-len(VALUE)] not in by_path})
    users = graph.users
    for key, value in annotations.items():
        annotation_spec(key, value, mesh)      # a malformed spec fails here, whatever the key
        if key not in by_path and key.endswith(VALUE) and key[:-len(VALUE)] in by_path:
            key = key[:-len(VALUE)]
        if key in by_path:
            op = graph.ops[by_path[key]]
            spec = annotation_spec(key, value, mesh, _rank(op))
            _check_fits(key, spec, op, mesh)
            pins[by_path[key]] = spec
            continue
        scoped = [op.id for op in graph.ops if _in_scope(op.op_name, key)]
        members = set(scoped)
        exported = [i for i in scoped if i in graph.outputs
                    or any(u not in members for u in users[i])]
        if not exported:
            raise RhinoError(f"annotation {key!r}: expected a parameter pytree path (e.g. "
                             f"{next(iter(by_path), 'params[...]')!r}) or a jax.named_scope "
                             f"name used in the step; found neither")
        for i in exported:
            spec = annotation_spec(key, value, mesh, _rank(graph.ops[i]))
            # a value inside the step may be split unevenly (padded), as the search does
            _check_fits(key, spec, graph.ops[i], mesh, uneven=i not in graph.outputs)
            pins[i] = spec
    return pins


VALUE = ".value"

# JAX names the scope of a value computed under a transformation ``jvp(scope)``,
# ``vmap(scope)``...; the backward pass's ``transpose(jvp(scope))`` is not the value the
# scope names.
_WRAPPED = re.compile(r"^(?:jvp|vmap|checkpoint|remat|pjit|jit)\((.*)\)$")


def _in_scope(op_name: str, key: str) -> bool:
    """Whether an op named ``op_name`` computes a value of the scope ``key`` (one name, or
    nested names ``outer/inner``), its forward value: under ``jax.grad`` the scope reads
    ``jvp(key)``; the backward's ``transpose(jvp(key))`` is left out.

    Example:
        >>> _in_scope("jit(step)/jvp(logits)/dot_general", "logits")
        True
        >>> _in_scope("jit(step)/transpose(jvp(logits))/dot_general", "logits")
        False
        >>> _in_scope("jit(step)/jvp(block)/jvp(attn)/exp", "block/attn")
        True
    """
    parts = []
    for part in op_name.split("/"):
        m = _WRAPPED.match(part)
        while m is not None:
            part = m.group(1)
            m = _WRAPPED.match(part)
        parts.append(part)
    return f"/{key}/" in "/" + "/".join(parts) + "/"


def annotation_spec(key: str, value: Any, mesh: AbstractMesh, rank: int | None = None
                    ) -> ShardingSpec:
    """The ``ShardingSpec`` of one annotation: a ``ShardingSpec``, rhino's notation, or a
    ``jax.sharding.PartitionSpec`` (one entry per dimension: None, an axis name, or a
    tuple of axis names split together, outermost first; as in JAX, dimensions past its
    end, up to ``rank``, are replicated).

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = AbstractMesh((2, 4))
        >>> annotation_spec("w", P("x", None), mesh).to_str(mesh)
        'S[x]·R'
        >>> annotation_spec("w", P(None, ("x", "y")), mesh).to_str(mesh)
        'R·S[x,y]'
        >>> annotation_spec("w", P("y"), mesh, rank=3).to_str(mesh)
        'S[y]·R·R'

    Raises:
        OptionsError: a spec that is none of these, or names an axis the mesh lacks.
    """
    from jax.sharding import PartitionSpec

    if isinstance(value, ShardingSpec):
        return value
    names = list(mesh.axis_names)
    try:
        if isinstance(value, PartitionSpec):
            splits = {}
            for d, entry in enumerate(value):
                axes = () if entry is None else (entry,) if isinstance(entry, str) \
                    else tuple(entry)
                for a in axes:
                    if a not in names:
                        raise ValueError(f"expected mesh axis names {names} in "
                                         f"{value}, found {a!r}")
                if axes:
                    splits[d] = tuple(names.index(a) for a in axes)
            return ShardingSpec.sharded(max(len(value), rank or 0), splits)
        if isinstance(value, str):
            return ShardingSpec.parse(value, mesh)
    except ValueError as e:
        raise OptionsError(f"annotation {key!r}: {e}") from None
    raise OptionsError(f"annotation {key!r}: expected a spec such as 'S[x]·R' or "
                       f"PartitionSpec('x', None), found {type(value).__name__} {value!r}")


def _rank(op: Any) -> int | None:
    dims = getattr(op.shape, "dims", None)
    return None if dims is None else len(dims)


def _check_fits(key: str, spec: ShardingSpec, op: Any, mesh: AbstractMesh,
                uneven: bool = False) -> None:
    dims = getattr(op.shape, "dims", None)
    if dims is None:
        return  # a tuple value: the planner says it stays replicated
    problems = spec.problems(dims, mesh, uneven)
    if problems:
        what = op.arg.path if op.arg is not None else f"{op.name} ({op.opcode})"
        raise OptionsError(f"annotation {key!r}: {spec.to_str(mesh)} does not fit {what} of "
                           f"shape {tuple(dims)} on mesh {mesh}: " + "; ".join(problems))
