"""The Ray executor: one actor per pipeline stage, values between stages through the object
store. ``init`` connects to (or starts) a Ray cluster; it is exposed as ``rhino.init``.

Only this module (in ``rhino.runtime``) imports ray, and only inside functions and the
actor, so ``import rhino`` never imports ray.

Layout of one step (2 stages)::

    driver ── run_step(step, args) ──► actor 0 (stage 0: mesh of N local devices)
           ── run_step(step, args) ──► actor 1 (stage 1: mesh of N local devices)
                                        │  send: ray.put(np.asarray(value)) in the sender,
                                        │        peer.deliver.remote(step, src, key, ref)
                                        │  recv: wait on the local mailbox (Condition)
           ◄── (outputs as numpy, task records) ──┘

* Each actor is created once per executor with its ``WorkerSpec`` (re-traces the step,
  builds its ``StageWorker`` on ``jax.devices()[:n]``); ``XLA_FLAGS`` with
  ``--xla_force_host_platform_device_count=n`` reaches it through ``runtime_env``, so it is
  set before the actor process imports jax.
* A step is one ``run_step`` call per actor. The actors are threaded (``max_concurrency``):
  ``deliver`` and ``abort`` run while ``run_step`` waits in the mailbox.
* ``RayTransport`` implements ``runtime.executor.Transport`` (``send(src, dst, key, value)``
  / ``recv(dst, src, key, timeout)``): a value goes to the host, into the sender's object
  store (``ray.put``), and its ``ObjectRef`` is passed as a top-level argument of the
  receiver's ``deliver``, so Ray resolves it (fetches the bytes to the receiver's node)
  *before* ``deliver`` runs: the copy overlaps the receiver's compute and the mailbox holds
  host arrays. An NCCL (or jax collectives) transport would implement the same two methods
  with device-to-device send/recv between the two meshes; nothing else changes.
* Arguments: the driver puts each argument leaf in the object store once per step (jax
  arrays: once for as long as the same object is passed again) and passes the same
  ``ObjectRef`` to every actor reading it. Training state that an actor returned last step
  and that comes back as the very same Python object (identity) is not sent again: the
  actor uses the array it kept. Steady state therefore moves the batch to the actors and
  the step's results (updated state, metrics) back to the driver.
* Failures: every wait has a timeout, reaching the cluster included (``init``: a TCP
  check of the address, then ``ray.init`` on a helper thread waited for at most
  ``timeout``). A dead actor (``RayActorError``), an error on a stage or a step that does
  not finish within ``2 × timeout`` raises ``ExecutorError`` naming the stage (and the task,
  from the ``StageWorker``; the root cause first, ``executor.root_cause``); the other
  actors' waits are aborted (``abort`` poisons their mailbox for that step), so nothing
  hangs. An executor that cannot run again (a dead or stuck actor) kills its actors at once,
  so a failed executor never holds the cluster's CPUs. Ctrl-C aborts the step in flight.

Example:
    >>> import rhino
    >>> info = rhino.init(num_cpus=4)                           # doctest: +SKIP
    >>> step = rhino.auto_parallel(m.step, cluster="2x4", stages=2,
    ...                            executor="ray")              # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import re
import socket
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from rhino.runtime import threads
from rhino.runtime.executor import DEFAULT_TIMEOUT_S, ExecutorError, Failure, root_cause

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
ACTOR_CONCURRENCY = 8
INLINE_BYTES = 100 * 1024
"""Values up to this size travel inside the ``deliver`` call (Ray inlines small
arguments); larger ones are put in the sender's object store first."""
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


def _ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a dependency
        raise ExecutorError("the Ray executor needs ray: pip install 'ray>=2.9'") from e
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
    ray = _ray()
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
                            f"`python -m rhino.runtime.local_ray start`)") from None


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


# --------------------------------------------------------------------------- actor side
class RayTransport:
    """The ``Transport`` of one actor for one step (see the module docstring).

    Args:
        mailbox: this actor's ``Mailbox``; peers: actor handles by stage; step: the step
            number (messages of other steps are never mixed up).
    """

    def __init__(self, mailbox: "Mailbox", peers: Sequence[Any], step: int):
        self.mailbox, self.peers, self.step = mailbox, peers, step

    def send(self, src: int, dst: int, key: tuple, value: Any) -> None:
        host = np.asarray(value)
        if host.nbytes > INLINE_BYTES:
            # A top-level ObjectRef argument: Ray fetches it to the receiver's node before
            # deliver runs (the copy overlaps the receiver's compute).
            host = _ray().put(host)
        self.peers[dst].deliver.remote(self.step, src, key, host)

    def recv(self, dst: int, src: int, key: tuple, timeout: float) -> Any:
        return self.mailbox.take(self.step, src, key, timeout)


class Mailbox:
    """Values delivered to one stage, per (step, source stage, key); ``abort`` poisons a
    step so that every waiting ``take`` raises at once."""

    def __init__(self):
        self._cond = threading.Condition()
        self._box: dict[tuple, Any] = {}
        self._aborted: dict[int, str] = {}

    def put(self, step: int, src: int, key: tuple, value: Any) -> None:
        with self._cond:
            self._box[(step, src, key)] = value
            self._cond.notify_all()

    def take(self, step: int, src: int, key: tuple, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        k = (step, src, key)
        with self._cond:
            while k not in self._box:
                if step in self._aborted:
                    raise ExecutorError(f"aborted: {self._aborted[step]}",
                                        failure=Failure.ABORTED)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no value {key} from stage {src} after "
                                       f"{timeout:.0f} s")
                self._cond.wait(left)
            return self._box.pop(k)

    def abort(self, step: int, why: str) -> None:
        with self._cond:
            self._aborted[step] = why
            self._cond.notify_all()

    def start(self, step: int) -> None:
        """Forget the values and aborts of earlier steps."""
        with self._cond:
            for k in [k for k in self._box if k[0] < step]:
                del self._box[k]
            for s in [s for s in self._aborted if s < step]:
                del self._aborted[s]


class StageActor:
    """One pipeline stage in its own process (wrapped by ``ray.remote`` at run time).

    Args:
        spec: the stage's ``WorkerSpec``; devices: devices of its mesh (``XLA_FLAGS`` gives
            this process that many host devices).
    """

    def __init__(self, spec: Any, devices: int):
        import jax

        self.stage = spec.stage
        found = jax.devices()
        if len(found) < devices:
            raise ExecutorError(f"stage {self.stage}: expected {devices} devices in the actor, "
                                f"found {len(found)} (XLA_FLAGS="
                                f"{os.environ.get('XLA_FLAGS', '')!r})")
        split = spec.split()
        self.worker = spec.build(found[:devices], split)
        self.outputs = tuple(o.ref for o in split.outputs if o.producer is not None
                             and o.producer[1] == self.stage and o.source in ("task", "acc"))
        self.args = split.stage_args(self.stage)
        self.mailbox = Mailbox()
        self.peers: list[Any] = []
        self.kept: dict[int, dict[int, Any]] = {}  # step -> its results (jax arrays)

    def describe(self) -> dict:
        import socket

        import jax

        return {"stage": self.stage, "args": self.args, "outputs": self.outputs,
                "pid": os.getpid(), "host": socket.gethostname(),
                "devices": len(jax.devices()), "platform": jax.devices()[0].platform}

    def set_peers(self, peers: Sequence[Any]) -> None:
        self.peers = list(peers)

    def deliver(self, step: int, src: int, key: tuple, value: Any) -> None:
        self.mailbox.put(step, src, key, value)

    def abort(self, step: int, why: str) -> None:
        self.mailbox.abort(step, why)

    def run_step(self, step: int, timeout: float, kept_step: int, kept: Mapping[int, int],
                 refs: Sequence[int], *values: Any) -> tuple[dict, list, float]:
        """One step: ``refs[i] -> values[i]`` (resolved by Ray) and ``kept``: argument ref
        -> the ref of a result of step ``kept_step`` that this actor kept (the results of
        other steps are dropped: a step that failed elsewhere is never reused).

        Returns:
            (this stage's step results as numpy, task records on the ``time.time()``
            clock, seconds the stage spent).
        """
        import jax

        from rhino.runtime.timeline import TaskRecord

        self.mailbox.start(step)
        t0 = time.perf_counter()
        args = dict(zip(refs, values))
        self.kept = {kept_step: self.kept[kept_step]} if kept_step in self.kept else {}
        mine = self.kept.get(kept_step, {})
        missing = [r for r, o in kept.items() if o not in mine]
        if missing:
            raise ExecutorError(f"stage {self.stage}: the driver referred to kept results "
                                f"of step {kept_step} for arguments {missing}; this actor "
                                f"does not have them")
        args.update({r: mine[o] for r, o in kept.items()})
        transport = RayTransport(self.mailbox, self.peers, step)
        outs, records = self.worker.run_step(args, transport, timeout)
        jax.block_until_ready(outs)
        self.kept[step] = dict(outs)
        host = {r: np.asarray(x) for r, x in outs.items()}
        # perf_counter is per machine: move the records to the wall clock.
        shift = time.time() - time.perf_counter()
        records = [TaskRecord(r.stage, r.label, r.start + shift, r.end + shift, r.microbatch,
                              r.kind) for r in records]
        return host, records, time.perf_counter() - t0


# --------------------------------------------------------------------------- driver side
class RayExecutor:
    """All stages as Ray actors, one per stage (same interface as ``LocalExecutor``).

    Args:
        specs: one ``WorkerSpec`` per stage, in stage order.
        cluster: the plan's ``Cluster`` (for messages).
        timeout: seconds any one wait may take (a value from another stage, creating the
            actors); a step may take ``2 × timeout``.
        address: the Ray cluster (see ``init``); None: the one this process is connected
            to, else ``$RAY_ADDRESS``, else a new local cluster.
        actor_options: extra ``.options(...)`` for every actor (e.g. ``num_gpus``,
            ``resources``); default ``num_cpus=1``, ``scheduling_strategy="SPREAD"``.
        reuse_state: do not resend state an actor returned last step (identity).
        connect_timeout: seconds to reach the cluster (``init``; default
            ``min(timeout, CONNECT_TIMEOUT_S)``).

    Usable as a context manager (``close()`` on exit). An executor that failed for good (a
    dead actor, a stage that did not stop) kills its actors at once.

    Attributes:
        actors: the actor handles by stage; last_records: the last step's task records
        (``time.time()`` clock); last_step_s: its wall-clock seconds on the driver;
        last_stage_s: seconds each stage spent in it; last_sent_bytes: bytes the driver put
        in the object store for it; last_kept: arguments an actor reused instead;
        info: the ``RayInfo``.
    """

    def __init__(self, specs: Sequence[Any], cluster: Any = None,
                 timeout: float = DEFAULT_TIMEOUT_S, address: str | None = None,
                 actor_options: Mapping[str, Any] | None = None, reuse_state: bool = True,
                 connect_timeout: float | None = None):
        ray = _ray()
        self.info = init(address, timeout=connect_timeout or min(timeout, CONNECT_TIMEOUT_S))
        self.specs = list(specs)
        self.cluster = cluster
        self.timeout = timeout
        self.reuse_state = reuse_state
        self.last_records: list = []
        self.last_step_s = 0.0
        self.last_stage_s: list[float] = []
        self.last_sent_bytes = 0
        self.last_kept = 0
        self._step = 0
        self._closed = False
        self._broken: str | None = None
        self._inflight: list = []                           # the last step's run_step calls
        self._puts: dict[int, tuple[Any, Any]] = {}      # id -> (jax array, ObjectRef)
        self._returned: dict[int, tuple[Any, int, int]] = {}  # id -> (array, stage, ref)
        self._returned_step = 0                                # the step they came from
        cls = ray.remote(StageActor)
        self.actors = []
        self._cpus = 0.0
        try:
            for spec in self.specs:
                n = int(np.prod(spec.mesh_shape))
                opts = {"num_cpus": 1, "max_concurrency": ACTOR_CONCURRENCY,
                        "scheduling_strategy": "SPREAD", "max_restarts": 0,
                        "runtime_env": {"env_vars": {"XLA_FLAGS": xla_flags(n)}}}
                opts.update(actor_options or {})
                self._cpus += float(opts.get("num_cpus") or 0)
                self.actors.append(cls.options(**opts).remote(spec, n))
            self._describe = self._collect([a.describe.remote() for a in self.actors],
                                           "creating the stage actor", timeout)
        except BaseException:  # Ctrl-C included: never leave actors behind
            self.close()
            raise
        for a in self.actors:
            a.set_peers.remote(self.actors)
        self._args = [tuple(d["args"]) for d in self._describe]

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _collect(self, refs: list, what: str, timeout: float) -> list:
        """Results of one call per stage; on failure, every failed stage named (in stage
        order, after giving the others a few seconds to fail too) and the actors killed."""
        ray = _ray()
        pending = list(refs)
        deadline = time.monotonic() + timeout
        try:
            while pending and time.monotonic() < deadline:  # slices: Ctrl-C gets through
                left = deadline - time.monotonic()
                done, pending = ray.wait(pending, num_returns=len(pending),
                                         timeout=max(0.0, min(left, threads.WAIT_SLICE_S)))
                for r in done:
                    ray.get(r, timeout=0)  # a failure raises now
            if not pending:
                return ray.get(refs, timeout=0)
        except Exception as first:
            ray.wait(refs, num_returns=len(refs), timeout=min(timeout, 10.0))
            errors = []
            for s, r in enumerate(refs):
                try:
                    ray.get(r, timeout=0)
                except ray.exceptions.GetTimeoutError:
                    continue
                except Exception as e:
                    errors.append((s, e))
            self.close()
            if not errors:
                raise ExecutorError(f"{what}: {_why(ray, first)}") from first
            msgs = [f"stage {s}: {what} failed: {_why(ray, e)}" for s, e in errors]
            more = f" (other stages: {'; '.join(msgs[1:])})" if len(msgs) > 1 else ""
            raise ExecutorError(msgs[0] + more, stage=errors[0][0],
                                failure=Failure.PROGRAM) from errors[0][1]
        waiting = [s for s, r in enumerate(refs) if r in pending]
        hint = self._resources_hint(ray)
        self.close()
        raise ExecutorError(f"stage {waiting[0]}: {what} did not finish within "
                            f"{timeout:.0f} s (stages waiting: {waiting}){hint}",
                            stage=waiting[0], failure=Failure.STALLED)

    def _resources_hint(self, ray) -> str:
        """Why actors may wait: too few free CPUs (e.g. held by executors not closed)."""
        try:
            free = float(ray.available_resources().get("CPU", 0.0))
            total = float(ray.cluster_resources().get("CPU", 0.0))
        except Exception:  # noqa: BLE001 - only a hint
            return ""
        if free >= self._cpus:
            return ""
        return (f"; the cluster has {free:g} of {total:g} CPUs free and these "
                f"{len(self.actors)} actors ask for {self._cpus:g}: close executors you no "
                f"longer use (step.close())")

    def _put(self, ray, x: Any, keep: dict) -> Any:
        """``x`` in the object store; a jax array (immutable) passed again as the same object
        reuses its ``ObjectRef``. ``keep`` collects this step's reusable entries."""
        import jax

        hit = keep.get(id(x)) or self._puts.get(id(x))
        if hit is not None and hit[0] is x:
            keep[id(x)] = hit
            return hit[1]
        host = np.asarray(x)
        self.last_sent_bytes += host.nbytes
        ref = ray.put(host)
        if isinstance(x, jax.Array):
            keep[id(x)] = (x, ref)
        return ref

    # ------------------------------------------------------------------ one step
    def run(self, flat_args: Sequence[Any]) -> dict[int, Any]:
        """One step: flat arguments in, ``ref -> value`` of the step's stage results out
        (jax arrays on this process's default device).

        Raises:
            ExecutorError: a stage failed, its actor died, or the step did not finish within
                ``2 × timeout`` (the root cause first); the executor is closed or failed
                earlier.
            KeyboardInterrupt: interrupted (the step is aborted on every actor).
        """
        import jax.numpy as jnp

        ray = _ray()
        if self._closed:
            raise ExecutorError("the Ray executor is closed")
        self._settle(ray)
        if self._broken:
            raise ExecutorError(f"the Ray executor failed earlier and cannot run more steps: "
                                f"{self._broken}; its actors were released, build a new step "
                                f"(rhino.auto_parallel(...)) to start fresh ones")
        self._step += 1
        step = self._step
        t0 = time.perf_counter()
        keep: dict[int, tuple[Any, Any]] = {}
        self.last_sent_bytes, self.last_kept = 0, 0
        calls = []
        for s, actor in enumerate(self.actors):
            kept, refs, values = {}, [], []
            for r in self._args[s]:
                x = flat_args[r]
                back = self._returned.get(id(x))
                if self.reuse_state and back is not None and back[0] is x and back[1] == s:
                    kept[r] = back[2]
                    self.last_kept += 1
                    continue
                refs.append(r)
                values.append(self._put(ray, x, keep))
            calls.append(actor.run_step.remote(step, self.timeout, self._returned_step,
                                               kept, tuple(refs), *values))
        self._puts = keep
        self._inflight = calls
        try:
            results = self._wait_step(ray, step, calls)
        except KeyboardInterrupt:
            self._abort(step, "interrupted (KeyboardInterrupt)")
            raise
        self._inflight = []
        outs: dict[int, Any] = {}
        returned: dict[int, tuple[Any, int, int]] = {}
        records = []
        self.last_stage_s = []
        for s, (host, rec, secs) in enumerate(results):
            for r, v in host.items():
                x = jnp.asarray(v)
                outs[r] = x
                returned[id(x)] = (x, s, r)
            records.extend(rec)
            self.last_stage_s.append(secs)
        self._returned, self._returned_step = returned, step
        self.last_records = records
        self.last_step_s = time.perf_counter() - t0
        return outs

    def _settle(self, ray) -> None:
        """Before a step: the last step's calls must have ended (an interrupted step's
        stages stop at their next wait); one still running after ``ABORT_GRACE_S`` is stuck:
        the executor fails for good and releases its actors."""
        if self._broken or not self._inflight:
            return
        calls, deadline = self._inflight, time.monotonic() + ABORT_GRACE_S
        pending = list(calls)
        while pending and time.monotonic() < deadline:
            _, pending = ray.wait(pending, num_returns=len(pending),
                                  timeout=threads.WAIT_SLICE_S)
        if pending:
            stuck = [s for s, c in enumerate(calls) if c in pending]
            self._fail(f"stage(s) {stuck} still running step {self._step} "
                       f"{ABORT_GRACE_S:.0f} s after it was aborted")
        self._inflight = []

    def _wait_step(self, ray, step: int, calls: list) -> list:
        """Every stage's result, or ``ExecutorError`` for the root cause (see the module
        docstring): a dead actor raises at once; otherwise the other stages, aborted, get
        ``ABORT_GRACE_S`` to stop so that the actors are idle before the next step."""
        pending = {c: s for s, c in enumerate(calls)}
        results: dict[int, Any] = {}
        errors: list[ExecutorError] = []
        start = time.monotonic()
        deadline = start + 2 * self.timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                stuck = sorted(pending.values())
                took = time.monotonic() - start
                errors += [ExecutorError(f"stage {s}: the step did not finish within "
                                         f"{took:.0f} s", stage=s, failure=Failure.STALLED)
                           for s in stuck]
                self._abort(step, f"stage(s) {stuck} did not finish")
                self._fail(f"stage(s) {stuck} did not finish step {step}")
                break
            ready = ray.wait(list(pending), num_returns=1,
                             timeout=min(left, threads.WAIT_SLICE_S))[0]
            for c in ready:
                s = pending.pop(c)
                try:
                    results[s] = ray.get(c, timeout=0)
                except Exception as e:
                    errors.append(_stage_error(ray, s, e))
                    if len(errors) == 1:
                        self._abort(step, str(errors[-1]))
                        deadline = min(deadline, time.monotonic() + ABORT_GRACE_S)
                    if _is_dead(ray, e):
                        self._fail(str(errors[-1]))
                        pending.clear()  # the executor cannot run again: do not wait
                        break
        if errors:
            raise root_cause(errors)
        return [results[s] for s in range(len(calls))]

    def _abort(self, step: int, why: str) -> None:
        for a in self.actors:
            try:
                a.abort.remote(step, why)
            except Exception:  # a dead actor: nothing to abort
                pass

    def _fail(self, why: str) -> None:
        """The executor cannot run again: say why from now on, and free the actors (their
        CPUs, devices and memory) at once instead of at ``close()``."""
        if self._broken is None:
            self._broken = why
        self._kill_actors()

    def _kill_actors(self) -> None:
        ray = _ray()
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead or gone
                pass
        self._inflight = []

    def close(self) -> None:
        """Kill the actors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._kill_actors()
        finally:
            self._puts.clear()
            self._returned.clear()


def _is_dead(ray, e: BaseException | None) -> bool:
    return isinstance(e, ray.exceptions.RayActorError)


def _why(ray, e: BaseException) -> str:
    """A one-line reason: the original exception of a task, or how an actor died."""
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    if isinstance(e, ray.exceptions.RayActorError):
        text = _ANSI.sub("", str(e)).strip()
        if getattr(e, "actor_init_failed", False):
            # The creation task's traceback ends with the exception raised in __init__.
            raised = [ln.strip() for ln in text.splitlines() if _RAISED.match(ln.strip())]
            what = _RAISED.sub(r"\1", raised[-1]) if raised else text.splitlines()[0]
            return f"the actor failed to start ({what})"
        first = text.splitlines()[0] if text else ""
        return f"the actor died ({type(e).__name__}: {first})"
    text = str(e)
    return text if isinstance(e, ExecutorError) else f"{type(e).__name__}: {text}"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception): )")


def _stage_error(ray, stage: int, e: BaseException) -> ExecutorError:
    """``stage s: ...`` as an ``ExecutorError``; a StageWorker's error already names stage
    and task (and says what kind of failure it was)."""
    why = _why(ray, e)
    cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
    named = isinstance(cause, ExecutorError) and cause.stage is not None
    msg = why if named or why.startswith(f"stage {stage}") else f"stage {stage}: {why}"
    out = ExecutorError(msg, stage=cause.stage if named else stage,
                        failure=(cause.failure if isinstance(cause, ExecutorError) else None)
                        or Failure.PROGRAM)
    if isinstance(cause, ExecutorError):
        out.at = cause.at
    return out
