"""GShard-style mixture-of-experts transformer language model.

A GPT decoder (see `rhino.models.gpt`) whose every `moe_every`-th layer replaces the dense FFN
by top-2 gated experts (GShard, Lepikhin et al. 2020). Each sequence is one gating group of
``S = seq`` tokens; each expert takes at most ``C = ceil(capacity_factor * S / experts)`` tokens
per group (with top-2 routing, ``capacity_factor = 2`` is the fair share of the 2·S choices).
Routing builds dense einsum operands, as in GShard::

    gates   [G, S, E]     = softmax(x @ wg)
    combine [G, S, E, C]  = gate weight of token s at slot c of expert e (0 if unrouted)
    dispatch[G, S, E, C]  = combine > 0
    expert_in  [E, G, C, M] = einsum('gsec,gsm->egcm', dispatch, x)
    expert_out [E, G, C, M] = gelu(expert_in @ w1[e] + b1[e]) @ w2[e] + b2[e]
    y          [G, S, M]    = einsum('gsec,egcm->gsm', combine, expert_out)

MoE layer params: ``ln1, wqkv, wo, ln2, wg [hidden, experts], w1 [experts, hidden, ffn],
b1 [experts, ffn], w2 [experts, ffn, hidden], b2 [experts, hidden]``; dense layers are GPT's.
The loss is the LM cross-entropy plus ``aux_loss_weight`` times the mean load-balancing loss.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp

from rhino.models.base import (ModelConfig, embed, init_attention, init_layernorm, init_transformer_layer, layernorm, normal,
                               require, self_attention, transformer_layer)
from rhino.models.gpt import LanguageModel, lm_head_loss, make_lm_batch, validate_lm

MOE_CONFIGS = types.MappingProxyType({
    # The Rhino paper's Table 2 (N_params, N_GPUs in the comment).
    "MoE-8E-380M": types.MappingProxyType(
        {"layers": 8, "hidden": 768, "ffn": 6144, "heads": 16, "experts": 8}),  # 350M, 1
    "MoE-8E-760M": types.MappingProxyType(
        {"layers": 16, "hidden": 768, "ffn": 6144, "heads": 16, "experts": 8}),  # 760M, 2
    "MoE-16E-1.3B": types.MappingProxyType(
        {"layers": 16, "hidden": 768, "ffn": 6144, "heads": 16, "experts": 16}),  # 1.3B, 4
    "MoE-16E-2.4B": types.MappingProxyType(
        {"layers": 16, "hidden": 1024, "ffn": 8192, "heads": 16, "experts": 16}),  # 2.4B, 8
    "MoE-32E-10B": types.MappingProxyType(
        {"layers": 16, "hidden": 1536, "ffn": 12288, "heads": 16, "experts": 32}),  # 10B, 16
})
"""Presets for ``get_model("moe", preset=...)``: the Rhino paper's Table 2 shapes."""


def top2_routing(gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 routing of one batch of groups.

    Args:
        gates: Router probabilities [groups, tokens, experts].
        capacity: Slots per expert per group.

    Returns:
        ``(combine, dispatch, aux_loss)``: combine weights and the 0/1 dispatch mask, both
        [groups, tokens, experts, capacity], and the scalar load-balancing loss.
    """
    experts = gates.shape[-1]
    mask1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), experts, dtype=gates.dtype)
    gates_without_1 = gates * (1.0 - mask1)
    mask2 = jax.nn.one_hot(jnp.argmax(gates_without_1, axis=-1), experts, dtype=gates.dtype)

    # Load balancing (GShard eq. 4): fraction routed first to e times its mean gate, · E².
    density = jnp.mean(mask1, axis=1)
    density_proxy = jnp.mean(gates, axis=1)
    aux_loss = jnp.mean(density * density_proxy) * experts * experts

    # Slot of each token in its expert's buffer: first choices fill first, then second ones.
    position1 = (jnp.cumsum(mask1, axis=1) - 1.0) * mask1
    mask1 = mask1 * (position1 < capacity)
    count1 = jnp.sum(mask1, axis=1, keepdims=True)
    position2 = (jnp.cumsum(mask2, axis=1) - 1.0 + count1) * mask2
    mask2 = mask2 * (position2 < capacity)

    gate1 = jnp.sum(gates * mask1, axis=-1)
    gate2 = jnp.sum(gates * mask2, axis=-1)
    denom = jnp.maximum(gate1 + gate2, jnp.finfo(gates.dtype).eps)
    gate1, gate2 = gate1 / denom, gate2 / denom

    slot1 = jax.nn.one_hot(jnp.sum(position1 * mask1, axis=-1).astype(jnp.int32), capacity,
                           dtype=gates.dtype)
    slot2 = jax.nn.one_hot(jnp.sum(position2 * mask2, axis=-1).astype(jnp.int32), capacity,
                           dtype=gates.dtype)
    combine = (gate1[..., None, None] * mask1[..., None] * slot1[:, :, None, :]
               + gate2[..., None, None] * mask2[..., None] * slot2[:, :, None, :])
    dispatch = (combine > 0).astype(gates.dtype)
    return combine, dispatch, aux_loss


def moe_ffn(p: dict[str, jax.Array], x: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Top-2 gated experts on `x` [groups, tokens, hidden]; returns ``(y, aux_loss)``."""
    gates = jax.nn.softmax(x @ p["wg"], axis=-1)
    combine, dispatch, aux_loss = top2_routing(gates, capacity)
    expert_in = jnp.einsum("gsec,gsm->egcm", dispatch, x)
    hidden = jax.nn.gelu(jnp.einsum("egcm,emf->egcf", expert_in, p["w1"])
                         + p["b1"][:, None, None, :])
    expert_out = jnp.einsum("egcf,efm->egcm", hidden, p["w2"]) + p["b2"][:, None, None, :]
    return jnp.einsum("gsec,egcm->gsm", combine, expert_out), aux_loss


@dataclass(frozen=True)
class MoeConfig(LanguageModel, ModelConfig):
    """GShard MoE hyper-parameters.

    Attributes:
        batch: Sequences per batch (each sequence is one gating group).
        seq: Tokens per sequence.
        vocab: Vocabulary size.
        layers: Transformer layers.
        hidden: Model width.
        ffn: FFN inner width of dense layers and of each expert; None means ``4 * hidden``.
        heads: Attention heads (must divide `hidden`).
        experts: Experts per MoE layer (>= 2 for top-2 routing).
        capacity_factor: Expert capacity is ``ceil(capacity_factor * seq / experts)``.
        moe_every: Layer i (0-based) is MoE when ``(i + 1) % moe_every == 0``.
        aux_loss_weight: Weight of the load-balancing loss added to the LM loss.
    """

    batch: int = 4
    seq: int = 64
    vocab: int = 1024
    layers: int = 2
    hidden: int = 128
    ffn: Optional[int] = None
    heads: int = 4
    experts: int = 4
    capacity_factor: float = 2.0
    moe_every: int = 2
    aux_loss_weight: float = 0.01

    PRESETS = MOE_CONFIGS

    def __post_init__(self):
        validate_lm("moe", self)
        require(self.experts >= 2, f"moe: top-2 routing needs experts >= 2, got {self.experts}")
        require(self.moe_every >= 1, f"moe: moe_every must be >= 1, got {self.moe_every}")
        require(self.capacity_factor > 0,
                f"moe: capacity_factor must be > 0, got {self.capacity_factor}")

    @property
    def capacity(self) -> int:
        """Slots per expert per group: ``ceil(capacity_factor * seq / experts)``."""
        return max(1, math.ceil(self.capacity_factor * self.seq / self.experts))

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) has an MoE FFN."""
        return (index + 1) % self.moe_every == 0

    def _init_moe_layer(self, key: jax.Array) -> dict[str, Any]:
        k_attn, k_g, k1, k2 = jax.random.split(key, 4)
        e, h, f = self.experts, self.hidden, self.ffn_dim
        return {"ln1": init_layernorm(h), **init_attention(k_attn, h), "ln2": init_layernorm(h),
                "wg": normal(k_g, (h, e), 0.02),
                "w1": normal(k1, (e, h, f), 0.02), "b1": jnp.zeros((e, f), jnp.float32),
                "w2": normal(k2, (e, f, h), 0.02), "b2": jnp.zeros((e, h), jnp.float32)}

    def init_params(self, key: jax.Array) -> dict[str, Any]:
        k_emb, k_layers = jax.random.split(key)
        layers = [self._init_moe_layer(k) if self.is_moe_layer(i)
                  else init_transformer_layer(k, self.hidden, self.ffn_dim)
                  for i, k in enumerate(jax.random.split(k_layers, self.layers))]
        return self.lm_params(k_emb, layers)

    def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
        return make_lm_batch(self, key)

    def loss(self, params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        x = embed(params, batch["tokens"])
        aux_losses = []
        for i, layer in enumerate(params["layers"]):
            if self.is_moe_layer(i):
                x = x + self_attention(layer, layernorm(layer["ln1"], x), self.heads, causal=True)
                y, aux = moe_ffn(layer, layernorm(layer["ln2"], x), self.capacity)
                x = x + y
                aux_losses.append(aux)
            else:
                x = transformer_layer(layer, x, self.heads, causal=True)
        loss = lm_head_loss(params, x, batch["labels"])
        if aux_losses:
            loss = loss + self.aux_loss_weight * jnp.mean(jnp.stack(aux_losses))
        return loss
