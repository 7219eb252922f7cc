"""HloGraph + AbstractMesh + CostModel -> ShardingProblem: one node per op, one choice per
strategy.

Costs (seconds, priced by the ``CostModel``):

* unary, per node and choice: the strategy's compute cost (``op.flops`` over the devices
  sharing the work) plus its communication inside the op. A program output that is not
  fed back as a parameter (see *carry* below) must be materialised: a pending reduction
  left on it is charged here as the all-reduce that resolves it;
* edge ``u -> v``: the resharding cost (``collectives.reshard``) from ``u``'s output spec to
  the spec ``v`` needs for that operand, summed over every operand position reading ``u``;
* shared pending sums: a value that may be a pending sum (a partial spec) and is used in
  several places (operand positions, a carry, being a program output) is reduced **once**,
  as the executor and XLA do (``auto_parallel`` constrains it to its reduced form), and every
  reader that needs a reduced spec reshards from that reduced form (usually a free slice).
  Charging the reduction on every reader edge would price a layernorm-backward input with
  three readers as three all-reduces, and reject Megatron's row-parallel matmul for it. The
  reduction ``reshard(s, s.without_partial())`` goes into the producer's unary cost. When a
  reader can also take the pending sum as it is (partial pass-through), each partial choice
  of the producer gets a twin that *leaves the sum pending* (no reduction charged; the edge
  to any reader that needs a reduced spec is forbidden), so the decision stays pairwise and
  adds no node (see ``SharedValue``). A value used in one place keeps the plain edge
  ``reshard(s, t)`` (which may be one reduce-scatter);
* carry: a training step's updated parameters (and optimizer state) are outputs that become
  the next step's parameters. Each such output is paired with its parameter (by pytree path:
  ``out[0]['w']`` or ``out['w']`` with ``params['w']``, same type) and the pair gets the
  cost of resharding the output's spec back to the parameter's spec, so a plan cannot leave
  updated weights in a layout the next step does not read (``BuildOptions.carry_outputs``).

* combined scalar reductions: XLA's all-reduce combiner merges all-reduces that do not
  depend on each other into one (a global gradient norm's per-leaf sums of squares, one
  per parameter leaf, become one all-reduce of a tuple of scalars). A scalar that may be
  left a pending sum is therefore charged ``1/K`` of each collective's latency α, where
  ``K`` is the number of such scalars of its reducer at its *reduction depth* (the most
  such scalars on a path into it: scalars of equal depth never depend on each other, so
  XLA can combine all of them; ``combined_reductions``). A plan that leaves ``m`` of the
  ``K`` pending pays ``m/K`` of the one latency the combined all-reduce costs: never more
  than XLA runs, at most one α less. Charging every leaf a full α priced clipping by the
  global norm at one α per parameter leaf and turned a sharded plan replicated.

Memory per node and choice: for parameters, the local bytes times ``1 +
optimizer_state_multiplier``; 0 elsewhere. ``forced_sharded`` parameters lose their
replicated choices (the memory constraint of §4.4); ``pinned`` ops keep only the choices
with the given output spec (semi-automatic annotations).

The ``Partition`` for O2 comes from ``analyze(graph)``: node index == op id, so cones,
segments and the critical nodes (pivots) map directly.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> from rhino.planner.cost_model import CostModel
    >>> from rhino.planner.mesh import AbstractMesh
    >>> g = rhino.ingest(lambda x, w: jnp.tanh(x @ w), jnp.ones((8, 4)), jnp.ones((4, 4)))
    >>> built = build_problem(g, AbstractMesh((2,)), CostModel.simulated_cpu(1))
    >>> built.problem.num_nodes, [len(c) for c in built.problem.costs]
    (4, [3, 3, 4, 3])
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
import types
from typing import Any, Mapping, Sequence

import numpy as np

from rhino.errors import OptionsError, PlanningError
from rhino.hlo_passes.analyses import analyze
from rhino.hlo_passes.graph import HloGraph, TensorType, flatten_shape
from rhino.planner.collectives import ReshardCostTable
from rhino.planner.cost_model import CostModel
from rhino.planner.hierarchical import Partition
from rhino.planner.mesh import AbstractMesh
from rhino.planner.problem import Edge, ShardingProblem
from rhino.planner.spec import ShardingSpec
from rhino.planner.strategies import (Strategy, StrategyOptions, UnknownOp,
                                      generate_strategies)


# HLO opcodes whose values may be strided with ``strided_interior_only`` (elementwise ops,
# reshapes and copies: what ``runtime.strided`` runs on split arrays).
STRIDED_OPCODES = frozenset({
    "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "negate",
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sine",
    "cosine", "tan", "sqrt", "rsqrt", "cbrt", "power", "abs", "sign", "select", "convert",
    "compare", "and", "or", "not", "xor", "erf", "clamp", "floor", "ceil", "round-nearest-even",
    "round-nearest-afz", "is-finite", "atan2", "reshape", "bitcast", "copy",
})


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """How ``build_problem`` builds the problem.

    Attributes:
        strided: offer strided candidates found through reshapes (§4.3.3).
        partial_passthrough: let linear ops take and produce pending sums.
        forced_sharded: op ids of parameters whose replicated choices are removed.
        pinned: op id -> the only output spec allowed for that op.
        divisors: op id -> {dim: k}: a split of that dimension must also divide its size
            over k (a pipeline plans whole-batch shapes but runs microbatches: k = m on
            the batch dimension, so no stage plan splits what a microbatch cannot hold).
        optimizer_state_multiplier: extra per-parameter memory, as a multiple of its local
            bytes, for optimizer state the graph does not hold as parameters (0 when the
            step takes the optimizer state as arguments, as the zoo's steps do).
        carry_outputs: pair updated-parameter outputs with their parameters (see module).
        carried: explicit ``(output op id, parameter op id)`` pairs; None = by pytree path.
        max_strides_per_dim: cap on extra stride candidates per tensor dim.
        min_split_flops: ops of at least this many FLOPs lose the choices that compute
            them whole on every device (replicated work): a cost model where compute is
            nearly free prefers replicating everything, which real memory and real
            devices do not afford. None (default): no such restriction. Ops that cannot be
            split keep their choices.
        strided_interior_only: strided specs only for values of elementwise and reshape
            ops (``STRIDED_OPCODES``) that are neither parameters nor results: a
            ``jax.Array`` handed in or back cannot hold a strided layout (no tiled sharding
            expresses it), and ``runtime.strided`` keeps strided values split through
            elementwise and reshape equations. ``auto_parallel`` plans this way.
        uneven: also split dimensions their shard counts do not divide, padded as XLA
            pads them (``StrategyOptions.uneven``), for values that are neither
            parameters nor results: JAX refuses an uneven sharding at a ``jax.jit``
            boundary, so a step's arguments and results keep even specs (e.g. a 50257-row
            embedding arrives replicated or split by its columns and is split by rows
            inside).
    """

    strided: bool = True
    partial_passthrough: bool = True
    forced_sharded: frozenset[int] = frozenset()
    pinned: Mapping[int, ShardingSpec] = dataclasses.field(default_factory=dict)
    divisors: Mapping[int, Mapping[int, int]] = dataclasses.field(default_factory=dict)
    optimizer_state_multiplier: float = 0.0
    carry_outputs: bool = True
    carried: tuple[tuple[int, int], ...] | None = None
    max_strides_per_dim: int = 4
    strided_interior_only: bool = False
    min_split_flops: float | None = None
    uneven: bool = False

    def __post_init__(self):
        object.__setattr__(self, "forced_sharded", frozenset(self.forced_sharded))
        object.__setattr__(self, "pinned", types.MappingProxyType(dict(self.pinned)))
        object.__setattr__(self, "divisors", types.MappingProxyType(
            {int(k): types.MappingProxyType(dict(v)) for k, v in self.divisors.items()}))
        if self.min_split_flops is not None and not (
                isinstance(self.min_split_flops, (int, float)) and self.min_split_flops >= 0
                and self.min_split_flops != float("inf")):
            raise OptionsError(f"min_split_flops: expected a finite number of FLOPs >= 0 or "
                               f"None, found {self.min_split_flops!r}")
        if self.optimizer_state_multiplier < 0:
            raise ValueError(f"optimizer_state_multiplier: expected >= 0, found "
                             f"{self.optimizer_state_multiplier}")

    def strategy_options(self) -> StrategyOptions:
        return StrategyOptions(strided=self.strided, partial_passthrough=self.partial_passthrough,
                               max_strides_per_dim=self.max_strides_per_dim,
                               uneven=self.uneven)


@dataclasses.dataclass(frozen=True)
class CostBreakdown:
    """An assignment's objective split into compute and communication seconds."""

    compute: float
    communication: float

    @property
    def total(self) -> float:
        return self.compute + self.communication


@dataclasses.dataclass(frozen=True)
class SharedValue:
    """A value that may be a pending sum and is used in several places (reduced once).

    Attributes:
        op: the producer's op id.
        readers: ``(consumer op id, operand position)`` of every operand reading it.
        carried_to: the parameter op ids its carries go to.
        output: whether it is a program output that is not carried (needs its reduced form;
            its strategy's comm cost already charges the reduction).
        pending: the producer's choice indices that leave the sum pending (twins of its
            partial choices, offered only when some reader can take a pending sum).
        reduce_cost: per producer choice, the reduction charged once in its unary cost (0
            for non-partial and pending choices, and for a program output).
    """

    op: int
    readers: tuple[tuple[int, int], ...]
    carried_to: tuple[int, ...]
    output: bool
    pending: tuple[int, ...]
    reduce_cost: np.ndarray = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class BuiltProblem:
    """A ``ShardingProblem`` with what is needed to map its solutions back to the graph.

    Attributes:
        graph: the graph planned.
        mesh: the mesh planned for.
        cost: the cost model the problem's costs come from.
        options: the build options.
        problem: the problem; node ``i`` is op ``i``; choice ``j`` is ``strategies[i][j]``.
        strategies: per node, its strategies (after forcing/pinning; a shared value's
            pending twins repeat its partial strategies, see ``SharedValue``).
        partition: cones, segments and pivots for ``solve_o2``.
        unknown_ops: ops replicated for lack of a rule.
        carried: ``(output op id, parameter op id)`` pairs charged for carry resharding.
        unforceable: ``forced_sharded`` parameters that have no sharded spec (kept).
        seconds: wall time of the build.
        shared: the values whose pending sum is reduced once (see ``SharedValue``).
        alpha_share: op id -> the part of a collective's α its value's reductions are
            charged (``combined_reductions``; absent: 1).
    """

    graph: HloGraph
    mesh: AbstractMesh
    cost: CostModel
    options: BuildOptions
    problem: ShardingProblem
    strategies: tuple[tuple[Strategy, ...], ...]
    partition: Partition
    unknown_ops: tuple[UnknownOp, ...]
    carried: tuple[tuple[int, int], ...]
    unforceable: tuple[int, ...]
    seconds: float
    shared: tuple[SharedValue, ...] = ()
    alpha_share: Mapping[int, float] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def activation_bytes(self) -> list[np.ndarray]:
        """Per op, the local bytes of its value under each choice (0 for parameters, whose
        memory is ``problem.memory``); computed once."""
        return [np.zeros(len(strats)) if op.opcode == "parameter" else
                np.array([local_bytes(op.shape, s.out_spec, self.mesh) for s in strats],
                         dtype=float)
                for op, strats in zip(self.graph.ops, self.strategies)]

    def plan(self, choice: Sequence[int]) -> tuple[Strategy, ...]:
        """The chosen strategy of every op."""
        if len(choice) != len(self.strategies):
            raise ValueError(f"assignment has {len(choice)} entries, problem has "
                             f"{len(self.strategies)} nodes")
        return tuple(s[c] for s, c in zip(self.strategies, choice))

    def resolved(self, choice: Sequence[int]) -> frozenset[int]:
        """Op ids whose pending sum is reduced once under ``choice`` (then read reduced)."""
        out = set()
        for sv in self.shared:
            spec = self.strategies[sv.op][choice[sv.op]].out_spec
            if isinstance(spec, ShardingSpec) and spec.is_partial and (
                    choice[sv.op] not in sv.pending):
                out.add(sv.op)
        return frozenset(out)

    def breakdown(self, choice: Sequence[int]) -> CostBreakdown:
        """Compute vs communication seconds of an assignment (sums to the objective)."""
        compute = float(sum(s.compute_cost for s in self.plan(choice)))
        return CostBreakdown(compute, float(self.problem.objective(choice)) - compute)

    def stats(self) -> dict[str, float]:
        """Sizes: nodes, choices (total and max per node), edges and edge-matrix entries."""
        p = self.problem
        counts = [p.num_choices(i) for i in range(p.num_nodes)]
        return {"nodes": p.num_nodes, "choices": sum(counts), "max_choices": max(counts, default=0),
                "edges": len(p.edges), "edge_entries": sum(e.cost.size for e in p.edges),
                "unknown_ops": len(self.unknown_ops), "seconds": self.seconds}


# ------------------------------------------------------------------------------ carry pairs
_HEAD = re.compile(r"^([A-Za-z_]\w*)(.*)$")
_INDEX = re.compile(r"^\[(\d+)\](.*)$")
_NAME_KEY = re.compile(r"\['([A-Za-z_]\w*)'\]")


def _canonical(rest: str) -> str:
    """A pytree path with its string dict keys written as attributes: ``['w'].value`` as
    ``.w.value``. An object flattened by attribute (``model.blocks[0].kernel``, a Flax NNX
    module) and its state as a nested dict (``nnx.state(model)``: ``['blocks'][0]['kernel']``)
    then read the same."""
    return _NAME_KEY.sub(r".\1", rest)


def local_bytes(shape: Any, spec: Any, mesh: AbstractMesh) -> int:
    """Bytes per device of a value laid out as ``spec`` (a tuple value: its elements by a
    tuple of specs, else replicated)."""
    if isinstance(shape, TensorType) and isinstance(spec, ShardingSpec):
        return _padded(shape, spec, mesh).nbytes // spec.shard_count(mesh)
    leaves = flatten_shape(shape)
    if isinstance(spec, tuple) and len(spec) == len(leaves):
        return sum(local_bytes(t, s, mesh) for t, s in zip(leaves, spec))
    return sum(t.nbytes for t in leaves)


def carried_pairs(graph: HloGraph) -> tuple[tuple[int, int], ...]:
    """Pair each output with the parameter it updates, by pytree path and type.

    Three readings of an output ``out[k]<rest>``, the one that pairs more results for the
    whole output winning: the ``k``-th result updates the ``k``-th argument (``return
    params, opt_state, loss``); the output as a whole mirrors one argument (a bare list of
    updated weights: ``out<rest>`` matches ``<any argument><rest>``); or a result *subtree*
    of two or more leaves has exactly the leaves (paths and types) of one argument,
    wherever it sits in the output (``return loss, state``; ``return {"state": new_state,
    "loss": loss}``). A pair needs equal array types and a unique match. A dump (a file)
    has no pytree paths: its ``input_output_alias`` pairs them (``HloGraph.aliases``).

    Example:
        >>> import jax.numpy as jnp, rhino
        >>> g = rhino.ingest(lambda p, x: {"w": p["w"] - x.sum() * p["w"]},
        ...                  {"w": jnp.ones((4,))}, jnp.ones((3,)))
        >>> [(g.ops[o].opcode, g.ops[p].arg.path) for o, p in carried_pairs(g)]
        [('subtract', "p['w']")]
        >>> g = rhino.ingest(lambda p, x: (x.sum(), {"w": p["w"] * 2, "b": p["b"] + 1}),
        ...                  {"w": jnp.ones((4,)), "b": jnp.ones((2,))}, jnp.ones((3,)))
        >>> sorted((g.ops[o].opcode, g.ops[p].arg.path) for o, p in carried_pairs(g))
        [('add', "p['b']"), ('multiply', "p['w']")]
    """
    if graph.aliases:   # a dump: its results that reuse donated arguments' buffers
        return tuple((graph.outputs[k], graph.params[p]) for k, p in graph.aliases
                     if graph.ops[graph.outputs[k]].shape == graph.ops[graph.params[p]].shape
                     and graph.outputs[k] != graph.params[p])
    by_rest: dict[str, list[int]] = {}
    by_pos: dict[tuple[int, str], list[int]] = {}
    by_arg: dict[str, dict[str, int]] = {}
    # The k-th argument by the function's own order (an argument without leaves, such as
    # SGD's empty state, still counts), else by the order the parameters name them.
    positions: dict[str, int] = {n: k for k, n in enumerate(graph.arg_names)}
    for p in graph.params:
        arg = graph.ops[p].arg
        m = _HEAD.match(arg.path) if arg is not None else None
        if m is None:
            continue
        name, rest = m.groups()
        rest = _canonical(rest)
        pos = positions.setdefault(name, len(positions))
        by_rest.setdefault(rest, []).append(p)
        by_pos.setdefault((pos, rest), []).append(p)
        by_arg.setdefault(name, {})[rest] = p
    outs = [(o, _canonical(info.path[3:])) for o, info in zip(graph.outputs, graph.output_info)
            if info.path.startswith("out")]

    def positional(rest: str) -> list[int]:
        m = _INDEX.match(rest)
        return by_pos.get((int(m.group(1)), m.group(2)), []) if m is not None else []

    def fits(o: int, cands: list[int]) -> list[int]:
        return [p for p in cands if graph.ops[p].shape == graph.ops[o].shape]

    def pair_up(choose) -> list[tuple[int, int]]:
        pairs, used = [], set()
        for o, rest in outs:
            cands = [p for p in fits(o, choose(o, rest)) if p not in used]
            if len(cands) == 1 and cands[0] != o:
                pairs.append((o, cands[0]))
                used.add(cands[0])
        return pairs

    readings = [pair_up(lambda o, r: positional(r)),
                pair_up(lambda o, r: by_rest.get(r, [])),
                pair_up(_subtree_match(graph, outs, by_arg))]
    best = max(range(3), key=lambda k: (len(readings[k]), -k))
    if best == 0:   # the positional reading, completed by the whole-output one
        have = {o for o, _ in readings[0]}
        used = {p for _, p in readings[0]}
        extra = [(o, p) for o, p in readings[1] if o not in have and p not in used]
        return tuple(readings[0] + extra)
    return tuple(readings[best])


_COMPONENT = re.compile(r"\[[^\]]*\]|\.[A-Za-z_]\w*")


def _subtree_match(graph: HloGraph, outs: list[tuple[int, str]],
                   by_arg: Mapping[str, Mapping[str, int]]):
    """A chooser pairing the leaves of an output subtree with an argument whose leaves
    (paths below it and types) are exactly the subtree's."""
    parts = {o: _COMPONENT.findall(rest) for o, rest in outs}
    under: dict[str, dict[str, int]] = {}       # output prefix -> {rest below it: op}
    for o, rest in outs:
        comps = parts[o]
        for j in range(len(comps) + 1):
            under.setdefault("".join(comps[:j]), {})["".join(comps[j:])] = o
    owner: dict[int, int] = {}
    for prefix, leaves in under.items():
        if len(leaves) < 2:     # one array alike in shape is no evidence (a gradient)
            continue
        same = [args for args in by_arg.values() if set(leaves) == set(args) and all(
            graph.ops[leaves[r]].shape == graph.ops[args[r]].shape for r in leaves)]
        if len(same) == 1:             # several arguments alike: no reading by structure
            for r, o in leaves.items():
                owner.setdefault(o, same[0][r])
    return lambda o, rest: [owner[o]] if o in owner else []


# ------------------------------------------------------------------------------ building
def combined_reductions(graph: HloGraph, strategies: Sequence[Sequence[Strategy]]
                        ) -> dict[int, float]:
    """The α share of every scalar that may be a pending reduction and that XLA would
    reduce together with others (module docstring): ``{op id: 1/K}`` for groups of
    ``K >= 2`` scalars of one reducer at one reduction depth.

    Example:
        >>> import jax.numpy as jnp, rhino
        >>> from rhino.planner.cost_model import CostModel
        >>> from rhino.planner.mesh import AbstractMesh
        >>> from rhino.planner.strategies import generate_strategies
        >>> g = rhino.ingest(lambda a, b: jnp.sqrt(jnp.sum(a * a) + jnp.sum(b * b)),
        ...                  jnp.ones((8, 4)), jnp.ones((8,)))
        >>> ss = generate_strategies(g, AbstractMesh((2,)), CostModel.simulated_cpu(1))
        >>> sorted(combined_reductions(g, ss.strategies).values())
        [0.5, 0.5]
    """
    n = len(graph.ops)
    kind: list[frozenset | None] = [None] * n
    for op, strats in zip(graph.ops, strategies):
        if isinstance(op.shape, TensorType) and op.shape.rank == 0:
            reds = frozenset(r for s in strats if isinstance(s.out_spec, ShardingSpec)
                             for _, r in s.out_spec.partial)
            kind[op.id] = reds or None
    depth = [0] * n
    for op in graph.ops:
        depth[op.id] = max((depth[u] + (kind[u] is not None) for u in op.operands), default=0)
    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        if kind[i] is not None:
            groups.setdefault((depth[i], kind[i]), []).append(i)
    return {i: 1.0 / len(ids) for ids in groups.values() if len(ids) > 1 for i in ids}


def _shared_values(graph: HloGraph, strategies: list[tuple[Strategy, ...]],
                   carried: Sequence[tuple[int, int]], table: ReshardCostTable,
                   share: Mapping[int, float]) -> tuple[SharedValue, ...]:
    """Values that may be pending sums and are used in more than one place.

    Appends the pending twins of their partial strategies to ``strategies`` (in place)
    where some reader can take a pending sum.
    """
    readers: dict[int, list[tuple[int, int]]] = {}
    for op in graph.ops:
        for k, u in enumerate(op.operands):
            readers.setdefault(u, []).append((op.id, k))
    carry: dict[int, tuple[int, ...]] = {}
    for o, p in carried:
        if o != p:
            carry[o] = carry.get(o, ()) + (p,)
    outs = set(graph.outputs) - {o for o, _ in carried}
    shared = []
    for u, strats in enumerate(strategies):
        t = graph.ops[u].shape
        reads = tuple(readers.get(u, ()))
        uses = len(reads) + len(carry.get(u, ())) + (u in outs)
        if not reads or uses < 2 or not isinstance(t, TensorType):
            continue
        partial = [j for j, s in enumerate(strats) if s.out_spec.is_partial]
        if not partial:
            continue
        red = [table.cost(s.out_spec, s.out_spec.without_partial(), t, share.get(u, 1.0))
               if s.out_spec.is_partial and u not in outs else 0.0 for s in strats]
        pending: tuple[int, ...] = ()
        if u not in outs and any(
                isinstance(s.in_specs[k], ShardingSpec) and s.in_specs[k].is_partial
                for v, k in reads for s in strategies[v]):
            pending = tuple(range(len(strats), len(strats) + len(partial)))
            strategies[u] = strats + tuple(strats[j] for j in partial)
            red += [0.0] * len(partial)
        shared.append(SharedValue(u, reads, carry.get(u, ()), u in outs, pending,
                                  np.array(red)))
    return tuple(shared)


def _partition(graph: HloGraph) -> Partition:
    an = analyze(graph)
    cone_of = list(an.cone_of)
    segment_of = list(an.segment_of)
    pivots = []
    for c in an.critical:
        if cone_of[c] == c:
            pivots.append(c)
            continue
        # A critical node that is not a cone root (e.g. dot(x, x)) cannot pivot: merge the
        # segments on both sides of it.
        k = len(pivots)
        segment_of[c] = k
        for i, s in enumerate(segment_of):
            if s > k and i != c:
                segment_of[i] = s - 1
    return Partition(tuple(cone_of), tuple(segment_of), tuple(pivots))


def _restrict(graph: HloGraph, strategies: list[tuple[Strategy, ...]], mesh: AbstractMesh,
              options: BuildOptions) -> tuple[int, ...]:
    unforceable = []
    if options.uneven:   # first: JAX holds no uneven split at a jit boundary
        for i in dict.fromkeys((*graph.params, *graph.outputs)):
            t = graph.ops[i].shape
            if isinstance(t, TensorType):
                strategies[i] = tuple(s for s in strategies[i] if not (
                    isinstance(s.out_spec, ShardingSpec)
                    and s.out_spec.uneven_dims(t.dims, mesh)))
    for i in sorted(options.forced_sharded):
        if not 0 <= i < len(graph.ops) or graph.ops[i].opcode != "parameter":
            raise PlanningError(f"forced_sharded: expected parameter op ids, found op {i} "
                                f"({graph.ops[i].opcode if 0 <= i < len(graph.ops) else 'none'})")
        kept = tuple(s for s in strategies[i]
                     if not (isinstance(s.out_spec, ShardingSpec) and s.out_spec.is_replicated))
        if kept:
            strategies[i] = kept
        else:
            unforceable.append(i)
    for i, spec in options.pinned.items():
        if not 0 <= i < len(graph.ops):
            raise PlanningError(f"pinned: expected an op id in 0..{len(graph.ops) - 1}, found {i}")
        op = graph.ops[i]
        if not isinstance(op.shape, TensorType):
            raise PlanningError(f"pinned: op {op.name} has a tuple shape and stays replicated")
        want = spec.normalized(op.shape.dims, mesh)
        kept = tuple(s for s in strategies[i] if s.out_spec == want)
        if not kept:
            have = sorted({s.out_spec.to_str(mesh) for s in strategies[i]})
            why = "; ".join(spec.problems(op.shape.dims, mesh))
            raise PlanningError(f"pinned: op {op.name} ({op.opcode}, {op.source}) of shape "
                                f"{tuple(op.shape.dims)}: expected one of its output specs "
                                f"{have}, found {want.to_str(mesh)}"
                                + (f" ({why})" if why else ""))
        strategies[i] = kept
    for i, dims in options.divisors.items():
        kept = tuple(s for s in strategies[i] if _divides(s.out_spec, graph.ops[i].shape, dims,
                                                           mesh))
        if kept:
            strategies[i] = kept
    if options.min_split_flops is not None:
        for op in graph.ops:
            if op.flops < options.min_split_flops or not isinstance(op.shape, TensorType):
                continue
            whole = max(s.compute_cost for s in strategies[op.id])
            kept = tuple(s for s in strategies[op.id] if s.compute_cost < whole * (1 - 1e-9))
            if kept:
                strategies[op.id] = kept
    if options.strided_interior_only:
        boundary = set(graph.params) | set(graph.outputs)
        for op in graph.ops:
            if op.id not in boundary and op.opcode in STRIDED_OPCODES:
                continue
            kept = tuple(s for s in strategies[op.id] if not (
                isinstance(s.out_spec, ShardingSpec) and
                any(d.stride is not None for d in s.out_spec.dims)))
            if kept and len(kept) < len(strategies[op.id]):
                strategies[op.id] = kept
    return tuple(unforceable)


def _divides(spec: object, shape: object, dims: Mapping[int, int], mesh: AbstractMesh) -> bool:
    """Whether ``spec`` splits each dimension of ``dims`` into shards that divide its size
    over the dimension's divisor (tuples and unsplit dims always do)."""
    if not isinstance(spec, ShardingSpec) or not isinstance(shape, TensorType):
        return True
    for d, k in dims.items():
        if d < len(spec.dims) and spec.dims[d].axes:
            n = mesh.group_size(spec.dims[d].axes)
            if (shape.dims[d] // k) % n:
                return False
    return True


def _finish_outputs(graph: HloGraph, strategies: list[tuple[Strategy, ...]],
                    carried: Sequence[tuple[int, int]], table: ReshardCostTable,
                    share: Mapping[int, float]) -> None:
    carried_outs = {o for o, _ in carried}
    for o in dict.fromkeys(graph.outputs):
        if o in carried_outs:
            continue
        t = graph.ops[o].shape
        new = []
        for s in strategies[o]:
            if isinstance(s.out_spec, ShardingSpec) and s.out_spec.is_partial:
                extra = table.cost(s.out_spec, s.out_spec.without_partial(), t,
                                   share.get(o, 1.0))
                s = dataclasses.replace(s, comm_cost=s.comm_cost + extra)
            new.append(s)
        strategies[o] = tuple(new)


class _EdgeBuilder:
    def __init__(self, table: ReshardCostTable):
        self.table = table
        self._small: dict[tuple, np.ndarray] = {}

    def matrix(self, src: Sequence, dst: Sequence, tensor, share: float = 1.0) -> np.ndarray:
        usrc: dict = {}
        udst: dict = {}
        si = np.fromiter((usrc.setdefault(s, len(usrc)) for s in src), dtype=np.intp)
        di = np.fromiter((udst.setdefault(d, len(udst)) for d in dst), dtype=np.intp)
        key = (tuple(usrc), tuple(udst), tensor, share)
        small = self._small.get(key)
        if small is None:
            cost = self.table.cost
            small = np.array([[cost(a, b, tensor, share) for b in udst] for a in usrc],
                             dtype=float)
            self._small[key] = small
        return small[np.ix_(si, di)]


def build_problem(graph: HloGraph, mesh: AbstractMesh, cost: CostModel,
                  options: BuildOptions = BuildOptions()) -> BuiltProblem:
    """Build the sharding problem of ``graph`` on ``mesh`` (see the module docstring).

    Args:
        graph: the ingested graph.
        mesh: the abstract mesh.
        cost: its cost model.
        options: build options.

    Returns:
        The ``BuiltProblem``: the ``ShardingProblem`` plus strategies, partition, unknown
        ops and carry pairs.

    Raises:
        PlanningError: a bad ``forced_sharded`` / ``pinned`` entry.
        OptionsError: the cost model is for another number of mesh axes.
    """
    t0 = time.perf_counter()
    sset = generate_strategies(graph, mesh, cost, options.strategy_options())
    strategies = list(sset.strategies)
    unforceable = _restrict(graph, strategies, mesh, options)
    table = ReshardCostTable(mesh, cost)
    if not options.carry_outputs:
        carried: tuple[tuple[int, int], ...] = ()
    elif options.carried is not None:
        carried = tuple((int(o), int(p)) for o, p in options.carried)
        for o, p in carried:
            if graph.ops[p].opcode != "parameter" or graph.ops[o].shape != graph.ops[p].shape:
                raise PlanningError(f"carried: expected (output, parameter) of one type, found "
                                    f"({graph.ops[o].name}: {graph.ops[o].shape}, "
                                    f"{graph.ops[p].name}: {graph.ops[p].shape})")
    else:
        carried = carried_pairs(graph)
    share = combined_reductions(graph, strategies)
    _finish_outputs(graph, strategies, carried, table, share)

    shared = _shared_values(graph, strategies, carried, table, share)
    by_op = {sv.op: sv for sv in shared}
    costs = [np.array([s.cost for s in strats], dtype=float) for strats in strategies]
    for sv in shared:
        costs[sv.op] = costs[sv.op] + sv.reduce_cost

    eb = _EdgeBuilder(table)
    mats: dict[tuple[int, int], np.ndarray] = {}

    def add(u: int, v: int, m: np.ndarray) -> None:
        key = (u, v)
        mats[key] = mats[key] + m if key in mats else m

    def read(u: int, dst: Sequence) -> np.ndarray:
        """reshard cost of ``u``'s value, per (choice of u, spec in ``dst``)."""
        specs = [s.out_spec for s in strategies[u]]
        sv, f = by_op.get(u), share.get(u, 1.0)
        if sv is None:
            return eb.matrix(specs, dst, graph.ops[u].shape, f)
        pend = np.array([isinstance(t, ShardingSpec) and t.is_partial for t in dst])
        reduced = [x.without_partial() if isinstance(x, ShardingSpec) and x.is_partial
                   and j not in sv.pending else x for j, x in enumerate(specs)]
        m = eb.matrix(reduced, dst, graph.ops[u].shape, f)  # reduced readers: reduced form
        if pend.any():  # a reader taking the pending sum reads it as it is
            m = np.where(pend[None, :], eb.matrix(specs, dst, graph.ops[u].shape, f), m)
        if sv.pending:
            m = m.copy()
            m[np.ix_(list(sv.pending), np.flatnonzero(~pend))] = np.inf
        return m

    for op in graph.ops:
        for k, u in enumerate(op.operands):
            add(u, op.id, read(u, [s.in_specs[k] for s in strategies[op.id]]))
    for o, p in carried:
        if o == p:
            continue
        # cost[j_o, i_p] = reshard(output spec j_o -> parameter spec i_p)
        m = read(o, [s.out_spec for s in strategies[p]])
        if p < o:
            add(p, o, m.T)
        else:
            add(o, p, m)
    edges = tuple(Edge(u, v, m) for (u, v), m in mats.items())

    mult = 1.0 + options.optimizer_state_multiplier
    memory = []
    for op, strats in zip(graph.ops, strategies):
        if op.opcode == "parameter":
            memory.append(np.array([mult * _local_bytes(op.shape, s.out_spec, mesh)
                                    for s in strats], dtype=float))
        else:
            memory.append(np.zeros(len(strats)))
    labels = []
    seen_labels: dict[int, tuple[str, ...]] = {}   # repeated layers share strategy tuples
    for i, strats in enumerate(strategies):
        if i not in by_op and id(strats) in seen_labels:
            labels.append(seen_labels[id(strats)])
            continue
        pend = set(by_op[i].pending) if i in by_op else ()
        labels.append(tuple(_choice_label(s, mesh) + (" (left pending)" if j in pend else "")
                            for j, s in enumerate(strats)))
        if i not in by_op:
            seen_labels[id(strats)] = labels[-1]
    problem = ShardingProblem(tuple(op.name for op in graph.ops), tuple(labels), tuple(costs),
                              edges, tuple(memory))
    partition = _partition(graph)
    return BuiltProblem(graph, mesh, cost, options, problem, tuple(strategies), partition,
                        sset.unknown_ops, carried, unforceable, time.perf_counter() - t0,
                        shared, types.MappingProxyType(share))


def _local_bytes(shape, spec, mesh: AbstractMesh) -> float:
    if isinstance(spec, ShardingSpec) and isinstance(shape, TensorType):
        return _padded(shape, spec, mesh).nbytes / spec.shard_count(mesh)
    return float(local_bytes(shape, spec, mesh))


def _padded(shape: TensorType, spec: ShardingSpec, mesh: AbstractMesh) -> TensorType:
    """``shape`` with the dims ``spec`` splits unevenly padded to whole shards."""
    if spec.uneven_dims(shape.dims, mesh):
        return TensorType(shape.dtype, spec.padded_shape(shape.dims, mesh))
    return shape


def _choice_label(s: Strategy, mesh: AbstractMesh) -> str:
    out = (s.out_spec.to_str(mesh) if isinstance(s.out_spec, ShardingSpec)
           else "(" + ", ".join(x.to_str(mesh) for x in s.out_spec) + ")")
    return f"{s.label} -> {out}"
