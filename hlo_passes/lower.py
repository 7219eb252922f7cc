"""Lowering: a ``Plan`` written into the program it was made for.

One pass for both kinds of plan, used by ``rhino.auto_parallel`` whatever runs the result::

    Plan + the step traced once (ScopedFunction), its HloGraph, its abstract arguments
      │ check_plan      the plan is for this program: every op, parameter and stage op it
      │                 names exists, with the same opcode / type (else PlanMismatchError)
      ▼
      ├── one stage ─── lower_spmd: every planned value constrained where its equation
      │                 produces it (a pending sum in its reduced form, or as its one
      │                 consumer needs it when that is a free slice); operands resharded
      │                 for their consumer constrained at the consumer; strided values kept
      │                 split (``strided.py``); argument and result shardings; donation of
      │                 the state the step updates. -> SpmdLowering (a jit-able function
      │                 with its shardings; ``compile_spmd`` compiles it and checks the
      │                 compiled shardings against the plan)
      └── stages ────── lower_stages: the plan's op stages and roles mapped onto the
                        step's equations; the same trace (whole batch) cut into per-stage
                        prologue and F/B/A programs, the microbatches a sharding of the
                        batch over time (``stage_programs.split_step``); each stage's specs
                        as PartitionSpecs on its programs' values. -> StageLowering

Nothing is dropped silently: a spec that cannot be written (strided where the executor
cannot hold it, a split a microbatch does not divide) or a planned value the program lacks
is a ``LoweringError`` / ``PlanMismatchError`` naming the value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from rhino.errors import BatchCouplingError, LoweringError, PlanMismatchError
from rhino.hlo_passes.annotate import EqnMap, ScopedFunction, eqn_path
from rhino.hlo_passes.backward_split import split_backward
from rhino.hlo_passes.graph import HloGraph, TensorType, shape_str
from rhino.hlo_passes.stage_programs import (FlatProgram, StageShardings, StageSplitError,
                                             StepSplit, assignment_from_ops, flatten,
                                             split_step)
from rhino.hlo_passes.pending import Producer, pending_axes
from rhino.hlo_passes.strided import StridedRealizer
from rhino.hlo_passes.unroll import trace
from rhino.jaxpr import primitives as prims
from rhino.jaxpr.keys import key_arguments
from rhino.jaxpr.microbatch import MicrobatchLayout
from rhino.jaxpr.pairs import batch_size_constants
from rhino.parallel_plan import Plan
from rhino.planner.build import carried_pairs
from rhino.planner.collectives import reshard
from rhino.planner.spec import ShardingSpec
from rhino.planner.spmd_plan import SpmdPlan
from rhino.vocabulary import PlanKind, Role, ScheduleKind


# ------------------------------------------------------------------------------ specs
def partition_spec(spec: ShardingSpec, axis_names: Sequence[str], what: str = "value"):
    """The ``PartitionSpec`` of a blocked spec (a pending sum is first reduced: callers
    pass ``spec.without_partial()`` where that is meant).

    Raises:
        LoweringError: a strided or partial spec, naming ``what``.

    Example:
        >>> tuple(partition_spec(ShardingSpec.parse("S[x]·R·S[y,z]"), ("x", "y", "z")))
        ('x', None, ('y', 'z'))
    """
    from jax.sharding import PartitionSpec

    if spec.is_partial:
        raise LoweringError(f"{what}: spec {spec.to_str()} is a pending reduction, which no "
                            f"device sharding expresses; expected a reduced spec")
    entries = []
    for d in spec.dims:
        if d.stride is not None:
            raise LoweringError(f"{what}: spec {spec.to_str()} is strided; a strided value "
                                f"is only held split inside an SPMD program "
                                f"(hlo_passes.strided), not as this value")
        names = tuple(axis_names[a] for a in d.axes)
        entries.append(None if not names else names[0] if len(names) == 1 else names)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def named_sharding(spec: ShardingSpec | None, jmesh: Any, names: Sequence[str],
                   what: str = "value"):
    """``NamedSharding`` of ``spec`` (None: replicated; a pending sum: its reduced form)."""
    from jax.sharding import NamedSharding, PartitionSpec

    if spec is None:
        return NamedSharding(jmesh, PartitionSpec())
    return NamedSharding(jmesh, partition_spec(spec.without_partial(), names, what))


def _describe(graph: HloGraph, op_id: int) -> str:
    op = graph.ops[op_id]
    where = op.arg.path if op.arg is not None else op.name
    return f"{where} ({shape_str(op.shape)}{', ' + op.source if op.source else ''})"


# ------------------------------------------------------------------------------ checks
def check_plan(plan: Plan, graph: HloGraph) -> None:
    """The plan must be for this program.

    One stage: its SPMD plan has this program's ops (same names and opcodes, in order) and
    parameters (same paths and types). Several stages: every op a stage names exists, and
    every stage has its SPMD plan.

    Raises:
        PlanMismatchError: naming the first value the program lacks or has otherwise.
    """
    if plan.num_stages == 1:
        _check_spmd(plan.spmd, graph)
        return
    names = {op.name for op in graph.ops}
    for st in plan.stages:
        if st.spmd is None:
            raise PlanMismatchError(f"plan: stage {st.index} has no SPMD plan (saved with "
                                    f"include_spmd=False); re-plan, or save with it")
        missing = [n for n in st.ops if n not in names]
        if missing:
            raise PlanMismatchError(
                f"plan: stage {st.index} runs op {missing[0]!r}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + f", which this program ({len(graph.ops)} ops) lacks: the plan was made for "
                  f"another program or other argument shapes; re-plan for this one")
        paths = {graph.ops[p].arg.path: shape_str(graph.ops[p].shape) for p in graph.params
                 if graph.ops[p].arg}
        lacking = [w for w in st.weights if w not in paths]
        if lacking:
            raise PlanMismatchError(f"plan: stage {st.index} reads weight {lacking[0]!r}, "
                                    f"which this program's arguments lack (they are e.g. "
                                    f"{sorted(paths)[:3]})")
        for p in st.spmd.params:
            have = paths.get(p.path)
            if have is not None and have != p.shape:
                raise PlanMismatchError(f"plan: stage {st.index} reads {p.path!r} as "
                                        f"{p.shape}, where this program has {have}: the plan "
                                        f"was made for other argument shapes; re-plan for "
                                        f"these")


def _check_spmd(plan: SpmdPlan, graph: HloGraph) -> None:
    if len(plan.ops) != len(graph.ops):
        raise PlanMismatchError(f"plan: made for a program of {len(plan.ops)} ops, this one "
                                f"has {len(graph.ops)}; re-plan for this function and these "
                                f"argument shapes")
    for p, op in zip(plan.ops, graph.ops):
        if p.name != op.name or p.opcode != op.opcode:
            raise PlanMismatchError(f"plan: names op {p.name!r} ({p.opcode}) where this "
                                    f"program has {op.name!r} ({op.opcode}); re-plan for this "
                                    f"function and these argument shapes")
    if len(plan.params) != len(graph.params):
        raise PlanMismatchError(f"plan: has {len(plan.params)} parameters, this program "
                                f"{len(graph.params)}")
    for p, q in zip(plan.params, graph.params):
        op = graph.ops[q]
        path = op.arg.path if op.arg is not None else op.name
        if p.path != path or p.shape != shape_str(op.shape):
            raise PlanMismatchError(f"plan: names parameter {p.path!r} {p.shape} where this "
                                    f"program has {path!r} {shape_str(op.shape)}; re-plan "
                                    f"for this function and these argument shapes")


# ------------------------------------------------------------------------------ SPMD
@dataclasses.dataclass(frozen=True)
class SpmdLowering:
    """A one-stage plan written into the step.

    Attributes:
        function: the step with the plan's constraints (jit-able; ``jax.jit(function,
            in_shardings=..., out_shardings=..., donate_argnums=...)``).
        in_shardings / out_shardings: per flat argument / result.
        in_tree / out_tree: pytree structures.
        donate_argnums: the arguments donated (state the step updates and returns).
        constrained: values with a sharding constraint.
        mesh: the ``jax.sharding.Mesh``.
    """

    function: Any
    in_shardings: tuple
    out_shardings: tuple
    in_tree: Any
    out_tree: Any
    donate_argnums: tuple[int, ...]
    constrained: int
    mesh: Any

    def jit(self):
        return jax.jit(self.function,
                       in_shardings=jax.tree_util.tree_unflatten(self.in_tree,
                                                                 self.in_shardings),
                       out_shardings=jax.tree_util.tree_unflatten(self.out_tree,
                                                                  self.out_shardings),
                       donate_argnums=self.donate_argnums,
                       # every argument stays an argument of the executable (an argument
                       # the step never reads would otherwise be dropped from it, and the
                       # plan's shardings would no longer line up with the program's)
                       keep_unused=True)


def _value_constraints(graph: HloGraph, plan: SpmdPlan, emap: EqnMap
                       ) -> tuple[dict, dict]:
    """(equation output -> the spec it is constrained to, equation path -> how it makes a
    carried pending sum). A pending sum that some consumer takes pending is *carried*: it
    keeps its pending spec, held explicit (``hlo_passes.pending``); its producer is the
    equation whose op makes it from operands with none (a split contraction)."""
    need_of: dict[int, set] = {}
    for op, o in zip(graph.ops, plan.ops):
        for q, u in enumerate(op.operands):
            need_of.setdefault(u, set()).add(o.in_specs[q])
    constraints, producers = {}, {}
    for key, op_id in emap.producer.items():
        spec = plan.ops[op_id].out_spec
        if spec is None:
            continue  # tuples stay as they are
        if spec.is_partial:
            needs = need_of.get(op_id, set())
            axes = pending_axes(spec)
            if axes is not None and any(n is not None and n.is_partial for n in needs):
                constraints[key] = spec
                made = _producer(graph, plan, emap, key[0], op_id, axes)
                if made is not None:
                    producers[key[0]] = made
                continue
            # A pending sum no consumer takes pending has no sharding of its own:
            # constrain it to its reduced form (the partitioner reduces right there), or to
            # its one consumer's spec when that is a local slice of the reduced form (a
            # reduce-scatter where it exists).
            one = next(iter(needs)) if len(needs) == 1 else None
            reduced = spec.without_partial()
            sliced = one is not None and not one.is_partial and reshard(
                reduced, one, graph.ops[op_id].shape, plan.mesh, plan.cost).is_free
            spec = one if sliced else reduced
        constraints[key] = spec
    return constraints, producers


def _producer(graph: HloGraph, plan: SpmdPlan, emap: EqnMap, path: tuple[int, ...],
              op_id: int, axes: tuple[int, ...]) -> Producer | None:
    """How the equation at ``path`` makes its op's pending sum: the specs its inputs are
    read in, where the op reads none pending (else the sum passes through it). An input
    whose op the map does not know (made inside a call XLA rewrote) is taken to be the
    op's operand in the same position, where that operand is no other input's: the
    producers' ops take their operands in the equation's order (a wrong guess only
    moves the operand, as ``shard_map`` reads it in that layout)."""
    op_id = _sum_maker(graph, plan, path, op_id)
    if op_id is None:
        return None
    op, o = graph.ops[op_id], plan.ops[op_id]
    inputs = emap.inputs.get(path, [])
    specs = []
    for j, h in enumerate(inputs):
        if h in op.operands:
            specs.append(o.in_specs[op.operands.index(h)])
        elif h is None and j < len(op.operands) and op.operands[j] not in inputs:
            specs.append(o.in_specs[j])
        else:
            specs.append(None)
    return Producer(frozenset(axes), tuple(specs))


def _sum_maker(graph: HloGraph, plan: SpmdPlan, path: tuple[int, ...], op_id: int
               ) -> int | None:
    """The op of the equation at ``path`` that makes the pending sum ``op_id`` holds: the
    op itself where it reads no pending sum made by another op (a whole value it reads
    pending, such as a scatter's zero table, is held so), else the one op of the same
    equation the sum comes from (a fill-mode ``gather`` lowers to a gather, then a select
    of it or the fill value); None where the sum comes from another equation or from
    several ops."""
    makers, seen, todo = set(), set(), [op_id]
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        sources = [u for q, u in enumerate(graph.ops[i].operands)
                   if (s := plan.ops[i].in_specs[q]) is not None and s.is_partial
                   and (made := plan.ops[u].out_spec) is not None and made.is_partial]
        if not sources:
            makers.add(i)
        for u in sources:
            if eqn_path(graph.ops[u].op_name) != path:
                return None
            todo.append(u)
    return next(iter(makers)) if len(makers) == 1 else None


def _pending_readers(graph: HloGraph, plan: SpmdPlan, emap: EqnMap) -> dict:
    """Equation path -> (the pending axes its main op reads its operands over, its inputs'
    specs as produced, whether it reads each input pending: True, False, or None where
    an op inside the equation reads it), for the equations whose main op reads an
    operand pending: the operands pending over fewer axes, and the whole values it adds
    to a pending sum, are held over those axes in their own layout
    (``PendingOps.extend``)."""
    out = {}
    for path, ids in emap.inputs.items():
        main = emap.producer.get((path, 0))
        if main is None:
            continue
        wanted = [s for s in plan.ops[main].in_specs if s is not None and s.is_partial]
        axes = pending_axes(wanted[0]) if wanted else None
        if axes is None:
            continue
        op, o = graph.ops[main], plan.ops[main]
        takes = [None if h not in op.operands else
                 o.in_specs[op.operands.index(h)] is not None
                 and o.in_specs[op.operands.index(h)].is_partial for h in ids]
        out[path] = (axes, [None if h is None else plan.ops[h].out_spec for h in ids], takes)
    return out


def _operand_constraints(graph: HloGraph, plan: SpmdPlan, emap: EqnMap) -> dict:
    """Equation input -> the spec its consumer needs, where that differs from how the
    value is produced (the consumer is whichever op of the equation reads it)."""
    members: dict[tuple[int, ...], list[int]] = {}
    for op in graph.ops:
        if op.opcode != "parameter":
            members.setdefault(eqn_path(op.op_name), []).append(op.id)
    out = {}
    for path, ids in emap.inputs.items():
        main = emap.producer.get((path, 0))
        if main is None:
            continue
        inside = members.get(path, [main])
        for j, h in enumerate(ids):
            if h is None:
                continue
            needs = {plan.ops[m].in_specs[q] for m in inside
                     for q, x in enumerate(graph.ops[m].operands) if x == h}
            if len(needs) != 1 and h in graph.ops[main].operands:
                needs = {plan.ops[main].in_specs[graph.ops[main].operands.index(h)]}
            if len(needs) != 1:
                continue  # read in several layouts inside the equation: XLA chooses
            need = next(iter(needs))
            if need is None or need.is_partial or need == plan.ops[h].out_spec:
                continue
            out[(path, j)] = need
    return out


def _donated_args(graph: HloGraph, abstract: tuple) -> tuple[int, ...]:
    """Arguments every leaf of which is updated and returned (carried)."""
    carried = {p for _, p in carried_pairs(graph)}
    picked, pos = [], 0
    for k, arg in enumerate(abstract):
        n = len(jax.tree_util.tree_leaves(arg))
        ids = graph.params[pos:pos + n]
        if n and all(i in carried for i in ids):
            picked.append(k)
        pos += n
    return tuple(picked)


def lower_spmd(traced: ScopedFunction, graph: HloGraph, plan: SpmdPlan, devices: Sequence,
               abstract: tuple, donate: bool) -> SpmdLowering:
    """The step with ``plan`` written in (see the module docstring).

    Raises:
        PlanMismatchError: the plan is for another program.
        LoweringError: a parameter or result spec no device sharding expresses.
    """
    from rhino.runtime.executors.spmd import device_mesh

    _check_spmd(plan, graph)
    names = plan.mesh.axis_names
    jmesh = device_mesh(plan.mesh.shape, names, devices)
    emap = EqnMap(traced, graph)
    constraints, producers = _value_constraints(graph, plan, emap)
    hooks = StridedRealizer(jmesh, names).hooks(constraints,
                                               _operand_constraints(graph, plan, emap),
                                               producers, _pending_readers(graph, plan, emap))
    in_flat = tuple(named_sharding(plan.params[i].spec, jmesh, names, _describe(graph, q))
                    for i, q in enumerate(graph.params))
    carried = dict(carried_pairs(graph))
    out_flat = tuple(named_sharding(plan.ops[carried.get(o, o)].out_spec, jmesh, names,
                                    f"result {info.path}")
                     for o, info in zip(graph.outputs, graph.output_info))
    return SpmdLowering(traced.with_hook(*hooks), in_flat, out_flat,
                        jax.tree_util.tree_structure(abstract), traced.out_tree,
                        _donated_args(graph, abstract) if donate else (), len(constraints),
                        jmesh)


def compile_spmd(lowered: SpmdLowering, graph: HloGraph, abstract: tuple) -> Any:
    """Compile with XLA's SPMD partitioner and check the compiled argument and result
    shardings against the plan (``ShardingMismatchError`` before anything runs)."""
    from rhino.runtime.executors.spmd import check_shardings

    compiled = lowered.jit().lower(*abstract).compile()
    got_in = jax.tree_util.tree_leaves(compiled.input_shardings[0])
    got_out = jax.tree_util.tree_leaves(compiled.output_shardings)
    ndim_in = [len(x.shape) for x in jax.tree_util.tree_leaves(abstract)]
    check_shardings("argument", got_in, lowered.in_shardings, ndim_in,
                    [graph.ops[p].arg.path for p in graph.params])
    ndim_out = [len(graph.ops[o].shape.dims) if isinstance(graph.ops[o].shape, TensorType)
                else 0 for o in graph.outputs]
    check_shardings("result", got_out, lowered.out_shardings, ndim_out,
                    [i.path for i in graph.output_info])
    return compiled


# ------------------------------------------------------------------------------ stages
@dataclasses.dataclass(frozen=True)
class StageLowering:
    """A several-stage plan written into the step.

    Attributes:
        split: the per-stage programs (``StepSplit``), made from the step traced at the
            whole batch.
        abstract: the step's arguments (whole batch).
        assignment: equation path -> (role, stage) (plain data: a Ray actor re-splits the
            step from it).
        batch_refs: flat argument indices of the batch leaves; key_refs: of PRNG keys.
        shardings: per stage its ``StageShardings``.
        per_microbatch_statistics: as the split was made.
    """

    split: StepSplit
    abstract: tuple
    assignment: dict
    batch_refs: tuple[int, ...]
    shardings: tuple[StageShardings, ...]
    key_refs: tuple[int, ...] = ()
    per_microbatch_statistics: bool = False


def batch_leaves(traced: ScopedFunction, graph: HloGraph, abstract: tuple,
                 batch_params: Sequence[int], m: int) -> tuple[int, ...]:
    """The batch leaves' flat indices (PRNG keys left out), each checked to have a leading
    dimension ``m`` divides.

    Raises:
        LoweringError: a batch leaf ``m`` does not divide, named by its path.
    """
    keys = key_args(traced)
    leaves = jax.tree_util.tree_leaves(abstract)
    paths = {graph.ops[q].arg.index: graph.ops[q].arg.path for q in graph.params}
    refs = tuple(sorted(graph.ops[q].arg.index for q in batch_params
                        if graph.ops[q].arg.index not in keys))
    for k in refs:
        shape = tuple(np.shape(leaves[k]))
        if not shape or shape[0] % m:
            raise LoweringError(f"batch argument {paths.get(k, k)}: expected a leading "
                                f"dimension divisible by num_microbatches={m}, found shape "
                                f"{shape}; if it is no batch, name the batch arguments "
                                f"(batch_args=...)")
    return refs


def lower_stages(traced: ScopedFunction, graph: HloGraph, plan: Plan, abstract: tuple,
                 roles: Sequence[str], batch_params: Sequence[int],
                 per_microbatch_statistics: bool = False) -> StageLowering:
    """The step cut into the plan's stage programs (see the module docstring).

    Args:
        traced: the step traced at the whole-batch ``abstract`` arguments (what was
            planned); graph: its HloGraph; roles: the role of every op (``pipeline.coarsen``).
        batch_params: the graph's batch parameter ops (the gradient boundary's).
        per_microbatch_statistics: accept statistics of the whole batch computed per
            microbatch (``rhino.jaxpr.microbatch``) instead of refusing the step.

    Raises:
        PlanMismatchError: the plan is for another program.
        BatchCouplingError: the gradients depend on a value of the whole batch at once
            (named, with the source line), unless ``per_microbatch_statistics``.
        LoweringError: a spec a microbatch cannot hold.
    """
    check_plan(plan, graph)
    m = plan.num_microbatches
    assignment = assignment_from_ops(traced, graph, _stage_of(plan, graph), roles)
    batch_refs = batch_leaves(traced, graph, abstract, batch_params, m)
    keys = tuple(sorted(key_args(traced)))
    split = _checked_split(traced, abstract, assignment, batch_refs, plan.num_stages, m,
                           keys, per_microbatch_statistics)
    if ScheduleKind(plan.schedule).splits_backward:
        split = split_backward(split)
    flat = split.flat
    emap = EqnMap(traced, graph)
    shardings = tuple(_stage_shardings(st.spmd, st.index, graph, emap, flat, split)
                      for st in plan.stages)
    return StageLowering(split, abstract, assignment, batch_refs, shardings, keys,
                         per_microbatch_statistics)


def _checked_split(traced: ScopedFunction, abstract: tuple, assignment: Any,
                   batch_refs: Sequence[int], num_stages: int, m: int, keys: Sequence[int],
                   per_microbatch_statistics: bool) -> StepSplit:
    """The step flattened and cut (``split_step``), its couplings refused (and, under
    ``per_microbatch_statistics``, its pairs' batch-size constants): what both the
    lowering and the planner's microbatch divisors start from.

    Raises:
        LoweringError: the step cannot be cut; BatchCouplingError: as ``refuse_couplings``
            and ``refuse_pair_constants``.
    """
    flat = flatten(traced.closed, platform_branches=per_microbatch_statistics)
    try:
        split = split_step(flat, assignment, batch_refs, num_stages, m, key_refs=tuple(keys),
                           per_microbatch_statistics=per_microbatch_statistics)
    except StageSplitError as e:
        raise LoweringError(str(e)) from e
    refuse_couplings(split.layout, m, per_microbatch_statistics)
    if per_microbatch_statistics:
        refuse_pair_constants(traced, abstract, split, batch_refs)
    return split


def refuse_pair_constants(traced: ScopedFunction, abstract: tuple, split: StepSplit,
                          batch_refs: Sequence[int]) -> None:
    """Under ``per_microbatch_statistics``, with values over pairs of the batch
    (``rhino.jaxpr.pairs``): trace the step again at one microbatch's size and refuse it,
    naming the line, where a constant the pairs meet differs (``batch_size_constants``):
    the microbatch's block of pairs would be scaled for the whole batch's, silently.

    Raises:
        BatchCouplingError: such a constant.
    """
    lay = split.layout
    if not any(x.pair is not None for x in lay.layout.values()):
        return
    m = split.num_microbatches
    leaves, tree = jax.tree_util.tree_flatten(abstract)
    batch = set(batch_refs)
    small = [jax.ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype) if k in batch
             else x for k, x in enumerate(leaves)]
    micro = flatten(trace(traced.fn, *jax.tree_util.tree_unflatten(tree, small)),
                    platform_branches=True)
    late = {i for i, r in enumerate(split.role) if r in (Role.BACKWARD, Role.APPLY)}
    found = batch_size_constants(split.flat, micro, lay, late)
    if found:
        fe, why = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise BatchCouplingError(
            f"per_microbatch_statistics: {why}: {prims.name(fe.eqn)} at "
            f"{split.flat.source(fe) or 'an unknown line'}{more}. Compute the pairs' "
            f"scale from a value that does not depend on the batch's size, or run the step "
            f"as one SPMD stage (mesh_shape=..., or stages=1)")


def refuse_couplings(layout: MicrobatchLayout, m: int,
                     per_microbatch_statistics: bool = False) -> None:
    """``BatchCouplingError`` naming the first value the gradients need of the whole batch.

    Raises:
        BatchCouplingError: where ``layout`` has a coupling.
    """
    found = layout.couplings
    if not found:
        return
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    first = found[0]
    if first.estimable:
        fix = ("Pass per_microbatch_statistics=True (rhino plan: "
               "--per-microbatch-statistics) to let each microbatch use its own "
               "statistics (as gradient accumulation does), or run the step as one SPMD "
               "stage (mesh_shape=..., or stages=1)")
    elif first.on_callback:
        fix = ("jax.jit runs a host callback once per step on the whole batch: compute its "
               "operands from the batch alone (each stage's prologue then runs it once per "
               "step on the whole batch), keep its results out of the gradients (it then runs "
               "once per step after the microbatches), or run the step as one SPMD stage "
               "(mesh_shape=..., or stages=1)")
    elif first.pairable and not per_microbatch_statistics:
        fix = ("It pairs examples of the batch with each other, which no microbatch can do "
               "on its own: pass per_microbatch_statistics=True to let each microbatch pair "
               "only its own examples (as running the step on that microbatch alone does), "
               "or run the step as one SPMD stage (mesh_shape=..., or stages=1)")
    elif not per_microbatch_statistics:
        fix = ("It pairs examples of the batch with each other, which no microbatch can do "
               "on its own (per_microbatch_statistics=True does not apply): run the step as "
               "one SPMD stage (mesh_shape=..., or stages=1)")
    else:
        fix = ("It pairs examples of the batch with each other in a way that "
               "per_microbatch_statistics=True does not cover (each microbatch pairs only "
               "its own examples, and no value over the pairs may address positions of the "
               "whole batch, be read whole, or be a mean over the whole batch's pairs): run "
               "the step as one SPMD stage (mesh_shape=..., or stages=1)")
    raise BatchCouplingError(
        f"the step's gradients depend on statistics of the whole batch, which {m} "
        f"microbatches cannot compute one by one: {first.describe()}{more}. {fix}")


def microbatch_divisors(traced: ScopedFunction, graph: HloGraph, abstract: tuple,
                        batch_params: Sequence[int], m: int, roles: Sequence[str],
                        per_microbatch_statistics: bool = False
                        ) -> dict[int, dict[int, int]]:
    """Op id -> {dim: m} for every planned value a microbatch cuts (its dimension along
    the batch, ``rhino.jaxpr.microbatch``): values the lowering constrains (equation
    results) and arguments. The pipeline planner then splits them only into shards a
    microbatch divides. ``roles``: every op's (``pipeline.coarsen``), as the stage programs
    will be made.

    Raises:
        LoweringError: a batch leaf ``m`` does not divide.
        BatchCouplingError: the gradients need a value of the whole batch (before any
            pipeline is searched).
    """
    refs = batch_leaves(traced, graph, abstract, batch_params, m)
    assignment = assignment_from_ops(traced, graph, [0] * len(graph.ops), roles)
    split = _checked_split(traced, abstract, assignment, refs, 1, m,
                           tuple(key_args(traced)), per_microbatch_statistics)
    flat = split.flat
    dims = split.layout.cut_dims()
    ref_of = {(fe.path, k): r for fe in flat.eqns for k, r in enumerate(fe.outs)
              if r is not None}
    out: dict[int, dict[int, int]] = {}
    for key, op in EqnMap(traced, graph).producer.items():
        r = ref_of.get(key)
        if r in dims:
            out[op] = {d: m for d in dims[r]}
    for q in graph.params:
        r = graph.ops[q].arg.index
        if r in dims:
            out[q] = {d: m for d in dims[r]}
    return out


def _stage_of(plan: Plan, graph: HloGraph) -> list[int]:
    """Per graph op its stage under ``plan`` (-1: none)."""
    if plan.kind is PlanKind.SPMD:
        return [0] * len(graph.ops)
    by_name = {op.name: op.id for op in graph.ops}
    stage_of = [-1] * len(graph.ops)
    for st in plan.stages:
        for nm in st.ops:
            stage_of[by_name[nm]] = st.index
    return stage_of


def key_args(traced: ScopedFunction) -> frozenset[int]:
    """Flat arguments that are PRNG keys (``rhino.jaxpr.keys``): a key dtype, or raw key
    data the step uses as a key, wherever it does. A key is the same for every microbatch,
    never split."""
    return key_arguments(traced.closed)


def _stage_shardings(plan: SpmdPlan, stage: int, graph: HloGraph, emap: EqnMap,
                     flat: FlatProgram, split: StepSplit) -> StageShardings:
    """A stage's SPMD plan as PartitionSpecs on the stage's programs (microbatch shapes)."""
    from jax.sharding import PartitionSpec

    names = plan.mesh.axis_names
    sizes = dict(zip(names, plan.mesh.shape))
    out_spec = {o.name: o.out_spec for o in plan.ops}
    ref_of = {(fe.path, k): r for fe in flat.eqns for k, r in enumerate(fe.outs)
              if r is not None}
    bad: list[str] = []

    def pspec(spec: ShardingSpec | None, ref: int, what: str):
        if spec is None:
            return None
        ps = partition_spec(spec.without_partial(), names, f"stage {stage}: {what}")
        shape = split.microbatch_shape(ref)
        for d, entry in enumerate(ps):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            n = int(np.prod([sizes[a] for a in axes])) if axes else 1
            if d >= len(shape) or shape[d] % n:
                bad.append(f"{what} {tuple(shape)} split {spec.to_str(plan.mesh)}")
                return None
        return ps

    mine = {i for (k, s), t in split.tasks.items() if s == stage for i in t.eqns}
    mine |= set(split.prologues[stage].eqns)
    paths = {flat.eqns[i].path for i in mine}
    values: dict = {}
    refs: dict[int, Any] = {}
    for (path, k), op in emap.producer.items():
        if path not in paths or (path, k) not in ref_of:
            continue
        ps = pspec(out_spec.get(graph.ops[op].name), ref_of[(path, k)],
                   _describe(graph, op))
        if ps is not None:
            values[(path, k)] = ps
            refs[ref_of[(path, k)]] = ps
    by_path = {graph.ops[q].arg.path: q for q in graph.params if graph.ops[q].arg}
    producer_of = {v: key for key, v in emap.producer.items()}
    op_id = {o.name: o.id for o in graph.ops}
    for p in plan.params:
        if p.path.startswith("cut:"):
            op = op_id.get(p.path[4:])
            if op is None:
                raise PlanMismatchError(f"stage {stage}: the plan receives value {p.path[4:]!r}"
                                        f" from another stage, which this program lacks")
            key = producer_of.get(op)
            if key is None or key not in ref_of:
                continue  # an op inside an equation: the stage receives the equation's result
            ref = ref_of[key]
        else:
            q = by_path.get(p.path)
            if q is None:
                raise PlanMismatchError(f"stage {stage}: the plan reads argument {p.path!r}, "
                                        f"which this program lacks (its arguments are e.g. "
                                        f"{sorted(by_path)[:3]})")
            ref = graph.ops[q].arg.index
        ps = pspec(p.spec, ref, p.path)
        if ps is not None:
            refs[ref] = ps
    # A step result that updates an argument this stage reads leaves its program in that
    # argument's sharding (as the SPMD path's out_shardings place it): the next step reads
    # it as it is instead of resharding it first.
    reads = set(split.stage_args(stage))
    leaving = {o.ref for o in split.outputs
               if o.source == "task" and o.producer is not None and o.producer[1] == stage}
    results: dict[int, Any] = {}
    for o, q in carried_pairs(graph):
        key, arg = producer_of.get(o), graph.ops[q].arg
        ref = ref_of.get(key) if key is not None else None
        if ref in leaving and arg is not None and arg.index in reads:
            want = refs.get(arg.index) or PartitionSpec()
            if want != (values.get(key) or PartitionSpec()):
                results[ref] = want
    if bad:
        raise LoweringError(f"stage {stage}: the plan splits dimensions that a microbatch does "
                            f"not divide ({'; '.join(bad[:3])}{'...' if len(bad) > 3 else ''}); "
                            f"use a batch divisible by num_microbatches × the stage's devices or "
                            f"fewer microbatches")
    return StageShardings(values, refs, results)
