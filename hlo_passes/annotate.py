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

from rhino.errors import RhinoError
from rhino.jaxpr import primitives as prims
from rhino.jaxpr import private
from rhino.jaxpr.interpret import Interpreter, inlined_equations, leaf_equations

from .graph import HloGraph, TensorType
from .unroll import trace

_EQN_RE = re.compile(r"(?:^|[/(])eqn(\d+)(?=[/)]|$)")
# Hook path suffix of a checkpoint body's inputs (the values behind its opt-barrier):
# ``hook(path + (BARRIER,), i, x)`` for input i of the checkpoint equation at ``path``.
BARRIER = -1

# (equation path, index, value) -> the value to use: applied to each output of a leaf
# equation (out hook) or to each of its inputs before it runs (in hook).
Hook = Callable[[tuple[int, ...], int, Any], Any]
# (equation, inputs, bind params, equation path) -> outputs (a list): runs a leaf equation
# in place of ``eqn.primitive.bind`` (e.g. on values kept in another physical shape).
Binder = Callable[[Any, list, dict, tuple[int, ...]], list]


class AnnotationError(RhinoError):
    """A plan cannot be mapped onto the program's values."""


class _Scoped(Interpreter):
    """The step's equations in named scopes ``eqn<i>`` (nested for inlined bodies), with
    ``in_hook`` on the inputs and ``hook`` on the outputs of every leaf equation, which
    runs through ``binder`` (default: bind). Checkpoint bodies read their inputs through
    ``hook(path + (BARRIER,), i, x)``. Without a binder a cheap ``cond`` is evaluated as
    a select (``Interpreter.cond_as_select``)."""

    scoped = True

    def __init__(self, hook: Hook | None, in_hook: Hook | None, binder: Binder | None):
        self.hook, self.in_hook, self.binder = hook, in_hook, binder
        self.select_light_conds = binder is None

    def leaf(self, eqn, path, invals):
        if self.in_hook is not None:
            invals = [self.in_hook(path, j, x) for j, x in enumerate(invals)]
        params = private.bind_params(eqn)
        with private.eqn_context(eqn):
            outs = (self.binder(eqn, invals, params, path) if self.binder is not None
                    else private.bind(eqn, invals, params))
        return self._out(path, outs)

    def cond_as_select(self, eqn, path, invals):
        return self._out(path, super().cond_as_select(eqn, path, invals))

    def remat_body(self, eqn, path, body, args):
        if self.hook is not None:
            args = [self.hook(path + (BARRIER,), i, x) for i, x in enumerate(args)]
        return self.run(body[0], body[1], args, path)

    def _out(self, path, outs):
        if self.hook is None:
            return outs
        return [self.hook(path, k, x) for k, x in enumerate(outs)]


def eval_scoped(jaxpr, consts: Sequence[Any], args: Sequence[Any], hook: Hook | None = None,
                path: tuple[int, ...] = (), in_hook: Hook | None = None,
                binder: Binder | None = None) -> list[Any]:
    """Evaluate ``jaxpr`` with one named scope per equation, calling ``in_hook`` on the
    inputs and ``hook`` on the outputs of every leaf equation, which runs through
    ``binder`` (default: ``bind``)."""
    return _Scoped(hook, in_hook, binder).run(jaxpr, consts, args, path)


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
        functools.update_wrapper(self, fn, updated=())   # its name, not its attributes

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
        return leaf_equations(self.closed.jaxpr)


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
                if private.is_dropped(v):
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
        calls = {p: e for p, e in inlined_equations(traced.closed.jaxpr) if prims.is_remat(e)}
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
            return None if private.is_literal(v) else ids.get(v)

        def walk(jaxpr, path, args):
            for v, i in zip(jaxpr.invars, args):
                ids[v] = i
            for i, eqn in enumerate(jaxpr.eqns):
                p = path + (i,)
                invals = [read(v) for v in eqn.invars]
                body = prims.call_body(eqn)
                if body is not None:
                    if prims.is_remat(eqn):   # read behind the opt-barrier
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
                    if not private.is_dropped(v):
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
