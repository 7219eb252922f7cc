"""Handles of step results kept on the Ray actors (``runtime.ray.executor``), and ``fetch``,
which brings their values to the driver (exposed as ``rhino.fetch``); how a value travels
between the driver and the actors (numpy, a typed PRNG key array as a ``PackedKey`` of its
bits: numpy has no key type). No Ray import here: the executor that made a handle does the
fetching.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedKey:
    """A typed PRNG key array on its way between the driver and an actor: its bits and
    its implementation's name."""

    data: np.ndarray
    impl: str


def pack_key(x: Any) -> Any:
    """Typed key arrays as ``PackedKey``, other jax arrays as numpy; the rest unchanged.

    >>> import jax
    >>> packed = pack_key(jax.random.key(3))
    >>> type(packed).__name__, packed.data.dtype.name, packed.data.shape
    ('PackedKey', 'uint32', (2,))
    >>> bool((jax.random.key_data(unpack_key(packed)) == packed.data).all())
    True
    """
    import jax

    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return PackedKey(np.asarray(jax.random.key_data(x)), str(jax.random.key_impl(x)))
        return np.asarray(x)
    return x


def unpack_key(x: Any) -> Any:
    """``pack_key``'s inverse for keys: a ``PackedKey`` as a typed key array again; the rest
    unchanged."""
    import jax

    if isinstance(x, PackedKey):
        return jax.random.wrap_key_data(x.data, impl=x.impl)
    return x


def dtype_name(x: Any) -> str:
    """The dtype of array ``x`` as text that ``named_dtype`` reads back: numpy's name, or
    ``key<IMPL>`` with the full name of a typed PRNG key array's implementation (``str``
    of a key dtype gives a short form that no API reads back).

    >>> dtype_name(np.zeros(2, np.float32))
    'float32'
    """
    import jax

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return f"key<{jax.random.key_impl(x)}>"
    return np.dtype(x.dtype).name


def named_dtype(name: Any) -> Any:
    """``dtype_name``'s inverse (a dtype object is returned as it is): numpy's and
    ml_dtypes' types (``bfloat16``, the float8 types) and typed PRNG keys.

    >>> named_dtype("int32")
    dtype('int32')
    """
    if not isinstance(name, str):
        return name if not isinstance(name, type) else np.dtype(name)
    if name.startswith("key<") and name.endswith(">"):
        import jax

        impl = name[4:-1]
        return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
    try:
        return np.dtype(name)
    except TypeError:   # bfloat16 and the float8 types live in ml_dtypes
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


class RemoteArray:
    """A step result kept on the Ray actors of one stage (``RayExecutor``, which makes it
    and answers its ``fetch``).

    ``np.asarray(x)``, ``x.fetch()`` or ``rhino.fetch(tree)`` bring its value to the driver;
    passed to the same step again it stays where it is. The actors keep the value until
    this handle is dropped (garbage-collected) or the step is closed.

    Attributes:
        shape, dtype, weak_type: the value's, as ``jax.typeof`` of the step's result under
            ``jax.jit`` gives them (``ParallelStep`` sets them from the step's result
            avals: weakly typed where the result is, a typed PRNG key's dtype for keys), so
            that passed back it has the signature the step was planned for; stage: the
            stage holding it; step: the executor step that produced it.
    """

    __slots__ = ("executor", "stage", "ref", "step", "shape", "dtype", "weak_type")
    rhino_remote = True     # how rhino.step_arguments recognises one without importing this

    def __init__(self, executor: Any, stage: int, ref: int, step: int,
                 shape: tuple[int, ...], dtype: Any, weak_type: bool = False):
        self.executor, self.stage, self.ref, self.step = executor, stage, ref, step
        self.shape, self.dtype = tuple(shape), named_dtype(dtype)
        self.weak_type = bool(weak_type)   # as the step's result is (a Python-number state)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * getattr(self.dtype, "itemsize", 0)

    def fetch(self) -> np.ndarray:
        return self.executor.fetch([self])[0]

    def __del__(self) -> None:
        try:
            self.executor.release(self.stage, self.step, self.ref)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.fetch()
        return a if dtype is None else a.astype(dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"RemoteArray(shape={self.shape}, dtype={self.dtype}, stage "
                f"{self.stage}, step {self.step})")


def fetch(tree: Any) -> Any:
    """``tree`` with every ``RemoteArray`` leaf replaced by its value (numpy), one request
    per executor; other leaves as they are.

    >>> fetch({"a": 1.0})
    {'a': 1.0}
    """
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    by_exec: dict[int, list[int]] = {}
    for k, x in enumerate(leaves):
        if isinstance(x, RemoteArray):
            by_exec.setdefault(id(x.executor), []).append(k)
    for ks in by_exec.values():
        got = leaves[ks[0]].executor.fetch([leaves[k] for k in ks])
        for k, v in zip(ks, got):
            leaves[k] = v
    return jax.tree_util.tree_unflatten(treedef, leaves)
