"""A reference run of a step the way its pipeline runs it (``rhino.jaxpr.microbatch``).

``simulate`` evaluates the step's flat program on concrete arguments in one place, as the
stage programs would over the microbatches: values read whole computed whole (the
prologue), per-microbatch equations once per microbatch on their slices (blocks of pairs
included), per-step equations once on sums and concatenations. The stage programs are
tested against it, and it checks a layout (every per-microbatch result has its
microbatch shape).
"""

from __future__ import annotations

from typing import Any, Sequence

from rhino.jaxpr import primitives as prims
from rhino.jaxpr.interpret import FlatProgram, Lit
from rhino.jaxpr.microbatch import MicrobatchError, MicrobatchLayout, Place
from rhino.jaxpr.private import eqn_source


def _combine(op: str, parts: list) -> Any:
    import jax.numpy as jnp

    out = parts[0]
    for x in parts[1:]:
        out = out + x if op == "sum" else jnp.maximum(out, x) if op == "max" \
            else jnp.minimum(out, x)
    return out


def simulate(flat: FlatProgram, layout: MicrobatchLayout, args: Sequence[Any]) -> list[Any]:
    """Run ``flat`` on ``args`` the way the pipelined step runs it, in one place: values
    read whole are computed whole (the prologue), per-microbatch equations once per
    microbatch on their slices, per-step equations once on sums and concatenations. The
    reference the stage programs are tested against (and a check of ``layout``: every
    per-microbatch result has its microbatch shape).

    Raises:
        MicrobatchError: a per-microbatch result of another shape than ``mb_shapes``.
    """
    import jax
    import jax.numpy as jnp

    from rhino.jaxpr.private import bind

    m = layout.num_microbatches
    producer = {r: i for i, fe in enumerate(flat.eqns) for r in fe.outs if r is not None}
    whole: dict[int, Any] = dict(flat.consts)
    whole.update(enumerate(args))
    parts: list[dict[int, Any]] = [dict() for _ in range(m)]

    def read_whole(x: Any) -> Any:
        """A value whole (the prologue's form of a value computed from the batch)."""
        if isinstance(x, Lit):
            return x.value
        if x not in whole:
            fe = flat.eqns[producer[x]]
            outs = bind(fe.eqn, [read_whole(y) for y in fe.ins])
            for r, v in zip(fe.outs, outs):
                if r is not None:
                    whole[r] = v
        return whole[x]

    def finished(x: Any) -> Any:
        lay = layout.layout[x]
        if lay.kind == "partial":
            return _combine(lay.op, [parts[k][x] for k in range(m)])
        if lay.kind == "split":
            if lay.pair is not None:
                raise MicrobatchError(f"value #{x} over pairs of the batch ({lay}) read "
                                      f"whole: only its diagonal blocks are computed")
            return jnp.concatenate([parts[k][x] for k in range(m)], axis=lay.axis)
        if lay.kind == "local":
            return sum(parts[k][x] for k in range(m)) / m
        return read_whole(x)

    def chunk(x: Any, axis: int, k: int) -> Any:
        size = x.shape[axis] // m
        return jax.lax.slice_in_dim(x, k * size, (k + 1) * size, axis=axis)

    for r in range(flat.num_args):
        lay = layout.layout[r]
        if lay.kind == "split":
            for k in range(m):
                parts[k][r] = chunk(jnp.asarray(args[r]), lay.axis, k)
    for i, fe in enumerate(flat.eqns):
        where = layout.place[i]
        if where in (Place.FREE, Place.PROLOGUE):
            if any(r is not None and r not in whole for r in fe.outs):
                outs = bind(fe.eqn, [read_whole(y) for y in fe.ins])
                whole.update((r, v) for r, v in zip(fe.outs, outs) if r is not None)
            continue
        if where is Place.POST:
            vals = []
            for j, x in enumerate(fe.ins):
                vals.append(x.value if isinstance(x, Lit) else finished(x))
            outs = bind(fe.eqn, vals)
            whole.update((r, v) for r, v in zip(fe.outs, outs) if r is not None)
            continue
        params = layout.params.get(i)
        for k in range(m):
            vals = []
            for j, x in enumerate(fe.ins):
                use = layout.use(i, j)
                if isinstance(x, Lit):
                    vals.append(x.value)
                elif use is None:
                    vals.append(parts[k][x] if layout.layout[x].per_microbatch
                                else read_whole(x))
                elif use.kind == "slice":
                    base = parts[k][x] if layout.layout[x].per_microbatch else read_whole(x)
                    v = chunk(base, use.axis, k)
                    vals.append(v if use.pair is None else chunk(v, use.pair, k))
                elif use.kind == "whole":
                    vals.append(read_whole(x))
                elif use.kind == "local":
                    v = parts[k][x] * m if layout.layout[x].op == "sum" else parts[k][x]
                    vals.append(v if use.axis is None else chunk(v, use.axis, k))
                else:
                    raise MicrobatchError(f"equation {fe.path}: use {use} per microbatch")
            outs = bind(fe.eqn, vals, params)
            for r, v in zip(fe.outs, outs):
                if r is None:
                    continue
                want = layout.mb_shapes.get(r)
                if want is not None and tuple(v.shape) != want:
                    raise MicrobatchError(f"{prims.name(fe.eqn)} at {eqn_source(fe.eqn)}: "
                                          f"expected a microbatch result of shape {want}, "
                                          f"found {tuple(v.shape)}")
                parts[k][r] = v
    return [x.value if isinstance(x, Lit) else finished(x) for x in flat.outs]
