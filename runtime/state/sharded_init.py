"""Distributed initialization (Rhino §6.3): parameters are created on their own devices.

Rather than initializing a model on one host and scattering the shards, every parameter is
produced by a program compiled for the devices that own it, with its sharding as the program's
output sharding, so XLA's SPMD partitioner makes each device compute only its own shard::

    init_fn(*args) ──► output tree ──► leaves grouped by device set (one group per pipeline
                                       stage mesh, typically)
        group 0 (devices 0-3): jit(init_fn → its leaves, out_shardings=their shardings)
        group 1 (devices 4-7): jit(init_fn → its leaves, out_shardings=their shardings)
        ...  (leaves of other groups are not outputs, so XLA eliminates their computation)

Numerical equality with a single-device ``jax.jit(init_fn)(*args)`` is automatic: partitioning
never changes a program's values. What the paper calls "skipping to the correct seed state" is
JAX's *partitionable* threefry (``jax_threefry_partitionable``): random bits are a function of
each element's index, so a shard of ``jax.random.normal(key, shape)`` is computed from its own
indices alone. With the flag off, the legacy threefry's bit stream cannot be split and the
partitioner materializes the full random tensor on every device of the stage (checked on
jax 0.10.2: the compiled per-device program then holds the global shape). jax 0.10.2 enables the
flag by default and offers ``jax.threefry_partitionable(bool)`` as a context manager; the
legacy stream gives *different* values, so rhino never flips the flag behind the user's back —
which would make the result differ from the user's own single-device init — and raises
`DistributedInitError` instead when it is off.

Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    >>> init = lambda key: {"w": jax.random.normal(key, (4, 2))}
    >>> params = distributed_init(init, jax.random.key(0), shardings=NamedSharding(mesh, P("x")))
    >>> bool((params["w"] == jax.jit(init)(jax.random.key(0))["w"]).all())
    True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from rhino.errors import RhinoError

PyTree = Any


class DistributedInitError(RhinoError, ValueError):
    """A distributed initialization that cannot be done as asked.

    Attributes:
        where: the output leaf (key path) or setting concerned.
        expected: what was expected.
        found: what was found instead.
    """

    def __init__(self, where: str, expected: str, found: str, detail: str = ""):
        self.where, self.expected, self.found = where, expected, found
        super().__init__(f"distributed_init {where}: expected {expected}, found {found}"
                         + (f" ({detail})" if detail else ""))


@dataclasses.dataclass(frozen=True)
class InitProgram:
    """The initialization program of one device set.

    Attributes:
        device_ids: the devices it runs on, in the order of its shardings' device assignment.
        leaf_indices: positions (in the flattened output tree) of the leaves it creates.
        leaf_paths: their key paths, e.g. ``"['layers'][0]['wqkv']"``.
        fn: the jitted function (outputs: those leaves, with their shardings).
        args: the arguments, already placed (replicated) on ``device_ids``.
    """

    device_ids: tuple[int, ...]
    leaf_indices: tuple[int, ...]
    leaf_paths: tuple[str, ...]
    fn: Callable[..., tuple[jax.Array, ...]]
    args: tuple[Any, ...]

    def lower(self) -> jax.stages.Lowered:
        """``fn.lower(*args)``: inspect ``.compile().as_text()`` for the per-device program."""
        return self.fn.lower(*self.args)

    def run(self) -> tuple[jax.Array, ...]:
        """Runs the program; returns its leaves, each already sharded on its devices."""
        return tuple(self.fn(*self.args))


def distributed_init(init_fn: Callable[..., PyTree], *args: Any, shardings: PyTree) -> PyTree:
    """Runs ``init_fn(*args)`` with every output leaf created directly on its devices.

    Args:
        init_fn: a pure function, e.g. ``init(key)``, returning a pytree of arrays.
        *args: its arguments (pytrees of arrays, e.g. a PRNG key); they are copied, replicated,
            to each device set.
        shardings: a pytree prefix of the output tree whose leaves are
            `jax.sharding.Sharding` objects. Different leaves may live on different meshes
            (e.g. one mesh per pipeline stage); one program is compiled per device set.

    Returns:
        The output tree of ``init_fn``; each leaf is a `jax.Array` with the sharding asked for
        and values bit-identical to ``jax.jit(init_fn)(*args)``.

    Raises:
        DistributedInitError: ``jax_threefry_partitionable`` is off; ``shardings`` does not
            match the output tree or holds a non-`Sharding` leaf; a sharding does not fit its
            leaf (rank, or a dimension not divisible by its mesh axes).

    Example:
        >>> import jax, numpy as np
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
        >>> init = lambda key: {"a": jax.random.normal(key, (2, 3)), "b": jax.numpy.zeros(3)}
        >>> out = distributed_init(init, jax.random.key(0),
        ...                        shardings={"a": NamedSharding(mesh, P("x")),
        ...                                   "b": NamedSharding(mesh, P())})
        >>> out["a"].sharding.spec == P("x"), out["b"].shape
        (True, (3,))
    """
    programs = init_programs(init_fn, *args, shardings=shardings)
    treedef = jax.tree.structure(jax.eval_shape(init_fn, *args))
    leaves: list[Any] = [None] * treedef.num_leaves
    for program in programs:
        for i, value in zip(program.leaf_indices, program.run()):
            leaves[i] = value
    return jax.tree.unflatten(treedef, leaves)


def init_programs(init_fn: Callable[..., PyTree], *args: Any,
                  shardings: PyTree) -> tuple[InitProgram, ...]:
    """The per-device-set programs `distributed_init` runs (for inspection and tests).

    Args, Raises: as `distributed_init`.

    Returns:
        One `InitProgram` per distinct device assignment, in order of first appearance.

    Example:
        >>> import jax, numpy as np
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
        >>> (prog,) = init_programs(lambda k: jax.random.normal(k, (2,)), jax.random.key(0),
        ...                         shardings=NamedSharding(mesh, P()))
        >>> prog.device_ids, prog.leaf_paths
        ((0,), ('',))
    """
    check_threefry_partitionable()
    out = jax.eval_shape(init_fn, *args)
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(out)
    paths = [jax.tree_util.keystr(p) for p, _ in path_leaves]
    avals = [leaf for _, leaf in path_leaves]
    leaf_shardings = _broadcast_prefix(shardings, out)
    for path, aval, sharding in zip(paths, avals, leaf_shardings):
        _check_fits(path, aval, sharding)

    groups: dict[tuple[int, ...], list[int]] = {}
    for i, sharding in enumerate(leaf_shardings):
        groups.setdefault(_device_order(sharding), []).append(i)
    by_id = {d.id: d for s in leaf_shardings for d in s.device_set}
    programs = []
    for order, idx in groups.items():
        replicated = NamedSharding(Mesh(np.array([by_id[i] for i in order]), ("_init",)),
                                   PartitionSpec())
        placed = jax.tree.map(
            lambda a: jax.device_put(a, replicated) if isinstance(a, jax.Array) else a, args)
        fn = jax.jit(_select_outputs(init_fn, tuple(idx)),
                     out_shardings=tuple(leaf_shardings[i] for i in idx))
        programs.append(InitProgram(order, tuple(idx), tuple(paths[i] for i in idx), fn,
                                    tuple(placed)))
    return tuple(programs)


def check_threefry_partitionable() -> None:
    """Raises `DistributedInitError` unless ``jax_threefry_partitionable`` is on.

    Example:
        >>> check_threefry_partitionable()  # on by default in jax >= 0.5
    """
    if not jax.config.jax_threefry_partitionable:
        raise DistributedInitError(
            "setting jax_threefry_partitionable", "True (random bits computable per shard)",
            "False", "the legacy threefry stream cannot be split: every device would compute "
            "the full random tensors. Enable it for both this call and any single-device "
            "reference init, e.g. `with jax.threefry_partitionable(True): ...` or "
            "jax.config.update('jax_threefry_partitionable', True); note that it changes the "
            "random values")


def _select_outputs(init_fn: Callable[..., PyTree], idx: Sequence[int]) -> Callable:
    def selected(*args):
        leaves = jax.tree.leaves(init_fn(*args))
        return tuple(leaves[i] for i in idx)

    selected.__name__ = f"init_{getattr(init_fn, '__name__', 'fn')}"
    return selected


def _broadcast_prefix(shardings: PyTree, out: PyTree) -> list[Sharding]:
    """One sharding per leaf of ``out``: the leaf of ``shardings`` whose key path is a prefix
    of the leaf's path (so a whole sub-tree may share one sharding)."""
    is_leaf = lambda x: x is None or isinstance(x, Sharding)
    by_path: dict[tuple, Sharding] = {}
    for path, s in jax.tree_util.tree_flatten_with_path(shardings, is_leaf=is_leaf)[0]:
        if not isinstance(s, Sharding):
            raise DistributedInitError(f"shardings{jax.tree_util.keystr(path)}",
                                       "a jax.sharding.Sharding",
                                       f"a leaf {s!r} of type {type(s).__name__}")
        by_path[tuple(path)] = s
    used: set[tuple] = set()
    per_leaf = []
    for path, _ in jax.tree_util.tree_flatten_with_path(out)[0]:
        match = next((path[:k] for k in range(len(path) + 1) if path[:k] in by_path), None)
        if match is None:
            raise DistributedInitError(
                f"output {jax.tree_util.keystr(path) or '<root>'}",
                "a sharding for it (shardings must be a pytree prefix of the output)",
                "none", f"shardings entries: {_short(sorted(map(_keystr, by_path)))}")
        used.add(match)
        per_leaf.append(by_path[match])
    unused = sorted(map(jax.tree_util.keystr, by_path.keys() - used))
    if unused:
        raise DistributedInitError(
            f"shardings{unused[0]}", "an entry matching a sub-tree of the output",
            "no such sub-tree", f"output tree: {_short(jax.tree.structure(out))}")
    return per_leaf


def _keystr(path: tuple) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _check_fits(path: str, aval: Any, sharding: Sharding) -> None:
    where = f"output {path or '<root>'} {aval.dtype}{list(aval.shape)}"
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if len(spec) > len(aval.shape):
            raise DistributedInitError(where, f"a PartitionSpec of rank <= {len(aval.shape)}",
                                       f"{sharding.spec} (rank {len(spec)})")
        for dim, (size, entry) in enumerate(zip(aval.shape, spec)):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            factor = math.prod(sharding.mesh.shape[a] for a in axes)
            if size % factor:
                raise DistributedInitError(
                    where, f"dimension {dim} divisible by {factor} (mesh axes {axes})",
                    f"size {size}", f"sharding {sharding.spec} on mesh "
                    f"{dict(sharding.mesh.shape)}")
        return
    try:
        sharding.shard_shape(tuple(aval.shape))
    except ValueError as e:
        raise DistributedInitError(where, f"a shape that {sharding} divides evenly",
                                   f"shape {tuple(aval.shape)}", str(e)) from e


def _device_order(sharding: Sharding) -> tuple[int, ...]:
    """The device ids of ``sharding`` in device-assignment order: one program per order,
    since one jit needs a single device assignment."""
    if isinstance(sharding, NamedSharding):
        return tuple(int(d.id) for d in sharding.mesh.devices.flat)
    if isinstance(sharding, SingleDeviceSharding):
        return tuple(int(d.id) for d in sharding.device_set)
    return tuple(sorted(int(d.id) for d in sharding.device_set))


def _short(x: Any, limit: int = 200) -> str:
    text = str(x)
    return text if len(text) <= limit else text[:limit - 3] + "..."
