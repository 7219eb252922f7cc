"""Checkpoints of sharded training state with ``orbax-checkpoint``, written where the state
lives: state kept on Ray actors is written by those actors, each host its own shards (the
hosts of an SPMD plan write one orbax checkpoint together; a pipeline stage's hosts, some
of the job's processes, each their shards' bytes: ``write_part``); arrays in this process
are written by this process. Exposed as ``rhino.save_checkpoint`` and ``rhino.restore_checkpoint``.

Layout of a checkpoint directory::

    ckpt/
      rhino.json     format, per leaf: pytree path, shape, dtype, part; the tree's structure.
                     Written last: a directory without it is an unfinished checkpoint.
      local/         orbax checkpoint of the leaves held in this process (if any)
      stage0/        orbax checkpoint written by stage 0's actors (RemoteArray leaves)
      stage1/ ...    (a stage of one process in a job of several: arrays.npz, its bytes;
                     of several processes in a job of more: shards-p<process>.npz each)

Restoring reads every part in this process, onto one device or onto the shardings given,
so a checkpoint of one plan restores into any other (a 2x4 Ray pipeline, 8 local devices,
one device): the values are the same bits. On a cluster of several nodes the directory must
be on storage every node sees (a shared filesystem, or a ``gs://`` path orbax writes to).

Example:
    >>> import tempfile, numpy as np, os
    >>> d = os.path.join(tempfile.mkdtemp(), "ck")
    >>> save_checkpoint(d, {"w": np.arange(3.0)})             # doctest: +SKIP
    >>> restore_checkpoint(d)["w"]                             # doctest: +SKIP
    Array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

import base64
import glob
import json
import os
import pickle
from typing import Any, Sequence

import numpy as np

from rhino.errors import RhinoError

FORMAT = "rhino-checkpoint/1"
MANIFEST = "rhino.json"
HOST_PART = "arrays.npz"   # a part written by one process of a job of several
SHARDS_PART = "shards-p{}.npz"   # one process's shards of a part of several processes


class CheckpointError(RhinoError):
    """A checkpoint could not be written or read (the message says which file or leaf)."""


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise CheckpointError("checkpoints need orbax-checkpoint, an optional dependency: "
                              "pip install 'rhino[checkpoint]' (or orbax-checkpoint)") from e
    return ocp


def write_part(directory: str, values: dict[str, Any],
               processes: Sequence[int] | None = None) -> None:
    """A part of a checkpoint: ``name -> array``, written by every process holding
    shards (each calls it).

    ``processes``: the ``jax.distributed`` processes that write it. All of the job's (the
    default): one orbax checkpoint, orbax waiting for every process of the job. Only some
    of them (one stage of a Ray pipeline, whose actors all join one job): each writes
    bytes instead, a part of one process its arrays (``HOST_PART``), a part of several
    each process its own shards (``SHARDS_PART``; every element once, from the shards of
    replica 0).
    """
    import jax

    if processes is not None and set(processes) != set(range(jax.process_count())):
        # Orbax refuses arrays of one process in a job of several ("host local") and
        # writes numpy arrays from process 0 only; for arrays over some processes of the
        # job it writes the arrays' metadata (.zarray) and merges the processes' files on
        # process 0 of the job only, whatever ``MultiprocessingOptions`` say (orbax 0.12.8:
        # a stage on processes 2 and 3 of 4 got neither). Shapes and dtypes are in the
        # manifest.
        os.makedirs(directory, exist_ok=True)
        if all(getattr(x, "is_fully_addressable", True) for x in values.values()):
            np.savez(os.path.join(directory, HOST_PART),
                     **{n: _bytes(x) for n, x in values.items()})
        else:
            _write_shards(directory, values, min(processes))
        return
    ocp = _orbax()
    ck = ocp.StandardCheckpointer()
    try:
        ck.save(directory, values)
        ck.wait_until_finished()
    finally:
        ck.close()


def _bytes(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def _write_shards(directory: str, values: dict[str, Any], first: int = 0) -> None:
    """This process's shards of replica 0 of every array (``SHARDS_PART``): their bytes,
    and per array which block of it each is (``__index__``, JSON). A host value (the same
    in every process) is written whole by process ``first``."""
    import jax

    arrays: dict[str, np.ndarray] = {}
    index: dict[str, list] = {}
    for n, x in values.items():
        shards = getattr(x, "addressable_shards", None)
        if shards is None:
            shards = [_Whole(x)] if jax.process_index() == first else []
        pieces = index.setdefault(n, [])
        for k, sh in enumerate(shards):
            if sh.replica_id != 0:
                continue
            key = f"{n}.{k}"
            arrays[key] = _bytes(sh.data)
            pieces.append([key, [[sl.indices(d)[0], sl.indices(d)[1]]
                                 for sl, d in zip(sh.index, np.shape(x))]])
    arrays["__index__"] = np.frombuffer(json.dumps(index).encode(), np.uint8)
    np.savez(os.path.join(directory, SHARDS_PART.format(jax.process_index())), **arrays)


class _Whole:
    """A host value as the one shard of itself."""

    def __init__(self, x: Any):
        self.data, self.replica_id = np.asarray(x), 0
        self.index = tuple(slice(None) for _ in np.shape(x))


def _read_shards(files: Sequence[str], abstract: dict[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of a part written as shards (``_write_shards``), whole, on the host.

    Raises:
        CheckpointError: an array's shards do not cover it exactly (a process's file is
            missing), naming the array.
    """
    out = {n: np.zeros(a.shape, a.dtype) for n, a in abstract.items()}
    filled = dict.fromkeys(abstract, 0)
    for file in files:
        with np.load(file) as data:
            index = json.loads(data["__index__"].tobytes())
            for n in abstract:
                for key, bounds in index.get(n, []):
                    block = tuple(slice(a, b) for a, b in bounds)
                    shape = tuple(b - a for a, b in bounds)
                    out[n][block] = data[key].view(out[n].dtype).reshape(shape)
                    filled[n] += int(np.prod(shape))
    short = [n for n in abstract if filled[n] != out[n].size]
    if short:
        n = short[0]
        raise CheckpointError(f"restore_checkpoint: {os.path.dirname(files[0])}: {n}: "
                              f"expected its {out[n].size} elements in the processes' "
                              f"shards, found {filled[n]} ({len(files)} files)")
    return out


def save_checkpoint(path: str, tree: Any) -> str:
    """Write ``tree`` (arrays, ``RemoteArray`` handles of a Ray step, numbers) to the new
    directory ``path``; returns its absolute path.

    Raises:
        CheckpointError: ``path`` exists (nothing is overwritten), a leaf is not an array,
            or a part failed to write.
    """
    import jax

    path = os.path.abspath(path)
    if os.path.exists(path):
        raise CheckpointError(f"save_checkpoint: expected a new directory, found {path} "
                              f"already there (nothing overwritten)")
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    local: dict[str, Any] = {}
    remote: dict[tuple[int, int], dict[str, tuple[int, int]]] = {}
    executors: dict[int, Any] = {}
    leaves = []
    for k, (keypath, x) in enumerate(flat):
        name = f"leaf{k}"
        if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            raise CheckpointError(f"save_checkpoint: leaf {jax.tree_util.keystr(keypath)}: "
                                  f"expected numeric arrays, found PRNG keys; save "
                                  f"jax.random.key_data(keys) instead")
        if getattr(x, "rhino_remote", False):   # a RemoteArray: its actors write it
            key = (id(x.executor), x.stage)
            executors[id(x.executor)] = x.executor
            remote.setdefault(key, {})[name] = (x.step, x.ref)
            shape, dtype = x.shape, x.dtype
        else:
            try:
                arr = x if isinstance(x, jax.Array) else np.asarray(x)
            except Exception as e:
                raise CheckpointError(f"save_checkpoint: leaf {jax.tree_util.keystr(keypath)}: "
                                      f"expected an array, found {type(x).__name__}") from e
            local[name] = arr
            shape, dtype = arr.shape, arr.dtype
        leaves.append({"path": jax.tree_util.keystr(keypath), "shape": list(shape),
                       "dtype": np.dtype(dtype).name, "name": name})
    parts = {}
    ex_index = {e: i for i, e in enumerate(executors)}
    for (e, s), names in remote.items():
        part = f"stage{s}" if len(executors) == 1 else f"step{ex_index[e]}_stage{s}"
        parts.update({n: part for n in names})
        executors[e].save_part(os.path.join(path, part), s, names)
    if local:
        parts.update({n: "local" for n in local})
        write_part(os.path.join(path, "local"), local)
    for leaf in leaves:
        leaf["part"] = parts[leaf["name"]]
    manifest = {"format": FORMAT, "leaves": leaves,
                "treedef": base64.b64encode(pickle.dumps(treedef)).decode()}
    tmp = os.path.join(path, MANIFEST + ".tmp")
    os.makedirs(path, exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(path, MANIFEST))
    return path


def read_manifest(path: str) -> dict:
    file = os.path.join(os.path.abspath(path), MANIFEST)
    if not os.path.exists(file):
        raise CheckpointError(f"restore_checkpoint: expected {file} (a finished rhino "
                              f"checkpoint), found none")
    with open(file) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"restore_checkpoint: {file}: expected format {FORMAT!r}, "
                              f"found {manifest.get('format')!r}")
    return manifest


def restore_checkpoint(path: str, like: Any = None, shardings: Any = None) -> Any:
    """The tree saved at ``path``, as jax arrays.

    Args:
        like: a tree of the same structure (arrays or ``ShapeDtypeStruct``s), checked leaf by
            leaf against the checkpoint; None: the structure saved with it.
        shardings: a tree of shardings (or one for every leaf) to read onto; None: this
            process's first device.

    Raises:
        CheckpointError: no finished checkpoint at ``path``, or ``like`` differs from it
            (the first differing leaf named).
    """
    import jax

    ocp = _orbax()
    path = os.path.abspath(path)
    manifest = read_manifest(path)
    leaves = manifest["leaves"]
    if like is not None:
        flat, treedef = jax.tree_util.tree_flatten_with_path(like)
        if len(flat) != len(leaves):
            raise CheckpointError(f"restore_checkpoint: expected a tree of {len(leaves)} "
                                  f"leaves (as saved), found {len(flat)}")
        for (keypath, x), leaf in zip(flat, leaves):
            got = (tuple(np.shape(x)), np.dtype(jax.numpy.result_type(x)).name)
            want = (tuple(leaf["shape"]), leaf["dtype"])
            if got != want:
                raise CheckpointError(f"restore_checkpoint: leaf "
                                      f"{jax.tree_util.keystr(keypath)}: saved as {want[0]} "
                                      f"{want[1]} ({leaf['path']}), found {got[0]} {got[1]}")
    else:
        treedef = pickle.loads(base64.b64decode(manifest["treedef"]))
    if shardings is None:
        targets = [jax.sharding.SingleDeviceSharding(jax.devices()[0])] * len(leaves)
    elif isinstance(shardings, jax.sharding.Sharding):
        targets = [shardings] * len(leaves)
    else:
        targets = jax.tree_util.tree_leaves(shardings,
                                            is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
        if len(targets) != len(leaves):
            raise CheckpointError(f"restore_checkpoint: shardings: expected {len(leaves)} "
                                  f"(one per leaf), found {len(targets)}")
    by_part: dict[str, dict[str, Any]] = {}
    for leaf, s in zip(leaves, targets):
        by_part.setdefault(leaf["part"], {})[leaf["name"]] = jax.ShapeDtypeStruct(
            tuple(leaf["shape"]), np.dtype(leaf["dtype"]), sharding=s)
    values: dict[str, Any] = {}
    for part, abstract in by_part.items():
        host = os.path.join(path, part, HOST_PART)
        files = sorted(glob.glob(os.path.join(path, part, SHARDS_PART.format("*"))))
        if files:
            for name, raw in _read_shards(files, abstract).items():
                values[name] = jax.device_put(raw, abstract[name].sharding)
            continue
        if os.path.exists(host):
            with np.load(host) as data:
                for name, a in abstract.items():
                    raw = data[name].view(a.dtype).reshape(a.shape)
                    values[name] = jax.device_put(raw, a.sharding)
            continue
        ck = ocp.StandardCheckpointer()
        try:
            values.update(ck.restore(os.path.join(path, part), abstract))
        except Exception as e:
            raise CheckpointError(f"restore_checkpoint: reading {os.path.join(path, part)}: "
                                  f"{type(e).__name__}: {e}") from e
        finally:
            ck.close()
    return jax.tree_util.tree_unflatten(treedef, [values[leaf["name"]] for leaf in leaves])
