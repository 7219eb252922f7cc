"""Subgraphs: cut a set of ops out of an ``HloGraph`` as an ``HloGraph`` of its own.

A pipeline stage (or the compute-gradients / apply-gradients half of a training step) is a
subset of the program's ops. ``extract_subgraph`` turns such a subset into a stand-alone
graph the SPMD planner can plan:

* the chosen ops keep their names, opcodes, shapes, attributes, FLOPs and sources, in the
  source graph's (topological) order;
* ``duplicate`` ops (entry parameters, constants, values computed from training state only)
  are copied into the subgraph when a chosen op needs them, so every stage that reads a
  weight gets its own parameter op for it;
* an operand produced outside (and not duplicable) becomes a new *cut input*: a
  ``parameter`` op with the producer's name and shape and the pytree path ``cut:<name>``;
* the subgraph returns every chosen op the source graph returns (keeping its output path,
  e.g. ``out[0]['w']``, so updated weights still pair with their parameters) and every
  chosen op read by an op outside (path ``cut:<name>``).

Entry parameters keep their ``ArgInfo`` path and donation, renumbered in order; cut inputs
come after them.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> g = rhino.ingest(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2,
    ...                  jnp.ones((8, 4)), jnp.ones((4, 4)), jnp.ones((4, 2)))
    >>> [op.opcode for op in g.ops]
    ['parameter', 'parameter', 'dot', 'tanh', 'parameter', 'dot']
    >>> sub = extract_subgraph(g, [5], duplicate=g.params)
    >>> [(op.opcode, op.arg.path) for op in sub.graph.ops if op.opcode == "parameter"]
    [('parameter', 'w2'), ('parameter', 'cut:tanh.1')]
    >>> sub.inputs, sub.outputs
    ((3,), (5,))
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterable

from .graph import ArgInfo, HloGraph, Op, shape_str

CUT_PREFIX = "cut:"


@dataclasses.dataclass(frozen=True, eq=False)
class Subgraph:
    """A graph cut out of a source graph, with the maps back to it.

    Attributes:
        graph: the stand-alone subgraph (``graph.check()`` holds).
        origin: for each subgraph op id, the source op id (a cut input maps to its producer).
        inputs: source ids of the cut inputs, in the order of their parameters.
        outputs: source ids of the values the subgraph returns, in output order.
        duplicated: source ids of the ``duplicate`` ops copied in.
    """

    graph: HloGraph
    origin: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    duplicated: tuple[int, ...]

    def new_id(self, source_id: int) -> int:
        """The subgraph id of a source op (chosen, duplicated or cut input)."""
        index = self._index()
        if source_id not in index:
            raise KeyError(f"source op #{source_id} is not in subgraph {self.graph.name!r}")
        return index[source_id]

    def _index(self) -> dict[int, int]:
        got = self.__dict__.get("_idx")
        if got is None:
            got = {s: i for i, s in enumerate(self.origin)}
            object.__setattr__(self, "_idx", got)
        return got


def _closure(graph: HloGraph, chosen: set[int], duplicable: set[int]) -> set[int]:
    """Duplicable ancestors reachable from ``chosen`` through duplicable ops only."""
    pulled: set[int] = set()
    stack = [o for i in chosen for o in graph.ops[i].operands
             if o in duplicable and o not in chosen]
    while stack:
        i = stack.pop()
        if i in pulled:
            continue
        pulled.add(i)
        for o in graph.ops[i].operands:
            if o in duplicable and o not in chosen and o not in pulled:
                stack.append(o)
    return pulled


def extract_subgraph(graph: HloGraph, ops: Iterable[int], *, duplicate: Iterable[int] = (),
                     outputs: Iterable[int] | None = None, name: str | None = None
                     ) -> Subgraph:
    """Cut ``ops`` out of ``graph`` (see the module docstring).

    Args:
        graph: the source graph.
        ops: source op ids to include.
        duplicate: source op ids that are copied in when an included op needs them.
        outputs: source ids to return; default: chosen ops the program returns or an op
            outside reads. Each must be chosen or duplicated.
        name: the subgraph's module name (default ``<graph name>.sub``).

    Returns:
        The ``Subgraph``.

    Raises:
        ValueError: an op id out of range, or an output that is not in the subgraph.
    """
    n = len(graph.ops)
    chosen = set(ops)
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
        raise ValueError(f"extract_subgraph: expected op ids in 0..{n - 1}, found {sorted(bad)[:5]}")
    duplicable = set(duplicate) - chosen
    pulled = _closure(graph, chosen, duplicable)
    members = sorted(chosen | pulled)
    member_set = set(members)
    cut_inputs = sorted({o for i in members for o in graph.ops[i].operands
                         if o not in member_set})
    out_paths: dict[int, str] = {}
    for o, info in zip(graph.outputs, graph.output_info):
        out_paths.setdefault(o, info.path)
    if outputs is None:
        users = graph.users
        outs = [i for i in sorted(chosen)
                if i in out_paths or any(u not in member_set for u in users[i])]
    else:
        outs = list(dict.fromkeys(outputs))
        missing = [i for i in outs if i not in member_set]
        if missing:
            raise ValueError(f"extract_subgraph: expected outputs among the subgraph's ops, found "
                             f"{[graph.ops[i].name for i in missing[:5]]} outside it")

    new_ops: list[Op] = []
    origin: list[int] = []
    remap: dict[int, int] = {}
    params: list[int] = []
    # Entry parameters first (in their original order), then cut inputs, then the rest.
    entry = [i for i in members if graph.ops[i].opcode == "parameter"]
    entry.sort(key=lambda i: graph.ops[i].attrs.get("parameter_number", i))
    rest = [i for i in members if graph.ops[i].opcode != "parameter"]

    def add(op: Op, src: int, operands: tuple[int, ...], arg: ArgInfo | None,
            attrs: dict) -> None:
        new = Op(id=len(new_ops), name=op.name, opcode=op.opcode, shape=op.shape,
                 operands=operands, attrs=attrs, flops=op.flops, out_bytes=op.out_bytes,
                 op_name=op.op_name, source=op.source, arg=arg)
        remap[src] = new.id
        origin.append(src)
        new_ops.append(new)

    for i in entry:
        op = graph.ops[i]
        k = len(params)
        arg = op.arg or ArgInfo(k, op.name)
        params.append(len(new_ops))
        add(op, i, (), ArgInfo(k, arg.path, arg.donated), dict(op.attrs, parameter_number=k))
    for i in cut_inputs:
        op = graph.ops[i]
        k = len(params)
        params.append(len(new_ops))
        new = Op(id=len(new_ops), name=op.name, opcode="parameter", shape=op.shape, operands=(),
                 attrs={"parameter_number": k}, flops=0.0, out_bytes=op.out_bytes,
                 op_name=op.op_name, source=op.source, arg=ArgInfo(k, CUT_PREFIX + op.name))
        remap[i] = new.id
        origin.append(i)
        new_ops.append(new)
    # Parameters precede everything, so operands of the rest are always remapped already
    # except those produced by earlier ``rest`` ops, which come in source (topological) order.
    for i in rest:
        op = graph.ops[i]
        add(op, i, tuple(remap[o] for o in op.operands), None, dict(op.attrs))
    # Restore topological order: parameters first is valid since they have no operands.
    out_infos = []
    for k, o in enumerate(outs):
        path = out_paths.get(o, CUT_PREFIX + graph.ops[o].name)
        out_infos.append(ArgInfo(k, path))
    sub = HloGraph(name=name or f"{graph.name}.sub", ops=new_ops, params=params,
                   outputs=[remap[o] for o in outs], output_info=out_infos,
                   opaque=[remap[i] for i in graph.opaque if i in remap],
                   origin=graph.origin, arg_names=graph.arg_names)
    sub.check()
    return Subgraph(sub, tuple(origin), tuple(cut_inputs), tuple(outs),
                    tuple(sorted(pulled)))


# Attributes naming computations differ between identical copies of a region; skip them.
_NAMING_ATTRS = frozenset({"parameter_number", "to_apply", "calls", "body", "condition",
                           "true_computation", "false_computation", "branch_computations"})


def structural_key(graph: HloGraph, extra: str = "") -> str:
    """A digest of a graph's structure: opcodes, shapes, edges, attributes, parameter kinds.

    Two graphs with equal keys have the same ops in the same order up to op names and
    pytree paths (cut inputs and entry parameters are told apart), so a plan made for one
    applies to the other op by op. Used to plan repeated pipeline stages once.
    """
    h = hashlib.sha256()
    barriers: dict[Any, int] = {}   # remat barrier names, by first appearance (one per layer)
    for op in graph.ops:
        attrs = sorted((k, repr(barriers.setdefault(v, len(barriers)) if k == "barrier" else v))
                       for k, v in op.attrs.items() if k not in _NAMING_ATTRS)
        kind = ""
        if op.opcode == "parameter" and op.arg is not None:
            kind = "cut" if op.arg.path.startswith(CUT_PREFIX) else "arg"
        h.update(repr((op.opcode, shape_str(op.shape), op.operands, attrs, kind)).encode())
    h.update(repr(graph.outputs).encode())
    h.update(extra.encode())
    return h.hexdigest()
