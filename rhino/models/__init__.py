"""The model zoo: plain-JAX training steps of the Rhino paper's models, configurable in size.

Every model is deterministic and trained with optax Adam (fp32), or AdamW with float32 moments
for bf16 weights (llama); optax is imported only when an optimizer is built, so importing
this package works without it.

    mlp · gpt · moe · vgg19 · wide_resnet · unet · dnabert · llama

Example:
    >>> import jax
    >>> from rhino.models import get_model, parse_model_spec
    >>> model = parse_model_spec("gpt:layers=3,hidden=64")
    >>> model.config.layers, model.config.hidden
    (3, 64)
    >>> big = get_model("gpt", preset="GPT-Medium", layers=2)
    >>> params, opt_state, batch = big.example_args()   # ShapeDtypeStructs, nothing allocated
    >>> params["layers"][1]["wqkv"].shape
    (1024, 3072)
"""

from __future__ import annotations

import types
from typing import Any

from rhino.models.base import ModelConfig, ZooModel, build_model, parse_overrides
from rhino.models.dnabert import DnabertConfig
from rhino.models.gpt import GPT_CONFIGS, GptConfig
from rhino.models.llama import LLAMA_CONFIGS, LlamaConfig
from rhino.models.mlp import MlpConfig
from rhino.models.moe import MOE_CONFIGS, MoeConfig
from rhino.models.unet import UnetConfig
from rhino.models.vgg19 import Vgg19Config
from rhino.models.wide_resnet import WIDE_RESNET_CONFIGS, WideResnetConfig

_CONFIGS = types.MappingProxyType({
    "mlp": MlpConfig,
    "gpt": GptConfig,
    "moe": MoeConfig,
    "vgg19": Vgg19Config,
    "wide_resnet": WideResnetConfig,
    "unet": UnetConfig,
    "dnabert": DnabertConfig,
    "llama": LlamaConfig,
})

MODEL_NAMES: tuple[str, ...] = tuple(_CONFIGS)
"""Names accepted by `get_model` and `parse_model_spec`."""


def get_model(name: str, **config_overrides: Any) -> ZooModel:
    """Returns the zoo model `name` with its default config updated by `config_overrides`.

    Args:
        name: One of `MODEL_NAMES`.
        **config_overrides: Config field values. ``preset=...`` (gpt, moe, wide_resnet,
            llama) first applies a published configuration (`GPT_CONFIGS`, `MOE_CONFIGS`,
            `WIDE_RESNET_CONFIGS`, `LLAMA_CONFIGS`); the other overrides win over it.

    Raises:
        ValueError: Unknown model, preset or option (the message lists the valid ones), a
            value of the wrong type, or an inconsistent config.

    Example:
        >>> get_model("gpt", preset="GPT-Medium", layers=4).config.hidden
        1024
    """
    return build_model(_CONFIGS, name, config_overrides)


def describe_models() -> str:
    """Every zoo model with its options (defaults) and presets, as text.

    Example:
        >>> print(describe_models().splitlines()[0])   # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
        mlp   options: learning_rate=0.001, ...
    """
    import dataclasses

    lines = []
    width = max(map(len, MODEL_NAMES))
    for name, cls in _CONFIGS.items():
        opts = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls)
                         if f.default is not dataclasses.MISSING)
        lines.append(f"{name:<{width}}  options: {opts}")
        for preset, values in cls.PRESETS.items():
            lines.append(f"{'':<{width}}  preset {preset}: "
                         + ", ".join(f"{k}={v!r}" for k, v in values.items()))
    return "\n".join(lines)


def parse_model_spec(spec: str) -> ZooModel:
    """Builds a model from ``"name"`` or ``"name:key=value,key=value"``.

    Values are parsed as bool (``true``/``false``), None (``none``), int, float, else str.

    Example:
        >>> parse_model_spec("moe:preset=MoE-8E-380M,layers=2,batch=1").config.experts
        8
    """
    name, _, options = spec.partition(":")
    return get_model(name.strip(), **parse_overrides(options))


__all__ = [
    "MODEL_NAMES", "ZooModel", "ModelConfig", "get_model", "parse_model_spec",
    "describe_models",
    "GPT_CONFIGS", "MOE_CONFIGS", "WIDE_RESNET_CONFIGS", "LLAMA_CONFIGS",
    "MlpConfig", "GptConfig", "MoeConfig", "Vgg19Config", "WideResnetConfig", "UnetConfig",
    "DnabertConfig", "LlamaConfig",
]
