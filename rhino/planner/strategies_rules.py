"""Per-opcode sharding rules, written as *loops*: the op's iteration dimensions.

A ``Loop`` is one iteration dimension of an op and says what splitting it over some mesh
axes does to each tensor: the output dim it splits (or the partial reduction it leaves on
the output), and per operand the dim it splits (or None: that operand is needed whole along
those axes, or ``"sum"``: the operand may itself be a pending sum). Strategies
(``rhino.planner.strategies``) give every mesh axis one loop or none — recursively over the
mesh axes, as §4 of the paper does — so a 2-D mesh gets e.g. batch on ``x`` and columns on
``y``. Rules per opcode:

======================  ================================================================
dot                     batch dims (both operands + out), lhs free dims (rows), rhs free
                        dims (columns), contracting dims (both operands -> out partial sum)
convolution             batch ``b``, output feature ``o``, input feature ``i`` (-> partial
                        sum); spatial dims are never split (they would need halos)
elementwise             every dim, shared by the output and all same-rank operands
                        (scalar operands stay whole); linear ops also pass a partial sum:
                        add/subtract (all operands), negate/copy/convert-to-float,
                        multiply (one operand, the other whole), divide (numerator),
                        select (both branches)
reduce                  kept dims follow; a reduced dim -> output partial ``sum``/``max``/
                        ``min`` for add/maximum/minimum reducers; a partial sum passes
                        through a zero-initialised add reduction
broadcast / transpose   dims mapped through ``dimensions``; new broadcast dims split the
                        output only; partial sums pass through
slice / pad / reverse   untouched dims follow; touched dims whole; partial sums pass (pad
                        only with a zero padding value)
concatenate             dims other than the concatenated one follow (all operands)
dynamic-(update-)slice  dims taken whole follow
gather                  indices batch dims -> output; whole operand (offset) dims ->
                        output; an indexed operand dim with slice size 1 (vocabulary) ->
                        output partial sum (each device looks up its rows, zeros elsewhere)
scatter (add)           batching dims follow; whole window dims follow; updates' scatter
                        dims -> output partial sum; the scattered operand dim (each device
                        applies the updates that fall in its rows)
reduce-window, select-  dims with a trivial window (size 1, stride 1, no padding/dilation)
and-scatter             follow
sort                    dims other than the sorted one follow (single operand)
parameter, constant,    any dim may be split (values are produced locally)
iota, rng
======================  ================================================================

``op_loops`` returns None for ops without a rule (tuple-shaped ops, get-tuple-element,
while, conditional, custom-call, unknown opcodes): they stay replicated.

Example:
    >>> from rhino.hlo_passes.graph import TensorType as T
    >>> [l.name for l in dot_loops((T("f32", (8, 4)), T("f32", (4, 2))), T("f32", (8, 2)),
    ...                            {"lhs_contracting_dims": (1,), "rhs_contracting_dims": (0,)})]
    ['m0', 'n0', 'k0']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from rhino.hlo_passes.costs import ELEMENTWISE
from rhino.hlo_passes.graph import HloGraph, Op, TensorType

# A role: int = a dim of that tensor is split; str = pending reduction ("sum", ...); None.
Role = Any

GENERATED = frozenset({"parameter", "constant", "iota", "rng"})
RESHAPES = frozenset({"reshape"})
_REDUCER_KIND = {"add": "sum", "maximum": "max", "minimum": "min", "max": "max", "min": "min"}
FLOAT_TYPES = frozenset({"f16", "bf16", "f32", "f64"})
_ELEMENTWISE = ELEMENTWISE | {"copy"}
SUM = "sum"


@dataclasses.dataclass(frozen=True)
class Loop:
    """One iteration dimension of an op.

    Attributes:
        name: short label (``b0`` batch, ``m0`` rows, ``n0`` columns, ``k0`` contracting,
            ``d2`` dim 2, ``psum`` partial pass-through, ...).
        size: extent; the axes given this loop must divide it. None for partial
            pass-through loops (any number of axes).
        out: output role: the dim split, a reducer name (output partial), or None.
        ins: one role per operand: the dim split, ``"sum"`` (operand is a partial sum),
            or None (operand whole along those axes).
        shares_work: devices on these axes split the op's FLOPs.
    """

    name: str
    size: int | None
    out: Role
    ins: tuple[Role, ...]
    shares_work: bool = True


def _t(graph: HloGraph, i: int) -> TensorType | None:
    s = graph.ops[i].shape
    return s if isinstance(s, TensorType) else None


def is_zero_constant(graph: HloGraph, i: int) -> bool:
    """Whether op ``i`` is a scalar constant equal to zero."""
    op = graph.ops[i]
    if op.opcode != "constant":
        return False
    try:
        return float(str(op.attrs.get("literal", "")).strip().strip("{}")) == 0.0
    except ValueError:
        return False


def generated_loops(out: TensorType) -> list[Loop]:
    """Parameter / constant / iota / rng: every dim may be split, at no cost."""
    return [Loop(f"d{i}", s, i, (), True) for i, s in enumerate(out.dims) if s > 1]


def dot_loops(ins: Sequence[TensorType], out: TensorType, attrs: dict) -> list[Loop]:
    lhs, rhs = ins
    lb, rb = tuple(attrs.get("lhs_batch_dims", ())), tuple(attrs.get("rhs_batch_dims", ()))
    lc = tuple(attrs.get("lhs_contracting_dims", ()))
    rc = tuple(attrs.get("rhs_contracting_dims", ()))
    lf = [d for d in range(lhs.rank) if d not in lb and d not in lc]
    rf = [d for d in range(rhs.rank) if d not in rb and d not in rc]
    loops = []
    o = 0
    for j, (a, b) in enumerate(zip(lb, rb)):
        loops.append(Loop(f"b{j}", out.dims[o], o, (a, b)))
        o += 1
    for j, a in enumerate(lf):
        loops.append(Loop(f"m{j}", out.dims[o], o, (a, None)))
        o += 1
    for j, b in enumerate(rf):
        loops.append(Loop(f"n{j}", out.dims[o], o, (None, b)))
        o += 1
    for j, (a, b) in enumerate(zip(lc, rc)):
        loops.append(Loop(f"k{j}", lhs.dims[a], SUM, (a, b)))
    return [l for l in loops if l.size and l.size > 1]


def conv_loops(ins: Sequence[TensorType], out: TensorType, attrs: dict) -> list[Loop] | None:
    labels = str(attrs.get("dim_labels", ""))
    try:
        lhs_l, rest = labels.split("_", 1)
        rhs_l, out_l = rest.split("->", 1)
    except ValueError:
        return None
    lhs, rhs = ins
    if len(lhs_l) != lhs.rank or len(rhs_l) != rhs.rank or len(out_l) != out.rank:
        return None
    fgc = int(attrs.get("feature_group_count", 1) or 1)
    bgc = int(attrs.get("batch_group_count", 1) or 1)
    loops = []
    if bgc == 1:
        b = lhs_l.index("b")
        loops.append(Loop("b", lhs.dims[b], out_l.index("b"), (b, None)))
    if fgc == 1 and bgc == 1:
        o = rhs_l.index("o")
        loops.append(Loop("o", rhs.dims[o], out_l.index("f"), (None, o)))
        f, i = lhs_l.index("f"), rhs_l.index("i")
        loops.append(Loop("i", lhs.dims[f], SUM, (f, i)))
    return [l for l in loops if l.size > 1]


def elementwise_loops(graph: HloGraph, op: Op, ins: Sequence[TensorType],
                      out: TensorType) -> list[Loop] | None:
    roles_per_dim = []
    for t in ins:
        if t.rank == out.rank and t.dims == out.dims:
            roles_per_dim.append(True)
        elif t.rank == 0:
            roles_per_dim.append(False)
        else:
            return None
    loops = [Loop(f"d{i}", s, i, tuple(i if full else None for full in roles_per_dim))
             for i, s in enumerate(out.dims) if s > 1]
    for roles in _linear_partials(op, ins, out):
        which = [k for k, r in enumerate(roles) if r == SUM]
        name = f"psum{which[0]}" if len(which) == 1 and len(roles) > 1 else "psum"
        loops.append(Loop(name, None, SUM, roles, False))
    return loops


def _linear_partials(op: Op, ins: Sequence[TensorType], out: TensorType) -> list[tuple]:
    """Operand role tuples under which the op maps partial sums to a partial sum."""
    code = op.opcode
    if out.dtype not in FLOAT_TYPES:
        return []
    n = len(ins)
    if code in ("add", "subtract") and n == 2:
        return [(SUM, SUM)]
    if code in ("negate", "copy") and n == 1:
        return [(SUM,)]
    if code == "convert" and n == 1 and ins[0].dtype in FLOAT_TYPES:
        return [(SUM,)]
    if code == "multiply" and n == 2:
        return [(SUM, None), (None, SUM)]
    if code == "divide" and n == 2:
        return [(SUM, None)]
    if code == "select" and n == 3:
        return [(None, SUM, SUM)]
    return []


def _psum(n_operands: int, which: Sequence[int]) -> Loop:
    return Loop("psum", None, SUM, tuple(SUM if k in which else None for k in range(n_operands)),
                False)


def reduce_loops(graph: HloGraph, op: Op, ins: Sequence[TensorType],
                 out: TensorType) -> list[Loop] | None:
    if "variadic" in op.attrs:
        # one result of a reduce of n arrays together (argmax): the kept dimensions are
        # shared by every array; a reduced dimension cannot be split (the reducer pairs
        # values across the arrays), nor is there a pending sum
        _, n = op.attrs["variadic"]
        if len(ins) != 2 * n or any(t.dims != ins[0].dims for t in ins[:n]):
            return None
        red = set(op.attrs.get("dimensions", ()))
        kept = [d for d in range(ins[0].rank) if d not in red]
        loops = [Loop(f"d{d}", ins[0].dims[d], j, (d,) * n + (None,) * n)
                 for j, d in enumerate(kept)]
        return [l for l in loops if l.size > 1]
    if len(ins) != 2:
        return None
    x = ins[0]
    red = set(op.attrs.get("dimensions", ()))
    kept = [d for d in range(x.rank) if d not in red]
    loops = [Loop(f"d{d}", x.dims[d], j, (d, None)) for j, d in enumerate(kept)]
    kind = _REDUCER_KIND.get(str(op.attrs.get("reducer", "")))
    if kind is not None:
        loops += [Loop(f"r{d}", x.dims[d], kind, (d, None)) for d in sorted(red)]
    if kind == SUM and x.dtype in FLOAT_TYPES and is_zero_constant(graph, op.operands[1]):
        loops.append(_psum(2, (0,)))
    return [l for l in loops if l.size is None or l.size > 1]


def broadcast_loops(ins: Sequence[TensorType], out: TensorType, attrs: dict) -> list[Loop]:
    dims = tuple(attrs.get("dimensions", ()))
    src = {o: j for j, o in enumerate(dims)}
    loops = [Loop(f"d{o}", s, o, (src.get(o),)) for o, s in enumerate(out.dims) if s > 1]
    if out.dtype in FLOAT_TYPES:
        loops.append(_psum(1, (0,)))
    return loops


def transpose_loops(ins: Sequence[TensorType], out: TensorType, attrs: dict) -> list[Loop]:
    perm = tuple(attrs.get("dimensions", ()))
    loops = [Loop(f"d{o}", s, o, (perm[o],)) for o, s in enumerate(out.dims) if s > 1]
    if out.dtype in FLOAT_TYPES:
        loops.append(_psum(1, (0,)))
    return loops


def _untouched_loops(out: TensorType, n_operands: int, keep: Sequence[int],
                     tensor_operands: Sequence[int]) -> list[Loop]:
    return [Loop(f"d{d}", out.dims[d], d,
                 tuple(d if k in tensor_operands else None for k in range(n_operands)))
            for d in keep if out.dims[d] > 1]


def slice_like_loops(graph: HloGraph, op: Op, ins: Sequence[TensorType],
                     out: TensorType) -> list[Loop] | None:
    code, a = op.opcode, op.attrs
    x = ins[0]
    n = len(ins)
    floaty = out.dtype in FLOAT_TYPES
    if code == "slice":
        sl = a.get("slice", ())
        keep = [d for d, (lo, hi, st) in enumerate(sl) if lo == 0 and hi == x.dims[d] and st == 1]
        return _untouched_loops(out, n, keep, (0,)) + ([_psum(n, (0,))] if floaty else [])
    if code == "pad":
        pads = a.get("padding", ())
        keep = [d for d, p in enumerate(pads) if tuple(p) == (0, 0, 0)]
        zero = is_zero_constant(graph, op.operands[1])
        return _untouched_loops(out, n, keep, (0,)) + ([_psum(n, (0,))] if floaty and zero
                                                       else [])
    if code == "reverse":
        rev = set(a.get("dimensions", ()))
        keep = [d for d in range(out.rank) if d not in rev]
        return _untouched_loops(out, n, keep, (0,)) + ([_psum(n, (0,))] if floaty else [])
    if code == "concatenate":
        cat = tuple(a.get("dimensions", ()))
        keep = [d for d in range(out.rank) if d not in cat]
        return _untouched_loops(out, n, keep, range(n)) + ([_psum(n, range(n))] if floaty
                                                            else [])
    if code == "dynamic-slice":
        sizes = a.get("dynamic_slice_sizes", out.dims)
        keep = [d for d in range(out.rank) if sizes[d] == x.dims[d]]
        return _untouched_loops(out, n, keep, (0,))
    if code == "dynamic-update-slice":
        upd = ins[1]
        keep = [d for d in range(out.rank) if upd.dims[d] == x.dims[d]]
        return _untouched_loops(out, n, keep, (0, 1))
    if code == "sort":
        if n != 1:
            return None
        sd = set(a.get("dimensions", ()))
        keep = [d for d in range(out.rank) if d not in sd]
        return _untouched_loops(out, n, keep, (0,))
    return None


def _trivial_window_dims(window: dict, rank: int) -> list[int]:
    size = window.get("size", (1,) * rank)
    stride = window.get("stride", (1,) * rank)
    pad = window.get("pad", ((0, 0),) * rank)
    ld = window.get("lhs_dilate", (1,) * rank)
    rd = window.get("rhs_dilate", (1,) * rank)
    return [d for d in range(rank) if size[d] == 1 and stride[d] == 1
            and tuple(pad[d]) == (0, 0) and ld[d] == 1 and rd[d] == 1]


def window_loops(op: Op, ins: Sequence[TensorType], out: TensorType) -> list[Loop] | None:
    window = op.attrs.get("window", {})
    if op.opcode == "reduce-window":
        if len(ins) != 2:
            return None
        keep = _trivial_window_dims(window, out.rank)
        return _untouched_loops(out, 2, keep, (0,))
    if op.opcode == "select-and-scatter":
        keep = _trivial_window_dims(window, out.rank)
        return _untouched_loops(out, 3, keep, (0, 1))
    return None


def gather_loops(ins: Sequence[TensorType], out: TensorType, a: dict) -> list[Loop] | None:
    operand, idx = ins
    offset = tuple(a.get("offset_dims", ()))
    collapsed = set(a.get("collapsed_slice_dims", ()))
    start_map = tuple(a.get("start_index_map", ()))
    sizes = tuple(a.get("slice_sizes", ()))
    obatch = tuple(a.get("operand_batching_dims", ()))
    ibatch = tuple(a.get("start_indices_batching_dims", ()))
    ivd = a.get("index_vector_dim", idx.rank)
    if len(sizes) != operand.rank:
        return None
    loops = []
    batch_out = [d for d in range(out.rank) if d not in offset]
    idx_dims = [d for d in range(idx.rank) if d != ivd]
    if len(batch_out) != len(idx_dims):
        return None
    for j, (o, i) in enumerate(zip(batch_out, idx_dims)):
        od = obatch[ibatch.index(i)] if i in ibatch else None
        loops.append(Loop(f"b{j}", out.dims[o], o, (od, i)))
    window = [d for d in range(operand.rank) if d not in collapsed and d not in obatch]
    if len(window) != len(offset):
        return None
    for o, d in zip(offset, window):
        if sizes[d] == operand.dims[d] and d not in start_map:
            loops.append(Loop(f"w{d}", out.dims[o], o, (d, None)))
    if len(start_map) == 1:
        d = start_map[0]
        if sizes[d] == 1 and d in collapsed and out.dtype in FLOAT_TYPES:
            loops.append(Loop(f"v{d}", operand.dims[d], SUM, (d, None), False))
    return [l for l in loops if l.size > 1]


def scatter_loops(graph: HloGraph, op: Op, ins: Sequence[TensorType],
                  out: TensorType) -> list[Loop] | None:
    if len(ins) != 3 or str(op.attrs.get("reducer", "")) != "add":
        return None
    operand, idx, upd = ins
    a = op.attrs
    uwd = tuple(a.get("update_window_dims", ()))
    inserted = set(a.get("inserted_window_dims", ()))
    s2o = tuple(a.get("scatter_dims_to_operand_dims", ()))
    obatch = tuple(a.get("input_batching_dims", ()))
    ibatch = tuple(a.get("scatter_indices_batching_dims", ()))
    ivd = a.get("index_vector_dim", idx.rank)
    idx_dims = [d for d in range(idx.rank) if d != ivd]
    upd_scatter = [d for d in range(upd.rank) if d not in uwd]
    if len(idx_dims) != len(upd_scatter):
        return None
    loops = []
    for j, (i, u) in enumerate(zip(idx_dims, upd_scatter)):
        if i in ibatch:
            od = obatch[ibatch.index(i)]
            loops.append(Loop(f"b{j}", upd.dims[u], od, (od, i, u)))
        elif out.dtype in FLOAT_TYPES:
            loops.append(Loop(f"u{j}", upd.dims[u], SUM, (SUM, i, u)))
    window = [d for d in range(operand.rank) if d not in inserted and d not in obatch]
    if len(window) != len(uwd):
        return None
    for d, u in zip(window, uwd):
        if upd.dims[u] == operand.dims[d] and d not in s2o:
            loops.append(Loop(f"w{d}", operand.dims[d], d, (d, None, u)))
    if len(s2o) == 1 and s2o[0] in inserted:
        d = s2o[0]
        loops.append(Loop(f"v{d}", operand.dims[d], d, (d, None, None)))
    return [l for l in loops if l.size > 1]


def op_loops(graph: HloGraph, op: Op) -> list[Loop] | None:
    """The loops of ``op`` (see the module docstring), or None if it has no rule.

    Reshapes are handled by ``strategies`` (they map specs rather than share loops).
    """
    out = op.shape
    if not isinstance(out, TensorType):
        return None
    ins = [_t(graph, o) for o in op.operands]
    if any(t is None for t in ins):
        return None
    code = op.opcode
    if code in GENERATED:
        loops = generated_loops(out)
        return [dataclasses.replace(l, ins=(None,) * len(ins)) for l in loops]
    if code == "dot" and len(ins) == 2:
        return dot_loops(ins, out, op.attrs)
    if code == "convolution" and len(ins) == 2:
        return conv_loops(ins, out, op.attrs)
    if code in _ELEMENTWISE or (code == "bitcast" and ins and ins[0].dims == out.dims):
        return elementwise_loops(graph, op, ins, out)
    if code == "reduce":
        return reduce_loops(graph, op, ins, out)
    if code == "broadcast" and len(ins) == 1:
        return broadcast_loops(ins, out, op.attrs)
    if code == "transpose" and len(ins) == 1:
        return transpose_loops(ins, out, op.attrs)
    if code in ("slice", "pad", "reverse", "concatenate", "dynamic-slice",
                "dynamic-update-slice", "sort"):
        return slice_like_loops(graph, op, ins, out)
    if code in ("reduce-window", "select-and-scatter"):
        return window_loops(op, ins, out)
    if code == "gather" and len(ins) == 2:
        return gather_loops(ins, out, op.attrs)
    if code == "scatter":
        return scatter_loops(graph, op, ins, out)
    return None
