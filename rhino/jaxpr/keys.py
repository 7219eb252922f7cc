"""Which arguments of a traced step are PRNG keys, typed or raw.

A typed key (``jax.random.key``) says so by its dtype. Raw key data (``jax.random.PRNGKey``:
``uint32[2]``, or ``uint32[4]`` for ``rbg``) is an unsigned integer array like any other; it
is recognisable only by how the step uses it: every ``jax.random`` function wraps it
(``random_wrap``) before use, and ``threefry2x32`` hashes with its words. A key is the same
for every microbatch (never split into microbatches), so each argument whose values reach a
key operand is one, wherever the step wraps it: in the step itself, inside a nested
``jit`` (an ``eqx.filter_jit`` or ``jax.jit`` helper), a checkpoint or a custom_vjp
function, a ``scan`` or ``while`` body, or a ``cond`` branch, after any slicing or
arithmetic. What makes a new key from other values (a seed, a message folded into a key)
or draws bits from one passes no key on.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def step(key, x, tokens):
    ...     noise = jax.jit(lambda k: jax.random.normal(k, x.shape))(key)
    ...     return x + noise, tokens[0]
    >>> closed = jax.make_jaxpr(step)(jax.random.PRNGKey(0), jnp.ones(3),
    ...                               jnp.zeros((2,), jnp.uint32))
    >>> sorted(key_arguments(closed))
    [0]
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from rhino.jaxpr import primitives as prims
from rhino.jaxpr import private

_NO_KEY = frozenset({prims.RANDOM_SEED, prims.RANDOM_BITS, prims.THREEFRY})
_FIXPOINT_ROUNDS = 8


def key_arguments(closed: Any) -> frozenset[int]:
    """Flat argument indices of ``closed`` (a ClosedJaxpr) that are PRNG keys: a key dtype,
    or unsigned 32-bit data whose values reach the key operand of a ``random_wrap`` or a
    ``threefry2x32``, through any equations and bodies."""
    jaxpr = closed.jaxpr
    typed, raw = set(), set()
    for k, v in enumerate(jaxpr.invars):
        dtype = v.aval.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            typed.add(k)
        elif np.dtype(dtype) == np.uint32:
            raw.add(k)
    if not raw:
        return frozenset(typed)
    reached: set[int] = set()     # only the candidates are followed
    _walk(jaxpr, [frozenset({k}) if k in raw else frozenset()
                  for k in range(len(jaxpr.invars))], reached)
    return frozenset(typed | (raw & reached))


def _walk(jaxpr: Any, args: Sequence[frozenset[int]], reached: set[int]
          ) -> list[frozenset[int]]:
    """The arguments each result of ``jaxpr`` derives from (``args``: each input's); the
    arguments reaching a key operand are added to ``reached``."""
    env: dict = dict(zip(jaxpr.invars, args))
    none: frozenset[int] = frozenset()

    def read(v: Any) -> frozenset[int]:
        return none if private.is_literal(v) else env.get(v, none)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = prims.name(eqn)
        if name == prims.RANDOM_WRAP:
            reached.update(ins[0])
        elif name == prims.THREEFRY:
            reached.update(ins[0] | ins[1])
        outs = _equation(eqn, ins, reached)
        if name == prims.RANDOM_FOLD_IN:          # a key from the key, not the message
            outs = [ins[0]] * len(eqn.outvars)
        elif outs is None:
            every = none if name in _NO_KEY else frozenset().union(*ins)
            outs = [every] * len(eqn.outvars)
        for v, o in zip(eqn.outvars, outs):
            if not private.is_dropped(v):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _equation(eqn: Any, ins: list[frozenset[int]], reached: set[int]
              ) -> list[frozenset[int]] | None:
    """What an equation with bodies passes on (walking them); None for one without."""
    body = prims.call_body(eqn)
    if body is not None:
        return _walk(body[0], ins, reached)
    scan = prims.scan_info(eqn)
    if scan is not None:
        nc, nk, _, _, (jaxpr, _) = scan
        return _loop(jaxpr, ins, nc, nk, reached)
    branches = prims.cond_branches(eqn)
    if branches is not None:
        outs = [_walk(b[0], ins[1:], reached) for b in branches]
        return [frozenset().union(*col) for col in zip(*outs)]
    parts = prims.while_parts(eqn)
    if parts is not None:
        cn, bn, cond = parts
        carry = _loop(prims.while_body(eqn)[0], ins[cn:], bn, len(ins) - cn - bn, reached)
        _walk(cond, ins[:cn] + carry, reached)
        return carry
    return None


def _loop(body: Any, ins: list[frozenset[int]], consts: int, carry: int,
          reached: set[int]) -> list[frozenset[int]]:
    """A loop body reading ``consts`` constants, ``carry`` carried values and the rest
    (scanned inputs), walked until what the carry derives from stops growing."""
    ins = list(ins)
    for _ in range(_FIXPOINT_ROUNDS):
        outs = _walk(body, ins, reached)
        grown = [a | b for a, b in zip(ins[consts:consts + carry], outs[:carry])]
        if grown == ins[consts:consts + carry]:
            break
        ins[consts:consts + carry] = grown
    return outs
