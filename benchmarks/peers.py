"""Hand-written peer strategies for the zoo models, as ``jax.jit`` in/out shardings.

Each peer is a rule set over the step's arguments ``(params, opt_state, batch)``: a parameter
or optimizer-state leaf is matched by its pytree path (``jax.tree_util.keystr``, e.g.
``['layers'][0]['wqkv']`` or ``[0].mu['layers'][0]['wqkv']``) against regular expressions;
Adam's ``mu`` and ``nu`` end in the same path as their parameter, so they get its spec. The
batch is matched by key. Peers (``STRATEGIES``):

``dp``         pure data parallel: batch dim 0 over all 8 devices; everything else replicated.
``megatron``   Megatron-style tensor parallel over all 8 devices, batch replicated:
               column-split first / row-split second matmul of each block (``wqkv`` and ``w1``
               split on their output dim, ``wo`` and ``w2`` on their input dim, ``b1`` split),
               vocabulary-parallel embedding (``wte`` split on the vocabulary); MoE experts
               split on their FFN dim (``w1 [E,H,F]`` on F, ``w2 [E,F,H]`` on F); convnets split
               the output channels of every conv kernel (and its bias) and the classifier's
               classes, VGG's first FC column-split and second row-split.
``zero3``      ZeRO-3 / FSDP-style: every parameter and optimizer-state array split along its
               largest dimension divisible by 8 (replicated if none is), batch dim 0 split.
``dp_tp``      2-D on a (2, 4) mesh: batch dim 0 on the first axis, Megatron on the second.
``xla_batch``  XLA's propagation from batch-sharded inputs alone: only the batch is given a
               sharding (dim 0 over 8); parameters and optimizer state are left unspecified
               (jax then passes them replicated) and so are all outputs, which XLA's
               propagation chooses.

Known limit of in/out shardings (documented, not worked around): the model's fused QKV weight
``[H, 3H]`` is laid out q|k|v, so Megatron's contiguous column split of ``3H`` does not align
with heads (a real Megatron stores it head-interleaved); XLA reshards at the reshape to heads.

Example:
    >>> megatron_spec("gpt", "[0].mu['layers'][3]['wqkv']", (1024, 3072), "tp", 4)
    (None, 'tp')
    >>> zero3_spec((8192, 1024), "d", 8)
    ('d', None)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import numpy as np

STRATEGIES = ("dp", "megatron", "zero3", "dp_tp", "xla_batch")
TP = "tp"  # the logical tensor-parallel axis in rule specs


@dataclasses.dataclass(frozen=True)
class Rule:
    """``pattern`` (regex searched in the leaf's path) with ``ndim`` (None: any) gets
    ``spec``: one entry per dim, ``None`` (not split) or ``TP`` (split over the TP axis)."""

    pattern: str
    spec: tuple
    ndim: int | None = None


_TRANSFORMER = (
    Rule(r"\['wte'\]$", (TP, None)),          # vocabulary-parallel embedding (tied head)
    Rule(r"\['wqkv'\]$", (None, TP)),         # column split: heads
    Rule(r"\['wo'\]$", (TP, None)),           # row split
    Rule(r"\['w1'\]$", (None, TP), ndim=2),   # column split
    Rule(r"\['b1'\]$", (TP,), ndim=1),
    Rule(r"\['w2'\]$", (TP, None), ndim=2),   # row split
)
_MOE_EXPERTS = (
    Rule(r"\['w1'\]$", (None, None, TP), ndim=3),   # [E, H, F]: F split
    Rule(r"\['b1'\]$", (None, TP), ndim=2),         # [E, F]
    Rule(r"\['w2'\]$", (None, TP, None), ndim=3),   # [E, F, H]: F split
)
_CONV_OUT = Rule(r"(\['(conv\d|shortcut|stem|w)'\])$", (None, None, None, TP), ndim=4)

MEGATRON_RULES: dict[str, tuple[Rule, ...]] = {
    "gpt": _TRANSFORMER,
    "moe": _TRANSFORMER + _MOE_EXPERTS,
    "vgg19": (
        _CONV_OUT,
        Rule(r"\['convs'\]\[\d+\]\['b'\]$", (TP,)),
        Rule(r"\['fcs'\]\[0\]\['w'\]$", (None, TP)),      # column split
        Rule(r"\['fcs'\]\[0\]\['b'\]$", (TP,)),
        Rule(r"\['fcs'\]\[1\]\['w'\]$", (TP, None)),      # row split
        Rule(r"\['classifier'\]\['w'\]$", (None, TP)),    # classes split
        Rule(r"\['classifier'\]\['b'\]$", (TP,)),
    ),
    "wide_resnet": (
        _CONV_OUT,
        Rule(r"\['head'\]\['w'\]$", (None, TP)),          # classes split
        Rule(r"\['head'\]\['b'\]$", (TP,)),
    ),
}
"""Megatron-style rules per zoo model; unmatched leaves are replicated."""


class PeerRuleError(ValueError):
    """A rule cannot be applied (a split dim not divisible by the axis size)."""


def _keystr(path) -> str:
    import jax
    return jax.tree_util.keystr(path)


def megatron_spec(model: str, path: str, shape: Sequence[int], tp_axis: str, tp_size: int):
    """The PartitionSpec entries of one parameter / optimizer-state leaf under Megatron."""
    for rule in MEGATRON_RULES[model]:
        if rule.ndim is not None and rule.ndim != len(shape):
            continue
        if re.search(rule.pattern, path):
            if len(rule.spec) != len(shape):
                raise PeerRuleError(f"megatron rule {rule.pattern!r}: spec {rule.spec} for "
                                    f"{path} of shape {tuple(shape)}")
            for d, s in zip(shape, rule.spec):
                if s == TP and d % tp_size:
                    raise PeerRuleError(f"megatron rule {rule.pattern!r}: {path} dim of size "
                                        f"{d} is not divisible by {tp_size}")
            return tuple(tp_axis if s == TP else None for s in rule.spec)
    return ()


def zero3_spec(shape: Sequence[int], axis: str, size: int):
    """Split the largest dim divisible by ``size`` (first on ties); else replicate."""
    best = None
    for i, d in enumerate(shape):
        if d % size == 0 and d >= size and (best is None or d > shape[best]):
            best = i
    if best is None:
        return ()
    return tuple(axis if i == best else None for i in range(len(shape)))


def peer_mesh(strategy: str, devices: Sequence[Any]):
    """The ``jax.sharding.Mesh`` (Auto axes) a peer runs on: (8,) ``('d',)``, or (2, 4)
    ``('dp', 'tp')`` for ``dp_tp``."""
    from jax.sharding import Mesh

    devs = np.array(list(devices)[:8])
    if strategy == "dp_tp":
        return Mesh(devs.reshape(2, 4), ("dp", "tp"))
    return Mesh(devs, ("d",))


def peer_shardings(strategy: str, model: str, args: tuple, devices: Sequence[Any]):
    """``(in_shardings, out_shardings)`` of ``jax.jit(step, ...)`` for a peer.

    Args:
        strategy: one of ``STRATEGIES``.
        model: zoo model name (a key of ``MEGATRON_RULES`` for the TP peers).
        args: ``(params, opt_state, batch)``, arrays or ShapeDtypeStructs.
        devices: at least 8 devices.

    Returns:
        Pytrees of ``NamedSharding`` matching ``args`` and ``(params, opt_state, loss)``;
        for ``xla_batch`` the non-batch inputs are ``None`` (unspecified) and
        ``out_shardings`` is None (left to XLA).
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown peer {strategy!r}; expected one of {STRATEGIES}")
    mesh = peer_mesh(strategy, devices)
    params, opt_state, batch = args

    def state_spec(path, leaf):
        shape = tuple(leaf.shape)
        key = _keystr(path)
        if strategy in ("dp", "xla_batch"):
            return ()
        if strategy == "megatron":
            return megatron_spec(model, key, shape, "d", 8)
        if strategy == "dp_tp":
            return megatron_spec(model, key, shape, "tp", 4)
        return zero3_spec(shape, "d", 8)  # zero3

    def batch_spec(path, leaf):
        if strategy == "megatron":
            return ()
        axis = "dp" if strategy == "dp_tp" else "d"
        size = mesh.shape[axis]
        if leaf.shape[0] % size:
            raise PeerRuleError(f"{strategy}: batch leaf {_keystr(path)} dim 0 of size "
                                f"{leaf.shape[0]} is not divisible by {size}")
        return (axis,) + (None,) * (len(leaf.shape) - 1)

    def named(spec):
        return NamedSharding(mesh, P(*spec))

    if strategy == "xla_batch":
        in_sh = (jax.tree.map(lambda _: None, params), jax.tree.map(lambda _: None, opt_state),
                 jax.tree_util.tree_map_with_path(lambda p, l: named(batch_spec(p, l)), batch))
        return in_sh, None
    in_sh = tuple(jax.tree_util.tree_map_with_path(lambda p, l: named(state_spec(p, l)), t)
                  for t in (params, opt_state))
    in_sh = in_sh + (jax.tree_util.tree_map_with_path(lambda p, l: named(batch_spec(p, l)),
                                                      batch),)
    out_sh = (in_sh[0], in_sh[1], named(()))
    return in_sh, out_sh


def describe(strategy: str, model: str, args: tuple, devices: Sequence[Any]) -> dict[str, str]:
    """Parameter path -> PartitionSpec text (for printing what a peer does)."""
    import jax

    in_sh, _ = peer_shardings(strategy, model, args, devices)
    out = {}
    for path, s in jax.tree_util.tree_leaves_with_path(in_sh[0], is_leaf=lambda x: x is None):
        out[_keystr(path)] = "unspecified" if s is None else str(s.spec)
    return out


# ----------------------------------------------------------- expert plans as pins
# The zoo models without rules of their own take those of their kind.
RULES_OF = {"dnabert": "gpt", "unet": "wide_resnet"}


def fits(dims: Sequence[int], spec: Any, mesh_shape: Sequence[int]) -> bool:
    """Whether the PartitionSpec ``spec`` fits a leaf of shape ``dims`` on a mesh of
    ``mesh_shape`` (axes ``x``, ``y``): rhino's own check of an annotation."""
    from rhino.planner.mesh import AbstractMesh
    from rhino.planner.pins import annotation_spec

    mesh = AbstractMesh(tuple(mesh_shape))
    return not annotation_spec("fits", spec, mesh, len(dims)).problems(tuple(dims), mesh)


def expert_annotations(graph, model: str, mesh_shape: Sequence[int]) -> dict[str, dict]:
    """name -> annotations: the textbook plans that fit ``graph``'s leaves on the mesh.

    Megatron is this module's rules (column/row pairs, the vocabulary-parallel embedding,
    convolutions by output channel, MoE experts by their hidden dimension; the plain MLP
    alternates column and row), ZeRO-3 its split of each state leaf's largest divisible
    dimension; a leaf a rule does not fit (``fits``) is left to the search. Also: expert parallelism (MoE experts over every axis) and, on a 2-D mesh,
    the batch over one axis with Megatron over the other, both ways. Keys are pytree
    paths as rhino names parameters; for ``rhino.plan(..., annotations=)``
    (``tests/test_search_space.py``, ``benchmarks/plan_quality.py pins``)."""
    from jax.sharding import PartitionSpec as P

    names = ("x", "y")[:len(mesh_shape)]
    sizes = dict(zip(names, mesh_shape))
    leaves = {graph.ops[p].arg.path: tuple(graph.ops[p].shape.dims) for p in graph.params}
    batch = [p for p in leaves if p.startswith("batch")]
    state = [p for p in leaves if p.startswith(("params", "opt_state")) and leaves[p]]
    every = names if len(names) > 1 else names[0]

    def pins(specs: dict) -> dict:
        return {p: s for p, s in specs.items() if fits(leaves[p], s, mesh_shape)}

    def megatron(tp) -> dict:
        size = math.prod(sizes[a] for a in ((tp,) if isinstance(tp, str) else tp))
        out = {}
        for p in state:
            layer = re.search(r"\['layers'\]\[(\d+)\]\['(w|b)'\]$", p)
            if model == "mlp" and layer:     # the plain MLP: layers alternate column / row
                column = int(layer.group(1)) % 2 == 0
                if layer.group(2) == "w":
                    out[p] = P(None, tp) if column else P(tp, None)
                elif column:
                    out[p] = P(tp)
                continue
            try:
                entries = megatron_spec(RULES_OF.get(model, model), p, leaves[p], tp, size)
            except PeerRuleError:
                continue
            if entries:
                out[p] = P(*entries)
        return pins(out)

    plans: dict[str, dict[str, P]] = {}
    rows = min(leaves[p][0] for p in batch)
    dp, n = [], 1          # the batch over every axis whose product divides it
    for a in names:
        if rows % (n * sizes[a]) == 0:
            dp.append(a)
            n *= sizes[a]
    plans["data parallel"] = pins({p: P(tuple(dp)) for p in batch}) if dp else {}
    plans["fsdp"] = {**plans["data parallel"], **pins(
        {p: P(*zero3_spec(leaves[p], every, math.prod(mesh_shape))) for p in state})}
    plans["megatron"] = megatron(every)
    experts = pins({p: P(every) for p in state if re.search(r"\['(w1|w2|b1|b2)'\]$", p)
                    and len(leaves[p]) == (3 if re.search(r"w[12]'\]$", p) else 2)})
    if experts:
        plans["expert parallel"] = {**plans["data parallel"], **experts}
    if len(names) == 2:
        for dp_axis, tp in (("x", "y"), ("y", "x")):
            plans[f"dp over {dp_axis} x tp over {tp}"] = {
                **pins({p: P(dp_axis) for p in batch}), **megatron(tp)}
    return {k: v for k, v in plans.items() if v}
