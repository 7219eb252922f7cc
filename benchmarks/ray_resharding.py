"""Cross-mesh resharding on Ray actors: every *host* of a ``ReshardingPlan`` is one actor.

``runtime.transfer.resharding.execute`` moves jax arrays between devices of one process. Here each
simulated host is a Ray actor holding the tiles of its devices (numpy arrays keyed by logical
device id), and the plan's jobs move between actors through the Ray object store::

    driver ── load(run, host, plan, peers, source tiles) ──► one HostActor per host
           ── run(run) on every actor at once ─────────────┐
                                                            ▼
    sending host: for each of its jobs, in the plan's order (the balancer's senders/order)
        slice the unit region from the chosen sender device's tile, then
          broadcast   ray.put ONCE; every receiving host gets the same ObjectRef
          send_recv   ray.put once per destination device (one object each)
          allgather   the slice cut in B parts, one put per part (B devices of the host)
        peer.deliver(run, job, devices, [refs]) per receiving host; wait for every ack
        before the next job (a host's NIC sends one job at a time, as in the simulator)
    receiving host (deliver, on another thread of the threaded actor):
        ray.get the refs (the fetch; bytes counted as cross-host when the putting host is
        another simulated host), fan out to its devices locally (a copy per device)
    run returns when every expected delivery arrived and each destination tile is assembled
           ◄── stats: puts, fetched cross-host / local bytes, start/end clock ──┘
    driver ── tiles(run) ──► the assembled tiles, compared with numpy by ``check_tiles``

All actors live on one machine here, so "cross-host" is counted by the *simulated* host ids
of the putting and the fetching actor, and object-store times say nothing about a network.
A job whose receivers sit on its sender's host is copied inside the actor (no object).

Failures: every ``ray.get`` / wait has a timeout; an error in an actor names the label (e.g.
the benchmark case), the host and the job; the driver then aborts the other actors' waits
(their ``run`` raises at once) and raises ``ReshardingError`` with the first error.

Only ``rhino.runtime`` imports ray, and this module only inside functions.

Example:
    >>> import numpy as np
    >>> from rhino.runtime.transfer.resharding import (DeviceMesh, expected_tiles, plan_resharding)
    >>> a, b = DeviceMesh.grid((2, 2)), DeviceMesh.grid((2, 2), first_device=4, first_host=2)
    >>> plan = plan_resharding((4, 4), 4, a, "S^01R", b, "S^0R")
    >>> data = np.arange(16, dtype=np.float32).reshape(4, 4)
    >>> with HostActors() as hosts:                                  # doctest: +SKIP
    ...     ex = execute_on_actors(plan, expected_tiles(data, a, "S^01R"), hosts)
    ...     check_tiles(ex, expected_tiles(data, b, "S^0R"))
    ...     ex.cross_host_bytes == plan.cross_host_bytes
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from rhino.runtime.transfer.resharding import (Box, ReshardingError, ReshardingPlan,
                                               intersect_boxes, box_slices, split_box, box_volume)

DEFAULT_TIMEOUT_S = 60.0
ACTOR_CONCURRENCY = 16
"""Threads per host actor: its own ``run`` plus concurrent ``deliver`` calls."""
ABORT_GRACE_S = 10.0
"""After a failure, how long the driver waits for the other actors' calls to stop."""


# --------------------------------------------------------------------------- plain data
@dataclasses.dataclass(frozen=True)
class HostStats:
    """What one host actor did in one run.

    Attributes:
        host: the simulated host id.
        jobs_sent: jobs it sent (it was the plan's sender host).
        puts, put_bytes: objects it put in the object store and their bytes.
        fetches: objects it fetched from the store.
        cross_host_bytes: bytes of fetched objects put by another simulated host.
        local_bytes: bytes copied inside the host (fan-out to further devices, local jobs).
        start, end: ``time.time()`` when its ``run`` began and when its last destination
            tile was assembled.
    """

    host: int
    jobs_sent: int
    puts: int
    put_bytes: int
    fetches: int
    cross_host_bytes: int
    local_bytes: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class ActorExecution:
    """What ``execute_on_actors`` did.

    Attributes:
        tiles: destination device -> its assembled tile (numpy), fetched back from the
            receiving actors after the timed phase.
        seconds: wall time of the transfer phase: first actor's ``run`` start to the last
            destination tile assembled (``time.time()`` of the actors; one machine).
        cross_host_bytes: bytes fetched by an actor of another simulated host than the
            putter, summed over the receiving actors.
        local_bytes: bytes copied inside hosts.
        puts: objects put in the store; fetches: objects fetched.
        hosts: per host, its ``HostStats``.
    """

    tiles: Mapping[int, np.ndarray]
    seconds: float
    cross_host_bytes: int
    local_bytes: int
    puts: int
    fetches: int
    hosts: Mapping[int, HostStats]


# --------------------------------------------------------------------------- actor side
class HostActor:
    """One simulated host (wrapped by ``ray.remote`` at run time; threaded).

    State of the current run only: ``load`` replaces it.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._run = -1
        self._aborted: dict[int, str] = {}
        self.host, self.label = -1, "host actor"

    # ---- set-up
    def load(self, run: int, host: int, plan: ReshardingPlan, peers: Mapping[int, Any],
             pieces: Mapping[int, np.ndarray], label: str, timeout: float) -> int:
        """Take this host's source tiles and work out what it sends and receives.

        Returns:
            the number of deliveries this host expects.
        """
        with self._cond:
            self._run, self.host, self.plan, self.peers = run, host, plan, dict(peers)
            self.label, self.timeout = label, timeout
            self.pieces = {int(d): np.asarray(p) for d, p in pieces.items()}
            self.src_box = {d: plan.src_spec.tile(plan.shape, plan.src_mesh, i)
                            for i, d in enumerate(plan.src_mesh.devices)}
            self.dst_box = {d: plan.dst_spec.tile(plan.shape, plan.dst_mesh, i)
                            for i, d in enumerate(plan.dst_mesh.devices)
                            if plan.dst_mesh.hosts[i] == host}
            self.received: dict[int, list[tuple[Box, np.ndarray]]] = {
                d: [] for d in self.dst_box}
            self.expected = {(j, host) for j, devs in enumerate(plan.job_receivers)
                             if any(plan.dst_mesh.host_of(d) == host for d in devs)}
            self.arrived: set[tuple[int, int]] = set()
            self.tiles: dict[int, np.ndarray] = {}
            self.stats = dict(jobs_sent=0, puts=0, put_bytes=0, fetches=0,
                              cross_host_bytes=0, local_bytes=0)
            for r in [r for r in self._aborted if r < run]:
                del self._aborted[r]
            return len(self.expected)

    def abort(self, run: int, why: str) -> None:
        with self._cond:
            self._aborted[run] = why
            self._cond.notify_all()

    def tiles_of(self, run: int) -> dict[int, np.ndarray]:
        self._same_run(run, "tiles")
        return self.tiles

    # ---- the run
    def run(self, run: int) -> HostStats:
        """Send this host's jobs in the plan's order, wait for every expected delivery,
        assemble the destination tiles."""
        self._same_run(run, "run")
        start = time.time()
        plan = self.plan
        for j in plan.assignment.order:
            if plan.assignment.senders[j] == self.host:
                if run in self._aborted:
                    raise ReshardingError(f"{self._where()}: aborted before job {j}: "
                                          f"{self._aborted[run]}")
                self._send(run, j)
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while self.arrived != self.expected:
                if run in self._aborted:
                    raise ReshardingError(f"{self._where()}: aborted: {self._aborted[run]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(j for j, _ in self.expected - self.arrived)
                    raise ReshardingError(f"{self._where()}: expected deliveries for jobs "
                                          f"{missing}, none after {self.timeout:.0f} s")
                self._cond.wait(left)
        for d, box in self.dst_box.items():
            self.tiles[d] = self._assemble(d, box)
        return HostStats(self.host, start=start, end=time.time(), **self.stats)

    def _send(self, run: int, j: int) -> None:
        plan = self.plan
        job, src = plan.jobs[j], plan.sender_devices[j]
        region = plan.tasks[job.unit].region
        where = (f"{self._where()}, job {j} ({plan.strategy}, unit {job.unit}, "
                 f"region {region})")
        piece = self.pieces.get(src)
        if piece is None:
            raise ReshardingError(f"{where}: expected source device {src} to hold a piece, "
                                  f"found pieces for devices {sorted(self.pieces)}")
        box = self.src_box[src]
        if intersect_boxes(box, region) != region or tuple(piece.shape) != tuple(
                hi - lo for lo, hi in box):
            raise ReshardingError(f"{where}: expected source device {src} to hold {box} "
                                  f"covering the region, found a piece of shape "
                                  f"{tuple(piece.shape)}")
        part = np.ascontiguousarray(piece[box_slices(region, box)])
        by_host: dict[int, list[int]] = {}
        for d in plan.job_receivers[j]:
            by_host.setdefault(plan.dst_mesh.host_of(d), []).append(d)
        ray = _ray()
        shared = None   # broadcast: the one object every receiving host fetches
        acks = []
        for h, devs in by_host.items():
            if h == self.host:      # receivers on the sender's host: no object
                self._place(run, j, h, devs, [(region, part)], local=True)
                continue
            if plan.strategy == "broadcast":
                if shared is None:
                    shared = self._put(ray, part)
                boxes, refs = [region], [shared]
            elif plan.strategy == "send_recv":
                boxes = [region] * len(devs)
                refs = [self._put(ray, part) for _ in devs]
            else:
                boxes = split_box(region, len(devs))
                refs = [self._put(ray, np.ascontiguousarray(part[box_slices(b, region)]))
                        for b in boxes]
            acks.append((h, self.peers[h].deliver.remote(run, self.host, j, devs, boxes,
                                                         refs)))
        for h, ack in acks:
            try:
                ray.get(ack, timeout=self.timeout)
            except ray.exceptions.GetTimeoutError:
                raise ReshardingError(f"{where}: host {h} did not take the delivery within "
                                      f"{self.timeout:.0f} s") from None
        self.stats["jobs_sent"] += 1

    def _put(self, ray, arr: np.ndarray) -> Any:
        self.stats["puts"] += 1
        self.stats["put_bytes"] += arr.nbytes
        return ray.put(arr)

    def deliver(self, run: int, src_host: int, j: int, devices: Sequence[int],
                boxes: Sequence[Box], refs: Sequence[Any]) -> int:
        """Fetch a job's objects (``refs`` arrive in a list, so this actor fetches them) and
        fan them out to ``devices``. Returns the bytes fetched."""
        self._same_run(run, f"deliver of job {j}")
        ray = _ray()
        try:
            arrs = ray.get(list(refs), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise ReshardingError(f"{self._where()}, job {j}: fetching {len(refs)} objects "
                                  f"from host {src_host} took over {self.timeout:.0f} s"
                                  ) from None
        nbytes = sum(a.nbytes for a in arrs)
        with self._cond:
            self.stats["fetches"] += len(arrs)
            if src_host != self.host:
                self.stats["cross_host_bytes"] += nbytes
        strategy = self.plan.strategy
        if strategy == "broadcast":        # one object, forwarded to every device here
            got = [(boxes[0], arrs[0])]
        elif strategy == "send_recv":      # one object per device
            for d, b, a in zip(devices, boxes, arrs):
                self._place(run, j, self.host, [d], [(b, a)], local=False, count=False)
            self._arrive(run, j)
            return nbytes
        else:                              # B parts: a local all-gather
            got = list(zip(boxes, arrs))
        self._place(run, j, self.host, devices, got, local=False)
        return nbytes

    def _place(self, run: int, j: int, host: int, devices: Sequence[int],
               parts: Sequence[tuple[Box, np.ndarray]], local: bool, count: bool = True
               ) -> None:
        """Give every device its own copy of ``parts``. A fetched part's first device
        (part ``k`` -> device ``k`` for an all-gather, else the first device) counts as
        the fetch; every other copy is an intra-host copy (``local``: all are)."""
        copied = 0
        with self._cond:
            for k, d in enumerate(devices):
                if d not in self.received:
                    raise ReshardingError(f"{self._where()}, job {j}: expected a destination "
                                          f"device of host {self.host}, found device {d}")
                for i, (b, a) in enumerate(parts):
                    self.received[d].append((b, np.array(a, copy=True)))
                    if local or k != (i if len(parts) > 1 else 0):
                        copied += a.nbytes
            self.stats["local_bytes"] += copied
        if count:
            self._arrive(run, j)

    def _arrive(self, run: int, j: int) -> None:
        with self._cond:
            if (j, self.host) in self.arrived:
                raise ReshardingError(f"{self._where()}, job {j}: delivered twice")
            self.arrived.add((j, self.host))
            self._cond.notify_all()

    def _assemble(self, d: int, tile: Box) -> np.ndarray:
        got = self.received[d]
        if sum(box_volume(b) for b, _ in got) != box_volume(tile) or any(
                intersect_boxes(b, tile) != b for b, _ in got):
            raise ReshardingError(f"{self._where()}: destination device {d}: expected "
                                  f"regions covering {tile}, found {[b for b, _ in got]}")
        if len(got) == 1:
            return got[0][1]
        buf = np.empty(tuple(hi - lo for lo, hi in tile), got[0][1].dtype)
        for b, a in got:
            buf[box_slices(b, tile)] = a
        return buf

    def _same_run(self, run: int, what: str) -> None:
        if run != self._run:
            raise ReshardingError(f"host actor: {what} for run {run}, but this actor is "
                                  f"loaded with run {self._run}")

    def _where(self) -> str:
        return f"{self.label}: host {self.host}"


# --------------------------------------------------------------------------- driver side
def _ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a dependency
        raise ReshardingError("resharding on actors needs ray: pip install 'ray>=2.9'") from e
    return ray


class HostActors:
    """A pool of host actors, reused across runs (starting a Ray worker costs seconds).

    Args:
        num_hosts: actors to start now (more are started when a plan needs them).
        timeout: seconds any one wait may take (creating actors, a fetch, an ack).
        actor_options: extra ``.options(...)``; default ``num_cpus=0`` (the actors mostly
            wait, and a plan may have more hosts than the cluster has CPUs),
            ``max_concurrency=ACTOR_CONCURRENCY``.

    Needs a connected Ray (``rhino.runtime.ray.executor.init``).
    """

    def __init__(self, num_hosts: int = 0, *, timeout: float = DEFAULT_TIMEOUT_S,
                 actor_options: Mapping[str, Any] | None = None):
        ray = _ray()
        if not ray.is_initialized():
            raise ReshardingError("HostActors: expected a connected Ray cluster "
                                  "(rhino.runtime.ray.executor.init), found none")
        self.timeout = timeout
        self._options = {"num_cpus": 0, "max_concurrency": ACTOR_CONCURRENCY,
                         "max_restarts": 0, **(actor_options or {})}
        # This module lives in benchmarks/, which Ray's workers cannot import: ship the
        # actor class by value.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        self._cls = ray.remote(HostActor)
        self.actors: list[Any] = []
        self._runs = itertools.count()
        self.ensure(num_hosts)

    def ensure(self, n: int) -> None:
        """At least ``n`` actors, all answering."""
        ray = _ray()
        new = [self._cls.options(**self._options).remote() for _ in range(n - len(self.actors))]
        if new:
            ready, _ = ray.wait([a.__ray_ready__.remote() for a in new], num_returns=len(new),
                                timeout=self.timeout)
            if len(ready) != len(new):
                for a in new:
                    ray.kill(a)
                raise ReshardingError(f"HostActors: expected {len(new)} new host actors, "
                                      f"{len(ready)} started within {self.timeout:.0f} s")
            ray.get(ready, timeout=self.timeout)
            self.actors += new

    def next_run(self) -> int:
        return next(self._runs)

    def close(self) -> None:
        ray = _ray()
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []

    def __enter__(self) -> "HostActors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_pieces(plan: ReshardingPlan, src_pieces: Mapping[int, Any], label: str) -> None:
    """Every source device has a piece of its tile's shape.

    Raises:
        ReshardingError: naming the label, the host and the jobs that would send from a
            device with a missing or misshapen piece.
    """
    for i, d in enumerate(plan.src_mesh.devices):
        tile = plan.src_spec.tile(plan.shape, plan.src_mesh, i)
        want = tuple(hi - lo for lo, hi in tile)
        jobs = [j for j, s in enumerate(plan.sender_devices) if s == d]
        where = f"{label}: host {plan.src_mesh.hosts[i]}, source device {d} (sends jobs {jobs})"
        if d not in src_pieces:
            raise ReshardingError(f"{where}: expected a piece of shape {want}, found pieces "
                                  f"only for devices {sorted(src_pieces)}")
        got = tuple(np.shape(src_pieces[d]))
        if got != want:
            raise ReshardingError(f"{where}: expected a piece of shape {want}, found {got}")


def execute_on_actors(plan: ReshardingPlan, src_pieces: Mapping[int, Any],
                      actors: HostActors | None = None, *, label: str = "resharding",
                      timeout: float | None = None, validate: bool = True) -> ActorExecution:
    """Run ``plan`` with every host a Ray actor (module docstring).

    Args:
        plan: from ``plan_resharding`` (any strategy).
        src_pieces: source device -> its tile (numpy, e.g. ``expected_tiles(data, ...)``).
        actors: a ``HostActors`` pool to reuse; None: one made (and closed) for this call.
        label: named in every error (e.g. ``"case 3, broadcast"``).
        timeout: seconds any one wait may take (default: the pool's); the whole run may
            take ``2 × timeout``.
        validate: check the pieces on the driver first (``check_pieces``); False leaves
            the check to the sending actors (for tests of the actor-side errors).

    Returns:
        An ``ActorExecution``; check its tiles with ``check_tiles``.

    Raises:
        ReshardingError: a missing or misshapen piece, an error or a timeout on an actor
            (naming label, host and job), a destination tile not exactly covered.
    """
    ray = _ray()
    if validate:
        check_pieces(plan, src_pieces, label)
    own = actors is None
    pool = actors or HostActors(timeout=timeout or DEFAULT_TIMEOUT_S)
    timeout = timeout or pool.timeout
    try:
        hosts = sorted(set(plan.src_mesh.hosts) | set(plan.dst_mesh.hosts))
        pool.ensure(len(hosts))
        handle = dict(zip(hosts, pool.actors))
        run = pool.next_run()
        loads = []
        for h in hosts:
            mine = {d: np.asarray(src_pieces[d]) for d, dh in
                    zip(plan.src_mesh.devices, plan.src_mesh.hosts) if dh == h and d in
                    src_pieces}
            loads.append(handle[h].load.remote(run, h, plan, handle, mine, label, timeout))
        _gather(ray, hosts, loads, handle, run, label, "loading", timeout)
        stats = _gather(ray, hosts, [handle[h].run.remote(run) for h in hosts], handle, run,
                        label, "the run", 2 * timeout)
        receivers = sorted(set(plan.dst_mesh.hosts))
        got = _gather(ray, receivers, [handle[h].tiles_of.remote(run) for h in receivers],
                      handle, run, label, "fetching tiles", timeout)
        tiles = {d: t for part in got for d, t in part.items()}
    finally:
        if own:
            pool.close()
    by_host = dict(zip(hosts, stats))
    return ActorExecution(
        tiles, max(s.end for s in stats) - min(s.start for s in stats),
        sum(s.cross_host_bytes for s in stats), sum(s.local_bytes for s in stats),
        sum(s.puts for s in stats), sum(s.fetches for s in stats), by_host)


def _gather(ray, hosts: Sequence[int], refs: list, handle: Mapping[int, Any], run: int,
            label: str, what: str, timeout: float) -> list:
    """Results of one call per host; on the first failure (or the deadline) the other
    actors are aborted and a ``ReshardingError`` names the host."""
    pending = dict(zip(refs, hosts))
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(left, 0))
        if not done:
            why = (f"{label}: {what} did not finish within {timeout:.0f} s on hosts "
                   f"{sorted(pending.values())}")
            _abort(handle, run, why, list(pending))
            raise ReshardingError(why)
        ref = done[0]
        host = pending.pop(ref)
        try:
            ray.get(ref, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - re-raised with the host named
            why = _why(ray, e)
            if not why.startswith(label):
                why = f"{label}: host {host}: {what} failed: {why}"
            _abort(handle, run, why, list(pending))
            raise ReshardingError(why) from e
    return ray.get(refs, timeout=timeout)


def _abort(handle: Mapping[int, Any], run: int, why: str, pending: Sequence[Any] = ()
           ) -> None:
    """Poison ``run`` on every actor, then collect the calls still pending (they fail at
    once; their errors are the consequence of ``why``, not news)."""
    ray = _ray()
    for a in handle.values():
        a.abort.remote(run, why)
    ray.wait(list(pending), num_returns=len(pending), timeout=ABORT_GRACE_S)
    for ref in pending:
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - see the docstring
            pass


def _why(ray, e: BaseException) -> str:
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    if isinstance(e, ReshardingError):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def check_tiles(ex: ActorExecution, expected: Mapping[int, np.ndarray],
                label: str = "resharding") -> None:
    """Every destination device's tile equals ``expected`` exactly.

    Raises:
        ReshardingError: naming the device, shapes and the first differing element.
    """
    if set(ex.tiles) != set(expected):
        raise ReshardingError(f"{label}: expected tiles for devices {sorted(expected)}, "
                              f"found {sorted(ex.tiles)}")
    for d, want in expected.items():
        got = np.asarray(ex.tiles[d])
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ReshardingError(f"{label}: device {d}: expected a {want.dtype} tile of "
                                  f"shape {want.shape}, found {got.dtype} {got.shape}")
        if not np.array_equal(got, want):
            bad = tuple(int(i) for i in np.argwhere(got != want)[0])
            raise ReshardingError(f"{label}: device {d}: tile differs at {bad}: expected "
                                  f"{want[bad]}, found {got[bad]}")
