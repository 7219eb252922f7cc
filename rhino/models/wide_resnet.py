"""Wide ResNet, with a stateless channel layernorm instead of batchnorm (the step stays pure).

Two layouts, chosen by ``block``:

* ``"basic"`` (WRN-n-k, Zagoruyko & Komodakis 2016): a 3x3 stem to `base_channels`, then three
  groups of ``(layers - 4) / 6`` pre-activation basic blocks (norm→relu→conv3x3, twice) with
  ``base_channels * width_factor * [1, 2, 4]`` channels and strides 1, 2, 2.
* ``"bottleneck"`` (the ResNet-50/101/152 layout of Alpa's WResNet, used by the Rhino paper's
  Table 4): four stages of ``[3, 4, 6, 3]`` / ``[3, 4, 23, 3]`` / ``[3, 8, 36, 3]``
  pre-activation blocks ``1x1 (f) → 3x3 (f * width_factor) → 1x1 (4f)`` with
  ``f = base_channels * 2**stage``; stride 2 at the first block of stages 1-3. The stem stays
  the 3x3 conv (no 7x7 / max-pool: images are small here).

Then norm → relu → global average pool → a linear classifier with softmax cross-entropy.
Parameters: ``{'stem': [3, 3, c, base], 'groups': [[block, ...], ...], 'norm': {...},
'head': {'w', 'b'}}``; a block holds ``norm1, conv1, norm2, conv2`` (+ ``norm3, conv3`` when
bottleneck) and ``shortcut`` (1x1) when its shape changes.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from rhino.models.base import (ModelConfig, conv2d, cross_entropy, init_conv, init_layernorm,
                               layernorm, normal, require)

BOTTLENECK_STAGES = types.MappingProxyType({50: (3, 4, 6, 3), 101: (3, 4, 23, 3),
                                            152: (3, 8, 36, 3)})
"""Blocks per stage of the bottleneck layout, by depth."""

WIDE_RESNET_CONFIGS = types.MappingProxyType({
    # The Rhino paper's Table 4 (global batch 4); comment: N_GPUs, then the parameters this
    # layout has with 1000 classes, which equal Alpa's WResNet sizes (the paper's labels differ).
    "WR-1.3B": types.MappingProxyType(
        {"block": "bottleneck", "base_channels": 320, "width_factor": 2, "layers": 50}),  # 1, 1.0B
    "WR-2.6B": types.MappingProxyType(
        {"block": "bottleneck", "base_channels": 448, "width_factor": 2, "layers": 50}),  # 2, 2.0B
    "WR-6B": types.MappingProxyType(
        {"block": "bottleneck", "base_channels": 640, "width_factor": 2, "layers": 50}),  # 4, 4.0B
    "WR-12B": types.MappingProxyType(  # 8, 9.5B
        {"block": "bottleneck", "base_channels": 320, "width_factor": 12, "layers": 101}),
})
"""Presets for ``get_model("wide_resnet", preset=...)``: the Rhino paper's Table 4 shapes."""


@dataclass(frozen=True)
class BlockSpec:
    """Static shape of one residual block.

    Channels go ``c_in`` → conv1 → ``c_mid`` → conv2 → ``c_wide`` (→ conv3 → ``c_out`` if
    bottleneck; basic blocks have ``c_mid == c_wide == c_out``); `stride` is applied by the
    3x3 conv that changes resolution (conv1 if basic, conv2 if bottleneck) and the shortcut.
    """

    c_in: int
    c_mid: int
    c_wide: int
    c_out: int
    stride: int


@dataclass(frozen=True)
class WideResnetConfig(ModelConfig):
    """Wide ResNet hyper-parameters.

    Attributes:
        batch: Images per batch.
        image: Square image side.
        channels: Input channels.
        base_channels: Stem width (and the first group's width before `width_factor`).
        width_factor: Channel multiplier k of WRN-n-k (inner width multiplier if bottleneck).
        layers: Depth n: ``(n - 4) % 6 == 0`` for basic, 50/101/152 for bottleneck.
        classes: Classifier outputs.
        block: ``"basic"`` or ``"bottleneck"``.
    """

    batch: int = 4
    image: int = 32
    channels: int = 3
    base_channels: int = 16
    width_factor: int = 2
    layers: int = 10
    classes: int = 10
    block: str = "basic"

    PRESETS = WIDE_RESNET_CONFIGS

    def __post_init__(self):
        require(min(self.batch, self.image, self.channels, self.base_channels,
                    self.width_factor, self.classes) >= 1,
                f"wide_resnet: sizes must be >= 1, got {self}")
        if self.block == "basic":
            require(self.layers >= 10 and (self.layers - 4) % 6 == 0,
                    f"wide_resnet: basic blocks need layers = 6k + 4 (k >= 1), got {self.layers}")
        elif self.block == "bottleneck":
            require(self.layers in BOTTLENECK_STAGES,
                    f"wide_resnet: bottleneck layers must be one of "
                    f"{tuple(BOTTLENECK_STAGES)}, got {self.layers}")
        else:
            raise ValueError(f"wide_resnet: block must be 'basic' or 'bottleneck', "
                             f"got {self.block!r}")

    def group_specs(self) -> list[list[BlockSpec]]:
        """Returns the static block shapes, one list per group/stage."""
        groups, c_in = [], self.base_channels
        if self.block == "basic":
            sizes = [(self.layers - 4) // 6] * 3
        else:
            sizes = list(BOTTLENECK_STAGES[self.layers])
        for g, size in enumerate(sizes):
            if self.block == "basic":
                c_mid = c_wide = c_out = self.base_channels * self.width_factor * 2 ** g
            else:
                c_mid = self.base_channels * 2 ** g
                c_wide, c_out = c_mid * self.width_factor, 4 * c_mid
            blocks = []
            for b in range(size):
                stride = 2 if g > 0 and b == 0 else 1
                blocks.append(BlockSpec(c_in, c_mid, c_wide, c_out, stride))
                c_in = c_out
            groups.append(blocks)
        return groups

    def _init_block(self, key: jax.Array, spec: BlockSpec) -> dict[str, Any]:
        keys = jax.random.split(key, 4)
        kernel1 = 3 if self.block == "basic" else 1
        p = {"norm1": init_layernorm(spec.c_in),
             "conv1": init_conv(keys[0], kernel1, spec.c_in, spec.c_mid),
             "norm2": init_layernorm(spec.c_mid),
             "conv2": init_conv(keys[1], 3, spec.c_mid, spec.c_wide)}
        if self.block == "bottleneck":
            p["norm3"] = init_layernorm(spec.c_wide)
            p["conv3"] = init_conv(keys[2], 1, spec.c_wide, spec.c_out)
        if spec.stride != 1 or spec.c_in != spec.c_out:
            p["shortcut"] = init_conv(keys[3], 1, spec.c_in, spec.c_out)
        return p

    def init_params(self, key: jax.Array) -> dict[str, Any]:
        k_stem, k_blocks, k_head = jax.random.split(key, 3)
        specs = self.group_specs()
        block_keys = iter(jax.random.split(k_blocks, sum(len(g) for g in specs)))
        groups = [[self._init_block(next(block_keys), spec) for spec in group] for group in specs]
        c_final = specs[-1][-1].c_out
        return {"stem": init_conv(k_stem, 3, self.channels, self.base_channels),
                "groups": groups,
                "norm": init_layernorm(c_final),
                "head": {"w": normal(k_head, (c_final, self.classes), 1.0 / math.sqrt(c_final)),
                         "b": jnp.zeros((self.classes,), jnp.float32)}}

    def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
        k_img, k_lbl = jax.random.split(key)
        shape = (self.batch, self.image, self.image, self.channels)
        return {"images": jax.random.normal(k_img, shape, jnp.float32),
                "labels": jax.random.randint(k_lbl, (self.batch,), 0, self.classes, jnp.int32)}

    def _block(self, p: dict[str, Any], x: jax.Array, spec: BlockSpec) -> jax.Array:
        h = jax.nn.relu(layernorm(p["norm1"], x))
        shortcut = conv2d(h, p["shortcut"], spec.stride) if "shortcut" in p else x
        if self.block == "basic":
            h = conv2d(h, p["conv1"], spec.stride)
            h = conv2d(jax.nn.relu(layernorm(p["norm2"], h)), p["conv2"])
        else:
            h = conv2d(h, p["conv1"])
            h = conv2d(jax.nn.relu(layernorm(p["norm2"], h)), p["conv2"], spec.stride)
            h = conv2d(jax.nn.relu(layernorm(p["norm3"], h)), p["conv3"])
        return shortcut + h

    def loss(self, params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        x = conv2d(batch["images"], params["stem"])
        for group_params, group_specs in zip(params["groups"], self.group_specs()):
            for p, spec in zip(group_params, group_specs):
                x = self._block(p, x, spec)
        x = jnp.mean(jax.nn.relu(layernorm(params["norm"], x)), axis=(1, 2))
        logits = x @ params["head"]["w"] + params["head"]["b"]
        return cross_entropy(logits, batch["labels"])
