"""Ingestion: a JAX function, an HLO text file or a StableHLO/MLIR file -> ``HloGraph``.

Steps: lower (JAX) or read (files) -> HLO text -> ``hlo_text.parse_hlo_text`` -> inline
``call``/``fusion`` computations from the entry, forward ``get-tuple-element(tuple(...))``,
drop the structural tuples left dead -> typed attributes, FLOPs, bytes, sources -> attach
argument/output pytree paths and donation.

Example:
    >>> import jax, jax.numpy as jnp, rhino
    >>> g = rhino.ingest(lambda p, x: x @ p["w"], {"w": jnp.ones((4, 2))}, jnp.ones((8, 4)))
    >>> [g.ops[p].arg.path for p in g.params]
    ["p['w']", 'x']
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any, Callable

from rhino.errors import HloParseError, IngestError

from . import hlo_text as ht
from .costs import op_flops
from .graph import ArgInfo, HloGraph, Op, Shape, TensorType, flatten_shape

_INT_LIST_KEYS = frozenset({
    "dimensions", "lhs_batch_dims", "lhs_contracting_dims", "rhs_batch_dims",
    "rhs_contracting_dims", "offset_dims", "collapsed_slice_dims", "start_index_map",
    "slice_sizes", "update_window_dims", "inserted_window_dims",
    "scatter_dims_to_operand_dims", "operand_batching_dims", "start_indices_batching_dims",
    "input_batching_dims", "scatter_indices_batching_dims", "dynamic_slice_sizes",
})
_INT_KEYS = frozenset({"index", "iota_dimension", "index_vector_dim", "feature_group_count",
                       "batch_group_count"})
_REGION_KEYS = ("to_apply", "calls", "body", "condition", "true_computation",
                "false_computation", "branch_computations")
_INLINED = frozenset({"call", "fusion"})
_OPAQUE = frozenset({"while", "conditional"})


def typed_attrs(raw: dict[str, str]) -> dict[str, Any]:
    """Decode the attributes a planner reads; others stay strings (metadata is dropped)."""
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if k == "metadata":
            continue
        if k in _INT_LIST_KEYS:
            out[k] = ht.parse_int_list(v)
        elif k in _INT_KEYS:
            out[k] = int(v)
        elif k == "slice":
            out[k] = ht.parse_slice(v)
        elif k == "padding":
            out[k] = ht.parse_padding(v)
        elif k == "window":
            out[k] = ht.parse_window(v)
        elif v.startswith('"') and v.endswith('"'):
            out[k] = v[1:-1]
        else:
            out[k] = v.lstrip("%") if k in _REGION_KEYS else v
    return out


class _Builder:
    """Inlines a RawModule into a flat op list."""

    def __init__(self, module: ht.RawModule):
        self.module = module
        self.ops: list[Op] = []
        self.emitted: dict[str, int] = {}
        self.names: set[str] = set()
        self._flops_memo: dict[str, float] = {}

    def _unique(self, name: str) -> str:
        if name not in self.names:
            self.names.add(name)
            return name
        k = 1
        while f"{name}.i{k}" in self.names:
            k += 1
        self.names.add(f"{name}.i{k}")
        return f"{name}.i{k}"

    def emit(self, comp: ht.RawComputation, args: list[int] | None, depth: int = 0) -> int:
        """Emit ``comp``'s instructions; returns the id standing for its root."""
        if depth > 64:
            raise IngestError(f"call nesting deeper than 64 at computation {comp.name!r}")
        local: dict[str, int] = {}
        path = self.module.path
        for ins in comp.instrs:
            try:
                operand_ids = [local[o] for o in ins.operands]
            except KeyError as e:
                raise HloParseError(path, ins.line, f"an operand defined earlier in "
                                    f"{comp.name!r}", str(e.args[0])) from None
            if ins.opcode == "parameter" and args is not None:
                local[ins.name] = args[int(ins.literal or 0)]
                continue
            attrs = typed_attrs(ins.attrs)
            if ins.opcode in _INLINED:
                callee = self._callee(ins, attrs)
                local[ins.name] = self.emit(callee, operand_ids, depth + 1)
                continue
            if ins.opcode == "get-tuple-element":
                src = self.ops[operand_ids[0]]
                if src.opcode == "tuple":
                    local[ins.name] = src.operands[attrs["index"]]
                    continue
            local[ins.name] = self._new_op(ins, attrs, operand_ids)
        if comp.root not in local:
            raise HloParseError(path, comp.line, f"ROOT {comp.root!r} defined in {comp.name!r}",
                                "no such instruction")
        return local[comp.root]

    def _callee(self, ins: ht.RawInstr, attrs: dict[str, Any]) -> ht.RawComputation:
        name = attrs.get("to_apply") or attrs.get("calls")
        comp = self.module.computations.get(name) if name else None
        if comp is None:
            raise HloParseError(self.module.path, ins.line,
                                f"a computation named by to_apply/calls of {ins.opcode}",
                                str(name))
        return comp

    def _new_op(self, ins: ht.RawInstr, attrs: dict[str, Any], operand_ids: list[int]) -> int:
        md = ht.parse_metadata(ins.attrs["metadata"]) if "metadata" in ins.attrs else {}
        if ins.opcode == "parameter":
            attrs["parameter_number"] = int(ins.literal or 0)
        elif ins.opcode == "constant":
            lit = ins.literal or ""
            attrs["literal"] = lit if len(lit) <= 64 else lit[:61] + "..."
        operand_shapes = [self.ops[o].shape for o in operand_ids]
        if "to_apply" in attrs and ins.opcode not in _INLINED:
            attrs["reducer"] = self._reducer(attrs["to_apply"])
        flops = op_flops(ins.opcode, ins.shape, operand_shapes, attrs)
        if ins.opcode in _OPAQUE:
            flops = self._opaque(ins, attrs)
        op = Op(id=len(self.ops), name=self._unique(ins.name), opcode=ins.opcode,
                shape=ins.shape, operands=tuple(operand_ids), attrs=attrs, flops=flops,
                out_bytes=sum(t.nbytes for t in flatten_shape(ins.shape)),
                op_name=md.get("op_name", ""), source=self.module.source_of(md))
        self.ops.append(op)
        return op.id

    def _reducer(self, comp_name: str) -> str | tuple[str, ...]:
        comp = self.module.computations.get(comp_name)
        if comp is None:
            return "unknown"
        root = comp.by_name()[comp.root]
        if root.opcode == "tuple":
            byname = comp.by_name()
            return tuple(byname[o].opcode for o in root.operands)
        return root.opcode

    def _opaque(self, ins: ht.RawInstr, attrs: dict[str, Any]) -> float:
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
            attrs = typed_attrs(ins.attrs)
            if ins.opcode in _INLINED:
                total += self.computation_flops(attrs.get("to_apply") or attrs.get("calls"))
            elif ins.opcode == "while":
                trips = _trip_count(self.module.computations.get(attrs.get("condition")), attrs)
                total += self.computation_flops(attrs.get("body")) * (trips or 1)
            else:
                ops = [shapes[o] for o in ins.operands if o in shapes]
                if len(ops) == len(ins.operands):
                    total += op_flops(ins.opcode, ins.shape, ops, attrs)
        self._flops_memo[name] = total
        return total


def _trip_count(cond: ht.RawComputation | None, attrs: dict[str, Any]) -> int | None:
    """Trip count from backend_config, or from a ``i < constant`` loop condition."""
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
            return int(float((rhs.literal or "").strip()))
        except ValueError:
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
        if used[op.id] or op.opcode not in ("tuple", "get-tuple-element"):
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
    """Build an ``HloGraph`` from HLO text (see module docstring for the steps)."""
    module = ht.parse_hlo_text(text, path)
    b = _Builder(module)
    root = b.emit(module.entry, None)
    return _finish(b, root, module.name, origin, arg_infos, out_paths)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise IngestError(f"cannot read {path!r}: {e.strerror}") from None


def graph_from_file(path: str | os.PathLike) -> HloGraph:
    """Ingest an ``.hlo``/``.txt`` HLO dump or an ``.mlir`` StableHLO module.

    The kind is decided by content: a module starting with ``HloModule`` is HLO text,
    one containing ``module`` / ``func.func`` is MLIR.
    """
    path = os.fspath(path)
    text = _read(path)
    head = text.lstrip()[:4096]
    if head.startswith("HloModule"):
        return graph_from_hlo_text(text, path, origin=f"hlo:{path}")
    if re.search(r"^\s*(module\b|func\.func\b|#loc)", head, re.M):
        from rhino._jax_private import stablehlo_text_to_hlo_text
        try:
            hlo = stablehlo_text_to_hlo_text(text)
        except ValueError as e:
            msg = str(e)
            m = re.search(r":(\d+):\d+: error: (.*)", msg) or re.search(r"line (\d+)", msg)
            line = int(m.group(1)) if m else None
            found = m.group(2) if (m and m.lastindex and m.lastindex >= 2) else msg.strip()
            raise HloParseError(path, line, "a valid StableHLO/MLIR module", found) from None
        return graph_from_hlo_text(hlo, path, origin=f"mlir:{path}")
    raise HloParseError(path, 1, "an HLO module ('HloModule ...') or an MLIR module "
                        "('module ...')", head.splitlines()[0] if head else "an empty file")


def _arg_names(fn: Callable, nargs: int) -> list[str]:
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
    names = _arg_names(fn, len(args))
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
