"""Evaluating a flat program's equations per microbatch (``rhino.jaxpr.microbatch``): an
operand read the way its equation reads it (``read_operand``: a whole value's chunk, a
partial value as the microbatch's own estimate), an equation bound at microbatch shapes
(``bind_micro``: rewritten parameters, nested bodies run per microbatch). One evaluator for
the stage programs (``hlo_passes.stage_programs``), the reference run (``simulate``) and
the bodies of control flow and custom calls (``rhino.jaxpr.bodies``).

Example:
    >>> import jax.numpy as jnp
    >>> chunk(jnp.arange(8), 0, 1, 4).tolist()           # microbatch 1 of 4
    [2, 3]
    >>> chunk(jnp.arange(8), 0, 1, 4, group=2).tolist()  # its part of each of 2 groups
    [1, 5]
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from rhino.jaxpr import primitives as prims
from rhino.jaxpr.interpret import FlatProgram, Lit
from rhino.jaxpr.layouts import MicrobatchError, MicrobatchLayout, Place
from rhino.jaxpr.private import bind, eqn_context


def chunk(x: Any, axis: int, mb: Any, m: int, group: int | None = None) -> Any:
    """Microbatch ``mb``'s chunk of ``x`` along ``axis`` (of ``m`` equal ones); with
    ``group``, the dimension is ``group`` equal blocks and the microbatch takes its chunk
    of each (``Layout.group``)."""
    import jax

    n = x.shape[axis]
    if not group or group == 1:
        size = n // m
        if isinstance(mb, (int, np.integer)):
            return jax.lax.slice_in_dim(x, int(mb) * size, (int(mb) + 1) * size, axis=axis)
        return jax.lax.dynamic_slice_in_dim(x, mb * size, size, axis=axis)
    shape = x.shape[:axis] + (group, n // group) + x.shape[axis + 1:]
    part = chunk(x.reshape(shape), axis + 1, mb, m)
    return part.reshape(x.shape[:axis] + (n // m,) + x.shape[axis + 1:])


def place_chunk(acc: Any, x: Any, axis: int, mb: Any, m: int, group: int | None = None
                ) -> Any:
    """``acc`` (a whole value) with microbatch ``mb``'s chunk ``x`` written in its place
    along ``axis`` (the inverse of ``chunk``)."""
    import jax

    if not group or group == 1:
        start = [0] * x.ndim
        start[axis] = mb * x.shape[axis]
        return jax.lax.dynamic_update_slice(acc, x, start)
    n = acc.shape[axis]
    whole = acc.reshape(acc.shape[:axis] + (group, n // group) + acc.shape[axis + 1:])
    part = x.reshape(x.shape[:axis] + (group, x.shape[axis] // group) + x.shape[axis + 1:])
    return place_chunk(whole, part, axis + 1, mb, m).reshape(acc.shape)


def read_operand(layout: MicrobatchLayout, i: int, j: int, x: Any, own: Mapping,
                 whole: Mapping, mb: Any) -> Any:
    """Operand ``j`` (``x``) of equation ``i`` as the equation reads it per microbatch
    (``Use``): ``own`` holds the microbatch's values, ``whole`` values computed whole (a
    ref may be in both: a batch argument sliced by some equations and read whole by
    others)."""
    v = _read(layout, i, j, x, own, whole, mb)
    use = layout.use(i, j)
    if use is not None and use.rebase is not None:
        import jax.numpy as jnp

        k, size = use.rebase
        shift = jnp.zeros(v.shape[-1], v.dtype).at[k].set(mb * size)
        v = v - shift
    return v


def _read(layout: MicrobatchLayout, i: int, j: int, x: Any, own: Mapping, whole: Mapping,
          mb: Any) -> Any:
    use = layout.use(i, j)
    m = layout.num_microbatches
    if isinstance(x, Lit):
        if use is not None and use.kind == "divided":
            return x.value // m
        return x.value
    if use is None or use.kind == "rebase":
        if x in own:
            return own[x]
        lay = layout.layout[x]
        if lay.kind == "split" and lay.pair is None:     # a batch argument given whole
            return chunk(whole[x], lay.axis, mb, m, lay.group)
        return whole[x]
    if use.kind == "slice":
        mine = layout.layout[x].per_microbatch      # local, or split along another dim
        base = own[x] if (mine or x not in whole) and x in own else whole[x]
        base = chunk(base, use.axis, 0 if use.steady else mb, m, use.group)
        return base if use.pair is None else chunk(base, use.pair, mb, m)   # its block
    if use.kind == "local":
        import jax.numpy as jnp

        v = own[x]
        if layout.layout[x].op == "sum":
            v = v * np.asarray(m, dtype=jnp.result_type(v))
        return v if use.axis is None else chunk(v, use.axis, mb, m)
    if use.kind == "divided":           # an offset into blocks: the microbatch's chunk's
        v = own[x] if x in own else whole[x]
        return v // np.asarray(m, dtype=getattr(v, "dtype", np.int32))
    return whole[x] if x in whole else own[x]        # whole / total / concat


def bind_micro(flat: FlatProgram, layout: MicrobatchLayout, i: int, vals: list, mb: Any
               ) -> list:
    """Equation ``i`` of ``flat`` bound on ``vals`` (per microbatch with its rewritten
    parameters or its bodies run per microbatch), its per-microbatch results checked
    against their microbatch shapes.

    Raises:
        MicrobatchError: a result of another shape than its microbatch shape.
    """
    fe = flat.eqns[i]
    nested = layout.bodies.get(i) if layout.place[i] is Place.MICRO else None
    with eqn_context(fe.eqn):
        if nested is not None:
            outs = nested.bind(fe.eqn, vals, mb, layout.num_microbatches)
        else:
            outs = bind(fe.eqn, vals, layout.params.get(i))
    if layout.place[i] is Place.MICRO:
        for r, v in zip(fe.outs, outs):
            want = layout.mb_shapes.get(r) if r is not None else None
            if want is not None and tuple(v.shape) != tuple(want):
                raise MicrobatchError(
                    f"{prims.name(fe.eqn)} at {flat.source(fe) or 'an unknown line'}: "
                    f"expected a result of microbatch shape {tuple(want)}, found "
                    f"{tuple(v.shape)}")
    return outs
