"""Checkpoints of training state as plain orbax checkpoints, keyed by the user's pytree paths.
Exposed as ``rhino.save_checkpoint``, ``rhino.restore_checkpoint`` and
``rhino.CheckpointManager``.

``save_checkpoint(path, tree)`` makes ``path`` an ``orbax.checkpoint.StandardCheckpointer``
checkpoint of ``tree``: its keys are the tree's paths as orbax records them (dict keys, list
indices, NamedTuple and dataclass fields: ``params/blocks/0/qkv``), so that plain orbax
(``ocp.StandardCheckpointer().restore(path, abstract_tree)``) reads it onto one device or any
sharding, without rhino. rhino adds one entry to orbax's own checkpoint metadata
(``custom_metadata["rhino"]``: the format, the tree's structure pickled, which orbax loses
for tuples and NamedTuples, and the leaves' keys), which plain orbax ignores.

``RemoteArray`` leaves (state kept on Ray stage actors) are written where they live: the
actors of each stage write their shards (``checkpoint_parts.write_part``) into a staging
directory; by default the driver assembles each leaf from them and writes it in the one
orbax save. ``assemble=False`` (state larger than the driver's memory) leaves the stages'
shard files in ``rhino_parts/`` inside the checkpoint instead, described by the rhino
metadata: ``restore_checkpoint`` assembles them, plain orbax sees those leaves as None.

Written atomically: everything goes to a temporary sibling ``.<name>.rhino-tmp-<id>`` first,
which is renamed to ``path`` at the end; a failure removes it and leaves ``path`` as it was
(absent, or the old checkpoint that ``overwrite=True`` was replacing), so a retry works.

Layout::

    ckpt/                  an orbax checkpoint (_CHECKPOINT_METADATA, _METADATA, d/, ...)
      rhino_parts/         (assemble=False only) stage0/ ...: shards-p<process>.npz each
                           (a stage of one host: arrays.npz; an SPMD job: an orbax checkpoint)

``restore_checkpoint(path, like=None, shardings=None, step=None)`` reads these, plain orbax
checkpoints (``StandardCheckpointer``, ``PyTreeCheckpointer``, an NNX ``nnx.state``),
Flax's ``flax.training.checkpoints`` directories (``checkpoint_<step>``), an orbax
``CheckpointManager`` directory (the latest step, or ``step``), and the first rhino format
(``rhino-checkpoint/1``, ``rhino.json``). Restoring reads every leaf in this process, onto
one device or onto the shardings given, so a checkpoint of one plan restores into any other.
On a cluster of several nodes the directory must be on storage every node sees (a shared
filesystem; the temporary-and-rename scheme needs a POSIX filesystem).

Example:
    >>> import tempfile, numpy as np, os
    >>> d = os.path.join(tempfile.mkdtemp(), "ck")
    >>> save_checkpoint(d, {"w": np.arange(3.0)})             # doctest: +SKIP
    >>> restore_checkpoint(d)["w"]                             # doctest: +SKIP
    Array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import shutil
import uuid
from typing import Any, Sequence

import numpy as np

from rhino.runtime.state.checkpoint_parts import (MANIFEST_V1, CheckpointError, orbax,
                                                  read_part, read_shards, restore_v1, targets,
                                                  write_part, write_shards)

# write_part: what the Ray actors call (runtime.ray.actor); the shard files' writer and reader
# under the names the tests have used.
__all__ = ["CheckpointError", "CheckpointManager", "restore_checkpoint", "save_checkpoint",
           "write_part", "read_part"]
_write_shards, _read_shards = write_shards, read_shards

FORMAT = "rhino-checkpoint/2"
PARTS = "rhino_parts"          # assemble=False: the stages' shard files, inside the checkpoint
ORBAX_METADATA = "_METADATA"   # orbax's tree metadata: a directory holding it is a checkpoint
STEP_METADATA = "_CHECKPOINT_METADATA"
STEP_NAME = re.compile(r"^(?:[A-Za-z][\w.-]*_)?(\d+)$")   # 5, checkpoint_5 (Flax), step_5


def orbax_key(keypath: Sequence[Any]) -> tuple[str, ...]:
    """The key orbax gives a leaf at ``keypath`` (``jax.tree_util`` key entries): dict keys
    and NamedTuple / dataclass fields by name, sequence entries by index, as text.

    >>> import jax
    >>> [orbax_key(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": [1, 2]})[0]]
    [('a', '0'), ('a', '1')]
    """
    import jax.tree_util as tu

    out = []
    for k in keypath:
        if isinstance(k, tu.SequenceKey):
            out.append(str(k.idx))
        elif isinstance(k, tu.DictKey):
            out.append(str(k.key))
        elif isinstance(k, tu.GetAttrKey):
            out.append(str(k.name))
        elif isinstance(k, tu.FlattenedIndexKey):
            out.append(str(k.key))
        else:
            raise CheckpointError(f"checkpoint: expected dict, sequence or attribute keys in "
                                  f"a tree path, found {type(k).__name__} {k!r}")
    return tuple(out)


def _local(path: str, who: str) -> str:
    """``path`` made absolute.

    Raises:
        CheckpointError: ``path`` is a URL (``gs://...``): temporaries are renamed into
            place, which needs a filesystem.
    """
    if "://" in str(path):
        raise CheckpointError(f"{who}: expected a path on a (shared) filesystem, found the "
                              f"URL {path}; mount it (gcsfuse, ...) and give the mount's path")
    return os.path.abspath(path)


def _show(key: Sequence[str]) -> str:
    return "/".join(key) or "(the root)"


# Writing ------------------------------------------------------------------------------------

def _gather(tree: Any, staging: str, assemble: bool) -> tuple[Any, dict]:
    """The tree orbax saves (the arrays of ``tree``, ``RemoteArray`` leaves assembled from
    the shards their actors write under ``staging``, or None where not ``assemble``) and
    the rhino metadata.

    Raises:
        CheckpointError: a leaf is a PRNG key array or not an array, two leaves have the
            same orbax key, or a stage's part could not be read.
    """
    import jax

    from rhino.runtime.state.remote_array import dtype_name

    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not flat:
        raise CheckpointError(f"save_checkpoint: expected a tree with arrays in it, found "
                              f"none (a {type(tree).__name__} of no leaves)")
    if treedef.num_nodes == 1:
        raise CheckpointError(f"save_checkpoint: expected a tree of arrays (a dict, list, "
                              f"dataclass ...: orbax saves no lone array), found a lone "
                              f"{type(tree).__name__}; save {{'name': value}}")
    keys: list[tuple[str, ...]] = []
    values: list[Any] = []
    remote: dict[tuple[int, int], dict[str, Any]] = {}
    executors: dict[int, Any] = {}
    for k, (keypath, x) in enumerate(flat):
        where = jax.tree_util.keystr(keypath)
        if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            raise CheckpointError(f"save_checkpoint: leaf {where}: expected numeric arrays, "
                                  f"found PRNG keys; save jax.random.key_data(keys) instead")
        keys.append(orbax_key(keypath))
        if getattr(x, "rhino_remote", False):   # a RemoteArray: its actors write it
            executors[id(x.executor)] = x.executor
            remote.setdefault((id(x.executor), x.stage), {})[f"leaf{k}"] = x
            values.append(None)
            continue
        try:
            arr = x if isinstance(x, jax.Array) else np.asarray(x)
        except Exception as e:
            raise CheckpointError(f"save_checkpoint: leaf {where}: expected an array, "
                                  f"found {type(x).__name__}") from e
        if arr.dtype == object:
            raise CheckpointError(f"save_checkpoint: leaf {where}: expected an array, "
                                  f"found {type(x).__name__}")
        values.append(arr)
    seen: dict[tuple[str, ...], int] = {}
    for k, key in enumerate(keys):
        if key in seen:
            first, second = (jax.tree_util.keystr(flat[i][0]) for i in (seen[key], k))
            raise CheckpointError(f"save_checkpoint: leaves {first} and {second}: expected "
                                  f"distinct keys, found both named {_show(key)} by orbax")
        seen[key] = k
    parts: dict[str, list[dict]] = {}
    ex_index = {e: i for i, e in enumerate(executors)}
    for (e, s), leaves in remote.items():
        part = f"stage{s}" if len(executors) == 1 else f"step{ex_index[e]}_stage{s}"
        directory = os.path.join(staging, part)
        executors[e].save_part(directory, s, {n: (x.step, x.ref) for n, x in leaves.items()})
        if assemble:
            got = read_part(directory, {n: jax.ShapeDtypeStruct(x.shape, x.dtype)
                                        for n, x in leaves.items()})
            for n in leaves:
                values[int(n[4:])] = got[n]
            shutil.rmtree(directory, ignore_errors=True)
        else:
            parts[part] = [{"leaf": int(n[4:]), "name": n, "shape": list(x.shape),
                            "dtype": dtype_name(x)} for n, x in leaves.items()]
    _held_by_processes(values, os.path.join(os.path.dirname(staging), "processes"))
    meta = {"format": FORMAT, "keys": [list(k) for k in keys], "parts": parts,
            "treedef": base64.b64encode(pickle.dumps(treedef)).decode()}
    return jax.tree_util.tree_unflatten(treedef, values), meta


def _held_by_processes(values: list, staging: str) -> None:
    """In a job of several processes (``rhino.launch``), the leaves among ``values`` that
    orbax refuses there, each held by one process (a pipeline stage's arrays: all of one
    process's devices, or none of this one's), replaced in place by their whole value:
    every process writes the shards it holds (``write_shards``), then reads everyone's.
    Arrays spanning processes stay for orbax, each process writing its own shards."""
    import jax

    if _processes()[1] == 1:
        return
    held = {f"leaf{k}": x for k, x in enumerate(values)
            if isinstance(x, jax.Array) and (x.is_fully_addressable or
                                             not x.addressable_shards)}
    if not held:
        return
    os.makedirs(staging, exist_ok=True)
    write_shards(staging, {n: x for n, x in held.items() if x.addressable_shards})
    _barrier(f"rhino-save-shards:{staging}")
    got = read_part(staging, {n: jax.ShapeDtypeStruct(x.shape, x.dtype)
                              for n, x in held.items()})
    for n in held:
        values[int(n[4:])] = got[n]


def _orbax_save(directory: str, tree: Any, meta: dict, path: str) -> None:
    """``tree`` as a ``StandardCheckpointer`` checkpoint at the new ``directory``, ``meta``
    in its metadata (``custom_metadata["rhino"]``).

    Raises:
        CheckpointError: orbax failed (its error given), for the checkpoint at ``path``.
    """
    ocp = orbax()
    # StandardCheckpointer's format, written synchronously: no thread of orbax is left
    # writing into the temporary once this returns or raises.
    ck = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
        ck.save(directory, args=ocp.args.StandardSave(tree), custom_metadata={"rhino": meta})
    except Exception as e:
        raise CheckpointError(f"save_checkpoint: writing {path} with orbax: "
                              f"{type(e).__name__}: {e}") from e
    finally:
        ck.close()


def is_checkpoint(path: str) -> bool:
    """Whether directory ``path`` is a checkpoint (an orbax one, a step of an orbax
    ``CheckpointManager``, or a ``rhino-checkpoint/1`` one)."""
    return any(os.path.exists(os.path.join(path, f))
               for f in (ORBAX_METADATA, STEP_METADATA, MANIFEST_V1))


def _processes() -> tuple[int, int]:
    """(this process's index, the number of processes) of the ``jax.distributed`` job."""
    import jax

    return jax.process_index(), jax.process_count()


BARRIER_TIMEOUT_S = 600.0
"""Seconds a process of a job waits for the others at a checkpoint's barrier."""

_barriers = iter(range(1, 1 << 62))


def _barrier(tag: str) -> None:
    """Every process of a ``jax.distributed`` job of several reaches ``tag`` (the job's
    coordination service: no collective, so a job without cross-process collectives too).

    Raises:
        CheckpointError: a process did not arrive within ``BARRIER_TIMEOUT_S``.
    """
    if _processes()[1] == 1:
        return
    from rhino.jaxpr.private import distributed_kv_client

    name = f"{tag}#{next(_barriers)}"     # every process counts its barriers alike
    try:
        distributed_kv_client().wait_at_barrier(name, int(BARRIER_TIMEOUT_S * 1000))
    except Exception as e:  # noqa: BLE001 - jax's runtime error, not a public type
        raise CheckpointError(f"checkpoint: expected every process of the job at {tag} "
                              f"within {BARRIER_TIMEOUT_S:g} s, found {type(e).__name__}: "
                              f"{e}") from e


def save_checkpoint(path: str, tree: Any, *, overwrite: bool = False,
                    assemble: bool = True) -> str:
    """Write ``tree`` (arrays, ``RemoteArray`` handles of a Ray step, numbers) as an orbax
    checkpoint at ``path``; returns its absolute path.

    The checkpoint is written to a temporary sibling of ``path`` and renamed into place when
    complete; on any failure the temporary is removed and ``path`` is as it was. In a
    ``jax.distributed`` job every process calls this (orbax writes each one's shards).

    Args:
        path: the checkpoint directory.
        tree: the state: any pytree of arrays. PRNG key arrays are refused (save
            ``jax.random.key_data(keys)``).
        overwrite: replace a checkpoint already at ``path`` (the old one stays intact until
            the new one is complete). False: an existing ``path`` is an error.
        assemble: ``RemoteArray`` leaves are assembled on this process from the shards the
            actors write and saved with the rest (a plain orbax checkpoint). False: for
            state larger than this process's memory, the stages' shard files stay in
            ``rhino_parts/`` inside the checkpoint; ``restore_checkpoint`` reads them, plain
            orbax does not (it sees those leaves as None).

    Raises:
        CheckpointError: ``path`` exists and ``overwrite`` is False, or it is not a
            checkpoint (nothing is replaced but a checkpoint), a leaf is not an array or is
            a PRNG key array, or a part failed to write.
    """
    orbax()
    path = _local(path, "save_checkpoint")
    if os.path.lexists(path):
        if not overwrite:
            raise CheckpointError(f"save_checkpoint: expected a new directory, found {path} "
                                  f"already there (nothing overwritten; pass overwrite=True "
                                  f"to replace it)")
        if not (os.path.isdir(path) and is_checkpoint(path)):
            found = (f"a directory of {sorted(os.listdir(path))[:8]}" if os.path.isdir(path)
                     else "a file")
            raise CheckpointError(f"save_checkpoint: overwrite=True: expected a checkpoint "
                                  f"at {path} to replace, found {found} (not replaced)")
    parent, name = os.path.split(path)
    me = _processes()[0]
    tmp = _temporary(parent, name)
    try:
        saved, meta = _gather(tree, os.path.join(tmp, "staging"), assemble)
        new = os.path.join(tmp, "checkpoint")
        _orbax_save(new, saved, meta, path)
        if me == 0:
            if meta["parts"]:
                os.rename(os.path.join(tmp, "staging"), os.path.join(new, PARTS))
            _replace(new, path, os.path.join(tmp, "replaced"))
        _barrier(f"rhino-save-done:{path}")
    finally:
        if me == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _temporary(parent: str, name: str) -> str:
    """A new temporary directory beside ``parent/name``: a fresh name in one process; in a
    job of several, one name every process agrees on (made by process 0, the others
    waiting for it), so that they write into the same one."""
    me, count = _processes()
    # The processes of a job write into one temporary: its name must not depend on them.
    tmp = os.path.join(parent, f".{name}.rhino-tmp-" +
                       (uuid.uuid4().hex[:12] if count == 1 else "job"))
    if me == 0:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)   # a job's earlier failed attempt
        os.mkdir(tmp)
    _barrier(f"rhino-temporary:{tmp}")
    return tmp


def _replace(new: str, path: str, aside: str) -> None:
    """Rename directory ``new`` to ``path``; what was at ``path`` goes to ``aside`` first,
    and back if the rename fails."""
    moved = False
    if os.path.lexists(path):
        os.rename(path, aside)
        moved = True
    try:
        os.rename(new, path)
    except BaseException:
        if moved:
            os.rename(aside, path)
        raise


# Reading ------------------------------------------------------------------------------------

def locate(path: str, step: int | None = None) -> tuple[str, str, str | None]:
    """What ``path`` is: ``("v1", path, None)`` a ``rhino-checkpoint/1`` checkpoint, or
    ``("orbax", item, step_dir)`` an orbax checkpoint's tree directory (``step_dir``: the
    step directory of a ``CheckpointManager`` holding it, if any). A directory of numbered
    steps gives its latest step (or ``step``).

    Raises:
        CheckpointError: ``path`` is none of these (what was expected and found), or
            ``step`` is not one of its steps.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"restore_checkpoint: expected a checkpoint directory at "
                              f"{path}, found {'a file' if os.path.exists(path) else 'nothing'}")
    if os.path.exists(os.path.join(path, MANIFEST_V1)):
        return _no_step("v1", path, None, step)
    if os.path.exists(os.path.join(path, ORBAX_METADATA)):
        return _no_step("orbax", path, None, step)
    entries = sorted(os.listdir(path))
    items = [e for e in entries if os.path.exists(os.path.join(path, e, ORBAX_METADATA))]
    if items and os.path.exists(os.path.join(path, STEP_METADATA)):
        # A step of a CheckpointManager: its items, "default" when saved with one.
        if len(items) > 1 and "default" not in items:
            raise CheckpointError(f"restore_checkpoint: {path}: expected one item (or "
                                  f"'default') in this step, found {items}")
        item = "default" if "default" in items else items[0]
        return _no_step("orbax", os.path.join(path, item), path, step)
    steps: dict[int, str] = {}
    for e in entries:
        m = STEP_NAME.match(e)
        if m and os.path.isdir(os.path.join(path, e)) and is_checkpoint(os.path.join(path, e)):
            steps.setdefault(int(m.group(1)), e)
    if steps:
        chosen = max(steps) if step is None else int(step)
        if chosen not in steps:
            raise CheckpointError(f"restore_checkpoint: {path}: expected step {chosen}, "
                                  f"found steps {sorted(steps)}")
        return locate(os.path.join(path, steps[chosen]))
    raise CheckpointError(f"restore_checkpoint: {path}: expected a checkpoint: an orbax "
                          f"checkpoint directory (with {ORBAX_METADATA}), a directory of "
                          f"numbered steps (an orbax CheckpointManager's, or Flax's "
                          f"checkpoint_<step>), or a rhino checkpoint ({MANIFEST_V1}); found "
                          f"{entries[:12] or 'an empty directory'}")


def _no_step(kind: str, item: str, step_dir: str | None,
             step: int | None) -> tuple[str, str, str | None]:
    if step is not None:
        raise CheckpointError(f"restore_checkpoint: step={step}: expected a directory of "
                              f"numbered steps, found the single checkpoint {item}")
    return kind, item, step_dir


def read_rhino_metadata(*directories: str | None) -> dict | None:
    """rhino's entry in the orbax checkpoint metadata of the first of ``directories`` that
    has one (``custom_metadata["rhino"]`` of ``_CHECKPOINT_METADATA``); None if none."""
    for d in directories:
        file = os.path.join(d, STEP_METADATA) if d else None
        if file and os.path.exists(file):
            try:
                with open(file) as f:
                    meta = (json.load(f).get("custom_metadata") or {}).get("rhino")
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict) and meta.get("format") == FORMAT:
                return meta
    return None


def _saved_leaves(item: str, meta: dict | None) -> tuple[Any, dict]:
    """(orbax's metadata tree of checkpoint ``item``, key -> (shape, dtype) of every saved
    leaf, the ``rhino_parts`` ones included)."""
    import jax
    from etils import epath

    from rhino.runtime.state.remote_array import named_dtype

    ocp = orbax()
    handler = ocp.StandardCheckpointHandler()
    try:
        tree = handler.metadata(epath.Path(item)).tree
    except Exception as e:
        raise CheckpointError(f"restore_checkpoint: reading {item}: expected orbax's "
                              f"metadata of a tree, found {type(e).__name__}: {e}") from e
    finally:
        handler.close()
    saved = {}
    for keypath, m in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not (hasattr(m, "shape") and hasattr(m, "dtype")):
            raise CheckpointError(f"restore_checkpoint: {item}: leaf "
                                  f"{_show(orbax_key(keypath))}: expected an array, found "
                                  f"{type(m).__name__}")
        saved[orbax_key(keypath)] = (tuple(m.shape), np.dtype(m.dtype))
    for part in (meta or {}).get("parts", {}).values():
        for leaf in part:
            saved[tuple(meta["keys"][leaf["leaf"]])] = (tuple(leaf["shape"]),
                                                        named_dtype(leaf["dtype"]))
    return tree, saved


def _canonical(dtype: Any) -> np.dtype:
    import jax

    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _structure(like: Any, meta: dict | None, tree: Any,
               saved: dict) -> tuple[Any, list[tuple[str, ...]]]:
    """(the treedef of the result, the saved key of each of its leaves): ``like``'s
    (checked against the checkpoint), else the saved structure (rhino's metadata), else
    orbax's tree of dicts and lists.

    Raises:
        CheckpointError: ``like`` differs from the checkpoint: the first leaf that is not
            saved, saved with another shape or dtype, or saved but not in ``like``.
    """
    import jax

    if like is not None:
        flat, treedef = jax.tree_util.tree_flatten_with_path(like)
        keys = [orbax_key(p) for p, _ in flat]
        for (keypath, x), key in zip(flat, keys):
            where = jax.tree_util.keystr(keypath)
            if key not in saved:
                shown = ", ".join(_show(k) for k in list(saved)[:6])
                more = ", ..." if len(saved) > 6 else ""
                raise CheckpointError(f"restore_checkpoint: leaf {where}: expected it in the "
                                      f"checkpoint as {_show(key)}, found no such leaf "
                                      f"(leaves saved as {shown}{more})")
            dtype = getattr(x, "dtype", None)
            dtype = jax.numpy.result_type(x) if dtype is None else dtype
            got = (tuple(np.shape(x)), _canonical(dtype))
            want = (saved[key][0], _canonical(saved[key][1]))
            if got != want:
                raise CheckpointError(f"restore_checkpoint: leaf {where}: saved as {want[0]} "
                                      f"{want[1].name} ({_show(key)}), found {got[0]} "
                                      f"{got[1].name}")
        extra = [k for k in saved if k not in set(keys)]
        if extra:
            raise CheckpointError(f"restore_checkpoint: expected a tree of {len(saved)} "
                                  f"leaves (as saved), found {len(keys)}: saved as "
                                  f"{_show(extra[0])} but not in like")
        return treedef, keys
    if meta is not None:
        try:
            return pickle.loads(base64.b64decode(meta["treedef"])), \
                [tuple(k) for k in meta["keys"]]
        except Exception:   # a class of the saved tree is gone: nested dicts
            pass
    if meta is not None and meta.get("parts"):   # orbax's tree lacks these leaves
        tree = {} if all(meta["keys"]) else 0   # () : the tree is one leaf
        for key in filter(None, meta["keys"]):
            node = tree
            for k in key[:-1]:
                node = node.setdefault(k, {})
            node[key[-1]] = 0
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return treedef, [orbax_key(p) for p, _ in flat]


def restore_checkpoint(path: str, like: Any = None, shardings: Any = None, *,
                       step: int | None = None) -> Any:
    """The tree saved at ``path``, as jax arrays.

    Reads rhino's checkpoints (this format and ``rhino-checkpoint/1``), plain orbax ones
    (``StandardCheckpointer``, ``PyTreeCheckpointer``, an NNX ``nnx.state``), Flax's
    ``flax.training.checkpoints`` directories and orbax ``CheckpointManager`` directories.
    The tree's structure comes from ``like``, else from rhino's metadata (this unpickles
    it: restore only checkpoints you trust without ``like``), else it is orbax's (dicts and
    lists).

    Args:
        path: a checkpoint directory, or a directory of numbered steps (an orbax
            ``CheckpointManager``'s, or Flax's ``checkpoint_<step>``).
        like: a tree of the same structure (arrays or ``ShapeDtypeStruct``s, an NNX abstract
            state), checked leaf by leaf (by path) against the checkpoint; the result has
            its structure. None: the structure saved with it.
        shardings: a tree of shardings (or one for every leaf) to read onto; None: this
            process's first device.
        step: with a directory of steps, which one (default: the latest).

    Raises:
        CheckpointError: no checkpoint at ``path`` (what was expected and found), no such
            ``step``, or ``like`` differs from it (the first differing leaf named).
    """
    import jax
    from etils import epath

    ocp = orbax()
    path = _local(path, "restore_checkpoint")
    kind, item, step_dir = locate(path, step)
    if kind == "v1":
        return restore_v1(item, like, shardings)
    meta = read_rhino_metadata(item, step_dir)
    tree, saved = _saved_leaves(item, meta)
    treedef, keys = _structure(like, meta, tree, saved)
    where = dict(zip(keys, targets(shardings, len(keys))))
    values: dict[tuple[str, ...], Any] = {}
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if flat:
        leaves = [jax.ShapeDtypeStruct(m.shape, _canonical(m.dtype),
                                       sharding=where[orbax_key(p)]) for p, m in flat]
        abstract = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)
        handler = ocp.StandardCheckpointHandler()
        try:
            got = handler.restore(epath.Path(item), args=ocp.args.StandardRestore(abstract))
        except Exception as e:
            raise CheckpointError(f"restore_checkpoint: reading {item}: "
                                  f"{type(e).__name__}: {e}") from e
        finally:
            handler.close()
        values.update((orbax_key(p), x) for p, x in jax.tree_util.tree_flatten_with_path(got)[0])
    for part, leaves in (meta or {}).get("parts", {}).items():
        keyed = {leaf["name"]: tuple(meta["keys"][leaf["leaf"]]) for leaf in leaves}
        raw = read_part(os.path.join(item, PARTS, part),
                        {n: jax.ShapeDtypeStruct(*saved[k]) for n, k in keyed.items()})
        values.update((k, jax.device_put(raw[n], where[k])) for n, k in keyed.items())
    return jax.tree_util.tree_unflatten(treedef, [values[k] for k in keys])


# Steps --------------------------------------------------------------------------------------

class CheckpointManager:
    """Numbered checkpoints in one directory, the newest ``max_to_keep`` kept: an
    ``orbax.checkpoint.CheckpointManager`` (its layout, ``<directory>/<step>/default``, so
    that plain orbax's ``CheckpointManager(directory)`` reads it), saving rhino trees
    (``RemoteArray`` leaves assembled on this process first, as ``save_checkpoint`` does).

    Example:
        >>> with CheckpointManager("ckpts", max_to_keep=2) as mgr:     # doctest: +SKIP
        ...     mgr.save(step, (params, opt))
        ...     params, opt = mgr.restore(like=(params, opt))

    Args:
        directory: the directory of steps (created if missing).
        max_to_keep: how many of the newest steps stay; None: all.
    """

    def __init__(self, directory: str, max_to_keep: int | None = None):
        ocp = orbax()
        self.directory = _local(directory, "CheckpointManager")
        self.max_to_keep = max_to_keep
        self._ocp = ocp
        self._mgr = ocp.CheckpointManager(self.directory, options=self._options())

    def _options(self) -> Any:
        return self._ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep, create=True,
                                                  enable_async_checkpointing=False)

    def all_steps(self) -> list[int]:
        """The steps saved, oldest first."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """The newest step saved; None when there is none."""
        return self._mgr.latest_step()

    def save(self, step: int, tree: Any, *, overwrite: bool = False) -> str:
        """Save ``tree`` as step ``step``; returns the step's directory. Older steps beyond
        ``max_to_keep`` are removed.

        Args:
            step: a step after the latest saved, or (``overwrite``) one already saved.
            tree: as for ``save_checkpoint``.
            overwrite: replace step ``step`` if saved (the old one stays intact until the
                new one is complete).

        Raises:
            CheckpointError: ``step`` is saved already and ``overwrite`` is False, it is
                before the latest step, or writing failed.
        """
        step = int(step)
        steps = self.all_steps()
        if step in steps and not overwrite:
            raise CheckpointError(f"CheckpointManager.save: {self.directory}: expected a new "
                                  f"step, found step {step} saved (pass overwrite=True to "
                                  f"replace it)")
        if step not in steps and steps and step < steps[-1]:
            raise CheckpointError(f"CheckpointManager.save: {self.directory}: expected a step "
                                  f"after the latest ({steps[-1]}), found {step}")
        parent, name = os.path.split(self.directory)
        tmp = _temporary(parent, name)
        try:
            saved, meta = _gather(tree, os.path.join(tmp, "staging"), assemble=True)
            args = self._ocp.args.StandardSave(saved)
            if step in steps:   # written by a manager of its own, then renamed into place
                scratch = os.path.join(tmp, "steps")
                with self._ocp.CheckpointManager(scratch, options=self._options()) as other:
                    self._write(other, step, args, meta)
                (written,) = [e for e in os.listdir(scratch) if STEP_NAME.match(e)]
                _replace(os.path.join(scratch, written), os.path.join(self.directory, written),
                         os.path.join(tmp, "replaced"))
                self._mgr.reload()
            else:
                self._write(self._mgr, step, args, meta)
            _barrier(f"rhino-manager-done:{tmp}")    # nobody reads the temporary now
        finally:
            if _processes()[0] == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        return os.path.join(self.directory, str(step))

    def _write(self, mgr: Any, step: int, args: Any, meta: dict) -> None:
        try:
            done = mgr.save(step, args=args, custom_metadata={"rhino": meta})
            mgr.wait_until_finished()
        except Exception as e:
            raise CheckpointError(f"CheckpointManager.save: writing step {step} in "
                                  f"{self.directory} with orbax: {type(e).__name__}: {e}") from e
        if not done:
            raise CheckpointError(f"CheckpointManager.save: {self.directory}: expected orbax "
                                  f"to save step {step}, found it skipped")

    def restore(self, step: int | None = None, like: Any = None, shardings: Any = None) -> Any:
        """Step ``step`` (default: the latest), as ``restore_checkpoint`` reads it.

        Raises:
            CheckpointError: no step saved, no step ``step``, or ``like`` differs from it.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"CheckpointManager.restore: {self.directory}: "
                                      f"expected a saved step, found none")
        return restore_checkpoint(self.directory, like, shardings, step=step)

    def close(self) -> None:
        """Release orbax's manager (its threads)."""
        self._mgr.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
