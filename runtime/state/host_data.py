"""Batches made on the hosts that run the step (``rhino.host_data``), instead of on the
driver.

A step's batch is usually arrays passed by the driver, which the executor moves to the
stages that read it: on Ray, every step's batch crosses from the driver to the actors.
``host_data(fn, like, step=i)`` passes instead a pytree shaped like the batch whose leaves
are placeholders (``HostLeaf``, shape and dtype of ``like``'s leaves): the step is
planned exactly as for arrays of those shapes (the same signature, the same plan), and
each host that reads the batch calls ``fn`` itself for the rows its devices hold::

    def rows(req: rhino.HostRequest) -> dict:          # runs on each host (Ray actor)
        x = my_dataset.tokens(step=req.step, rows=req.rows)   # numpy, len == req.num_rows
        return {"x": x[:, :-1], "y": x[:, 1:]}

    like = {"x": jax.ShapeDtypeStruct((B, T), jnp.int32),
            "y": jax.ShapeDtypeStruct((B, T), jnp.int32)}
    for i in range(steps):
        state, metrics = step(state, rhino.host_data(rows, like, step=i))

``fn(req)`` gets a ``HostRequest``: the stage and host (``host`` of ``hosts``, the host's
index among the stage's hosts, its ``jax.process_index()`` within a stage spanning
hosts), the ``step`` the driver gave, and ``rows``: the ``[start, stop)`` ranges of the
whole batch (``size`` rows) it needs, in order; it returns the batch's pytree (as
``like``) holding those rows only, as numpy, one after the other (``req.take(whole)`` cuts
them out of a whole batch). A stage on one host needs every row; the hosts of a stage whose
mesh spans several each need the rows of their own devices (a row is read by every host
whose devices hold part of it). Each host places what it made on its devices (on a mesh
spanning hosts, each process its own shards), so the driver sends only the request (a few
dozen bytes per leaf, whatever the batch size) and receives only the step's 0-d results
(``RayExecutor.last_sent_bytes`` counts no batch bytes; ``last_control_bytes`` the
requests).

``fn`` is user code run on the hosts: on Ray it is pickled by value with cloudpickle
(``ray.cloudpickle``) and sent to each actor once (on the first step that uses it; the
same function object is not sent again), so it must be picklable, and whatever it closes
over goes with it (keep datasets out of the closure: open them inside ``fn``, e.g. by path,
and cache them in a module global of the worker). The local executor calls ``fn`` on the
driver once per step, for every row (``host=0, hosts=1``), and runs on the result.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class HostRequest:
    """What one host asks ``fn`` for (see the module docstring).

    Attributes:
        stage: the stage; host, hosts: this host's index among the stage's hosts, and how
            many there are; step: the step number given to ``host_data``; rows: the
            ``[start, stop)`` ranges of the whole batch this host needs, in order; size:
            the whole batch's rows.
    """

    stage: int
    host: int
    hosts: int
    step: int
    rows: tuple[tuple[int, int], ...]
    size: int

    @property
    def num_rows(self) -> int:
        """The rows ``fn`` returns per leaf.

        >>> HostRequest(0, 0, 2, 5, ((0, 2), (4, 6)), 8).num_rows
        4
        """
        return sum(b - a for a, b in self.rows)

    def take(self, whole: Any) -> np.ndarray:
        """``self.rows`` of ``whole`` (all ``size`` rows), one range after the other.

        >>> HostRequest(0, 1, 2, 0, ((2, 4),), 4).take(np.arange(4)).tolist()
        [2, 3]
        """
        whole = np.asarray(whole)
        return np.concatenate([whole[a:b] for a, b in self.rows], axis=0)


class HostData:
    """The source of one step's host-made batch: ``fn``, the abstract batch ``like`` (a
    pytree of ``ShapeDtypeStruct``) and the ``step`` (see ``host_data``)."""

    def __init__(self, fn: Callable[[HostRequest], Any], like: Any, step: int):
        import jax

        if not callable(fn):
            raise TypeError(f"host_data: expected a function of a rhino.HostRequest, found "
                            f"{type(fn).__name__}")
        self.fn, self.step = fn, int(step)
        self.avals, self.tree = jax.tree_util.tree_flatten(like)
        for k, a in enumerate(self.avals):
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                raise TypeError(f"host_data: expected ShapeDtypeStructs (or arrays) in "
                                f"every leaf of like, found {type(a).__name__} at leaf {k}")
            if not a.shape:
                raise TypeError(f"host_data: expected leaves with a leading batch dimension, "
                                f"found a 0-d leaf {k} ({a.dtype})")
        self.paths = [jax.tree_util.keystr(p) for p, _ in
                      jax.tree_util.tree_flatten_with_path(like)[0]]

    def maker(self) -> "RowMaker":
        """What a host runs: ``fn`` with the checks of its result (picklable)."""
        return RowMaker(self.fn, self.paths, [(tuple(a.shape), np.dtype(a.dtype).name)
                                              for a in self.avals])

    def rows(self, req: HostRequest) -> list[np.ndarray]:
        """``fn(req)``'s leaves, checked (``RowMaker``)."""
        return self.maker()(req)

    def whole(self) -> list[np.ndarray]:
        """Every row, made here (``host=0, hosts=1``): what the local executor runs on."""
        size = self.avals[0].shape[0]
        return self.rows(HostRequest(0, 0, 1, self.step, ((0, size),), size))


class RowMaker:
    """``fn`` and what its results must be: per leaf its path, the whole batch's shape and
    the dtype. Called with a ``HostRequest``, the leaves of ``fn(req)``, checked (rows,
    trailing shape, dtype; a value of another dtype of the same kind, e.g. int64 for
    int32, is cast).

    Raises:
        ValueError: ``fn``'s result does not fit.
    """

    def __init__(self, fn: Callable[[HostRequest], Any], paths: list[str],
                 leaves: list[tuple[tuple[int, ...], str]]):
        self.fn, self.paths, self.leaves = fn, list(paths), list(leaves)

    def __call__(self, req: HostRequest) -> list[np.ndarray]:
        import jax

        found = jax.tree_util.tree_leaves(self.fn(req))
        where = f"step {req.step}, stage {req.stage} host {req.host} (rows {list(req.rows)})"
        if len(found) != len(self.leaves):
            raise ValueError(f"host_data: fn's result for {where} should have the "
                             f"{len(self.leaves)} leaves of like "
                             f"({', '.join(self.paths)}), found {len(found)}")
        out = []
        for path, (shape, name), x in zip(self.paths, self.leaves, found):
            x = np.asarray(x)
            want = (req.num_rows, *shape[1:])
            dtype = np.dtype(name)
            if x.shape != want or (x.dtype != dtype and x.dtype.kind != dtype.kind):
                raise ValueError(f"host_data: fn's result{path} for {where}: expected "
                                 f"{dtype.name}{list(want)}, found "
                                 f"{x.dtype.name}{list(x.shape)}")
            out.append(x if x.dtype == dtype else x.astype(dtype))
        return out


class HostLeaf:
    """One leaf of a host-made batch: its shape and dtype (the step plans with them) and
    where its value comes from (``source``, leaf ``index``)."""

    __slots__ = ("source", "index", "shape", "dtype")
    rhino_host_data = True    # how rhino.step_arguments recognises one
    weak_type = False

    def __init__(self, source: HostData, index: int):
        self.source, self.index = source, index
        a = source.avals[index]
        self.shape, self.dtype = tuple(a.shape), np.dtype(a.dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __repr__(self) -> str:
        return (f"HostLeaf({self.source.paths[self.index] or 'batch'}: "
                f"{self.dtype.name}{list(self.shape)}, step {self.source.step})")


def host_data(fn: Callable[[HostRequest], Any], like: Any, step: int = 0) -> Any:
    """A batch each host makes itself: ``like``'s pytree with ``HostLeaf`` leaves, passed
    to a ``ParallelStep`` in place of the batch (see the module docstring).

    Args:
        fn: ``fn(HostRequest) -> pytree of numpy`` (as ``like``, the requested rows only);
            run on the hosts (pickled by value with cloudpickle on Ray).
        like: the whole batch's pytree of ``jax.ShapeDtypeStruct`` (or arrays: only their
            shapes and dtypes are read); every leaf has the batch as its first dimension.
        step: passed to ``fn`` as ``HostRequest.step`` (e.g. the training step number, so
            that each step reads its own data).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def rows(req):
        ...     return {"x": np.full((req.num_rows, 3), req.step, np.int32)}
        >>> b = host_data(rows, {"x": jax.ShapeDtypeStruct((4, 3), jnp.int32)}, step=7)
        >>> b["x"]
        HostLeaf(['x']: int32[4, 3], step 7)
        >>> materialize(b)["x"][0].tolist()
        [7, 7, 7]
    """
    source = HostData(fn, like, step)
    import jax

    return jax.tree_util.tree_unflatten(source.tree, [HostLeaf(source, k) for k in
                                                      range(len(source.avals))])


def has_host_data(leaves: Any) -> bool:
    return any(getattr(x, "rhino_host_data", False) for x in leaves)


def materialize(tree: Any) -> Any:
    """``tree`` with every ``HostLeaf`` replaced by its value, made here for every row
    (one call of each source's ``fn``); other leaves as they are."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    made: dict[int, list[np.ndarray]] = {}
    for k, x in enumerate(leaves):
        if getattr(x, "rhino_host_data", False):
            if id(x.source) not in made:
                made[id(x.source)] = x.source.whole()
            leaves[k] = made[id(x.source)][x.index]
    return jax.tree_util.tree_unflatten(treedef, leaves)
