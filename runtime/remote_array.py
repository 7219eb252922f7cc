"""Handles of step results kept on the Ray actors (``runtime.ray_executor``), and ``fetch``,
which brings their values to the driver (exposed as ``rhino.fetch``). No Ray import here:
the executor that made a handle does the fetching.
"""

from __future__ import annotations

from typing import Any

import numpy as np

class RemoteArray:
    """A step result kept on the Ray actors of one stage (``RayExecutor``, which makes it
    and answers its ``fetch``).

    ``np.asarray(x)``, ``x.fetch()`` or ``rhino.fetch(tree)`` bring its value to the driver;
    passed to the same step again it stays where it is. The actors keep the value until
    this handle is dropped (garbage-collected) or the step is closed.

    Attributes:
        shape, dtype, weak_type: the value's (weakly typed where the step's result is, so
            that passed back it has the signature the step was planned for); stage: the
            stage holding it; step: the executor step that produced it.
    """

    __slots__ = ("executor", "stage", "ref", "step", "shape", "dtype", "weak_type")
    rhino_remote = True     # how rhino.step_arguments recognises one without importing this

    def __init__(self, executor: Any, stage: int, ref: int, step: int,
                 shape: tuple[int, ...], dtype: Any, weak_type: bool = False):
        self.executor, self.stage, self.ref, self.step = executor, stage, ref, step
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.weak_type = bool(weak_type)   # as the step's result is (a Python-number state)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

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
        return (f"RemoteArray(shape={self.shape}, dtype={self.dtype.name}, stage "
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
