"""The HloGraph: a flat, topologically ordered, inlined view of an HLO module.

Every op has a stable integer id equal to its position in ``HloGraph.ops`` (topological
order: operands always come before users). Nested computations reached through ``call``
(and ``fusion`` in optimized dumps) are inlined; reducer regions (``to_apply`` of reduce,
scatter, all-reduce, ...) are summarized in ``Op.attrs['reducer']``; control flow
(``while``, ``conditional``) stays one opaque op, listed in ``HloGraph.opaque``.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> g = rhino.ingest(lambda x, w: jnp.tanh(x @ w), jnp.ones((8, 4)), jnp.ones((4, 2)))
    >>> [op.opcode for op in g.ops]
    ['parameter', 'parameter', 'dot', 'tanh']
    >>> g.ops[2].flops
    128.0
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Iterator, NamedTuple

DTYPE_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "token": 0, "opaque": 0,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of an HLO element type (``f8*`` types count as 1)."""
    got = DTYPE_BYTES.get(dtype)
    if got is not None:
        return got
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return 1
    raise KeyError(dtype)


class TensorType(NamedTuple):
    """An array type: HLO element type name and static dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        return math.prod(self.dims) * dtype_bytes(self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


# A result shape: one TensorType, or a (possibly nested) tuple of shapes.
Shape = Any


def flatten_shape(shape: Shape) -> tuple[TensorType, ...]:
    """The array leaves of a (possibly nested tuple) shape, in order."""
    if isinstance(shape, TensorType):
        return (shape,)
    out: list[TensorType] = []
    for s in shape:
        out.extend(flatten_shape(s))
    return tuple(out)


def shape_str(shape: Shape) -> str:
    if isinstance(shape, TensorType):
        return str(shape)
    return "(" + ", ".join(shape_str(s) for s in shape) + ")"


@dataclasses.dataclass(frozen=True)
class ArgInfo:
    """Where an entry parameter (or an output) comes from in the user's pytrees.

    Attributes:
        index: flat position among the entry parameters (or outputs).
        path: pytree path as ``jax.tree_util.keystr`` prints it, prefixed by the argument,
            e.g. ``params['layers'][3]['wqkv']``; for HLO files, the parameter's name.
        donated: the buffer is donated (inputs only).
    """

    index: int
    path: str
    donated: bool = False


@dataclasses.dataclass(eq=False, slots=True)
class Op:
    """One HLO instruction of the inlined graph.

    Attributes:
        id: position in ``HloGraph.ops``; stable for the life of the graph.
        name: the instruction name (unique in the graph; inlined copies get a suffix).
        opcode: HLO opcode (``dot``, ``add``, ``parameter``, ...).
        shape: the result shape: a TensorType, or a tuple of shapes for tuple results.
        operands: ids of the operand ops, in order.
        attrs: parsed attributes the planner needs (see ``hlo_passes.hlo_text``).
        flops: floating point operations of this op (multiply-add = 2).
        out_bytes: bytes of the result.
        op_name: the ``op_name`` metadata (JAX's name stack), or "".
        source: ``file:line`` of the user code, or None.
        arg: for entry parameters, where the value comes from.
    """

    id: int
    name: str
    opcode: str
    shape: Shape
    operands: tuple[int, ...]
    attrs: dict[str, Any]
    flops: float = 0.0
    out_bytes: int = 0
    op_name: str = ""
    source: str | None = None
    arg: ArgInfo | None = None

    @property
    def is_tuple(self) -> bool:
        return not isinstance(self.shape, TensorType)

    @property
    def tensor(self) -> TensorType:
        """The array result type; raises for tuple-shaped ops."""
        if isinstance(self.shape, TensorType):
            return self.shape
        raise TypeError(f"op {self.name} ({self.opcode}) has tuple shape {shape_str(self.shape)}")

    def __repr__(self) -> str:
        return (f"Op({self.id}, {self.name}, {self.opcode}, {shape_str(self.shape)}, "
                f"operands={list(self.operands)})")


@dataclasses.dataclass(eq=False)
class HloGraph:
    """An inlined HLO graph in topological order.

    Attributes:
        name: the module name.
        ops: every op; ``ops[i].id == i``; operands precede users.
        params: ids of the entry parameters, in parameter order.
        outputs: ids of the ops whose values the program returns, in order.
        output_info: pytree paths of the outputs (parallel to ``outputs``).
        opaque: ids of ops kept opaque (control flow), with the reason in ``attrs['opaque']``.
        origin: what was ingested: ``"jax"``, ``"hlo"`` or ``"mlir"``, plus a path for files.
        arg_names: the function's top-level argument names in order, those without any
            array leaf too (an empty optimizer state); empty for files.
        aliases: (output position, parameter position) pairs of a dump whose results reuse
            donated arguments' buffers (its ``input_output_alias``): the updates of the
            state arguments, where a file has no pytree paths to pair them by; empty for
            functions, whose paths pair them (``rhino.planner.build.carried_pairs``).
    """

    name: str
    ops: list[Op]
    params: list[int]
    outputs: list[int]
    output_info: list[ArgInfo]
    opaque: list[int]
    origin: str
    arg_names: tuple[str, ...] = ()
    aliases: tuple[tuple[int, int], ...] = ()
    _users: list[list[int]] | None = dataclasses.field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    @property
    def users(self) -> list[list[int]]:
        """``users[i]``: ids of the ops that read op i (each user once), ascending."""
        if self._users is None:
            users: list[list[int]] = [[] for _ in self.ops]
            for op in self.ops:
                seen = None
                for o in op.operands:
                    if seen is None:
                        users[o].append(op.id)
                        seen = {o}
                    elif o not in seen:
                        users[o].append(op.id)
                        seen.add(o)
            self._users = users
        return self._users

    def preds(self, i: int) -> tuple[int, ...]:
        """Distinct operand ids of op i, in first-use order."""
        return tuple(dict.fromkeys(self.ops[i].operands))

    def op_by_name(self, name: str) -> Op:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"no op named {name!r} in graph {self.name!r}")

    def opcode_histogram(self) -> Counter:
        return Counter(op.opcode for op in self.ops)

    @property
    def total_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    @property
    def param_bytes(self) -> int:
        return sum(self.ops[p].out_bytes for p in self.params)

    def check(self) -> None:
        """Validate the graph's invariants: ``ops[i].id == i``; every operand id exists and
        precedes its user; array dimensions are non-negative integers; FLOPs are finite and
        non-negative, bytes non-negative integers; ``params`` are the parameter ops, numbered
        ``0..n-1`` in order; outputs and opaque ids exist. Raised even under ``python -O``.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        def require(ok: bool, msg: str) -> None:
            if not ok:
                raise AssertionError(f"graph {self.name!r}: {msg}")

        n = len(self.ops)
        for i, op in enumerate(self.ops):
            require(op.id == i, f"op {op.name} has id {op.id} at position {i}")
            for o in op.operands:
                require(isinstance(o, int) and 0 <= o < i,
                        f"op {op.name} (#{i}) reads #{o}, not before it")
            for t in flatten_shape(op.shape):
                require(all(isinstance(d, int) and d >= 0 for d in t.dims),
                        f"op {op.name} has dimensions {t.dims}")
            require(isinstance(op.flops, (int, float)) and 0 <= op.flops < math.inf,
                    f"op {op.name} has {op.flops} FLOPs")
            require(isinstance(op.out_bytes, int) and op.out_bytes >= 0,
                    f"op {op.name} has {op.out_bytes} output bytes")
        for k, p in enumerate(self.params):
            require(0 <= p < n and self.ops[p].opcode == "parameter",
                    f"param {k} is #{p}, not a parameter op")
            num = self.ops[p].attrs.get("parameter_number", k)
            require(num == k, f"param {k} ({self.ops[p].name}) is numbered {num}")
        n_param_ops = sum(op.opcode == "parameter" for op in self.ops)
        require(len(set(self.params)) == len(self.params) == n_param_ops,
                f"params {self.params} are not the graph's {n_param_ops} parameter ops")
        for o in self.outputs:
            require(0 <= o < n, f"output #{o} out of range")
        for o in self.opaque:
            require(0 <= o < n, f"opaque #{o} out of range")
        require(len(self.output_info) == len(self.outputs),
                f"{len(self.output_info)} output infos for {len(self.outputs)} outputs")
        for k, p in self.aliases:
            require(0 <= k < len(self.outputs) and 0 <= p < len(self.params),
                    f"alias (output {k}, parameter {p}) out of range")
