"""Validation of a parsed HLO module: what XLA would reject (parameter numbering, operand
shapes per opcode, calls and their signatures, the entry layout) as ``HloParseError`` with
the file and line. ``ingest`` runs ``validate_module`` before building the graph.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator, NoReturn

from rhino.errors import HloParseError

from . import hlo_text as ht
from .graph import Shape, TensorType, shape_str
from .hlo_text import RawComputation, RawInstr, RawModule, region_refs

def typed_attrs(raw: dict[str, str], path: str = "<string>",
                line: int | None = None) -> dict[str, Any]:
    """Decode the attributes a planner reads; others stay strings (metadata is dropped).

    Raises:
        HloParseError: an attribute without its documented form (at ``path``:``line``).
    """
    return ht.decode_attrs(raw, path, line)


# Elementwise ops whose operands all have the result's dimensions (select's predicate and
# clamp's bounds may also be scalars), and those whose operands and result share a type.
_UNARY = frozenset("""abs cbrt ceil clz count-leading-zeros convert cosine erf exponential exponential-minus-one
floor imag is-finite log log-plus-one logistic negate not popcnt real reduce-precision
round-nearest-afz round-nearest-even rsqrt sign sine sqrt tan tanh""".split())
_BINARY = frozenset("""add and atan2 compare complex divide maximum minimum multiply mulhi or
power
remainder shift-left shift-right-arithmetic shift-right-logical stochastic-convert subtract
xor""".split())
_TERNARY = frozenset({"select", "clamp"})
_SAME_TYPE = (_UNARY | _BINARY | _TERNARY) - {"abs", "convert", "imag", "real", "is-finite",
                                              "compare", "complex", "stochastic-convert"}
_ARITY = {**{o: 1 for o in _UNARY}, **{o: 2 for o in _BINARY}, **{o: 3 for o in _TERNARY},
          "reshape": 1, "transpose": 1, "broadcast": 1, "get-tuple-element": 1, "slice": 1,
          "reverse": 1, "copy": 1, "pad": 2, "while": 1, "parameter": 0, "constant": 0,
          "iota": 0, "convolution": 2, "gather": 2, "select-and-scatter": 3, "dot": 2}
_MIN_ARITY = {"concatenate": 1, "reduce": 2, "reduce-window": 2, "scatter": 3,
              "dynamic-slice": 1, "dynamic-update-slice": 2, "sort": 1, "all-reduce": 1}
_REQUIRED = {"broadcast": ("dimensions",), "transpose": ("dimensions",),
             "reduce": ("dimensions", "to_apply"), "concatenate": ("dimensions",),
             "get-tuple-element": ("index",), "slice": ("slice",), "call": ("to_apply",),
             "fusion": ("calls",), "while": ("body", "condition"), "compare": ("direction",),
             "iota": ("iota_dimension",), "reverse": ("dimensions",), "pad": ("padding",),
             "dynamic-slice": ("dynamic_slice_sizes",)}

INLINED_OPCODES = frozenset({"call", "fusion"})
_RESULT_IS_OPERANDS = frozenset({"copy", "sort", "all-reduce", "scatter", "select-and-scatter"})
_ARRAYS_ONLY = _UNARY | _BINARY | _TERNARY | frozenset({
    "dot", "reshape", "transpose", "broadcast", "concatenate", "slice", "reverse", "pad", "iota",
    "convolution"})

MAX_INLINED_OPS = 10_000_000
# Attributes the builder reads as one computation's name.
_SINGLE_REGION_KEYS = ("to_apply", "calls", "body", "condition")
_STACK_FRAME_RE = re.compile(r"\bstack_frame_id=([^\s}]*)")


# --- validation: what XLA would reject beyond the syntax --------------------------------

def _call_order(module: RawModule) -> list[RawComputation]:
    """Computations with every callee before its callers; rejects unknown callees and
    recursion (XLA's call graph is acyclic)."""
    comps, path = module.computations, module.path
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    order: list[RawComputation] = []

    def callees(c: RawComputation) -> Iterator[tuple[RawInstr, str]]:
        for ins in c.instrs:
            for k in _SINGLE_REGION_KEYS:
                v = ins.attrs.get(k)
                if v is not None and not ht.NAME_RE.fullmatch(v):
                    raise HloParseError(path, ins.line, f"{k}= naming one computation", v)
            for name in region_refs(ins):
                yield ins, name

    for start in comps:
        if start in state:
            continue
        state[start] = 1
        stack = [(comps[start], callees(comps[start]))]
        while stack:
            comp, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[comp.name] = 2
                order.append(comp)
                stack.pop()
                continue
            ins, name = nxt
            if name not in comps:
                raise HloParseError(path, ins.line, "a computation defined in the module", name)
            if state.get(name) == 1:
                raise HloParseError(path, ins.line, "a call graph without cycles",
                                    f"{comp.name!r} calling {name!r}, which calls it back")
            if name not in state:
                state[name] = 1
                stack.append((comps[name], callees(comps[name])))
    return order


def validate_module(module: RawModule) -> None:
    """Check a parsed module as XLA would: known opcodes, parameters numbered 0..n-1 in every
    computation, operands defined before use, called computations that exist and do not
    recurse, operand and result shapes against the opcode's rule where it is simple and
    certain (elementwise ops, dot, reshape, transpose, broadcast, slice, concatenate, pad,
    reduce, scatter, tuples, calls, while), and the ``entry_computation_layout`` / old-style
    signatures against the bodies.
    Fills in ``RawComputation.params`` and ``RawInstr.typed``.

    Raises:
        HloParseError: at the offending instruction's line.
    """
    inlined: dict[str, int] = {}
    for comp in _call_order(module):
        _validate_computation(module, comp)
        size = 0
        for ins in comp.instrs:
            if ins.opcode in INLINED_OPCODES:
                size += inlined[region_refs(ins)[0]]
            elif ins.opcode != "parameter":
                size += 1
        inlined[comp.name] = size
        if comp.signature is not None:
            _check_signature(module, comp, comp.signature, comp.line, "its header")
    entry = module.entry
    if inlined[entry.name] > MAX_INLINED_OPS:
        raise HloParseError(module.path, entry.line, f"at most {MAX_INLINED_OPS:,} instructions "
                            "once calls are inlined", f"{inlined[entry.name]:,}")
    if module.entry_layout is not None:
        _check_signature(module, entry, module.entry_layout, module.header_line,
                         "the header's entry_computation_layout")


def _check_signature(module: RawModule, comp: RawComputation,
                     sig: tuple[list[Shape], Shape], line: int, what: str) -> None:
    params, result = sig
    if len(params) != len(comp.params):
        raise HloParseError(module.path, line, f"{len(comp.params)} parameter shape(s) in {what}"
                            f", as {comp.name!r} has", f"{len(params)}")
    for k, (want, ins) in enumerate(zip(params, comp.params)):
        if ins.shape != want:
            raise HloParseError(module.path, ins.line, f"parameter {k} of shape "
                                f"{shape_str(want)}, as {what} (line {line}) declares",
                                shape_str(ins.shape))
    root = comp.by_name()[comp.root]
    if root.shape != result:
        raise HloParseError(module.path, root.line, f"a root of shape {shape_str(result)}, "
                            f"as {what} (line {line}) declares", shape_str(root.shape))


def _validate_computation(module: RawModule, comp: RawComputation) -> None:
    path = module.path
    shapes: dict[str, Shape] = {}
    dynamic: dict[str, bool] = {}
    params: dict[int, RawInstr] = {}
    for ins in comp.instrs:
        for o in ins.operands:
            if o not in shapes:
                raise HloParseError(path, ins.line, f"an operand defined earlier in "
                                    f"{comp.name!r}", o)
        try:
            ins.typed = ht.decode_attrs(ins.attrs, path, ins.line)
            if ins.opcode == "parameter":
                lit = (ins.literal or "").strip()
                if not (lit.isdigit() and lit.isascii()):
                    raise HloParseError(path, ins.line, "a parameter number such as "
                                        "parameter(0)", lit)
                if int(lit) in params:
                    raise HloParseError(path, ins.line, "a parameter number not used before "
                                        f"(line {params[int(lit)].line})", f"parameter({lit})")
                params[int(lit)] = ins
            sf = _STACK_FRAME_RE.search(ins.attrs.get("metadata", ""))
            if sf is not None and not (sf.group(1).isdigit() and sf.group(1).isascii()):
                raise HloParseError(path, ins.line, "an integer stack_frame_id", sf.group(1))
            _check_instr(module, ins, [shapes[o] for o in ins.operands],
                         any(dynamic[o] for o in ins.operands) or ins.dynamic)
        except ht.DECODE_ERRORS as e:
            raise ht.unexpected_error(path, ins.line, f"{ins.name} = {ins.opcode}(...)", e) from e
        shapes[ins.name] = ins.shape
        dynamic[ins.name] = ins.dynamic
    n = len(params)
    for k, ins in params.items():
        if k >= n:
            raise HloParseError(path, ins.line, f"a parameter number below {n} ({comp.name!r} "
                                f"has {n} parameters, numbered 0..{n - 1})", f"parameter({k})")
    comp.params = [params[k] for k in range(n)]


_Fail = Callable[[str, str], NoReturn]  # raises an HloParseError at the instruction's line


def _array(s: Shape) -> TensorType | None:
    return s if isinstance(s, TensorType) else None


def _check_instr(module: RawModule, ins: RawInstr, ops: list[Shape], dynamic: bool) -> None:
    """Operand and result shapes against the opcode's rule, where it is simple and certain."""
    op, t, res = ins.opcode, ins.typed, ins.shape

    def fail(expected: str, found: str) -> NoReturn:
        raise HloParseError(module.path, ins.line, f"{op}: {expected}", found)

    if op not in ht.OPCODES:
        raise HloParseError(module.path, ins.line, "an HLO opcode such as add or dot", op)
    n = len(ops)
    if op in _ARITY and n != _ARITY[op] and not (op == "dot" and "sparsity" in t):  # + meta
        fail(f"{_ARITY[op]} operand(s)", str(n))
    if n < _MIN_ARITY.get(op, 0):
        fail(f"at least {_MIN_ARITY[op]} operand(s)", str(n))
    for k in _REQUIRED.get(op, ()):
        if k not in t:
            fail(f"a {k}= attribute", "none")
    arrays = [_array(s) for s in ops]
    r = _array(res)
    if op in _ARRAYS_ONLY:
        if r is None:
            fail("an array result", shape_str(res))
        for k, a in enumerate(arrays):
            if a is None:
                fail(f"an array operand {k}", shape_str(ops[k]))
    if op in _UNARY or op in _BINARY or op in _TERNARY:
        for k, a in enumerate(arrays):
            scalar_ok = (op == "select" and k == 0) or (op == "clamp" and k != 1)
            if a.dims != r.dims and not (scalar_ok and a.dims == ()):
                fail(f"operand {k} with the result's dimensions {list(r.dims)}", str(a))
        if op in _SAME_TYPE:
            for k, a in enumerate(arrays):
                want = "pred" if op == "select" and k == 0 else r.dtype
                if a.dtype != want:
                    fail(f"operand {k} of element type {want}", str(a))
        if op in ("compare", "is-finite") and r.dtype != "pred":
            fail("a pred result", str(r))
        if op == "compare" and arrays[0].dtype != arrays[1].dtype:
            fail(f"operands of one element type ({arrays[0].dtype})", str(arrays[1]))
    elif op == "dot":
        if n < 2:
            fail("at least 2 operands", str(n))
        _check_dot(t, arrays[0], arrays[1], r, fail, sparse="sparsity" in t)
    elif op in ("reshape", "transpose", "broadcast", "slice", "reverse"):
        a = arrays[0]
        if a.dtype != r.dtype:
            fail(f"an operand of the result's element type {r.dtype}", str(a))
        dims = t.get("dimensions", ())
        if op == "reshape" and not dynamic and a.numel != r.numel:
            fail(f"an operand of {r.numel} elements, as the result {r}", str(a))
        elif op == "transpose":
            if sorted(dims) != list(range(a.rank)) or r.dims != tuple(a.dims[d] for d in dims):
                fail(f"dimensions= a permutation of the operand's {a.rank} dimensions, "
                     f"giving the result's {list(r.dims)}", f"{list(dims)} on {a}")
        elif op == "broadcast":
            if len(dims) != a.rank or len(set(dims)) != len(dims) or any(
                    not 0 <= d < r.rank or a.dims[i] not in (1, r.dims[d])
                    for i, d in enumerate(dims)):
                fail(f"dimensions= one distinct result dimension (of {r.rank}) per operand "
                     f"dimension, of the same size", f"{list(dims)} for {a} -> {r}")
        elif op == "slice":
            sl = t["slice"]
            if len(sl) != a.rank or any(
                    not (0 <= lo <= hi <= d and st >= 1 and rd == -(-(hi - lo) // st))
                    for (lo, hi, st), d, rd in zip(sl, a.dims, r.dims)) or r.rank != a.rank:
                fail(f"one in-bounds [start:limit:stride] per dimension of {a} giving {r}",
                     ins.attrs["slice"])
        elif op == "reverse":
            if r.dims != a.dims or any(not 0 <= d < a.rank for d in dims):
                fail(f"the operand's dimensions and dimensions= below {a.rank}", f"{a} -> {r}")
    elif op == "concatenate":
        dims = t["dimensions"]
        if len(dims) != 1 or not 0 <= dims[0] < r.rank:
            fail(f"dimensions= one dimension below {r.rank}", str(list(dims)))
        d = dims[0]
        if any(a.rank != r.rank or a.dtype != r.dtype or any(
                x != y for i, (x, y) in enumerate(zip(a.dims, r.dims)) if i != d)
               for a in arrays) or sum(a.dims[d] for a in arrays) != r.dims[d]:
            fail(f"operands matching {r} except along dimension {d}, where they add up",
                 ", ".join(map(str, arrays)))
    elif op == "pad":
        a, pad = arrays[0], t["padding"]
        if arrays[1].rank != 0 or len(pad) != a.rank or r.rank != a.rank or any(
                rd != lo + hi + d + max(d - 1, 0) * it
                for (lo, hi, it), d, rd in zip(pad, a.dims, r.dims)):
            fail(f"a scalar padding value and one low_high_interior per dimension of {a} "
                 f"giving {r}", f"{ins.attrs['padding']} with {arrays[1]}")
    elif op == "iota":
        if not 0 <= t["iota_dimension"] < r.rank:
            fail(f"iota_dimension below the rank {r.rank}", str(t["iota_dimension"]))
    elif op == "convolution":
        if not arrays[0].rank == arrays[1].rank == r.rank:
            fail("input, kernel and result of one rank", ", ".join(map(str, arrays + [r])))
        labels = t.get("dim_labels")
        if labels is not None and r.rank <= 11:
            digits = "".join(str(k) for k in range(r.rank - 2))
            want = [sorted("bf" + digits), sorted("io" + digits), sorted("bf" + digits)]
            parts = labels.replace("->", "_").split("_")
            if [sorted(x) for x in parts] != want:
                fail(f"dim_labels= like b01f_01io->b01f: b, f (i, o for the kernel) and "
                     f"{digits or 'no digits'} once each per operand", labels)
    elif op == "tuple":
        if res != tuple(ops):
            fail(f"a result shape {shape_str(tuple(ops))} (the operands' shapes)", shape_str(res))
    elif op == "get-tuple-element":
        src, k = ops[0], t["index"]
        if _array(src) is not None or not 0 <= k < len(src) or src[k] != res:
            fail(f"a tuple operand whose element index={k} has the result's shape "
                 f"{shape_str(res)}", shape_str(src))
    elif op in _RESULT_IS_OPERANDS:
        # copy, sort, all-reduce: each operand; scatter: the operands before indices and
        # updates; select-and-scatter: the first. One operand: its shape, else a tuple.
        k = {"scatter": (n - 1) // 2, "select-and-scatter": 1}.get(op, n)
        want = ops[0] if k == 1 else tuple(ops[:k])
        if (op == "scatter" and n % 2 == 0) or res != want:
            fail(f"a result of the shape of the {k} operand(s) it updates: {shape_str(want)}",
                 shape_str(res))
    elif op == "constant":
        if r is not None and (r.rank == 0) == (ins.literal or "").lstrip().startswith("{"):
            fail(f"a literal of rank {r.rank} (braces for arrays)", ins.literal or "")
    elif op == "reduce":
        _check_reduce(module, t, arrays, res, fail)
    elif op == "dynamic-slice":
        a, sizes = arrays[0], t["dynamic_slice_sizes"]
        if a is None or r is None or len(sizes) != a.rank or r.dims != sizes or any(
                not 0 <= s <= d for s, d in zip(sizes, a.dims)):
            fail("dynamic_slice_sizes= within the operand, equal to the result's dims",
                 f"{list(sizes)} on {shape_str(ops[0])} -> {shape_str(res)}")
    elif op == "dynamic-update-slice":
        a, u = arrays[0], arrays[1]
        if a is None or u is None or r is None or r.dims != a.dims or u.rank != a.rank or any(
                x > y for x, y in zip(u.dims, a.dims)):
            fail("an update within the operand and a result of the operand's shape",
                 f"{shape_str(ops[0])}, {shape_str(ops[1])} -> {shape_str(res)}")
    elif op in INLINED_OPCODES or op == "while":
        _check_call(module, ins, ops, fail)


def _check_dot(t: dict[str, Any], lhs: TensorType, rhs: TensorType, r: TensorType,
               fail: _Fail, sparse: bool) -> None:
    """Contracting and batch dimensions pair up, in range, of equal sizes, and the result is
    (batch, lhs free, rhs free). A sparse dot's lhs is compressed: only ranges are checked."""
    lc, rc = t.get("lhs_contracting_dims", ()), t.get("rhs_contracting_dims", ())
    lb, rb = t.get("lhs_batch_dims", ()), t.get("rhs_batch_dims", ())
    if len(lc) != len(rc) or len(lb) != len(rb):
        fail("as many lhs as rhs contracting (and batch) dimensions",
             f"contracting {list(lc)} x {list(rc)}, batch {list(lb)} x {list(rb)}")
    for side, dims, a in (("lhs", lc + lb, lhs), ("rhs", rc + rb, rhs)):
        if len(set(dims)) != len(dims) or any(not 0 <= d < a.rank for d in dims):
            fail(f"distinct {side} contracting/batch dimensions below its rank {a.rank}",
                 f"{list(dims)} of {a}")
    if sparse:
        return
    for x, y in zip(lc + lb, rc + rb):
        if lhs.dims[x] != rhs.dims[y]:
            fail(f"lhs dimension {x} ({lhs.dims[x]}) equal to rhs dimension {y}",
                 f"{lhs} x {rhs}")
    want = (tuple(lhs.dims[d] for d in lb)
            + tuple(x for i, x in enumerate(lhs.dims) if i not in lc and i not in lb)
            + tuple(x for i, x in enumerate(rhs.dims) if i not in rc and i not in rb))
    if r.dims != want:
        fail(f"result dimensions {list(want)} (batch, lhs free, rhs free)", str(r))


def _check_reduce(module: RawModule, t: dict[str, Any], arrays: list[TensorType | None],
                  res: Shape, fail: _Fail) -> None:
    k = len(arrays) // 2
    ins_, inits = arrays[:k], arrays[k:]
    dims = t["dimensions"]
    if len(arrays) % 2 or any(a is None for a in arrays) or any(i.rank for i in inits) or any(
            a.dims != ins_[0].dims for a in ins_):
        fail("inputs of one shape followed by as many scalar init values",
             ", ".join(shape_str(a) if a is not None else "a tuple" for a in arrays))
    if len(set(dims)) != len(dims) or any(not 0 <= d < ins_[0].rank for d in dims):
        fail(f"distinct dimensions= below the rank {ins_[0].rank}", str(list(dims)))
    kept = tuple(x for i, x in enumerate(ins_[0].dims) if i not in dims)
    results = [res] if k == 1 else (list(res) if _array(res) is None else [])
    if len(results) != k or any(_array(x) is None or x.dims != kept for x in results):
        fail(f"{k} result(s) of dimensions {list(kept)}", shape_str(res))


def _check_call(module: RawModule, ins: RawInstr, ops: list[Shape], fail: _Fail) -> None:
    """call/fusion: operands match the callee's parameters, result its root; while: the
    state shape threads through body and condition."""
    comps = module.computations
    if ins.opcode == "while":
        body, cond = comps[ins.typed["body"]], comps[ins.typed["condition"]]
        state = ops[0]
        for c in (body, cond):
            if [p.shape for p in c.params] != [state]:
                fail(f"{c.name!r} taking one parameter of the loop state's shape "
                     f"{shape_str(state)}", ", ".join(shape_str(p.shape) for p in c.params))
        if ins.shape != state or body.by_name()[body.root].shape != state:
            fail(f"a result and body root of the loop state's shape {shape_str(state)}",
                 shape_str(ins.shape))
        if cond.by_name()[cond.root].shape != TensorType("pred", ()):
            fail(f"condition {cond.name!r} returning pred[]",
                 shape_str(cond.by_name()[cond.root].shape))
        return
    callee = comps[region_refs(ins)[0]]
    want = [p.shape for p in callee.params]
    if list(ops) != want:
        fail(f"operands of the shapes {callee.name!r} takes: "
             f"({', '.join(map(shape_str, want))})", f"({', '.join(map(shape_str, ops))})")
    root = callee.by_name()[callee.root]
    if root.shape != ins.shape:
        fail(f"the result shape of {callee.name!r}: {shape_str(root.shape)}",
             shape_str(ins.shape))
