"""Flax NNX objects passed straight to a step, updated in place as ``nnx.jit`` updates them.

A step written for ``nnx.jit`` takes modules, optimizers, ``nnx.Rngs`` and metrics and
mutates them (``optimizer.update(model, grads)``, ``metrics.update(...)``, ``rngs()``)
instead of returning new state. Traced as a pure function (``jax.jit`` does so) the
mutations happen on copies made inside the trace and are lost: the step trains nothing
and says nothing. ``ParallelStep`` therefore runs such a step as ``nnx.jit`` does::

    step(model, optimizer, batch)                the user's call
      │ NnxObjects.of: nnx.split of every NNX object in the arguments (together, so that
      │ objects sharing variables stay shared), each object replaced by its nnx.State
      ▼
    pure(model_state, optimizer_state, batch)    what is traced, planned and run:
      │   merges the objects, calls the step, returns (new state of each object at its
      │   argument's position, ..., the step's result)
      ▼
    nnx.update(objects, new states); the step's result returned

The new state of the k-th argument is the k-th result, so rhino pairs the updated
parameters with the parameters they update (``carried_pairs``) and a pipeline keeps them
where they live. Nothing here imports flax: objects are recognised only when the caller
has imported ``flax.nnx`` already.

Example:
    >>> NnxObjects.of((1.0, [2.0])) is None      # no NNX object: the step runs as it is
    True
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable

import jax


def _nnx() -> Any:
    """``flax.nnx`` if the caller has imported it, else None (never imported here)."""
    return sys.modules.get("flax.nnx")


def _is_object(x: Any) -> bool:
    """An NNX object (module, optimizer, rngs, metric): a graph node that is no
    ``nnx.Variable``. The variables of an ``nnx.State`` (a step written for ``jax.jit``,
    returning its new state) are left to be pytree leaves as ``jax.jit`` takes them."""
    nnx = _nnx()
    return nnx is not None and nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class NnxObjects:
    """The NNX objects of one call's arguments, split out.

    Attributes:
        objects: the objects, in argument order (updated in place by ``finish``).
        args: the arguments with each object replaced by its ``nnx.State``.
        static: what the traced program depends on beyond the arrays (the objects'
            graph definition and where they sit in the arguments): part of the cache key.
    """

    objects: tuple
    args: tuple
    static: tuple

    @staticmethod
    def of(args: tuple) -> "NnxObjects | None":
        """The NNX objects anywhere in ``args``, or None if there are none."""
        nnx = _nnx()
        if nnx is None:
            return None
        trees = [jax.tree_util.tree_flatten(a, is_leaf=_is_object) for a in args]
        if not any(_is_object(x) for leaves, _ in trees for x in leaves):
            return None
        objects = tuple(x for leaves, _ in trees for x in leaves if _is_object(x))
        graphdef, state = nnx.split(objects)
        present = tuple(j in state for j in range(len(objects)))
        pieces = iter(state[j] if has else nnx.State({}) for j, has in enumerate(present))
        new_args = tuple(jax.tree_util.tree_unflatten(
            tree, [next(pieces) if _is_object(x) else x for x in leaves])
            for leaves, tree in trees)
        where = tuple((tree, tuple(_is_object(x) for x in leaves)) for leaves, tree in trees)
        return NnxObjects(objects, new_args, (graphdef, where, present))

    def pure(self, fn: Callable) -> Callable:
        """``fn`` as a function of the split arguments returning ``(new state of each
        argument's objects (None where it has none), ..., fn's result)``."""
        graphdef, where, present = self.static

        @functools.wraps(fn)
        def pure(*args: Any) -> Any:
            nnx = _nnx()
            flat = [tree.flatten_up_to(a) for a, (tree, _) in zip(args, where)]
            pieces = [x for leaves, (_, isobj) in zip(flat, where)
                      for x, o in zip(leaves, isobj) if o]
            objects = iter(nnx.merge(graphdef, _state(nnx, pieces, present)))
            user_args = [jax.tree_util.tree_unflatten(
                tree, [next(objects) if o else x for x, o in zip(leaves, isobj)])
                for leaves, (tree, isobj) in zip(flat, where)]
            result = fn(*user_args)
            objs = [x for a, (tree, isobj) in zip(user_args, where)
                    for x, o in zip(tree.flatten_up_to(a), isobj) if o]
            new = nnx.state(tuple(objs))
            news = iter(new[j] if has else nnx.State({}) for j, has in enumerate(present))
            states = [jax.tree_util.tree_unflatten(
                tree, [next(news) if o else None for o in isobj]) if any(isobj) else None
                for tree, isobj in where]
            return (*states, result)

        return pure

    def finish(self, out: Any) -> Any:
        """Apply the new states ``out`` of ``pure`` to the objects; the step's result."""
        nnx = _nnx()
        _, where, present = self.static
        *states, result = out
        pieces = [x for s, (tree, isobj) in zip(states, where) if any(isobj)
                  for x, o in zip(tree.flatten_up_to(s), isobj) if o]
        nnx.update(self.objects, _state(nnx, pieces, present))
        return result


def _state(nnx: Any, pieces: list, present: tuple[bool, ...]) -> Any:
    """The ``nnx.State`` of the objects tuple from each object's piece."""
    return nnx.State({j: p for j, (p, has) in enumerate(zip(pieces, present)) if has})
