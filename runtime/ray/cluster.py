"""Reaching a Ray cluster (``init``, exposed as ``rhino.init``) and the facts every Ray
piece of the runtime shares (the simulated device count of an actor, the waits' bounds).

Only the modules of ``rhino.runtime.ray`` import ray, and only inside functions, so
``import rhino`` never imports ray.

Example:
    >>> xla_flags(2, "--xla_foo=1")
    '--xla_foo=1 --xla_force_host_platform_device_count=2'
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import math
import os
import socket
import time
import warnings
from typing import Any, Mapping, Sequence

from rhino.runtime import threads
from rhino.runtime.failures import ExecutorError

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
ACTOR_CONCURRENCY = 8
ABORT_GRACE_S = 30.0
"""After a failure, how long the driver waits for the other stages to stop."""
CONNECT_TIMEOUT_S = 60.0
"""How long ``init`` may take to reach a cluster by default (and at most, for an executor)."""


@dataclasses.dataclass(frozen=True)
class RayInfo:
    """The Ray cluster this process is connected to.

    Attributes:
        address: the GCS address (``host:port``), or the ``ray://`` address in client mode.
        nodes: alive nodes; cpus: total CPUs; started: this call started a local cluster.
    """

    address: str
    nodes: int
    cpus: float
    started: bool = False


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ExecutorError("the Ray executor needs ray, an optional dependency: pip "
                            "install 'rhino[ray]' (or 'ray[default]>=2.9')") from e
    return ray


def _current_address(ray) -> str:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # client mode has no gcs_address
        return ""


def _info(ray, started: bool, address: str | None = None) -> RayInfo:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = float(ray.cluster_resources().get("CPU", 0.0))
    return RayInfo(address or _current_address(ray), len(nodes), cpus, started)


def init(address: str | None = None, num_cpus: int | None = None,
         timeout: float = CONNECT_TIMEOUT_S, **kwargs: Any) -> RayInfo:
    """Connect to a Ray cluster, or start a local one; idempotent.

    Args:
        address: ``"auto"`` (the cluster started on this machine by ``ray start``),
            ``"host:port"`` (a GCS address), ``"ray://host:10001"`` (Ray client), or None:
            ``$RAY_ADDRESS`` if set (as inside ``ray job submit``), else a new local cluster
            (no dashboard, token authentication off: ``RAY_AUTH_MODE=disabled`` unless set).
        num_cpus: CPUs of a new local cluster (ignored when connecting).
        timeout: seconds to reach a cluster: the address must accept a TCP connection and
            ``ray.init`` return within it (it runs on a helper thread: if it does not
            return in time it goes on trying in the background and this raises).
        **kwargs: passed to ``ray.init`` (e.g. ``_temp_dir``, ``log_to_driver``).

    Returns:
        A ``RayInfo`` (address, alive nodes, CPUs).

    Raises:
        ExecutorError: already connected to a different cluster, nothing answers at the
            address, or the connection failed or did not finish within ``timeout``.

    Example:
        >>> info = init(num_cpus=2)                                  # doctest: +SKIP
        >>> info.nodes, info.cpus                                    # doctest: +SKIP
        (1, 2.0)
    """
    ray = import_ray()
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ExecutorError(f"rhino.init: timeout: expected a positive number of seconds, "
                            f"found {timeout!r}")
    if ray.is_initialized():
        cur = _current_address(ray)
        if address not in (None, "auto") and not address.startswith("ray://") and cur and \
                _norm(address) != _norm(cur):
            raise ExecutorError(f"rhino.init: already connected to the Ray cluster at {cur}, "
                                f"asked for {address}; call ray.shutdown() first")
        return _info(ray, False)
    from_env = address is None and bool(os.environ.get("RAY_ADDRESS"))
    if address is None:
        address = os.environ.get("RAY_ADDRESS") or None
    local = address is None
    where = ("a local Ray cluster" if local else f"the Ray cluster at {address}"
             + (" ($RAY_ADDRESS)" if from_env else ""))
    if local:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kwargs.setdefault("include_dashboard", False)
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
    deadline = time.monotonic() + timeout
    try:
        if local:
            with quiet_fork_warning():
                ray.init(**kwargs)  # starting a local cluster: ray bounds its own waits
        else:
            if address != "auto":
                _check_reachable(address, where, timeout)
            _connect(ray, address, kwargs, deadline, where, timeout)
    except ExecutorError:
        raise
    except Exception as e:
        raise ExecutorError(f"rhino.init: could not start or reach {where}: "
                            f"{type(e).__name__}: {e}") from e
    return _info(ray, local, address if address and address.startswith("ray://") else None)


@contextlib.contextmanager
def quiet_fork_warning():
    """Leave out JAX's ``RuntimeWarning: os.fork() was called ...`` while Ray starts its
    processes. Ray starts each one with ``subprocess`` (fork, then at once exec of another
    program; its pre-exec hook only sets signal masks), so the child never runs JAX code
    and the deadlock JAX warns about (a forked copy of its threads) cannot happen. Any other
    warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                                category=RuntimeWarning)
        yield


_CONNECTING: list[cf.Future] = []   # a ray.init still trying after its caller gave up


def _connect(ray, address: str, kwargs: dict, deadline: float, where: str,
             timeout: float) -> None:
    """``ray.init(address=...)`` on a helper thread, waited for until ``deadline``."""
    if _CONNECTING and not _CONNECTING[-1].done():
        raise ExecutorError(f"rhino.init: an earlier attempt to reach a Ray cluster is still "
                            f"trying in the background; expected it to finish before "
                            f"connecting to {address} (restart the process to give up on it)")
    _CONNECTING.clear()
    quiet = _DropMessage("SIGTERM handler is not set")  # ray.init off the main thread
    logging.getLogger("ray._private.worker").addFilter(quiet)
    try:
        attempt = threads.start(lambda: ray.init(address=address, **kwargs),
                                name="rhino-ray-init")
        left = threads.wait_all([attempt], max(0.0, deadline - time.monotonic()))
    finally:
        logging.getLogger("ray._private.worker").removeFilter(quiet)
    if left:
        _CONNECTING.append(attempt)
        raise ExecutorError(f"rhino.init: could not reach {where} within {timeout:g} s "
                            f"(a TCP connection works, but ray.init did not return: is it a "
                            f"Ray GCS of the same Ray version?)")
    attempt.result()


def _check_reachable(address: str, where: str, timeout: float) -> None:
    """Raise ``ExecutorError`` unless ``address`` accepts a TCP connection in time."""
    target = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ExecutorError(f"rhino.init: expected an address 'host:port', "
                            f"'ray://host:port' or 'auto', found {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        why = (f"no answer within {timeout:g} s" if isinstance(e, socket.timeout)
               else f"{type(e).__name__}: {e}")
        raise ExecutorError(f"rhino.init: could not reach {where}: nothing accepts "
                            f"connections there ({why}); expected a running Ray head (e.g. "
                            f"`python -m rhino.runtime.ray.local_head start`)") from None


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _norm(address: str) -> str:
    host, _, port = address.rpartition(":")
    host = {"localhost": "127.0.0.1"}.get(host, host)
    return f"{host}:{port}"


def xla_flags(devices: int, base: str | None = None) -> str:
    """``base`` XLA flags (default: this process's) with ``devices`` simulated host devices.

    >>> xla_flags(4, "--xla_force_host_platform_device_count=8 --foo=1")
    '--foo=1 --xla_force_host_platform_device_count=4'
    """
    base = os.environ.get("XLA_FLAGS", "") if base is None else base
    kept = [f for f in base.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join(kept + [f"{DEVICE_COUNT_FLAG}={devices}"])


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (none where the OS cannot say)."""
    return tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()


def share_cores(found: Sequence[tuple[str, Sequence[int]]], simulated: Sequence[bool],
                pin: bool | None, labels: Sequence[str]) -> list[tuple[int, ...] | None]:
    """Per actor, the cores it keeps to, or None: the actors that simulate hosts
    (``simulated``) on one node (``found``: per actor, its node and the cores it may use)
    take equal runs of the node's cores, in actor order, as hosts do not share theirs. An
    actor alone on its node keeps every core. Where a node has fewer cores than such actors,
    nobody there is pinned (``pin=None``) or it is an error (``pin=True``).

    >>> share_cores([("a", (0, 1, 2, 3)), ("a", (0, 1, 2, 3)), ("b", (0, 1))],
    ...             [True, True, True], None, ["s0", "s1", "s2"])
    [(0, 1), (2, 3), None]

    Raises:
        ExecutorError: ``pin=True`` and a node with fewer cores than its simulating actors.
    """
    by_node: dict[str, list[int]] = {}
    for n, (node, _) in enumerate(found):
        if simulated[n]:
            by_node.setdefault(node, []).append(n)
    out: list[tuple[int, ...] | None] = [None] * len(found)
    for node, actors in by_node.items():
        cores = sorted(found[actors[0]][1])
        if len(actors) < 2:
            continue
        if len(cores) < len(actors):
            if pin:
                raise ExecutorError(f"pin_cpus=True: expected at least one core per actor on "
                                    f"node {node[:12]}, found {len(cores)} cores for "
                                    f"{len(actors)} actors ("
                                    f"{', '.join(labels[n] for n in actors)})")
            continue
        k = len(cores) // len(actors)
        for i, n in enumerate(actors):
            out[n] = tuple(cores[i * k:(i + 1) * k])
    return out



def check_plan(sizes: Sequence[int], hosts: Sequence[int],
               host_ids: Sequence[Sequence[int]], info: RayInfo,
               options: Mapping[str, Any], cluster: Any = None) -> None:
    """Whether a plan fits the Ray cluster, before any actor is made: per stage, its hosts
    (``hosts[s]``) divide its devices (``sizes[s]``); a multi-node cluster has a node per
    plan host (``host_ids``: per stage, its hosts); a single node has the CPUs its actors
    ask for (``check_cpus``)."""
    for s, (n, h) in enumerate(zip(sizes, hosts)):
        if h < 1 or n % h:
            raise ExecutorError(f"stage {s}: expected a number of hosts dividing its "
                                f"{n} devices, found {h}", stage=s)
    need = len({h for ids in host_ids for h in ids})
    if 1 < info.nodes < need:
        raise ExecutorError(f"the plan (cluster {cluster}) runs on {need} hosts, the Ray "
                            f"cluster has {info.nodes} alive nodes; expected one node per "
                            f"host (or a single node, where hosts are simulated by actors)")
    check_cpus(hosts, options, info, cluster)


def check_cpus(hosts: Sequence[int], options: Mapping[str, Any], info: RayInfo,
               cluster: Any = None) -> None:
    """On a single-node Ray cluster (hosts simulated by actors), refuse a plan whose actors
    (``hosts[s]`` per stage, each asking ``options["num_cpus"]``, default 1) ask for more
    CPUs than the node has: Ray would leave the rest waiting until the executor's timeout.

    >>> check_cpus([2, 2], {}, RayInfo("a", 1, 4.0))
    >>> check_cpus([2, 2], {"num_cpus": 0.5}, RayInfo("a", 1, 2.0))
    """
    if info.nodes != 1:
        return      # several nodes: placement groups wait for (or scale to) the hosts
    each = float(options.get("num_cpus", 1) or 0)
    actors = sum(hosts)
    need = each * actors
    if need > info.cpus + 1e-9:
        waiting = actors - int(info.cpus // each)
        raise ExecutorError(
            f"the plan{f' (cluster {cluster})' if cluster is not None else ''} runs "
            f"{actors} actors asking {each:g} CPU each ({need:g} CPUs), expected at most "
            f"the {info.cpus:g} CPUs of this single-node Ray cluster: Ray would leave "
            f"{waiting} of them waiting. Start Ray with more CPUs "
            f"(rhino.runtime.ray.executor.init(num_cpus={math.ceil(need)}) or `ray start "
            f"--num-cpus {math.ceil(need)}`), or pass "
            f"ray_actor_options={{'num_cpus': {info.cpus / actors:g}}}")
