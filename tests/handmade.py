"""Hand-built HloGraphs and small steps for tests whose answers are known on paper."""

from __future__ import annotations

from rhino.hlo_passes.graph import ArgInfo, HloGraph, Op, TensorType


def make_graph(spec: list[tuple[str, str, list[str]]], outputs: list[str] | None = None,
               nbytes: dict[str, int] | None = None) -> HloGraph:
    """Build a graph from ``(name, opcode, operand names)`` rows in topological order.

    Every value is an f32[n] array with n = nbytes[name] // 4 (default 1 element).
    Outputs default to the ops without users.
    """
    ids: dict[str, int] = {}
    ops: list[Op] = []
    params = []
    for name, opcode, operands in spec:
        nb = (nbytes or {}).get(name, 4)
        op = Op(id=len(ops), name=name, opcode=opcode, shape=TensorType("f32", (nb // 4,)),
                operands=tuple(ids[o] for o in operands), attrs={}, out_bytes=nb)
        if opcode == "parameter":
            op.arg = ArgInfo(len(params), name)
            op.attrs["parameter_number"] = len(params)
            params.append(op.id)
        ids[name] = op.id
        ops.append(op)
    if outputs is None:
        used = {o for op in ops for o in op.operands}
        outputs = [op.name for op in ops if op.id not in used]
    outs = [ids[o] for o in outputs]
    g = HloGraph(name="handmade", ops=ops, params=params, outputs=outs,
                 output_info=[ArgInfo(k, o) for k, o in enumerate(outputs)], opaque=[],
                 origin="test")
    g.check()
    return g


def names(g: HloGraph, ids) -> list[str]:
    return [g.ops[i].name for i in ids]


def ffn_layernorm_step(p, x):
    """x0 = x @ w0; a pre-layernorm FFN with a residual, one SGD step: the backward of the
    FFN's first matmul feeds the layernorm backward, which reads it three times (GPT's
    pattern). ``p``: ``{"w0": [H, H], "w1": [H, F], "w2": [F, H]}``, ``x``: [T, H]."""
    import jax
    import jax.numpy as jnp

    def ln(v):
        m = jnp.mean(v, -1, keepdims=True)
        return (v - m) * jax.lax.rsqrt(jnp.mean((v - m) ** 2, -1, keepdims=True) + 1e-5)

    def loss(p):
        x0 = x @ p["w0"]
        return jnp.mean((x0 + jax.nn.relu(ln(x0) @ p["w1"]) @ p["w2"]) ** 2)
    grads = jax.grad(loss)(p)
    return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)
