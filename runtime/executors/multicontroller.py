"""Pipelined plans in a multi-controller job: every process runs the stages whose devices it
holds, values between stages on different processes move through JAX's transfer servers
(``runtime.transfer.jax_transfer``), and every process ends a step with every result: its own
stages' arrays, the other processes' 0-d results (losses, metrics) received, and for their arrays a
global ``jax.Array`` with no shards here (what multi-controller JAX gives a process for an
array on other processes' devices). Passed back as the next step's state, they move nothing:
an argument a stage reads from another process (a tied weight) is sent by the process that
holds it at the start of the step.

One step on 2 processes (stage 0 on process 0, stage 1 on process 1)::

    process 0: args ─► stage 0 (local executor, its instruction list) ─► send v@mb ─►┐
               ◄── recv g@mb ◄──────────────────────────────────────────────────────┤
               recv loss (0-d) ◄────────────────────────────────────────────────────┤
    process 1: args ─► stage 1 ◄── recv v@mb; send g@mb; send loss to process 0 ───┘

Every wait has the step's timeout; an error on one process reaches the others as a timeout
naming the value they waited for. A step counts only where every process finished it: at
its end each process tells the others its outcome through the job's key-value store
(``_agree``), and a process that finished its part while a peer failed raises too, keeping
none of its results. So after a failed step every process holds the arguments it was given
and the next call runs from them (a stage still stuck in the failed step refuses it, naming
it, and every process with it); without the agreement a process could go on from the step
a peer failed, mixing the states of two steps.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax

from rhino.runtime.executors.local import DEFAULT_TIMEOUT_S, LocalExecutor
from rhino.runtime.executors.worker_spec import WorkerSpec
from rhino.runtime.failures import ExecutorError, Failure

OUTCOME_SLACK_S = 10.0
"""Seconds a process waits for its peers' outcome of a step beyond their own bound."""


def _first_line(e: BaseException) -> str:
    """What ``e`` says in one line (a traceback in the message: what was raised)."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    if len(lines) > 1 and "Traceback" in lines[0]:
        return (lines[0].split("Traceback")[0] + lines[-1].strip())[:300]
    return lines[0][:300]


def stage_processes(stage_devices: Sequence[Sequence[Any]]) -> dict[int, int]:
    """Stage -> the process holding all its devices; a stage spanning processes is refused."""
    out = {}
    for s, devs in enumerate(stage_devices):
        procs = sorted({d.process_index for d in devs})
        if len(procs) != 1:
            raise ExecutorError(f"stage {s}: its devices belong to processes {procs}; a "
                                f"stage of a pipelined plan in a multi-controller job must "
                                f"be on one process's devices (a cluster of hosts × devices "
                                f"per host, one or more stages per host)", stage=s)
        out[s] = procs[0]
    return out


class ProcessStages:
    """The stages of a pipelined plan this process runs, as an executor
    (``run(flat_args) -> ref -> value`` for every result of the step).

    Args:
        specs: every stage's ``WorkerSpec``; split: the step split (this process traced the
        step itself: every process runs the same script); stage_devices: per stage, its
        devices (global, host-major); timeout: seconds any wait may take.
    """

    def __init__(self, specs: Sequence[WorkerSpec], split: Any,
                 stage_devices: Sequence[Sequence[Any]], timeout: float = DEFAULT_TIMEOUT_S):
        from rhino.runtime.transfer.jax_transfer import JaxTransferTransport, stage_targets
        from rhino.runtime.executors.spmd import device_mesh

        self.split, self.timeout = split, timeout
        self.stage_process = stage_processes(stage_devices)
        self.process = jax.process_index()
        self.workers = [sp.build(list(stage_devices[sp.stage]), split) for sp in specs
                        if self.stage_process[sp.stage] == self.process]
        if not self.workers:
            raise ExecutorError(f"process {self.process}: no stage of the plan is on its "
                                f"devices (stages on processes {self.stage_process})")
        self._mine = {w.stage for w in self.workers}
        self._first = {}                      # process -> its first stage
        for s, p in sorted(self.stage_process.items()):
            self._first.setdefault(p, s)
        self._meshes = {sp.stage: device_mesh(sp.mesh_shape, sp.axis_names,
                                              list(stage_devices[sp.stage])) for sp in specs}
        self._specs = {sp.stage: sp for sp in specs}
        layouts = [(tuple(sp.mesh_shape), tuple(sp.axis_names), dict(sp.shardings.refs))
                   for sp in specs]
        self.transport = JaxTransferTransport(
            self.stage_process, target=stage_targets(
                {w.stage: w for w in self.workers},
                {s: list(d) for s, d in enumerate(stage_devices)}, layouts),
            connect_timeout=timeout, defer_relayout=True)
        self.local = LocalExecutor(self.workers, timeout, self.transport)
        self.last_records: list = []
        self.last_step_s = 0.0
        self._steps = 0
        # Results of other processes' stages: global arrays with no shards here, the same
        # objects every step (making ~70 of them after each step took ~2 ms of its end).
        self._elsewhere: dict[int, Any] = {}
        self._owners: dict[Any, frozenset] = {}   # sharding -> its processes

    def _sharding(self, stage: int, ref: int) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        spec = self._specs[stage].shardings.refs.get(ref)
        return NamedSharding(self._meshes[stage], spec or PartitionSpec())

    def run(self, flat_args: Sequence[Any] | Mapping[int, Any], warm_up: bool = False
            ) -> dict[int, Any]:
        # Every call takes the next number on every process, a failed one too: the
        # processes keep counting alike.
        self._steps += 1
        step = self._steps
        args = dict(flat_args) if isinstance(flat_args, Mapping) else dict(
            enumerate(flat_args))
        try:
            foreign = self._foreign_args(args)
            self._expect(step, foreign)
            args.update(self._exchange_args(step, args, foreign))
            outs = self.local.run(args, warm_up, step)
            self.last_records = self.local.last_records
            self.last_step_s = self.local.last_step_s
            outs.update(self._exchange_results(step, outs))
        except Exception as e:  # noqa: BLE001 - told to the others, then raised
            self._agree(step, e)
            raise
        self._agree(step, None)
        return outs

    def _agree(self, step: int, error: BaseException | None) -> None:
        """Every process's outcome of ``step``, through the job's key-value store: a step
        counts only where every process finished it. This process's ``error`` is told to
        the others; a peer's failure is raised here (this process drops its results)."""
        kv, key = self.transport.job_keys("outcome")
        why = "ok" if error is None else _first_line(error)
        kv.key_value_set(f"{key}/{step}/{self.process}", why, allow_overwrite=True)
        # A peer reports within its step's bound (2 × timeout) and a refusal's grace.
        wait = 2 * self.timeout + self.local.grace + OUTCOME_SLACK_S
        failed = []
        for p in range(jax.process_count()):
            if p == self.process:
                continue
            try:
                got = kv.blocking_key_value_get(f"{key}/{step}/{p}", int(wait * 1000))
            except Exception:  # noqa: BLE001 - jax's DEADLINE_EXCEEDED, not a public type
                got = f"no outcome reported within {wait:.0f} s"
            if got != "ok":
                failed.append(f"process {p}: {got}")
        if step > 2:   # every peer has read it: they finished step - 1's agreement
            try:
                kv.key_value_delete(f"{key}/{step - 2}/{self.process}")
            except Exception:  # noqa: BLE001 - gone already
                pass
        if failed and error is None:
            raise ExecutorError(
                f"step {step} failed on another process ({'; '.join(failed)}); this process "
                f"finished its part but keeps none of its results, as every process of the "
                f"job: the arguments are as they were, call the step again with them",
                failure=Failure.ABORTED)

    def _expect(self, step: int, foreign: Sequence[tuple[int, int, int]]) -> None:
        """Ask the transport now for the arguments (``foreign``: ``_foreign_args``) and
        0-d results this process will receive this step (the pull then waits at the sender
        for the value)."""
        for s, r, owner in foreign:
            if self.stage_process[s] == self.process:
                self.transport.expect(s, self._first[owner], (step, "arg", 0, r))
        avals = self.split.flat.avals
        for o in self.split.outputs:
            if o.source in ("task", "acc") and o.producer is not None and \
                    not tuple(avals[o.ref].shape) and \
                    self.stage_process[o.producer[1]] != self.process:
                self.transport.expect(self._first[self.process], o.producer[1],
                                      (step, "out", 0, o.ref))

    def _foreign_args(self, args: Mapping[int, Any]) -> list[tuple[int, int, int]]:
        """(reading stage, ref, process holding it) of every argument a stage reads that
        is an array on another process's devices."""
        out = []
        for s in sorted(self.stage_process):
            for r in self.split.stage_args(s):
                x = args.get(r)
                if not isinstance(x, jax.Array) or not x.committed or \
                        isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
                    # host values, arrays in jax's default placement (uncommitted: each
                    # process made its own, on its own first device) and arrays put on one
                    # device (``jax.device_put(x, jax.local_devices()[0])``, a checkpoint
                    # restored): every process has its own (a stage's results are on its
                    # mesh, never a single-device sharding)
                    continue
                owners = self._owners.get(x.sharding)
                if owners is None:
                    owners = self._owners[x.sharding] = frozenset(
                        d.process_index for d in x.sharding.device_set)
                if len(owners) == 1 and owners != {self.stage_process[s]}:
                    out.append((s, r, next(iter(owners))))
        return out

    def _exchange_args(self, step: int, args: Mapping[int, Any],
                       foreign: Sequence[tuple[int, int, int]]) -> dict[int, Any]:
        """Arguments a local stage reads whose value is on another process's devices (a
        result of that process kept as state, e.g. a tied weight; ``foreign``:
        ``_foreign_args``): received from it; and ours that another process's stage reads:
        sent to it."""
        got: dict[int, Any] = {}
        for s, r, owner in foreign:      # every send first: a peer may wait on one
            if owner == self.process:
                self.transport.send(self._first[owner], s, (step, "arg", 0, r), args[r])
        for s, r, owner in foreign:
            if owner != self.process and self.stage_process[s] == self.process and \
                    r not in got:
                got[r] = self.transport.recv(s, self._first[owner], (step, "arg", 0, r),
                                             self.timeout)
        return got

    def _exchange_results(self, step: int, outs: Mapping[int, Any]) -> dict[int, Any]:
        """The step's results made on other processes: 0-d ones received (every process
        sends its 0-d results to every other), arrays as global arrays with no shards here."""
        got: dict[int, Any] = {}
        avals = self.split.flat.avals
        made = [o for o in self.split.outputs
                if o.source in ("task", "acc") and o.producer is not None]
        for o in made:   # every send first: otherwise a process receiving a peer's result
            src = o.producer[1]  # before sending its own holds that peer up until its end
            if self.stage_process[src] == self.process and not tuple(avals[o.ref].shape):
                for p, first in self._first.items():
                    if p != self.process:
                        self.transport.send(src, first, (step, "out", 0, o.ref),
                                            outs[o.ref])
        for o in made:
            src = o.producer[1]
            scalar = not tuple(avals[o.ref].shape)
            key = (step, "out", 0, o.ref)
            if self.stage_process[src] == self.process or o.ref in got:
                continue
            if scalar:
                got[o.ref] = self.transport.recv(self._first[self.process], src, key,
                                                 self.timeout)
            else:
                x = self._elsewhere.get(o.ref)
                if x is None or x.is_deleted():       # (a caller may delete an array)
                    x = self._elsewhere[o.ref] = jax.make_array_from_single_device_arrays(
                        tuple(avals[o.ref].shape), self._sharding(src, o.ref), [],
                        dtype=avals[o.ref].dtype)
                got[o.ref] = x
        return got

    def close(self) -> None:
        self.local.close()

    def __enter__(self) -> "ProcessStages":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["ProcessStages", "stage_processes"]
