"""The Ray executor: one actor per host of every stage's mesh, values between stages device to
device through JAX's transfer servers (every actor in one ``jax.distributed`` job), the
training state kept on the actors. ``init`` (``ray/cluster.py``)
connects to (or starts) a Ray cluster; it is exposed as ``rhino.init``.

Only the modules of ``rhino.runtime.ray`` import ray, and only inside functions and
the actors, so ``import rhino`` never imports ray.

Layout of one step (2 stages; stage 1's mesh spans two hosts)::

    driver ── run_step(step, batch refs) ──► actor (0, host 0): stage 0, N local devices
           ── run_step(step, batch refs) ──► actor (1, host 0) ┐ stage 1: one mesh
           ── run_step(step, batch refs) ──► actor (1, host 1) ┘ over two hosts
                                        │  send / recv: device to device by JAX's
                                        │   transfer servers (pull by uuid), every actor
                                        │   one process of the run's jax.distributed job
           ◄── (0-d results as numpy, shapes of the rest, task records) ──┘

* Interleaved 1F1B (``virtual_stages > 1``): device group ``g`` holds stages ``g, g + p,
  ...`` on one mesh, so its hosts are one actor each running all those stages (a
  ``GroupWorker``; ``runtime.ray.actor``): 2 groups x 2 virtual stages are 2 actors for 4
  stages. A value between two stages of a group stays in the actor's process. What the
  driver keys by stage (results, kept state, checkpoint parts, ``lost``) names the stage
  itself; the calls go to its group's actors.
* Start (``runtime.ray.actor``): actors are created (``XLA_FLAGS`` with
  ``--xla_force_host_platform_device_count`` = that host's devices reaches each through
  ``runtime_env``; not on GPU actors, ``num_gpus`` in ``actor_options``), actors that
  simulate hosts on one node split its cores (``pin_cpus``), every actor joins the run's
  ``jax.distributed`` job (a run of one actor too), each builds its ``StageWorker`` and
  the stages run once on zeros, so every program is compiled and every collective set up
  before the first step. A Ray cluster of several nodes but fewer than the plan's hosts is
  refused before any actor starts; on one node, hosts are simulated by actors.
* A step is one ``run_step`` call per actor. The actors are threaded (``max_concurrency``):
  ``abort`` runs while ``run_step`` waits for a value.
* Values between stages (``transport="jax"``, the only one) move device to device through
  JAX's transfer servers (``runtime.transfer.jax_transfer``): no host copy, no object store, no
  socket of rhino's. (The object store with an actor call per value and rhino's own TCP
  channels were removed after measurement: ``benchmarks/RESULTS.md``; the object store
  carries only the driver's arguments, control messages and results.)
* A result one stage keeps and another reads (a tied weight passed back in) is sent by its
  holder to the readers at the start of the step, through the same transport.
* State on the workers: results with at least one dimension stay in the actors and come
  back as ``RemoteArray`` handles (shape and dtype; ``np.asarray``, ``rhino.fetch`` or
  ``.fetch()`` bring the value). Passed back in as the next step's arguments they move
  nothing; 0-d results (losses, metrics, counters) come back as arrays. Steady state moves
  the batch in and the metrics out (``last_sent_bytes``, ``last_received_bytes``).
  ``keep_state=False`` brings every result back each step instead. Handles and 0-d
  results take the step's result types (``StagedRun``: dtype, weak type, typed PRNG
  keys), so passed back they hit the plan made for the first call.
* Batches made on the hosts (``rhino.host_data(fn, like, step=i)`` in place of the batch;
  ``runtime.state.host_data``): ``run_step``'s control message names per batch leaf the source,
  the step and the rows this actor needs (all on a stage of one host, its devices' rows
  on a stage spanning hosts: ``describe()["rows"]``); the actor calls ``fn(HostRequest)``
  and places the rows. ``fn`` (user code) is pickled by value with ``ray.cloudpickle``
  and sent to each actor once. The driver sends no batch bytes (``last_sent_bytes`` 0
  with the state kept); ``last_control_bytes`` does not grow with the batch.
* Failures: every wait has a timeout. A dead actor (``RayActorError``), an error on a stage
  or a step that does not finish within ``2 × timeout`` raises ``ExecutorError`` naming the
  stage (and host, and the task, from the ``StageWorker``; the root cause first,
  ``executor.root_cause``); the other actors' waits are aborted, so nothing hangs. Ctrl-C
  aborts the step in flight. A failed step costs that step, not the run:
  - an error on a stage, a timeout or a stall: the actors drop what the failed step made
    and keep everything else, so the state the step was given stays readable
    (``fetch``, ``rhino.save_checkpoint``) and the next step runs from it. A stage still
    busy with the aborted step (stuck in a program, or stopped) holds the next step up:
    it is refused after ``grace`` seconds naming that stage, and runs once the stage
    stops;
  - a dead actor: the run's ``jax.distributed`` job lost a process, so no step can run
    again (``lost``: the stages whose actors died). The actors of the other stages stay
    until ``close()``: what they hold stays readable (when no stage is left, or none held
    state yet, every actor is released at once); a handle of a lost stage raises naming
    what was lost and how to resume (the last checkpoint, and a step starting new
    actors: ``StagedRun`` makes a new executor when called again).

Example:
    >>> import rhino
    >>> info = rhino.init(num_cpus=4)                           # doctest: +SKIP
    >>> step = rhino.auto_parallel(m.step, cluster="2x4", stages=1,
    ...                            executor="ray")              # doctest: +SKIP
    >>> params, opt, loss = step(params, opt, batch)            # doctest: +SKIP
    >>> rhino.fetch(params)          # numpy, from the actors   # doctest: +SKIP
    >>> batch = rhino.host_data(make_rows, like, step=1)  # made on the actors # doctest: +SKIP
    >>> params, opt, loss = step(params, opt, batch)            # doctest: +SKIP
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from rhino.runtime import threads
from rhino.runtime.executors.local import DEFAULT_TIMEOUT_S, ExecutorError, Failure, root_cause
from rhino.runtime.executors.group_worker import device_groups  # noqa: F401 (re-export)
from rhino.runtime.failures import RESUME
from rhino.runtime.ray.actor import StageActor, stages_name
from rhino.runtime.ray.arguments import SMALL_ARG_BYTES, StepArguments
from rhino.runtime.ray.cluster import (ABORT_GRACE_S, ACTOR_CONCURRENCY, CONNECT_TIMEOUT_S,
                                       RayInfo, check_plan, import_ray, init, share_cores,
                                       xla_flags)
from rhino.runtime.ray.errors import is_dead, stage_error, unlabelled, why_failed
from rhino.runtime.state.remote_array import PackedKey, RemoteArray, fetch, pack_key, unpack_key
from rhino.runtime.scheduling.timeline import TaskRecord
from rhino.vocabulary import removed_transport

RAY_TRANSPORTS = ("jax",)
"""How values cross stages on Ray: device to device by JAX's transfer servers, every actor
in one ``jax.distributed`` job (``runtime.transfer.jax_transfer``)."""

__all__ = ["RayExecutor", "RemoteArray", "SMALL_ARG_BYTES", "fetch", "init", "RayInfo", "xla_flags"]


def actor_platform(actor_options: Mapping[str, Any] | None) -> str:
    """What the actors' JAX runs on: ``cuda`` where they are given GPUs (``num_gpus``), else
    ``cpu`` (hosts simulated by forced host devices)."""
    return "cuda" if (actor_options or {}).get("num_gpus") else "cpu"


def _artifacts(specs: Sequence[Any], actor_options: Mapping[str, Any]) -> list:
    """``specs`` as ``StageArtifact``s: a ``WorkerSpec`` is split here (the driver has the
    user's code) and its programs exported for the actors' platform (``cuda`` where the
    actors are given GPUs, else ``cpu``)."""
    from rhino.runtime.executors.artifacts import StageArtifact, export_stages

    todo = [s for s in specs if not isinstance(s, StageArtifact)]
    if not todo:
        return list(specs)
    made = iter(export_stages(todo, todo[0].split(), actor_platform(actor_options),
                              with_code=True))
    return [s if isinstance(s, StageArtifact) else next(made) for s in specs]


def hosts_per_stage(specs: Sequence[Any], cluster: Any) -> list[int]:
    """Host processes per stage: its devices over the cluster's devices per host (one
    host without a cluster)."""
    out = []
    for spec in specs:
        n = int(np.prod(spec.mesh_shape))
        per = getattr(cluster, "devices_per_host", None) or n
        out.append(max(1, -(-n // per)))
    return out


class RayExecutor:
    """Every stage as Ray actors, one per host of its mesh (same interface as
    ``LocalExecutor``; and batches made on the hosts, ``rhino.host_data``).

    Args:
        specs: one ``WorkerSpec`` (or ``StageArtifact``) per stage, in stage order; with
            ``virtual_stages > 1`` each device group's stages share its actors.
        cluster: the plan's ``Cluster`` (hosts per stage, the node check, messages).
        timeout: seconds any one wait may take (a value from another stage, starting the
            actors, joining a job); a step may take ``2 × timeout``.
        address: the Ray cluster (see ``init``); None: the one this process is connected
            to, else ``$RAY_ADDRESS``, else a new local cluster.
        actor_options: extra ``.options(...)`` for every actor (e.g. ``num_gpus``,
            ``resources``); default ``num_cpus=1``, ``scheduling_strategy="SPREAD"``. With
            ``num_gpus`` the actor uses the GPUs Ray gives it (no forced host devices).
        reuse_state: do not resend state an actor kept from last step.
        connect_timeout: seconds to reach the cluster (``init``; default
            ``min(timeout, CONNECT_TIMEOUT_S)``).
        hosts: host processes per stage (default ``hosts_per_stage``).
        host_ids: per stage, the plan's host of each of its actors (``StagePlan.hosts``;
            default: stage by stage, 0, 1, ...). On a Ray cluster of several nodes, one
            placement group bundle per plan host (``STRICT_SPREAD``: each on its own node)
            holds that host's actors, unless ``actor_options`` sets a scheduling strategy.
        keep_state: results with dimensions stay on the actors (``RemoteArray``).
        transport: how values cross stages: ``"jax"`` (``RAY_TRANSPORTS``; JAX's transfer
            servers, device to device; the nodes must reach each other on any port, as
            ``jax.distributed`` needs). ``"object_store"`` and ``"direct"`` were removed:
            an error naming that.
        pin_cpus: actors that simulate hosts (forced host devices, no ``num_gpus``) and
            share a node split its cores, as hosts do not share theirs: each actor's threads
            (XLA's included, sized to them) keep to its own share. None (default): where the
            node has at least as many cores as such actors; True: also, and a node with
            fewer is an error; False: never (each actor may use every core).

    Usable as a context manager (``close()`` on exit). An executor that failed for good (a
    dead actor, a stage that did not stop) kills its actors at once.

    Attributes:
        actors: every actor, stage by stage (``groups``: per stage; under virtual stages
        the stages of a device group share one list); owners: (stage, host) per actor (a
        device group's actors: its first stage; ``units``: per actor's first stage, every
        stage it runs); last_records: the last step's task records (``time.time()`` clock, the
        first host's); last_step_s: its wall-clock seconds on the driver; last_stage_s:
        seconds each stage spent in it; last_sent_bytes / last_received_bytes: bytes the
        driver put in the object store for it (or inside the calls) / received from it;
        last_control_bytes: the pickled control messages of its calls (what else the
        actors need: kept results, host_data requests); fetched_bytes: bytes
        ``fetch`` brought so far;
        last_kept: arguments an actor reused instead; warm_up_s: the zeros step per actor;
        pinned: per actor, the cores it keeps to (None: not pinned); info: the ``RayInfo``.
    """

    takes_host_data = True
    """``run`` takes ``HostLeaf`` arguments (``rhino.host_data``): each actor makes them."""

    def __init__(self, specs: Sequence[Any], cluster: Any = None,
                 timeout: float = DEFAULT_TIMEOUT_S, address: str | None = None,
                 actor_options: Mapping[str, Any] | None = None, reuse_state: bool = True,
                 connect_timeout: float | None = None, hosts: Sequence[int] | None = None,
                 keep_state: bool = True, host_ids: Sequence[Sequence[int]] | None = None,
                 transport: str = "jax", pin_cpus: bool | None = None):
        if transport not in RAY_TRANSPORTS:
            raise ExecutorError(f"transport: expected one of {list(RAY_TRANSPORTS)} for the "
                                f"Ray executor, found {transport!r}"
                                f"{removed_transport(transport)}")
        self.transport = transport
        ray = import_ray()
        self.info = init(address, timeout=connect_timeout or min(timeout, CONNECT_TIMEOUT_S))
        self.specs = list(specs)
        self.cluster = cluster
        self.timeout = timeout
        self.reuse_state, self.keep_state = reuse_state, keep_state
        # Per device group, keyed by its first stage: the stages its actors run (a stage
        # each without virtual stages; interleaved-1f1b: group g runs g, g + p, ...).
        self.units = device_groups(self.specs)
        self._first = {c: g for g, cs in self.units.items() for c in cs}
        if host_ids is not None:
            self.hosts = [len(h) for h in host_ids]
        else:
            self.hosts = list(hosts) if hosts is not None else hosts_per_stage(self.specs,
                                                                               cluster)
            first = dict(zip(self.units, np.cumsum([0] + [self.hosts[g]
                                                          for g in self.units])))
            host_ids = [range(first[self._first[s]], first[self._first[s]] + h)
                        for s, h in enumerate(self.hosts)]
        self.host_ids = [tuple(int(x) for x in h) for h in host_ids]
        for c, g in self._first.items():
            if self.host_ids[c] != self.host_ids[g] or \
                    tuple(self.specs[c].mesh_shape) != tuple(self.specs[g].mesh_shape):
                raise ExecutorError(f"stage {c}: expected the mesh and hosts of stage {g} "
                                    f"(one device group), found mesh "
                                    f"{tuple(self.specs[c].mesh_shape)} on hosts "
                                    f"{self.host_ids[c]} and {tuple(self.specs[g].mesh_shape)}"
                                    f" on {self.host_ids[g]}", stage=c)
        self.placement_group = None
        self._records: list = []             # per first host: (clock shift, raw records)
        self._made_records: list | None = []  # last_records, made when first read
        self.last_step_s = 0.0
        self.last_stage_s: list[float] = []
        self.last_sent_bytes = self.last_received_bytes = self.last_kept = 0
        self.last_control_bytes = 0
        self.fetched_bytes = 0
        self._step = 0
        self.arguments = StepArguments(self, reuse_state)
        self._closed = False
        self._broken: str | None = None   # why no step can run again (a process died)
        self.lost: dict[int, str] = {}    # stage -> how its actor died
        self._released = False            # the actors were killed
        self._inited = False              # init_state made state on the actors
        self.grace = ABORT_GRACE_S         # how long a step waits for an aborted one
        self._last_ok = 0                  # the last step that finished
        self._lock = threading.RLock()   # one step or fetch at a time (collectives' order)
        self._inflight: list = []                           # the last step's run_step calls
        self._dropped: list[tuple[int, int, int]] = []  # (stage, step, ref) handles dropped
        self._failed_steps: list[int] = []               # their results are dropped too
        # per actor: the shapes and dtypes of the results it keeps (the same every step)
        self._meta: dict[int, dict[int, tuple]] = {}
        check_plan([int(np.prod(self.specs[g].mesh_shape)) for g in self.units],
                   [self.hosts[g] for g in self.units], [self.host_ids[g] for g in self.units],
                   self.info, actor_options or {}, self.cluster)
        self.specs = _artifacts(self.specs, actor_options or {})   # before any actor
        split = self.specs[0].split
        # result ref -> the stage producing it (a device group's actors return its stages')
        self._producer = {o.ref: o.producer[1] for o in split.outputs
                          if o.producer is not None and o.source in ("task", "acc")}
        cls = ray.remote(StageActor)
        self.actors, self.owners = [], []
        self.groups: list[list] = [[] for _ in self.specs]
        self._cpus = 0.0
        simulated: list[bool] = []
        try:
            placed = self._placement(ray, actor_options or {}, timeout)
            per_host = {}
            for s, stages in self.units.items():
                spec = self.specs[s]
                n, h = int(np.prod(spec.mesh_shape)), self.hosts[s]
                per_host[s] = n // h
                opts = {"num_cpus": 1, "max_concurrency": ACTOR_CONCURRENCY,
                        "scheduling_strategy": "SPREAD", "max_restarts": 0}
                opts.update(actor_options or {})
                if placed(s, 0):
                    del opts["scheduling_strategy"]     # the placement group's instead
                if not opts.get("num_gpus"):   # simulated host devices, unless set
                    env = dict(opts.get("runtime_env") or {})
                    env["env_vars"] = {"XLA_FLAGS": xla_flags(n // h),
                                       **(env.get("env_vars") or {})}
                    opts["runtime_env"] = env
                self._cpus += h * float(opts.get("num_cpus") or 0)
                group = [cls.options(**opts, **placed(s, r)).remote(spec.stage, r, h, stages)
                         for r in range(h)]
                for c in stages:
                    self.groups[c] = group
                self.actors.extend(group)
                self.owners.extend((s, r) for r in range(h))
                simulated += [not opts.get("num_gpus")] * h
            self.pinned = self._share_cpus(pin_cpus, simulated, timeout)
            jobs = self._one_job(timeout)
            # Plain pickle of rhino's own data and jax.export bytes: the actors never
            # unpickle, import or trace the user's code.
            blobs = {s: pickle.dumps(self.specs[s] if len(stages) == 1 else
                                     [self.specs[c] for c in stages])
                     for s, stages in self.units.items()}
            self._describe = self._collect(
                [a.setup.remote(blobs[s], per_host[s], job, timeout, cpus)
                 for a, (s, _), cpus, job in zip(self.actors, self.owners, self.pinned,
                                                 jobs)],
                "starting the stage", timeout, self.owners, close=True)
            self.warm_up_s = self._collect([a.warm_up.remote(timeout) for a in self.actors],
                                           "warming up the stage", 2 * timeout, self.owners,
                                           close=True)
        except BaseException:  # Ctrl-C included: never leave actors behind
            self.close()
            raise
        self._args = [tuple(self._describe[self.owners.index((self._first[s], 0))]
                            ["stage_args"][s]) for s in range(len(self.specs))]

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _one_job(self, timeout: float) -> list:
        """Per actor, its part of the run's one ``jax.distributed`` job (every actor is one
        of its processes, whatever the plan: a single-stage SPMD run and a run of one actor
        too): the coordinator (on the first actor's node), the processes, its own, which
        processes run each stage and every stage's layouts."""
        coord = self._collect([self.actors[0].coordinator.remote()],
                              "finding a coordinator port", timeout, self.owners[:1],
                              close=True)[0]
        stage_process = {s: tuple(i for i, o in enumerate(self.owners)
                                  if o[0] == self._first[s])
                         for s in range(len(self.specs))}
        layouts = [(tuple(a.mesh_shape), tuple(a.axis_names), dict(a.shardings.refs))
                   for a in self.specs]
        return [(coord, len(self.actors), i, stage_process, layouts)
                for i in range(len(self.actors))]

    def _share_cpus(self, pin: bool | None, simulated: Sequence[bool],
                    timeout: float) -> list[tuple[int, ...] | None]:
        """Per actor, the cores it keeps to (``pin_cpus``; ``share_cores``), or None."""
        if pin is False:
            return [None] * len(self.actors)
        found = self._collect([a.node_cpus.remote() for a in self.actors],
                              "reading the nodes' cores", timeout, self.owners, close=True)
        return share_cores(found, simulated, pin, [self._label(o) for o in self.owners])

    def _placement(self, ray, options: Mapping[str, Any], timeout: float):
        """``(stage, rank) -> extra actor options``: on a cluster of several nodes, a
        placement group with one bundle per plan host, each on its own node."""
        if self.info.nodes <= 1 or "scheduling_strategy" in options:
            return lambda s, r: {}
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        plan_hosts = sorted({h for ids in self.host_ids for h in ids})
        bundle = {h: k for k, h in enumerate(plan_hosts)}
        need: list[dict[str, float]] = [{} for _ in plan_hosts]
        for ids in (self.host_ids[g] for g in self.units):   # one actor per group and host
            for h in ids:
                b = need[bundle[h]]
                for key, opt in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
                    amount = float(options.get(opt, 1 if opt == "num_cpus" else 0) or 0)
                    if amount:
                        b[key] = b.get(key, 0.0) + amount
        pg = placement_group([b or {"CPU": 0.01} for b in need], strategy="STRICT_SPREAD")
        self.placement_group = pg
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        if not ready:
            raise ExecutorError(f"placing the plan's {len(plan_hosts)} hosts on "
                                f"{self.info.nodes} Ray nodes (one host per node, "
                                f"{need[0]} each) did not succeed within {timeout:.0f} s: "
                                f"expected nodes with those free resources")
        return lambda s, r: {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle[self.host_ids[s][r]])}

    def _label(self, owner: tuple[int, int]) -> str:
        s, r = owner
        return self._name(s) + (f" (host {r})" if self.hosts[s] > 1 else "")

    def _name(self, s: int) -> str:
        """``stage s``, or for a device group's actors ``stages 1, 3``."""
        return stages_name(self.units.get(s, (s,)))

    def _stage_of(self, ref: int, s: int) -> int:
        """The stage whose result ``ref`` is, of those the actors of owner stage ``s`` run."""
        return s if len(self.units.get(s, ())) <= 1 else self._producer.get(ref, s)

    def _collect(self, refs: list, what: str, timeout: float,
                 owners: Sequence[tuple[int, int]], close: bool = False) -> list:
        """Results of one call per actor; on failure, every failed actor named (in order,
        after giving the others a few seconds to fail too), the actors killed if ``close``
        or one died."""
        ray = import_ray()
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
            for k, r in enumerate(refs):
                try:
                    ray.get(r, timeout=0)
                except ray.exceptions.GetTimeoutError:
                    continue
                except Exception as e:
                    errors.append((k, e))
            dead = [owners[k] for k, e in errors if is_dead(ray, e)]
            if dead:
                self._lose(dead, f"{what} failed")
            if close:
                self._fail(f"{what} failed")
            if not errors:
                raise ExecutorError(f"{what}: {why_failed(ray, first)}") from first
            msgs = [f"{self._label(owners[k])}: {what} failed: "
                    f"{unlabelled(why_failed(ray, e), self._label(owners[k]))}" for k, e in errors]
            more = f" (other stages: {'; '.join(msgs[1:])})" if len(msgs) > 1 else ""
            raise ExecutorError(msgs[0] + more, stage=owners[errors[0][0]][0],
                                failure=Failure.PROGRAM) from errors[0][1]
        waiting = [owners[k] for k, r in enumerate(refs) if r in pending]
        hint = self._resources_hint(ray)
        if close:    # starting: a stage that does not start never will
            self._fail(f"{what} did not finish")
        raise ExecutorError(f"{self._label(waiting[0])}: {what} did not finish within "
                            f"{timeout:.0f} s (waiting: "
                            f"{', '.join(self._label(w) for w in waiting)}){hint}",
                            stage=waiting[0][0], failure=Failure.STALLED)

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

    def _usable(self, stages: Sequence[int] | None = None) -> None:
        """Refuse a call the executor cannot make: any when closed; a step (``stages``
        None) after a process died; a read of a lost stage's values."""
        if self._closed:
            raise ExecutorError("the Ray executor is closed")
        if not self._broken:
            return
        if stages is None:
            released = "its actors were released" if self._released else \
                "the other actors keep their values until close()"
            raise ExecutorError(f"the Ray executor failed earlier and cannot run more steps: "
                                f"{self._broken}; {released}. {RESUME}")
        gone = sorted(set(stages) & set(self.lost))
        if gone:
            raise ExecutorError(f"stage {gone[0]}: {self.lost[gone[0]]}: the values its "
                                f"actors held are lost. {RESUME}", stage=gone[0],
                                failure=Failure.PROGRAM)
        if self._released:
            raise ExecutorError(f"the Ray executor failed earlier: {self._broken}; its "
                                f"actors were released")

    # ------------------------------------------------------------------ one step
    def run(self, flat_args: Sequence[Any]) -> dict[int, Any]:
        """One step: flat arguments in, ``ref -> value`` of the step's stage results out
        (0-d: jax arrays on this process's default device; others ``RemoteArray``, or jax
        arrays with ``keep_state=False``).

        Raises:
            ExecutorError: a stage failed, its actor died, or the step did not finish within
                ``2 × timeout`` (the root cause first); the executor is closed or failed
                earlier.
            KeyboardInterrupt: interrupted (the step is aborted on every actor).
        """
        with self._lock:
            return self._run(flat_args)

    def _run(self, flat_args: Sequence[Any]) -> dict[int, Any]:
        import jax.numpy as jnp

        ray = import_ray()
        self._usable()
        self._settle(ray)
        self._usable()
        t0 = time.perf_counter()
        self.last_received_bytes = 0
        per_actor, push = self.arguments.plan(
            flat_args, self.owners, self._args,
            [d.get("rows") or {} for d in self._describe], self.units)
        self.last_sent_bytes, self.last_kept = (self.arguments.sent_bytes,
                                                self.arguments.kept)
        self._step += 1
        step = self._step
        release: dict[int, list[tuple[int, int]]] = {}
        while self._dropped:
            s, k, r = self._dropped.pop()
            release.setdefault(self._first.get(s, s), []).append((k, r))
        failed, self._failed_steps = self._failed_steps, []
        # What an actor needs besides the values goes as one pickled blob: Ray would
        # serialize each of its ~3 entries per state leaf on its own (a few ms per step).
        controls = [pickle.dumps(
            (step, self.timeout, a.kept, release.get(s, []), failed, self._last_ok,
             self.keep_state, a.partial,
             sorted((c, k, sorted(d)) for c in self.units[s]
                    for k, d in push.get(c, {}).items()),
             a.pull, tuple(a.refs), n not in self._meta, a.hosted, a.ship),
            protocol=pickle.HIGHEST_PROTOCOL)
            for n, ((s, _), a) in enumerate(zip(self.owners, per_actor))]
        self.last_control_bytes = sum(len(c) for c in controls)
        calls = [actor.run_step.remote(c, *a.values)
                 for actor, c, a in zip(self.actors, controls, per_actor)]
        self._inflight = calls
        try:
            results = self._wait_step(ray, step, calls)
        except BaseException:
            # What the step made is dropped at the next step; what it was given is kept.
            self._failed_steps.append(step)
            if not isinstance(sys.exc_info()[1], KeyboardInterrupt):
                raise
            self._abort(step, "interrupted (KeyboardInterrupt)")
            raise
        self._inflight = []
        outs: dict[int, Any] = {}
        returned: dict[int, tuple[Any, int, int, int]] = {}
        records = []
        self.last_stage_s = [0.0] * len(self.groups)
        for n, ((s, rank), blob) in enumerate(zip(self.owners, results)):
            host, meta, rec, secs = pickle.loads(blob)
            meta = self._meta.setdefault(n, meta)
            for c in self.units[s]:     # a device group's stages: the group's seconds
                self.last_stage_s[c] = max(self.last_stage_s[c], secs)
            if rank:
                continue
            for r, v in host.items():
                self.last_received_bytes += getattr(v, "nbytes", 0) or v.data.nbytes
                x = unpack_key(v) if isinstance(v, PackedKey) else jnp.asarray(v)
                outs[r] = x
                returned[id(x)] = (x, self._stage_of(r, s), r, step)
            for r, (shape, dtype) in meta.items():
                outs[r] = RemoteArray(self, self._stage_of(r, s), r, step, shape, dtype)
            records.append(rec)
        self.arguments.returned = returned
        self._last_ok = step
        self._records, self._made_records = records, None
        self.last_step_s = time.perf_counter() - t0
        return outs

    @property
    def last_records(self) -> list[TaskRecord]:
        """The last step's task records, on the ``time.time()`` clock (made when read)."""
        if self._made_records is None:
            self._made_records = [
                TaskRecord(st, label, start + shift, end + shift, mb, kind)
                for shift, raw in self._records
                for st, label, start, end, mb, kind in raw]
        return self._made_records

    def release(self, stage: int, step: int, ref: int) -> None:
        """A handle was dropped: its actors free the value at the next step."""
        self._dropped.append((stage, step, ref))

    def fetch(self, handles: Sequence[RemoteArray]) -> list[np.ndarray]:
        """The values of ``handles`` (this executor's, of its last step) as numpy (typed
        PRNG key arrays as jax key arrays: numpy has no key type).

        Raises:
            ExecutorError: a handle of another step (released) or executor, the executor is
                closed, or an actor failed or did not answer within ``timeout``.
        """
        with self._lock:
            wanted: dict[int, list[int]] = {}     # per device group (first stage)
            for h in handles:
                if h.executor is not self:
                    raise ExecutorError(f"fetch: expected results of this executor, found "
                                        f"{h!r} of another")
                wanted.setdefault(self._first[h.stage], []).append((h.step, h.ref))
            self._usable(sorted({h.stage for h in handles}))
            calls, owners = [], []
            for s, keys in wanted.items():
                for r, a in enumerate(self.groups[s]):
                    calls.append(a.fetch.remote(tuple(dict.fromkeys(keys))))
                    owners.append((s, r))
            got = self._collect(calls, "fetching results", self.timeout, owners)
            values: dict[tuple[int, int, int], np.ndarray] = {}
            for (s, rank), d in zip(owners, got):
                if rank == 0:
                    for k, v in d.items():
                        # A typed PRNG key array comes as its bits: a key array again.
                        self.fetched_bytes += v.data.nbytes if isinstance(
                            v, PackedKey) else v.nbytes
                        values[(s, *k)] = unpack_key(v)
            return [values[(self._first[h.stage], h.step, h.ref)] for h in handles]

    def init_state(self, init_fn: Any, init_args: tuple, num_leaves: int) -> list[Any]:
        """The step's first ``num_leaves`` argument leaves made by ``init_fn(*init_args)``
        on the actors, each stage its own with its shardings (§6.3; nothing created on the
        driver but leaves no stage reads): ``RemoteArray`` handles in leaf order."""
        import jax

        from rhino.runtime.executors.artifacts import export_init

        with self._lock:
            self._usable()
            args = jax.tree_util.tree_map(pack_key, tuple(init_args))
            calls, owners = [], []
            made: dict[tuple[int, int], int] = {}   # (group, leaf) -> the stage making it
            for g, stages in self.units.items():
                group = self.groups[g]
                parts = []
                for s in stages:    # a leaf two stages of a group read: made once
                    refs = tuple(k for k in self._args[s]
                                 if k < num_leaves and (g, k) not in made)
                    if refs:
                        # The initializer goes as an exported program, never as code.
                        parts.append((s, export_init(init_fn, tuple(init_args), refs,
                                                     self.specs[s]), refs))
                        made.update(((g, k), s) for k in refs)
                if parts:
                    blob = pickle.dumps((args, parts))
                    calls += [a.init_state.remote(blob) for a in group]
                    owners += [(g, r) for r in range(len(group))]
            got = self._collect(calls, "initializing the state", 2 * self.timeout, owners)
            self._inited = True
            out: list[Any] = [None] * num_leaves
            for (g, rank), d in zip(owners, got):
                for k, (shape, dtype) in (d.items() if rank == 0 else ()):
                    if out[k] is None:
                        out[k] = RemoteArray(self, made[(g, k)], k, 0, shape, dtype)
            unread = [k for k, x in enumerate(out) if x is None]
            if unread:   # no stage reads them: any value does; made here
                leaves = jax.jit(lambda *a: [jax.tree_util.tree_leaves(init_fn(*a))[k]
                                             for k in unread])(*init_args)
                for k, v in zip(unread, leaves):
                    out[k] = v
            return out

    def save_part(self, directory: str, stage: int,
                  names: Mapping[str, tuple[int, int]]) -> None:
        """``stage``'s actors write the results ``names`` (name -> (step, ref)) as one
        orbax checkpoint at ``directory`` (``runtime.state.checkpoint``)."""
        with self._lock:
            self._usable([stage])
            group = self.groups[stage]
            self._collect([a.save_part.remote(directory, dict(names)) for a in group],
                          f"writing checkpoint part {directory}", self.timeout,
                          [(self._first[stage], r) for r in range(len(group))])

    def collectives(self) -> list[dict]:
        """Per stage, its first host's ``StageWorker.collectives()`` (compiled programs)."""
        with self._lock:
            self._usable()
            firsts = [g[0] for g in self.groups]
            return self._collect([a.collectives.remote(s) for s, a in enumerate(firsts)],
                                 "reading the compiled programs", self.timeout,
                                 [(self._first[s], 0) for s in range(len(firsts))])

    def _settle(self, ray) -> None:
        """Before a step: the last step's calls must have ended (an aborted step's stages
        stop at their next wait). One still running after ``grace`` seconds (stuck in a
        program, or its process stopped) holds this step up: ``ExecutorError`` naming it;
        the executor stays usable, and the state it was given stays on the actors."""
        if self._broken or not self._inflight:
            return
        calls, deadline = self._inflight, time.monotonic() + self.grace
        pending = list(calls)
        while pending and time.monotonic() < deadline:
            _, pending = ray.wait(pending, num_returns=len(pending),
                                  timeout=threads.WAIT_SLICE_S)
        if pending:
            stuck = sorted({c for k, call in enumerate(calls) if call in pending
                            for c in self.units[self.owners[k][0]]})
            raise ExecutorError(
                f"stage(s) {stuck} still running step {self._step} (aborted; stuck in a "
                f"program or a wait, or its process stopped) after {self.grace:.0f} s more: "
                f"no step can run until it stops. The state the failed step was given is "
                f"kept on the actors: call the step again with it later, or save it "
                f"(rhino.save_checkpoint) once the stage answers; step.close() releases the "
                f"actors", stage=stuck[0], failure=Failure.STALLED)
        self._inflight = []

    def _wait_step(self, ray, step: int, calls: list) -> list:
        """Every actor's result, or ``ExecutorError`` for the root cause (see the module
        docstring): a dead actor raises at once; otherwise the other stages, aborted, get
        ``ABORT_GRACE_S`` to stop so that the actors are idle before the next step."""
        pending = {c: k for k, c in enumerate(calls)}
        results: dict[int, Any] = {}
        errors: list[ExecutorError] = []
        start = time.monotonic()
        deadline = start + 2 * self.timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                stuck = sorted({self.owners[k][0] for k in pending.values()})
                took = time.monotonic() - start
                errors += [ExecutorError(f"{self._name(s)}: the step did not finish within "
                                         f"{took:.0f} s", stage=s, failure=Failure.STALLED)
                           for s in stuck]
                stuck = sorted(c for s in stuck for c in self.units[s])
                # Aborted, not killed: the state stays on the actors; the next step waits
                # for these stages to stop (``_settle``).
                self._abort(step, f"stage(s) {stuck} did not finish")
                break
            ready = ray.wait(list(pending), num_returns=1,
                             timeout=min(left, threads.WAIT_SLICE_S))[0]
            for c in ready:
                k = pending.pop(c)
                s = self.owners[k][0]
                try:
                    results[k] = ray.get(c, timeout=0)
                except Exception as e:
                    errors.append(stage_error(ray, s, e, self._label(self.owners[k])))
                    if len(errors) == 1:
                        self._abort(step, str(errors[-1]))
                        deadline = min(deadline, time.monotonic() + ABORT_GRACE_S)
                    if is_dead(ray, e):
                        self._lose([self.owners[k]], str(errors[-1]))
                        pending.clear()  # the executor cannot run again: do not wait
                        break
        if errors:
            raise root_cause(errors)
        return [results[k] for k in range(len(calls))]

    def _abort(self, step: int, why: str) -> None:
        for a in self.actors:
            try:
                a.abort.remote(step, why)
            except Exception:  # a dead actor: nothing to abort
                pass

    def _lose(self, owners: Sequence[tuple[int, int]], why: str) -> None:
        """Actors of ``owners`` died: no step can run again (the job lost a process). The
        other actors stay until ``close()``, so that what they hold stays readable."""
        for g, _ in owners:
            for s in self.units.get(g, (g,)):   # every stage of a device group's actors
                self.lost.setdefault(s, "its actor died" if self.hosts[s] == 1 else
                                     "an actor of its hosts died")
        if self._broken is None:
            self._broken = why
        if (not self._last_ok and not self._inited) or len(self.lost) == len(self.groups):
            self._fail(why)          # nothing left to read: free the CPUs at once
        else:                        # the other hosts of a lost stage hold no whole value
            self._kill_actors([a for a, (s, _) in zip(self.actors, self.owners)
                               if s in self.lost])
        self._inflight = []

    def _fail(self, why: str) -> None:
        """The executor cannot run again: say why from now on, and free the actors (their
        CPUs, devices and memory) at once instead of at ``close()``."""
        if self._broken is None:
            self._broken = why
        self._kill_actors()

    def _kill_actors(self, actors: Sequence[Any] | None = None) -> None:
        """Kill ``actors`` (default: every actor, and the executor's actors are released)."""
        if actors is None:
            self._released = True
        ray = import_ray()
        for a in self.actors if actors is None else actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead or gone
                pass
        self._inflight = []

    def close(self) -> None:
        """Kill the actors (idempotent); their ``RemoteArray`` results are gone."""
        if self._closed:
            return
        self._closed = True
        try:
            self._kill_actors()
            if self.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.placement_group)
        finally:
            self.arguments.clear()
