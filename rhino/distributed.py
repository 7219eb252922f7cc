"""Multi-controller jobs: the same script started on every host, one process each.

JAX users on SLURM, Kubernetes or a cloud TPU start one process per host, and every process
calls ``jax.distributed.initialize()``; together they see every device of the job
(``jax.devices()``), each holding its own (``jax.local_devices()``). rhino joins in::

    srun / Kubernetes / python -m rhino.launch ─► every process runs the script:
        rhino.distributed_init()        joins the job: rhino.launch's variables, else
                                        jax.distributed.initialize() (auto-detected)
        step = rhino.auto_parallel(fn)  the mesh spans every device of the job
        step(*args)                     each process plans alone, deterministically; the
                                        plan's hash is compared over the job's key-value
                                        store (agree_on_plan) before anything compiles;
                                        then one SPMD program runs on all devices

``rhino.launch`` (``python -m rhino.launch --hosts 2 script.py``) starts such a job on one
machine, for trying it (docs/multicontroller.md).

Example:
    >>> launch_environment({}) is None     # not started by rhino.launch
    True
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import random
import socket
import time
from typing import Any, Mapping

from rhino.errors import RhinoError

log = logging.getLogger("rhino")

ENV_COORDINATOR = "RHINO_COORDINATOR_ADDRESS"
"""``HOST:PORT`` of the job's coordinator (process 0), as ``rhino.launch`` sets it."""
ENV_NUM_PROCESSES = "RHINO_NUM_PROCESSES"
"""The number of processes in the job."""
ENV_PROCESS_ID = "RHINO_PROCESS_ID"
"""This process's id, 0 to ``RHINO_NUM_PROCESSES - 1``."""
ENV_TRANSFER_ADDRESS = "RHINO_TRANSFER_ADDRESS"
"""``HOST:PORT`` of this process's socket for cross-process transfers on CPU (optional)."""

DEFAULT_INIT_TIMEOUT_S = 300.0
"""How long ``distributed_init`` waits for every process of the job to join."""


class DistributedError(RhinoError):
    """A multi-controller job that cannot be joined or run: malformed launch variables,
    JAX already in use, a process that did not answer in time."""


class PlanDivergenceError(DistributedError):
    """The processes of a job made different plans for the same step (raised on every
    process, before anything runs).

    Attributes:
        hashes: ``{process id: the sha256 of its plan}``.
    """

    def __init__(self, message: str, hashes: Mapping[int, str]):
        super().__init__(message)
        self.hashes = dict(hashes)


@dataclasses.dataclass(frozen=True)
class Job:
    """The job this process is part of.

    Attributes:
        process_id: this process (``jax.process_index()``).
        num_processes: processes in the job (``jax.process_count()``).
        how: how it was joined: ``"rhino.launch"`` (its variables), ``"auto-detected"``
            (``jax.distributed.initialize()``: SLURM, Open MPI, Kubernetes, cloud TPU),
            ``"already joined"`` (``jax.distributed`` was initialized before) or
            ``"single process"`` (no job to join was found).
    """

    process_id: int
    num_processes: int
    how: str


def launch_environment(env: Mapping[str, str] | None = None) -> dict | None:
    """``{coordinator, num_processes, process_id, transfer}`` from ``rhino.launch``'s
    variables (``RHINO_COORDINATOR_ADDRESS``, ``RHINO_NUM_PROCESSES``,
    ``RHINO_PROCESS_ID``, optionally ``RHINO_TRANSFER_ADDRESS``); None when
    ``RHINO_COORDINATOR_ADDRESS`` is not set.

    Raises:
        DistributedError: a variable missing or malformed (naming it).

    >>> launch_environment({"RHINO_COORDINATOR_ADDRESS": "10.0.0.1:1234",
    ...                     "RHINO_NUM_PROCESSES": "2", "RHINO_PROCESS_ID": "1"})
    {'coordinator': '10.0.0.1:1234', 'num_processes': 2, 'process_id': 1, 'transfer': None}
    """
    env = os.environ if env is None else env
    coordinator = env.get(ENV_COORDINATOR, "").strip()
    if not coordinator:
        return None
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(f"{ENV_COORDINATOR}: expected HOST:PORT, found "
                               f"{coordinator!r}")
    got = {}
    for name in (ENV_NUM_PROCESSES, ENV_PROCESS_ID):
        text = env.get(name, "").strip()
        if not text.isdigit():
            raise DistributedError(f"{name}: expected a whole number (set with "
                                   f"{ENV_COORDINATOR}={coordinator}), found {text!r}")
        got[name] = int(text)
    n, i = got[ENV_NUM_PROCESSES], got[ENV_PROCESS_ID]
    if n < 1 or not 0 <= i < n:
        raise DistributedError(f"{ENV_PROCESS_ID}={i}, {ENV_NUM_PROCESSES}={n}: expected "
                               f"0 <= process id < number of processes >= 1")
    return {"coordinator": coordinator, "num_processes": n, "process_id": i,
            "transfer": env.get(ENV_TRANSFER_ADDRESS) or None}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` nobody listens on now, below the kernel's range for the
    local ends of outgoing connections where there is room: a port from that range (what
    binding port 0 gives) can be taken by any connection made before the job binds it (a
    coordinator once failed so: "Failed to add port to server ... [::]:48569")."""
    low = _ephemeral_low()
    pick = random.Random()
    for _ in range(100):
        port = pick.randrange(20000, low) if low > 20000 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's range for outgoing connections (read on Linux;
    elsewhere 32768, Linux's default, below macOS's and Windows' 49152)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _transfer_address(launched: dict | None) -> str | None:
    """A free ``HOST:PORT`` of this host for cross-process transfers (127.0.0.1 when the
    coordinator is local); None where the host's address cannot be found (logged)."""
    try:
        host = ("127.0.0.1" if launched and launched["coordinator"].startswith(
            ("127.", "localhost")) else socket.gethostbyname(socket.gethostname()))
        return f"{host}:{free_port(host)}"
    except OSError as e:
        log.warning("rhino: no socket for cross-process transfers (%s); set %s=HOST:PORT "
                    "if the job moves values between processes", e, ENV_TRANSFER_ADDRESS)
        return None


def _cpu_only() -> bool:
    """Whether JAX will run on CPU only (``JAX_PLATFORMS=cpu``, or no accelerator plugin
    installed), judged without starting JAX's backends."""
    import importlib.util

    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms == ["cpu"]
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
               "jax_rocm7_plugin", "libtpu", "jax_plugins")
    return not any(importlib.util.find_spec(p) for p in plugins)


# True once distributed_init(cross_process_collectives=False) joined the job.
_NO_CROSS_PROCESS_COLLECTIVES = {"off": False}


def distributed_init(*, timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
                     cross_process_collectives: bool = True) -> Job:
    """Join this process's multi-controller job; call it at the top of the script, before
    anything else uses JAX. Idempotent: later calls return the job joined.

    Where the job comes from:

    * ``python -m rhino.launch`` set ``RHINO_COORDINATOR_ADDRESS``, ``RHINO_NUM_PROCESSES``
      and ``RHINO_PROCESS_ID`` (set them by hand on Kubernetes, e.g. from an Indexed Job's
      completion index): those are passed to ``jax.distributed.initialize``;
    * otherwise ``jax.distributed.initialize()`` with no arguments detects SLURM, Open MPI,
      cloud TPU and the rest JAX knows; where it finds no job, the process runs alone
      (``Job.how == "single process"``, logged).

    On CPU it first selects gloo collectives between the processes
    (``jax_cpu_collectives_implementation``) and a socket for cross-process transfers
    (``jax_cross_host_transfer_socket_address``: ``RHINO_TRANSFER_ADDRESS``, or a free port
    of this host). In a job of several processes, an uncaught exception then ends the
    process at once (status 1, after its traceback), so that the launcher or scheduler
    sees the failure, instead of JAX's exit waiting for the other processes.

    Args:
        timeout_s: seconds to wait for every process to join.
        cross_process_collectives: on CPU, select gloo (the default). ``False`` keeps every
            program's collectives inside its process: a pipelined plan whose stages each sit
            on one process then runs about 1.8x faster on a 2-core machine (gloo sends a
            process's own all-reduces through sockets too: ``multicontroller_overhead.py``,
            421-428 ms a step against 762 ms), and a plan that is one SPMD program over
            several processes is refused before it runs. GPUs and TPUs use their own
            collectives either way.

    Returns:
        The ``Job``.

    Raises:
        DistributedError: JAX was already used in this process (its backends exist, so it
            cannot join a job any more); malformed launch variables; the job could not be
            joined in time (JAX's message attached).
    """
    import jax

    from rhino.jaxpr.private import backends_initialized

    if jax.distributed.is_initialized():
        return Job(jax.process_index(), jax.process_count(), "already joined")
    launched = launch_environment()
    if backends_initialized():
        if jax.process_count() > 1:     # joined some other way, e.g. by a framework
            return Job(jax.process_index(), jax.process_count(), "already joined")
        raise DistributedError(
            "distributed_init: expected to run before JAX is used, found its backends "
            "already started in this process (by jax.devices(), an array or a computation "
            "made before the call), so this process can no longer join a multi-process job; "
            "call rhino.distributed_init() at the top of the script, right after importing "
            "jax and rhino")
    # JAX's default is gloo already (jax 0.10, 0.12): set both ways, explicitly.
    jax.config.update("jax_cpu_collectives_implementation",
                      "gloo" if cross_process_collectives else None)
    _NO_CROSS_PROCESS_COLLECTIVES["off"] = not cross_process_collectives
    transfer = launched["transfer"] if launched else None
    if transfer is None and _cpu_only():
        transfer = _transfer_address(launched)
    if transfer:
        jax.config.update("jax_cross_host_transfer_socket_address", transfer)
    timeout = max(1, int(timeout_s))
    try:
        if launched:
            jax.distributed.initialize(launched["coordinator"],
                                       num_processes=launched["num_processes"],
                                       process_id=launched["process_id"],
                                       initialization_timeout=timeout)
            how = "rhino.launch"
        else:
            try:
                jax.distributed.initialize(initialization_timeout=timeout)
            except ValueError as e:    # nothing detected: no coordinator, no process count
                if jax.distributed.is_initialized():
                    raise
                log.info("rhino: no multi-process job found (%s); running as a single "
                         "process", e)
                return Job(0, 1, "single process")
            how = "auto-detected"
    except DistributedError:
        raise
    except Exception as e:
        where = (f"coordinator {launched['coordinator']}, process {launched['process_id']} "
                 f"of {launched['num_processes']}" if launched else "auto-detected")
        raise DistributedError(f"distributed_init: could not join the job ({where}) within "
                               f"{timeout} s: {type(e).__name__}: {e}") from e
    job = Job(jax.process_index(), jax.process_count(), how)
    if job.num_processes > 1:
        _exit_at_once_on_failure()
    return job


def _exit_at_once_on_failure() -> None:
    """An uncaught exception ends this process of the job at once (status 1, after the
    traceback): JAX's exit would wait at the job's shutdown barrier for the other processes
    (minutes), and the launcher or scheduler would not see the failure to stop the job."""
    import sys

    previous = sys.excepthook
    if getattr(previous, "rhino_exits", False):
        return

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        if job_process_id() == 0:
            # The job's coordination service lives here; leaving ends the job for every
            # process, which may be about to report the same error: give them a moment.
            time.sleep(EXIT_GRACE_S)
        os._exit(1)
    hook.rhino_exits = True   # type: ignore[attr-defined]
    sys.excepthook = hook


EXIT_GRACE_S = 1.0
"""How long process 0 (the coordinator) waits before ending on an uncaught exception."""


def job_process_id() -> int:
    import jax

    return jax.process_index()


# ------------------------------------------------------------------------------ agreement
SEEN_TIMEOUT_S = 30.0
"""Plans that differ: how long each process waits for the others to have seen it too."""
_AGREEMENTS = itertools.count()
"""Agreements made by this process so far: every process of a job plans its steps in the
same order, so the n-th agreement of each process is about the same step."""


def plan_digest(text: str) -> str:
    """The sha256 (hex) of a plan's JSON."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def agree_on_plan(plan_json: str, what: str, timeout_s: float) -> str:
    """Check that every process of the job made this plan: each publishes its plan's hash
    in the job's key-value store and reads everyone's. Every process raises on a
    mismatch, so none runs a program the others do not.

    Args:
        plan_json: the plan (``Plan.to_json(search_times=False)``).
        what: what was planned (for messages), e.g. ``"auto_parallel(train_step)"``.
        timeout_s: how long to wait for the other processes' hashes.

    Returns:
        The plan's hash.

    Raises:
        PlanDivergenceError: the hashes differ (naming every process and its hash).
        DistributedError: a process did not publish its hash in time.
    """
    import jax

    from rhino.jaxpr.private import kv_get, kv_set

    me, n = jax.process_index(), jax.process_count()
    mine = plan_digest(plan_json)
    key = f"rhino/plan/{next(_AGREEMENTS)}"
    kv_set(f"{key}/{me}", mine)
    hashes = {me: mine}
    for p in range(n):
        if p == me:
            continue
        try:
            hashes[p] = kv_get(f"{key}/{p}", timeout_s)
        except TimeoutError:
            raise DistributedError(
                f"{what}: process {me} waited {timeout_s:g} s for process {p}'s plan, in "
                f"vain (it failed or is still planning; give auto_parallel a longer "
                f"timeout=)") from None
    if len(set(hashes.values())) > 1:
        # Every process read every hash, so each sees the mismatch: wait until each has
        # (the coordinator leaving ends the job for the others) before raising.
        kv_set(f"{key}/seen/{me}", "1")
        for p in range(n):
            try:
                kv_get(f"{key}/seen/{p}", min(timeout_s, SEEN_TIMEOUT_S))
            except TimeoutError:
                pass
        listed = ", ".join(f"process {p}: {h[:16]}" for p, h in sorted(hashes.items()))
        raise PlanDivergenceError(
            f"{what}: the processes of this job made different plans (sha256 of the plan "
            f"JSON: {listed}); this is process {me}. Every process must run the same step "
            f"with the same options and argument shapes; nothing has run", hashes)
    log.debug("rhino: %d processes agree on the plan of %s (%s)", n, what, mine[:16])
    return mine


def global_batch(local: Any, devices: Any = None) -> Any:
    """A global batch made of each process's own rows (a pytree of arrays whose leading
    dimension is this process's share): ``jax.make_array_from_process_local_data`` over a
    1-D mesh of every device of the job (host-major), the rows of process ``p`` after those
    of process ``p - 1``. ``auto_parallel`` moves it to the plan's layout.

    Raises:
        DistributedError: a leaf with no leading dimension.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devs = list(devices) if devices is not None else job_devices()
    sharding = NamedSharding(Mesh(np.array(devs), ("rows",)), PartitionSpec("rows"))

    def one(x: Any) -> Any:
        if not np.shape(x):
            raise DistributedError("global_batch: expected arrays with a leading dimension "
                                   "of rows, found a scalar")
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))
    return jax.tree_util.tree_map(one, local)


def job_devices() -> list:
    """Every device of the job, host-major (by process, then id): a mesh's leading axis
    runs across the processes, as the planner prices it."""
    import jax

    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def spans_processes(devices: Any) -> bool:
    """Whether ``devices`` belong to more than one process."""
    return len({getattr(d, "process_index", 0) for d in devices}) > 1


def check_cross_process_program(what: str) -> None:
    """Refuse ``what`` (one program over the devices of several processes) on CPU when this
    process joined its job with ``distributed_init(cross_process_collectives=False)``."""
    import jax

    if _NO_CROSS_PROCESS_COLLECTIVES["off"] and jax.distributed.is_initialized() and \
            jax.process_count() > 1 and jax.devices()[0].platform == "cpu":
        raise DistributedError(
            f"{what}: expected collectives between processes for one program over "
            f"{jax.process_count()} processes, found this job joined with "
            f"rhino.distributed_init(cross_process_collectives=False) (no gloo on CPU); "
            f"drop that argument, or ask for a pipeline with one stage per process "
            f"(stages=...)")
