"""DNABERT: a BERT-like bidirectional encoder over long nucleotide-token sequences.

Pre-LN transformer layers without a causal mask (same layer params as `rhino.models.gpt`),
a learned position table, and a masked-LM objective: 15% of input tokens are replaced by the
mask token (id ``vocab - 1``) and the model predicts the original token at every position
(tied output embedding ``x @ wte.T``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp

from rhino.models.base import (ModelConfig, cross_entropy, embed, init_transformer_layer,
                               layernorm, require, transformer_layer)
from rhino.models.gpt import LanguageModel, validate_lm


@dataclass(frozen=True)
class DnabertConfig(LanguageModel, ModelConfig):
    """DNABERT hyper-parameters.

    Attributes:
        batch: Sequences per batch.
        seq: Tokens per sequence (long: DNA contexts).
        vocab: Vocabulary size, the last id being the mask token (k-mer vocabularies).
        layers: Encoder layers.
        hidden: Model width.
        heads: Attention heads (must divide `hidden`).
        ffn: FFN inner width; None means ``4 * hidden``.
        mask_rate: Fraction of input positions replaced by the mask token.
    """

    batch: int = 2
    seq: int = 512
    vocab: int = 64
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    ffn: Optional[int] = None
    mask_rate: float = 0.15

    def __post_init__(self):
        validate_lm("dnabert", self)
        require(self.vocab >= 2, f"dnabert: vocab must be >= 2 (mask token), got {self.vocab}")

    def init_params(self, key: jax.Array) -> dict[str, Any]:
        k_emb, k_layers = jax.random.split(key)
        layers = [init_transformer_layer(k, self.hidden, self.ffn_dim)
                  for k in jax.random.split(k_layers, self.layers)]
        return self.lm_params(k_emb, layers)

    def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
        k_tok, k_mask = jax.random.split(key)
        labels = jax.random.randint(k_tok, (self.batch, self.seq), 0, self.vocab - 1, jnp.int32)
        masked = jax.random.bernoulli(k_mask, self.mask_rate, labels.shape)
        return {"tokens": jnp.where(masked, self.vocab - 1, labels), "labels": labels}

    def loss(self, params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        x = embed(params, batch["tokens"])
        for layer in params["layers"]:
            x = transformer_layer(layer, x, self.heads, causal=False)
        logits = layernorm(params["ln_f"], x) @ params["wte"].T
        return cross_entropy(logits, batch["labels"])
