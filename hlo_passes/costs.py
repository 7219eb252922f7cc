"""FLOP counts of HLO ops (a multiply-add counts 2), from shapes and typed attributes.

Example:
    >>> from rhino.hlo_passes.graph import TensorType as T
    >>> op_flops("dot", T("f32", (8, 2)), [T("f32", (8, 4)), T("f32", (4, 2))],
    ...          {"lhs_contracting_dims": (1,)})
    128.0
"""

from __future__ import annotations

from typing import Any, Sequence

from .graph import Shape, TensorType, flatten_shape

# Ops that cost about one FLOP per output element.
ELEMENTWISE = frozenset({
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "compare", "complex", "convert",
    "cosine", "divide", "erf", "exponential", "exponential-minus-one", "floor", "imag",
    "is-finite", "log", "log-plus-one", "logistic", "maximum", "minimum", "multiply", "negate",
    "not", "or", "popcnt", "power", "real", "reduce-precision", "remainder", "round-nearest-afz",
    "round-nearest-even", "rsqrt", "select", "shift-left", "shift-right-arithmetic",
    "shift-right-logical", "sign", "sine", "sqrt", "subtract", "tan", "tanh", "xor",
    "stochastic-convert", "bitcast-convert", "clz", "count-leading-zeros", "mulhi",
})

# Ops that cost a multi-FLOP evaluation per element (transcendentals count the same here).
COMPUTE_INTENSIVE = frozenset({"dot", "convolution"})


def _numel(shape: Shape) -> int:
    return sum(t.numel for t in flatten_shape(shape))


def op_flops(opcode: str, shape: Shape, operand_shapes: Sequence[Shape],
             attrs: dict[str, Any]) -> float:
    """FLOPs of one op. Data movement (reshape, slice, gather, ...) counts zero."""
    if opcode == "dot":
        lhs = operand_shapes[0]
        k = 1
        for d in attrs.get("lhs_contracting_dims", ()):
            k *= lhs.dims[d]
        return 2.0 * _numel(shape) * k
    if opcode == "convolution":
        kernel: TensorType = operand_shapes[1]
        labels = str(attrs.get("dim_labels", ""))
        per_out = kernel.numel
        if "_" in labels and "->" in labels:
            klabels = labels.split("_", 1)[1].split("->", 1)[0]
            if len(klabels) == kernel.rank and "o" in klabels:
                per_out = kernel.numel // max(1, kernel.dims[klabels.index("o")])
        return 2.0 * _numel(shape) * per_out
    if opcode in ELEMENTWISE:
        return float(_numel(shape))
    if opcode in ("reduce", "all-reduce", "reduce-scatter"):
        n = len(operand_shapes) // 2 if opcode == "reduce" else len(operand_shapes)
        return float(sum(_numel(s) for s in operand_shapes[:max(1, n)]))
    if opcode == "reduce-window":
        win = attrs.get("window", {}).get("size", ())
        w = 1
        for x in win:
            w *= x
        return float(_numel(shape) * w)
    if opcode in ("scatter", "select-and-scatter"):
        return float(_numel(operand_shapes[-1]))
    if opcode == "custom-call":
        from .custom_calls import custom_call_flops
        return custom_call_flops(attrs, operand_shapes, shape)
    return 0.0
