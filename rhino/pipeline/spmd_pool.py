"""The search's SPMD planning pool: plans in parallel (forked workers, threads or serial),
structurally identical stages planned once and renamed (see ``SpmdPool``)."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
import warnings
from typing import Any, Callable, Sequence

from rhino.errors import InfeasiblePlanError
from rhino.hlo_passes.graph import HloGraph
from rhino.hlo_passes.subgraph import structural_key
from rhino.planner.api import PlanOptions, plan_graph
from rhino.planner.build import BuildOptions
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spmd_plan import SpmdPlan


def _plan_task(graph: HloGraph, mesh: AbstractMesh, cost: CostModel, options: PlanOptions
               ) -> tuple[SpmdPlan | None, str, float]:
    t0 = time.perf_counter()
    try:
        return plan_graph(graph, mesh, cost, options), "", time.perf_counter() - t0
    except InfeasiblePlanError as e:
        return None, str(e), time.perf_counter() - t0


def _rename_plan(plan: SpmdPlan, src: HloGraph, dst: HloGraph) -> SpmdPlan:
    """A plan made for ``src`` applied to the structurally identical ``dst``."""
    names = {a.name: b.name for a, b in zip(src.ops, dst.ops)}
    paths = {}
    for a, b in zip(src.params, dst.params):
        pa, pb = src.ops[a].arg, dst.ops[b].arg
        paths[pa.path if pa else src.ops[a].name] = pb.path if pb else dst.ops[b].name
    ops = tuple(dataclasses.replace(o, name=names.get(o.name, o.name)) for o in plan.ops)
    params = tuple(dataclasses.replace(p, path=paths.get(p.path, p.path)) for p in plan.params)
    colls = tuple(dataclasses.replace(c, tensor=names.get(c.tensor, c.tensor),
                                      consumer=names.get(c.consumer, c.consumer))
                  for c in plan.collectives)
    unplanned = tuple(dataclasses.replace(u, name=names.get(u.name, u.name))
                      for u in plan.unplanned)
    return dataclasses.replace(plan, program=dst.name, ops=ops, params=params,
                               collectives=colls, unplanned=unplanned)


def _picklable(options: PlanOptions) -> dict[str, Any]:
    """PlanOptions as plain data (its BuildOptions holds a mappingproxy, which does not
    pickle) for worker processes."""
    build = {f.name: getattr(options.build, f.name) for f in dataclasses.fields(BuildOptions)}
    build["pinned"] = dict(build["pinned"])
    build["divisors"] = {k: dict(v) for k, v in build["divisors"].items()}
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(PlanOptions)}
    fields["build"] = build
    return fields


def _plan_task_in_worker(graph: HloGraph, mesh: AbstractMesh, cost: CostModel,
                         fields: dict[str, Any]) -> tuple[SpmdPlan | None, str, float]:
    fields = dict(fields, build=BuildOptions(**fields["build"]))
    return _plan_task(graph, mesh, cost, PlanOptions(**fields))


class SpmdPool:
    """Runs SPMD plans in parallel, planning structurally identical stages once.

    ``process`` workers are forked (the planner is pure Python: threads would share one
    core under the GIL); ``thread`` and ``serial`` run in this process. The forked workers
    are pools of one process each, fed from one queue here: a worker that falls idle takes
    the oldest waiting plan for a stage mesh it has planned before, else one for a new
    mesh, else the oldest. A split's first, middle and last stages hold the same layers, and
    the planner memoises exact segment tables per process (``hierarchical._EXACT``), so
    keeping a mesh on one worker shares that work without leaving a worker idle.
    """

    def __init__(self, workers: int, executor: str):
        self.lock = threading.RLock()   # a future done early runs its callback in _dispatch
        self.futures: dict[tuple, tuple[cf.Future, HloGraph]] = {}
        self.seconds = 0.0
        self.counted: set[int] = set()     # futures whose seconds are in ``seconds``
        self.made = 0
        self.processes = False
        self.pool: cf.Executor | None = None
        self.workers: list[Any] = []
        self.busy: list[bool] = []
        # (priority, home key, args, future), kept sorted by priority (stable)
        self.waiting: list[tuple[int, tuple, tuple, cf.Future]] = []
        self.home: dict[tuple, int] = {}   # (mesh, cost) -> the worker that planned it
        if executor == "process" and workers > 1:
            import multiprocessing as mp
            self.workers = [cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork"))
                            for _ in range(workers)]
            self.busy = [False] * workers
            self.processes = True
        elif executor != "serial" and workers > 1:
            self.pool = cf.ThreadPoolExecutor(workers)

    @property
    def parallel(self) -> bool:
        """Whether submitted plans run beside this thread (else ``submit`` plans at once)."""
        return self.processes or self.pool is not None

    def _dispatch(self) -> None:
        """Give every idle worker a waiting plan (called holding ``lock``)."""
        for w in range(len(self.workers)):
            if self.busy[w] or not self.waiting:
                continue
            first = self.waiting[0][0]
            homes = [self.home.get(h) for prio, h, _, _ in self.waiting if prio == first]
            pick = next((j for j, x in enumerate(homes) if x == w),
                        next((j for j, x in enumerate(homes) if x is None), 0))
            _, h, args, outer = self.waiting.pop(pick)
            self.home.setdefault(h, w)
            self.busy[w] = True
            # Workers fork lazily here. JAX warns at every fork of a process that
            # imported it; the workers only run the pure-Python planner, never JAX.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
                inner = self.workers[w].submit(_plan_task_in_worker, *args)
            inner.add_done_callback(self._finished(w, outer))

    def _finished(self, w: int, outer: cf.Future) -> Callable[[cf.Future], None]:
        def done(inner: cf.Future) -> None:
            with self.lock:
                self.busy[w] = False
                self._dispatch()
            if inner.cancelled():
                outer.cancel()
            elif inner.exception() is not None:
                outer.set_exception(inner.exception())
            else:
                outer.set_result(inner.result())
        return done

    def submit(self, graph: HloGraph, mesh: AbstractMesh, cost: CostModel,
               options: PlanOptions, extra: str = "", priority: int = 0
               ) -> tuple[cf.Future, HloGraph]:
        """A handle on the plan (``result``); with process workers, queued plans start in
        ``priority`` order (lowest first), then in submission order."""
        key = (structural_key(graph, extra), mesh, cost, repr(options))
        with self.lock:
            got = self.futures.get(key)
            if got is None:
                if self.processes:
                    fut = cf.Future()
                    at = next((j for j, q in enumerate(self.waiting) if q[0] > priority),
                              len(self.waiting))
                    self.waiting.insert(at, (priority, (mesh, cost),
                                             (graph, mesh, cost, _picklable(options)), fut))
                    self._dispatch()
                elif self.pool is None:
                    fut = cf.Future()
                    fut.set_result(_plan_task(graph, mesh, cost, options))
                else:
                    fut = self.pool.submit(_plan_task, graph, mesh, cost, options)
                got = (fut, graph)
                self.futures[key] = got
                self.made += 1
        return got

    def result(self, handle: tuple[cf.Future, HloGraph], graph: HloGraph
               ) -> tuple[SpmdPlan | None, str]:
        fut, src = handle
        plan, err, secs = fut.result()
        with self.lock:
            if id(fut) not in self.counted:
                self.seconds += secs
                self.counted.add(id(fut))
        if plan is not None and src is not graph:
            plan = _rename_plan(plan, src, graph)
        return plan, err

    def withdraw(self, handles: Sequence[tuple[cf.Future, HloGraph]]) -> None:
        """Drop the plans of ``handles`` that have not started (a pruned wave's); those
        running finish and are ignored."""
        with self.lock:
            futs = {id(h[0]) for h in handles}
            dropped = {id(q[3]) for q in self.waiting if id(q[3]) in futs}
            self.waiting = [q for q in self.waiting if id(q[3]) not in dropped]
            for key, (fut, _) in list(self.futures.items()):
                if id(fut) in dropped:
                    fut.cancel()
                    del self.futures[key]
                    self.made -= 1

    def close(self) -> None:
        with self.lock:
            for _, _, _, fut in self.waiting:
                fut.cancel()
            self.waiting.clear()
        for pool in self.workers + ([self.pool] if self.pool is not None else []):
            pool.shutdown(wait=True, cancel_futures=True)
