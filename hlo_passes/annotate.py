"""Annotation: run a function through a jaxpr interpreter that names every equation, so the
HLO ops the planner sees map back to the values the annotator constrains.

One op identity end to end (DESIGN.md): the function is traced once to a jaxpr; the
interpreter re-evaluates it equation by equation inside ``jax.named_scope("eqn<i>")`` (call-like
equations — ``pjit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat`` — are
inlined, giving nested scopes ``eqn<i>/eqn<j>``). Lowering the interpreter gives HLO whose
``op_name`` metadata carries the equation path, so ``EqnMap`` can find, for each equation
output, the HLO op producing it. The annotated run then applies
``with_sharding_constraint`` to those outputs.

Example:
    >>> import jax, jax.numpy as jnp, rhino
    >>> traced = ScopedFunction(lambda x, w: jnp.tanh(x @ w), jnp.ones((8, 4)), jnp.ones((4, 2)))
    >>> g = rhino.ingest(traced, jnp.ones((8, 4)), jnp.ones((4, 2)))
    >>> m = EqnMap(traced, g)
    >>> sorted(m.producer.values()) == sorted(op.id for op in g.ops if op.opcode != "parameter")
    True
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jcore

from rhino._jax_private import eqn_context, jaxpr_env, trace_without_name_stack
from rhino.errors import RhinoError

from .graph import HloGraph, TensorType
from .unroll import trace

_EQN_RE = re.compile(r"(?:^|[/(])eqn(\d+)(?=[/)]|$)")
# Call-like primitives whose body is evaluated inline (param holding the body).
_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
           "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr",
           "remat2": "jaxpr"}
# jax.checkpoint's primitives: their body is evaluated in named scopes like any call, but
# under the primitive again, so that XLA still recomputes it in the backward pass (behind
# an opt-barrier) instead of keeping the forward's values.
_REMAT = frozenset({"remat", "checkpoint", "remat2"})
# Hook path suffix of a checkpoint body's inputs (the values behind its opt-barrier):
# ``hook(path + (BARRIER,), i, x)`` for input i of the checkpoint equation at ``path``.
BARRIER = -1
# A ``cond`` whose branches hold none of these (and no effects) is evaluated as both branches
# and a select: what it computes is the same, both branches are cheap (an update applied or
# skipped, a scale), and its values get planned specs instead of an opaque conditional that
# keeps everything it touches replicated. Heavier branches stay a conditional.
_HEAVY = frozenset({"dot_general", "conv_general_dilated", "while", "scan", "cond", "fft",
                    "sort", "custom_call", "pure_callback", "io_callback", "debug_callback",
                    "cumsum", "cumprod", "cummax", "cumlogsumexp", "reduce_precision",
                    "all_gather", "psum", "ppermute", "all_to_all"})


def light_branches(eqn) -> bool:
    """A ``cond`` equation whose branches are cheap and pure (see ``_HEAVY``)."""
    if eqn.primitive.name != "cond" or "branches" not in eqn.params:
        return False

    def light(jaxpr) -> bool:
        for e in jaxpr.eqns:
            if e.primitive.name in _HEAVY or getattr(e, "effects", None):
                return False
            body = call_body(e)
            if body is not None and not light(body[0]):
                return False
        return True

    return all(light(b.jaxpr) for b in eqn.params["branches"])

# (equation path, index, value) -> the value to use: applied to each output of a leaf
# equation (out hook) or to each of its inputs before it runs (in hook).
Hook = Callable[[tuple[int, ...], int, Any], Any]
# (equation, inputs, bind params) -> outputs (a list): runs a leaf equation in place of
# ``eqn.primitive.bind`` (e.g. on values kept in another physical shape).
Binder = Callable[[Any, list, dict], list]


def _bind(eqn, invals: list, params: dict) -> list:
    outs = eqn.primitive.bind(*invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


class AnnotationError(RhinoError):
    """A plan cannot be mapped onto the program's values."""


def call_body(eqn) -> tuple[Any, Sequence[Any]] | None:
    key = _INLINE.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    body = eqn.params[key]
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, body.consts
    if isinstance(body, jcore.Jaxpr):
        return body, ()
    return None


def eval_scoped(jaxpr, consts: Sequence[Any], args: Sequence[Any], hook: Hook | None = None,
                path: tuple[int, ...] = (), in_hook: Hook | None = None,
                binder: Binder | None = None) -> list[Any]:
    """Evaluate ``jaxpr`` with one named scope per equation, calling ``in_hook`` on the
    inputs and ``hook`` on the outputs of every leaf equation, which runs through
    ``binder`` (default: ``bind``)."""
    env, read = jaxpr_env(jaxpr, consts, args)
    for i, eqn in enumerate(jaxpr.eqns):
        p = path + (i,)
        invals = [read(v) for v in eqn.invars]
        with jax.named_scope(f"eqn{i}"):
            body = call_body(eqn)
            if binder is None and light_branches(eqn):
                with eqn_context(eqn):
                    outs = _eval_cond_as_select(eqn, invals)
                if hook is not None:
                    outs = [hook(p, k, x) for k, x in enumerate(outs)]
            elif body is not None:
                # The call's own name stack (e.g. ``transpose(jvp(...))`` around a nested
                # jit) goes on for its inlined equations: without it a weight gradient
                # computed in a nested jit would not look like one.
                with eqn_context(eqn):
                    if eqn.primitive.name in _REMAT:
                        outs = _eval_remat(eqn, body, invals, hook, p, in_hook, binder)
                    else:
                        outs = eval_scoped(body[0], body[1], invals, hook, p, in_hook, binder)
            else:
                if in_hook is not None:
                    invals = [in_hook(p, j, x) for j, x in enumerate(invals)]
                params = eqn.primitive.get_bind_params(eqn.params)
                with eqn_context(eqn):
                    outs = (binder or _bind)(eqn, invals, params)
                if hook is not None:
                    outs = [hook(p, k, x) for k, x in enumerate(outs)]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _eval_remat(eqn, body, invals: list, hook: Hook | None, path: tuple[int, ...],
                in_hook: Hook | None, binder: Binder | None) -> list[Any]:
    """A ``jax.checkpoint`` equation: its body evaluated in named scopes (with the hooks),
    traced to a jaxpr and bound under the same primitive and parameters."""
    def scoped(*args):
        if hook is not None:
            args = [hook(path + (BARRIER,), i, x) for i, x in enumerate(args)]
        return eval_scoped(body[0], body[1], args, hook, path, in_hook, binder)

    jaxpr, consts = trace_without_name_stack(scoped, invals)
    params = dict(eqn.params, jaxpr=jaxpr)
    outs = eqn.primitive.bind(*consts, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _eval_cond_as_select(eqn, invals: list) -> list[Any]:
    """A light ``cond``: every branch evaluated (in scopes ``branch<b>/eqn<j>``), then the
    branch the index picks selected (the index clamped as ``cond`` clamps it)."""
    branches = eqn.params["branches"]
    index, operands = invals[0], invals[1:]
    results = []
    for b, branch in enumerate(branches):
        with jax.named_scope(f"branch{b}"):
            results.append(eval_scoped(branch.jaxpr, branch.consts, operands))
    which = jax.lax.clamp(0, jax.lax.convert_element_type(index, "int32"), len(branches) - 1)
    if len(branches) == 2:
        which = which.astype(bool)
    return [jax.lax.select_n(which, *cases) for cases in zip(*results)]


class ScopedFunction:
    """``fn`` traced once to a jaxpr, callable with the same pytree arguments, evaluating
    the jaxpr equation by equation in named scopes (optionally with a hook on outputs).

    Attributes:
        closed: the ClosedJaxpr of ``fn`` at the example arguments.
        in_tree / out_tree: pytree structures of the arguments and results.
    """

    def __init__(self, fn: Callable, *example_args: Any, hook: Hook | None = None,
                 in_hook: Hook | None = None):
        self.fn = fn
        self.closed, out_shape = trace(fn, *example_args, return_shape=True)
        self.in_tree = jax.tree_util.tree_structure(example_args)
        self.out_tree = jax.tree_util.tree_structure(out_shape)
        self.hook = hook
        self.in_hook = in_hook
        self.binder: Binder | None = None
        self.finish: Callable[[Any], Any] | None = None
        functools.update_wrapper(self, fn)

    def with_hook(self, hook: Hook | None, in_hook: Hook | None = None,
                  binder: Binder | None = None,
                  finish: Callable[[Any], Any] | None = None) -> "ScopedFunction":
        """The same traced function with other hooks (no re-tracing); ``finish`` maps each
        result before it is returned."""
        new = object.__new__(ScopedFunction)
        new.__dict__.update(self.__dict__)
        new.hook, new.in_hook, new.binder, new.finish = hook, in_hook, binder, finish
        return new

    def __call__(self, *args: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != self.in_tree:
            raise AnnotationError(f"arguments: expected the structure {self.in_tree}, found "
                                  f"{tree}")
        outs = eval_scoped(self.closed.jaxpr, self.closed.consts, flat, self.hook, (),
                           self.in_hook, self.binder)
        if self.finish is not None:
            outs = [self.finish(x) for x in outs]
        return jax.tree_util.tree_unflatten(self.out_tree, outs)

    def leaf_eqns(self) -> dict[tuple[int, ...], Any]:
        """Every evaluated (non-inlined) equation by its path."""
        out: dict[tuple[int, ...], Any] = {}

        def walk(jaxpr, path):
            for i, eqn in enumerate(jaxpr.eqns):
                body = call_body(eqn)
                if body is not None:
                    walk(body[0], path + (i,))
                else:
                    out[path + (i,)] = eqn
        walk(self.closed.jaxpr, ())
        return out


def eqn_path(op_name: str) -> tuple[int, ...]:
    """``'jit(f)/eqn3/eqn0/dot_general'`` -> ``(3, 0)``; a scope inside a transformation
    counts too (``'jit(f)/eqn227/transpose(jvp(eqn1))/scatter-add'`` -> ``(227, 1)``).

    Example:
        >>> eqn_path("jit(step)/eqn227/transpose(jvp(eqn1))/scatter-add")
        (227, 1)
    """
    return tuple(int(x) for x in _EQN_RE.findall(op_name))


class EqnMap:
    """Which HLO op produces each equation output of a ``ScopedFunction``.

    Attributes:
        producer: ``(eqn path, output index) -> op id``.
        inputs: ``eqn path -> [op id holding input j, or None]`` for every leaf equation.
        unmapped: ``(eqn path, output index)`` outputs with no HLO op of their own (values
            equal to an input, e.g. a no-op convert; they need no annotation).
    """

    def __init__(self, traced: ScopedFunction, graph: HloGraph):
        by_path: dict[tuple[int, ...], list[int]] = {}
        for op in graph.ops:
            if op.opcode == "parameter":
                continue
            by_path.setdefault(eqn_path(op.op_name), []).append(op.id)
        users = graph.users
        outputs = set(graph.outputs)
        self.producer: dict[tuple[tuple[int, ...], int], int] = {}
        self.unmapped: list[tuple[tuple[int, ...], int]] = []
        for path, eqn in traced.leaf_eqns().items():
            ops = by_path.get(path, [])
            members = set(ops)
            exported = [i for i in ops if i in outputs or any(u not in members for u in users[i])]
            for k, v in enumerate(eqn.outvars):
                if isinstance(v, jcore.DropVar):
                    continue
                aval = v.aval
                want = TensorType(_dtype_name(aval.dtype), tuple(aval.shape))
                match = [i for i in exported if graph.ops[i].shape == want]
                if not match:
                    self.unmapped.append((path, k))
                    continue
                # Several same-typed exports: the k-th output is the k-th of its type.
                same_type_before = sum(1 for j in range(k)
                                       if _type_of(eqn.outvars[j]) == want)
                self.producer[(path, k)] = match[min(same_type_before, len(match) - 1)]
        self._barrier_inputs(traced, graph)
        self.inputs = self._input_ops(traced, graph)

    def _barrier_inputs(self, traced: ScopedFunction, graph: HloGraph) -> None:
        """``(checkpoint path + (BARRIER,), i)`` -> the copy op ingestion made for input i
        of a checkpoint equation behind its opt-barrier (whose operands are the bound
        constants first, then the equation's inputs)."""
        calls: dict[tuple[int, ...], Any] = {}

        def walk(jaxpr, path):
            for i, eqn in enumerate(jaxpr.eqns):
                body = call_body(eqn)
                if body is not None:
                    if eqn.primitive.name in _REMAT:
                        calls[path + (i,)] = eqn
                    walk(body[0], path + (i,))
        walk(traced.closed.jaxpr, ())
        for op in graph.ops:
            if op.opcode != "copy" or "barrier" not in op.attrs:
                continue
            path = eqn_path(op.op_name)
            eqn = calls.get(path)
            if eqn is None:
                continue
            i = op.attrs["index"] - (op.attrs["of"] - len(eqn.invars))
            if 0 <= i < len(eqn.invars):
                self.producer[(path + (BARRIER,), i)] = op.id

    def _input_ops(self, traced: ScopedFunction, graph: HloGraph
                   ) -> dict[tuple[int, ...], list[int | None]]:
        """Per leaf equation, the HLO op holding each of its inputs (None: a literal or a
        value with no op of its own). A value with no op that equals its only input of the
        same type (trace-time folding such as ``x + 0``) is that input's op."""
        ids: dict = {}
        out: dict[tuple[int, ...], list[int | None]] = {}

        def read(v):
            return None if isinstance(v, jcore.Literal) else ids.get(v)

        def walk(jaxpr, path, args):
            for v, i in zip(jaxpr.invars, args):
                ids[v] = i
            for i, eqn in enumerate(jaxpr.eqns):
                p = path + (i,)
                invals = [read(v) for v in eqn.invars]
                body = call_body(eqn)
                if body is not None:
                    if eqn.primitive.name in _REMAT:   # read behind the opt-barrier
                        invals = [self.producer.get((p + (BARRIER,), j), x)
                                  for j, x in enumerate(invals)]
                    res = walk(body[0], p, invals)
                else:
                    out[p] = invals
                    res = []
                    for k, v in enumerate(eqn.outvars):
                        got = self.producer.get((p, k))
                        if got is None:
                            same = [x for x, w in zip(invals, eqn.invars)
                                    if x is not None and _type_of(w) == _type_of(v)]
                            got = same[0] if len(same) == 1 else None
                        res.append(got)
                for v, x in zip(eqn.outvars, res):
                    if not isinstance(v, jcore.DropVar):
                        ids[v] = x
            return [read(v) for v in jaxpr.outvars]

        walk(traced.closed.jaxpr, (), list(graph.params))
        return out


_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
           "int32": "s32", "int64": "s64", "int8": "s8", "int16": "s16", "uint8": "u8",
           "uint32": "u32", "uint64": "u64", "uint16": "u16", "bool": "pred",
           "complex64": "c64", "complex128": "c128"}


def _dtype_name(dtype) -> str:
    name = getattr(dtype, "name", str(dtype))
    return _DTYPES.get(name, name)


def _type_of(v) -> TensorType | None:
    aval = getattr(v, "aval", None)
    if aval is None or not hasattr(aval, "shape"):
        return None
    return TensorType(_dtype_name(aval.dtype), tuple(aval.shape))
