"""The two kinds of run a ``ParallelStep`` makes of a lowered plan: ``DirectRun`` (one
stage in this process: the compiled SPMD program, called directly) and ``StagedRun`` (stage
programs under a static schedule, by a local or a Ray executor)."""

from __future__ import annotations

from typing import Any

import jax

from rhino.errors import RhinoError, format_bytes
from rhino.hlo_passes.lower import SpmdLowering, StageLowering
from rhino.runtime.executor import WorkerSpec
from rhino.vocabulary import ScheduleKind


class DirectRun:
    """One stage in this process: the compiled SPMD program, called directly."""

    def __init__(self, lowering: SpmdLowering, compiled: Any, memory: dict | None,
                 budget: int | None = None, pressure: float | None = None):
        self.lowering, self.compiled = lowering, compiled
        self.memory, self.budget, self.pressure = memory, budget, pressure
        self._accepted: list = [None] * len(lowering.in_shardings)
        self._hlo_text: str | None = None

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
            moved[i] = jax.device_put(x, s)
        if moved is not None:
            args = jax.tree_util.tree_unflatten(tree, moved)
        return self.compiled(*args)

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


class StagedRun:
    """Stage programs under a static schedule, by a local or a Ray executor."""

    def __init__(self, lowering: StageLowering, specs: list[WorkerSpec], executor: Any,
                 schedule: ScheduleKind):
        self.lowering, self.specs, self.executor, self.schedule = (lowering, specs, executor,
                                                                   schedule)

    def __call__(self, args: tuple) -> list:
        flat = jax.tree_util.tree_leaves(args)
        outs = self.executor.run(flat)
        res = []
        for o in self.lowering.split.outputs:
            if o.source == "lit":
                res.append(jax.numpy.asarray(o.value))
            elif o.source == "arg":
                res.append(flat[o.ref])
            else:
                res.append(outs[o.ref])
        return res

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
