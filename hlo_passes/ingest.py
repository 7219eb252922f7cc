"""Ingestion: a JAX function, an HLO text file or a StableHLO/MLIR file -> ``HloGraph``.

Steps: lower (JAX) or read (files: UTF-8; StableHLO converted by jaxlib) -> HLO text ->
``hlo_text.parse_hlo_text`` -> ``validate_module`` (what XLA would reject: parameter
numbering, operand shapes per opcode, calls, the entry layout) -> inline ``call``/``fusion``
computations from the entry, forward ``get-tuple-element(tuple(...))``, drop the structural
tuples left dead -> typed attributes, FLOPs, bytes, sources -> attach argument/output pytree
paths and donation -> ``HloGraph.check``. Malformed input of any kind is an ``HloParseError``.

Example:
    >>> import jax, jax.numpy as jnp, rhino
    >>> g = rhino.ingest(lambda p, x: x @ p["w"], {"w": jnp.ones((4, 2))}, jnp.ones((8, 4)))
    >>> [g.ops[p].arg.path for p in g.params]
    ["p['w']", 'x']
"""

from __future__ import annotations

import inspect
import math
import os
import re
from typing import Any, Callable, Iterator, NoReturn

from rhino.errors import HloParseError, IngestError

from . import hlo_text as ht
from .costs import op_flops
from .graph import ArgInfo, HloGraph, Op, Shape, TensorType, flatten_shape, shape_str
from .hlo_text import RawComputation, RawInstr, RawModule, region_refs

_OPAQUE = frozenset({"while", "conditional"})
_MAX_CALL_DEPTH = 200


def typed_attrs(raw: dict[str, str], path: str = "<string>",
                line: int | None = None) -> dict[str, Any]:
    """Decode the attributes a planner reads; others stay strings (metadata is dropped).

    Raises:
        HloParseError: an attribute without its documented form (at ``path``:``line``).
    """
    return ht.decode_attrs(raw, path, line)


# Elementwise ops whose operands all have the result's dimensions (select's predicate and
# clamp's bounds may also be scalars), and those whose operands and result share a type.
_UNARY = frozenset("""abs cbrt ceil clz convert cosine erf exponential exponential-minus-one
floor imag is-finite log log-plus-one logistic negate not popcnt real reduce-precision
round-nearest-afz round-nearest-even rsqrt sign sine sqrt tan tanh""".split())
_BINARY = frozenset("""add and atan2 compare complex divide maximum minimum multiply or power
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

_INLINED = frozenset({"call", "fusion"})
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
            if ins.opcode in _INLINED:
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
    elif op in _INLINED or op == "while":
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


class _Builder:
    """Inlines a RawModule into a flat op list."""

    def __init__(self, module: RawModule):
        self.module = module
        self.ops: list[Op] = []
        self.emitted: dict[str, int] = {}
        self.names: set[str] = set()
        self._flops_memo: dict[str, float] = {}
        self._barrier_copies: dict[tuple[int, int], int] = {}
        self._reduce_outputs: dict[tuple[int, int], int] = {}
        # ops dropped when nothing reads them (besides tuples and their elements)
        self.structural: set[int] = set()

    def _unique(self, name: str) -> str:
        if name not in self.names:
            self.names.add(name)
            return name
        k = 1
        while f"{name}.i{k}" in self.names:
            k += 1
        self.names.add(f"{name}.i{k}")
        return f"{name}.i{k}"

    def emit(self, comp: RawComputation, args: list[int] | None, depth: int = 0) -> int:
        """Emit ``comp``'s instructions (validated by ``validate_module``); returns the id
        standing for its root."""
        local: dict[str, int] = {}
        for ins in comp.instrs:
            try:
                self._emit_one(ins, local, args, depth)
            except ht.DECODE_ERRORS as e:
                raise ht.unexpected_error(self.module.path, ins.line,
                                          f"{ins.name} = {ins.opcode}(...)", e) from e
        return local[comp.root]

    def _emit_one(self, ins: RawInstr, local: dict[str, int], args: list[int] | None,
                  depth: int) -> None:
        operand_ids = [local[o] for o in ins.operands]
        if ins.opcode == "parameter" and args is not None:
            local[ins.name] = args[int(ins.literal)]
            return
        attrs = dict(ins.typed)  # each inlined copy gets its own
        if ins.opcode in _INLINED:
            if depth >= _MAX_CALL_DEPTH:
                raise HloParseError(self.module.path, ins.line, f"calls nested at most "
                                    f"{_MAX_CALL_DEPTH} deep (rhino inlines them)",
                                    f"a call at depth {depth + 1}")
            callee = self.module.computations[region_refs(ins)[0]]
            local[ins.name] = self.emit(callee, operand_ids, depth + 1)
            return
        if ins.opcode == "get-tuple-element":
            src = self.ops[operand_ids[0]]
            if src.opcode == "opt-barrier" and self.ops[src.operands[0]].opcode == "tuple":
                local[ins.name] = self._through_barrier(src, attrs["index"], ins)
                return
            if src.opcode == "reduce" and len(src.operands) >= 4 and \
                    not isinstance(src.shape, TensorType):
                local[ins.name] = self._reduce_output(src, attrs["index"], ins)
                return
            if src.opcode == "tuple":
                local[ins.name] = src.operands[attrs["index"]]
                return
        local[ins.name] = self._new_op(ins, attrs, operand_ids)

    def _through_barrier(self, barrier: Op, index: int, ins: RawInstr) -> int:
        """Element ``index`` of an ``opt-barrier`` over a tuple, as a ``copy`` of the element.

        jax.checkpoint's barrier orders the recomputation in XLA's scheduler and moves no
        data, but what reads through it is another value to XLA: a weight gathered for the
        forward pass is gathered again for the recomputation. One copy op per element keeps
        the elements' specs free (no tuple without a rule forcing them replicated) and the
        readers behind the barrier apart from those before it."""
        key = (barrier.id, index)
        if key not in self._barrier_copies:
            elem = self.ops[self.ops[barrier.operands[0]].operands[index]]
            op = Op(id=len(self.ops), name=self._unique(ins.name), opcode="copy",
                    shape=elem.shape, operands=(elem.id,),
                    attrs={"barrier": barrier.name, "index": index,
                           "of": len(self.ops[barrier.operands[0]].operands)},
                    flops=0.0, out_bytes=elem.out_bytes, op_name=barrier.op_name,
                    source=barrier.source)
            self.ops.append(op)
            self._barrier_copies[key] = op.id
        return self._barrier_copies[key]

    def _reduce_output(self, red: Op, index: int, ins: RawInstr) -> int:
        """Result ``index`` of a variadic reduce (``argmax``: values and indices reduced
        together) as a reduce op of its own over all the operands, marked
        ``attrs['variadic'] = (index, n)``: the planner gives each result array specs (the
        kept dimensions shared by every operand) instead of leaving the tuple replicated.
        XLA still runs one reduce; the split ops share its FLOPs."""
        key = (red.id, index)
        if key not in self._reduce_outputs:
            n = len(red.operands) // 2
            elem = red.shape[index]
            op = Op(id=len(self.ops), name=self._unique(ins.name), opcode="reduce",
                    shape=elem, operands=red.operands,
                    attrs=dict(red.attrs, variadic=(index, n)), flops=red.flops / n,
                    out_bytes=elem.nbytes, op_name=red.op_name, source=red.source)
            self.ops.append(op)
            self._reduce_outputs[key] = op.id
            self.structural.add(red.id)
        return self._reduce_outputs[key]

    def _new_op(self, ins: RawInstr, attrs: dict[str, Any], operand_ids: list[int]) -> int:
        md = ht.parse_metadata(ins.attrs["metadata"]) if "metadata" in ins.attrs else {}
        if ins.opcode == "parameter":
            attrs["parameter_number"] = int(ins.literal)
        elif ins.opcode == "constant":
            lit = ins.literal or ""
            attrs["literal"] = lit if len(lit) <= 64 else lit[:61] + "..."
        operand_shapes = [self.ops[o].shape for o in operand_ids]
        if "to_apply" in attrs and ins.opcode not in _INLINED:
            attrs["reducer"] = self._reducer(attrs["to_apply"])
        flops = op_flops(ins.opcode, ins.shape, operand_shapes, attrs)
        if ins.opcode in _OPAQUE:
            flops = self._opaque(ins, attrs)
        if not 0 <= flops < math.inf:
            raise HloParseError(self.module.path, ins.line, "an op whose FLOP count is a finite "
                                "non-negative number", f"{flops} FLOPs")
        op = Op(id=len(self.ops), name=self._unique(ins.name), opcode=ins.opcode,
                shape=ins.shape, operands=tuple(operand_ids), attrs=attrs, flops=flops,
                out_bytes=sum(t.nbytes for t in flatten_shape(ins.shape)),
                op_name=md.get("op_name", ""), source=self.module.source_of(md))
        self.ops.append(op)
        return op.id

    def _reducer(self, comp_name: str) -> str | tuple[str, ...]:
        comp = self.module.computations[comp_name]
        root = comp.by_name()[comp.root]
        if root.opcode == "tuple":
            byname = comp.by_name()
            return tuple(byname[o].opcode for o in root.operands)
        return root.opcode

    def _opaque(self, ins: RawInstr, attrs: dict[str, Any]) -> float:
        """Describe a control-flow op in attrs['opaque']; return its FLOPs estimate."""
        if ins.opcode == "while":
            body, cond = attrs.get("body"), attrs.get("condition")
            trips = _trip_count(self.module.computations.get(cond), attrs)
            attrs["trip_count"] = trips
            body_flops = self.computation_flops(body)
            attrs["opaque"] = (f"while loop (body {body}, "
                               f"{trips if trips is not None else 'unknown'} trips)")
            return body_flops * (trips if trips is not None else 1)
        branches = [attrs[k] for k in ("true_computation", "false_computation") if k in attrs]
        if "branch_computations" in attrs:
            branches = [b.strip().lstrip("%") for b in attrs["branch_computations"].strip("{}")
                        .split(",")]
        attrs["opaque"] = f"conditional ({len(branches)} branches: {', '.join(branches)})"
        return max((self.computation_flops(b) for b in branches), default=0.0)

    def computation_flops(self, name: str | None) -> float:
        """FLOPs of one execution of a (non-entry) computation, nested loops included."""
        if name is None or name not in self.module.computations:
            return 0.0
        if name in self._flops_memo:
            return self._flops_memo[name]
        self._flops_memo[name] = 0.0  # guards against (invalid) recursion
        comp = self.module.computations[name]
        shapes: dict[str, Shape] = {}
        total = 0.0
        for ins in comp.instrs:
            shapes[ins.name] = ins.shape
            attrs = ins.typed
            if ins.opcode in _INLINED:
                total += self.computation_flops(attrs.get("to_apply") or attrs.get("calls"))
            elif ins.opcode == "while":
                trips = _trip_count(self.module.computations.get(attrs.get("condition")), attrs)
                total += self.computation_flops(attrs.get("body")) * (
                    trips if trips is not None else 1)
            else:
                ops = [shapes[o] for o in ins.operands if o in shapes]
                if len(ops) == len(ins.operands):
                    total += op_flops(ins.opcode, ins.shape, ops, attrs)
        self._flops_memo[name] = total
        return total


def _trip_count(cond: RawComputation | None, attrs: dict[str, Any]) -> int | None:
    """Trip count from backend_config, or from a ``i < constant`` loop condition (a negative
    bound counts 0 trips; a bound that is not a finite number, unknown)."""
    m = re.search(r'known_trip_count[^0-9]*(\d+)', str(attrs.get("backend_config", "")))
    if m:
        return int(m.group(1))
    if cond is None:
        return None
    byname = cond.by_name()
    root = byname.get(cond.root)
    if root is None or root.opcode != "compare" or "LT" not in root.attrs.get("direction", ""):
        return None
    rhs = byname.get(root.operands[1]) if len(root.operands) == 2 else None
    if rhs is not None and rhs.opcode == "constant":
        try:
            return max(0, int(float((rhs.literal or "").strip())))
        except (ValueError, OverflowError):  # not a number, or inf/nan: trips unknown
            return None
    return None


def _finish(builder: _Builder, root: int, name: str, origin: str,
            arg_infos: list[ArgInfo] | None, out_paths: list[str] | None) -> HloGraph:
    ops = builder.ops
    root_op = ops[root]
    outputs = list(root_op.operands) if root_op.opcode == "tuple" else [root]
    # Drop structural ops left without users (tuples whose elements were forwarded).
    used = [False] * len(ops)
    for o in outputs:
        used[o] = True
    for op in reversed(ops):
        if used[op.id] or (op.opcode not in ("tuple", "get-tuple-element", "opt-barrier")
                           and op.id not in builder.structural):
            used[op.id] = True
            for x in op.operands:
                used[x] = True
    remap: dict[int, int] = {}
    kept: list[Op] = []
    for op in ops:
        if used[op.id]:
            remap[op.id] = len(kept)
            op.id = len(kept)
            op.operands = tuple(remap[o] for o in op.operands)
            kept.append(op)
    params = sorted((op for op in kept if op.opcode == "parameter"),
                    key=lambda op: op.attrs["parameter_number"])
    for k, p in enumerate(params):
        if arg_infos is not None and k < len(arg_infos):
            p.arg = arg_infos[k]
        else:
            p.arg = ArgInfo(k, p.op_name or p.name, False)
    outputs = [remap[o] for o in outputs]
    if out_paths is None or len(out_paths) != len(outputs):
        out_paths = [f"out[{k}]" for k in range(len(outputs))]
    g = HloGraph(name=name, ops=kept, params=[p.id for p in params], outputs=outputs,
                 output_info=[ArgInfo(k, pth) for k, pth in enumerate(out_paths)],
                 opaque=[op.id for op in kept if op.opcode in _OPAQUE], origin=origin)
    return g


def graph_from_hlo_text(text: str, path: str = "<string>", origin: str = "hlo",
                        arg_infos: list[ArgInfo] | None = None,
                        out_paths: list[str] | None = None) -> HloGraph:
    """Build an ``HloGraph`` from HLO text (see module docstring for the steps).

    Raises:
        HloParseError: malformed or invalid HLO (names the file, line, expected and found).
    """
    module = ht.parse_hlo_text(text, path)
    validate_module(module)
    b = _Builder(module)
    root = b.emit(module.entry, None)
    g = _finish(b, root, module.name, origin, arg_infos, out_paths)
    g.check()
    return g


def _decode(data: bytes, path: str) -> str:
    """UTF-8 text (a leading byte-order mark dropped), or an HloParseError at the first
    byte that is not UTF-8."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise HloParseError(path, line, "UTF-8 text",
                            f"byte 0x{data[e.start]:02x} at column {col}") from None


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise IngestError(f"cannot read {path!r}: {e.strerror}") from None


def _mlir_error(path: str, e: ValueError) -> HloParseError:
    """An MLIR parser/verifier message (``-:LINE:COL: error: ...``) as an HloParseError."""
    msg = str(e)
    m = re.search(r"(?m)^(?:\w+: )?-:(\d+):(\d+): error: (.*)$", msg)
    if m:
        return HloParseError(path, int(m.group(1)), "a valid StableHLO/MLIR module",
                             f"{m.group(3).strip()} (column {m.group(2)})")
    m = re.search(r"line (\d+)", msg)
    return HloParseError(path, int(m.group(1)) if m else None,
                         "a StableHLO/MLIR module jaxlib can convert to HLO", msg.strip())


# A convolution's dim_numbers, e.g. [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f].
_CONV_DIMS_RE = re.compile(r"\[([\w\s,]*)\]\s*x\s*\[([\w\s,]*)\]\s*->\s*\[([\w\s,]*)\]")


def _check_conv_dim_numbers(text: str, path: str) -> None:
    """Reject a spatial dimension number beyond its tensor's rank in a convolution's
    dim_numbers before jaxlib sees it: jaxlib 0.10's MLIR parser builds a list as long as
    that number (2**28 takes 10 s and 2 GiB; larger ones exhaust memory)."""
    for m in _CONV_DIMS_RE.finditer(text):
        for group in m.groups():
            items = [x.strip() for x in group.split(",")]
            for x in items:
                if x.isdigit() and x.isascii() and int(x) >= len(items):
                    raise HloParseError(path, text.count("\n", 0, m.start()) + 1,
                                        "convolution dim_numbers whose spatial dimensions are "
                                        f"numbered below the rank ({len(items)})", x)


def graph_from_mlir_text(text: str, path: str = "<string>") -> HloGraph:
    """Build an ``HloGraph`` from a StableHLO/MHLO module's text, through jaxlib's MLIR
    parser and HLO converter.

    Raises:
        HloParseError: the MLIR parser or verifier rejects the text (at its line), or the HLO
            jaxlib converted it to does not validate (line None: the converted text's line is
            given in ``expected``).
    """
    from rhino._jax_private import stablehlo_text_to_hlo_text
    _check_conv_dim_numbers(text, path)
    try:
        hlo = stablehlo_text_to_hlo_text(text)
    except ValueError as e:
        raise _mlir_error(path, e) from None
    try:
        return graph_from_hlo_text(hlo, path, origin=f"mlir:{path}")
    except HloParseError as e:
        at = f" (line {e.line} of the HLO jaxlib converted it to)" if e.line else ""
        raise HloParseError(path, None, e.expected + at, e.found) from e


def graph_from_file(path: str | os.PathLike) -> HloGraph:
    """Ingest an ``.hlo``/``.txt`` HLO dump or an ``.mlir`` StableHLO module.

    The kind is decided by content: a module starting with ``HloModule`` is HLO text,
    one containing ``module`` / ``func.func`` is MLIR.

    Raises:
        HloParseError: bytes that are not UTF-8, or a malformed or invalid module (names the
            file, the 1-based line where there is one, what was expected and found).
        IngestError: the file cannot be read.
    """
    path = os.fspath(path)
    text = _decode(_read(path), path)
    head = text.lstrip()[:4096]
    if head.startswith("HloModule"):
        return graph_from_hlo_text(text, path, origin=f"hlo:{path}")
    if re.search(r"^\s*(module\b|func\.func\b|#loc)", head, re.M):
        return graph_from_mlir_text(text, path)
    raise HloParseError(path, 1, "an HLO module ('HloModule ...') or an MLIR module "
                        "('module ...')", head.splitlines()[0] if head else "an empty file")


def arg_names(fn: Callable, nargs: int) -> list[str]:
    """The names of ``fn``'s first ``nargs`` positional parameters (``arg<i>`` past them)."""
    target = getattr(fn, "__wrapped__", fn)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else f"arg{i}" for i in range(nargs)]


def graph_from_function(fn: Callable, *args: Any) -> HloGraph:
    """Lower a JAX function on example args (arrays / ShapeDtypeStructs / pytrees)."""
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn, keep_unused=True)
    try:
        lowered = jitted.lower(*args)
    except TypeError as e:
        raise IngestError(f"cannot lower {getattr(fn, '__name__', fn)!r} on the given example "
                          f"arguments: {e}") from e
    text = lowered.as_text(dialect="hlo", debug_info=True)
    names = arg_names(fn, len(args))
    flat, _ = jax.tree_util.tree_flatten_with_path(lowered.args_info[0])
    infos = []
    for k, (path, info) in enumerate(flat):
        head, rest = path[0], path[1:]
        label = names[head.idx] + jax.tree_util.keystr(tuple(rest))
        infos.append(ArgInfo(k, label, bool(getattr(info, "donated", False))))
    from rhino._jax_private import kept_arg_indices
    kept = kept_arg_indices(lowered)
    if kept is not None and len(kept) != len(infos):
        infos = [ArgInfo(j, infos[i].path, infos[i].donated) for j, i in enumerate(kept)]
    out_flat, _ = jax.tree_util.tree_flatten_with_path(lowered.out_info)
    out_paths = ["out" + jax.tree_util.keystr(tuple(p)) for p, _ in out_flat]
    name = getattr(fn, "__name__", "fn")
    return graph_from_hlo_text(text, f"<lowered {name}>", origin=f"jax:{name}",
                               arg_infos=infos, out_paths=out_paths)


def ingest(source: Any, *example_args: Any) -> HloGraph:
    """Turn a JAX function, an HLO text file or a StableHLO/MLIR file into an ``HloGraph``.

    Args:
        source: a callable (jitted or not), or a path (str / PathLike) to a ``.hlo`` text
            dump or an ``.mlir`` StableHLO module.
        *example_args: for callables, the example arguments (arrays, ShapeDtypeStructs or
            pytrees of them); must be empty for files.

    Returns:
        The inlined graph, with FLOPs, bytes, sources and argument paths.

    Raises:
        HloParseError: malformed file (names file, line, expected and found).
        IngestError: a source of the wrong kind, an unreadable file, or bad example args.

    Example:
        >>> import jax.numpy as jnp, rhino
        >>> g = rhino.ingest(lambda x: jnp.sum(x * 2.0), jnp.ones((4,)))
        >>> sorted(g.opcode_histogram())[:3]
        ['broadcast', 'constant', 'multiply']
    """
    if isinstance(source, (str, os.PathLike)):
        if example_args:
            raise IngestError(f"example arguments are only for functions; {source!r} is a "
                              f"file path and got {len(example_args)} of them")
        return graph_from_file(source)
    if callable(source):
        return graph_from_function(source, *example_args)
    raise IngestError(f"expected a JAX function or a path to an .hlo/.mlir file, found "
                      f"{type(source).__name__}")
