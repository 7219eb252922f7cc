"""The jaxpr primitives rhino treats specially, by name, in one table.

Every primitive name rhino's code refers to is spelled here once; other modules ask by
meaning (``is_call``, ``ELEMENTWISE``, ``rng_shape``, ...). A primitive JAX renames or adds
is then a change to this file and its canary test (``tests/test_jaxpr_private.py`` checks
that every name below is a primitive of the installed JAX, or is listed as one that only
some releases have).

=================  ===========================================================================
call               a function call whose body is inlined by the interpreter (``jit``, ...)
custom             a custom_jvp / custom_vjp function: its primal body is inlined
remat              ``jax.checkpoint``: its body is evaluated and bound again under it
hi                 jax ≥ 0.11's ``call_hi_primitive`` (checkpoint / custom_vjp under
                   ``jax_remat3`` / ``jax_custom_vjp3``): its body is inlined; a
                   checkpoint's is bound again under ``jax.checkpoint`` (remat)
scan / cond /      control flow (bodies kept; scans of a bounded length are unrolled)
while
=================  ===========================================================================
"""

from __future__ import annotations

from typing import Any, Sequence

from rhino.jaxpr import private

# Call-like primitives -> the parameter holding their body.
CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
         "core_call": "call_jaxpr"}
CUSTOM = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr",
          # a function with a custom batching rule, a named decomposition: their bodies
          # (composite's is "jaxpr" in jax 0.10, "call_jaxpr" from 0.12)
          "custom_vmap_call": "call", "composite": ("jaxpr", "call_jaxpr")}
REMAT = {"remat": "jaxpr", "checkpoint": "jaxpr", "remat2": "jaxpr"}
HI = "call_hi_primitive"
SCAN, COND, WHILE = "scan", "cond", "while"
PLATFORM_INDEX = "platform_index"
CONTROL_FLOW = frozenset({SCAN, COND, WHILE})
OPTIMIZATION_BARRIER = "optimization_barrier"

# cuDNN's fused attention as jax.nn.dot_product_attention(implementation="cudnn") binds it
# (GPU only): one problem per index of the batch, its leading dimension in every operand and
# result that has it (query, key, value, a per-example bias or sequence lengths; empty
# operands stand for what is absent).
CUDNN_ATTENTION = frozenset({"dot_product_attention_fwd_wrapper",
                             "dot_product_attention_bwd_wrapper",
                             "dot_product_attention_fp8_fwd_wrapper",
                             "dot_product_attention_fp8_bwd_wrapper"})
# Names only some supported JAX releases have (the canary does not require them).
VERSION_DEPENDENT = frozenset({"pjit", "remat", "checkpoint", "core_call", "closed_call",
                               "custom_vjp_call_jaxpr", "one_minus_square", "copy_p",
                               "reciprocal", "square", "split", "erf_inv", "sharding_constraint",
                               "mesh_cast", "reshard", "pvary", "cumlogsumexp",
                               "expand_dims", "custom_call", "scatter_add", "scatter_mul",
                               "scatter_min", "scatter_max", "scatter_sub", "eq_to",
                               "le_to", "lt_to", "stage", "stack", "unstack", "tile",
                               "random_gamma_grad", "geqp3", "cholesky_update",
                               "symmetric_product", "composite", "custom_vmap_call",
                               "debug_print", "log2", "polynomial"}) | CUDNN_ATTENTION

# One result per element from the elements at the same position of every operand (rank-0
# operands broadcast): slicing the operands slices the result.
ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "exp", "exp2", "log",
    # jax 0.12: log2, and polynomial (Horner's rule in x; its coefficients are operands too)
    "log2", "polynomial",
    "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan",
    "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "pow",
    "integer_pow", "abs", "sign", "select_n", "convert_element_type", "square", "erf",
    "erfc", "erf_inv", "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a",
    "bessel_i0e", "bessel_i1e", "polygamma", "zeta", "and", "or", "not",
    "xor", "eq", "ne", "lt", "le", "gt", "ge", "copy", "copy_p", "floor", "ceil", "round",
    "is_finite", "atan2", "clamp", "nextafter", "reciprocal", "real", "imag", "conj",
    "complex", "shift_left", "shift_right_arithmetic", "shift_right_logical",
    "population_count", "clz", "reduce_precision", "stop_gradient", "one_minus_square",
    "mulhi", "eq_to", "le_to", "lt_to", "regularized_incomplete_beta",
    "random_gamma_grad"})
# Elementwise too, but not arithmetic: values passed on unchanged (a sharding, a name, a
# barrier), and the counter-based random functions over key data.
IDENTITY_LIKE = frozenset({"device_put", "sharding_constraint", "mesh_cast", "reshard",
                           "pvary", "name", OPTIMIZATION_BARRIER, "stage"})
# Batched linear algebra: every dimension before the last ``core`` ones of the first
# operand is a batch dimension of every operand and result (one problem per index).
LINALG_CORE = {"cholesky": 2, "cholesky_update": 2, "eig": 2, "eigh": 2, "svd": 2,
               "qr": 2, "geqrf": 2, "geqp3": 2, "householder_product": 2, "ormqr": 2,
               "lu": 2, "lu_pivots_to_permutation": 1, "triangular_solve": 2, "schur": 2,
               "hessenberg": 2, "tridiagonal": 2, "tridiagonal_solve": 1,
               "symmetric_product": 2, "fft": None}
STACK, UNSTACK, TILE, REDUCE, APPROX_TOP_K = "stack", "unstack", "tile", "reduce", \
    "approx_top_k"
# Calls with a body that the flat program keeps (their bodies run per microbatch:
# ``rhino.jaxpr.bodies``).
CUSTOM_PARTITIONING, LINEAR_SOLVE = "custom_partitioning", "custom_linear_solve"
RNG_ELEMENTWISE = frozenset({"threefry2x32", "random_fold_in"})
# Elementwise and linear in their floating operands (a sum of per-part results is the
# result of the sum): what a partial sum may pass through unreduced.
LINEAR_ELEMENTWISE = frozenset({"add", "add_any", "sub", "neg", "copy", "copy_p",
                                "device_put", "sharding_constraint", "mesh_cast", "reshard",
                                "pvary", "name", "real", "imag", "conj"})
# Reductions over ``axes``.
REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min",
              "reduce_prod": "prod", "reduce_and": "and", "reduce_or": "or",
              "reduce_xor": "xor"}
ARG_REDUCTIONS = frozenset({"argmax", "argmin"})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
# Random primitives whose ``shape`` parameter sets how many values they draw per key.
RNG_SHAPED = frozenset({"random_bits", "random_split"})
RANDOM_WRAP, RANDOM_UNWRAP = "random_wrap", "random_unwrap"
# Random functions whose results are no key made from their operands: a key from a seed,
# and random bits (their counter-based hash, ``threefry2x32(k1, k2, x1, x2)``).
RANDOM_SEED, RANDOM_BITS, THREEFRY = "random_seed", "random_bits", "threefry2x32"
RANDOM_FOLD_IN = "random_fold_in"       # a key from a key (operand 0) and a message
# Heavy or effectful: a ``cond`` holding one is not evaluated as a select.
HEAVY = frozenset({"dot_general", "conv_general_dilated", WHILE, SCAN, COND, "fft", "sort",
                   "custom_call", "pure_callback", "io_callback", "debug_callback", "cumsum",
                   "cumprod", "cummax", "cumlogsumexp", "reduce_precision", "all_gather",
                   "psum", "ppermute", "all_to_all", HI})

# Names the microbatch layout rules (``rhino.jaxpr.microbatch``) dispatch on.
DOT, CONV = "dot_general", "conv_general_dilated"
BROADCAST, RESHAPE, TRANSPOSE, SQUEEZE = "broadcast_in_dim", "reshape", "transpose", "squeeze"
EXPAND_DIMS = "expand_dims"
CONVERT = "convert_element_type"
IOTA = "iota"
SLICE, DYNAMIC_SLICE, DYNAMIC_UPDATE_SLICE = "slice", "dynamic_slice", "dynamic_update_slice"
CONCATENATE, PAD, REV, SPLIT = "concatenate", "pad", "rev", "split"
GATHER = "gather"
SCATTERS = frozenset({"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
                      "scatter-min", "scatter_min", "scatter-max", "scatter_max",
                      "scatter-sub", "scatter_sub"})
SCATTER_ADD = frozenset({"scatter-add", "scatter_add"})
SORT, TOP_K = "sort", "top_k"
SELECT_N = "select_n"
MUL, DIV, INTEGER_POW = "mul", "div", "integer_pow"
ADDS = frozenset({"add", "add_any"})
SUB = "sub"
# Linear in their (one) operand and moving no value across the batch: a chain of these
# after a sum of gradient parts can run on the parts' sums instead.
LINEAR_UNARY = frozenset({"neg", "convert_element_type", "reshape", "transpose", "copy",
                          "squeeze", "expand_dims", "broadcast_in_dim", "reduce_sum"})
SUMS = frozenset({"add", "add_any", "sub"})
REDUCE_WINDOWS = frozenset({"reduce_window_sum", "reduce_window_max", "reduce_window_min",
                            "reduce_window", "select_and_scatter_add",
                            "select_and_gather_add", "select_and_scatter"})


def name(eqn: Any) -> str:
    """The primitive's name."""
    return eqn.primitive.name


def call_body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of an equation the interpreter inlines (a call, a custom_jvp /
    custom_vjp function's primal, a checkpoint, a ``call_hi_primitive``); None for others."""
    n = eqn.primitive.name
    if n == HI:
        return private.hi_body(eqn)
    key = CALLS.get(n) or CUSTOM.get(n) or REMAT.get(n)
    present = [k for k in ((key,) if isinstance(key, str) else key or ()) if k in eqn.params]
    if not present:
        return None
    return private.open_body(eqn.params[present[0]])


def is_remat(eqn: Any) -> bool:
    """A ``jax.checkpoint`` equation bound as such (its body recomputed in the backward):
    ``checkpoint`` / ``remat``, or under ``jax_remat3`` a ``call_hi_primitive`` holding a
    checkpoint."""
    return eqn.primitive.name in REMAT or private.hi_remat_params(eqn) is not None


def is_call(eqn: Any) -> bool:
    """A plain function call (``jit``): binding its body inline computes the same."""
    return eqn.primitive.name in CALLS


def is_identity_pow(eqn: Any) -> bool:
    """``integer_pow`` with exponent 1."""
    return eqn.primitive.name == INTEGER_POW and eqn.params.get("y") == 1


def rng_shape(eqn: Any) -> tuple[int, ...] | None:
    """The per-key ``shape`` of a random equation that draws values (``RNG_SHAPED``)."""
    if eqn.primitive.name not in RNG_SHAPED:
        return None
    return tuple(eqn.params["shape"])


def scan_info(eqn: Any) -> tuple[int, int, int, bool, tuple[Any, Sequence[Any]]] | None:
    """``(constants, carry, length, reverse, (body jaxpr, body consts))`` of a ``scan``
    equation (its operands: constants, then carry, then the scanned inputs); None for other
    equations."""
    if eqn.primitive.name != SCAN:
        return None
    nc, nk, _ = private.scan_parts(eqn)
    body = private.open_body(eqn.params["jaxpr"])
    return nc, nk, int(eqn.params["length"]), bool(eqn.params["reverse"]), body


def cond_branches(eqn: Any) -> list[tuple[Any, Sequence[Any]]] | None:
    """The branches of a ``cond`` equation (its first operand is the index)."""
    if eqn.primitive.name != COND or "branches" not in eqn.params:
        return None
    return [private.open_body(b) for b in eqn.params["branches"]]


# Primitives that address positions by index values (an iota of the batch's size read as
# positions of the whole batch).
INDEXING = frozenset({GATHER, DYNAMIC_SLICE, DYNAMIC_UPDATE_SLICE}) | SCATTERS


def index_free_branches(eqn: Any) -> tuple[Any, frozenset[int]] | None:
    """For a platform-dependent ``cond`` (``jax.lax.platform_dependent``, as
    ``jnp.diagonal`` makes: its branches compute the same values, each lowered for its
    platforms): its ``branches_platforms`` and the branches that address no position by
    index values (none of ``INDEXING``, also in nested calls: a mask-and-reduce rather
    than a gather). None for other equations."""
    platforms = eqn.params.get("branches_platforms") if eqn.primitive.name == COND else None
    branches = cond_branches(eqn) if platforms is not None else None
    if branches is None:
        return None

    def free(jaxpr: Any) -> bool:
        for e in jaxpr.eqns:
            if e.primitive.name in INDEXING or e.primitive.name in CONTROL_FLOW:
                return False
            body = call_body(e)
            if body is not None and not free(body[0]):
                return False
        return True

    return platforms, frozenset(b for b, (jaxpr, _) in enumerate(branches) if free(jaxpr))


def while_parts(eqn: Any) -> tuple[int, int, Any] | None:
    """``(cond constants, body constants, cond jaxpr)`` of a ``while`` equation (operands:
    the cond's constants, the body's constants, then the carry)."""
    if eqn.primitive.name != WHILE:
        return None
    p = eqn.params
    return p["cond_nconsts"], p["body_nconsts"], private.open_body(p["cond_jaxpr"])[0]


def while_trips(eqn: Any) -> int | None:
    """The number of iterations of a ``while`` equation that counts: a carry started from
    a literal, stepped by a literal in the body and compared with a literal bound by
    ``lt`` / ``le`` / ``gt`` / ``ge`` / ``ne`` in the condition (``fori_loop`` with a
    bound known when traced but written as a loop); None for any other equation or loop.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: jax.lax.while_loop(
        ...     lambda c: c[0] < 5, lambda c: (c[0] + 2, c[1] * 2), (0, x)))(1.0).eqns[0]
        >>> while_trips(eqn)
        3
    """
    parts = while_parts(eqn)
    if parts is None:
        return None
    nc, nb, cond = parts
    body = private.open_body(eqn.params["body_jaxpr"])[0]
    if len(cond.eqns) != 1 or len(cond.outvars) != 1:
        return None
    test = cond.eqns[0]
    ops = {"lt": lambda i, n: i < n, "le": lambda i, n: i <= n, "gt": lambda i, n: i > n,
           "ge": lambda i, n: i >= n, "ne": lambda i, n: i != n}
    if test.primitive.name not in ops or test.outvars[0] is not cond.outvars[0]:
        return None
    a, b = test.invars
    carry_in = cond.invars[nc:]
    if private.is_literal(a) or a not in carry_in or not private.is_literal(b):
        return None
    k = carry_in.index(a)
    start = eqn.invars[nc + nb + k]
    if not private.is_literal(start):
        return None
    out = body.outvars[k]
    step_eqn = next((e for e in body.eqns if out in e.outvars), None)
    if step_eqn is None or step_eqn.primitive.name not in ("add", "sub"):
        return None
    x, y = step_eqn.invars
    if x is not body.invars[nb + k] or not private.is_literal(y):
        return None
    i, n = int(start.val), int(b.val)
    step = int(y.val) if step_eqn.primitive.name == "add" else -int(y.val)
    if step == 0:
        return None
    trips, test_of = 0, ops[test.primitive.name]
    while test_of(i, n):
        trips += 1
        i += step
        if trips > 1 << 20:
            return None
    return trips


def while_body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of a ``while`` equation's body (it reads the body's constants,
    then the carry); None for other equations."""
    if eqn.primitive.name != WHILE:
        return None
    return private.open_body(eqn.params["body_jaxpr"])


def reduction_axes(eqn: Any) -> tuple[int, ...]:
    """The axes a reduction (``REDUCTIONS``, ``ARG_REDUCTIONS``) reduces over."""
    p = eqn.params
    if "axis" in p:
        return (int(p["axis"]),)
    return tuple(int(a) for a in p.get("axes", p.get("dimensions", ())))


def light_cond(eqn: Any) -> bool:
    """A ``cond`` whose branches are cheap and pure (none of ``HEAVY``, no effects, also in
    nested calls): evaluating every branch and selecting computes the same."""
    branches = cond_branches(eqn)
    if branches is None:
        return False

    def light(jaxpr: Any) -> bool:
        for e in jaxpr.eqns:
            if e.primitive.name in HEAVY or getattr(e, "effects", None):
                return False
            body = call_body(e)
            if body is not None and not light(body[0]):
                return False
        return True

    return all(light(b[0]) for b in branches)


# Host callbacks: Python run by the program (``jax.debug.callback`` is ``debug_callback``,
# ``jax.debug.print`` ``debug_print``; ``io_callback``; ``pure_callback``, which has no
# effect).
CALLBACKS = frozenset({"pure_callback", "io_callback", "debug_callback", "debug_print"})


def is_effect(eqn: Any) -> bool:
    """An equation with an effect (a debug or io callback, or control flow holding one):
    under ``jax.jit`` it runs once per step even where nothing reads its results."""
    return bool(getattr(eqn, "effects", None))


def is_ordered(eqn: Any) -> bool:
    """An equation with an ordered effect (``ordered=True``): ``jax.jit`` runs those in
    program order, and only on one device."""
    return any(private.is_ordered_effect(e) for e in getattr(eqn, "effects", None) or ())


def callback_sites(eqn: Any) -> list[Any]:
    """The host-callback equations ``eqn`` is or holds (in its bodies, branches, loops),
    innermost, in program order: where a message names the user's callback. (An
    effect of another primitive, holding no body, counts as one.)"""
    if eqn.primitive.name in CALLBACKS:
        return [eqn]
    out: list[Any] = []
    bodies = False
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            body = private.open_body(v)
            if body is not None:
                bodies = True
                for e in body[0].eqns:
                    out.extend(callback_sites(e))
    return [eqn] if not bodies and is_effect(eqn) else out


def all_names() -> frozenset[str]:
    """Every primitive name this table spells (for the canary test)."""
    names = set(CALLS) | set(CUSTOM) | set(REMAT) | {HI, SCAN, COND, WHILE}
    names |= ELEMENTWISE | IDENTITY_LIKE | RNG_ELEMENTWISE | LINEAR_ELEMENTWISE | set(REDUCTIONS) | ARG_REDUCTIONS | CUMULATIVE
    names |= RNG_SHAPED | LINEAR_UNARY | SUMS | {RANDOM_WRAP, RANDOM_UNWRAP} | HEAVY | SCATTERS | REDUCE_WINDOWS
    names |= set(LINALG_CORE) | {STACK, UNSTACK, TILE, REDUCE, APPROX_TOP_K,
                                 CUSTOM_PARTITIONING, LINEAR_SOLVE} | CUDNN_ATTENTION
    names |= {RANDOM_WRAP, RANDOM_UNWRAP, RANDOM_SEED, RANDOM_BITS, THREEFRY,
              RANDOM_FOLD_IN} | CALLBACKS
    names |= {DOT, CONV, BROADCAST, RESHAPE, TRANSPOSE, SQUEEZE, CONVERT, IOTA, SLICE,
              DYNAMIC_SLICE, DYNAMIC_UPDATE_SLICE, CONCATENATE, PAD, REV, SPLIT, GATHER, SORT,
              TOP_K, SELECT_N, MUL, DIV, INTEGER_POW, SUB, OPTIMIZATION_BARRIER,
              PLATFORM_INDEX} | ADDS
    return frozenset(names)
