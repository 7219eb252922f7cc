"""An independent validator of sharding plans.

Given a graph, a mesh, its cost model and one chosen ``Strategy`` per op, ``validate_plan``
re-derives
everything from the ops' semantics, with code separate from the strategy generator:

1. every spec fits its tensor (rank, axes, divisibility by shards and shards × stride);
2. every strategy is legal for its op: per mesh axis, the roles of the output and the
   operands (split dim and axis stride, pending reduction, or nothing) must form one of the
   op's dimension correspondences (derived here from the op's attributes), and reshapes are
   checked by brute force: every element must land on the same devices on both sides;
3. compute cost = the op's seconds over the devices sharing the work
   (``op_cost.OpTimes.seconds``: ``flops / (FLOP/s × devices)`` at the cost model's FLOP/s
   for the op's dtype, or its share of its kernel's roofline time), where an axis shares
   the work when it splits a dim of the output or of an operand (not a gather's table:
   each device then still looks up every index);
4. communication = the resharding (``collectives.reshard``) of every producer's output spec
   into each consumer's operand spec, of every carried output back to its parameter's spec,
   and the all-reduce resolving a pending reduction left on a program output. A pending sum
   used more than once (*shared*: several operands, a carry, being an output) is reduced
   once — the reduction is charged once and the uses that need a reduced spec reshard from
   the reduced form — as the executor and XLA run it; a shared pending sum some use needs
   reduced must be in ``resolved``, and only shared ones may be;
5. the total equals the solver's objective (relative tolerance 1e-9 by default).

It raises ``PlanValidationError`` naming the op (name, opcode, source line) and what is
inconsistent.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> from rhino.planner.cost_model import CostModel
    >>> from rhino.planner.mesh import AbstractMesh
    >>> from rhino.planner.build import build_problem
    >>> g = rhino.ingest(lambda x, w: x @ w, jnp.ones((8, 4)), jnp.ones((4, 4)))
    >>> built = build_problem(g, AbstractMesh((2,)), CostModel.simulated_cpu(1))
    >>> choice = (0,) * len(g.ops)
    >>> check = validate_plan(g, built.mesh, built.cost, built.plan(choice),
    ...                       objective=built.problem.objective(choice))
    >>> check.total == built.problem.objective(choice)
    True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection, Mapping, Sequence

import numpy as np

from rhino.errors import RhinoError
from rhino.hlo_passes.costs import ELEMENTWISE
from rhino.hlo_passes.graph import HloGraph, Op, TensorType, flatten_shape
from rhino.planner.collectives import reshard as _reshard
from rhino.planner.cost_model import CostModel
from rhino.planner.op_cost import OpTimes
from rhino.planner.custom_calls import check_custom, is_custom_tuple, op_rule
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spec import ShardingSpec, padding_factor

_FLOATS = ("f16", "bf16", "f32", "f64")
_KIND = {"add": "sum", "maximum": "max", "minimum": "min"}
_SAMPLE = 1 << 20


class PlanValidationError(RhinoError, ValueError):
    """A plan that is not consistent with the graph, the mesh or the claimed objective."""


@dataclasses.dataclass(frozen=True)
class PlanCheck:
    """What the validator recomputed.

    Attributes:
        compute: seconds of compute (sum over ops).
        communication: seconds of resharding, carries and output reductions.
        resharded_edges: number of (producer, consumer operand) pairs with a nonzero cost.
    """

    compute: float
    communication: float
    resharded_edges: int

    @property
    def total(self) -> float:
        return self.compute + self.communication


def _where(op: Op) -> str:
    return f"op #{op.id} {op.name} ({op.opcode}{', ' + op.source if op.source else ''})"


def _fail(op: Op, msg: str) -> PlanValidationError:
    return PlanValidationError(f"{_where(op)}: {msg}")


# ------------------------------------------------------------------ op semantics, per axis
@dataclasses.dataclass
class _Sem:
    """Dimension correspondences of an op.

    follow: output dim -> per operand the dim split with it (None: operand whole).
    creates: (reducer, per operand: dim split / "sum" partial / None) -> output partial.
    passes: per operand "sum" / None -> output partial sum.
    """

    follow: dict[int, tuple]
    creates: list[tuple[str, tuple]]
    passes: list[tuple]


def _linear_patterns(code: str, n: int) -> list[tuple]:
    table = {("add", 2): [("sum", "sum")], ("subtract", 2): [("sum", "sum")],
             ("negate", 1): [("sum",)], ("copy", 1): [("sum",)], ("convert", 1): [("sum",)],
             ("multiply", 2): [("sum", None), (None, "sum")], ("divide", 2): [("sum", None)],
             ("select", 3): [(None, "sum", "sum")]}
    return table.get((code, n), [])


def _zero(graph: HloGraph, i: int) -> bool:
    op = graph.ops[i]
    if op.opcode != "constant":
        return False
    try:
        return float(str(op.attrs.get("literal", "x")).strip("{} ")) == 0.0
    except ValueError:
        return False


def _semantics(graph: HloGraph, op: Op) -> _Sem | None:
    """The op's correspondences, or None when only the replicated strategy is legal."""
    out = op.shape
    ins = [graph.ops[o].shape for o in op.operands]
    if not isinstance(out, TensorType) or not all(isinstance(t, TensorType) for t in ins):
        return None
    code, a, n = op.opcode, op.attrs, len(ins)
    floaty = out.dtype in _FLOATS
    everything = range(out.rank)

    def same(dims, operands) -> dict:
        return {d: tuple(d if k in operands else None for k in range(n)) for d in dims}

    if code in ("parameter", "constant", "iota", "rng"):
        return _Sem({d: (None,) * n for d in everything}, [], [])
    if code == "dot":
        lb, rb = list(a.get("lhs_batch_dims", ())), list(a.get("rhs_batch_dims", ()))
        lc, rc = list(a.get("lhs_contracting_dims", ())), list(a.get("rhs_contracting_dims", ()))
        lfree = [d for d in range(ins[0].rank) if d not in lb + lc]
        rfree = [d for d in range(ins[1].rank) if d not in rb + rc]
        pairs = list(zip(lb, rb)) + [(d, None) for d in lfree] + [(None, d) for d in rfree]
        return _Sem(dict(enumerate(pairs)), [("sum", p) for p in zip(lc, rc)], [])
    if code == "convolution":
        spec = str(a.get("dim_labels", ""))
        lhs_l, _, rest = spec.partition("_")
        rhs_l, _, out_l = rest.partition("->")
        if sorted(out_l) != sorted(lhs_l) or len(out_l) != out.rank:
            return _Sem({}, [], [])
        fgc, bgc = int(a.get("feature_group_count", 1)), int(a.get("batch_group_count", 1))
        follow, creates = {}, []
        if bgc == 1:
            follow[out_l.index("b")] = (lhs_l.index("b"), None)
        if fgc == 1 and bgc == 1:
            follow[out_l.index("f")] = (None, rhs_l.index("o"))
            creates.append(("sum", (lhs_l.index("f"), rhs_l.index("i"))))
        return _Sem(follow, creates, [])
    if code in ELEMENTWISE or code == "copy" or (code == "bitcast" and ins[0].dims == out.dims):
        if any(t.rank not in (0, out.rank) or (t.rank and t.dims != out.dims) for t in ins):
            return None
        full = [k for k, t in enumerate(ins) if t.rank == out.rank]
        passes = []
        if floaty and (code != "convert" or ins[0].dtype in _FLOATS):
            passes = _linear_patterns(code, n)
        return _Sem(same(everything, full), [], passes)
    if code == "reduce" and "variadic" in a:
        k = a["variadic"][1]
        if n != 2 * k or any(t.dims != ins[0].dims for t in ins[:k]):
            return None
        red = sorted(a.get("dimensions", ()))
        kept = [d for d in range(ins[0].rank) if d not in red]
        return _Sem({j: (d,) * k + (None,) * k for j, d in enumerate(kept)}, [], [])
    if code == "reduce":
        if n != 2:
            return None
        red = sorted(a.get("dimensions", ()))
        kept = [d for d in range(ins[0].rank) if d not in red]
        kind = _KIND.get(str(a.get("reducer")))
        creates = [(kind, (d, None)) for d in red] if kind else []
        passes = [("sum", None)] if kind == "sum" and floaty and _zero(graph, op.operands[1]) \
            else []
        return _Sem({j: (d, None) for j, d in enumerate(kept)}, creates, passes)
    if code == "broadcast":
        where = {o: j for j, o in enumerate(a.get("dimensions", ()))}
        return _Sem({o: (where.get(o),) for o in everything}, [],
                    [("sum",)] if floaty else [])
    if code == "transpose":
        perm = a.get("dimensions", ())
        return _Sem({o: (perm[o],) for o in everything}, [], [("sum",)] if floaty else [])
    if code == "slice":
        keep = [d for d, t in enumerate(a.get("slice", ())) if t == (0, ins[0].dims[d], 1)]
        return _Sem(same(keep, (0,)), [], [("sum",)] if floaty else [])
    if code == "reverse":
        keep = [d for d in everything if d not in a.get("dimensions", ())]
        return _Sem(same(keep, (0,)), [], [("sum",)] if floaty else [])
    if code == "pad":
        keep = [d for d, p in enumerate(a.get("padding", ())) if tuple(p) == (0, 0, 0)]
        ok = floaty and _zero(graph, op.operands[1])
        return _Sem(same(keep, (0,)), [], [("sum", None)] if ok else [])
    if code == "concatenate":
        keep = [d for d in everything if d not in a.get("dimensions", ())]
        return _Sem(same(keep, range(n)), [], [("sum",) * n] if floaty else [])
    if code == "dynamic-slice":
        keep = [d for d in everything if out.dims[d] == ins[0].dims[d]]
        return _Sem(same(keep, (0,)), [], [])
    if code == "dynamic-update-slice":
        keep = [d for d in everything if ins[1].dims[d] == ins[0].dims[d]]
        return _Sem(same(keep, (0, 1)), [], [])
    if code == "sort":
        if n != 1:
            return None
        return _Sem(same([d for d in everything if d not in a.get("dimensions", ())], (0,)),
                    [], [])
    if code in ("reduce-window", "select-and-scatter"):
        w = a.get("window", {})

        def get(key, default):
            return tuple(w.get(key, (default,) * out.rank))
        keep = [d for d in everything if get("size", 1)[d] == 1 and get("stride", 1)[d] == 1
                and tuple(get("pad", (0, 0))[d]) == (0, 0) and get("lhs_dilate", 1)[d] == 1
                and get("rhs_dilate", 1)[d] == 1]
        return _Sem(same(keep, (0,) if code == "reduce-window" else (0, 1)), [], [])
    if code == "gather":
        return _gather_sem(ins, out, a)
    if code == "scatter":
        return _scatter_sem(ins, out, a) if n == 3 and a.get("reducer") == "add" else None
    return None


def _gather_sem(ins, out, a) -> _Sem:
    operand, idx = ins
    offset = list(a.get("offset_dims", ()))
    collapsed = list(a.get("collapsed_slice_dims", ()))
    obatch = list(a.get("operand_batching_dims", ()))
    ibatch = list(a.get("start_indices_batching_dims", ()))
    starts = list(a.get("start_index_map", ()))
    sizes = list(a.get("slice_sizes", ()))
    ivd = a.get("index_vector_dim", idx.rank)
    follow = {}
    batch_out = [d for d in range(out.rank) if d not in offset]
    for o, i in zip(batch_out, [d for d in range(idx.rank) if d != ivd]):
        follow[o] = (obatch[ibatch.index(i)] if i in ibatch else None, i)
    window = [d for d in range(operand.rank) if d not in collapsed + obatch]
    for o, d in zip(offset, window):
        if sizes[d] == operand.dims[d] and d not in starts:
            follow[o] = (d, None)
    creates = []
    if len(starts) == 1 and starts[0] in collapsed and sizes[starts[0]] == 1 \
            and out.dtype in _FLOATS:
        creates.append(("sum", (starts[0], None)))
    return _Sem(follow, creates, [])


def _scatter_sem(ins, out, a) -> _Sem:
    operand, idx, upd = ins
    uwd = list(a.get("update_window_dims", ()))
    inserted = list(a.get("inserted_window_dims", ()))
    obatch = list(a.get("input_batching_dims", ()))
    ibatch = list(a.get("scatter_indices_batching_dims", ()))
    s2o = list(a.get("scatter_dims_to_operand_dims", ()))
    ivd = a.get("index_vector_dim", idx.rank)
    follow, creates = {}, []
    upd_scatter = [d for d in range(upd.rank) if d not in uwd]
    for i, u in zip([d for d in range(idx.rank) if d != ivd], upd_scatter):
        if i in ibatch:
            od = obatch[ibatch.index(i)]
            follow[od] = (od, i, u)
        elif out.dtype in _FLOATS:
            creates.append(("sum", ("sum", i, u)))
    window = [d for d in range(operand.rank) if d not in inserted + obatch]
    for d, u in zip(window, uwd):
        if upd.dims[u] == operand.dims[d] and d not in s2o:
            follow[d] = (d, None, u)
    if len(s2o) == 1 and s2o[0] in inserted:
        follow[s2o[0]] = (s2o[0], None, None)
    return _Sem(follow, creates, [])


def _axis_ok(sem: _Sem, ro: Any, rins: Sequence[Any]) -> bool:
    """Whether one mesh axis' roles (output, operands) match a correspondence of ``sem``."""
    def dim_is(role, d, s):
        return role is not None and role[0] == "dim" and role[1] == d and role[2] == s

    if ro is None:
        return all(r is None for r in rins)
    if ro[0] == "dim":
        _, d, s = ro
        if d not in sem.follow:
            return False
        return all((r is None) if e is None else dim_is(r, e, s)
                   for e, r in zip(sem.follow[d], rins))
    reducer = ro[1]
    for red, pattern in sem.creates:
        if red != reducer:
            continue
        strides = {r[2] for e, r in zip(pattern, rins)
                   if isinstance(e, int) and r is not None and r[0] == "dim"}
        if len(strides) != 1:
            continue
        s = strides.pop()
        if all((r is None) if e is None else (r == ("partial", "sum")) if e == "sum"
               else dim_is(r, e, s) for e, r in zip(pattern, rins)):
            return True
    if reducer == "sum":
        for pattern in sem.passes:
            if all((r is None) if e is None else r == ("partial", "sum")
                   for e, r in zip(pattern, rins)):
                return True
    return False


def _owners(spec: ShardingSpec, dims: Sequence[int], mesh: AbstractMesh,
            lin: np.ndarray) -> list:
    """Per mesh axis, the coordinate of each row-major element ``lin`` (or the role)."""
    inner = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    out = []
    for a, role in enumerate(spec.axis_roles(dims, mesh)):
        if role is None:
            out.append(None)
        elif role[0] == "partial":
            out.append(role)
        else:
            _, d, s = role
            out.append(((lin // inner[d]) % dims[d] // s) % mesh.shape[a])
    return out


# _reshape_ok is a pure function of its arguments' values; a training step repeats its
# layers, so the same reshape is checked for every layer (2667 checks, 34 s of a 48-layer
# GPT's 85 s plan on an 8x8 mesh, before this cache).
_RESHAPE_CHECKED: dict = {}


def _reshape_ok(src: ShardingSpec, dst: ShardingSpec, x: TensorType, y: TensorType,
                mesh: AbstractMesh) -> str | None:
    key = (src, dst, tuple(x.dims), tuple(y.dims), tuple(mesh.shape), tuple(mesh.axis_names))
    if key not in _RESHAPE_CHECKED:
        if len(_RESHAPE_CHECKED) > 100_000:
            _RESHAPE_CHECKED.clear()
        _RESHAPE_CHECKED[key] = _reshape_check(src, dst, x, y, mesh)
    return _RESHAPE_CHECKED[key]


def _reshape_check(src: ShardingSpec, dst: ShardingSpec, x: TensorType, y: TensorType,
                   mesh: AbstractMesh) -> str | None:
    numel = x.numel
    if numel <= _SAMPLE:
        lin = np.arange(numel, dtype=np.int64)
    else:
        rng = np.random.default_rng(0)
        lin = np.concatenate([np.arange(4096), numel - 1 - np.arange(4096),
                              rng.integers(0, numel, _SAMPLE)]).astype(np.int64)
    for a, (o1, o2) in enumerate(zip(_owners(src, x.dims, mesh, lin),
                                     _owners(dst, y.dims, mesh, lin))):
        if mesh.shape[a] == 1:
            continue
        if isinstance(o1, np.ndarray) and isinstance(o2, np.ndarray):
            if not np.array_equal(o1, o2):
                bad = int(lin[np.argmax(o1 != o2)])
                return (f"element {bad} (row-major) is on coordinate {o1[np.argmax(o1 != o2)]} "
                        f"of axis {mesh.axis_names[a]} in the operand but "
                        f"{o2[np.argmax(o1 != o2)]} in the result")
        elif not (o1 is None and o2 is None) and not (isinstance(o1, tuple) and o1 == o2):
            return (f"axis {mesh.axis_names[a]} is {o1 if not isinstance(o1, np.ndarray) else 'a split'}"
                    f" on the operand but {o2 if not isinstance(o2, np.ndarray) else 'a split'}"
                    f" on the result")
    return None


# ------------------------------------------------------------------------------ checks
def _check_fit(op: Op, what: str, spec: Any, shape: Any, mesh: AbstractMesh,
               sharded: bool = False) -> None:
    """The spec fits; a tuple value's specs are replicated unless ``sharded`` (a custom
    call with a rule, and the elements read from it)."""
    if isinstance(shape, TensorType):
        if not isinstance(spec, ShardingSpec):
            raise _fail(op, f"{what}: expected a ShardingSpec for {shape}, found {spec!r}")
        problems = spec.problems(shape.dims, mesh, uneven=True)
        if problems:
            raise _fail(op, f"{what} {spec.to_str(mesh)} does not fit {shape}: "
                        + "; ".join(problems))
        return
    leaves = flatten_shape(shape)
    if not (isinstance(spec, tuple) and len(spec) == len(leaves)
            and all(isinstance(s, ShardingSpec) and s.rank == t.rank
                    and (sharded or s.is_replicated) for s, t in zip(spec, leaves))):
        raise _fail(op, f"{what}: expected {len(leaves)} "
                    f"{'' if sharded else 'replicated '}specs for tuple shape, found {spec!r}")
    for s, t in zip(spec, leaves):
        if s.problems(t.dims, mesh):   # tuple values (custom calls) split evenly only
            raise _fail(op, f"{what} {s.to_str(mesh)} does not fit {t}: "
                        + "; ".join(s.problems(t.dims, mesh)))


def check_strategy(graph: HloGraph, op: Op, strategy: Any, mesh: AbstractMesh) -> None:
    """Raise ``PlanValidationError`` unless ``strategy`` is legal for ``op``."""
    custom = op_rule(graph, op) is not None or is_custom_tuple(graph, op)
    _check_fit(op, "output spec", strategy.out_spec, op.shape, mesh, custom)
    if len(strategy.in_specs) != len(op.operands):
        raise _fail(op, f"expected {len(op.operands)} operand specs, found "
                    f"{len(strategy.in_specs)}")
    for k, (o, s) in enumerate(zip(op.operands, strategy.in_specs)):
        _check_fit(op, f"operand {k} spec", s, graph.ops[o].shape, mesh, custom)
    if custom:
        why = check_custom(graph, op, strategy, mesh)
        if why:
            raise _fail(op, f"{why} (strategy {strategy.describe(mesh)})")
        return
    x = graph.ops[op.operands[0]].shape if len(op.operands) == 1 else None
    if (op.opcode in ("reshape", "bitcast") and isinstance(x, TensorType)
            and isinstance(op.shape, TensorType) and x.dims != op.shape.dims):
        why = _reshape_ok(strategy.in_specs[0], strategy.out_spec, x, op.shape, mesh)
        if not why and strategy.out_spec.partial_groups != strategy.in_specs[0].partial_groups:
            why = (f"pending groups {strategy.in_specs[0].partial_groups} become "
                   f"{strategy.out_spec.partial_groups}")
        if why:
            raise _fail(op, f"reshape {strategy.in_specs[0].to_str(mesh)} -> "
                        f"{strategy.out_spec.to_str(mesh)} moves data: {why}")
        return
    sem = _semantics(graph, op)
    specs = [strategy.out_spec, *strategy.in_specs]
    if sem is None:
        if not all(s.is_replicated if isinstance(s, ShardingSpec) else True for s in specs):
            raise _fail(op, "expected every spec replicated (no sharding rule for this op), "
                        f"found {strategy.describe(mesh)}")
        return
    shapes = [op.shape] + [graph.ops[o].shape for o in op.operands]
    roles = [s.axis_roles(t.dims, mesh) for s, t in zip(specs, shapes)]
    for a in range(mesh.ndim):
        if mesh.shape[a] == 1:
            continue
        ro, rins = roles[0][a], [r[a] for r in roles[1:]]
        if not _axis_ok(sem, ro, rins):
            raise _fail(op, f"on mesh axis {mesh.axis_names[a]} the roles (output {ro}, "
                        f"operands {rins}) match none of the op's dimension correspondences "
                        f"(strategy {strategy.describe(mesh)})")
    _check_partial_groups(op, specs, roles, mesh, strategy)


def _check_partial_groups(op: Op, specs: Sequence[Any], roles: Sequence[tuple],
                          mesh: AbstractMesh, strategy: Any) -> None:
    """A group of the output's pending axes is reduced by one collective, which is only
    what XLA does for a sum one loop of the op leaves: on every operand the group's axes
    must all be unused, all split one dimension, or all a pending sum grouped alike."""
    out = specs[0]
    if not isinstance(out, ShardingSpec):
        return
    for g in out.partial_groups:
        for k, (spec, r) in enumerate(zip(specs[1:], roles[1:])):
            got = [r[a] for a in g]
            if all(x is None for x in got):
                continue
            if all(x is not None and x[0] == "dim" and x[1] == got[0][1] for x in got):
                continue
            if all(x is not None and x[0] == "partial" for x in got) and any(
                    set(g) <= set(h) for h in spec.partial_groups):
                continue
            names = "+".join(mesh.axis_names[a] for a in g)
            raise _fail(op, f"output pending over {names} reduced as one group: expected "
                        f"operand {k}'s roles on those axes all unused, all one split "
                        f"dimension or a pending sum grouped alike, found {got} (strategy "
                        f"{strategy.describe(mesh)})")


def _share(op: Op, strategy: Any, shapes: Sequence[Any], mesh: AbstractMesh) -> int:
    flat = [x for s in [strategy.out_spec, *strategy.in_specs]
            for x in (s if isinstance(s, tuple) else (s,))]
    specs = flat
    if op.opcode == "get-tuple-element":
        specs = []   # reading an element computes nothing
    elif op.opcode == "gather" and len(specs) == 3:
        # A table split (its slice dimension) leaves every device looking up every index
        # into a partial result of the whole shape: only the result's and the indices'
        # splits share the work.
        specs = [specs[0], specs[2]]
    share = 1
    for a in range(mesh.ndim):
        for s in specs:
            if isinstance(s, ShardingSpec) and any(a in d.axes for d in s.dims):
                share *= mesh.shape[a]
                break
    if op.opcode == "get-tuple-element":
        return share
    if len(flat) == len(shapes) and any(
            isinstance(s, ShardingSpec) and isinstance(t, TensorType) and s.uneven_dims(t.dims, mesh)
            for s, t in zip(flat, shapes)):
        share /= padding_factor(op.opcode, flat, shapes, mesh)   # padded shards
    return share


def _close(x: float, y: float, rel: float) -> bool:
    return abs(x - y) <= rel * max(abs(x), abs(y), 1e-300) or abs(x - y) < 1e-300


def _check_resolved(graph: HloGraph, mesh: AbstractMesh, plan: Sequence[Any],
                    carried: Sequence[tuple[int, int]], outs_free: set[int],
                    resolved: Collection[int] | None) -> frozenset[int]:
    """The pending sums reduced once: checked against the plan, or derived (None).

    A value is *shared* when its spec is a pending sum, some operand reads it and it is used
    more than once (operand positions, a carry, being an output). A shared value that some
    use needs reduced must be reduced once; only shared values may be.
    """
    needs: dict[int, list[Any]] = {}
    for op, st in zip(graph.ops, plan):
        for k, u in enumerate(op.operands):
            needs.setdefault(u, []).append(st.in_specs[k])
    carries: dict[int, int] = {}
    for o, p in carried:
        if o != p:
            carries[o] = carries.get(o, 0) + 1
    must, may = set(), set()
    for u, got in needs.items():
        spec = plan[u].out_spec
        if not (isinstance(spec, ShardingSpec) and spec.is_partial):
            continue
        if len(got) + carries.get(u, 0) + (u in outs_free) < 2:
            continue
        may.add(u)
        if u in carries or u in outs_free or any(
                not (isinstance(t, ShardingSpec) and t.is_partial) for t in got):
            must.add(u)
    if resolved is None:
        return frozenset(must)
    resolved = frozenset(int(u) for u in resolved)
    for u in sorted(resolved - may):
        raise _fail(graph.ops[u], f"reduced once: expected a pending sum read in several "
                    f"places, found spec {_spec_str(plan[u].out_spec, mesh)} with "
                    f"{len(needs.get(u, ()))} reading operand(s)")
    for u in sorted(must - resolved):
        raise _fail(graph.ops[u], f"pending sum {_spec_str(plan[u].out_spec, mesh)}: expected "
                    f"it reduced once (a use needs it reduced), found it left pending")
    return resolved


def _spec_str(spec: Any, mesh: AbstractMesh) -> str:
    return spec.to_str(mesh) if isinstance(spec, ShardingSpec) else repr(spec)


def validate_plan(graph: HloGraph, mesh: AbstractMesh, cost: CostModel, plan: Sequence[Any],
                  *,
                  objective: float | None = None,
                  carried: Sequence[tuple[int, int]] = (),
                  resolved: Collection[int] | None = None,
                  alpha_share: Mapping[int, float] | None = None,
                  rel_tol: float = 1e-9) -> PlanCheck:
    """Check a plan from scratch (see the module docstring).

    Args:
        graph: the graph.
        mesh: the mesh.
        cost: its cost model.
        plan: one ``Strategy`` per op (``BuiltProblem.plan(choice)``).
        objective: the solver's objective to compare with, or None.
        carried: ``(output op id, parameter op id)`` pairs (``BuiltProblem.carried``).
        resolved: op ids of the pending sums reduced once (``BuiltProblem.resolved``);
            None: every shared pending sum that some reader needs reduced.
        alpha_share: op id -> the part of α its value's collectives are charged
            (``BuiltProblem.alpha_share``: scalars XLA reduces in one all-reduce); each
            must be ``1/K`` for ``K`` scalars of that share. None: every collective pays α.
        rel_tol: relative tolerance on costs.

    Returns:
        The recomputed ``PlanCheck``.

    Raises:
        PlanValidationError: naming the op and the inconsistency.
    """
    if len(plan) != len(graph.ops):
        raise PlanValidationError(f"plan has {len(plan)} strategies, graph {graph.name!r} has "
                                  f"{len(graph.ops)} ops")
    for o, p in carried:
        if graph.ops[p].opcode != "parameter" or graph.ops[o].shape != graph.ops[p].shape:
            raise PlanValidationError(f"carried pair ({graph.ops[o].name}, {graph.ops[p].name})"
                                      f": expected an output and a parameter of one type")
    carried_outs = {o for o, _ in carried}
    outs_free = set(graph.outputs) - carried_outs
    resolved = _check_resolved(graph, mesh, plan, carried, outs_free, resolved)
    share = _check_shares(graph, alpha_share or {})
    compute = comm = 0.0
    resharded = 0
    times = OpTimes(graph, cost)

    def reshard(src: Any, dst: Any, u: int) -> Any:
        return _reshard(src, dst, graph.ops[u].shape, mesh, cost, share.get(u, 1.0))

    def source(u: int, need: Any) -> Any:
        spec = plan[u].out_spec
        if u in resolved and isinstance(need, ShardingSpec) and not need.is_partial:
            return spec.without_partial()  # read from the value reduced once
        return spec

    for i in dict.fromkeys((*graph.params, *graph.outputs)):
        spec, t = plan[i].out_spec, graph.ops[i].shape
        if (i not in carried_outs and isinstance(spec, ShardingSpec)
                and isinstance(t, TensorType) and spec.uneven_dims(t.dims, mesh)
                and not spec.problems(t.dims, mesh, uneven=True)):
            raise _fail(graph.ops[i], f"{'parameter' if i in graph.params else 'result'} "
                        f"spec {spec.to_str(mesh)} splits {t} unevenly; expected an even "
                        f"split (JAX holds no uneven split at a jit boundary)")
    for op, st in zip(graph.ops, plan):
        check_strategy(graph, op, st, mesh)
        shapes = [op.shape] + [graph.ops[o].shape for o in op.operands]
        c = times.seconds(op.id, _share(op, st, shapes, mesh))
        if not _close(c, st.compute_cost, rel_tol):
            raise _fail(op, f"compute cost: expected {c:.6g} s ({op.flops:.6g} FLOP over "
                        f"{_share(op, st, shapes, mesh)} devices), found {st.compute_cost:.6g}")
        compute += c
        for k, u in enumerate(op.operands):
            need = st.in_specs[k]
            secs = reshard(source(u, need), need, u).cost
            comm += secs
            resharded += secs > 0
    for u in sorted(resolved):  # after check_strategy: the specs fit
        op, spec = graph.ops[u], plan[u].out_spec
        if u not in outs_free:  # a free output's reduction is its strategy's comm cost
            comm += reshard(spec, spec.without_partial(), u).cost
    for o, p in carried:
        need = plan[p].out_spec
        comm += reshard(source(o, need), need, o).cost
    for o in dict.fromkeys(graph.outputs):
        st, op = plan[o], graph.ops[o]
        inner = 0.0
        if o in outs_free and isinstance(st.out_spec, ShardingSpec):
            inner = reshard(st.out_spec, st.out_spec.without_partial(), o).cost
        if not _close(inner, st.comm_cost, rel_tol):
            raise _fail(op, f"comm cost inside the op: expected {inner:.6g} s (resolving the "
                        f"output's pending reduction), found {st.comm_cost:.6g}")
        comm += inner
    outs = set(graph.outputs)
    for op, st in zip(graph.ops, plan):
        if op.id not in outs and st.comm_cost != 0.0:
            raise _fail(op, f"comm cost inside the op: expected 0, found {st.comm_cost:.6g}")
    check = PlanCheck(float(compute), float(comm), int(resharded))
    if objective is not None and not _close(check.total, objective, rel_tol):
        raise PlanValidationError(
            f"objective: recomputed {check.total:.12g} s (compute {compute:.6g} + "
            f"communication {comm:.6g}), the solver claims {objective:.12g}")
    return check


def _check_shares(graph: HloGraph, share: Mapping[int, float]) -> Mapping[int, float]:
    """Latency shares must be ``1/K`` on whole groups of ``K >= 2`` scalars, so that a
    group's one combined all-reduce is charged at most one α."""
    count: dict[float, int] = {}
    for u, f in share.items():
        op = graph.ops[u]
        if not (isinstance(op.shape, TensorType) and op.shape.rank == 0):
            raise _fail(op, f"latency share {f}: expected only scalars to share an "
                        f"all-reduce, found shape {op.shape}")
        count[f] = count.get(f, 0) + 1
    for f, k in count.items():
        groups = round(1 / f) if f > 0 else 0         # K: the scalars of one group
        if groups < 2 or not _close(f * groups, 1.0, 1e-12) or k % groups:
            raise PlanValidationError(f"latency shares: expected 1/K for groups of K >= 2 "
                                      f"scalars, found share {f} on {k} scalars")
    return share


def validate_built(built: Any, choice: Sequence[int], objective: float | None = None
                   ) -> PlanCheck:
    """``validate_plan`` for a ``BuiltProblem`` and an assignment (objective defaults to
    ``built.problem.objective(choice)``)."""
    obj = built.problem.objective(choice) if objective is None else objective
    return validate_plan(built.graph, built.mesh, built.cost, built.plan(choice), objective=obj,
                         carried=built.carried, resolved=built.resolved(choice),
                         alpha_share=built.alpha_share)
