"""Strategies of custom calls that carry a sharding rule, and of the ``get-tuple-element``
ops that read their tuple results (``hlo_passes/custom_calls.py`` reads the rules).

Every factor of the rule that may be split (``ShardingRule.splittable``) is one loop, as an
op's dimensions are for built-in ops (``strategies_rules``): the mesh axes given to it split
each operand and result dimension whose major factor it is, and a reduction factor leaves
the float results pending sums. A call with several results gets a tuple of specs, one
per result; the ``get-tuple-element`` reading element ``i`` mirrors its producer's choices
(operand spec: the whole tuple; result: its element ``i``), so a kernel's outputs keep the
split the kernel made. Compute: the call's FLOPs over the devices sharing them.

A custom call without a rule keeps its single replicated strategy (``strategies``), and
the plan's report lists it with its source line.

Example:
    >>> from rhino.hlo_passes.custom_calls import parse_sdy_rule
    >>> rule = parse_sdy_rule("#sdy.op_sharding_rule<([i, j], [j, k])->([i, k]) "
    ...                       "{i=8, j=16, k=4} reduction={j}, custom>")
    >>> [(l.name, l.outs, l.ins) for l in rule_loops(rule, (True,))]
    [('i', (0,), (0, None)), ('j', ('sum',), (1, 0)), ('k', (1,), (None, 1))]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from rhino.hlo_passes.custom_calls import ShardingRule, rule_for
from rhino.hlo_passes.graph import HloGraph, Op, TensorType, flatten_shape
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spec import ShardingSpec
from rhino.planner.strategies_rules import FLOAT_TYPES, SUM, Loop


@dataclasses.dataclass(frozen=True)
class CustomLoop:
    """One splittable factor of a custom call's rule.

    Attributes:
        name: the factor; size: its size (the axes given it must divide it).
        outs: per result, the dim it splits, ``"sum"`` (a pending sum) or None.
        ins: per operand, the dim it splits or None.
    """

    name: str
    size: int
    outs: tuple[Any, ...]
    ins: tuple[Any, ...]
    shares_work: bool = True

    def for_result(self, r: int) -> Loop:
        """The loop as ``strategies.spec_of`` reads it, for result ``r``."""
        return Loop(self.name, self.size, self.outs[r], self.ins, self.shares_work)


def rule_loops(rule: ShardingRule, float_results: Sequence[bool]) -> list[CustomLoop]:
    """The loops of a rule (module docstring); ``float_results``: per result, whether it
    can hold a pending sum."""
    loops = []
    for f in rule.splittable():
        ins = tuple(rule.dim_of(t, f) for t in rule.operands)
        outs = []
        for t, fl in zip(rule.results, float_results):
            d = rule.dim_of(t, f)
            outs.append(d if d is not None else SUM if f in rule.reduction and fl else None)
        if f in rule.reduction and not any(o == SUM for o in outs):
            continue      # a sum no result can hold pending
        loops.append(CustomLoop(f, int(rule.sizes[f]), tuple(outs), ins))
    return loops


def op_rule(graph: HloGraph, op: Op) -> ShardingRule | None:
    """The rule of custom call ``op`` (None: none, or an operand that is a tuple)."""
    if op.opcode != "custom-call":
        return None
    shapes = [graph.ops[o].shape for o in op.operands]
    if not all(isinstance(t, TensorType) for t in shapes):
        return None
    return rule_for(op.attrs, shapes, op.shape)


def _results(op: Op) -> list:
    return [op.shape] if isinstance(op.shape, TensorType) else list(flatten_shape(op.shape))


def custom_loops(graph: HloGraph, op: Op) -> list[CustomLoop] | None:
    """The loops of a custom call with a rule, or None."""
    rule = op_rule(graph, op)
    if rule is None:
        return None
    return rule_loops(rule, [isinstance(t, TensorType) and t.dtype in FLOAT_TYPES
                             for t in _results(op)])


def enumerate_custom(op: Op, loops: Sequence[CustomLoop], ranks: Sequence[int],
                     mesh: AbstractMesh, assignments: Callable, spec_of: Callable,
                     intern: dict) -> list[tuple[Any, tuple, int, dict]]:
    """``(out spec, in specs, devices sharing the work, assignment)`` of every way to give
    the mesh axes to ``loops`` (``strategies.assignments``); the out spec is a tuple for a
    call with a tuple result."""
    results = _results(op)
    per_result = [[lp.for_result(r) for lp in loops] for r in range(len(results))]
    out = []
    seen = set()
    for asg in assignments(per_result[0] if per_result else [], mesh, None):
        outs = tuple(spec_of(t.rank, -1, per_result[r], asg, intern)
                     for r, t in enumerate(results))
        ins = tuple(spec_of(rank, k, per_result[0], asg, intern) if per_result else
                    ShardingSpec.replicated(rank) for k, rank in enumerate(ranks))
        spec = outs[0] if isinstance(op.shape, TensorType) else outs
        if (spec, ins) in seen:
            continue
        seen.add((spec, ins))
        share = 1
        for li, (axes, _) in asg.items():
            share *= mesh.group_size(axes)
        out.append((spec, ins, share, asg))
    return out


def is_custom_tuple(graph: HloGraph, op: Op) -> bool:
    """Whether ``op`` is a ``get-tuple-element`` of a custom call that has a rule."""
    if op.opcode != "get-tuple-element" or len(op.operands) != 1:
        return False
    src = graph.ops[op.operands[0]]
    return src.opcode == "custom-call" and not isinstance(src.shape, TensorType) \
        and op_rule(graph, src) is not None


def check_custom(graph: HloGraph, op: Op, strategy: Any, mesh: AbstractMesh) -> str | None:
    """Why ``strategy`` is not legal for the custom call or ``get-tuple-element`` ``op``
    (None: legal), re-derived from the rule: on every mesh axis the roles of the results and
    operands are one factor's (or none), and an element read is its tuple's element."""
    if op.opcode == "get-tuple-element":
        src = strategy.in_specs[0] if strategy.in_specs else None
        i = int(op.attrs.get("index", -1))
        if not isinstance(src, tuple) or not 0 <= i < len(src) or src[i] != strategy.out_spec:
            return (f"expected element {i} of the tuple spec it reads, found "
                    f"{strategy.out_spec} from {src}")
        return None
    rule = op_rule(graph, op)
    if rule is None:
        return "no sharding rule"
    results = _results(op)
    outs = [strategy.out_spec] if isinstance(op.shape, TensorType) else list(strategy.out_spec)
    shapes_in = [graph.ops[o].shape for o in op.operands]
    roles_out = [s.axis_roles(t.dims, mesh) for s, t in zip(outs, results)]
    roles_in = [s.axis_roles(t.dims, mesh) for s, t in zip(strategy.in_specs, shapes_in)]
    loops = custom_loops(graph, op) or []
    for a in range(mesh.ndim):
        if mesh.shape[a] == 1:
            continue
        ro = [r[a] for r in roles_out]
        ri = [r[a] for r in roles_in]
        if all(x is None for x in ro + ri):
            continue
        if not any(_axis_matches(lp, ro, ri) for lp in loops):
            return (f"on mesh axis {mesh.axis_names[a]} the roles (results {ro}, operands "
                    f"{ri}) are no factor's of its rule ({rule.origin})")
    return None


def _axis_matches(lp: CustomLoop, ro: Sequence[Any], ri: Sequence[Any]) -> bool:
    def ok(want, got) -> bool:
        if want is None:
            return got is None
        if want == SUM:
            return got is not None and got[0] == "partial" and got[1] == "sum"
        return got is not None and got[0] == "dim" and got[1] == want
    return all(ok(w, g) for w, g in zip(lp.outs, ro)) and all(
        ok(w, g) for w, g in zip(lp.ins, ri))
