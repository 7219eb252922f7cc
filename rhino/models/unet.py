"""UNet noise predictor, the backbone of diffusion models (no timestep conditioning).

Encoder level i (i < depth) applies a conv block of ``base_channels * 2**i`` channels, keeps
the result as a skip tensor and halves the resolution by 2x2 average pooling; a middle block of
``base_channels * 2**depth`` channels follows. Decoder level i (reversed) doubles the resolution
by nearest-neighbour `jnp.repeat`, concatenates the level's skip tensor on channels and applies
a conv block back to ``base_channels * 2**i``. A final 1x1 conv predicts the noise; the loss is
the MSE against it. A conv block is ``(conv3x3 → channel layernorm → silu) x 2``.

Parameters: ``{'down': [block] * depth, 'mid': block, 'up': [block] * depth (up[i] is level i),
'out': {'w': [1, 1, base, channels], 'b'}}``, a block being ``{'conv1', 'b1', 'norm1', 'conv2',
'b2', 'norm2'}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from rhino.models.base import (ModelConfig, avg_pool, conv2d, init_conv, init_layernorm,
                               layernorm, require)


def init_conv_block(key: jax.Array, c_in: int, c_out: int) -> dict[str, Any]:
    """Params of ``(conv3x3 → layernorm → silu) x 2`` from `c_in` to `c_out` channels."""
    k1, k2 = jax.random.split(key)
    return {"conv1": init_conv(k1, 3, c_in, c_out), "b1": jnp.zeros((c_out,), jnp.float32),
            "norm1": init_layernorm(c_out),
            "conv2": init_conv(k2, 3, c_out, c_out), "b2": jnp.zeros((c_out,), jnp.float32),
            "norm2": init_layernorm(c_out)}


def conv_block(p: dict[str, Any], x: jax.Array) -> jax.Array:
    """Applies a conv block (see `init_conv_block`)."""
    x = jax.nn.silu(layernorm(p["norm1"], conv2d(x, p["conv1"]) + p["b1"]))
    return jax.nn.silu(layernorm(p["norm2"], conv2d(x, p["conv2"]) + p["b2"]))


def upsample(x: jax.Array) -> jax.Array:
    """Nearest-neighbour 2x upsampling of NHWC `x`."""
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


@dataclass(frozen=True)
class UnetConfig(ModelConfig):
    """UNet hyper-parameters.

    Attributes:
        batch: Images per batch.
        image: Square image side (divisible by ``2**depth``).
        channels: Image channels (input and predicted noise).
        base_channels: Channels of the first level; level i has ``base_channels * 2**i``.
        depth: Down/up-sampling levels.
    """

    batch: int = 2
    image: int = 32
    channels: int = 3
    base_channels: int = 16
    depth: int = 3

    def __post_init__(self):
        require(min(self.batch, self.image, self.channels, self.base_channels, self.depth) >= 1,
                f"unet: sizes must be >= 1, got {self}")
        require(self.image % 2 ** self.depth == 0,
                f"unet: image ({self.image}) must be divisible by 2**depth ({2 ** self.depth})")

    def level_channels(self, level: int) -> int:
        """Channels at encoder/decoder `level` (``depth`` is the middle block)."""
        return self.base_channels * 2 ** level

    def init_params(self, key: jax.Array) -> dict[str, Any]:
        k_down, k_mid, k_up, k_out = jax.random.split(key, 4)
        c = self.level_channels
        down = [init_conv_block(k, self.channels if i == 0 else c(i - 1), c(i))
                for i, k in enumerate(jax.random.split(k_down, self.depth))]
        up = [init_conv_block(k, c(i + 1) + c(i), c(i))
              for i, k in enumerate(jax.random.split(k_up, self.depth))]
        return {"down": down, "mid": init_conv_block(k_mid, c(self.depth - 1), c(self.depth)),
                "up": up,
                "out": {"w": init_conv(k_out, 1, c(0), self.channels) * 0.1,
                        "b": jnp.zeros((self.channels,), jnp.float32)}}

    def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
        k_img, k_noise = jax.random.split(key)
        shape = (self.batch, self.image, self.image, self.channels)
        clean = jax.random.uniform(k_img, shape, jnp.float32, -1.0, 1.0)
        noise = jax.random.normal(k_noise, shape, jnp.float32)
        return {"inputs": clean + noise, "targets": noise}

    def loss(self, params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        x, skips = batch["inputs"], []
        for block in params["down"]:
            x = conv_block(block, x)
            skips.append(x)
            x = avg_pool(x)
        x = conv_block(params["mid"], x)
        for level in reversed(range(self.depth)):
            x = jnp.concatenate([upsample(x), skips[level]], axis=-1)
            x = conv_block(params["up"][level], x)
        pred = conv2d(x, params["out"]["w"]) + params["out"]["b"]
        return jnp.mean(jnp.square(pred - batch["targets"]))
