"""Sharding rules of custom calls: which dimensions of a kernel's operands and results may
be split, read from the rule the kernel declares or built in for the kernels JAX emits.

A rule is written in *factors*, as Shardy's ``OpShardingRuleAttr`` is: every dimension of
every operand and result is a list of factors (major first); splitting a factor over mesh
axes splits every dimension whose major factor it is, in operands and results alike. A
factor in no result is a *reduction* factor when the rule says so (splitting it leaves the
results pending sums), else it may not be split; ``need_replication`` and ``permutation``
factors are never split here.

Where rules come from (``rule_for``):

* ``jax.experimental.custom_partitioning`` with ``sharding_rule=``: on a mesh of two or
  more devices JAX lowers the call to ``custom-call(...), custom_call_target=
  "CustomSPMDPartitioning"`` carrying ``frontend_attributes={xla.sdy.sharding_rule=
  "#sdy.op_sharding_rule<([i, j, k, l], [i, j, m, l])->([i, j, k, l]) {i=2, j=8, ...}
  reduction={...}, custom>"}`` (checked on jax 0.10.2; on one device the call's body is
  inlined instead: ``ingest`` lowers such functions on two devices, ``parse_sdy_rule``);
* cuDNN fused attention (``jax.nn.dot_product_attention(implementation="cudnn")`` on
  GPU, as XLA's HLO dumps hold it): ``__cudnn$fmha*`` forward and ``...Backward`` calls.
  Built in (``_cudnn_fmha``): batch and heads split, sequences and head dims whole (what
  JAX's own partitioner for them accepts), for both layouts JAX uses (BTNH, the default,
  and BNTH, read from the backend config's ``bmm1`` batch dimensions), with grouped-query
  heads (the query's heads split in blocks with the key's). Operands: query, key, value,
  [bias], [sequence lengths, offsets, page tables]; forward results: output ``[B,N,T,H]``
  (physically BTNH), [softmax statistics ``f32[B,N,T]``], workspace ``u8[...]``; backward
  operands: query, key, value, statistics, output gradient, [bias], output, [...];
  results: ``dQ``, ``dK``, ``dV`` (``[B,N,T,H]`` logical), [``dbias``], workspace.

Any other custom call has no rule: the planner keeps it replicated and lists it.

FLOPs (``custom_call_flops``): cuDNN attention as its matmuls (forward ``2·BNTS·(H+Hv)``,
backward ``2·BNTS·(3H+2Hv)`` with the recomputed scores; halved for a causal mask); a
``custom_partitioning`` call lowered from a JAX function, its body's (``ingest`` counts them
from the call's jaxpr); another declared rule, an einsum over its factors (``2·Π sizes``:
for attention ``b h s t d`` one of its two matmuls); else 0.

Example:
    >>> r = parse_sdy_rule("#sdy.op_sharding_rule<([i, j], [j, k])->([i, k]) "
    ...                    "{i=8, j=16, k=4} reduction={j}, custom>")
    >>> r.operands[1], r.results, r.splittable()    # per tensor, per dim, its factors
    ((('j',), ('k',)), ((('i',), ('k',)),), ('i', 'j', 'k'))
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Mapping, Sequence

from .graph import Shape, TensorType, flatten_shape

SDY_RULE_ATTR = "xla.sdy.sharding_rule"
CUSTOM_PARTITIONING = "CustomSPMDPartitioning"
_FACTOR = re.compile(r"[a-z](?:_\d+)?")


@dataclasses.dataclass(frozen=True)
class ShardingRule:
    """A custom call's sharding rule in factors (module docstring).

    Attributes:
        operands: per operand, per dimension, its factors (major first); each a name.
        results: the same per result (one entry for a call with one array result).
        sizes: factor -> size.
        reduction: factors summed over (in no result): splitting them leaves the results
            pending sums.
        whole: factors never split (need replication, permutation).
        origin: where the rule comes from, for reports.
    """

    operands: tuple[tuple[tuple[str, ...], ...], ...]
    results: tuple[tuple[tuple[str, ...], ...], ...]
    sizes: Mapping[str, int]
    reduction: frozenset[str] = frozenset()
    whole: frozenset[str] = frozenset()
    origin: str = ""

    def splittable(self) -> tuple[str, ...]:
        """Factors the planner may split: the major factor of some dimension, not
        ``whole``, and in some result or a reduction factor."""
        major = {dim[0] for t in self.operands + self.results for dim in t if dim}
        in_results = {f for t in self.results for dim in t for f in dim}
        return tuple(sorted(f for f in major if f not in self.whole
                            and (f in in_results or f in self.reduction)))

    @staticmethod
    def dim_of(tensor: Sequence[Sequence[str]], factor: str) -> int | None:
        """The dimension of ``tensor`` whose major factor is ``factor`` (None: none)."""
        for d, dim in enumerate(tensor):
            if dim and dim[0] == factor:
                return d
        return None

    def check(self, operands: Sequence[Shape], results: Sequence[Shape]) -> None:
        """Raise ``ValueError`` unless the rule fits these shapes (ranks; a dimension's
        factors multiply to its size)."""
        for what, rule, shapes in (("operand", self.operands, operands),
                                   ("result", self.results, results)):
            if len(rule) != len(shapes):
                raise ValueError(f"sharding rule ({self.origin}): expected {len(rule)} "
                                 f"{what}s, found {len(shapes)}")
            for k, (dims, t) in enumerate(zip(rule, shapes)):
                if not isinstance(t, TensorType) or len(dims) != t.rank:
                    raise ValueError(f"sharding rule ({self.origin}): {what} {k} has "
                                     f"{len(dims)} dimensions in the rule, found {t}")
                for d, (fs, size) in enumerate(zip(dims, t.dims)):
                    if math.prod(self.sizes.get(f, 1) for f in fs) != size:
                        raise ValueError(f"sharding rule ({self.origin}): {what} {k} dim {d}"
                                         f" of size {size} has factors {fs} of sizes "
                                         f"{[self.sizes.get(f) for f in fs]}")


def parse_sdy_rule(text: str, origin: str = "sdy rule") -> ShardingRule:
    """A ``#sdy.op_sharding_rule<...>`` attribute as a ``ShardingRule``.

    Raises:
        ValueError: text that is not such a rule (named, with what was expected).
    """
    m = re.fullmatch(r"\s*#sdy\.op_sharding_rule<\s*\((.*?)\)\s*->\s*\((.*?)\)\s*"
                     r"\{([^}]*)\}(.*)>\s*", text, re.S)
    if m is None:
        raise ValueError(f"sharding rule: expected '#sdy.op_sharding_rule<(...)->(...) "
                         f"{{sizes}} ...>', found {text[:120]!r}")

    def tensors(part: str) -> tuple[tuple[tuple[str, ...], ...], ...]:
        out = []
        for body in re.findall(r"\[([^\]]*)\]", part):
            dims = [d.strip() for d in body.split(",")] if body.strip() else []
            out.append(tuple(tuple(_FACTOR.findall(d)) for d in dims))
        return tuple(out)

    sizes = {}
    for item in m.group(3).split(","):
        if item.strip():
            k, _, v = item.partition("=")
            sizes[k.strip()] = int(v)
    rest = m.group(4)

    def named(key: str) -> frozenset[str]:
        got = re.search(key + r"\s*=\s*\{([^}]*)\}", rest)
        return frozenset(_FACTOR.findall(got.group(1))) if got else frozenset()

    ops, res = tensors(m.group(1)), tensors(m.group(2))
    unknown = {f for t in ops + res for dim in t for f in dim} - set(sizes)
    if unknown:
        raise ValueError(f"sharding rule: expected a size for every factor, found none for "
                         f"{sorted(unknown)} in {text[:120]!r}")
    return ShardingRule(ops, res, sizes, named("reduction"),
                        named("need_replication") | named("permutation"), origin)


def _sdy_text(attrs: Mapping[str, Any]) -> str | None:
    fa = str(attrs.get("frontend_attributes", ""))
    m = re.search(re.escape(SDY_RULE_ATTR) + r'\s*=\s*"([^"]*)"', fa)
    return m.group(1) if m else None


def rule_for(attrs: Mapping[str, Any], operands: Sequence[Shape], shape: Shape
             ) -> ShardingRule | None:
    """The sharding rule of a custom call (attrs, operand shapes, result shape), or None.

    Raises:
        ValueError: a declared rule that is malformed or does not fit the shapes.
    """
    results = flatten_shape(shape) if not isinstance(shape, TensorType) else [shape]
    text = _sdy_text(attrs)
    target = str(attrs.get("custom_call_target", ""))
    if text is not None:
        rule = parse_sdy_rule(text, f"declared sdy rule of {target or 'a custom call'}")
    elif target.startswith("__cudnn$fmha"):
        rule = _cudnn_fmha(target, attrs, operands, results)
    else:
        return None
    if rule is not None:
        rule.check(operands, results)
    return rule


def _layout_bnth(attrs: Mapping[str, Any], backward: bool) -> bool | None:
    """Whether the call's query is BNTH (True), BTNH (False), or unknown (None), from the
    backend config's first matmul batch dimensions ([0, 1]: BNTH; [0, 2]: BTNH)."""
    try:
        cfg = json.loads(str(attrs.get("backend_config", "")))["cudnn_fmha_backend_config"]
        key = "bmm2_grad_gemm2_dot_dimension_numbers" if backward else \
            "bmm1_dot_dimension_numbers"
        batch = [int(x) for x in cfg[key]["rhs_batch_dimensions"]]
    except (ValueError, KeyError, TypeError):
        return None
    return batch == [0, 1]


def _cudnn_fmha(target: str, attrs: Mapping[str, Any], operands: Sequence[Shape],
                results: Sequence[Shape]) -> ShardingRule | None:
    """The built-in rule of a cuDNN fused-attention call (module docstring), or None
    where its operands are not the query, key, value JAX passes."""
    backward = "Backward" in target
    if len(operands) < 3 or not all(isinstance(t, TensorType) and t.rank == 4
                                    for t in operands[:3]):
        return None
    q, k, v = operands[:3]
    out = results[0]
    if not isinstance(out, TensorType) or out.rank != 4:
        return None
    bnth = _layout_bnth(attrs, backward)
    if bnth is None:   # the results are [B, N, T, H] logical: compare the query with them
        bnth = q.dims == out.dims if not backward else q.dims == results[0].dims
    if bnth:
        B, N, T, H = q.dims
        _, M, S, Hv = v.dims
    else:
        B, T, N, H = q.dims
        _, S, M, Hv = v.dims
    if M == 0 or N % M:
        return None
    sizes = {"b": B, "m": M, "t": T, "s": S, "h": H, "v": Hv}
    heads = ("m", "r") if N != M else ("m",)
    if N != M:
        sizes["r"] = N // M
    # Other dims' factors: unique names per tensor and dim, never split.
    counter = iter(range(10**6))

    def own(size: int) -> tuple[str, ...]:
        name = f"z_{next(counter)}"
        sizes[name] = size
        return (name,)

    def whole(t: Shape) -> tuple[tuple[str, ...], ...]:
        return tuple(own(s) for s in t.dims) if isinstance(t, TensorType) else ()

    def qlike(last: str, seq: str, hd: tuple[str, ...] = heads) -> tuple[tuple[str, ...], ...]:
        """A query-like operand: [B, T, N, H] (BTNH) or [B, N, T, H] (BNTH)."""
        return (("b",), hd, (seq,), (last,)) if bnth else (("b",), (seq,), hd, (last,))

    def bnt(hd: tuple[str, ...], seq: str, last: str | None) -> tuple[tuple[str, ...], ...]:
        dims = (("b",), hd, (seq,))
        return dims + ((last,),) if last else dims

    def bias(t: Shape) -> tuple[tuple[str, ...], ...]:
        if not (isinstance(t, TensorType) and t.rank == 4 and t.dims[2:] == (T, S)):
            return whole(t)
        return ((("b",) if t.dims[0] == B else own(t.dims[0])),
                (heads if t.dims[1] == N else own(t.dims[1])), own(T), own(S))

    ops = [qlike("h", "t"), qlike("h", "s", ("m",)), qlike("v", "s", ("m",))]
    rest = list(operands[3:])
    has_bias = "Bias" in target
    if backward:
        ops += [bnt(heads, "t", None), qlike("v", "t")]           # statistics, dO
        if has_bias:
            ops.append(bias(rest[2]))
        ops.append(qlike("v", "t"))                                 # the forward output
        done = 3 + has_bias
    else:
        if has_bias:
            ops.append(bias(rest[0]))
        done = int(has_bias)
    ops += [whole(t) for t in rest[done:]]
    res = []
    for i, t in enumerate(results):
        if not isinstance(t, TensorType) or t.dtype in ("u8", "s8") and i == len(results) - 1:
            res.append(whole(t))                                    # workspace
        elif backward and i < 3:
            res.append(bnt(heads if i == 0 else ("m",), "t" if i == 0 else "s",
                           "h" if i < 2 else "v"))
        elif backward:
            res.append(bias(t))                                     # dbias
        elif i == 0:
            res.append(bnt(heads, "t", "v"))
        else:
            res.append(bnt(heads, "t", None) if t.rank == 3 else whole(t))
    return ShardingRule(tuple(ops), tuple(res), sizes, frozenset(),
                        frozenset(f for f in sizes if f.startswith("z_")) | {"t", "s", "h",
                                                                             "v", "r"},
                        f"built-in rule for {target}")


def custom_call_flops(attrs: Mapping[str, Any], operands: Sequence[Shape],
                      shape: Shape) -> float:
    """FLOPs of a custom call (module docstring); 0 when unknown or without a rule."""
    target = str(attrs.get("custom_call_target", ""))
    try:
        rule = rule_for(attrs, operands, shape)
    except ValueError:
        return 0.0
    if rule is None:
        return 0.0
    if target.startswith("__cudnn$fmha"):
        s = rule.sizes
        n = s["m"] * s.get("r", 1)
        per = 2.0 * s["b"] * n * s["t"] * s["s"]
        flops = per * (3 * s["h"] + 2 * s["v"]) if "Backward" in target else \
            per * (s["h"] + s["v"])
        causal = "CAUSAL" in str(attrs.get("backend_config", "")).upper()
        return flops / 2 if causal else flops
    return 2.0 * math.prod(rule.sizes.values())
