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


def _dense(key, n, d):
    import jax

    return [jax.random.normal(k, (d, d)) / d ** 0.5 for k in jax.random.split(key, n)]


def frozen_front_step(batch: int = 16, d: int = 64):
    """A step whose first four layers are frozen (an argument it reads and never trains)
    and whose last two are trained with SGD; it returns the new weights, the loss and the
    number of positive features of the first frozen layer. Pipelined in two stages, stage 0
    holds only the frozen layers: its backward and apply tasks are empty, and the loss
    (stage 1) and the count (stage 0) are results of different stages.

    Returns:
        ``(step, args, options)``: ``args = (params, frozen, x, y)``; ``options`` for
        ``rhino.auto_parallel`` (``batch_args``: the frozen layers are no batch).
    """
    import jax
    import jax.numpy as jnp

    def step(params, frozen, x, y):
        h = jnp.tanh(x @ frozen[0])
        active = jnp.sum(h > 0)
        for w in frozen[1:]:
            h = jnp.tanh(h @ w)

        def loss_fn(p):
            z = h
            for w in p:
                z = jnp.tanh(z @ w)
            return jnp.mean((z - y) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(params)
        return [w - 0.1 * d for w, d in zip(params, g)], loss, active

    k = jax.random.split(jax.random.key(0), 4)
    args = (_dense(k[0], 2, d), _dense(k[1], 4, d), jax.random.normal(k[2], (batch, d)),
            jax.random.normal(k[3], (batch, d)))
    return step, args, {"batch_args": ("x", "y")}


def loss_only_last_step(batch: int = 16, d: int = 64):
    """Two trained layers, then a loss with no weights that costs as much as they do
    (per example: products of the features with themselves): pipelined in two stages,
    stage 1 is only the loss, so its apply task is empty. Returns ``(step, args,
    options)``, ``args = (params, x, y)``."""
    import jax
    import jax.numpy as jnp

    def step(params, x, y):
        def loss_fn(p):
            h = x
            for w in p:
                h = jnp.tanh(h @ w)
            z = jnp.einsum("bi,bj->bij", h, h)
            for _ in range(3):
                z = jnp.tanh(z @ z)
            return jnp.mean(z) + jnp.mean((h - y) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(params)
        return [w - 0.1 * d for w, d in zip(params, g)], loss

    k = jax.random.split(jax.random.key(0), 3)
    args = (_dense(k[0], 2, d), jax.random.normal(k[1], (batch, d)),
            jax.random.normal(k[2], (batch, d)))
    return step, args, {}


def assert_trains_like_jit(step, reference, params, opt, batch, steps: int = 3,
                           loss_rtol: float = 1e-5, atol: float = 5e-5):
    """Run ``steps`` training steps of ``step`` and of ``reference`` (``jax.jit`` of the
    same function) from copies of one state; losses agree to ``loss_rtol`` at every step
    and the parameters at the end to rtol 1e-4 and ``atol`` (Adam moves an element whose
    gradient is ~0 by up to a fraction of a step under another summation order). Returns
    ``step``'s parameters."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    p0, o0 = params, opt
    p1, o1 = jax.tree.map(jnp.copy, (params, opt))
    for _ in range(steps):
        p0, o0, l0 = reference(p0, o0, batch)
        p1, o1, l1 = step(p1, o1, batch)
        np.testing.assert_allclose(float(l1), float(l0), rtol=loss_rtol)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=atol)
    return p1
