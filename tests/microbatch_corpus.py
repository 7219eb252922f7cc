"""A generated corpus of training steps for the microbatch analysis (issue 43, acceptance 1):
one case per use of a ``jax.lax`` primitive that can take a per-example operand (and the
composites users write: softmax, norms, cross-entropy, one_hot, gathers, scatters, control
flow, checkpoints, custom derivatives), each inside a loss whose gradient feeds an optax
update, in float32, bfloat16 and float16 (integer data where it applies).

Every case is ``fn(h, p, b) -> per-example values``: ``h`` the batch's hidden values
``[N, D]`` in the case's dtype (computed from the batch and the weights, so its gradient
reaches them), ``p`` the parameters, ``b`` the batch's other leaves (integer features,
tokens, a mask) and a PRNG key. The loss is the mean over the batch of a per-example
error, so that gradient accumulation over microbatches (``reference``) and the step on the
whole batch agree wherever the case does not couple the examples. Cases marked
``along_batch`` act across the batch's examples on purpose (a statistic of the batch, a
sort of the examples, a concatenation of augmented copies): some of them couple the batch,
and the analysis must refuse exactly those.

``PRIMITIVES`` names every primitive of the installed ``jax.lax`` (and ``jax.lax.linalg``)
that can take a per-example operand, each covered by the cases listed there (the test
checks that the case's traced step holds it); ``NOT_PER_EXAMPLE`` the others, with the
reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

N, D, V, M = 16, 8, 12, 4              # batch, features, vocabulary, microbatches
FLOATS = ("float32", "bfloat16", "float16")
F32 = ("float32",)


@dataclasses.dataclass(frozen=True)
class Case:
    """One use of one or more primitives on per-example values.

    Attributes:
        name: unique; prims: the primitives its traced step must hold (in its jaxpr,
            looking into bodies); fn: ``fn(h, p, b) -> [N, ...]``; dtypes: where it applies;
        along_batch: it acts across the batch's examples on purpose; refused: the analysis
            refuses it (its gradients need the whole batch at once, so that gradient
            accumulation computes something else: checked against ``reference``);
        loss: ``mse`` (the mean over examples of ``(mean(out_i) - y_i)^2``) or ``sum``
            (``sum(out) / N``: linear in sums over the batch).
        unpartitioned: why no multi-device program can hold it (XLA's own limit, shown
            with ``jax.jit`` alone); analysed, not run on several devices.
    """

    name: str
    prims: tuple[str, ...]
    fn: Callable[..., Any]
    dtypes: tuple[str, ...] = FLOATS
    along_batch: bool = False
    refused: bool = False
    loss: str = "mse"
    unpartitioned: str = ""


def _pos(h):
    return 1.0 + h * h


def _unit(h):
    return 0.9 * h


CASES: list[Case] = []


def case(name, prims, fn, dtypes=FLOATS, along_batch=False, refused=False, loss="mse",
         unpartitioned=""):
    CASES.append(Case(name, tuple(prims.split()) if isinstance(prims, str) else tuple(prims),
                      fn, dtypes, along_batch, refused, loss, unpartitioned))


# ---------------------------------------------------------------- elementwise, unary
for _name, _f in {
        "abs": jnp.abs, "neg": jnp.negative, "exp": jnp.exp, "exp2": jnp.exp2,
        "expm1": jnp.expm1, "log": lambda h: jnp.log(_pos(h)),
        "log1p": lambda h: jnp.log1p(h * h), "tanh": jnp.tanh, "logistic": jax.nn.sigmoid,
        "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan, "asin": lambda h: jnp.arcsin(_unit(h)),
        "acos": lambda h: jnp.arccos(_unit(h)), "atan": jnp.arctan, "sinh": jnp.sinh,
        "cosh": jnp.cosh, "asinh": jnp.arcsinh, "acosh": lambda h: jnp.arccosh(_pos(h) + 0.1),
        "atanh": lambda h: jnp.arctanh(_unit(h)), "sqrt": lambda h: jnp.sqrt(_pos(h)),
        "rsqrt": lambda h: jax.lax.rsqrt(_pos(h)), "cbrt": lambda h: jnp.cbrt(_pos(h)),
        "square": jnp.square, "integer_pow": lambda h: h ** 3,
        "erf": jax.scipy.special.erf, "erfc": jax.scipy.special.erfc,
        "erf_inv": lambda h: jax.scipy.special.erfinv(_unit(h)),
        "lgamma": lambda h: jax.lax.lgamma(_pos(h)), "digamma": lambda h: jax.lax.digamma(_pos(h)),
        "bessel_i0e": jax.lax.bessel_i0e, "bessel_i1e": jax.lax.bessel_i1e,
        "copy": jnp.copy,
}.items():
    case(_name, _name, lambda h, p, b, f=_f: f(h))

# Primitives only newer JAX releases have (0.12: jnp.log2 and erf's Horner evaluation bind
# them; tanh's derivative binds one_minus_square).
if hasattr(jax.lax, "log2"):
    case("log2", "log2", lambda h, p, b: jax.lax.log2(_pos(h)))
if hasattr(jax.lax, "polynomial"):
    case("polynomial", "polynomial", lambda h, p, b: jax.lax.polynomial(h, (1.0, 0.5, 0.25)))
if hasattr(jax.lax, "one_minus_square"):
    case("one_minus_square", "one_minus_square",
         lambda h, p, b: jax.lax.one_minus_square(jnp.tanh(h)))

case("floor", "floor mul", lambda h, p, b: h * jnp.floor(3 * h))
case("ceil", "ceil mul", lambda h, p, b: h * jnp.ceil(3 * h))
case("round", "round mul", lambda h, p, b: h * jnp.round(3 * h))
case("sign", "sign", lambda h, p, b: h * jnp.sign(h - 0.1))
case("is_finite", "is_finite select_n", lambda h, p, b: jnp.where(jnp.isfinite(h), h, 0))
case("nextafter", "nextafter", lambda h, p, b: h * jnp.nextafter(   # (no derivative rule)
    jax.lax.stop_gradient(h), jnp.ones_like(h)))
case("reduce_precision", "reduce_precision",
     lambda h, p, b: jax.lax.reduce_precision(h, exponent_bits=5, mantissa_bits=7))
case("convert_element_type", "convert_element_type",
     lambda h, p, b: h * (4 * h).astype(jnp.int32).astype(h.dtype))
case("bitcast_convert_type", "bitcast_convert_type",
     lambda h, p, b: h * (jax.lax.bitcast_convert_type(h.astype(jnp.float32), jnp.int32) > 0))
case("complex", "complex real imag conj abs",
     lambda h, p, b: jnp.abs(jnp.conj(jax.lax.complex(h, 2 * h))) +
     jnp.real(jax.lax.complex(h, h)) * jnp.imag(jax.lax.complex(h, h)), dtypes=F32)
case("optimization_barrier", "optimization_barrier",
     lambda h, p, b: jax.lax.optimization_barrier(h) * 2)
case("device_put", "device_put", lambda h, p, b: jax.device_put(h) * 2)

# ---------------------------------------------------------------- elementwise, binary+
case("add", "add", lambda h, p, b: h + p["g"])
case("sub", "sub", lambda h, p, b: h - p["g"])
case("mul", "mul", lambda h, p, b: h * p["g"])
case("div", "div", lambda h, p, b: h / (2.0 + p["g"]))
case("max", "max", lambda h, p, b: jnp.maximum(h, 0.1 * p["g"]))
case("min", "min", lambda h, p, b: jnp.minimum(h, 0.1 * p["g"]))
case("pow", "pow", lambda h, p, b: _pos(h) ** (1.5 + 0.1 * p["g"]))
case("atan2", "atan2", lambda h, p, b: jnp.arctan2(h, _pos(h)))
case("rem", "rem", lambda h, p, b: jnp.fmod(3 * h, 1.0))
case("clamp", "clamp", lambda h, p, b: jax.lax.clamp(jnp.asarray(-0.5, h.dtype), h,
                                                     jnp.asarray(0.5, h.dtype)))
case("igamma", "igamma igammac igamma_grad_a",
     lambda h, p, b: jax.lax.igamma(_pos(h), _pos(h)) + jax.lax.igammac(_pos(h), 2.0 * _pos(h)),
     dtypes=F32)
case("polygamma", "polygamma", lambda h, p, b: jax.lax.polygamma(jnp.ones_like(h), _pos(h)),
     dtypes=F32)
case("zeta", "zeta", lambda h, p, b: h * jax.lax.zeta(           # (no derivative rule)
    2.0 + jax.lax.stop_gradient(h) ** 2, _pos(jax.lax.stop_gradient(h))), dtypes=F32)
case("regularized_incomplete_beta", "regularized_incomplete_beta",
     lambda h, p, b: jax.scipy.special.betainc(2.0, 3.0, 0.45 * (h + 1.0) + 0.05),
     dtypes=F32)
# One key for the whole array: each element's draw depends on its place in the whole batch,
# so gradient accumulation draws other numbers (refused, rightly).
case("random_gamma", "random_gamma",
     lambda h, p, b: jax.random.gamma(b["key"], 1.0 + h.astype(jnp.float32) ** 2), dtypes=F32,
     along_batch=True, refused=True)
for _cmp, _f in {"eq": lambda a: jnp.round(2 * a) == 0, "ne": lambda a: jnp.round(2 * a) != 0,
                 "lt": lambda a: a < 0.1, "le": lambda a: a <= 0.1, "gt": lambda a: a > 0.1,
                 "ge": lambda a: a >= 0.1}.items():
    case(_cmp, f"{_cmp} select_n", lambda h, p, b, f=_f: jnp.where(f(h), h, 2 * h))
case("and_or_not_xor", "and or not xor",
     lambda h, p, b: jnp.where(((h > 0) & (h < 0.5)) | ~(h > -0.5) ^ (h > 0.2), h, -h))
case("select_n3", "select_n",
     lambda h, p, b: jax.lax.select_n(jnp.clip(jnp.floor(2 * h + 1), 0, 2).astype(jnp.int32),
                                      h, 2 * h, h * h))
# integer data of the batch
case("shifts", "shift_left shift_right_arithmetic shift_right_logical",
     lambda h, p, b: h * ((b["xi"] << 1) >> 1).astype(h.dtype) +
     h * jax.lax.shift_right_logical(b["xi"], 1).astype(h.dtype))
case("population_count", "population_count",
     lambda h, p, b: h * jax.lax.population_count(b["xi"]).astype(h.dtype))
case("clz", "clz", lambda h, p, b: h * (jax.lax.clz(b["xi"]) - 28).astype(h.dtype))
case("mulhi", "mulhi",
     lambda h, p, b: h * jax.lax.mulhi_p.bind(b["xi"].astype(jnp.uint32) * 1000000000,
                                             jnp.uint32(7)).astype(h.dtype),
     unpartitioned="jax.jit of mulhi with a NamedSharding over 4 CPU devices fails in "
                   "jaxlib 0.10.2: 'Unable to convert MHLO to StableHLO' (mhlo.unknown)")
case("int_arith", "rem max min", lambda h, p, b: h * (jnp.maximum(b["xi"] % 3, 1) -
                                                      jnp.minimum(b["xi"], 2)).astype(h.dtype))

# ---------------------------------------------------------------- reductions, per example
case("reduce_sum", "reduce_sum", lambda h, p, b: jnp.sum(h, 1, keepdims=True) * h)
case("reduce_max", "reduce_max", lambda h, p, b: jnp.max(h, 1, keepdims=True) * h)
case("reduce_min", "reduce_min", lambda h, p, b: jnp.min(h, 1, keepdims=True) * h)
# Differentiated, a product or a cumulative op is computed by its derivative rule's own
# decomposition (pads, slices, products); stopped, it stays the primitive: both here.
_sg = jax.lax.stop_gradient
case("reduce_prod", "reduce_prod pad slice",
     lambda h, p, b: jnp.prod(1 + 0.1 * h, 1, keepdims=True) * h +
     h * jnp.prod(1 + 0.1 * _sg(h), 1, keepdims=True))
case("reduce_and_or", "reduce_and reduce_or",
     lambda h, p, b: h * (jnp.all(h > -2, 1, keepdims=True) & jnp.any(h > 0, 1, keepdims=True)))
case("reduce_xor", "reduce_xor",
     lambda h, p, b: h * jax.lax.reduce(b["xi"], 0, jax.lax.bitwise_xor, (1,))[:, None]
     .astype(h.dtype))
case("argmax_argmin", "argmax argmin",
     lambda h, p, b: h * (jnp.argmax(h, 1) - jnp.argmin(h, 1))[:, None].astype(h.dtype))
def _max_and_where(x, y):
    return jnp.maximum(x[0], y[0]), jnp.where(x[0] >= y[0], x[1], y[1])


case("reduce_variadic", "reduce",
     lambda h, p, b: h * jax.lax.reduce(
         (jax.lax.stop_gradient(h), jnp.broadcast_to(jnp.arange(D, dtype=h.dtype), h.shape)),
         (jnp.asarray(-jnp.inf, h.dtype), jnp.asarray(0, h.dtype)), _max_and_where,
         (1,))[1][:, None])
for _c in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
    case(_c, _c, lambda h, p, b, c=_c: getattr(jax.lax, c)(1 + 0.1 * h, axis=1) +
         h * getattr(jax.lax, c)(1 + 0.1 * _sg(h), axis=1))
case("sort", "sort", lambda h, p, b: jnp.sort(h, axis=1))
case("argsort", "sort", lambda h, p, b: h * jnp.argsort(h, axis=1).astype(h.dtype))
case("sort_keys", "sort",
     lambda h, p, b: jax.lax.sort((jnp.round(4 * h), h), dimension=1, num_keys=2)[1])
case("top_k", "top_k", lambda h, p, b: jax.lax.top_k(h, 3)[0])
case("approx_top_k", "approx_top_k", lambda h, p, b: jax.lax.approx_max_k(h, 3)[0])

# ---------------------------------------------------------------- shapes and indexing
case("broadcast_in_dim", "broadcast_in_dim",
     lambda h, p, b: jnp.broadcast_to(h[:, None, :], (len(h), 3, D)) * p["g"])
case("reshape", "reshape", lambda h, p, b: h.reshape(len(h), 2, D // 2) * 2)
case("transpose", "transpose", lambda h, p, b: h.reshape(len(h), 2, D // 2).transpose(0, 2, 1))
case("squeeze_expand", "squeeze", lambda h, p, b: jnp.squeeze(h[:, None, :], 1) * 2)
case("rev", "rev", lambda h, p, b: h[:, ::-1] * p["g"])
case("pad", "pad", lambda h, p, b: jnp.pad(h, ((0, 0), (1, 2))))
case("concatenate", "concatenate", lambda h, p, b: jnp.concatenate([h, 2 * h], axis=1))
case("split", "split", lambda h, p, b: jnp.split(h, 2, axis=1)[0] * jnp.split(h, 2, axis=1)[1])
case("slice", "slice", lambda h, p, b: h[:, 2:6] * h[:, :4:1])
case("strided_slice", "slice", lambda h, p, b: h[:, ::2])
case("tile", "tile", lambda h, p, b: jnp.tile(h, (1, 2)))
case("stack_unstack", "stack unstack",
     lambda h, p, b: jax.lax.unstack(jnp.stack([h, 2 * h], axis=1), axis=1)[1] * h)
case("dynamic_slice", "dynamic_slice",
     lambda h, p, b: jax.lax.dynamic_slice_in_dim(h, jnp.argmax(p["g"]) % 4, 4, axis=1))
case("dynamic_update_slice", "dynamic_update_slice",
     lambda h, p, b: jax.lax.dynamic_update_slice_in_dim(h, 2 * h[:, :2], 3, axis=1))
case("gather_features", "gather", lambda h, p, b: h[:, jnp.array([3, 1, 1, 0])])
case("take_along_axis", "gather",
     lambda h, p, b: jnp.take_along_axis(h, b["xi"] % D, axis=1))
case("embedding", "gather", lambda h, p, b: p["e"][b["tok"]] * h)
case("one_hot", "eq", lambda h, p, b: jax.nn.one_hot(b["tok"] % D, D, dtype=h.dtype) * h)
for _op in ("set", "add", "multiply", "min", "max", "subtract"):
    case(f"scatter_{_op}", {"set": "scatter", "add": "scatter-add", "multiply": "scatter-mul",
                            "min": "scatter-min", "max": "scatter-max",
                            "subtract": "scatter-sub"}[_op],
         lambda h, p, b, op=_op: getattr(h.at[:, jnp.array([0, 2, 5])], op)(
             h[:, 1:4] * 0.5, unique_indices=True))
case("pick_by_label", "gather", lambda h, p, b: h[jnp.arange(len(h)), b["tok"] % D][:, None])
case("scatter_by_position", "scatter",
     lambda h, p, b: h.at[jnp.arange(len(h)), b["tok"] % D].set(0.0))
case("scatter_per_example", "scatter-add",
     lambda h, p, b: jnp.zeros_like(h).at[jnp.arange(len(h))[:, None], b["xi"] % D].add(h))
case("segment_sum_features", "scatter-add",
     lambda h, p, b: jax.vmap(lambda r: jax.ops.segment_sum(r, jnp.arange(D) % 3, 3))(h))

# ---------------------------------------------------------------- linear algebra
case("dot_general", "dot_general", lambda h, p, b: h @ p["w2"])
case("batched_dot", "dot_general",
     lambda h, p, b: jnp.einsum("nij,njk->nik", h.reshape(len(h), 2, 4), h.reshape(len(h), 4, 2)))
case("conv", "conv_general_dilated",
     lambda h, p, b: jax.lax.conv_general_dilated(
         h[:, None, :], p["k"].astype(h.dtype)[None, None, :], (1,), "SAME")[:, 0])
case("fft", "fft", lambda h, p, b: jnp.abs(jnp.fft.rfft(h.astype(jnp.float32), axis=1)),
     dtypes=F32)


def _spd(h):
    a = h.reshape(len(h), 2, 4).astype(jnp.float32)
    return a @ jnp.swapaxes(a, 1, 2) + 2 * jnp.eye(2)


case("cholesky", "cholesky", lambda h, p, b: jnp.linalg.cholesky(_spd(h)), dtypes=F32)
case("eigh", "eigh", lambda h, p, b: jnp.linalg.eigh(_spd(h))[0], dtypes=F32)
case("svd", "svd", lambda h, p, b: jnp.linalg.svd(h.reshape(len(h), 2, 4).astype(jnp.float32),
                                                 compute_uv=False), dtypes=F32)
case("qr", "qr", lambda h, p, b: jnp.abs(jnp.linalg.qr(_spd(h))[1]), dtypes=F32)
case("householder", "householder_product", lambda h, p, b: h * jnp.sum(
    jax.lax.linalg.householder_product(_spd(_sg(h)), 0.1 * _sg(h)[:, :2].astype(jnp.float32)),
    (1, 2))[:, None], dtypes=F32)                                   # (no derivative rule)
case("lu_solve", "lu triangular_solve",
     lambda h, p, b: jnp.linalg.solve(_spd(h), h.reshape(len(h), 2, 4).astype(jnp.float32)),
     dtypes=F32)
case("lu", "lu", lambda h, p, b: jnp.sum(jax.lax.linalg.lu(_spd(h))[0], (1, 2))[:, None],
     dtypes=F32)
case("lu_pivots_to_permutation", "lu_pivots_to_permutation", lambda h, p, b: h * (
    jax.lax.linalg.lu_pivots_to_permutation(jnp.argsort(_sg(h), 1)[:, :2].astype(jnp.int32),
                                            D)[:, :1] + 1).astype(h.dtype))
case("eig", "eig", lambda h, p, b: h * jax.lax.stop_gradient(
    jnp.real(jnp.linalg.eigvals(_spd(h))).sum(1, keepdims=True)), dtypes=F32)
case("tridiagonal_solve", "tridiagonal_solve",
     lambda h, p, b: jax.lax.linalg.tridiagonal_solve(
         jnp.pad(0.1 * h[:, 1:], ((0, 0), (1, 0))).astype(jnp.float32),
         (3.0 + h * h).astype(jnp.float32),
         jnp.pad(0.1 * h[:, :-1], ((0, 0), (0, 1))).astype(jnp.float32),
         h.astype(jnp.float32)[:, :, None])[:, :, 0], dtypes=F32)
case("symmetric_product", "symmetric_product", lambda h, p, b: h * jax.lax.stop_gradient(
    jax.lax.linalg.symmetric_product(jax.lax.stop_gradient(h).reshape(len(h), 2, 4)
                                     .astype(jnp.float32),
                                     jnp.eye(2) * jnp.ones((len(h), 1, 1))).sum((1, 2))[:, None]),
     dtypes=F32)                                                    # (no derivative rule)
case("custom_linear_solve", "custom_linear_solve",
     lambda h, p, b: jax.lax.custom_linear_solve(lambda x: _pos(p["g"]) * x, h,
                                                 lambda mv, r: r / _pos(p["g"]),
                                                 symmetric=True))

# ---------------------------------------------------------------- windows
_window = dict(window_dimensions=(1, 2), window_strides=(1, 2), padding="VALID")
case("reduce_window_sum", "reduce_window_sum",
     lambda h, p, b: jax.lax.reduce_window(h, 0.0, jax.lax.add, **_window))
case("reduce_window_max", "reduce_window_max select_and_scatter_add",
     lambda h, p, b: jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, **_window))
case("reduce_window_min", "reduce_window_min",
     lambda h, p, b: jax.lax.reduce_window(h, jnp.inf, jax.lax.min, **_window))
case("reduce_window", "reduce_window",                      # (no derivative rule)
     lambda h, p, b: h[:, ::2] * jax.lax.reduce_window(
         jax.lax.stop_gradient(h), jnp.asarray(1, h.dtype), lambda x, y: x * y + 0 * x,
         **_window))
case("select_and_gather_add", "select_and_gather_add",     # a JVP-based penalty
     lambda h, p, b: h[:, ::2] * jax.jvp(lambda a: jax.lax.reduce_window(
         a, -jnp.inf, jax.lax.max, **_window), (jax.lax.stop_gradient(h),),
         (jax.lax.stop_gradient(h * h),))[1],
     dtypes=F32)

# ---------------------------------------------------------------- random
case("dropout", "random_bits",
     lambda h, p, b: jnp.where(jax.random.bernoulli(b["key"], 0.8, h.shape), h / 0.8, 0))
case("keys_per_example", "random_split random_fold_in random_bits",
     lambda h, p, b: jax.vmap(lambda k, r: r * jax.random.uniform(k, r.shape, r.dtype))(
         jax.random.split(jax.random.fold_in(b["key"], 3), len(h)), h))

# ---------------------------------------------------------------- control flow, wrappers
case("cond", "cond", lambda h, p, b: jax.lax.cond(
    p["g"][0] > 0, lambda a: jnp.tanh(a @ p["w2"]), lambda a: jnp.sin(a @ p["w2"].T), h))
case("switch", "cond", lambda h, p, b: jax.lax.switch(
    jnp.argmax(p["g"]) % 3, [lambda a: a @ p["w2"], lambda a: jnp.sin(a @ p["w2"]),
                             lambda a: a * a], h))
case("while", "while", lambda h, p, b: jax.lax.fori_loop(
    0, jnp.argmax(p["g"]) % 2 + 2, lambda i, a: jnp.tanh(a * 1.5), jax.lax.stop_gradient(h)) * h)
case("scan_short", "mul", lambda h, p, b: jax.lax.scan(
    lambda c, w: (jnp.tanh(c @ w), None), h, jnp.stack([p["w2"], p["w2"].T]))[0])
case("scan_long", "scan", lambda h, p, b: jax.lax.scan(
    lambda c, t: (jnp.tanh(c * (1 + 0.001 * t)), None), h, jnp.arange(130, dtype=h.dtype))[0])
case("checkpoint", "mul", lambda h, p, b: jax.checkpoint(
    lambda a: jnp.tanh(a @ p["w2"]) * a)(h))


@jax.custom_vjp
def _clip_grad(x):
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))


@jax.custom_jvp
def _softplus(x):
    return jnp.logaddexp(x, 0.0)


_softplus.defjvp(lambda xs, ts: (_softplus(xs[0]), ts[0] * jax.nn.sigmoid(xs[0])))
case("custom_vjp", "max min", lambda h, p, b: _clip_grad(h) * h)
case("custom_jvp", "logistic", lambda h, p, b: _softplus(h))
case("composite", "sin", lambda h, p, b: h * jax.lax.composite(
    lambda a: jnp.sin(a) * 2, name="rhino.test.sin2")(jax.lax.stop_gradient(h)))

# ---------------------------------------------------------------- composites
case("softmax", "reduce_max exp", lambda h, p, b: jax.nn.softmax(h, axis=1) * p["g"])
case("log_softmax", "reduce_max", lambda h, p, b: jax.nn.log_softmax(h, axis=1))
case("logsumexp", "reduce_max", lambda h, p, b: jax.nn.logsumexp(h, axis=1, keepdims=True) * h)
case("layer_norm", "rsqrt", lambda h, p, b: (h - h.mean(1, keepdims=True)) * jax.lax.rsqrt(
    h.var(1, keepdims=True) + 1e-5) * p["g"])
case("rms_norm_f32", "rsqrt", lambda h, p, b: (
    h.astype(jnp.float32) * jax.lax.rsqrt(jnp.mean(h.astype(jnp.float32) ** 2, -1,
                                                   keepdims=True) + 1e-5) *
    p["g"].astype(jnp.float32)).astype(h.dtype))
case("cross_entropy", "reduce_max gather", lambda h, p, b: optax.softmax_cross_entropy_with_integer_labels(
    (h @ p["w2"]).astype(jnp.float32), b["tok"] % D)[:, None])
case("masked_mean_tokens", "reduce_sum div",
     lambda h, p, b: (h * b["mask"][:, None]) / jnp.maximum(jnp.sum(b["mask"]), 1.0) * len(h))
case("gelu_silu", "tanh logistic", lambda h, p, b: jax.nn.gelu(h) + jax.nn.silu(h))
case("attention", "dot_general reduce_max", lambda h, p, b: jax.nn.dot_product_attention(
    h.reshape(len(h), 2, 1, 4), h.reshape(len(h), 2, 1, 4), h.reshape(len(h), 2, 1, 4),
    is_causal=True), dtypes=("float32", "bfloat16"))     # (no float16 dot on CPU)

# ---------------------------------------------------------------- across the batch
case("sum_over_batch", "reduce_sum", lambda h, p, b: jnp.sum(h, 0) @ p["w2"],
     along_batch=True, loss="sum")
case("segment_sum_batch", "scatter-add",
     lambda h, p, b: jax.ops.segment_sum(h * h, b["tok"] % 3, 3) * p["g"][:3, None],
     along_batch=True, loss="sum")
case("class_sums_added", "scatter-add gather",       # linear in the class sums: exact
     lambda h, p, b: h + jax.ops.segment_sum(h, b["tok"] % 3, 3)[b["tok"] % 3],
     along_batch=True, loss="sum")
case("class_sums_per_example", "scatter-add gather",
     lambda h, p, b: h * jax.ops.segment_sum(h, b["tok"] % 3, 3)[b["tok"] % 3],
     along_batch=True, refused=True, loss="sum")
case("concat_augment", "concatenate", lambda h, p, b: jnp.concatenate([h, -h * h], 0)
     .reshape(2, len(h), D).sum(0), along_batch=True)
case("strided_batch", "slice", lambda h, p, b: jnp.repeat(h[::2], 2, axis=0), along_batch=True)
case("batch_norm", "reduce_sum", lambda h, p, b: (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-3),
     along_batch=True, refused=True)
case("softmax_over_batch", "reduce_max", lambda h, p, b: jax.nn.softmax(h, axis=0) * len(h),
     along_batch=True, refused=True)
case("cumsum_over_batch", "cumsum", lambda h, p, b: jnp.cumsum(h, 0) / len(h), along_batch=True,
     refused=True)
case("sort_over_batch", "sort", lambda h, p, b: jnp.sort(h, 0) * jnp.arange(len(h))[:, None] / len(h),
     along_batch=True, refused=True)
case("pairs", "dot_general", lambda h, p, b: (h @ h.T) @ h / len(h), along_batch=True, refused=True)
case("roll_batch", "concatenate", lambda h, p, b: jnp.roll(h, 1, 0) * h, along_batch=True,
     refused=True)


# ---------------------------------------------------------------- coverage of jax.lax
def lax_primitives() -> set[str]:
    """Every primitive the installed ``jax.lax`` and ``jax.lax.linalg`` export."""
    from jax.extend.core import Primitive

    out = set()
    for mod in (jax.lax, jax.lax.linalg):
        out |= {v.name for v in vars(mod).values() if isinstance(v, Primitive)}
    return out


NOT_PER_EXAMPLE = {
    "iota": "it has no operand", "after_all": "tokens only", "create_token": "no operand",
    "rng_uniform": "it has no array operand (shapes only)",
    "rng_bit_generator": "its operand is a key, one per call; its bits are values of the "
                         "batch's shape read in chunks like any whole value",
    "axis_index": "named mesh axes exist only inside shard_map / pmap",
    "psum": "a collective over named mesh axes (shard_map / pmap bodies only)",
    "pmax": "a collective over named mesh axes", "pmin": "a collective over named mesh axes",
    "ppermute": "a collective over named mesh axes",
    "all_gather": "a collective over named mesh axes",
    "all_to_all": "a collective over named mesh axes",
    "ragged_all_to_all": "a collective over named mesh axes",
    "reduce_scatter": "a collective over named mesh axes",
    "psum_scatter": "a collective over named mesh axes",
    "pbroadcast": "a collective over named mesh axes",
    "eq_to": "only inside sort's comparator as XLA lowers it; never an equation of a step",
    "lt_to": "only inside sort's comparator as XLA lowers it; never an equation of a step",
    "le_to": "only inside sort's comparator as XLA lowers it; never an equation of a step",
    "dce_sink": "JAX's own marker keeping a value alive; no value, nothing to compute",
    "select_and_scatter": "no public function emits it (max pooling's gradient is "
                          "select_and_scatter_add, covered)",
    "stage": "the identity that lifts a value into a trace: never an equation of a step",
    "sharding_constraint": "an explicit sharding needs a mesh the step would be planned "
                           "for; rhino writes its own (tested on the SPMD path)",
    "stop_gradient": "not an equation of a traced step (applied when differentiating)",
    "cholesky_update": "only the rank-1 update of a factor, no batch dimensions "
                       "(jax.lax.linalg.cholesky_update takes one matrix)",
    "schur": "CPU only and not differentiable; batched like the other factorizations",
    "hessenberg": "CPU only and not differentiable; batched like the other factorizations",
    "tridiagonal": "not differentiable; batched like the other factorizations",
    "geqp3": "pivoted QR: not differentiable; batched like the other factorizations",
    "ormqr": "not differentiable; batched like the other factorizations",
    "scan": None, "while": None, "cond": None,        # covered (see CASES)
}


def covered() -> dict[str, list[str]]:
    """primitive -> the cases listing it."""
    out: dict[str, list[str]] = {}
    for c in CASES:
        for p in c.prims:
            out.setdefault(p, []).append(c.name)
    return out


# ---------------------------------------------------------------- steps and references
def args_of(dtype: str, seed: int = 0):
    """``(params, opt_state, batch)`` of a case in ``dtype``."""
    k = jax.random.split(jax.random.PRNGKey(seed), 8)
    dt = jnp.dtype(dtype)
    params = {"w1": (jax.random.normal(k[0], (D, D)) * 0.5).astype(dt),
              "w2": (jax.random.normal(k[1], (D, D)) * 0.4).astype(dt),
              "g": (1.0 + 0.1 * jax.random.normal(k[2], (D,))).astype(dt),
              "e": (jax.random.normal(k[3], (V, D)) * 0.5).astype(dt),
              "k": (jax.random.normal(k[4], (3,)) * 0.5).astype(dt)}
    mask = (jax.random.uniform(k[6], (N,)) > 0.3).astype(jnp.float32).at[0].set(1.0)
    batch = {"x": jax.random.normal(k[5], (N, D)),
             "xi": jax.random.randint(k[6], (N, D), 0, 16, dtype=jnp.int32),
             "tok": jax.random.randint(k[7], (N,), 0, V, dtype=jnp.int32),
             "mask": mask, "y": jax.random.normal(k[7], (N,))}
    return params, OPTIMIZER.init(params), batch, jax.random.key(seed + 1)


OPTIMIZER = optax.sgd(0.1)


def make_step(c: Case, dtype: str):
    """The case's training step: ``step(params, opt_state, batch, key) -> (params,
    opt_state, loss, gradients in float32)``."""
    dt = jnp.dtype(dtype)

    def loss(p, batch, key):
        h = jnp.tanh(batch["x"].astype(dt) @ p["w1"])
        out = c.fn(h, p, dict(batch, key=key))
        n = h.shape[0]
        if c.loss == "sum":
            return jnp.sum(out.astype(jnp.float32)) / n
        out = out.astype(jnp.float32).reshape(n, -1)
        return jnp.mean((jnp.mean(out, 1) - batch["y"]) ** 2)

    def step(params, opt_state, batch, key):
        l, g = jax.value_and_grad(loss)(params, batch, key)
        updates, opt_state = OPTIMIZER.update(g, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, l,
                jax.tree.map(lambda t: t.astype(jnp.float32), g))

    return step, loss


def reference(c: Case, dtype: str, args, m: int = M):
    """Gradient accumulation: the loss and gradients of each of ``m`` microbatches (the
    batch's contiguous chunks) under ``jax.jit``, averaged, then the update."""
    params, opt_state, batch, key = args
    _, loss = make_step(c, dtype)
    n = N // m
    grad = jax.jit(jax.value_and_grad(loss))
    parts = [grad(params, jax.tree.map(lambda a: a[j * n:(j + 1) * n], batch), key)
             for j in range(m)]
    ls = sum(l for l, _ in parts) / m
    g = jax.tree.map(lambda *t: sum(x.astype(jnp.float32) for x in t) / m,
                     *[g for _, g in parts])
    g_dt = jax.tree.map(lambda a, p: a.astype(p.dtype), g, params)
    updates, opt_state = OPTIMIZER.update(g_dt, opt_state, params)
    return [*jax.tree.leaves((optax.apply_updates(params, updates), opt_state)), ls,
            *jax.tree.leaves(g)]


TOLERANCE = {"float32": 2e-4, "bfloat16": 2e-2, "float16": 4e-3}


def differs(a, b) -> float:
    """The largest difference of two result lists, relative to each leaf's scale (the
    loss, a scalar near 1, against 1); infinite where a result is not finite (NaN would
    otherwise compare as no difference). A leaf of ``a`` may be a masked array (a
    process's own shards of a result under ``rhino.launch``): only what it holds is
    compared."""
    worst = 0.0
    for x, y in zip(a, b):
        held = ~np.ma.getmaskarray(x)
        x = np.asarray(np.ma.getdata(x), np.float64)
        y = np.asarray(y, np.float64)
        floor = 1.0 if y.ndim == 0 else 1e-3
        scale = max(floor, float(np.max(np.abs(y))) if y.size else 0.0)
        if not held.any():
            continue
        d = float(np.max(np.abs(x - y)[held])) / scale
        if not np.isfinite(d):
            return float("inf")
        worst = max(worst, d)
    return worst


def truth(c: Case, dtype: str, args):
    """The step in float32 on the same values (parameters widened): what every dtype's
    results are rounded from."""
    params, opt_state, batch, key = args
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    step, _ = make_step(c, "float32")
    return jax.tree.leaves(jax.jit(step)(wide, OPTIMIZER.init(wide), batch, key))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How a pipelined run of a case compares (``judge``).

    Attributes:
        outcome: ``exact`` (equal to ``jax.jit`` to its dtype's rounding), ``refused``
            (rightly: gradient accumulation differs from the step), ``wrong``, ``false
            refusal``, or ``unpartitioned`` (``Case.unpartitioned``: not run).
        error: the run's difference from the float32 step (relative, worst leaf);
            rounding: ``jax.jit``'s own in the case's dtype; accumulation: how far gradient
            accumulation in float32 is from the step in float32.
    """

    outcome: str
    error: float = 0.0
    rounding: float = 0.0
    accumulation: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome in ("exact", "refused", "unpartitioned")


def judge(c: Case, dtype: str, args, got) -> Verdict:
    """``got`` (the pipelined step's flat results, or None where it was refused) against
    the step: a run must be as close to the float32 step as ``jax.jit``'s own run in the
    dtype (three times its rounding, plus the dtype's tolerance), so that computing the
    per-microbatch semantics instead of the step's shows; a refusal must be of a step
    whose gradient accumulation (in float32) differs from it."""
    exact = truth(c, dtype, args)
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), args[0])
    acc = differs(reference(c, "float32", (wide, OPTIMIZER.init(wide), *args[2:])), exact)
    if got is None:
        return Verdict("refused" if acc > TOLERANCE["float32"] else "false refusal",
                       accumulation=acc)
    step, _ = make_step(c, dtype)
    whole = jax.tree.leaves(jax.jit(step)(*args))
    rounding = differs(whole, exact)
    error = differs(got, exact)
    ok = error <= 3 * rounding + TOLERANCE[dtype]
    return Verdict("exact" if ok else "wrong", error, rounding, acc)


def pipelined_verdict(c: Case, dtype: str, **options) -> Verdict:
    """The case pipelined by ``rhino.auto_parallel`` on 2x4 (2 stages, ``M``
    microbatches; ``options`` passed on, e.g. an executor), judged (``judge``). A
    ``BatchCouplingError`` is a refusal; any other error propagates."""
    import rhino
    from rhino.errors import BatchCouplingError

    if c.unpartitioned:
        return Verdict("unpartitioned")
    args = args_of(dtype)
    step, _ = make_step(c, dtype)
    run = rhino.auto_parallel(step, cluster="2x4", stages=2, num_microbatches=M, **options)
    try:
        # read while the executor is open (a Ray executor's results are handles on it)
        got = [np.asarray(x) for x in jax.tree.leaves(run(*args))]
    except BatchCouplingError:
        got = None
    finally:
        run.close()
    return judge(c, dtype, args, got)
