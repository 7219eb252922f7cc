"""The driver's side of a Ray step's arguments: per actor, what goes with its ``run_step``
call. Cut from ``runtime/ray/executor.py`` (issue 47): the executor runs steps and handles
their failures; this module decides how each argument reaches each actor.

Per argument leaf a stage reads, one of::

    made on the actor        a rhino.host_data leaf: the source's token, the leaf, the
                             user's step and this host's rows (the fn shipped once)
    kept on the actor        a result this actor kept (a RemoteArray of this stage, or a
                             0-d result handed back last step): its (step, ref)
    pulled from a stage      a RemoteArray another stage keeps (a tied weight): that
                             stage's actors push it at the start of the step
    sent                     anything else: numpy inside the call up to SMALL_ARG_BYTES,
                             else one object-store put shared by every actor reading it
                             (this host's rows only, for a batch split over hosts)

An actor running a device group's stages (``interleaved-1f1b``) gets what any of them
reads, once; what one of its stages kept counts as kept for all of them (one store).
A jax array passed again as the same object reuses its put (jax arrays are immutable).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from rhino.runtime.ray.cluster import import_ray
from rhino.runtime.state.remote_array import PackedKey, RemoteArray, pack_key

SMALL_ARG_BYTES = 256
"""Host values up to this size (scalars: a step counter, a learning rate) go inside the
actor call; larger ones are put in the object store once, shared by every actor reading
them."""


class ActorArguments:
    """What one actor gets for one step (``StepArguments.plan``).

    Attributes:
        kept: argument ref -> (step, ref) of a result the actor keeps; partial: ref -> the
        whole batch's rows, for arguments sent as this host's rows only; pull: ref ->
        (stage, step, ref) of a result another stage sends; refs, values: the arguments
        sent, in order; hosted: ref -> (source token, leaf, user step, rows, batch size)
        of ``host_data`` leaves; ship: source token -> its pickled ``fn`` (first use only).
    """

    __slots__ = ("kept", "partial", "pull", "refs", "values", "hosted", "ship")

    def __init__(self) -> None:
        self.kept: dict[int, tuple[int, int]] = {}
        self.partial: dict[int, int] = {}
        self.pull: dict[int, tuple[int, int, int]] = {}
        self.refs: list[int] = []
        self.values: list[Any] = []
        self.hosted: dict[int, tuple] = {}
        self.ship: dict[int, bytes] = {}


class StepArguments:
    """The arguments of an executor's steps, one step after the other.

    Args:
        executor: the ``RayExecutor`` (its handles are recognised as its own).
        reuse_state: use what an actor kept instead of sending it again.

    Attributes:
        sent_bytes: bytes put or sent inside the calls by the last ``plan``; kept: the
        arguments an actor reused instead.
    """

    def __init__(self, executor: Any, reuse_state: bool = True):
        self.executor, self.reuse_state = executor, reuse_state
        self.sent_bytes = self.kept = 0
        self._puts: dict[tuple, tuple[Any, Any]] = {}     # (id, rows) -> (array, ref)
        # id -> (0-d array, stage, ref, step) of the last step's results sent back whole
        self.returned: dict[int, tuple[Any, int, int, int]] = {}
        # id(fn) -> (fn, token, its cloudpickle, actors that have it) of host_data sources
        self._sources: dict[int, tuple[Any, int, bytes, set[int]]] = {}
        self._tokens = 0

    def plan(self, flat_args: Sequence[Any], owners: Sequence[tuple[int, int]],
             stage_args: Sequence[Sequence[int]], rows_of: Sequence[dict],
             units: Mapping[int, Sequence[int]] | None = None
             ) -> tuple[list[ActorArguments], dict[int, dict[tuple[int, int], set[int]]]]:
        """Per actor (``owners``: its (stage, host)), what goes with its call; and per
        stage, the kept results ((step, ref)) it pushes to the stages reading them.
        ``stage_args``: per stage, the argument refs it reads; ``rows_of``: per actor, the
        batch rows its host needs (``describe()["rows"]``); ``units``: an owner's stage ->
        every stage its actor runs (a device group's; default: that stage alone). A value
        pushed to an actor goes to the first of its stages reading it."""
        ray = import_ray()
        keep: dict[tuple, tuple[Any, Any]] = {}
        self.sent_bytes = self.kept = 0
        # A result one stage kept that another stage reads (a tied weight): the holder
        # sends it to the readers at the start of its step, actor to actor.
        push: dict[int, dict[tuple[int, int], set[int]]] = {}
        out = []
        for n, (s, _) in enumerate(owners):
            stages = tuple((units or {}).get(s, (s,)))
            a = ActorArguments()
            rows = rows_of[n] or {}
            readers: dict[int, int] = {}     # argument ref -> the first stage reading it
            for c in stages:
                for r in stage_args[c]:
                    readers.setdefault(r, c)
            for r, reader in readers.items():
                x = flat_args[r]
                if getattr(x, "rhino_host_data", False):    # made by the actor itself
                    token = self._source(x.source, n, a.ship)
                    size = int(x.shape[0])
                    a.hosted[r] = (token, x.index, x.source.step,
                                   tuple(map(tuple, rows[r])) if r in rows else ((0, size),),
                                   size)
                    continue
                k = self._kept_ref(x, stages)
                if k is not None:
                    a.kept[r] = k
                    self.kept += 1
                    continue
                mine = isinstance(x, RemoteArray) and x.executor is self.executor
                if mine and x.stage not in stages:
                    a.pull[r] = (x.stage, x.step, x.ref)
                    push.setdefault(x.stage, {}).setdefault((x.step, x.ref),
                                                            set()).add(reader)
                    continue
                a.refs.append(r)
                if r in rows and not mine:     # this host's rows of the batch only
                    a.partial[r] = int(np.shape(x)[0])
                    a.values.append(self._put(ray, x, keep, tuple(rows[r])))
                else:
                    a.values.append(self._put(ray, x, keep))
            out.append(a)
        self._forget_unused(out)
        self._puts = keep
        return out, push

    def _forget_unused(self, actors: Sequence[ActorArguments]) -> None:
        """host_data functions this step did not use are forgotten (here and on the
        actors): a function made anew every step is not held forever."""
        used = [{h[0] for h in a.hosted.values()} for a in actors]
        self._sources = {k: v for k, v in self._sources.items()
                         if any(v[1] in u for u in used)}
        for _, token, _, shipped in self._sources.values():
            shipped.intersection_update(n for n, u in enumerate(used) if token in u)

    def _put(self, ray, x: Any, keep: dict, rows: tuple | None = None) -> Any:
        """``x`` (or only its ``rows``, ``[a, b)`` ranges) in the object store, or up to
        ``SMALL_ARG_BYTES`` as numpy to go inside the call; a jax array (immutable) passed
        again as the same object reuses its ``ObjectRef``. ``keep`` collects this step's
        reusable entries. A ``RemoteArray`` is fetched first."""
        import jax

        from rhino.runtime.ray.actor import take_rows

        key = (id(x), rows)
        hit = keep.get(key) or self._puts.get(key)
        if hit is not None and hit[0] is x:
            keep[key] = hit
            if isinstance(hit[1], (np.ndarray, PackedKey)):  # passed in the call again
                self.sent_bytes += getattr(hit[1], "nbytes", 0) or hit[1].data.nbytes
            return hit[1]
        host = pack_key(x.fetch() if isinstance(x, RemoteArray) else x)
        if isinstance(host, PackedKey):          # a typed PRNG key array: its bits
            nbytes = host.data.nbytes
        else:
            host = take_rows(np.asarray(host), rows) if rows is not None else np.asarray(host)
            nbytes = host.nbytes
        self.sent_bytes += nbytes
        # A small value goes inside the call itself (a put is a round trip of its own).
        ref = host if nbytes <= SMALL_ARG_BYTES else ray.put(host)
        if isinstance(x, (jax.Array, RemoteArray)):
            keep[key] = (x, ref)
        return ref

    def _source(self, source: Any, actor: int, ship: dict[int, bytes]) -> int:
        """The token of a ``host_data`` source's ``fn`` (the same function object, the
        same token); its cloudpickle (with the checks of its results, ``RowMaker``) goes
        into ``ship`` the first time ``actor`` needs it."""
        ray = import_ray()
        fn = source.fn
        found = self._sources.get(id(fn))
        if found is None or found[0] is not fn:
            self._tokens += 1
            found = (fn, self._tokens, ray.cloudpickle.dumps(source.maker()), set())
            self._sources[id(fn)] = found   # holds fn: its id is not reused meanwhile
        _, token, blob, shipped = found
        if actor not in shipped:
            ship[token] = blob
            shipped.add(actor)
        return token

    def _kept_ref(self, x: Any, stages: Sequence[int]) -> tuple[int, int] | None:
        """(step, ref) under which the actors running ``stages`` keep ``x``, if they do."""
        if not self.reuse_state:
            return None
        if isinstance(x, RemoteArray):
            return (x.step, x.ref) if x.executor is self.executor and x.stage in stages \
                else None
        back = self.returned.get(id(x))
        if back is not None and back[0] is x and back[1] in stages:
            return (back[3], back[2])
        return None

    def clear(self) -> None:
        """Forget every put and returned value (the executor closed)."""
        self._puts.clear()
        self.returned.clear()


__all__ = ["ActorArguments", "SMALL_ARG_BYTES", "StepArguments"]
