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

from rhino.jaxpr.interpret import FlatProgram, Lit
from rhino.jaxpr.mb_eval import bind_micro, chunk, place_chunk, read_operand
from rhino.jaxpr.microbatch import MicrobatchError, MicrobatchLayout, Place


def _combine(op: str, parts: list) -> Any:
    """The parts of a partial value combined as the stage programs accumulate them (sums
    of lower-precision floats in float32, returned to their own type)."""
    import jax.numpy as jnp

    if op == "sum":
        dt = jnp.result_type(parts[0])
        wide = jnp.issubdtype(dt, jnp.floating) and jnp.finfo(dt).bits < 32
        out = sum(x.astype(jnp.float32) if wide else x for x in parts)
        return out.astype(dt)
    out = parts[0]
    for x in parts[1:]:
        out = jnp.maximum(out, x) if op == "max" else jnp.minimum(out, x)
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
            out = jnp.zeros(flat.avals[x].shape, parts[0][x].dtype)
            for k in range(m):
                out = place_chunk(out, parts[k][x], lay.axis, k, m, lay.group)
            return out
        if lay.kind == "local":
            return sum(parts[k][x] for k in range(m)) / m
        return read_whole(x)

    for r in range(flat.num_args):
        lay = layout.layout[r]
        if lay.kind == "split":
            for k in range(m):
                parts[k][r] = chunk(jnp.asarray(args[r]), lay.axis, k, m, lay.group)
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
        for k in range(m):
            own = parts[k]
            for j, x in enumerate(fe.ins):    # values read whole (computed on demand)
                use = layout.use(i, j)
                if isinstance(x, int) and (not layout.layout[x].per_microbatch or (
                        use is not None and use.kind == "whole")):
                    read_whole(x)
            vals = [read_operand(layout, i, j, x, own, whole, k) for j, x in enumerate(fe.ins)]
            for r, v in zip(fe.outs, bind_micro(flat, layout, i, vals, k)):
                if r is not None:
                    parts[k][r] = v
    return [x.value if isinstance(x, Lit) else finished(x) for x in flat.outs]
