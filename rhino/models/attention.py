"""A fused attention kernel that carries its sharding rule: ``fused_attention``.

On GPU a transformer's attention runs as one fused call (cuDNN's flash attention, through
``jax.nn.dot_product_attention(implementation="cudnn")``): no ``[T, S]`` scores in memory,
and only its batch and heads may be split. On CPU that implementation does not lower, so a
step written for the GPU cannot be planned as it will run. ``fused_attention`` is the same
contract as a ``jax.experimental.custom_partitioning`` pair (forward; backward recomputing
the scores, as flash attention's does) whose bodies are ``jax.nn.dot_product_attention``'s
XLA implementation and whose Shardy rules say what cuDNN's partitioner accepts: batch and
key/value heads split (the query's heads in blocks with them: grouped-query attention),
sequences and head dims whole. ``rhino.ingest`` keeps each call one custom call with that
rule (``hlo_passes/custom_calls.py``), priced at its body's FLOPs; values equal
``jax.nn.dot_product_attention`` with ``is_causal`` on any backend.

Layout BTNH: query ``[B, T, N, D]``, key and value ``[B, S, M, D]`` with ``N % M == 0``.

Example:
    >>> import jax, jax.numpy as jnp
    >>> q = jnp.ones((2, 8, 4, 16)); kv = jnp.ones((2, 8, 2, 16))
    >>> bool(jnp.allclose(fused_attention(q, kv, kv),
    ...                   jax.nn.dot_product_attention(q, kv, kv, is_causal=True)))
    True
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor,
                                                  SdyShardingRule, custom_partitioning)


def _reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _reference_bwd(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array):
    return tuple(jax.vjp(_reference, q, k, v)[1](g))


def _rule(n: int, m: int, backward: bool) -> SdyShardingRule:
    """Batch and key/value heads split; the query's heads are (kv heads, group)."""
    heads = CompoundFactor("m", "r") if n != m else "m"
    q = ArrayMapping("b", "t", heads, "d")
    kv = ArrayMapping("b", "s", "m", "d")
    whole = ("t", "r", "d", "s") if n != m else ("t", "d", "s")   # in factor order
    sizes = {"r": n // m} if n != m else {}
    if backward:
        return SdyShardingRule((q, kv, kv, q), (q, kv, kv), need_replication_factors=whole,
                               **sizes)
    return SdyShardingRule((q, kv, kv), (q,), need_replication_factors=whole, **sizes)


def _shardings(args):
    return tuple(a.sharding for a in args)


@functools.lru_cache(maxsize=None)
def _kernels(n: int, m: int):
    """The forward and backward calls for ``n`` query and ``m`` key/value heads."""
    fwd = custom_partitioning(_reference)
    bwd = custom_partitioning(_reference_bwd)

    def part_fwd(mesh, args, result):
        s = _shardings(args)
        return mesh, _reference, s[0], s

    def part_bwd(mesh, args, result):
        s = _shardings(args)
        return mesh, _reference_bwd, s[:3], s

    fwd.def_partition(infer_sharding_from_operands=lambda mesh, a, r: a[0].sharding,
                      partition=part_fwd, sharding_rule=_rule(n, m, False))
    bwd.def_partition(infer_sharding_from_operands=lambda mesh, a, r: _shardings(a[:3]),
                      partition=part_bwd, sharding_rule=_rule(n, m, True))

    @jax.custom_vjp
    def attend(q, k, v):
        return fwd(q, k, v)

    attend.defvjp(lambda q, k, v: (fwd(q, k, v), (q, k, v)),
                  lambda res, g: tuple(bwd(*res, g)))
    return attend


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention as one fused call with a sharding rule (module docstring).

    Args:
        q: ``[B, T, N, D]``; k, v: ``[B, S, M, D]``, ``N`` a multiple of ``M``.

    Raises:
        ValueError: shapes that are not BTNH with ``N % M == 0``.
    """
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[2] % k.shape[2]:
        raise ValueError(f"fused_attention: expected q [B, T, N, D] and k, v [B, S, M, D] "
                         f"with N % M == 0, found {q.shape}, {k.shape}, {v.shape}")
    return _kernels(q.shape[2], k.shape[2])(q, k, v)
