"""Bodies per microbatch: control flow and calls with a body of their own whose operands are
per-microbatch values (``rhino.jaxpr.microbatch``).

The step's flat program inlines calls, custom derivatives and checkpoints, and rhino
unrolls scans of at most ``UNROLL_LIMIT`` iterations; what is left holding a body is a
``cond`` with heavy branches, a ``while`` loop, a long ``scan`` and a
``custom_partitioning`` call (a fused kernel with its sharding rule). Such an equation is
computed per microbatch when its bodies are: each body is flattened and analysed by the
same analysis as the step, under the layouts its operands have, and must then compute
every value per microbatch or from whole values alone (nothing needs the whole batch
inside it). Its results take the body's layouts:

===================  ===================================================================
``cond``             the branch index whole; every branch under the operands' layouts;
                     the branches' results joined (a whole result where another branch's
                     is split is chunked; zeros where another's is a partial sum stay)
``while``            the carry's layouts to a fixed point: the body's results joined
                     with the carry's (a whole initial value of a split carry read as
                     its chunk, a partial carry started from zeros); the condition whole:
                     every microbatch runs as many iterations as the step
``scan``             as ``while`` over the carry; a scanned input split along another
                     dimension than the scanned one (that dimension, less one, in the
                     body); its stacked results split one dimension further
``custom_partitioning``  its body (``call``) under the operands' layouts; bound again
                     with that body traced at microbatch shapes (its partitioner traces
                     its own function at the shapes it is given)
``custom_linear_solve``  its ``solve`` function (what it computes; the rest serves its
                     derivatives, taken already), run per microbatch
===================  ===================================================================

Per microbatch the equation runs its bodies per microbatch (``Nested.bind``): a ``cond``
as ``lax.switch``, a loop as ``lax.while_loop`` / ``lax.scan`` over the bodies evaluated
by ``mb_eval``, which computes what the equation computes on the microbatch's values.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from rhino.jaxpr.layouts import WHOLE, split
    >>> def f(w, x):      # a loop over iterations, per example
    ...     return jax.lax.while_loop(lambda c: c[0] < 3,
    ...                               lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]
    >>> eqn = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((8, 4))).eqns[0]
    >>> from rhino.jaxpr.microbatch import analyze
    >>> got = rule(eqn, [WHOLE, WHOLE, split(0)], 4, lambda x: False, analyze)
    >>> [str(x) for x in got.outs]
    ['whole', 'split(0)']
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Sequence

from rhino.jaxpr import primitives as prims
from rhino.jaxpr.interpret import FlatProgram, Lit, flatten
from rhino.jaxpr.layouts import WHOLE, Layout, MicrobatchLayout, Outcome, Place, Use, split
from rhino.jaxpr.mb_eval import bind_micro, chunk, read_operand
from rhino.jaxpr.private import bind, bind_params, eqn_context

CUSTOM_PARTITIONING, LINEAR_SOLVE = prims.CUSTOM_PARTITIONING, prims.LINEAR_SOLVE
NAMES = frozenset({prims.COND, prims.WHILE, prims.SCAN, CUSTOM_PARTITIONING, LINEAR_SOLVE})


def _solve_operands(eqn: Any) -> tuple[int, int, int]:
    """``custom_linear_solve``'s operands: ``(first solve constant, solve constants, first
    right-hand side)``; its value is its ``solve`` function on those (the others serve
    its derivatives)."""
    c = eqn.params["const_lengths"]
    return c.matvec + c.vecmat, c.solve, c.matvec + c.vecmat + c.solve + c.transpose_solve


class Refused(Exception):
    """A body that cannot run per microbatch (the reason names its equation)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
    """A body analysed per microbatch.

    Attributes:
        flat: its flat program; layout: its analysis.
        outs: its results' layouts as computed; want: as returned (a whole result returned
            split is chunked).
    """

    flat: FlatProgram
    layout: MicrobatchLayout
    outs: tuple[Layout, ...]
    want: tuple[Layout, ...]

    @property
    def reads_mb(self) -> bool:
        """Whether running it needs the microbatch's index (it chunks a whole value)."""
        lay = self.layout
        return any(u.kind == "local" or (u.kind == "slice" and not u.steady) or
                   u.rebase is not None for u in lay.uses.values()) or \
            any(a != b for a, b in zip(self.outs, self.want)) or \
            any(n.reads_mb for n in lay.bodies.values())

    def returning(self, want: Sequence[Layout]) -> "Body":
        return dataclasses.replace(self, want=tuple(want))

    def run(self, args: Sequence[Any], mb: Any, m: int) -> list[Any]:
        """Its results on ``args`` (the microbatch's operands) for microbatch ``mb``."""
        flat, lay = self.flat, self.layout
        env: dict[int, Any] = dict(flat.consts)
        env.update(enumerate(args))
        for i, fe in enumerate(flat.eqns):
            if lay.place[i] is Place.FREE:
                outs = bind(fe.eqn, [x.value if isinstance(x, Lit) else env[x]
                                     for x in fe.ins])
            else:
                vals = [read_operand(lay, i, j, x, env, env, mb) for j, x in enumerate(fe.ins)]
                outs = bind_micro(flat, lay, i, vals, mb)
            env.update((r, v) for r, v in zip(fe.outs, outs) if r is not None)
        res = []
        for x, have, want in zip(flat.outs, self.outs, self.want):
            v = x.value if isinstance(x, Lit) else env[x]
            if have.kind == "whole" and want.kind == "split":
                v = chunk(v, want.axis, mb, m, want.group)
            res.append(v)
        return res


def analyze_body(closed: Any, ins: Sequence[Layout], m: int, analyze: Callable,
                 zeros: Sequence[int] = ()) -> Body:
    """``closed`` (a ``ClosedJaxpr``, or ``(jaxpr, consts)``) analysed under its
    arguments' layouts ``ins`` (``zeros``: arguments known to be zeros) by ``analyze``
    (``microbatch.analyze``, which calls this module's ``rule``).

    Raises:
        Refused: an argument no body can take (a total, pairs), or an equation of the
            body needing the whole batch (named, with its line).
    """
    if isinstance(closed, tuple):
        closed = types.SimpleNamespace(jaxpr=closed[0], consts=closed[1])
    for x in ins:
        if x.kind in ("total", "local") or x.pair is not None:
            raise Refused(f"a body reading a value {x} of the batch")
    flat = flatten(closed)
    lay = analyze(flat, (), m, state_refs=range(flat.num_args),
                  arg_layouts={r: x for r, x in enumerate(ins) if x.kind != "whole"},
                  arg_zeros=zeros)
    for i, where in enumerate(lay.place):
        if where in (Place.POST, Place.PROLOGUE):
            fe = flat.eqns[i]
            raise Refused(f"{prims.name(fe.eqn)} at {flat.source(fe) or 'an unknown line'} "
                          f"in its body needs the whole batch at once")
    outs = tuple(WHOLE if isinstance(x, Lit) or x in flat.consts else lay.layout[x]
                 for x in flat.outs)
    return Body(flat, lay, outs, outs)


def _zero_result(body: Body, k: int) -> bool:
    """Whether result ``k`` of ``body`` is zeros (a literal, or a broadcast or conversion
    of zeros)."""
    import numpy as np

    x = body.flat.outs[k]
    producer = {r: fe for fe in body.flat.eqns for r in fe.outs if r is not None}
    while True:
        if isinstance(x, Lit):
            return bool(np.all(np.asarray(x.value) == 0))
        fe = producer.get(x)
        if fe is None or prims.name(fe.eqn) not in (prims.BROADCAST, prims.CONVERT, "copy"):
            return False
        x = fe.ins[0]


def _join(a: Layout, b: Layout) -> Layout | None:
    """The layout holding both: a whole value reads as any split; zeros as a partial sum
    (checked by the caller); None where none does."""
    if a == b:
        return a
    if a.kind == "whole" and b.kind in ("split", "partial"):
        return b
    if b.kind == "whole" and a.kind in ("split", "partial"):
        return a
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class Nested:
    """How a per-microbatch equation runs its bodies (``MicrobatchLayout.bodies``).

    Attributes:
        kind: ``cond``, ``while``, ``scan``, ``call`` (a custom call's body) or ``solve``
            (``custom_linear_solve``: its ``solve`` function).
        bodies: cond: its branches; while: (condition, body); the others: (body,).
        counts: while: (condition constants, body constants); scan: (constants, carry);
            solve: ``_solve_operands``.
    """

    kind: str
    bodies: tuple[Body, ...]
    counts: tuple[int, ...] = ()

    @property
    def reads_mb(self) -> bool:
        return any(b.reads_mb for b in self.bodies)

    def bind(self, eqn: Any, vals: list, mb: Any, m: int) -> list:
        """The equation on the microbatch's operands ``vals``."""
        import jax

        if self.kind == "call":
            body = self.bodies[0]
            avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in vals]
            params = bind_params(eqn)
            params["call"] = jax.make_jaxpr(lambda *a: body.run(a, None, m))(*avals)
            return bind(eqn, vals, params)
        if self.kind == "solve":
            a, n, b = self.counts
            return self.bodies[0].run([*vals[a:a + n], *vals[b:]], mb, m)
        if self.kind == "cond":
            branches = [lambda *a, b=b: b.run(a, mb, m) for b in self.bodies]
            return list(jax.lax.switch(vals[0], branches, *vals[1:]))
        if self.kind == "while":
            nc, nb = self.counts
            cond, body = self.bodies
            cc, bc, init = vals[:nc], vals[nc:nc + nb], vals[nc + nb:]
            out = jax.lax.while_loop(lambda c: cond.run([*cc, *c], mb, m)[0],
                                     lambda c: tuple(body.run([*bc, *c], mb, m)),
                                     tuple(init))
            return list(out)
        nc, nk = self.counts
        body = self.bodies[0]
        p = eqn.params
        consts, init, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]

        def step(c, x):
            out = body.run([*consts, *c, *x], mb, m)
            return tuple(out[:nk]), tuple(out[nk:])

        carry, ys = jax.lax.scan(step, tuple(init), tuple(xs), length=p["length"],
                                 reverse=p["reverse"], unroll=p.get("unroll", 1))
        return [*carry, *ys]


def rule(eqn: Any, ins: Sequence[Layout], m: int, is_zero: Callable[[int], bool],
         analyze: Callable) -> Any:
    """The layouts of a body-holding equation's results (``mb_rules.Outcome``), or None
    for an equation without a body this module runs per microbatch.

    Args:
        eqn: the equation; ins: its operands' layouts; m: the microbatches.
        is_zero: whether operand ``j`` is zeros (a partial carry's initial value must be).
        analyze: ``microbatch.analyze`` (for the bodies).
    """
    name = prims.name(eqn)
    if name not in NAMES:
        return None
    ins = list(ins)
    try:
        with eqn_context(eqn):
            if name == CUSTOM_PARTITIONING:
                body = analyze_body(eqn.params["call"], ins, m, analyze)
                if body.reads_mb:
                    raise Refused("its body reads positions of the whole batch")
                return Outcome(list(body.outs), {}, nested=Nested("call", (body,)))
            if name == LINEAR_SOLVE:
                a, n, b = _solve_operands(eqn)
                body = analyze_body(eqn.params["jaxprs"].solve, [*ins[a:a + n], *ins[b:]], m,
                                    analyze)
                return Outcome(list(body.outs), {}, nested=Nested("solve", (body,), (a, n, b)))
            if name == prims.COND:
                return _cond(eqn, ins, m, analyze)
            return _loop(eqn, ins, m, is_zero, analyze)
    except Refused as e:
        per = [j for j, x in enumerate(ins) if x.per_microbatch]
        return Outcome([], {}, needs_total=tuple(per),
                       reason=f"a per-example value enters {name}, which cannot run per "
                              f"microbatch: {e}")


def _cond(eqn: Any, ins: list[Layout], m: int, analyze: Callable) -> Outcome:
    if ins[0].kind != "whole":
        raise Refused("the branch it takes depends on the batch")
    bodies = [analyze_body(b, ins[1:], m, analyze) for b in prims.cond_branches(eqn)]
    want = []
    for k in range(len(eqn.outvars)):
        got = bodies[0].outs[k]
        for b in bodies[1:]:
            j = _join(got, b.outs[k])
            if j is None:
                raise Refused(f"its branches give result {k} as {got} and {b.outs[k]}")
            got = j
        for b in bodies:
            if got.kind == "partial" and b.outs[k].kind == "whole" and not _zero_result(b, k):
                raise Refused(f"a branch gives result {k}, a sum over the batch in another, "
                              f"as one value for the whole batch")
        want.append(got)
    nested = Nested("cond", tuple(b.returning(want) for b in bodies))
    return Outcome(want, {}, nested=nested)


def _loop(eqn: Any, ins: list[Layout], m: int, is_zero: Callable[[Any], bool],
          analyze: Callable) -> Outcome:
    """``while`` and ``scan``: the carry's layouts to a fixed point (module docstring)."""
    if prims.name(eqn) == prims.WHILE:
        nc, nb, _ = prims.while_parts(eqn)
        body_closed = eqn.params["body_jaxpr"]
        fixed, init = ins[nc:nc + nb], ins[nc + nb:]
        xs: list[Layout] = []
        ys_of = None
    else:
        nc, nk, length, reverse, body_closed = prims.scan_info(eqn)
        fixed, init, scanned = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        xs = []
        for x in scanned:
            if x.kind == "split" and x.axis == 0:
                raise Refused("it scans over the batch's examples one by one")
            xs.append(split(x.axis - 1, group=x.group) if x.kind == "split" else x)
        ys_of = True
    carry = list(init)
    start = len(ins) - len(init) - len(xs)
    # On the first iteration a carry started from zeros is zeros: an accumulator (a
    # gradient summed over iterations) becomes a partial sum, then stays one.
    zeros = [len(fixed) + k for k, c in enumerate(carry)
             if c.kind == "whole" and is_zero(start + k)]
    for it in range(len(carry) + 2):
        body = analyze_body(body_closed, [*fixed, *carry, *xs], m, analyze,
                            zeros if it == 0 else ())
        new = [_join(c, o) for c, o in zip(carry, body.outs)]
        if any(x is None for x in new):
            k = next(k for k, x in enumerate(new) if x is None)
            raise Refused(f"its carry {k} is {carry[k]} on entry and {body.outs[k]} after "
                          f"an iteration")
        if new == carry and (it > 0 or not zeros):
            break       # settled, analysed without assuming zeros
        carry = new
    else:
        raise Refused("its carry's layouts do not settle")
    uses: dict[int, Use] = {}
    for k, (a, c) in enumerate(zip(init, carry)):
        if a == c:
            continue
        if c.kind == "split":
            uses[start + k] = Use("slice", c.axis, group=c.group)
        elif not is_zero(start + k):
            raise Refused(f"its carry {k} is a sum over the batch started from a value "
                          f"other than zeros")
    for k, (c, o) in enumerate(zip(carry, body.outs)):
        if c.kind == "partial" and o.kind == "whole" and not _zero_result(body, k):
            raise Refused(f"its carry {k}, a sum over the batch, is set to one value for the "
                          f"whole batch")
    if ys_of is None:
        cond = analyze_body(eqn.params["cond_jaxpr"], [*ins[:nc], *carry], m, analyze)
        if cond.outs[0].kind != "whole":
            raise Refused("how many iterations it runs depends on the examples")
        nested = Nested("while", (cond, body.returning([*carry])), (nc, len(fixed)))
        return Outcome(carry, uses, nested=nested)
    ys = []
    for y in body.outs[len(carry):]:
        ys.append(split(y.axis + 1, group=y.group) if y.kind == "split" else y)
    nested = Nested("scan", (body.returning([*carry, *body.outs[len(carry):]]),),
                    (nc, len(carry)))
    return Outcome(carry + ys, uses, nested=nested)

