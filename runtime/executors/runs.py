"""The two kinds of run a ``ParallelStep`` makes of a lowered plan: ``DirectRun`` (one
stage in this process: the compiled SPMD program, called directly) and ``StagedRun`` (stage
programs under a static schedule, by a local or a Ray executor).

Both runs are ready before the first step: a ``DirectRun`` is built from the compiled
program, and ``StagedRun.warm_up`` compiles every stage program with one step on zeros (the
Ray executor's actors do the same when they start), so the first call, and its
``timeline()``, is a steady-state step. A ``DirectRun`` deletes its donated arguments
(``donate=True``: state the step updates and returns) after every call, the first included,
whether the program took them as they were or a copy moved onto the plan's devices
(``delete_donated``). Stage programs do not donate the state (they keep it per stage
between steps), so a ``StagedRun`` deletes nothing, on any call. A ``StagedRun`` hands its
0-d results back uncommitted (``Handover``), so that results of different stages combine
as ``jax.jit``'s do.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from rhino.errors import RhinoError, format_bytes
from rhino.jaxpr.private import with_weak_type
from rhino.hlo_passes.lower import SpmdLowering, StageLowering
from rhino.runtime.transfer.placement import place
from rhino.runtime.executors.worker_spec import WorkerSpec
from rhino.runtime.failures import RESUME, ExecutorError
from rhino.vocabulary import ScheduleKind


class DirectRun:
    """One stage in this process: the compiled SPMD program, called directly."""

    def __init__(self, lowering: SpmdLowering, compiled: Any, memory: dict | None,
                 budget: int | None = None, pressure: float | None = None,
                 multi_process: bool = False):
        self.lowering, self.compiled = lowering, compiled
        self.multi_process = multi_process   # the mesh spans the processes of a job
        self.memory, self.budget, self.pressure = memory, budget, pressure
        self._accepted: list = [None] * len(lowering.in_shardings)
        self._hlo_text: str | None = None
        self._donated: frozenset[int] | None = None

    def __call__(self, args: tuple) -> Any:
        # An input whose sharding object is the planned one, or one already found
        # equivalent (e.g. last step's result, fed back), is passed as it is; anything
        # else (host arrays, other shardings) is moved.
        flat, tree = jax.tree_util.tree_flatten(args)
        moved = None
        for i, (x, s) in enumerate(zip(flat, self.lowering.in_shardings)):
            sh = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
            if sh is not None and (sh is s or sh is self._accepted[i]):
                continue
            if sh is not None and sh.is_equivalent_to(s, x.ndim):
                self._accepted[i] = sh
                continue
            if moved is None:
                moved = list(flat)
            moved[i] = put(x, s)
        if moved is None:
            return self.compiled(*args)
        out = self.compiled(*jax.tree_util.tree_unflatten(tree, moved))
        # The program donated the moved copies; the arrays passed in go too, as they do
        # when the program takes them as they are (every later call).
        delete_donated(flat, self.donated_leaves, keep=moved)
        return out

    @property
    def donated_leaves(self) -> frozenset[int]:
        if self._donated is None:
            self._donated = leaves_of_args(self.lowering.in_tree,
                                           self.lowering.donate_argnums)
        return self._donated

    def compiled_text(self) -> str:
        if self._hlo_text is None:
            self._hlo_text = self.compiled.as_text()
        return self._hlo_text

    def report_lines(self) -> list[str]:
        m = self.memory
        if m is None:
            return []
        line = (f"  compiled memory   peak {format_bytes(m['peak'])} per device (arguments "
                f"{format_bytes(m['argument'])}, outputs {format_bytes(m['output'])}, "
                f"temporaries {format_bytes(m['temp'])}, donated {format_bytes(m['alias'])})")
        if self.budget is not None:
            line += (f"; budget {format_bytes(self.budget)}, met at memory pressure "
                     f"μ={self.pressure:g}")
        return [line]

    def shardings(self, leaves: int) -> list:
        return list(self.lowering.in_shardings[:leaves])

    def close(self) -> None:
        pass


HEARTBEAT_S = 10.0
"""While the stage programs compile, a line every this many seconds."""


def _typed_as(x: Any, aval: Any) -> Any:
    """``x`` (a result of the step) with the abstract value ``aval`` of the step's result:
    the dtype and weak type ``jax.jit`` would return, so that passed back as the next
    step's argument it has the signature the step was planned for. Values that came back
    through the host lose both (numpy has no weak type and no PRNG key type; a literal
    result is a Python or numpy number); a ``RemoteArray`` handle takes them from ``aval``
    (its shape must agree: an executor that returned another shape is a bug, raised).

    Raises:
        RhinoError: ``x``'s shape is not ``aval``'s.
    """
    if aval is None:
        return x
    shape, dtype, weak = tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type",
                                                                      False))
    if tuple(np.shape(x)) != shape:
        raise RhinoError(f"a result of the step: expected shape {shape} ({dtype}), found "
                         f"{tuple(np.shape(x))} from the executor")
    if getattr(x, "rhino_remote", False):
        x.dtype, x.weak_type = dtype, weak
        return x
    if not isinstance(x, jax.Array):
        x = jax.numpy.asarray(x, dtype=None if weak else dtype)
    if x.dtype != dtype:
        x = x.astype(dtype)
    if bool(getattr(x, "weak_type", False)) != weak:
        x = with_weak_type(x, weak)
    return x


def step_results(split: Any, flat: Sequence[Any], outs: Mapping[int, Any],
                 out_avals: Sequence[Any] | None = None) -> list:
    """The step's flat results from an executor's (``ref -> value``) and its flat
    arguments (results that are arguments passed through, or literals), each as jax.jit
    returns it (dtype, weak type: ``out_avals``, else the split's), so that the step's
    results passed back match the signature it was planned for (issue 30)."""
    avals = split.flat.avals
    res = []
    for k, o in enumerate(split.outputs):
        aval = out_avals[k] if out_avals is not None else (
            None if o.source == "lit" else avals[o.ref])
        if o.source == "lit":
            res.append(_typed_as(o.value, aval) if aval is not None
                       else jax.numpy.asarray(o.value))
        elif o.source == "arg":
            res.append(flat[o.ref])
        else:
            res.append(_typed_as(outs[o.ref], aval))
    return res


class Handover:
    """Where a pipelined step's results come back, so that they combine as ``jax.jit``'s.

    Each stage's programs leave its results on the stage's devices. A 0-d result (a loss, a
    metric, a metric's total or count, a step counter) comes back *uncommitted* on one
    device holding it (a view of its buffer there, no copy), as ``jax.jit`` returns results
    of host inputs: ``total / count`` of two stages' values, or a loss times a norm of one
    stage's weights, runs where JAX puts it instead of failing on "incompatible devices".
    Passed back as the next step's argument (a counter, a metric's state), the stage's own
    copy is used (``back``): no transfer. An array result stays committed on the devices
    of the stage that made it, in the sharding the next step reads it in: the state is fed
    back without moving, and combining arrays of two stages (``optax.global_norm`` of the
    whole model's parameters) needs them moved first (``jax.device_put``, or host values);
    moving every result to one device each step would cost the transfer and the memory of
    the whole state. Typed PRNG keys stay as they are.

    Only the last step's results are remembered.
    """

    def __init__(self) -> None:
        self._given: dict[int, tuple[Any, Any]] = {}   # id(handed) -> (handed, stage's)

    def give(self, results: Sequence[Any]) -> list:
        """The step's flat results as the caller gets them (remembered for ``back``)."""
        from rhino.jaxpr.private import uncommitted_view

        given: dict[int, tuple[Any, Any]] = {}
        out = []
        for x in results:
            if isinstance(x, jax.Array) and not x.ndim and x.committed and \
                    x.is_fully_addressable and \
                    not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                view = uncommitted_view(x)
                given[id(view)] = (view, x)
                x = view
            out.append(x)
        self._given = given
        return out

    def back(self, flat: Sequence[Any]) -> list:
        """The step's flat arguments, the last step's handed results among them replaced
        by the stages' own copies."""
        if not self._given:
            return list(flat)
        out = []
        for x in flat:
            kept = self._given.get(id(x))
            out.append(kept[1] if kept is not None and kept[0] is x else x)
        return out


class StagedRun:
    """Stage programs under a static schedule, by a local or a Ray executor.

    Args:
        lowering, specs, executor, schedule: the stage programs and who runs them.
    """

    def __init__(self, lowering: StageLowering, specs: list[WorkerSpec], executor: Any,
                 schedule: ScheduleKind, out_avals: Sequence[Any] | None = None,
                 restart: Callable[[], Any] | None = None):
        self.lowering, self.specs, self.executor, self.schedule = (lowering, specs, executor,
                                                                   schedule)
        self.out_avals = tuple(out_avals) if out_avals is not None else None
        self.warm_up_s: float | None = None
        self.handover = Handover()
        self.restart = restart
        self.restarts = 0

    def warm_up(self, say: Callable[[str], None]) -> None:
        """Compile every stage program before the first step: one step of the local
        executor on zeros (``StageWorker.zero_args``), so that the first call runs at steady
        state. The Ray executor's actors warm up when they start; nothing to do for it."""
        workers = getattr(self.executor, "workers", None)
        if workers is None:
            return
        n = len(workers)
        say(f"compiling the stage programs of {n} stage{'s' if n > 1 else ''} (one step on "
            f"zeros, before the first step)")
        t0 = time.perf_counter()
        done = threading.Event()

        def heartbeat() -> None:     # XLA says nothing while it compiles: we do
            while not done.wait(HEARTBEAT_S):
                say(f"compiling the stage programs of {n} stage{'s' if n > 1 else ''}: "
                    f"{time.perf_counter() - t0:.0f} s so far")

        beat = threading.Thread(target=heartbeat, name="rhino-compile-heartbeat",
                                daemon=True)
        beat.start()
        zeros: dict[int, Any] = {}
        for w in workers:
            for r, z in w.zero_args().items():
                # A weakly typed argument (a Python-number learning rate) stays weak, or the
                # first real step would compile its programs again.
                weak = getattr(w.split.flat.avals[r], "weak_type", False)
                zeros[r] = jax.numpy.full(z.shape, z.dtype.type(0).item()) if weak else z
        try:
            self.executor.run(zeros, warm_up=True)     # host callbacks not called
        finally:
            done.set()
        self.warm_up_s = time.perf_counter() - t0
        say(f"compiled the stage programs of {n} stage{'s' if n > 1 else ''} in "
            f"{self.warm_up_s:.1f} s")

    def __call__(self, args: tuple) -> list:
        if getattr(self.executor, "lost", None):
            args = self._start_again(args)
        flat = self.handover.back(jax.tree_util.tree_leaves(args))
        try:
            outs = self.executor.run(flat)
        except ExecutorError as e:
            if not getattr(self.executor, "lost", None):
                raise
            raise ExecutorError(f"{e}. {self._lost_note(args)}", stage=e.stage,
                                failure=e.failure) from e
        return self.handover.give(step_results(self.lowering.split, flat, outs,
                                               self.out_avals))

    def _held(self, args: tuple, stages: Any) -> list[str]:
        """Pytree paths of the arguments held by this executor's ``stages``."""
        return [jax.tree_util.keystr(path) for path, x in
                jax.tree_util.tree_flatten_with_path(args)[0]
                if getattr(x, "rhino_remote", False) and x.executor is self.executor and
                x.stage in stages]

    def _lost_note(self, args: tuple) -> str:
        """What a dead actor took with it of the arguments ``args``, and how to go on."""
        lost = self.executor.lost
        gone = self._held(args, lost)
        kept = sorted(set(range(len(self.specs))) - set(lost))
        if not gone:
            return (f"Nothing this call was given was held by stage(s) {sorted(lost)}: "
                    f"call the step again with the same arguments (it starts new actors)")
        shown = ", ".join(gone[:4]) + (f" and {len(gone) - 4} more" if len(gone) > 4 else "")
        alive = (f"; stage(s) {kept}'s values are still readable (rhino.fetch)"
                 if kept else "")
        return (f"Lost with stage(s) {sorted(lost)}: {len(gone)} array(s) of the state this "
                f"call was given ({shown}){alive}. {RESUME}")

    def _start_again(self, args: tuple) -> tuple:
        """After an actor died: new actors (``restart``) for a call whose arguments hold
        nothing of the lost stages (the values of living ones are brought here first)."""
        lost = self.executor.lost
        gone = self._held(args, lost)
        if gone or self.restart is None:
            why = (f"{len(gone)} of its arguments ({', '.join(gone[:4])}"
                   f"{' ...' if len(gone) > 4 else ''}) were held by stage(s) "
                   f"{sorted(lost)}, whose actors died" if gone else
                   "this executor cannot start new actors")
            raise ExecutorError(f"the step cannot run: {why}. {RESUME}")
        old = self.executor
        args = jax.tree_util.tree_map(
            lambda x: x.fetch() if getattr(x, "rhino_remote", False) and x.executor is old
            else x, args)
        old.close()
        self.executor = self.restart()
        self.restarts += 1
        return args

    def typed_args(self, values: Sequence[Any]) -> list[Any]:
        """The step's leading argument leaves ``values`` (e.g. ``RemoteArray`` handles made
        by ``distributed_init`` on the actors) with the signature the step was planned for
        (``_typed_as``)."""
        avals = self.lowering.split.flat.avals
        return [_typed_as(v, avals[k]) for k, v in enumerate(values)]

    def report_lines(self) -> list[str]:
        sp = self.lowering.split
        lay = sp.layout
        pro = {s: p for s, p in sp.prologues.items() if p.eqns}
        lines = [f"  microbatches      {sp.num_microbatches}, a sharding of the batch over "
                 f"time: {sum(1 for x in lay.place if x.value == 'micro')} equations per "
                 f"microbatch, {sum(1 for x in lay.place if x.value == 'post')} once per "
                 f"step after them"]
        if pro:
            lines.append("  prologue          values computed once per step from the whole "
                         "batch: " + ", ".join(f"stage {s} {len(p.outputs)} ({len(p.eqns)} "
                                               f"equations)" for s, p in sorted(pro.items())))
        if lay.local:
            lines.append(f"  statistics        {len(lay.local)} equations read each "
                         f"microbatch's own estimate of a whole-batch statistic "
                         f"(per_microbatch_statistics)")
        effects = sum(len(t.effects) for t in sp.tasks.values())
        if effects:
            lines.append(f"  host effects      {effects} callback{'s' if effects > 1 else ''} "
                         f"nothing reads: once per step, after stage 0's apply-gradients, "
                         f"on its first device")
        if self.warm_up_s is not None:
            lines.append(f"  compiled          every stage program before the first step "
                         f"({self.warm_up_s:.1f} s, one step on zeros)")
        return lines

    def shardings(self, leaves: int) -> list:
        workers = getattr(self.executor, "workers", None)
        if workers is None:
            raise RhinoError(f"distributed_init: expected the local executor, found "
                             f"{type(self.executor).__name__} (actors initialize their own "
                             f"state)")
        split = self.lowering.split
        return [next((w for w in workers if k in split.stage_args(w.stage)), workers[0])
                .sharding(k) for k in range(leaves)]

    def close(self) -> None:
        self.executor.close()


def put(x: Any, sharding: Any) -> Any:
    """``x`` with ``sharding``. On a mesh spanning the processes of a multi-controller job,
    a host array (the same on every process) is placed by each process from its own copy,
    writing only its devices' shards (``jax.make_array_from_callback``, no cross-process
    check); a global ``jax.Array`` (e.g. ``rhino.distributed.global_batch``) is resharded;
    Python numbers keep their weak type."""
    if sharding.is_fully_addressable or isinstance(x, (bool, int, float, complex)):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.device_put(x, sharding)
        x = np.asarray(x)     # a process's own array: the same on every process
    return place(x, sharding)


def leaves_of_args(in_tree: Any, argnums: Sequence[int]) -> frozenset[int]:
    """The flat leaf indices of the top-level arguments ``argnums`` of the arguments tuple
    whose structure is ``in_tree``."""
    counts = [c.num_leaves for c in in_tree.children()]
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return frozenset(i for k in argnums for i in range(starts[k], starts[k] + counts[k]))


def delete_donated(flat: Sequence[Any], donated: frozenset[int], keep: Sequence[Any] = ()
                   ) -> None:
    """Delete the donated arguments among ``flat`` (jax arrays not yet deleted), except an
    array that is also a result or a value still in use (``keep``), or that the call also
    took as an argument that is not donated."""
    if not donated:
        return
    kept = {id(x) for x in jax.tree_util.tree_leaves(list(keep))}
    kept |= {id(x) for i, x in enumerate(flat) if i not in donated}
    for i in donated:
        x = flat[i] if i < len(flat) else None
        if isinstance(x, jax.Array) and id(x) not in kept and not x.is_deleted():
            x.delete()
