"""Host-level model of cross-mesh communication: topology, simulator, sender load balancers.

Follows the cross-mesh resharding paper (``seeds/004``, §3). Hosts are the bottleneck, so
scheduling is done per host, not per device. A ``CommJob`` is one host-level communication: a
data slice held on some *candidate* sender hosts goes to devices on some receiver hosts. A
balancer picks one sender host per job and a global order; the simulator turns that into
start and end times:

* A job whose receivers are all on its sender's host moves over the intra-host links only: it
  takes ``bytes / intra_bandwidth`` and occupies no NIC.
* Otherwise it occupies the sender host's NIC (send side) and the NIC of every *other*
  receiver host (receive side) for its whole duration; a NIC sends one stream at a time and
  receives one stream at a time, independently (full duplex; 004 §3 Eq. 3). Per ``kind``:

  =============  ==================================  ===========================================
  kind           what moves                          duration (t = bytes / slowest NIC involved)
  =============  ==================================  ===========================================
  ``broadcast``  one pipelined ring broadcast to     ``t · (1 + A / K)`` (004 §3.1, A receiving
                 every receiver (one cross-host      hosts, K chunks; ``t`` when K is None), at
                 copy per host, forwarded inside)    least ``bytes / intra_bandwidth`` if a host
                                                     forwards inside
  ``send_recv``  one copy to one receiver device     ``t``
  ``allgather``  1/B of the slice to each of the B   ``t + bytes·(B−1)/B / intra_bandwidth``
                 devices of one host, then an        (send/recv with local all-gather, the
                 intra-host all-gather               paper's "Alpa" baseline)
  =============  ==================================  ===========================================

* Order semantics (004 §3.2, DFS paragraph): the global order induces an order on each host;
  a job starts when every job before it in the order on its sender NIC and on its receiver
  NICs has finished (list scheduling, no overtaking on a NIC).

Balancers: ``naive`` (lowest-indexed holder, natural order), ``greedy`` (load balance only:
longest job first to the least-loaded candidate, Eq. 4), ``randomized_greedy`` (rounds of
non-conflicting jobs covering the most hosts, picked from random orders), ``dfs`` (depth-first
search over order × sender with lower-bound pruning and a time budget), ``best`` (the best of
all four; 004's "ours" is the better of DFS and randomized greedy). ``brute_force`` is for
tests on tiny cases.

Example (two sender hosts 0, 1 holding both slices; receivers on hosts 2 and 3):
    >>> topo = Topology(nic_bandwidth=1.0, intra_bandwidth=100.0)
    >>> jobs = [CommJob("broadcast", 0, (0, 1), (2,), (4,), 1.0),
    ...         CommJob("broadcast", 1, (0, 1), (3,), (4,), 1.0)]
    >>> balance(jobs, topo, "naive").makespan, balance(jobs, topo, "best").makespan
    (2.0, 1.0)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from typing import Sequence

from rhino.errors import RhinoError

JOB_KINDS = ("broadcast", "send_recv", "allgather")
BALANCERS = ("naive", "greedy", "randomized_greedy", "dfs", "best")


class LoadBalanceError(RhinoError, ValueError):
    """Bad jobs, topology or assignment; the message says what was expected and found."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """Bandwidths of a cluster, per host.

    Attributes:
        nic_bandwidth: bytes/s each host's NIC sends (and, separately, receives).
        intra_bandwidth: bytes/s between two devices of one host (NVLink; shared memory).
        host_nic_bandwidth: ``(host, bytes/s)`` overrides of ``nic_bandwidth``.
        pipeline_chunks: K, chunks a broadcast is pipelined in; None = ideal pipelining.

    The default is 004 §5's cluster: 10 Gbit/s between hosts, NVLink (≈100 GB/s) inside.
    """

    nic_bandwidth: float = 1.25e9
    intra_bandwidth: float = 1e11
    host_nic_bandwidth: tuple[tuple[int, float], ...] = ()
    pipeline_chunks: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "host_nic_bandwidth",
                           tuple(sorted((int(h), float(b)) for h, b in self.host_nic_bandwidth)))
        rates = [self.nic_bandwidth, self.intra_bandwidth] + [b for _, b in
                                                              self.host_nic_bandwidth]
        if any(not (r > 0 and math.isfinite(r)) for r in rates):
            raise LoadBalanceError(f"topology: expected positive finite bandwidths, found "
                                   f"{rates}")
        if self.pipeline_chunks is not None and int(self.pipeline_chunks) < 1:
            raise LoadBalanceError(f"topology: expected pipeline_chunks >= 1 or None, found "
                                   f"{self.pipeline_chunks}")

    def nic(self, host: int) -> float:
        """The NIC bandwidth of ``host``."""
        return dict(self.host_nic_bandwidth).get(host, self.nic_bandwidth)


@dataclasses.dataclass(frozen=True)
class CommJob:
    """One host-level communication of a resharding.

    Attributes:
        kind: ``"broadcast"``, ``"send_recv"`` or ``"allgather"`` (see the module table).
        unit: index of the unit communication task it serves.
        candidates: hosts holding the slice, preferred (lowest-indexed holder) first.
        receiver_hosts: hosts with receiving devices.
        receivers_per_host: number of receiving devices on each of ``receiver_hosts``.
        nbytes: bytes of the slice.
    """

    kind: str
    unit: int
    candidates: tuple[int, ...]
    receiver_hosts: tuple[int, ...]
    receivers_per_host: tuple[int, ...]
    nbytes: float

    def __post_init__(self):
        for f in ("candidates", "receiver_hosts", "receivers_per_host"):
            object.__setattr__(self, f, tuple(int(x) for x in getattr(self, f)))
        if self.kind not in JOB_KINDS:
            raise LoadBalanceError(f"job {self.unit}: expected kind in {JOB_KINDS}, found "
                                   f"{self.kind!r}")
        if not self.candidates or not self.receiver_hosts or len(
                self.receiver_hosts) != len(self.receivers_per_host):
            raise LoadBalanceError(f"job {self.unit}: expected candidates and one receiver "
                                   f"count per receiver host, found {self}")
        if self.kind != "broadcast" and len(self.receiver_hosts) != 1:
            raise LoadBalanceError(f"{self.kind} job {self.unit}: expected one receiver host, "
                                   f"found {self.receiver_hosts}")

    def cross_hosts(self, sender: int) -> tuple[int, ...]:
        """Receiver hosts other than ``sender``: those reached through the network."""
        return tuple(h for h in self.receiver_hosts if h != sender)

    def duration(self, sender: int, topo: Topology) -> float:
        """Seconds this job takes when ``sender`` sends it (module docstring's table)."""
        cross = self.cross_hosts(sender)
        intra = self.nbytes / topo.intra_bandwidth
        if not cross:
            return intra
        t = self.nbytes / min([topo.nic(sender)] + [topo.nic(h) for h in cross])
        if self.kind == "broadcast":
            k = topo.pipeline_chunks
            t = t * (1 + len(cross) / k) if k else t
            forwards = any(n > 1 for n in self.receivers_per_host) or len(cross) < len(
                self.receiver_hosts)
            return max(t, intra) if forwards else t
        if self.kind == "allgather":
            b = self.receivers_per_host[0]
            return t + intra * (b - 1) / b
        return t


@dataclasses.dataclass(frozen=True)
class Simulation:
    """Start and end time of every job, and the completion time (makespan)."""

    start: tuple[float, ...]
    end: tuple[float, ...]
    makespan: float


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A balancer's answer.

    Attributes:
        senders: the sender host of each job (indexed like the jobs).
        order: job indices in the global order.
        makespan: simulated completion time.
        balancer: which balancer produced it.
        complete: False when a search stopped at its time budget (result = best found).
    """

    senders: tuple[int, ...]
    order: tuple[int, ...]
    makespan: float
    balancer: str
    complete: bool = True


def simulate(jobs: Sequence[CommJob], senders: Sequence[int], order: Sequence[int],
             topology: Topology) -> Simulation:
    """List-schedule ``jobs`` in ``order`` with the chosen ``senders`` (module docstring).

    Raises:
        LoadBalanceError: if ``order`` is not a permutation or a sender is not a candidate.

    Example:
        >>> topo = Topology(nic_bandwidth=2.0)
        >>> jobs = [CommJob("send_recv", 0, (0,), (1,), (1,), 4.0),
        ...         CommJob("send_recv", 1, (0,), (2,), (1,), 4.0)]
        >>> simulate(jobs, [0, 0], [1, 0], topo)
        Simulation(start=(2.0, 0.0), end=(4.0, 2.0), makespan=4.0)
    """
    n = len(jobs)
    if sorted(order) != list(range(n)) or len(senders) != n:
        raise LoadBalanceError(f"simulate: expected an order permuting 0..{n - 1} and {n} "
                               f"senders, found order {list(order)[:8]}, {len(senders)} senders")
    send_free: dict[int, float] = {}
    recv_free: dict[int, float] = {}
    start, end = [0.0] * n, [0.0] * n
    for j in order:
        job, s = jobs[j], senders[j]
        if s not in job.candidates:
            raise LoadBalanceError(f"simulate: job {j}: expected a sender among "
                                   f"{job.candidates}, found {s}")
        cross = job.cross_hosts(s)
        t0 = 0.0
        if cross:
            t0 = max([send_free.get(s, 0.0)] + [recv_free.get(h, 0.0) for h in cross])
        start[j], end[j] = t0, t0 + job.duration(s, topology)
        if cross:
            send_free[s] = end[j]
            for h in cross:
                recv_free[h] = end[j]
    return Simulation(tuple(start), tuple(end), max(end, default=0.0))


def _result(jobs, senders, order, topo, name, complete=True) -> Assignment:
    sim = simulate(jobs, senders, order, topo)
    return Assignment(tuple(senders), tuple(order), sim.makespan, name, complete)


def naive(jobs: Sequence[CommJob], topology: Topology) -> Assignment:
    """Each job from its first candidate (the lowest-indexed holder), in the natural order."""
    return _result(jobs, [j.candidates[0] for j in jobs], range(len(jobs)), topology, "naive")


def greedy(jobs: Sequence[CommJob], topology: Topology) -> Assignment:
    """Load balance only (004 Eq. 4): longest job first, each to the candidate whose NIC has
    sent the least so far (ties: the earlier candidate); the order is that sorted order."""
    order = sorted(range(len(jobs)),
                   key=lambda j: -jobs[j].duration(jobs[j].candidates[0], topology))
    load: dict[int, float] = {}
    senders = [0] * len(jobs)
    for j in order:
        job = jobs[j]

        def cost(c, job=job):
            return load.get(c, 0.0) + (job.duration(c, topology) if job.cross_hosts(c) else 0.0)
        c = min(job.candidates, key=cost)
        senders[j] = c
        if job.cross_hosts(c):
            load[c] = load.get(c, 0.0) + job.duration(c, topology)
    return _result(jobs, senders, order, topology, "greedy")


def randomized_greedy(jobs: Sequence[CommJob], topology: Topology, seed: int = 0,
                      trials: int = 16) -> Assignment:
    """Greedy search with randomization (004 §3.2): repeatedly pick, among ``trials`` random
    orders of the unscheduled jobs, the set of mutually non-conflicting jobs (no shared sender
    NIC, no shared receiver NIC) that involves the most hosts; append it to the order."""
    rng = random.Random(seed)
    remaining = list(range(len(jobs)))
    senders = [0] * len(jobs)
    order: list[int] = []
    load: dict[int, float] = {}
    while remaining:
        best: tuple[int, float, list[tuple[int, int]]] | None = None
        for _ in range(max(1, trials)):
            perm = remaining[:]
            rng.shuffle(perm)
            used_send: set[int] = set()
            used_recv: set[int] = set()
            chosen: list[tuple[int, int]] = []
            for j in perm:
                job = jobs[j]
                ok = [c for c in job.candidates
                      if not job.cross_hosts(c) or (c not in used_send and
                                                    not used_recv & set(job.cross_hosts(c)))]
                if not ok:
                    continue
                c = min(ok, key=lambda c: (bool(job.cross_hosts(c)), load.get(c, 0.0)))
                chosen.append((j, c))
                if job.cross_hosts(c):
                    used_send.add(c)
                    used_recv.update(job.cross_hosts(c))
            score = (len(used_send) + len(used_recv),
                     sum(jobs[j].duration(c, topology) for j, c in chosen))
            if best is None or score > best[:2]:
                best = (score[0], score[1], chosen)
        for j, c in best[2]:
            senders[j] = c
            order.append(j)
            remaining.remove(j)
            if jobs[j].cross_hosts(c):
                load[c] = load.get(c, 0.0) + jobs[j].duration(c, topology)
    return _result(jobs, senders, order, topology, "randomized_greedy")


class _OutOfTime(Exception):
    pass


class _Optimal(Exception):
    pass


def dfs(jobs: Sequence[CommJob], topology: Topology, time_budget_s: float = 1.0,
        max_nodes: int | None = None) -> Assignment:
    """Depth-first search over (next job, its sender) with pruning (004 §3.2).

    Each tree level appends one job to the order with one sender; children are tried earliest
    finish first, so the first leaf is a good greedy schedule. A branch is cut when a lower
    bound — the current makespan; each receiver NIC's free time plus the jobs it must still
    receive; each single-candidate sender NIC's free time plus the jobs it must still send;
    each remaining job's earliest end — reaches the best makespan found. Identical jobs are
    interchangeable, so only the first unscheduled one of each class is branched on. The
    search stops early when a schedule meets the bound at the root.

    Args:
        time_budget_s: stop after this long and return the best schedule found.
        max_nodes: or after this many tree nodes (deterministic tests).

    Returns:
        An ``Assignment``; ``complete`` is True when the search finished or met the root
        lower bound (optimal under the order semantics).
    """
    n = len(jobs)
    if n == 0:
        return Assignment((), (), 0.0, "dfs")
    deadline = time.perf_counter() + time_budget_s
    classes: dict[tuple, list[int]] = {}
    for j, job in enumerate(jobs):
        classes.setdefault((job.kind, job.candidates, job.receiver_hosts,
                            job.receivers_per_host, job.nbytes), []).append(j)
    cls = list(classes.values())
    dur = [{c: job.duration(c, topology) for c in job.candidates} for job in jobs]
    cross = [{c: job.cross_hosts(c) for c in job.candidates} for job in jobs]
    # lower-bound bookkeeping: work a host must still receive / send whatever the senders
    fixed_recv = [dict() for _ in jobs]   # host -> min duration, when h receives for any sender
    for j, job in enumerate(jobs):
        for h in job.receiver_hosts:
            if all(h in cross[j][c] for c in job.candidates):
                fixed_recv[j][h] = min(dur[j].values())
    fixed_send = [(job.candidates[0], dur[j][job.candidates[0]])
                  if len(job.candidates) == 1 and cross[j][job.candidates[0]] else None
                  for j, job in enumerate(jobs)]
    recv_left: dict[int, float] = {}
    send_left: dict[int, float] = {}
    for j in range(n):
        for h, d in fixed_recv[j].items():
            recv_left[h] = recv_left.get(h, 0.0) + d
        if fixed_send[j]:
            send_left[fixed_send[j][0]] = send_left.get(fixed_send[j][0], 0.0) + fixed_send[j][1]

    best = {"makespan": math.inf, "senders": None, "order": None}
    next_in_class = [0] * len(cls)
    send_free: dict[int, float] = {}
    recv_free: dict[int, float] = {}
    order: list[int] = []
    senders = [0] * n
    nodes = [0]

    def bound(current: float) -> float:
        lb = current
        for h, left in recv_left.items():
            lb = max(lb, recv_free.get(h, 0.0) + left)
        for h, left in send_left.items():
            lb = max(lb, send_free.get(h, 0.0) + left)
        return lb

    def visit(current: float) -> None:
        nodes[0] += 1
        if nodes[0] % 256 == 0 and (time.perf_counter() > deadline or (
                max_nodes is not None and nodes[0] > max_nodes)):
            raise _OutOfTime
        if len(order) == n:
            if current < best["makespan"]:
                best.update(makespan=current, senders=tuple(senders), order=tuple(order))
                if current <= root_bound * (1 + 1e-12):
                    raise _Optimal  # meets the lower bound: nothing can beat it
            return
        children = []
        for ci, members in enumerate(cls):
            if next_in_class[ci] == len(members):
                continue
            j = members[next_in_class[ci]]
            for c in jobs[j].candidates:
                xs = cross[j][c]
                t0 = max([send_free.get(c, 0.0)] + [recv_free.get(h, 0.0) for h in xs]) if xs \
                    else 0.0
                children.append((t0 + dur[j][c], t0, ci, j, c))
        # every remaining job must end by its earliest possible end
        earliest: dict[int, float] = {}
        for end, _, ci, _, _ in children:
            earliest[ci] = min(earliest.get(ci, math.inf), end)
        if max(earliest.values()) >= best["makespan"]:
            return
        children.sort()
        for end, t0, ci, j, c in children:
            new = max(current, end)
            xs = cross[j][c]
            saved = (send_free.get(c), [(h, recv_free.get(h)) for h in xs])
            if xs:
                send_free[c] = end
                for h in xs:
                    recv_free[h] = end
            for h, d in fixed_recv[j].items():
                recv_left[h] -= d
            if fixed_send[j]:
                send_left[c] -= fixed_send[j][1]
            next_in_class[ci] += 1
            order.append(j)
            senders[j] = c
            if bound(new) < best["makespan"]:
                visit(new)
            order.pop()
            next_in_class[ci] -= 1
            for h, d in fixed_recv[j].items():
                recv_left[h] += d
            if fixed_send[j]:
                send_left[c] += fixed_send[j][1]
            if xs:
                _restore(send_free, c, saved[0])
                for h, v in saved[1]:
                    _restore(recv_free, h, v)

    root_bound = max([bound(0.0)] + [min(d.values()) for d in dur])
    complete = True
    try:
        visit(0.0)
    except _Optimal:
        pass
    except _OutOfTime:
        complete = False
    if best["order"] is None:  # budget too small to reach a leaf: fall back to greedy
        g = greedy(jobs, topology)
        return dataclasses.replace(g, balancer="dfs", complete=False)
    return _result(jobs, best["senders"], best["order"], topology, "dfs", complete)


def _restore(d: dict, k, v) -> None:
    if v is None:
        d.pop(k, None)
    else:
        d[k] = v


def brute_force(jobs: Sequence[CommJob], topology: Topology) -> Assignment:
    """Try every order and every sender choice (tiny cases only: n! · Π candidates)."""
    n = len(jobs)
    if n > 7:
        raise LoadBalanceError(f"brute_force: expected at most 7 jobs, found {n}")
    best = None
    for senders in itertools.product(*[j.candidates for j in jobs]):
        for order in itertools.permutations(range(n)):
            m = simulate(jobs, senders, order, topology).makespan
            if best is None or m < best[0]:
                best = (m, senders, order)
    return Assignment(tuple(best[1]), tuple(best[2]), best[0], "brute_force")


def balance(jobs: Sequence[CommJob], topology: Topology, balancer: str = "best", *,
            seed: int = 0, time_budget_s: float = 1.0) -> Assignment:
    """Pick senders and an order for ``jobs`` with the named balancer (``BALANCERS``).

    ``best`` runs naive, greedy, randomized greedy and DFS (with ``time_budget_s``) and keeps
    the lowest simulated makespan (the first on ties, in that order).
    """
    jobs = list(jobs)
    if balancer == "naive":
        return naive(jobs, topology)
    if balancer == "greedy":
        return greedy(jobs, topology)
    if balancer == "randomized_greedy":
        return randomized_greedy(jobs, topology, seed=seed)
    if balancer == "dfs":
        return dfs(jobs, topology, time_budget_s=time_budget_s)
    if balancer == "best":
        runs = [naive(jobs, topology), greedy(jobs, topology),
                randomized_greedy(jobs, topology, seed=seed),
                dfs(jobs, topology, time_budget_s=time_budget_s)]
        win = min(runs, key=lambda a: a.makespan)
        return dataclasses.replace(win, balancer=f"best({win.balancer})")
    raise LoadBalanceError(f"balancer: expected one of {BALANCERS}, found {balancer!r}")
