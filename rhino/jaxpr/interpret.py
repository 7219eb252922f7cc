"""The one jaxpr interpreter of rhino: a static walk, a flattener, and a re-binding
evaluator that annotation, scan unrolling, stage programs and their analyses share.

A traced step is a nested jaxpr: calls (``jit``), custom_jvp / custom_vjp functions,
checkpoints and jax ≥ 0.11's ``call_hi_primitive`` hold bodies. Every pass of rhino sees it
the same way: a body is *inlined* (its equations get paths below the equation's, e.g.
``(3, 0)``), except that a checkpoint re-evaluated by ``Interpreter`` is bound again around
its evaluated body so that XLA still recomputes it::

    ClosedJaxpr ─► leaf_equations   path -> leaf equation (bodies inlined)
              ├──► flatten          one list of leaf equations over integer value refs
              └──► Interpreter      re-bind equation by equation (subclass hooks: named
                                    scopes, sharding constraints, scan unrolling, a light
                                    ``cond`` evaluated as a select)

Example:
    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(jnp.ones(3))
    >>> sorted(leaf_equations(closed.jaxpr))      # sin inside the jit is (0, 0)
    [(0, 0), (1,)]
    >>> Interpreter().run(closed.jaxpr, closed.consts, [jnp.zeros(3)])[0].tolist()
    [0.0, 0.0, 0.0]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from rhino.jaxpr import primitives as prims
from rhino.jaxpr import private


# ------------------------------------------------------------------------------ walking
def leaf_equations(jaxpr: Any, path: tuple[int, ...] = ()) -> dict[tuple[int, ...], Any]:
    """Every leaf (non-inlined) equation of ``jaxpr`` by its path."""
    out: dict[tuple[int, ...], Any] = {}

    def walk(j: Any, p: tuple[int, ...]) -> None:
        for i, eqn in enumerate(j.eqns):
            body = prims.call_body(eqn)
            if body is not None:
                walk(body[0], p + (i,))
            else:
                out[p + (i,)] = eqn
    walk(jaxpr, path)
    return out


def inlined_equations(jaxpr: Any, path: tuple[int, ...] = ()
                      ) -> list[tuple[tuple[int, ...], Any]]:
    """``(path, equation)`` of every equation with a body the walk inlines (calls,
    checkpoints, ...), outermost first."""
    out: list = []

    def walk(j: Any, p: tuple[int, ...]) -> None:
        for i, eqn in enumerate(j.eqns):
            body = prims.call_body(eqn)
            if body is not None:
                out.append((p + (i,), eqn))
                walk(body[0], p + (i,))
    walk(jaxpr, path)
    return out


def any_equation(jaxpr: Any, pred: Callable[[Any], bool]) -> bool:
    """Whether ``pred`` holds for an equation of ``jaxpr`` or of a body it inlines."""
    for eqn in jaxpr.eqns:
        if pred(eqn):
            return True
        body = prims.call_body(eqn)
        if body is not None and any_equation(body[0], pred):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class Lit:
    """A literal operand."""

    value: Any


@dataclasses.dataclass(frozen=True, eq=False)
class FlatEqn:
    """A leaf equation: its path in the nested jaxpr, the equation, operand refs (or
    literals) and result refs (None for dropped results). ``remat``: the path of the
    innermost checkpoint holding it (None outside every checkpoint)."""

    path: tuple[int, ...]
    eqn: Any
    ins: tuple[Any, ...]
    outs: tuple[int | None, ...]
    remat: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class FlatProgram:
    """A jaxpr as one list of leaf equations over integer value refs.

    Attributes:
        eqns: leaf equations in program order.
        num_args: refs ``0 .. num_args-1`` are the flat arguments.
        consts: ref -> constant value (closed-over constants of the jaxpr and its bodies).
        outs: the flat results (ref or ``Lit``).
        avals: ref -> abstract value (shape, dtype).
        remats: checkpoint path -> its equation (the checkpoints the walk inlined).
        calls: path -> equation, for every equation whose body the walk inlined.
    """

    eqns: tuple[FlatEqn, ...]
    num_args: int
    consts: Mapping[int, Any]
    outs: tuple[Any, ...]
    avals: Mapping[int, Any]
    remats: Mapping[tuple[int, ...], Any] = dataclasses.field(default_factory=dict)
    calls: Mapping[tuple[int, ...], Any] = dataclasses.field(default_factory=dict)

    def source(self, fe: FlatEqn) -> str | None:
        """``file:line`` of the user code that made ``fe``: its own, else that of the
        innermost inlined call holding it (an equation inside ``jnp.var`` is named by the
        line calling ``jnp.var``)."""
        own = private.eqn_source(fe.eqn)
        path = fe.path
        while own is None and len(path) > 1:
            path = path[:-1]
            call = self.calls.get(path)
            own = private.eqn_source(call) if call is not None else None
        return own


def flatten(closed: Any, platform_branches: bool = False) -> FlatProgram:
    """The leaf equations of a ClosedJaxpr over integer refs (bodies inlined).

    ``platform_branches``: a platform-dependent ``cond`` (``jax.lax.platform_dependent``,
    as ``jnp.diagonal`` makes: its branches compute the same values, each lowered for its
    platforms) is inlined as a branch that addresses no position by index values
    (``primitives.index_free_branches``; its paths are below the cond's, which ``calls``
    holds); the branch index is not read. The same for such a cond written as every
    branch and a ``select_n`` on the platform index (``unroll.trace``): the select is the
    chosen branch's values, and what only the other branches need is left out. Every cond
    or select of the same platforms takes the same branch (the first that is index-free
    in all of them; none: they stay), so the residuals a forward branch hands to its
    transpose are the ones that branch reads."""
    choice, picks = _platform_choices(closed.jaxpr) if platform_branches else ({}, {})
    avals: dict[int, Any] = {}
    consts: dict[int, Any] = {}
    eqns: list[FlatEqn] = []
    remats: dict[tuple[int, ...], Any] = {}
    calls: dict[tuple[int, ...], Any] = {}
    counter = [0]

    def new(aval: Any) -> int:
        r = counter[0]
        counter[0] += 1
        avals[r] = aval
        return r

    def walk(jaxpr: Any, const_vals: Sequence[Any], args: Sequence[Any],
             path: tuple[int, ...], remat: tuple[int, ...] | None) -> list[Any]:
        env: dict = {}

        def read(v: Any) -> Any:
            return Lit(v.val) if private.is_literal(v) else env[v]

        for v, x in zip(jaxpr.constvars, const_vals):
            r = new(v.aval)
            consts[r] = x
            env[v] = r
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        for i, eqn in enumerate(jaxpr.eqns):
            p = path + (i,)
            ins = [read(v) for v in eqn.invars]
            body = prims.call_body(eqn)
            free = prims.index_free_branches(eqn) if choice and body is None else None
            if free is not None and choice.get(free[0]) is not None:
                body = prims.cond_branches(eqn)[choice[free[0]]]
                ins = ins[1:]                             # the branch index
            if id(eqn) in picks:                          # select_n on the platform
                env[eqn.outvars[0]] = ins[1 + picks[id(eqn)]]
                continue
            if body is not None:
                inner = remat
                calls[p] = eqn
                if prims.is_remat(eqn):
                    remats[p] = eqn
                    inner = p
                res = walk(body[0], body[1], ins, p, inner)
            else:
                res = [None if private.is_dropped(v) else new(v.aval) for v in eqn.outvars]
                eqns.append(FlatEqn(p, eqn, tuple(ins), tuple(res), remat))
            for v, x in zip(eqn.outvars, res):
                if not private.is_dropped(v):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    args = [new(v.aval) for v in closed.jaxpr.invars]
    outs = walk(closed.jaxpr, closed.consts, args, (), None)
    if picks:      # what only the branches not taken read
        live = {x for x in outs if isinstance(x, int)}
        keep = []
        for fe in reversed(eqns):
            if any(r in live for r in fe.outs if r is not None) or \
                    getattr(fe.eqn, "effects", None):
                keep.append(fe)
                live.update(x for x in fe.ins if isinstance(x, int))
        eqns = keep[::-1]
    return FlatProgram(tuple(eqns), len(args), consts, tuple(outs), avals, remats, calls)


def _platform_choices(jaxpr: Any) -> tuple[dict[Any, int | None], dict[int, int]]:
    """For ``flatten(platform_branches=True)``: platforms -> the branch every
    platform-dependent cond or select with them takes (None where no branch is index-free
    in all), and ``id(select_n equation)`` -> the case it takes."""
    free: dict[Any, frozenset[int]] = {}
    selects: list[tuple[Any, Any]] = []

    def walk(j: Any) -> None:
        made = {v: e for e in j.eqns for v in e.outvars}
        platform: dict[Any, Any] = {}       # var -> platforms of the index it holds
        for eqn in j.eqns:
            got = prims.index_free_branches(eqn)
            if got is not None:
                free[got[0]] = free.get(got[0], got[1]) & got[1]
                continue
            name = eqn.primitive.name
            ins = [v for v in eqn.invars if not private.is_literal(v)]
            if name == prims.PLATFORM_INDEX:
                platform[eqn.outvars[0]] = eqn.params.get("platforms")
            elif name in ("clamp", prims.CONVERT) and len(ins) == 1 and ins[0] in platform:
                platform[eqn.outvars[0]] = platform[ins[0]]
            elif name == prims.SELECT_N and not private.is_literal(eqn.invars[0]) and \
                    eqn.invars[0] in platform:
                key = platform[eqn.invars[0]]
                cases = [_index_free_cases(eqn, made)]
                free[key] = free.get(key, cases[0]) & cases[0]
                selects.append((key, eqn))
            body = prims.call_body(eqn)
            if body is not None:
                walk(body[0])
    walk(jaxpr)
    choice = {k: min(v) if v else None for k, v in free.items()}
    picks = {id(e): choice[k] for k, e in selects if choice.get(k) is not None}
    return choice, picks


def _index_free_cases(select: Any, made: Mapping[Any, Any]) -> frozenset[int]:
    """The cases of a ``select_n`` none of whose own equations (those no other case reads)
    address positions by index values."""
    def cone(v: Any) -> set[int]:
        seen: dict[int, Any] = {}
        stack = [v]
        while stack:
            x = stack.pop()
            if private.is_literal(x) or x not in made or id(made[x]) in seen:
                continue
            e = made[x]
            seen[id(e)] = e
            stack.extend(e.invars)
        return seen

    cones = [cone(v) for v in select.invars[1:]]
    out = set()
    for c, mine in enumerate(cones):
        others = set().union(*(set(k) for j, k in enumerate(cones) if j != c))
        if not any(any_equation_of(mine[k], lambda e: e.primitive.name in prims.INDEXING)
                   for k in mine if k not in others):
            out.add(c)
    return frozenset(out)


def any_equation_of(eqn: Any, pred: Callable[[Any], bool]) -> bool:
    """Whether ``pred`` holds for ``eqn`` or an equation of a body it holds."""
    if pred(eqn):
        return True
    body = prims.call_body(eqn)
    return body is not None and any_equation(body[0], pred)


# ------------------------------------------------------------------------------ evaluating
class Interpreter:
    """Evaluates a jaxpr by binding its equations again, in the current trace.

    Bodies are inlined (``call``); a checkpoint's body is evaluated by this interpreter,
    traced to a jaxpr and bound under the checkpoint again (``remat``), so that XLA still
    recomputes it; every equation is bound with its own source line and name stack
    (``private.eqn_context``). Subclasses change one step by overriding a method:

    ``scoped``            a ``jax.named_scope(f"eqn{i}")`` around equation ``i`` (so that
                          lowered ops carry their equation path in ``op_name``)
    ``select_light_conds`` a ``cond`` with cheap branches is evaluated as both branches and
                          a select (its values then get planned like the rest)
    ``leaf``              how a leaf equation is bound
    ``call``              how a body is evaluated (default: inline)
    ``unrolls``/``scan``  which scans (and counted ``while`` loops) are written out, and how
    """

    scoped = False
    select_light_conds = False

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
            path: tuple[int, ...] = ()) -> list[Any]:
        """The results of ``jaxpr`` on ``args`` (equation paths start at ``path``)."""
        import jax

        env, read = private.jaxpr_env(jaxpr, consts, args)
        for i, eqn in enumerate(jaxpr.eqns):
            p = path + (i,)
            invals = [read(v) for v in eqn.invars]
            if self.scoped:
                with jax.named_scope(f"eqn{i}"):
                    outs = self.equation(eqn, p, invals)
            else:
                outs = self.equation(eqn, p, invals)
            for v, x in zip(eqn.outvars, outs):
                if not private.is_dropped(v):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn: Any, path: tuple[int, ...], invals: list) -> list[Any]:
        """One equation: dispatched to ``cond_as_select``, ``remat``, ``call``, ``scan`` or
        ``leaf``."""
        if self.select_light_conds and prims.light_cond(eqn):
            with private.eqn_context(eqn):
                return self.cond_as_select(eqn, path, invals)
        body = prims.call_body(eqn)
        if body is not None:
            # The equation's own name stack (e.g. ``transpose(jvp(...))`` around a nested
            # jit) goes on for its inlined equations: without it a weight gradient computed
            # in a nested jit would not look like one.
            with private.eqn_context(eqn):
                if prims.is_remat(eqn):
                    return self.remat(eqn, path, body, invals)
                return self.call(eqn, path, body, invals)
        if eqn.primitive.name in (prims.SCAN, prims.WHILE) and self.unrolls(eqn):
            with private.eqn_context(eqn):
                return self.scan(eqn, path, invals)
        return self.leaf(eqn, path, invals)

    def leaf(self, eqn: Any, path: tuple[int, ...], invals: list) -> list[Any]:
        """A leaf equation bound as it is."""
        with private.eqn_context(eqn):
            return private.bind(eqn, invals)

    def call(self, eqn: Any, path: tuple[int, ...], body: tuple[Any, Sequence[Any]],
             invals: list) -> list[Any]:
        """A body evaluated inline."""
        return self.run(body[0], body[1], invals, path)

    def remat(self, eqn: Any, path: tuple[int, ...], body: tuple[Any, Sequence[Any]],
              invals: list) -> list[Any]:
        """A checkpoint: its body evaluated by ``remat_body``, traced, and bound under the
        same primitive and parameters (the traced constants first)."""
        hi = private.hi_remat_params(eqn)
        if hi is not None:           # jax_remat3: bound again through jax.checkpoint
            import jax

            outs = jax.checkpoint(lambda *a: self.remat_body(eqn, path, body, list(a)),
                                  **hi)(*invals)
            return list(outs)
        jaxpr, consts = private.trace_without_name_stack(
            lambda *a: self.remat_body(eqn, path, body, list(a)), invals)
        params = dict(eqn.params, jaxpr=jaxpr)
        outs = eqn.primitive.bind(*consts, *invals, **params)
        return list(outs) if eqn.primitive.multiple_results else [outs]

    def remat_body(self, eqn: Any, path: tuple[int, ...], body: tuple[Any, Sequence[Any]],
                   args: list) -> list[Any]:
        """The body of a checkpoint, on the values behind its barrier."""
        return self.run(body[0], body[1], args, path)

    def unrolls(self, eqn: Any) -> bool:
        """Whether a ``scan`` (or ``while``) equation is evaluated by ``scan`` (default:
        none)."""
        return False

    def scan(self, eqn: Any, path: tuple[int, ...], invals: list) -> list[Any]:
        raise NotImplementedError("Interpreter.scan: a subclass that unrolls scans defines it")

    def cond_as_select(self, eqn: Any, path: tuple[int, ...], invals: list) -> list[Any]:
        """A light ``cond``: every branch evaluated (in scopes ``branch<b>/eqn<j>`` when
        scoped), then the branch the index picks selected (clamped as ``cond`` clamps)."""
        import jax

        branches = prims.cond_branches(eqn)
        index, operands = invals[0], invals[1:]
        plain = Interpreter()        # branches hold no hooks' values: evaluated as they are
        plain.scoped = self.scoped
        results = []
        for b, (jaxpr, consts) in enumerate(branches):
            with jax.named_scope(f"branch{b}"):
                results.append(plain.run(jaxpr, consts, operands))
        which = jax.lax.clamp(0, jax.lax.convert_element_type(index, "int32"),
                              len(branches) - 1)
        if len(branches) == 2:
            which = which.astype(bool)
        return [jax.lax.select_n(which, *cases) for cases in zip(*results)]


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """``jaxpr`` on ``args`` with the default ``Interpreter`` (bodies inlined)."""
    return Interpreter().run(jaxpr, consts, args)
