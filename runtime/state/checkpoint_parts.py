"""The pieces of a checkpoint that are not one orbax save: what Ray stage actors write
(``write_part``: a stage's ``RemoteArray`` leaves, each host its own shards), reading such a
part back on the driver (``read_part``), and the first format of rhino checkpoints
(``rhino-checkpoint/1``: a ``rhino.json`` manifest and one part per stage), still read by
``rhino.restore_checkpoint`` (``restore_v1``).

A part is a directory in one of three forms:

    shards-p<process>.npz   a stage over several processes of a job of more: each process's
                            shards of replica 0, their bytes and where each goes (``__index__``)
    arrays.npz              a stage of one process in a job of several: its arrays' bytes
    an orbax checkpoint     the writers are the whole ``jax.distributed`` job (SPMD)

Only ``rhino.errors`` and ``runtime/state`` modules are imported here.
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

FORMAT_V1 = "rhino-checkpoint/1"
MANIFEST_V1 = "rhino.json"
HOST_PART = "arrays.npz"   # a part written by one process of a job of several
SHARDS_PART = "shards-p{}.npz"   # one process's shards of a part of several processes


class CheckpointError(RhinoError):
    """A checkpoint could not be written or read (the message says which file or leaf)."""


def orbax():
    """``orbax.checkpoint``, or the error naming the extra that brings it."""
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
        # a stage on processes 2 and 3 of 4 got neither). Shapes and dtypes are known to
        # the driver, which reads the part (``read_part``).
        os.makedirs(directory, exist_ok=True)
        if all(getattr(x, "is_fully_addressable", True) for x in values.values()):
            np.savez(os.path.join(directory, HOST_PART),
                     **{n: _bytes(x) for n, x in values.items()})
        else:
            write_shards(directory, values, min(processes))
        return
    ocp = orbax()
    ck = ocp.StandardCheckpointer()
    try:
        ck.save(directory, values)
        ck.wait_until_finished()
    finally:
        ck.close()


def _bytes(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def write_shards(directory: str, values: dict[str, Any], first: int = 0) -> None:
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


def read_shards(files: Sequence[str], abstract: dict[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of a part written as shards (``write_shards``), whole, on the host.

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


def read_part(directory: str, abstract: dict[str, Any]) -> dict[str, np.ndarray]:
    """The arrays ``abstract`` (name -> anything with ``shape`` and ``dtype``) of the part
    at ``directory`` (any of its three forms), whole, as numpy arrays in this process.

    Raises:
        CheckpointError: ``directory`` holds no part, or a leaf is missing from it or does
            not cover its shape (named).
    """
    files = sorted(glob.glob(os.path.join(directory, SHARDS_PART.format("*"))))
    if files:
        return read_shards(files, abstract)
    host = os.path.join(directory, HOST_PART)
    if os.path.exists(host):
        out = {}
        with np.load(host) as data:
            for name, a in abstract.items():
                if name not in data.files:
                    raise CheckpointError(f"restore_checkpoint: {host}: expected an array "
                                          f"{name!r}, found {sorted(data.files)}")
                out[name] = data[name].view(a.dtype).reshape(a.shape)
        return out
    if not os.path.exists(os.path.join(directory, "_METADATA")):
        found = sorted(os.listdir(directory)) if os.path.isdir(directory) else "nothing"
        raise CheckpointError(f"restore_checkpoint: {directory}: expected a checkpoint part "
                              f"({SHARDS_PART.format('<process>')}, {HOST_PART} or an orbax "
                              f"checkpoint), found {found}")
    ocp = orbax()
    ck = ocp.PyTreeCheckpointer()
    try:
        restore = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in abstract}
        got = ck.restore(directory, args=ocp.args.PyTreeRestore(restore_args=restore))
    except Exception as e:
        raise CheckpointError(f"restore_checkpoint: reading {directory}: "
                              f"{type(e).__name__}: {e}") from e
    finally:
        ck.close()
    return {n: np.asarray(got[n]) for n in abstract}


def read_manifest(path: str) -> dict:
    """The manifest of a ``rhino-checkpoint/1`` directory.

    Raises:
        CheckpointError: no manifest, or one of another format.
    """
    file = os.path.join(os.path.abspath(path), MANIFEST_V1)
    if not os.path.exists(file):
        raise CheckpointError(f"restore_checkpoint: expected {file} (a finished rhino "
                              f"checkpoint), found none")
    with open(file) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT_V1:
        raise CheckpointError(f"restore_checkpoint: {file}: expected format {FORMAT_V1!r}, "
                              f"found {manifest.get('format')!r}")
    return manifest


def targets(shardings: Any, count: int) -> list:
    """One sharding per leaf: ``shardings`` None (this process's first device), one
    ``Sharding`` for all, or a tree of them (its leaves in the result's leaf order).

    Raises:
        CheckpointError: a tree of another number of shardings.
    """
    import jax

    if shardings is None:
        return [jax.sharding.SingleDeviceSharding(jax.local_devices()[0])] * count
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * count
    found = jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    if len(found) != count:
        raise CheckpointError(f"restore_checkpoint: shardings: expected {count} (one per "
                              f"leaf), found {len(found)}")
    return found


def restore_v1(path: str, like: Any = None, shardings: Any = None) -> Any:
    """A ``rhino-checkpoint/1`` checkpoint (leaves ``leaf0..N`` in parts, the tree's
    structure pickled in ``rhino.json``) as jax arrays: ``restore_checkpoint`` for it.

    Raises:
        CheckpointError: ``like`` differs from it (the first differing leaf named), or a
            part is missing or short.
    """
    import jax

    from rhino.runtime.state.remote_array import named_dtype

    path = os.path.abspath(path)
    leaves = read_manifest(path)["leaves"]
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
        treedef = pickle.loads(base64.b64decode(read_manifest(path)["treedef"]))
    by_part: dict[str, dict[str, Any]] = {}
    for leaf, s in zip(leaves, targets(shardings, len(leaves))):
        by_part.setdefault(leaf["part"], {})[leaf["name"]] = jax.ShapeDtypeStruct(
            tuple(leaf["shape"]), named_dtype(leaf["dtype"]), sharding=s)
    values: dict[str, Any] = {}
    for part, abstract in by_part.items():
        raw = read_part(os.path.join(path, part), abstract)
        values.update({n: jax.device_put(raw[n], a.sharding) for n, a in abstract.items()})
    return jax.tree_util.tree_unflatten(treedef, [values[leaf["name"]] for leaf in leaves])
