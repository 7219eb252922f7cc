"""What each op of a graph costs in seconds under a cost model (the planner's compute cost).

``OpTimes(graph, cost)`` prices each op for the planner. With the cost model's roofline
(``rhino.planner.roofline``) the graph's ops are grouped into kernels the way XLA fuses
them (``rhino.hlo_passes.fusion``) and a kernel takes ``max(FLOPs / achievable FLOP/s,
bytes / bandwidth) + launch``: a matmul at its dtype's peak times the efficiency of its
size (a convolution by its own curve where the roofline has one), a fused attention call (cuDNN's flash attention) at the attention efficiency with the
bytes of its operands and results (no scores in memory), a ``custom_partitioning`` call as
the kernels of its body (``hlo_passes.ingest`` records them), any other kernel at the
vector FLOP/s (and its transcendental elements at their rate). A fused kernel's time is
shared among its ops (by their FLOPs and bytes) and its launch charged to its root.
``seconds(i, share)``: op ``i`` split over ``share`` devices (a matmul's efficiency read at
its share's size; launches not divided). Without a roofline an op costs ``op.flops / rate
of its dtype`` (``CostModel.flops_for``).

Example:
    >>> import jax.numpy as jnp, rhino
    >>> from rhino.planner.roofline import Roofline
    >>> g = rhino.ingest(lambda x: jnp.tanh(x * 2.0 + 1.0), jnp.ones((1024, 256)))
    >>> cost = CostModel((0.0,), (0.0,), 1e12, roofline=Roofline(1e9, 1e12, launch_s=1e-6))
    >>> round(OpTimes(g, cost).total() * 1e3, 4)              # 2 MiB at 1 GB/s + 1 launch
    2.0982
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from rhino.hlo_passes.fusion import BODY_KERNELS, MATMULS, Kernel, fusion_kernels
from rhino.hlo_passes.graph import HloGraph, flatten_shape
from rhino.planner.cost_model import CostModel, compute_dtype


def _bytes(shape) -> int:
    return sum(t.nbytes for t in flatten_shape(shape))


def kernel_seconds(kind: str, flops: float, nbytes: float, dtype: str, cost: CostModel,
                   transcendentals: float = 0.0, size: float | None = None,
                   best: bool = False) -> float:
    """Roofline seconds of one kernel's work (no launch) under ``cost``'s roofline; without
    one, its FLOPs at the dtype's rate. A matmul (``matmul``, or ``conv`` for a
    convolution) runs at its dtype's peak times the efficiency of its ``size`` (the FLOPs
    of the square matmul it runs like, ``hlo_passes.fusion.matmul_square_flops``; default
    its FLOPs); a vector kernel's compute is its FLOPs at the vector rate plus its
    transcendental elements at theirs (where the roofline has one), and its ``size`` the
    bytes of the whole kernel (its bandwidth is that size's; ``nbytes`` may be a part of
    it). ``best``: at the best efficiency and bandwidth of any size (a lower bound)."""
    peak = cost.flops_for(dtype)
    roof = cost.roofline
    if roof is None or kind == "control":
        return flops / peak
    if best:
        bw = roof.best_bandwidth()
    else:
        bw = roof.bandwidth_for(nbytes if size is None or kind in ("matmul", "conv")
                                else size)
    memory = nbytes / bw
    if best and kind in ("matmul", "conv"):
        key = f"conv:{dtype}" if kind == "conv" else dtype
        table = dict(roof.matmul_efficiency)
        curve = table.get(key) or table.get(dtype) or table.get("*")
        eff = max(e for _, e in curve) if curve else 1.0
        return max(flops / (peak * eff), memory)
    if kind in ("matmul", "conv"):
        key = f"conv:{dtype}" if kind == "conv" else dtype
        eff = roof.matmul_efficiency_for(key, flops if size is None else size,
                                         fallback=dtype)
        return max(flops / (peak * eff), memory)
    if kind == "attention":
        return max(flops / (peak * roof.attention_efficiency), memory)
    compute = flops / roof.vector_flops_per_s
    if transcendentals and roof.transcendentals_per_s is not None:
        compute += transcendentals / roof.transcendentals_per_s
    return max(compute, memory)


# One op's price: pieces, each ("flops", FLOPs, 0, dtype) (no roofline) or (kind, FLOPs,
# bytes, dtype, transcendentals, size) evaluated at the op's share (``kernel_seconds``),
# and the kernels launched for it.
Piece = tuple


@dataclasses.dataclass(frozen=True)
class OpCost:
    """What one op costs: ``pieces`` of work (divided among the devices sharing it) and
    ``launches`` kernels (not divided)."""

    pieces: tuple[Piece, ...]
    launches: float


_FREE = OpCost((), 0.0)


class OpTimes:
    """Seconds of every op of a graph under a cost model (module docstring).

    Attributes:
        graph, cost: what it prices.
        kernels: the fusion model's kernels (empty without a roofline).
        op_costs: per op, its ``OpCost``.
    """

    def __init__(self, graph: HloGraph, cost: CostModel):
        self.graph, self.cost = graph, cost
        self.kernels: list[Kernel] = []
        if cost.roofline is None:
            self.op_costs = [OpCost(((("flops", op.flops, 0.0, compute_dtype(graph, op)),)
                                     if op.flops else ()), 0.0) for op in graph.ops]
            return
        rules = cost.roofline.fusion
        self.kernels = fusion_kernels(graph, rules)
        pieces: list[list[Piece]] = [[] for _ in graph.ops]
        launches = [0.0] * len(graph.ops)
        for k in self.kernels:
            launches[k.root] += 1.0
            if k.kind in ("matmul", "conv", "attention", "control"):
                pieces[k.root].append((k.kind, k.flops, k.bytes, k.dtype, 0.0,
                                       k.square_flops))
            elif k.kind == "body":
                body = graph.ops[k.root].attrs[BODY_KERNELS][rules]
                pieces[k.root].extend(tuple(b) for b in body)
                launches[k.root] += len(body) - 1
            else:
                self._share(k, pieces)
        self.op_costs = [OpCost(tuple(p), n) if p or n else _FREE
                         for p, n in zip(pieces, launches)]

    def _share(self, k: Kernel, pieces: list[list[Piece]]) -> None:
        """A fused kernel's work shared among its members by their FLOPs and result bytes
        (each member's piece a fraction of the kernel's FLOPs, bytes and transcendentals,
        priced at the kernel's bandwidth: the pieces sum to the kernel's time)."""
        roof = self.cost.roofline
        ops = self.graph.ops
        bw = roof.bandwidth_for(k.bytes)
        w = [ops[m].flops / roof.vector_flops_per_s + _bytes(ops[m].shape) / bw
             for m in k.members]
        total = sum(w)
        for m, wm in zip(k.members, w):
            f = wm / total if total > 0 else 1.0 / len(k.members)
            if f > 0 and (k.flops or k.bytes):
                pieces[m].append((k.kind, k.flops * f, k.bytes * f, k.dtype,
                                  k.transcendentals * f, k.bytes))

    def seconds(self, i: int, share: float = 1.0) -> float:
        """Seconds of op ``i`` with its work split over ``share`` devices."""
        c = self.op_costs[i]
        return piece_seconds(c.pieces, share, self.cost) + \
            c.launches * (self.cost.roofline.launch_s if self.cost.roofline else 0.0)

    def key(self, i: int) -> tuple:
        """A hashable summary of what op ``i`` costs (equal keys, equal seconds)."""
        c = self.op_costs[i]
        return (c.pieces, c.launches)

    def total(self, ops: Sequence[int] | None = None, share: float = 1.0) -> float:
        """Seconds of ``ops`` (default: all) on one device, each split ``share`` ways."""
        idx = range(len(self.graph.ops)) if ops is None else ops
        return float(sum(self.seconds(i, share) for i in idx))

    def floor(self, ops: Sequence[int] | None = None) -> float:
        """Seconds below which ``ops`` (default: all) cannot run on one device however
        they are split: their work at the best matmul efficiency and bandwidth of any size,
        no launches (divided by ``n`` devices: a bound for ``n``)."""
        idx = range(len(self.graph.ops)) if ops is None else ops
        total = 0.0
        for i in idx:
            for p in self.op_costs[i].pieces:
                if p[0] == "flops":
                    total += p[1] / self.cost.flops_for(p[3])
                else:
                    total += kernel_seconds(p[0], p[1], p[2], p[3], self.cost, p[4],
                                            best=True)
        return total

    def launch_seconds(self, ops: Sequence[int] | None = None) -> float:
        """Launch seconds charged to ``ops`` (default: all)."""
        if self.cost.roofline is None:
            return 0.0
        idx = range(len(self.graph.ops)) if ops is None else ops
        return self.cost.roofline.launch_s * float(sum(self.op_costs[i].launches for i in idx))


def piece_seconds(pieces: Sequence[Piece], share: float, cost: CostModel) -> float:
    """Seconds of an op's ``pieces`` split over ``share`` devices: a matmul's efficiency is
    read at the FLOPs of its share."""
    s = max(share, 1.0)
    total = 0.0
    for p in pieces:
        if p[0] == "flops":
            total += p[1] / (cost.flops_for(p[3]) * s)
        else:
            total += kernel_seconds(p[0], p[1] / s, p[2] / s, p[3], cost, p[4] / s,
                                    p[5] / s)
    return total


def model_flops(graph: HloGraph) -> float:
    """The step's model FLOPs: those of its matmuls (dots, convolutions, and the matmuls of
    library and fused-attention calls), the numerator of MFU."""
    return float(sum(op.flops for op in graph.ops
                     if op.opcode in MATMULS or op.opcode == "custom-call"))


def matmul_dtype(graph: HloGraph) -> str:
    """The dtype that most of ``graph``'s matmul FLOPs run in (``f32`` when none)."""
    by: dict[str, float] = {}
    for op in graph.ops:
        if op.opcode in MATMULS or op.opcode == "custom-call":
            dt = compute_dtype(graph, op)
            by[dt] = by.get(dt, 0.0) + op.flops
    return max(by, key=lambda k: by[k]) if by else "f32"
