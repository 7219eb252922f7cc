"""Runtime (schedules, executors, transports, cross-mesh resharding), installed as
``rhino.runtime``. Only this package imports ray.

Built so far (pure pieces first, each testable without a cluster)::

    schedules.py     Schedule: clock × stage table of F/B/A tasks — gpipe, 1f1b (default),
                     eager-1f1b (004 §4); validate() checks dependencies, completeness and
                     the in-flight bound each promises; simulate() times it with real
                     durations and inter-stage transfer latency; JSON round trip.
    load_balance.py  host-level model of cross-mesh communication (004 §3): Topology,
                     CommJob, list-scheduling simulator, sender balancers naive / greedy /
                     randomized greedy / DFS with pruning under a time budget / best.
    resharding.py    cross-mesh resharding: DeviceMesh (devices grouped by host), TileSpec
                     (004's S^0 / S^01 / R notation), unit communication tasks, send/recv,
                     send/recv + local all-gather and broadcast plans, and execute(), which
                     moves jax arrays between meshes of one process and assembles every
                     destination tile.
    spmd.py          SPMD execution facts: device meshes, compiled shardings checked against
                     the plan, collectives counted, compiled memory read.
    transport.py     the Transport protocol, LocalTransport, ExecutorError and root_cause
                     (which stage to blame first).
    executor.py      per-stage instruction lists from a schedule (run / send / recv),
                     StageWorker (one stage's mesh, programs, state), LocalExecutor (one
                     thread per stage over disjoint local devices).
    threads.py       daemon threads and bounded, interruptible waits: a stuck stage never
                     holds up close(), Ctrl-C or the interpreter's exit.
    ray_cluster.py   ``init`` (``rhino.init``): reaching a Ray cluster; imports ray lazily.
    ray_actor.py     StageActor: one host of one stage mesh; every actor of a run is one
                     process of one jax.distributed job; results kept on the actor.
    ray_executor.py  the Ray executor (actors per host of every stage mesh, values between
                     stages through JAX's transfers, state on the actors as RemoteArray
                     handles, fetch).
    remote_array.py  RemoteArray handles and fetch; PackedKey: a typed PRNG key array's bits
                     between the driver and the actors.
    checkpoint.py    orbax checkpoints written where the state lives, restored anywhere.
    cross_mesh.py    004's resharding as the local executor's transport between stages.
    jax_transfer.py  a transport between the processes of one jax.distributed job: values
                     pulled device to device by JAX's transfer server under a uuid both
                     sides compute (cross-process device_put matches by call order only).
    sharded_init.py  distributed initialization: state created on its stage's devices,
                     equal to a single-device init with the same seed (§6.3).
    local_ray.py     a local Ray head on free ports, stopped by its own process group.
    timeline.py      measured task records and the per-stage Gantt chart (PNG / text).

The stage programs these run are cut by ``rhino.hlo_passes.lower``; the public entry is
``rhino.auto_parallel`` (``rhino/parallel_step.py``). The task graph of Rhino §6.1, used to
analyse measured steps, lives with the benchmark that uses it (``benchmarks/task_graph.py``).

Example:
    >>> from rhino.runtime import make_schedule
    >>> s = make_schedule("1f1b", 2, 4)
    >>> [t.label for t in s.stage_tasks(1)][:4]
    ['F0', 'B0', 'F1', 'B1']
"""

from rhino.runtime.load_balance import BALANCERS, CommJob, Topology, balance
from rhino.runtime.resharding import (STRATEGIES, DeviceMesh, ReshardingError, ReshardingPlan,
                                      TileSpec, execute, plan_resharding, unit_tasks)
from rhino.runtime.schedules import (SCHEDULE_NAMES, Schedule, ScheduleError, Task,
                                     make_schedule)

__all__ = ["BALANCERS", "CommJob", "Topology", "balance", "STRATEGIES", "DeviceMesh",
           "ReshardingError", "ReshardingPlan", "TileSpec", "execute", "plan_resharding",
           "unit_tasks", "SCHEDULE_NAMES", "Schedule", "ScheduleError", "Task", "make_schedule"]
