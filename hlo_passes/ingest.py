"""Ingestion: a JAX function, an HLO text file or a StableHLO/MLIR file -> ``HloGraph``.

Steps: lower (JAX) or read (files: UTF-8; StableHLO converted by jaxlib) -> HLO text ->
``hlo_text.parse_hlo_text`` -> ``hlo_validate.validate_module`` (what XLA would reject: parameter
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
from typing import Any, Callable

from rhino.errors import HloParseError, IngestError

from . import hlo_text as ht
from .costs import op_flops
from .fusion import BODY_KERNELS, body_profile
from .graph import ArgInfo, HloGraph, Op, Shape, TensorType, flatten_shape
from .hlo_text import RawComputation, RawInstr, RawModule, region_refs
from .hlo_validate import INLINED_OPCODES, validate_module

_OPAQUE = frozenset({"while", "conditional"})
_MAX_CALL_DEPTH = 200


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
        if ins.opcode in INLINED_OPCODES:
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
        if "to_apply" in attrs and ins.opcode not in INLINED_OPCODES:
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
            if ins.opcode in INLINED_OPCODES:
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
            arg_infos: list[ArgInfo] | None, out_paths: list[str] | None,
            aliases: dict[int, int] | None = None) -> HloGraph:
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
    # A step with ordered effects (``jax.debug.print(..., ordered=True)``) is lowered with
    # a runtime token in front of its arguments and its results: not a value of the step.
    # The token parameter is read as a fresh token (``after-all``), the argument numbers
    # and the results are the step's own.
    for p in [p for p in params if _is_token(p.shape)]:
        p.opcode = "after-all"
        p.attrs.pop("parameter_number", None)
    params = [p for p in params if p.opcode == "parameter"]
    # A dump's input_output_alias, renumbered as the token argument and result go.
    param_at = {p.attrs["parameter_number"]: k for k, p in enumerate(params)}
    result_at = {j: k for k, j in enumerate(
        j for j, o in enumerate(outputs) if not _is_token(kept[remap[o]].shape))}
    aliases = tuple((result_at[r], param_at[p]) for r, p in sorted((aliases or {}).items())
                    if r in result_at and p in param_at)
    outputs = [o for o in outputs if not _is_token(kept[remap[o]].shape)]
    for k, p in enumerate(params):
        p.attrs["parameter_number"] = k
    donated = {p for _, p in aliases}
    for k, p in enumerate(params):
        if arg_infos is not None and k < len(arg_infos):
            p.arg = arg_infos[k]
        else:   # a dump: the argument's path as JAX wrote it in op_name, quotes unescaped
            p.arg = ArgInfo(k, (p.op_name or p.name).replace("\\'", "'"), k in donated)
    outputs = [remap[o] for o in outputs]
    if out_paths is None or len(out_paths) != len(outputs):
        out_paths = [f"out[{k}]" for k in range(len(outputs))]
    g = HloGraph(name=name, ops=kept, params=[p.id for p in params], outputs=outputs,
                 output_info=[ArgInfo(k, pth) for k, pth in enumerate(out_paths)],
                 opaque=[op.id for op in kept if op.opcode in _OPAQUE], origin=origin,
                 aliases=aliases)
    return g


def _is_token(shape: Any) -> bool:
    return any(t.dtype == "token" for t in flatten_shape(shape))


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
    g = _finish(b, root, module.name, origin, arg_infos, out_paths,
                module.aliases if arg_infos is None else None)
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
    from rhino.jaxpr.private import stablehlo_text_to_hlo_text
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


def _lower(jitted: Any, args: tuple) -> tuple[Any, list]:
    """``(jitted.lower(*args), custom_partitioning equations)``. A function holding
    ``custom_partitioning`` calls is lowered replicated on two devices (when there are
    two), where JAX keeps each call one ``CustomSPMDPartitioning`` custom call with its
    sharding rule instead of inlining its body, so that the planner splits it by that rule
    (``custom_calls.py``)."""
    import jax

    try:
        traced = jitted.trace(*args)
    except AttributeError:
        return jitted.lower(*args), []
    from rhino.jaxpr.private import custom_partitioning_bodies

    calls = custom_partitioning_bodies(traced.jaxpr) if len(jax.devices()) >= 2 else []
    if not calls:
        return traced.lower(), []
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    two = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("ingest",)), PartitionSpec())
    return jax.jit(jitted, in_shardings=two, keep_unused=True).lower(*args), calls


def _body_flops(graph: HloGraph, calls: list) -> None:
    """Give each ``CustomSPMDPartitioning`` op of ``graph`` the FLOPs of its call's body
    (the function it runs per shard, ingested on its own) and its kernels
    (``fusion.body_profile``, in ``attrs[BODY_KERNELS]``: the cost model prices the call as
    its body runs), matched in program order and by result shapes; calls that do not match
    keep the estimate of ``custom_calls.py``."""
    from .custom_calls import CUSTOM_PARTITIONING

    ops = [op for op in graph.ops if op.opcode == "custom-call"
           and op.attrs.get("custom_call_target") == CUSTOM_PARTITIONING]
    if len(ops) != len(calls):
        return
    memo: dict[str, tuple] = {}      # a layer's calls are the same body: ingested once
    for op, (fn, ins, outs, key) in zip(ops, calls):
        if outs != [t.dims for t in flatten_shape(op.shape)]:
            continue
        if key not in memo:
            body = graph_from_function(fn, *ins)
            memo[key] = (body.total_flops, body_profile(body))
        op.flops = memo[key][0]
        op.attrs[BODY_KERNELS] = memo[key][1]


def graph_from_function(fn: Callable, *args: Any) -> HloGraph:
    """Lower a JAX function on example args (arrays / ShapeDtypeStructs / pytrees)."""
    import jax

    from rhino.hlo_passes.unroll import unrolled_function

    if hasattr(fn, "lower"):
        jitted = fn
    else:
        try:
            unrolled = unrolled_function(fn, *args)   # scans over layers written out
        except TypeError as e:
            raise IngestError(f"cannot lower {getattr(fn, '__name__', fn)!r} on the given "
                              f"example arguments: {e}") from e
        jitted = jax.jit(unrolled or fn, keep_unused=True)
    try:
        lowered, calls = _lower(jitted, args)
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
    from rhino.jaxpr.private import kept_arg_indices
    kept = kept_arg_indices(lowered)
    if kept is not None and len(kept) != len(infos):
        infos = [ArgInfo(j, infos[i].path, infos[i].donated) for j, i in enumerate(kept)]
    out_flat, _ = jax.tree_util.tree_flatten_with_path(lowered.out_info)
    out_paths = ["out" + jax.tree_util.keystr(tuple(p)) for p, _ in out_flat]
    name = getattr(fn, "__name__", "fn")
    graph = graph_from_hlo_text(text, f"<lowered {name}>", origin=f"jax:{name}",
                                arg_infos=infos, out_paths=out_paths)
    graph.arg_names = tuple(names)
    if calls:
        _body_flops(graph, calls)
    return graph


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
