"""Per-op sharding strategies: output spec, required operand specs, compute and comm cost.

For every op the loops of ``strategies_rules`` are composed recursively over the mesh axes
(§4): each mesh axis of size > 1 is given one loop or none, axes on one loop split its dims
together (outermost axis first), and every combination whose sizes divide is a strategy.
Compute cost = the op's seconds with its work split over the devices sharing it
(``op_cost.OpTimes.seconds``): ``op.flops / (FLOP/s × devices)`` at the cost model's FLOP/s
for the op's dtype (``cost_model.compute_dtype``), or with the cost model's roofline, the
op's share of its fused kernel's roofline time plus the launches charged to it.

Strides (§4.1, candidate generation of §4.3.3). Specs are blocked (maximum stride) by
default. Other strides enter only through reshapes: ``stride_hints`` starts from every
reshape where a blocked split of one side is a strided split of the other (e.g. a
head-parallel split of ``[B, S, 3, heads, hd]`` is the strided split ``S[x/s(H/n)]`` of the
fused ``[B, S, 3H]`` projection), then merges it comm-free with neighbours: the stride
spreads through every loop that links the dim (elementwise chains, transposes, broadcasts,
the dot producing the projection and its weight, the optimizer update) until nothing
changes. Only those ``(shard count, stride)`` pairs are offered as extra candidates, and
only on those dims; reshapes themselves map specs exactly (``spec.map_reshape``), so the
fused-QKV head-parallel plan needs no resharding at the reshape.

Custom calls with a sharding rule (declared, or built in for cuDNN attention) are split
by it (``custom_calls``), and the ``get-tuple-element`` ops reading their results mirror
them. Ops without a rule (other tuple-shaped ops and their elements, while, conditional,
custom calls without a rule, unknown opcodes) get the single replicated strategy and are
listed in ``unknown_ops`` with their source line.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> from rhino.planner.cost_model import CostModel
    >>> from rhino.planner.mesh import AbstractMesh
    >>> g = rhino.ingest(lambda x, w: x @ w, jnp.ones((8, 4)), jnp.ones((4, 4)))
    >>> ss = generate_strategies(g, AbstractMesh((2,)), CostModel.simulated_cpu(1))
    >>> sorted(s.label for s in ss.strategies[2])
    ['dot[R]', 'dot[k0@x]', 'dot[m0@x]', 'dot[n0@x]']
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterator, Sequence

from rhino.hlo_passes.graph import HloGraph, Op, TensorType, flatten_shape
from rhino.planner.cost_model import CostModel
from rhino.planner.custom_calls import custom_loops, enumerate_custom, is_custom_tuple
from rhino.planner.op_cost import OpTimes
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spec import (DimSharding, ShardingSpec, inner_sizes, map_linear_axis,
                                map_reshape, padding_factor)
from rhino.planner.strategies_rules import FLOAT_TYPES, SUM, Loop, op_loops

_REPL = DimSharding()


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run an op.

    Attributes:
        out_spec: the spec of the result (a tuple of replicated specs for tuple results).
        in_specs: the spec each operand must have (resharding is charged on edges).
        compute_cost: seconds of compute per device.
        comm_cost: seconds of communication inside the op (e.g. resolving a pending
            reduction of a program output).
        label: readable description, e.g. ``dot[m0@x,n0@y]``.
    """

    out_spec: object
    in_specs: tuple
    compute_cost: float
    comm_cost: float = 0.0
    label: str = ""

    @property
    def cost(self) -> float:
        return self.compute_cost + self.comm_cost

    def describe(self, mesh: AbstractMesh | None = None) -> str:
        """``label: in specs -> out spec``."""
        def s(x):
            return ("(" + ", ".join(y.to_str(mesh) for y in x) + ")" if isinstance(x, tuple)
                    else x.to_str(mesh))
        return f"{self.label}: {', '.join(s(x) for x in self.in_specs)} -> {s(self.out_spec)}"


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """Knobs of strategy generation.

    Attributes:
        strided: offer strided candidates found through reshapes (§4.3.3).
        partial_passthrough: let linear ops take and produce pending sums.
        max_strides_per_dim: cap on the extra strides per tensor dim and shard count.
        hint_sweeps: cap on the propagation sweeps of ``stride_hints``.
        uneven: also split loops their shard counts do not divide (blocked, padded by
            XLA; ``spec.py``), priced at the padded size; reshapes and custom calls stay
            even, and ``build_problem`` keeps such specs off arguments and results.
    """

    strided: bool = True
    partial_passthrough: bool = True
    max_strides_per_dim: int = 4
    hint_sweeps: int = 16
    uneven: bool = False


@dataclasses.dataclass(frozen=True)
class UnknownOp:
    """An op kept replicated for lack of a rule."""

    id: int
    name: str
    opcode: str
    source: str | None
    reason: str


@dataclasses.dataclass(frozen=True)
class StrategySet:
    """Strategies of every op of a graph.

    Attributes:
        strategies: per op id, its strategies (at least one).
        unknown_ops: ops replicated for lack of a rule.
        hints: per op id, per dim, the extra ``(shard count, stride)`` candidates.
    """

    strategies: tuple[tuple[Strategy, ...], ...]
    unknown_ops: tuple[UnknownOp, ...]
    hints: dict


# ------------------------------------------------------------------------------ helpers
def replicated_like(shape) -> object:
    """The replicated spec of a shape (a tuple of specs for tuple shapes)."""
    if isinstance(shape, TensorType):
        return ShardingSpec.replicated(shape.rank)
    return tuple(ShardingSpec.replicated(t.rank) for t in flatten_shape(shape))


def group_sizes(mesh: AbstractMesh) -> list[int]:
    """Distinct shard counts of non-empty groups of mesh axes (of size > 1)."""
    axes = [a for a in range(mesh.ndim) if mesh.shape[a] > 1]
    out = set()
    for r in range(1, len(axes) + 1):
        for g in itertools.combinations(axes, r):
            out.add(mesh.group_size(g))
    return sorted(out)


def _add_hint(hints: dict, graph: HloGraph, i: int, d: int, n: int, s: int, cap: int) -> bool:
    t = graph.ops[i].shape
    if not isinstance(t, TensorType) or s < 1:
        return False
    size = t.dims[d]
    if size % (n * s) or n * s == size:
        return False
    h = hints.setdefault(i, {}).setdefault(d, set())
    # The cap is per shard count, so that a 2-D mesh keeps every stride its one-axis
    # mesh of the same devices has (planner/fold.py).
    if (n, s) in h or sum(nn == n for nn, _ in h) >= cap:
        return False
    h.add((n, s))
    return True


def _reshape_pair(graph: HloGraph, op: Op) -> tuple[TensorType, TensorType] | None:
    if op.opcode not in ("reshape", "bitcast") or len(op.operands) != 1:
        return None
    x, y = graph.ops[op.operands[0]].shape, op.shape
    if not (isinstance(x, TensorType) and isinstance(y, TensorType)) or x.numel != y.numel:
        return None
    if op.opcode == "bitcast" and x.dims == y.dims:
        return None
    return x, y


def stride_hints(graph: HloGraph, mesh: AbstractMesh, loops_of: Sequence[list[Loop] | None],
                 options: StrategyOptions = StrategyOptions()) -> dict:
    """Strided candidates: ``{op id: {dim: {(shard count, stride)}}}`` (see module doc)."""
    hints: dict = {}
    if not options.strided:
        return hints
    cap = options.max_strides_per_dim
    sizes = group_sizes(mesh)
    reshapes = [(op, p) for op in graph.ops if (p := _reshape_pair(graph, op)) is not None]

    def through(src: TensorType, dst: TensorType, d: int, n: int, s: int):
        return map_linear_axis(inner_sizes(src.dims)[d] * s, n, dst.dims)

    hot = _compute_linked(graph, mesh, loops_of, reshapes)
    for op, (x, y) in reshapes:                       # seeds: blocked on one side
        for n in sizes:
            for src, dst, src_id, dst_id in ((x, y, op.operands[0], op.id),
                                             (y, x, op.id, op.operands[0])):
                for d, size in enumerate(src.dims):
                    if size % n == 0 and size > 1 and hot(src_id, d):
                        hit = through(src, dst, d, n, size // n)
                        if hit is not None:
                            _add_hint(hints, graph, dst_id, hit[0], n, hit[1], cap)
    if not hints:
        return hints
    for sweep in range(options.hint_sweeps):
        changed = False
        order = graph.ops if sweep % 2 == 0 else reversed(graph.ops)
        for op in order:
            pair = _reshape_pair(graph, op)
            if pair is not None:
                x, y = pair
                for src, dst, src_id, dst_id in ((x, y, op.operands[0], op.id),
                                                 (y, x, op.id, op.operands[0])):
                    for d, hs in list(hints.get(src_id, {}).items()):
                        for n, s in list(hs):
                            hit = through(src, dst, d, n, s)
                            if hit is not None:
                                changed |= _add_hint(hints, graph, dst_id, hit[0], n, hit[1],
                                                     cap)
                continue
            loops = loops_of[op.id]
            if not loops:
                continue
            for loop in loops:
                linked = _linked_dims(op, loop)
                if len(linked) < 2:
                    continue
                union = set()
                for i, d in linked:
                    union |= hints.get(i, {}).get(d, set())
                for n, s in union:
                    for i, d in linked:
                        changed |= _add_hint(hints, graph, i, d, n, s, cap)
        if not changed:
            break
    return hints


def _compute_linked(graph: HloGraph, mesh: AbstractMesh,
                    loops_of: Sequence[list[Loop] | None],
                    reshapes: Sequence[tuple[Op, tuple[TensorType, TensorType]]]):
    """A predicate ``hot(op id, dim)``: the dim is linked comm-free to a dot/conv loop.

    Tensor dims are joined when one loop splits both, or when a reshape maps a blocked
    split of one onto a blocked split of the other; a group is hot when it holds a dim a
    dot or convolution splits. Reshape seeds start only from hot dims (§4.3.3: strided
    candidates come from merging compute-intensive ops with their neighbours).
    """
    parent: dict[tuple[int, int], tuple[int, int]] = {}

    def find(x):
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:
            parent[x], x = root, parent[x]
        return root

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb

    heavy = []
    for op in graph.ops:
        loops = loops_of[op.id]
        for loop in loops or ():
            linked = _linked_dims(op, loop)
            for a, b in zip(linked, linked[1:]):
                union(a, b)
            if op.opcode in ("dot", "convolution") and linked:
                heavy.append(linked[0])
    sizes = group_sizes(mesh)
    for op, (x, y) in reshapes:
        inner = inner_sizes(x.dims)
        for d, size in enumerate(x.dims):
            for n in sizes:
                if size % n == 0 and size > 1:
                    hit = map_linear_axis(inner[d] * (size // n), n, y.dims)
                    if hit is not None and hit[1] * n == y.dims[hit[0]]:
                        union((op.operands[0], d), (op.id, hit[0]))
    hot_roots = {find(h) for h in heavy}

    def hot(i: int, d: int) -> bool:
        return find((i, d)) in hot_roots
    return hot


def _linked_dims(op: Op, loop: Loop) -> list[tuple[int, int]]:
    """(tensor-producing op id, dim) pairs a loop splits."""
    out = [(op.id, loop.out)] if isinstance(loop.out, int) else []
    out += [(op.operands[k], r) for k, r in enumerate(loop.ins) if isinstance(r, int)]
    return out


# ------------------------------------------------------------------------------ enumeration
Assignment = dict  # loop index -> (axes tuple, stride or None)


def assignments(loops: Sequence[Loop], mesh: AbstractMesh,
                stride_options: Callable[[int, int], list[int]] | None = None,
                uneven: bool = False) -> Iterator[Assignment]:
    """Every way to give each mesh axis (of size > 1) one loop or none (§4's recursion).

    Axes on one loop are kept in mesh order (outermost first) and must divide its size
    (``uneven``: or be one axis shorter than it, a padded split; such loops get no
    strides. One axis only: a dim split over two axes unevenly pads differently from its
    split over the outer one, so XLA cannot move between the two in place).
    ``stride_options(loop index, shard count)`` lists extra strides for a loop.
    """
    active = [a for a in range(mesh.ndim) if mesh.shape[a] > 1]
    for combo in itertools.product(range(-1, len(loops)), repeat=len(active)):
        per: dict[int, list[int]] = {}
        for a, li in zip(active, combo):
            if li >= 0:
                per.setdefault(li, []).append(a)
        ok = True
        for li, axes in per.items():
            size = loops[li].size
            n = mesh.group_size(axes)
            if size is not None and size % n and not (uneven and size > n and len(axes) == 1):
                ok = False
                break
        if not ok:
            continue
        base = {li: (tuple(axes), None) for li, axes in per.items()}
        yield base
        if stride_options is None:
            continue
        extra = []
        for li, axes in per.items():
            if loops[li].size is not None and not loops[li].size % mesh.group_size(axes):
                opts = stride_options(li, mesh.group_size(axes))
                if opts:
                    extra.append((li, [None] + list(opts)))
        if not extra:
            continue
        for pick in itertools.product(*(o for _, o in extra)):
            if all(p is None for p in pick):
                continue
            v = dict(base)
            for (li, _), s in zip(extra, pick):
                v[li] = (v[li][0], s)
            yield v


def spec_of(rank: int, which: int, loops: Sequence[Loop], assignment: Assignment,
            intern: dict | None = None, group_passthrough: bool = True) -> ShardingSpec:
    """The spec of the output (``which=-1``) or operand ``which`` under an assignment.

    ``intern`` (optional) maps a spec's key to one shared instance. A pending sum one loop
    leaves over several axes is reduced by one collective (``ShardingSpec.partial_groups``);
    a pass-through loop (size None: a linear op handing a pending sum on) keeps whatever
    grouping its operand has, so it is enumerated both grouped and, with
    ``group_passthrough=False``, apart.
    """
    dims = [_REPL] * rank
    partial = []
    groups = []
    for li, (axes, stride) in assignment.items():
        loop = loops[li]
        role = loop.out if which < 0 else loop.ins[which]
        if role is None:
            continue
        if isinstance(role, str):
            partial.extend((a, role) for a in axes)
            if len(axes) > 1 and (group_passthrough or loop.size is not None):
                groups.append(tuple(sorted(axes)))
        else:
            dims[role] = (axes, stride)
    partial.sort()
    groups.sort()
    key = (tuple(d if isinstance(d, tuple) else ((), None) for d in dims), tuple(partial),
           tuple(groups))
    if intern is not None:
        got = intern.get(key)
        if got is not None:
            return got
    spec = ShardingSpec.unchecked(
        tuple(DimSharding(*d) if isinstance(d, tuple) else d for d in dims), tuple(partial),
        tuple(groups))
    if intern is not None:
        intern[key] = spec
    return spec


def _groupings(loops: Sequence[Loop], assignment: Assignment) -> tuple[bool, ...]:
    """``spec_of``'s ``group_passthrough`` values to enumerate: both where a pass-through
    loop holds several axes (its operand's sum may be grouped or apart), else one."""
    if any(loops[li].size is None and len(axes) > 1 for li, (axes, _) in assignment.items()):
        return (True, False)
    return (True,)


def _label(opcode: str, loops: Sequence[Loop], assignment: Assignment,
           mesh: AbstractMesh) -> str:
    if not assignment:
        return f"{opcode}[R]"
    parts = []
    for li, (axes, stride) in sorted(assignment.items(), key=lambda kv: kv[1][0]):
        st = f"/s{stride}" if stride is not None else ""
        parts.append(f"{loops[li].name}{st}@{''.join(mesh.axis_names[a] for a in axes)}")
    return f"{opcode}[{','.join(parts)}]"


class _Generator:
    """Strategy generation for one graph, mesh and cost model."""

    def __init__(self, graph: HloGraph, mesh: AbstractMesh, cost: CostModel,
                 options: StrategyOptions):
        cost.check(mesh, "generate_strategies")
        self.graph, self.mesh, self.cost, self.options = graph, mesh, cost, options
        self.loops_of: list[list[Loop] | None] = []
        for op in graph.ops:
            loops = None if _reshape_pair(graph, op) is not None else op_loops(graph, op)
            if loops is not None and not options.partial_passthrough:
                loops = [l for l in loops if l.size is not None]
            self.loops_of.append(loops)
        self.hints = stride_hints(graph, mesh, self.loops_of, options)
        self.unknown: list[UnknownOp] = []
        self.intern: dict = {}
        self.enumerated: dict = {}
        self.group_sizes = group_sizes(mesh)
        self.times = OpTimes(graph, cost)

    def _seconds(self, op: Op, share: float = 1.0) -> float:
        """Seconds of ``op`` on one device with its work split ``share`` ways."""
        return self.times.seconds(op.id, share)

    def _hint_set(self, i: int, d: int) -> set:
        return self.hints.get(i, {}).get(d, set())

    def _stride_fn(self, op: Op, loops: Sequence[Loop]):
        if not self.hints:
            return None
        graph = self.graph

        def fn(li: int, n: int) -> list[int]:
            linked = _linked_dims(op, loops[li])
            cands = set()
            for i, d in linked:
                cands |= {s for nn, s in self._hint_set(i, d) if nn == n}
            good = []
            for s in sorted(cands):
                if all(graph.ops[i].shape.dims[d] % (n * s) == 0
                       and graph.ops[i].shape.dims[d] != n * s for i, d in linked):
                    good.append(s)
            return good
        return fn

    def replicated(self, op: Op, reason: str) -> tuple[Strategy, ...]:
        self.unknown.append(UnknownOp(op.id, op.name, op.opcode, op.source, reason))
        ins = tuple(replicated_like(self.graph.ops[o].shape) for o in op.operands)
        return (Strategy(replicated_like(op.shape), ins, self._seconds(op), 0.0,
                         f"{op.opcode}[R]"),)

    def for_op(self, op: Op, done: Sequence[tuple[Strategy, ...]] = ()) -> tuple[Strategy, ...]:
        """``op``'s strategies; ``done``: those of the ops before it (a tuple element
        mirrors its producer's)."""
        pair = _reshape_pair(self.graph, op)
        if pair is not None:
            return self._reshape(op, *pair)
        if op.opcode == "custom-call":
            custom = self._custom(op)
            if custom is not None:
                return custom
        if is_custom_tuple(self.graph, op) and op.operands[0] < len(done):
            return self._element(op, done[op.operands[0]])
        loops = self.loops_of[op.id]
        if loops is None:
            if op.opcode == "custom-call":
                target = op.attrs.get("custom_call_target", "?")
                return self.replicated(op, f"custom call {target!r} declares no sharding "
                                           f"rule rhino reads (kept whole on every device)")
            if not isinstance(op.shape, TensorType):
                return self.replicated(op, "tuple-shaped result")
            if any(not isinstance(self.graph.ops[o].shape, TensorType) for o in op.operands):
                return self.replicated(op, "tuple-shaped operand")
            return self.replicated(op, f"no sharding rule for {op.opcode!r}")
        return self._enumerate(op, loops)

    def _enumerate(self, op: Op, loops: Sequence[Loop]) -> tuple[Strategy, ...]:
        mesh, price = self.mesh, self.times.key(op.id)
        out_rank = op.shape.rank
        ranks = [self.graph.ops[o].shape.rank for o in op.operands]
        fn = self._stride_fn(op, loops)
        # The strategies are a function of the loops, ranks, the op's price and the strides
        # offered per (loop, shard count): a layer repeated 48 times is enumerated once.
        strides = () if fn is None else tuple(
            (li, n, tuple(fn(li, n))) for li, lp in enumerate(loops) if lp.size is not None
            for n in self.group_sizes)
        key = (op.opcode, price, out_rank, tuple(ranks), tuple(loops), strides)
        hit = self.enumerated.get(key)
        if hit is not None:
            return hit
        seen: dict[tuple, Strategy] = {}
        uneven = self.options.uneven
        for asg in assignments(loops, mesh, fn, uneven):
            padded = uneven and any(
                loops[li].size is not None and loops[li].size % mesh.group_size(axes)
                for li, (axes, _) in asg.items())
            for grouped in _groupings(loops, asg):
                out = spec_of(out_rank, -1, loops, asg, self.intern, grouped)
                ins = tuple(spec_of(r, k, loops, asg, self.intern, grouped)
                            for k, r in enumerate(ranks))
                pair = (out, ins)
                if pair in seen:
                    continue
                share = 1
                for li, (axes, _) in asg.items():
                    if loops[li].shares_work:
                        share *= mesh.group_size(axes)
                if padded:
                    share /= padding_factor(
                        op.opcode, (out, *ins),
                        (op.shape, *(self.graph.ops[o].shape for o in op.operands)), mesh)
                seen[pair] = Strategy(out, ins, self._seconds(op, share), 0.0,
                                      _label(op.opcode, loops, asg, mesh))
        if not seen:  # cannot happen: the empty assignment is always valid
            return self.replicated(op, "no valid assignment")
        self.enumerated[key] = tuple(seen.values())
        return self.enumerated[key]

    def _custom(self, op: Op) -> tuple[Strategy, ...] | None:
        """A custom call with a sharding rule (``custom_calls``), or None without one."""
        loops = custom_loops(self.graph, op)
        if loops is None:
            return None
        ranks = [self.graph.ops[o].shape.rank for o in op.operands]
        out = []
        for spec, ins, share, asg in enumerate_custom(op, loops, ranks, self.mesh,
                                                      assignments, spec_of, self.intern):
            out.append(Strategy(spec, ins, self._seconds(op, share), 0.0,
                                _label("custom-call", loops, asg, self.mesh)))
        return tuple(out)

    def _element(self, op: Op, src: Sequence[Strategy]) -> tuple[Strategy, ...]:
        """A ``get-tuple-element`` of a custom call: one choice per tuple spec it reads."""
        i = int(op.attrs["index"])
        specs = dict.fromkeys(s.out_spec for s in src)
        return tuple(Strategy(t[i], (t,), 0.0, 0.0, f"get-tuple-element[{i}]")
                     for t in specs)

    def _tensor_specs(self, t: TensorType, producer: int, partial: bool) -> list[ShardingSpec]:
        loops = [Loop(f"d{i}", s, i, ()) for i, s in enumerate(t.dims) if s > 1]
        if partial and self.options.partial_passthrough and t.dtype in FLOAT_TYPES:
            loops.append(Loop("psum", None, SUM, (), False))
        fn = None
        if self.hints:
            def fn(li: int, n: int) -> list[int]:
                lp = loops[li]
                return sorted(s for nn, s in self._hint_set(producer, lp.out) if nn == n)
        return [spec_of(t.rank, -1, loops, asg, self.intern, grouped)
                for asg in assignments(loops, self.mesh, fn) for grouped in _groupings(loops, asg)]

    def _reshape(self, op: Op, x: TensorType, y: TensorType) -> tuple[Strategy, ...]:
        mesh = self.mesh
        # A function of the two types, the op's price and the strides hinted on either
        # side (what ``_tensor_specs`` reads): the reshapes of repeated layers are done once.
        src, dst = op.operands[0], op.id
        key = ("reshape", op.opcode, self.times.key(op.id), x, y,
               tuple(tuple(sorted(self._hint_set(src, d))) for d in range(x.rank)),
               tuple(tuple(sorted(self._hint_set(dst, d))) for d in range(y.rank)))
        hit = self.enumerated.get(key)
        if hit is not None:
            return hit
        pairs: dict[tuple, None] = {}
        for s in self._tensor_specs(x, src, True):
            t = map_reshape(s, x.dims, y.dims, mesh)
            if t is not None:
                pairs[(t, s)] = None
        for t in self._tensor_specs(y, dst, True):
            s = map_reshape(t, y.dims, x.dims, mesh)
            if s is not None:
                pairs[(t, s)] = None
        out = []
        for t, s in pairs:
            if not self.options.strided and (_is_strided(t) or _is_strided(s)):
                continue
            share = t.shard_count(mesh)
            lab = "R" if t.is_replicated else t.to_str(mesh)
            out.append(Strategy(t, (s,), self._seconds(op, share), 0.0,
                                f"{op.opcode}[{lab}]"))
        self.enumerated[key] = tuple(out)
        return self.enumerated[key]


def _is_strided(spec: ShardingSpec) -> bool:
    return any(d.stride is not None for d in spec.dims)


def generate_strategies(graph: HloGraph, mesh: AbstractMesh, cost: CostModel,
                        options: StrategyOptions = StrategyOptions()) -> StrategySet:
    """Strategies of every op of ``graph`` on ``mesh`` (see the module docstring).

    Args:
        graph: the ingested graph.
        mesh: the abstract mesh.
        cost: its cost model (the compute costs' FLOP/s).
        options: generation knobs.

    Returns:
        A ``StrategySet``; ``strategies[i]`` belongs to op ``i``.

    Raises:
        OptionsError: the cost model is for another number of mesh axes.
    """
    gen = _Generator(graph, mesh, cost, options)
    done: list[tuple[Strategy, ...]] = []
    for op in graph.ops:
        done.append(gen.for_op(op, done))
    return StrategySet(tuple(done), tuple(gen.unknown), gen.hints)


def op_strategies(graph: HloGraph, op_id: int, mesh: AbstractMesh, cost: CostModel,
                  options: StrategyOptions = StrategyOptions()) -> tuple[Strategy, ...]:
    """Strategies of one op (hints are computed for the whole graph)."""
    return _Generator(graph, mesh, cost, options).for_op(graph.ops[op_id])
