"""Runtime (task graph, schedules, executors, cross-mesh resharding), installed as
``rhino.runtime``. Only this package imports ray.

Built so far (pure pieces first, each testable without a cluster)::

    schedules.py     Schedule: clock × stage table of F/B/A tasks — gpipe, 1f1b (default),
                     eager-1f1b (004 §4); validate() checks dependencies, completeness and
                     the in-flight bound each promises; simulate() times it with real
                     durations and inter-stage transfer latency; JSON round trip.
    task_graph.py    TaskGraph (Rhino §6.1): source, F/B per stage per microbatch, local
                     accumulation, apply-gradients, activation/gradient transfers, sink;
                     topological order, critical path, per-stage instruction lists, the
                     schedule's order as extra edges (critical path of a static schedule).
    load_balance.py  host-level model of cross-mesh communication (004 §3): Topology,
                     CommJob, list-scheduling simulator, sender balancers naive / greedy /
                     randomized greedy / DFS with pruning under a time budget / best.
    resharding.py    cross-mesh resharding: DeviceMesh (devices grouped by host), TileSpec
                     (004's S^0 / S^01 / R notation), unit communication tasks, send/recv,
                     send/recv + local all-gather and broadcast plans, and execute(), which
                     moves jax arrays between meshes of one process and assembles every
                     destination tile.
    spmd.py          SPMD execution of an ExecutionPlan on a local mesh (execution layer).
    stage_programs.py  the step's jaxpr cut into per-stage F/B/A programs (call-like
                     equations inlined; batch-independent values recomputed where read;
                     gradients and metrics accumulated over microbatches in the programs).
    executor.py      per-stage instruction lists from a schedule (run / send / recv),
                     StageWorker (one stage's mesh, programs, state), Transport,
                     LocalExecutor (one thread per stage over disjoint local devices).
    ray_executor.py  the Ray executor (one actor per stage mesh, object-store transport)
                     and ``init`` (``rhino.init``); imports ray lazily.
    ray_resharding.py  a ReshardingPlan executed with every host a Ray actor (004 Table 2).
    cross_mesh.py    004's resharding as the local executor's transport between stages.
    init.py          distributed initialization: state created on its stage's devices,
                     equal to a single-device init with the same seed (§6.3).
    timeline.py      measured task records and the per-stage Gantt chart (PNG / text).

The public entry is ``rhino.auto_parallel(step, cluster=...)`` (``rhino/pipelined.py``).

Example:
    >>> from rhino.runtime import build_task_graph, make_schedule
    >>> g = build_task_graph(2, 4).with_schedule(make_schedule("1f1b", 2, 4))  # 2(m+p-1) clocks
    >>> g.critical_path(lambda n: 1.0 if n.kind in ("forward", "backward") else 0.0).length
    10.0
"""

from rhino.runtime.load_balance import BALANCERS, CommJob, Topology, balance
from rhino.runtime.resharding import (STRATEGIES, DeviceMesh, ReshardingError, ReshardingPlan,
                                      TileSpec, execute, plan_resharding, unit_tasks)
from rhino.runtime.schedules import (SCHEDULE_NAMES, Schedule, ScheduleError, Task,
                                     make_schedule)
from rhino.runtime.task_graph import (BoundaryTensor, TaskGraph, TaskGraphError,
                                      build_task_graph)

__all__ = ["BALANCERS", "CommJob", "Topology", "balance", "STRATEGIES", "DeviceMesh",
           "ReshardingError", "ReshardingPlan", "TileSpec", "execute", "plan_resharding",
           "unit_tasks", "SCHEDULE_NAMES", "Schedule", "ScheduleError", "Task", "make_schedule",
           "BoundaryTensor", "TaskGraph", "TaskGraphError", "build_task_graph"]
