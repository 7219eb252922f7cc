"""GPT: a decoder-only transformer language model (pre-LN, fused QKV, tied embeddings).

Parameters (unrolled, ``scan=False``)::

    {'wte': [vocab, hidden], 'wpe': [seq, hidden],
     'layers': [{'ln1': {'scale', 'bias'}, 'wqkv': [hidden, 3*hidden], 'wo': [hidden, hidden],
                 'ln2': {'scale', 'bias'}, 'w1': [hidden, ffn], 'b1', 'w2': [ffn, hidden], 'b2'},
                ...],
     'ln_f': {'scale', 'bias'}}

With ``scan=True`` ``params['layers']`` is one dict whose arrays carry a leading [layers] axis,
and the layers run under `jax.lax.scan` (an HLO while loop). Logits are ``x @ wte.T``; the loss
is softmax cross-entropy against the next token.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp

from rhino.models.base import (ModelConfig, cross_entropy, embed, init_embeddings,
                               init_layernorm, init_transformer_layer, layernorm, require,
                               transformer_layer)

GPT_CONFIGS = types.MappingProxyType({
    # The Rhino paper's Table 1; comment: N_params, N_GPUs of the paper's weak-scaling runs.
    "GPT-Medium": types.MappingProxyType(
        {"layers": 24, "hidden": 1024, "ffn": 4096, "heads": 16}),  # 350M, 1
    "GPT-Large": types.MappingProxyType(
        {"layers": 24, "hidden": 1536, "ffn": 6144, "heads": 16}),  # 760M, 2
    "GPT-XL": types.MappingProxyType(
        {"layers": 24, "hidden": 2048, "ffn": 8192, "heads": 32}),  # 1.3B, 4
    "GPT-2.7B": types.MappingProxyType(
        {"layers": 32, "hidden": 2560, "ffn": 10240, "heads": 32}),  # 2.7B, 8
    "GPT-6.7B": types.MappingProxyType(
        {"layers": 32, "hidden": 4096, "ffn": 16384, "heads": 32}),  # 6.7B, 16
})
"""Presets for ``get_model("gpt", preset=...)``: the Rhino paper's Table 1 shapes."""


class LanguageModel:
    """What the transformer language models share (a mixin of their frozen configs, which
    have ``vocab``, ``seq``, ``hidden`` and ``ffn``)."""

    @property
    def ffn_dim(self) -> int:
        """The FFN inner width (``ffn`` or ``4 * hidden``)."""
        return self.ffn or 4 * self.hidden

    def lm_params(self, k_emb: jax.Array, layers: Any) -> dict[str, Any]:
        """Embeddings, the given layers, and the final layernorm."""
        return {**init_embeddings(k_emb, self.vocab, self.seq, self.hidden),
                "layers": layers, "ln_f": init_layernorm(self.hidden)}


def validate_lm(name: str, cfg: Any) -> None:
    """Checks the fields shared by the transformer LMs (batch, seq, vocab, layers, heads)."""
    require(min(cfg.batch, cfg.seq, cfg.vocab, cfg.layers, cfg.hidden, cfg.heads) >= 1,
            f"{name}: batch, seq, vocab, layers, hidden and heads must be >= 1, got {cfg}")
    require(cfg.hidden % cfg.heads == 0,
            f"{name}: hidden ({cfg.hidden}) must be divisible by heads ({cfg.heads})")
    require(cfg.ffn is None or cfg.ffn >= 1, f"{name}: ffn must be >= 1 or None, got {cfg.ffn}")


def make_lm_batch(cfg: Any, key: jax.Array) -> dict[str, jax.Array]:
    """Random token sequences: ``tokens`` [batch, seq] and next-token ``labels`` [batch, seq]."""
    stream = jax.random.randint(key, (cfg.batch, cfg.seq + 1), 0, cfg.vocab, jnp.int32)
    return {"tokens": stream[:, :-1], "labels": stream[:, 1:]}


def lm_head_loss(params: dict[str, Any], x: jax.Array, labels: jax.Array) -> jax.Array:
    """Final layernorm, tied logits ``x @ wte.T`` and the mean cross-entropy."""
    logits = layernorm(params["ln_f"], x) @ params["wte"].T
    return cross_entropy(logits, labels)


@dataclass(frozen=True)
class GptConfig(LanguageModel, ModelConfig):
    """GPT hyper-parameters.

    Attributes:
        batch: Sequences per batch.
        seq: Tokens per sequence (also the size of the learned position table).
        vocab: Vocabulary size.
        layers: Transformer layers.
        hidden: Model width.
        ffn: FFN inner width; None means ``4 * hidden``.
        heads: Attention heads (must divide `hidden`).
        scan: Stack the layers and run them under `jax.lax.scan` (an HLO while loop).
        remat: Recompute each layer in the backward pass (`jax.checkpoint` per layer).
    """

    batch: int = 4
    seq: int = 64
    vocab: int = 1024
    layers: int = 2
    hidden: int = 128
    ffn: Optional[int] = None
    heads: int = 4
    scan: bool = False
    remat: bool = False

    PRESETS = GPT_CONFIGS

    def __post_init__(self):
        validate_lm("gpt", self)

    def init_params(self, key: jax.Array) -> dict[str, Any]:
        k_emb, k_layers = jax.random.split(key)
        layers = [init_transformer_layer(k, self.hidden, self.ffn_dim)
                  for k in jax.random.split(k_layers, self.layers)]
        if self.scan:
            layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
        return self.lm_params(k_emb, layers)

    def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
        return make_lm_batch(self, key)

    def loss(self, params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        x = embed(params, batch["tokens"])

        def block(layer, h):
            return transformer_layer(layer, h, self.heads, causal=True)

        if self.remat:
            block = jax.checkpoint(block)
        if self.scan:
            def body(h, layer):
                return block(layer, h), None

            x, _ = jax.lax.scan(body, x, params["layers"])
        else:
            for layer in params["layers"]:
                x = block(layer, x)
        return lm_head_loss(params, x, batch["labels"])
