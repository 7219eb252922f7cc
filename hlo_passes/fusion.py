"""Kernels of a graph, fused the way XLA fuses them (``rhino.planner.op_cost`` prices them).

``fusion_kernels(graph)`` groups the ops of an ``HloGraph`` into the kernels XLA would run,
from the ops' kinds alone (a pure function of the graph):

* *views* cost nothing and read through: ``reshape``, ``bitcast``, ``get-tuple-element``,
  ``tuple``, and a ``transpose`` read only by matmuls (XLA folds it into the matmul's
  operand layout); *sources* are read from memory where a kernel reads them:
  ``parameter``, ``constant`` (scalars are free: they become literals);
* *fusible* ops (elementwise, ``broadcast``, ``convert``, ``slice``, ``transpose``,
  ``concatenate``, ``gather``, ``iota``, ...) join the kernel of their consumers, taken in
  reverse program order as XLA's producer-consumer fusion does: an op whose consumers all
  lie in one kernel joins it; one read by several kernels is *duplicated* into each when it
  is cheap and reads no more bytes than it writes (``_Fuser._duplicable``), and otherwise
  becomes a kernel of its own (its result written once and read by
  each); an op read by a matmul or another library call becomes a kernel of its own (their
  operands are buffers). What is cheap depends on the compiler (``Roofline.fusion``):
  XLA:CPU keeps transcendental ops and divisions out (``EXPENSIVE``), XLA:GPU only a few
  (``EXPENSIVE_GPU``: its f32 math is cheap);
* a *reduction* (``reduce``, ``reduce-window``) and an in-place ``dynamic-update-slice``
  start a kernel that their producers may join, and do not join their consumers (their
  results are written), except on GPU a reduction over the trailing dimensions whose
  consumers all lie in one kernel over the reduction's input shape (a softmax or a
  normalization: Triton's softmax fusion keeps each row on chip);
* anything else (``dot``, ``convolution``, ``custom-call``, collectives, ``sort``,
  ``scatter``, control flow) is a kernel of its own.

A kernel moves the bytes of the values it reads from outside it (each once; a value read
only through slices, only the sliced part; the buffer a ``dynamic-update-slice`` updates
in place, not at all) and of the values it writes (its root's, and those of members that
are program outputs): an elementwise chain reads its inputs and writes its output once.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> g = rhino.ingest(lambda x: jnp.tanh(x * 2.0 + 1.0), jnp.ones((1024, 256)))
    >>> [(k.kind, len(k.members), k.bytes) for k in fusion_kernels(g)]   # read + write once
    [('vector', 5, 2097152.0)]
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .costs import ELEMENTWISE
from .graph import HloGraph, Op, TensorType, flatten_shape

VIEWS = frozenset({"reshape", "bitcast", "get-tuple-element", "tuple", "opt-barrier",
                   "optimization-barrier"})
SOURCES = frozenset({"parameter", "constant", "partition-id", "replica-id", "after-all"})
FUSIBLE = ELEMENTWISE | frozenset({
    "broadcast", "transpose", "slice", "dynamic-slice", "concatenate", "pad", "reverse",
    "iota", "copy", "gather", "select", "clamp", "convert", "reduce-precision", "map"})
ROOTS = frozenset({"reduce", "reduce-window", "dynamic-update-slice"})
MATMULS = frozenset({"dot", "convolution"})
# Not duplicated into several consumers: recomputing them per consumer costs more than
# reading their result (XLA's "expensive" ops).
EXPENSIVE = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "erf",
    "divide", "power", "rsqrt", "sqrt", "cbrt", "sine", "cosine", "tan", "atan2",
    "remainder", "concatenate", "pad", "gather", "reverse", "map"})
EXPENSIVE_GPU = frozenset({"power", "remainder", "atan2", "concatenate", "pad", "gather",
                           "reverse", "map"})
SLICING = frozenset({"slice", "dynamic-slice", "gather"})
TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "erf",
    "power", "rsqrt", "sqrt", "cbrt", "sine", "cosine", "tan", "atan2"})
CONTROL = frozenset({"while", "conditional", "call"})
ATTENTION_PREFIX = "__cudnn$fmha"
CUSTOM_PARTITIONING = "CustomSPMDPartitioning"
BODY_KERNELS = "body_kernels"   # Op.attrs key: a custom_partitioning body's kernels


def kernel_dtype(graph: HloGraph, op: Op) -> str:
    """The dtype ``op`` computes in: a dot's, convolution's or library call's first
    operand type (bf16 × bf16 accumulated in f32 runs at the bf16 rate; cuDNN attention on
    bf16 queries at the bf16 rate), else its result type; ``f32`` for tuple-shaped ops."""
    if (op.opcode in MATMULS or op.opcode == "custom-call") and op.operands:
        src = graph.ops[op.operands[0]].shape
        if isinstance(src, TensorType):
            return src.dtype
    return op.shape.dtype if isinstance(op.shape, TensorType) else "f32"


def matmul_square_flops(graph: HloGraph, op: Op) -> float:
    """The FLOPs of the square matmul a dot or convolution runs like: as a matrix product
    ``[M, K] × [K, N]`` (a convolution as its implicit GEMM: M the batch and output
    positions, N the output features, K the window times the input features), the square
    of side ``s = 3 / (1/M + 1/N + 1/K)`` (the harmonic mean: a skinny product runs like a
    small square one), ``2·s³``. Matmul efficiency is looked up at this size.

    Example:
        >>> import jax.numpy as jnp, rhino
        >>> g = rhino.ingest(lambda a, b: a @ b, jnp.ones((512, 512)), jnp.ones((512, 16)))
        >>> round(matmul_square_flops(g, g.ops[2]) ** (1 / 3) / 2 ** (1 / 3))   # s
        45
    """
    if not isinstance(op.shape, TensorType) or op.flops <= 0:
        return op.flops
    out = op.shape.numel
    if op.opcode == "dot":
        rhs = graph.ops[op.operands[1]].shape
        skip = set(op.attrs.get("rhs_contracting_dims", ())) | \
            set(op.attrs.get("rhs_batch_dims", ()))
        n = 1
        for d, size in enumerate(rhs.dims if isinstance(rhs, TensorType) else ()):
            if d not in skip:
                n *= size
    else:
        labels = str(op.attrs.get("dim_labels", ""))
        out_labels = labels.split("->")[-1] if "->" in labels else ""
        n = op.shape.dims[out_labels.index("f")] if "f" in out_labels and \
            len(out_labels) == op.shape.rank else 1
    k = op.flops / (2.0 * out)
    m = out / max(n, 1)
    dims = [x for x in (m, n, k) if x > 0]
    if len(dims) < 3:
        return op.flops
    side = 3.0 / sum(1.0 / x for x in dims)
    return 2.0 * side ** 3


def _bytes(shape) -> int:
    return sum(t.nbytes for t in flatten_shape(shape))


def _result_bytes(op: Op) -> int:
    """Bytes a kernel writes for ``op``: a library call's ``u8``/``s8`` workspace is not
    a result, a ``dynamic-update-slice`` writes its update only."""
    if isinstance(op.shape, TensorType):
        return op.shape.nbytes
    return sum(t.nbytes for t in flatten_shape(op.shape)
               if not (t.dtype in ("u8", "s8") and len(t.dims) == 1))


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of the fusion model.

    Attributes:
        root: the op whose result the kernel is (its launch is charged there).
        members: every op computed in it, root included (a cheap op duplicated into several
            kernels is a member of each).
        kind: ``matmul`` (dot, library matmuls), ``conv`` (convolution), ``attention`` (a fused
            attention call), ``body`` (a ``custom_partitioning`` call, priced by its body's
            kernels), ``control`` (a ``while``/``conditional`` kept whole: its FLOPs at the
            peak) or ``vector`` (everything else).
        flops: FLOPs of its members.
        bytes: bytes it reads and writes.
        dtype: the dtype it computes in (``compute_dtype`` of the root).
        transcendentals: elements its transcendental members compute (``TRANSCENDENTAL``).
        square_flops: a matmul's size as the FLOPs of the square matmul it runs like
            (``matmul_square_flops``); its FLOPs for other kernels.
    """

    root: int
    members: tuple[int, ...]
    kind: str
    flops: float
    bytes: float
    dtype: str
    transcendentals: float = 0.0
    square_flops: float = 0.0


class _Fuser:
    """Reverse-order fusion of one graph (module docstring)."""

    def __init__(self, graph: HloGraph, rules: str = "cpu"):
        self.graph = graph
        self.gpu = rules == "gpu"
        self.expensive = EXPENSIVE_GPU if self.gpu else EXPENSIVE
        self.ops = graph.ops
        self.users = graph.users
        self.outputs = set(graph.outputs)
        self.folded: set[int] = set()       # transposes folded into matmul operands
        self.groups: list[list[int]] = []   # kernel index -> member ops (root first)
        self.member_of: list[list[int]] = [[] for _ in graph.ops]
        self.accepts: list[bool] = []
        for op in graph.ops:
            if op.opcode == "transpose" and self._consumers(op.id) and all(
                    self.ops[u].opcode in MATMULS for u in self._consumers(op.id)):
                self.folded.add(op.id)

    def is_view(self, i: int) -> bool:
        return self.ops[i].opcode in VIEWS or i in self.folded

    def _consumers(self, i: int) -> list[int]:
        """Users of ``i``, looking through views."""
        out, stack, seen = [], list(self.users[i]), set()
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            if self.ops[u].opcode in VIEWS or u in self.folded:
                stack.extend(self.users[u])
            else:
                out.append(u)
        return out

    def _is_output(self, i: int) -> bool:
        """Whether ``i`` leaves the program (directly or through views)."""
        stack, seen = [i], set()
        while stack:
            v = stack.pop()
            if v in self.outputs:
                return True
            for u in self.users[v]:
                if u not in seen and (self.ops[u].opcode in VIEWS or u in self.folded):
                    seen.add(u)
                    stack.append(u)
        return False

    def _new(self, i: int, accepts: bool) -> None:
        self.member_of[i].append(len(self.groups))
        self.groups.append([i])
        self.accepts.append(accepts)

    def run(self) -> list[Kernel]:
        for i in range(len(self.ops) - 1, -1, -1):
            op = self.ops[i]
            code = op.opcode
            if code in SOURCES or self.is_view(i):
                continue
            if code in ROOTS:
                g = self._row_fusion(i)
                if g is None:
                    self._new(i, True)
                else:
                    self.groups[g].append(i)
                    self.member_of[i].append(g)
                continue
            if code not in FUSIBLE or not isinstance(op.shape, TensorType):
                self._new(i, False)
                continue
            into: set[int] = set()
            blocked = False
            for u in self._consumers(i):
                groups = self.member_of[u]
                if not groups or not all(self.accepts[g] for g in groups):
                    blocked = True
                    break
                into.update(groups)
            if blocked or not into or (len(into) > 1 and not self._duplicable(op)):
                self._new(i, True)
                continue
            for g in sorted(into):
                self.groups[g].append(i)
                self.member_of[i].append(g)
        return [self._kernel(members) for members in reversed(self.groups)]

    def _duplicable(self, op: Op) -> bool:
        """Whether ``op`` is recomputed in each kernel reading it rather than written once:
        a cheap op that reads no more bytes than it writes, broadcasts not counted (a
        broadcast, a convert, a unary op, a binary op with a broadcast operand; not the sum of two full tensors, whose
        copies would read both in every kernel and pull in their producers too)."""
        if op.opcode in self.expensive:
            return False
        reads = 0
        for o in dict.fromkeys(op.operands):
            if self.ops[self._producer(o)].opcode not in ("broadcast", "iota", "constant"):
                reads += _bytes(self.ops[o].shape)
        return reads <= _bytes(op.shape)

    def _row_fusion(self, i: int) -> int | None:
        """On GPU, the kernel a row reduction ``i`` joins (module docstring), else None."""
        op = self.ops[i]
        if not self.gpu or op.opcode != "reduce" or not isinstance(op.shape, TensorType):
            return None
        src = self.ops[op.operands[0]].shape
        dims = tuple(op.attrs.get("dimensions", ()))
        if not isinstance(src, TensorType) or not dims or \
                sorted(dims) != list(range(src.rank - len(dims), src.rank)):
            return None
        into: set[int] = set()
        for u in self._consumers(i):
            into.update(self.member_of[u] or [-1])
        if len(into) != 1 or -1 in into:
            return None
        g = into.pop()
        root = self.ops[self.groups[g][0]]
        ok = self.accepts[g] and root.opcode not in ROOTS and \
            isinstance(root.shape, TensorType) and root.shape.dims == src.dims
        return g if ok else None

    def _producer(self, o: int) -> int:
        """The op whose buffer reading ``o`` reads: through reshapes, bitcasts and folded
        transposes (not through tuple elements: an element is its own buffer)."""
        while self.ops[o].opcode in ("reshape", "bitcast", "opt-barrier",
                                     "optimization-barrier") or o in self.folded:
            if not self.ops[o].operands:
                break
            o = self.ops[o].operands[0]
        return o

    def _kernel(self, members: list[int]) -> Kernel:
        ops, graph = self.ops, self.graph
        root = members[0]
        inside = set(members)
        reads: dict[int, list[int]] = {}      # external buffer -> members reading it
        for m in members:
            operands = ops[m].operands
            if ops[m].opcode == "dynamic-update-slice":
                operands = operands[1:]       # the buffer is updated in place
            for o in dict.fromkeys(operands):
                p = self._producer(o)
                if p in inside:
                    continue
                if ops[p].opcode == "constant" and _bytes(ops[p].shape) <= 8:
                    continue                  # a scalar literal
                reads.setdefault(p, []).append(m)
        nbytes = 0.0
        for p, readers in reads.items():
            full = _bytes(ops[p].shape)
            if all(ops[r].opcode in SLICING for r in readers):
                full = min(full, sum(_bytes(ops[r].shape) for r in readers))
            nbytes += full
        root_op = ops[root]
        if root_op.opcode == "dynamic-update-slice":
            nbytes += _bytes(ops[root_op.operands[1]].shape)
        else:
            nbytes += _result_bytes(root_op)
        for m in members[1:]:
            if self._is_output(m):
                nbytes += _bytes(ops[m].shape)
        flops = float(sum(ops[m].flops for m in members))
        trans = float(sum(ops[m].shape.numel for m in members
                          if ops[m].opcode in TRANSCENDENTAL and isinstance(ops[m].shape,
                                                                            TensorType)))
        code = root_op.opcode
        target = str(root_op.attrs.get("custom_call_target", ""))
        if code in MATMULS:
            kind = "conv" if code == "convolution" else "matmul"
        elif code == "custom-call" and target.startswith(ATTENTION_PREFIX):
            kind = "attention"
        elif code == "custom-call" and root_op.attrs.get(BODY_KERNELS):
            kind = "body"
        elif code == "custom-call" and root_op.flops > 0:
            kind = "matmul"
        elif code in CONTROL or root in graph.opaque:
            kind = "control"
        else:
            kind = "vector"
        return Kernel(root, tuple(members), kind, flops, nbytes, kernel_dtype(graph, root_op),
                      trans if kind == "vector" else 0.0,
                      matmul_square_flops(graph, root_op) if code in MATMULS else flops)


def fusion_kernels(graph: HloGraph, rules: str = "cpu") -> list[Kernel]:
    """The kernels of ``graph`` under the fusion model (module docstring), in program
    order of their roots; ``rules``: ``cpu`` or ``gpu`` (``Roofline.fusion``)."""
    return _Fuser(graph, rules).run()


def body_profile(graph: HloGraph) -> dict[str, tuple[tuple[str, float, float, str, float],
                                                     ...]]:
    """The kernels of a ``custom_partitioning`` call's body, as ``Op.attrs[BODY_KERNELS]``
    holds them: per fusion rules (``cpu``, ``gpu``), ``(kind, FLOPs, bytes, dtype,
    transcendentals, size)`` of each kernel (``size``: ``Kernel.square_flops`` of a matmul,
    the bytes of any other kernel: what ``planner.op_cost`` reads rates at)."""
    return {rules: tuple((k.kind, k.flops, k.bytes, k.dtype, k.transcendentals,
                          k.bytes if k.kind == "vector" else k.square_flops)
                         for k in fusion_kernels(graph, rules)) for rules in ("cpu", "gpu")}


