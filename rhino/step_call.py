"""A step called as ``jax.jit`` calls it: keyword arguments, and static arguments
(``static_argnums`` / ``static_argnames``: configuration values that are not arrays, whose
every distinct value gets its own plan).

``CallBinder.bind`` turns a call's positional and keyword arguments into what rhino plans
and runs: the dynamic arguments in the step's parameter order, a key naming the call's
shape (which parameters were passed, and the static values), and a function of the dynamic
arguments alone that calls the step with the static and keyword ones put back. That
function carries the names of the parameters it takes (``__signature__``), so plans,
reports and ``batch_args=`` speak of the step's own argument names.

Example:
    >>> def step(params, batch, lr=0.1, *, train=True):
    ...     return params - lr * batch if train else params
    >>> b = CallBinder(step, static_argnames=("train",))
    >>> call = b.bind((1.0,), {"batch": 2.0, "train": False})
    >>> call.args, call.fn(*call.args)
    ((1.0, 2.0), 1.0)
    >>> import inspect; str(inspect.signature(call.fn))
    '(params, batch, /)'
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

from rhino.errors import ArgumentError, OptionsError


@dataclasses.dataclass(frozen=True)
class BoundCall:
    """One call, bound: ``args`` (dynamic, in parameter order), ``key`` (hashable: the
    parameters passed and the static values) and ``fn`` (the step as a function of
    ``args``)."""

    args: tuple
    key: Any
    fn: Callable


class CallBinder:
    """Binds calls of ``fn`` (see the module docstring).

    Raises:
        OptionsError: ``static_argnums`` / ``static_argnames`` naming no parameter of
            ``fn`` (or a step whose parameters Python cannot read).
    """

    def __init__(self, fn: Callable, static_argnums: Sequence[int] = (),
                 static_argnames: Sequence[str] = ()):
        self.fn = fn
        self.name = getattr(fn, "__name__", "step")
        try:
            self.sig: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self.sig = None
        argnums = tuple(static_argnums)
        names = tuple(static_argnames)
        if (argnums or names) and self.sig is None:
            raise OptionsError(f"static_argnums / static_argnames: expected a step whose "
                               f"parameters Python can read, found {self.name!r} without a "
                               f"signature")
        static = set(names)
        if self.sig is not None:
            params = list(self.sig.parameters.values())
            positional = [p.name for p in params
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            for k in argnums:
                if not isinstance(k, int) or isinstance(k, bool) or \
                        not -len(positional) <= k < len(positional):
                    raise OptionsError(f"static_argnums: expected positions of {self.name}'s "
                                       f"parameters {positional}, found {k!r}")
                static.add(positional[k])
            known = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL,
                                                              p.VAR_KEYWORD)}
            unknown = sorted(static - known)
            if unknown:
                raise OptionsError(f"static_argnames: expected names of {self.name}'s "
                                   f"parameters {sorted(known)}, found {unknown}")
        self.static = frozenset(static)
        self._fns: dict[Any, Callable] = {}

    @property
    def needed(self) -> bool:
        """Whether calls must be bound even without keywords (static arguments)."""
        return bool(self.static)

    def bind(self, args: tuple, kwargs: dict) -> BoundCall:
        """The call ``fn(*args, **kwargs)`` as a ``BoundCall``.

        Raises:
            ArgumentError: arguments the step's signature does not take (as Python says),
                or a static value that cannot be hashed.
        """
        if self.sig is None:
            if kwargs:
                raise ArgumentError(f"{self.name}: keyword arguments {sorted(kwargs)} need a "
                                    f"step whose parameters Python can read")
            return BoundCall(tuple(args), ("positional", len(args)), self.fn)
        try:
            bound = self.sig.bind(*args, **kwargs)
        except TypeError as e:
            raise ArgumentError(f"{self.name}(): {e}") from None
        layout, dynamic, static = [], [], []
        for name, value in bound.arguments.items():
            kind = self.sig.parameters[name].kind
            if name in self.static:
                try:
                    hash(value)
                except TypeError:
                    raise ArgumentError(f"{self.name}(): static argument {name!r}: expected a "
                                        f"hashable value (as jax.jit's static arguments), "
                                        f"found {type(value).__name__}") from None
                layout.append((name, "static"))
                static.append(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                layout.append((name, len(value)))
                dynamic.extend(value)
            else:
                layout.append((name, "value"))
                dynamic.append(value)
        key = (tuple(layout), tuple(static))
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self._pure(tuple(layout), tuple(static))
        return BoundCall(tuple(dynamic), key, fn)

    def _pure(self, layout: tuple, static: tuple) -> Callable:
        """The step as a function of the dynamic arguments of ``layout``."""
        sig, fn = self.sig, self.fn

        def pure(*dynamic: Any) -> Any:
            arguments, it, fixed = {}, iter(dynamic), iter(static)
            for name, what in layout:
                if what == "static":
                    arguments[name] = next(fixed)
                elif what == "value":
                    arguments[name] = next(it)
                else:       # *args: as many as the call gave
                    arguments[name] = tuple(next(it) for _ in range(what))
            ba = inspect.BoundArguments(sig, arguments)
            return fn(*ba.args, **ba.kwargs)

        names = []
        for name, what in layout:
            if what == "value":
                names.append(name)
            elif what != "static":
                names.extend(f"{name}_{i}" for i in range(what))
        pure.__signature__ = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])
        pure.__name__ = self.name
        pure.__qualname__ = getattr(fn, "__qualname__", self.name)
        pure.__module__ = getattr(fn, "__module__", None)
        return pure
