"""Llama: a decoder-only transformer as Meta's Llama 3 (RMSNorm, rotary position
embeddings, grouped-query attention through ``jax.nn.dot_product_attention``, SwiGLU MLP,
untied input and output embeddings), bf16 weights trained by AdamW with float32 moments.

Parameters (unrolled, ``scan=False``)::

    {'embed': [vocab, hidden],
     'layers': [{'attn_norm': [hidden], 'wq': [hidden, heads*hd], 'wk': [hidden, kv*hd],
                 'wv': [hidden, kv*hd], 'wo': [heads*hd, hidden], 'mlp_norm': [hidden],
                 'w_gate': [hidden, ffn], 'w_up': [hidden, ffn], 'w_down': [ffn, hidden]}, ...],
     'norm': [hidden], 'lm_head': [hidden, vocab]}

``hd = hidden / heads``; ``kv`` = ``kv_heads``. With ``scan=True`` the layers are stacked
and run under ``jax.lax.scan``. ``attention``: ``"xla"`` (``jax.nn.dot_product_attention``'s
XLA implementation: the ``[T, S]`` scores are values of the step), ``"cudnn"`` (its cuDNN
implementation: GPU only), or ``"fused"`` (``rhino.models.attention.fused_attention``: the
same values as one fused call with cuDNN's sharding rule, which is how a GPU step should be
planned on a CPU). The presets are the published shapes (Meta, "The Llama 3 Herd of
Models", Table 3: 8B: 32 layers, width 4096, FFN 14336, 32 heads, 8 key/value heads;
70B: 80, 8192, 28672, 64, 8; vocabulary 128256, RoPE base 500000).

Example:
    >>> from rhino.models import get_model
    >>> m = get_model("llama", preset="Llama-3-8B", layers=2)
    >>> params, opt_state, batch = m.example_args()
    >>> params["layers"][0]["wk"].shape, params["layers"][0]["wk"].dtype.name
    ((4096, 1024), 'bfloat16')
    >>> opt_state.mu["embed"].dtype.name
    'float32'
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rhino.models.base import ModelConfig, normal, require

LLAMA_CONFIGS = types.MappingProxyType({
    "Llama-3-8B": types.MappingProxyType(
        {"layers": 32, "hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8,
         "vocab": 128256, "rope_theta": 500000.0}),
    "Llama-3-70B": types.MappingProxyType(
        {"layers": 80, "hidden": 8192, "ffn": 28672, "heads": 64, "kv_heads": 8,
         "vocab": 128256, "rope_theta": 500000.0}),
})
"""Presets for ``get_model("llama", preset=...)``: the published Llama 3 shapes."""

ATTENTION = ("xla", "cudnn", "fused")


class AdamF32State(NamedTuple):
    """AdamW state: the step count and float32 first and second moments."""

    count: jax.Array
    mu: Any
    nu: Any


def adamw_f32(learning_rate: float, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
              weight_decay: float = 0.1):
    """AdamW whose moments are float32 whatever the parameters' dtype (Llama 3's
    optimizer; optax's ``adamw`` keeps the second moment in the parameters' dtype).

    Returns:
        An ``optax.GradientTransformation``; its updates have the parameters' dtypes.
    """
    import optax

    def init(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return AdamF32State(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(grads, state, params):
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(jnp.float32),
                          state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(jnp.float32)),
                          state.nu, grads)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)

        def step(m, v, p):
            u = (m / c1) / (jnp.sqrt(v / c2) + eps) + weight_decay * p.astype(jnp.float32)
            return (-learning_rate * u).astype(p.dtype)
        return jax.tree.map(step, mu, nu, params), AdamF32State(count, mu, nu)

    return optax.GradientTransformation(init, update)


def rms_norm(w: jax.Array, x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, back to ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embeddings on ``[B, T, heads, hd]``, the rotate-half form
    ``[x1 cos - x2 sin, x2 cos + x1 sin]`` of the halves ``x1, x2``. Written with the halves
    as a dimension of size 2 and ``flip`` over it instead of a split and a concatenation:
    the same values, and ops (a reverse, products) whose shardings the planner reads
    directly; the split/concatenate form took O2 6.5x longer on Llama-3-8B layers on
    (2, 8) (19.0 s against 2.9 s for two layers; its slices and concatenations make
    segments too dense for exact tables)."""
    b, t, h, hd = x.shape
    freq = theta ** (-jnp.arange(0, hd // 2, dtype=jnp.float32) * 2 / hd)
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq[None, :]        # [T, hd/2]
    cos = jnp.cos(angle)[None, :, None, None, :]
    sin = jnp.stack([-jnp.sin(angle), jnp.sin(angle)], 1)[None, :, None, :, :]  # [1,T,1,2,hd/2]
    halves = x.astype(jnp.float32).reshape(b, t, h, 2, hd // 2)
    return (halves * cos + jnp.flip(halves, 3) * sin).reshape(b, t, h, hd).astype(x.dtype)


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Llama hyper-parameters.

    Attributes:
        batch: Sequences per batch.
        seq: Tokens per sequence.
        vocab: Vocabulary size.
        layers: Transformer layers.
        hidden: Model width.
        ffn: SwiGLU inner width.
        heads: Query heads (must divide ``hidden``).
        kv_heads: Key/value heads (grouped-query attention; must divide ``heads``).
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
        dtype: Parameter and activation dtype (``bfloat16`` or ``float32``); the optimizer
            moments are float32.
        attention: ``xla``, ``cudnn`` or ``fused`` (module docstring).
        scan: Stack the layers and run them under ``jax.lax.scan``.
        remat: Recompute each layer in the backward pass (``jax.checkpoint`` per layer).
    """

    learning_rate: float = 3e-4
    batch: int = 4
    seq: int = 64
    vocab: int = 1024
    layers: int = 2
    hidden: int = 128
    ffn: int = 384
    heads: int = 4
    kv_heads: int = 2
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    dtype: str = "bfloat16"
    attention: str = "xla"
    scan: bool = False
    remat: bool = False

    PRESETS = LLAMA_CONFIGS

    def __post_init__(self):
        require(min(self.batch, self.seq, self.vocab, self.layers, self.hidden, self.ffn,
                    self.heads, self.kv_heads) >= 1,
                f"llama: sizes must be >= 1, got {self}")
        require(self.hidden % self.heads == 0 and (self.hidden // self.heads) % 2 == 0,
                f"llama: hidden ({self.hidden}) must be heads ({self.heads}) times an even "
                f"head size")
        require(self.heads % self.kv_heads == 0,
                f"llama: heads ({self.heads}) must be a multiple of kv_heads "
                f"({self.kv_heads})")
        require(self.dtype in ("bfloat16", "float32"),
                f"llama: dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        require(self.attention in ATTENTION,
                f"llama: attention must be one of {ATTENTION}, got {self.attention!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def make_optimizer(self):
        return adamw_f32(self.learning_rate)

    def _layer(self, key: jax.Array) -> dict[str, jax.Array]:
        h, hd, f = self.hidden, self.head_dim, self.ffn
        dt = jnp.dtype(self.dtype)
        ks = jax.random.split(key, 7)
        shapes = {"wq": (h, self.heads * hd), "wk": (h, self.kv_heads * hd),
                  "wv": (h, self.kv_heads * hd), "wo": (self.heads * hd, h),
                  "w_gate": (h, f), "w_up": (h, f), "w_down": (f, h)}
        out = {name: normal(k, s, s[0] ** -0.5).astype(dt)
               for k, (name, s) in zip(ks, shapes.items())}
        return {"attn_norm": jnp.ones((h,), dt), **out, "mlp_norm": jnp.ones((h,), dt)}

    def init_params(self, key: jax.Array) -> dict[str, Any]:
        k_emb, k_head, k_layers = jax.random.split(key, 3)
        dt = jnp.dtype(self.dtype)
        layers = [self._layer(k) for k in jax.random.split(k_layers, self.layers)]
        if self.scan:
            layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
        return {"embed": normal(k_emb, (self.vocab, self.hidden), 1.0).astype(dt),
                "layers": layers, "norm": jnp.ones((self.hidden,), dt),
                "lm_head": normal(k_head, (self.hidden, self.vocab),
                                  self.hidden ** -0.5).astype(dt)}

    def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
        stream = jax.random.randint(key, (self.batch, self.seq + 1), 0, self.vocab, jnp.int32)
        return {"tokens": stream[:, :-1], "labels": stream[:, 1:]}

    def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        if self.attention == "fused":
            from rhino.models.attention import fused_attention
            return fused_attention(q, k, v)
        impl = "cudnn" if self.attention == "cudnn" else None
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    def block(self, p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        """One decoder layer on ``x`` [B, T, hidden]."""
        b, t, _ = x.shape
        hd = self.head_dim
        h = rms_norm(p["attn_norm"], x, self.norm_eps)
        q = rope((h @ p["wq"]).reshape(b, t, self.heads, hd), self.rope_theta)
        k = rope((h @ p["wk"]).reshape(b, t, self.kv_heads, hd), self.rope_theta)
        v = (h @ p["wv"]).reshape(b, t, self.kv_heads, hd)
        x = x + self._attend(q, k, v).reshape(b, t, self.heads * hd) @ p["wo"]
        h = rms_norm(p["mlp_norm"], x, self.norm_eps)
        return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]

    def loss(self, params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        x = params["embed"][batch["tokens"]]
        block = jax.checkpoint(self.block) if self.remat else self.block
        if self.scan:
            x, _ = jax.lax.scan(lambda h, layer: (block(layer, h), None), x, params["layers"])
        else:
            for layer in params["layers"]:
                x = block(layer, x)
        logits = (rms_norm(params["norm"], x, self.norm_eps) @ params["lm_head"])
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(log_probs, batch["labels"][..., None], axis=-1)
        return -jnp.mean(picked)
