"""A plain multi-layer perceptron regressed onto a random target with MSE.

``x [batch, in_dim] @ w0 + b0 → relu → ... → @ w_{L-1} + b_{L-1}`` (no activation after the
last layer). Parameters: ``{'layers': [{'w': [d_in, d_out], 'b': [d_out]}, ...]}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp

from rhino.models.base import ModelConfig, normal, require


@dataclass(frozen=True)
class MlpConfig(ModelConfig):
    """MLP hyper-parameters.

    Attributes:
        batch: Rows per batch.
        hidden: Width of every hidden layer.
        layers: Number of linear layers (>= 1).
        in_dim: Input features; None means `hidden`.
        out_dim: Output features; None means `hidden`.
    """

    batch: int = 128
    hidden: int = 256
    layers: int = 2
    in_dim: Optional[int] = None
    out_dim: Optional[int] = None

    def __post_init__(self):
        require(min(self.batch, self.hidden, self.layers) >= 1,
                f"mlp: batch, hidden and layers must be >= 1, got {self}")

    def dims(self) -> list[int]:
        """Returns the layer widths ``[in_dim, hidden, ..., out_dim]`` (length layers + 1)."""
        in_dim = self.in_dim or self.hidden
        out_dim = self.out_dim or self.hidden
        return [in_dim] + [self.hidden] * (self.layers - 1) + [out_dim]

    def init_params(self, key: jax.Array) -> dict[str, Any]:
        dims = self.dims()
        keys = jax.random.split(key, self.layers)
        return {"layers": [
            {"w": normal(keys[i], (dims[i], dims[i + 1]), math.sqrt(2.0 / dims[i])),
             "b": jnp.zeros((dims[i + 1],), jnp.float32)}
            for i in range(self.layers)]}

    def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
        dims = self.dims()
        k_x, k_y = jax.random.split(key)
        return {"inputs": jax.random.normal(k_x, (self.batch, dims[0]), jnp.float32),
                "targets": jax.random.normal(k_y, (self.batch, dims[-1]), jnp.float32)}

    def loss(self, params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        x = batch["inputs"]
        for i, layer in enumerate(params["layers"]):
            x = x @ layer["w"] + layer["b"]
            if i + 1 < len(params["layers"]):
                x = jax.nn.relu(x)
        return jnp.mean(jnp.square(x - batch["targets"]))
