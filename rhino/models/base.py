"""The model-zoo core: `ZooModel`, configs, the name registry logic and shared layers.

Every zoo model is a frozen config dataclass (a subclass of `ModelConfig`) that knows how to
build its parameters, a synthetic batch and its forward loss. `ZooModel` wraps a config with
the optax optimizer and exposes the uniform interface the rest of rhino consumes:

    init(key) ─► (params, opt_state)        make_batch(key) ─► batch
    step(params, opt_state, batch) ─► (params, opt_state, loss)    (pure, not jitted)
    example_args() ─► ShapeDtypeStruct pytrees of (params, opt_state, batch), no allocation

The shared layers below (layernorm, fused-QKV attention, dense MLP, conv, cross-entropy) are
plain functions on dicts of arrays, written once and used by all models.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp

PyTree = Any


@dataclass(frozen=True)
class ModelConfig(abc.ABC):
    """Base of every model config: hyper-parameters plus the model's three pure functions.

    Subclasses are frozen dataclasses whose fields all have defaults, so that
    `Config(**overrides)` always works. `PRESETS` maps a preset name to field values.

    Attributes:
        learning_rate: Adam learning rate of the training step.
    """

    learning_rate: float = 1e-3

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = types.MappingProxyType({})

    @abc.abstractmethod
    def init_params(self, key: jax.Array) -> PyTree:
        """Returns the parameter pytree (nested dicts / lists of fp32 arrays)."""

    @abc.abstractmethod
    def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
        """Returns a synthetic, deterministic batch for `key`."""

    @abc.abstractmethod
    def loss(self, params: PyTree, batch: dict[str, jax.Array]) -> jax.Array:
        """Returns the scalar fp32 training loss."""

    def make_optimizer(self) -> Any:
        """The optax optimizer of the training step: Adam at ``learning_rate`` (a model
        with other needs, such as float32 moments for bf16 weights, overrides it)."""
        import optax  # Optional dependency: only needed once a step is built.

        return optax.adam(self.learning_rate)


def require(condition: bool, message: str) -> None:
    """Raises `ValueError(message)` unless `condition` holds (config validation helper)."""
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ZooModel:
    """A zoo model: a named config with an optax Adam training step.

    Example:
        >>> import jax
        >>> from rhino.models import get_model
        >>> model = get_model("mlp", hidden=32)
        >>> params, opt_state = model.init(jax.random.key(0))
        >>> batch = model.make_batch(jax.random.key(1))
        >>> params, opt_state, loss = jax.jit(model.step)(params, opt_state, batch)
        >>> loss.shape, loss.dtype
        ((), dtype('float32'))

    Attributes:
        name: Registry name, e.g. ``"gpt"``.
        config: The model's frozen `ModelConfig` subclass instance.
    """

    name: str
    config: ModelConfig

    def optimizer(self) -> Any:
        """Returns the optax optimizer (``config.make_optimizer()``: Adam at
        ``config.learning_rate`` unless the model says otherwise); imports optax."""
        return self.config.make_optimizer()

    def init(self, key: jax.Array) -> tuple[PyTree, PyTree]:
        """Returns real ``(params, opt_state)`` for `key`."""
        params = self.config.init_params(key)
        return params, self.optimizer().init(params)

    def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
        """Returns a real synthetic batch for `key`."""
        return self.config.make_batch(key)

    def loss(self, params: PyTree, batch: dict[str, jax.Array]) -> jax.Array:
        """Returns the scalar forward loss."""
        return self.config.loss(params, batch)

    def step(self, params: PyTree, opt_state: PyTree,
             batch: dict[str, jax.Array]) -> tuple[PyTree, PyTree, jax.Array]:
        """One training step: value_and_grad of `loss`, then an optax update. Pure, not jitted."""
        import optax  # Optional dependency: only needed once a step is built.

        loss, grads = jax.value_and_grad(self.loss)(params, batch)
        updates, opt_state = self.optimizer().update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    def example_args(self) -> tuple[PyTree, PyTree, PyTree]:
        """Returns ``(params, opt_state, batch)`` as `jax.ShapeDtypeStruct` pytrees, unallocated."""
        params, opt_state = jax.eval_shape(lambda: self.init(jax.random.key(0)))
        batch = jax.eval_shape(lambda: self.make_batch(jax.random.key(1)))
        return params, opt_state, batch


# ----------------------------------------------------------------------------- registry logic


def _coerce(config_cls: type, field_name: str, value: Any) -> Any:
    """Checks `value` against the field's annotation; ints are widened to float fields."""
    hint = typing.get_type_hints(config_cls)[field_name]
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    allowed = typing.get_args(hint) if is_union else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
    elif isinstance(value, bool):
        if bool in allowed:
            return value
    elif isinstance(value, int) and (int in allowed or float in allowed):
        return value if int in allowed else float(value)
    elif isinstance(value, float) and float in allowed:
        return value
    elif isinstance(value, str) and str in allowed:
        return value
    names = " | ".join(getattr(a, "__name__", str(a)) for a in allowed)
    raise ValueError(f"{config_cls.__name__}.{field_name}: expected {names}, "
                     f"got {value!r} ({type(value).__name__})")


def build_model(registry: Mapping[str, type], name: str, overrides: Mapping[str, Any]) -> ZooModel:
    """Builds a `ZooModel` from a registry of config classes (see `rhino.models.get_model`).

    Args:
        registry: Model name to `ModelConfig` subclass.
        name: Model name.
        overrides: Field values; the special key ``preset`` names an entry of the config
            class's `PRESETS` whose values are applied first (other overrides win).

    Raises:
        ValueError: Unknown model, preset or field, or a value of the wrong type.
    """
    if name not in registry:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(registry)}")
    config_cls = registry[name]
    overrides = dict(overrides)
    values: dict[str, Any] = {}
    if "preset" in overrides:
        preset = overrides.pop("preset")
        if preset not in config_cls.PRESETS:
            valid = ", ".join(config_cls.PRESETS) or "(none)"
            raise ValueError(
                f"unknown preset {preset!r} for model {name!r}; valid presets: {valid}")
        values.update(config_cls.PRESETS[preset])
    fields = [f.name for f in dataclasses.fields(config_cls)]
    for key, value in overrides.items():
        if key not in fields:
            valid = ", ".join(fields + (["preset"] if config_cls.PRESETS else []))
            raise ValueError(f"unknown option {key!r} for model {name!r}; valid options: {valid}")
        values[key] = value
    values = {k: _coerce(config_cls, k, v) for k, v in values.items()}
    return ZooModel(name=name, config=config_cls(**values))


def parse_value(text: str) -> Any:
    """Parses a spec value: ``true``/``false`` → bool, ``none`` → None, then int, float, str."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse_overrides(text: str) -> dict[str, Any]:
    """Parses ``"k1=v1,k2=v2"`` into a dict of parsed values (empty text → empty dict)."""
    overrides: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad model option {item!r}: expected key=value")
        overrides[key.strip()] = parse_value(value)
    return overrides


# ----------------------------------------------------------------------------- shared layers


def normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    """Returns an fp32 normal(0, std) array."""
    return std * jax.random.normal(key, shape, jnp.float32)


def init_layernorm(dim: int) -> dict[str, jax.Array]:
    """Returns layernorm params ``{'scale': ones, 'bias': zeros}`` of shape [dim]."""
    return {"scale": jnp.ones((dim,), jnp.float32), "bias": jnp.zeros((dim,), jnp.float32)}


def layernorm(p: dict[str, jax.Array], x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """Normalizes the last axis of `x`, then scales and shifts."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def init_attention(key: jax.Array, hidden: int, std: float = 0.02) -> dict[str, jax.Array]:
    """Returns ``{'wqkv': [hidden, 3*hidden], 'wo': [hidden, hidden]}``."""
    k_qkv, k_o = jax.random.split(key)
    return {"wqkv": normal(k_qkv, (hidden, 3 * hidden), std),
            "wo": normal(k_o, (hidden, hidden), std)}


def self_attention(p: Mapping[str, jax.Array], x: jax.Array, heads: int, causal: bool) -> jax.Array:
    """Multi-head self-attention with one fused QKV projection.

    ``x @ wqkv`` ([batch, seq, 3*hidden]) is reshaped to [batch, seq, 3, heads, head_dim] and
    split into q, k, v; the heads' outputs are merged and projected by ``wo``.
    """
    batch, seq, hidden = x.shape
    head_dim = hidden // heads
    qkv = (x @ p["wqkv"]).reshape(batch, seq, 3, heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    if causal:
        mask = jnp.tril(jnp.ones((seq, seq), jnp.bool_))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, hidden)
    return out @ p["wo"]


def init_mlp(key: jax.Array, hidden: int, ffn: int, std: float = 0.02) -> dict[str, jax.Array]:
    """Returns the dense FFN params ``w1 [hidden, ffn], b1, w2 [ffn, hidden], b2``."""
    k1, k2 = jax.random.split(key)
    return {"w1": normal(k1, (hidden, ffn), std), "b1": jnp.zeros((ffn,), jnp.float32),
            "w2": normal(k2, (ffn, hidden), std), "b2": jnp.zeros((hidden,), jnp.float32)}


def mlp(p: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    """Dense FFN: ``gelu(x @ w1 + b1) @ w2 + b2``."""
    return jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def init_transformer_layer(key: jax.Array, hidden: int, ffn: int) -> dict[str, Any]:
    """Returns one pre-LN layer: ``ln1, wqkv, wo, ln2, w1, b1, w2, b2``."""
    k_attn, k_mlp = jax.random.split(key)
    return {"ln1": init_layernorm(hidden), **init_attention(k_attn, hidden),
            "ln2": init_layernorm(hidden), **init_mlp(k_mlp, hidden, ffn)}


def transformer_layer(p: Mapping[str, Any], x: jax.Array, heads: int, causal: bool,
                      ffn_fn=mlp) -> jax.Array:
    """Pre-LN block: ``x + attn(ln1(x))`` then ``+ ffn_fn(p, ln2(x))``."""
    x = x + self_attention(p, layernorm(p["ln1"], x), heads, causal)
    return x + ffn_fn(p, layernorm(p["ln2"], x))


def init_embeddings(key: jax.Array, vocab: int, seq: int, hidden: int) -> dict[str, jax.Array]:
    """Returns the token (``wte`` [vocab, hidden]) and position (``wpe`` [seq, hidden]) tables."""
    k_te, k_pe = jax.random.split(key)
    return {"wte": normal(k_te, (vocab, hidden), 0.02), "wpe": normal(k_pe, (seq, hidden), 0.01)}


def embed(params: Mapping[str, jax.Array], tokens: jax.Array) -> jax.Array:
    """Token lookup with `jnp.take` (lowers to a gather) plus positions: [batch, seq, hidden]."""
    return jnp.take(params["wte"], tokens, axis=0) + params["wpe"][None, : tokens.shape[1]]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of integer `labels` under `logits` [..., classes]."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, labels[..., None].astype(jnp.int32), axis=-1)
    return -jnp.mean(picked)


def init_conv(key: jax.Array, kernel: int, c_in: int, c_out: int) -> jax.Array:
    """Returns an HWIO conv kernel with He-normal init."""
    return normal(key, (kernel, kernel, c_in, c_out), math.sqrt(2.0 / (kernel * kernel * c_in)))


def conv2d(x: jax.Array, w: jax.Array, stride: int = 1) -> jax.Array:
    """NHWC / HWIO convolution with SAME padding."""
    return jax.lax.conv_general_dilated(
        x, w, window_strides=(stride, stride), padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def max_pool(x: jax.Array, size: int = 2) -> jax.Array:
    """NHWC max-pool with a `size` window and stride (`jax.lax.reduce_window`)."""
    window = (1, size, size, 1)
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window, window, "VALID")


def avg_pool(x: jax.Array, size: int = 2) -> jax.Array:
    """NHWC average-pool with a `size` window and stride."""
    window = (1, size, size, 1)
    return jax.lax.reduce_window(x, 0.0, jax.lax.add, window, window, "VALID") / (size * size)
