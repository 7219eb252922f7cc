r"""SPMD execution facts: the device mesh, the compiled shardings checked against the plan
before anything runs, the collectives of a compiled program counted, its memory read.
(Writing a plan into the program is ``hlo_passes.lower``.)

Example:
    >>> count_collectives("HloModule m\nENTRY e {\n  p = f32[8] parameter(0)\n"
    ...                   "  ROOT r = f32[8] all-reduce(p), to_apply=add\n}\n")[0].kind
    'all-reduce'
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Sequence

import numpy as np

from rhino.errors import RhinoError
from rhino.hlo_passes import hlo_text as ht
from rhino.hlo_passes.graph import flatten_shape

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")


class ShardingMismatchError(RhinoError):
    """The compiled program's shardings differ from the plan's (never run silently)."""


def device_mesh(mesh_shape: Sequence[int], axis_names: Sequence[str], devices=None):
    """A ``jax.sharding.Mesh`` (Auto axes) over the first devices."""
    import jax
    from jax.sharding import Mesh

    n = int(np.prod(mesh_shape))
    devs = list(devices) if devices is not None else jax.devices()
    if len(devs) < n:
        raise RhinoError(f"mesh {tuple(mesh_shape)} needs {n} devices, found {len(devs)} "
                         f"({devs[0].platform if devs else 'none'}); on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before "
                         f"importing jax")
    return Mesh(np.array(devs[:n]).reshape(tuple(mesh_shape)), tuple(axis_names))


def check_shardings(what: str, compiled: Sequence[Any], expected: Sequence[Any],
                    ndims: Sequence[int], paths: Sequence[str]) -> None:
    """Raise ``ShardingMismatchError`` naming the first leaf whose compiled sharding is
    not equivalent to the planned one."""
    if len(compiled) != len(expected):
        raise ShardingMismatchError(f"{what}: the compiled program has {len(compiled)} "
                                    f"shardings, the plan {len(expected)}")
    for got, want, nd, path in zip(compiled, expected, ndims, paths):
        if not got.is_equivalent_to(want, nd):
            raise ShardingMismatchError(
                f"{what} {path}: planned {getattr(want, 'spec', want)}, the compiled program "
                f"has {getattr(got, 'spec', got)}; refusing to run a program that differs "
                f"from its plan")


@dataclasses.dataclass(frozen=True)
class CountedCollective:
    """A collective found in compiled HLO: kind, per-device bytes (the planner's
    convention: all-reduce/all-to-all/permute the operand, all-gather the result,
    reduce-scatter the operand), and the instruction name."""

    kind: str
    bytes: int
    name: str


def count_collectives(hlo: str) -> list[CountedCollective]:
    """Collectives of a compiled (partitioned) HLO module. A combined (tuple) all-reduce or
    all-gather counts once per operand, as the planner predicts them; a tuple all-to-all
    (XLA:CPU splits the exchange into one operand per peer) counts once."""
    module = ht.parse_hlo_text(hlo, "<compiled>")
    out: list[CountedCollective] = []
    for comp in module.computations.values():
        shapes = {i.name: i.shape for i in comp.instrs}
        for ins in comp.instrs:
            op = ins.opcode
            if op.endswith("-done"):
                continue
            kind = op[:-6] if op.endswith("-start") else op
            if kind not in COLLECTIVE_KINDS:
                continue
            operands = [shapes[o] for o in ins.operands if o in shapes]
            if kind == "all-gather":
                results = flatten_shape(ins.shape)
                if op.endswith("-start"):  # (operands..., results...) tuple
                    results = results[len(results) // 2:]
                sizes = [t.nbytes for t in results]
            else:
                sizes = [t.nbytes for s in operands for t in flatten_shape(s)]
            if kind == "all-to-all":  # a tuple all-to-all is one exchange of its chunks
                sizes = [sum(sizes)]
            for k, b in enumerate(sizes):
                out.append(CountedCollective(kind, int(b), f"{ins.name}#{k}"))
    return out


def summarize(collectives: Sequence[CountedCollective]) -> dict[str, tuple[int, int]]:
    """kind -> (count, total bytes)."""
    c, b = Counter(), Counter()
    for x in collectives:
        c[x.kind] += 1
        b[x.kind] += x.bytes
    return {k: (c[k], b[k]) for k in sorted(c)}



def compiled_memory(compiled: Any) -> dict[str, int] | None:
    """Per-device memory of a compiled program from XLA's ``memory_analysis()``:
    ``argument``, ``output``, ``temp``, ``alias`` and ``generated_code`` bytes, and ``peak``
    = argument + output + temp − alias (donated state updated in place counts once).
    None where the backend gives no analysis."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    if ma is None:
        return None
    d = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in
         ("argument", "output", "temp", "alias", "generated_code")}
    d["peak"] = d["argument"] + d["output"] + d["temp"] - d["alias"]
    return d
