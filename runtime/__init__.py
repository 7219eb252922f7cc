"""The runtime, installed as ``rhino.runtime``: what runs a pipelined or SPMD step once it
is planned and cut into stage programs. Laid out by responsibility::

    failures.py   base: Failure, ExecutorError, root_cause (how a failed step is named).
    threads.py    base: daemon threads and bounded, interruptible waits (a stuck stage
                  never holds up close(), Ctrl-C or the interpreter's exit).
    scheduling/   what orders tasks: schedules, instruction lists, task timing, timelines.
    transfer/     what moves data: transports, placement, 004's cross-mesh resharding and
                  load balancing, JAX's transfers between processes.
    state/        what keeps state: checkpoints, host data, sharded init, remote handles.
    executors/    what runs a step: the local executor, the multi-controller executor of
                  ``rhino.launch``, worker specs, exported stage programs, handovers.
    ray/          running a step on Ray (the only part of rhino that imports ray).

Imports go one way: the base modules import no subpackage; ``scheduling``, ``transfer`` and
``state`` import only the base modules (and rhino's compiler side), not each other;
``executors`` may import those three; ``ray`` may import anything here, and nothing here
imports it. ``tests/test_architecture.py`` checks this.

The modules' earlier flat names (``rhino.runtime.executor``, ``rhino.runtime.ray_executor``,
...) still import: each is the moved module itself (``MOVED`` maps old to new), so patching
one patches the other.

The stage programs these run are cut by ``rhino.hlo_passes.lower``; the public entry is
``rhino.auto_parallel`` (``rhino/parallel_step.py``). The task graph of Rhino §6.1, used to
analyse measured steps, lives with the benchmark that uses it (``benchmarks/task_graph.py``).

Example:
    >>> from rhino.runtime import make_schedule
    >>> s = make_schedule("1f1b", 2, 4)
    >>> [t.label for t in s.stage_tasks(1)][:4]
    ['F0', 'B0', 'F1', 'B1']
"""

import importlib
import importlib.abc
import importlib.util
import sys

from rhino.runtime.scheduling.schedules import (SCHEDULE_NAMES, Schedule, ScheduleError, Task,
                                                make_schedule)
from rhino.runtime.transfer.load_balance import BALANCERS, CommJob, Topology, balance
from rhino.runtime.transfer.resharding import (STRATEGIES, DeviceMesh, ReshardingError,
                                               ReshardingPlan, TileSpec, execute,
                                               plan_resharding, unit_tasks)

__all__ = ["BALANCERS", "CommJob", "Topology", "balance", "STRATEGIES", "DeviceMesh",
           "ReshardingError", "ReshardingPlan", "TileSpec", "execute", "plan_resharding",
           "unit_tasks", "SCHEDULE_NAMES", "Schedule", "ScheduleError", "Task", "make_schedule"]

# The flat names of the modules before the runtime was laid out in subpackages.
MOVED = {
    "schedules": "scheduling.schedules", "instructions": "scheduling.instructions",
    "task_timing": "scheduling.task_timing", "timeline": "scheduling.timeline",
    "transport": "transfer.transport", "placement": "transfer.placement",
    "load_balance": "transfer.load_balance", "resharding": "transfer.resharding",
    "cross_mesh": "transfer.cross_mesh", "process_resharding": "transfer.process_resharding",
    "jax_transfer": "transfer.jax_transfer",
    "checkpoint": "state.checkpoint", "host_data": "state.host_data",
    "sharded_init": "state.sharded_init", "remote_array": "state.remote_array",
    "executor": "executors.local", "spmd": "executors.spmd",
    "host_effects": "executors.host_effects", "worker_spec": "executors.worker_spec",
    "runs": "executors.runs", "artifacts": "executors.artifacts",
    "multicontroller": "executors.multicontroller",
    "ray_cluster": "ray.cluster", "ray_actor": "ray.actor", "ray_executor": "ray.executor",
    "ray_errors": "ray.errors", "local_ray": "ray.local_head",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``rhino.runtime.<old name>`` as the moved module itself (one module object
    under two names), so code written against the flat layout keeps working."""

    specs: dict = {}

    def find_spec(self, fullname, path=None, target=None):
        package, _, leaf = fullname.rpartition(".")
        if package != __name__ or leaf not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}")
        self.specs[module.__name__] = module.__spec__
        return module

    def get_code(self, fullname):
        """``python -m rhino.runtime.<old name>`` runs the moved module."""
        moved = f"{__name__}.{MOVED[fullname.rpartition('.')[2]]}"
        return importlib.util.find_spec(moved).loader.get_code(moved)

    def exec_module(self, module):
        # The import system has set __spec__ to the old name's; give the module its own back.
        module.__spec__ = self.specs[module.__name__]


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
