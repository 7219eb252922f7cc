"""VGG19 with a large final classifier (the Rhino paper replaces it by a million-class one).

Sixteen 3x3 SAME convolutions (NHWC / HWIO) with ReLU in five blocks of 2, 2, 4, 4, 4, each
block followed by a 2x2 max-pool; VGG19's 64-128-256-512-512 channel plan is scaled to
``width * [1, 2, 4, 8, 8]``. Then two ReLU fully-connected layers of `fc_hidden` and the
classifier, with softmax cross-entropy. Parameters::

    {'convs': [{'w': [3, 3, c_in, c_out], 'b': [c_out]}] * 16,
     'fcs': [{'w', 'b'}] * 2, 'classifier': {'w': [fc_hidden, classes], 'b': [classes]}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from rhino.models.base import (ModelConfig, conv2d, cross_entropy, init_conv, max_pool, normal,
                               require)

BLOCKS = ((2, 1), (2, 2), (4, 4), (4, 8), (4, 8))
"""VGG19's five conv blocks as (convs, channel multiple of `width`)."""


@dataclass(frozen=True)
class Vgg19Config(ModelConfig):
    """VGG19 hyper-parameters.

    Attributes:
        batch: Images per batch.
        image: Square image side (>= 32: five 2x2 pools).
        channels: Input channels.
        width: Channels of the first block (VGG19 proper: 64).
        classes: Classifier outputs.
        fc_hidden: Width of the two hidden fully-connected layers (VGG19 proper: 4096).
    """

    batch: int = 8
    image: int = 32
    channels: int = 3
    width: int = 16
    classes: int = 10000
    fc_hidden: int = 256

    def __post_init__(self):
        require(min(self.batch, self.channels, self.width, self.classes, self.fc_hidden) >= 1,
                f"vgg19: sizes must be >= 1, got {self}")
        require(self.image >= 32, f"vgg19: image must be >= 32 (five 2x2 pools), got {self.image}")

    def conv_channels(self) -> list[tuple[int, int]]:
        """Returns ``(c_in, c_out)`` of the 16 convolutions, in order."""
        pairs, c_in = [], self.channels
        for convs, multiple in BLOCKS:
            for _ in range(convs):
                pairs.append((c_in, self.width * multiple))
                c_in = self.width * multiple
        return pairs

    def flat_features(self) -> int:
        """Features entering the first fully-connected layer."""
        side = self.image
        for _ in BLOCKS:
            side //= 2
        return side * side * self.width * BLOCKS[-1][1]

    def init_params(self, key: jax.Array) -> dict[str, Any]:
        k_conv, k_fc, k_cls = jax.random.split(key, 3)
        convs = [{"w": init_conv(k, 3, c_in, c_out), "b": jnp.zeros((c_out,), jnp.float32)}
                 for k, (c_in, c_out) in zip(jax.random.split(k_conv, 16), self.conv_channels())]
        fc_dims = [self.flat_features(), self.fc_hidden, self.fc_hidden]
        fcs = [{"w": normal(k, (fc_dims[i], fc_dims[i + 1]), math.sqrt(2.0 / fc_dims[i])),
                "b": jnp.zeros((fc_dims[i + 1],), jnp.float32)}
               for i, k in enumerate(jax.random.split(k_fc, 2))]
        classifier = {"w": normal(k_cls, (self.fc_hidden, self.classes),
                                  1.0 / math.sqrt(self.fc_hidden)),
                      "b": jnp.zeros((self.classes,), jnp.float32)}
        return {"convs": convs, "fcs": fcs, "classifier": classifier}

    def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
        k_img, k_lbl = jax.random.split(key)
        shape = (self.batch, self.image, self.image, self.channels)
        return {"images": jax.random.normal(k_img, shape, jnp.float32),
                "labels": jax.random.randint(k_lbl, (self.batch,), 0, self.classes, jnp.int32)}

    def loss(self, params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        x, index = batch["images"], 0
        for convs, _ in BLOCKS:
            for _ in range(convs):
                conv = params["convs"][index]
                x = jax.nn.relu(conv2d(x, conv["w"]) + conv["b"])
                index += 1
            x = max_pool(x)
        x = x.reshape(x.shape[0], -1)
        for fc in params["fcs"]:
            x = jax.nn.relu(x @ fc["w"] + fc["b"])
        logits = x @ params["classifier"]["w"] + params["classifier"]["b"]
        return cross_entropy(logits, batch["labels"])
