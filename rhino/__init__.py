"""rhino: automatic parallelization of single-device JAX training steps at the HLO level.

The public API: ``auto_parallel`` (run a step in parallel; one ``ParallelStep`` type),
``plan`` (plan without running; one ``Plan`` type), ``ingest`` / ``analyze`` (the graph the
planner sees), ``plan_pipeline`` (the cluster controller), ``init`` (join a Ray cluster),
``distributed_init`` (join a multi-controller job: the same script on every host, started by
SLURM, Kubernetes or ``python -m rhino.launch``; ``global_batch`` makes a batch of each
process's own rows).

Layers, each importing only the ones above it::

    errors · vocabulary · milp · progress · distributed (multi-controller jobs; launch)
    hlo_passes  (ingest, analyses, annotate, stage programs, strided values)
    planner     (SPMD: mesh, cost model, spec, strategies, build, solvers, spmd_plan)
    backends · cluster · parallel_plan   (figures per backend; the one Plan type)
    pipeline    (gradient boundary, stage ILP, search/controller)
    planning    (rhino.plan)
    hlo_passes.lower              (a Plan written into the program)
    runtime     (executors, schedules, transports)
    parallel_step                 (rhino.auto_parallel)

Example:
    >>> import jax.numpy as jnp, rhino
    >>> g = rhino.ingest(lambda x, w: x @ w, jnp.ones((8, 4)), jnp.ones((4, 2)))
    >>> a = rhino.analyze(g)
    >>> len(a.critical)
    1
"""

from rhino._version import __version__
from rhino.cluster import Cluster
from rhino.distributed import (DistributedError, PlanDivergenceError, distributed_init,
                               global_batch)
from rhino.errors import (ArgumentError, BatchCouplingError, HloParseError, InfeasiblePlanError,
                          IngestError, LoweringError, OptionsError, PlanMismatchError,
                          PlanningError, RhinoError, UnsupportedOpError)
from rhino.hlo_passes import GraphAnalysis, HloGraph, analyze, ingest
from rhino.parallel_step import ParallelStep, auto_parallel
from rhino.pipeline import grad, plan_pipeline
from rhino.parallel_plan import Plan
from rhino.planner.api import PlanOptions
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spec import ShardingSpec
from rhino.planner.spmd_plan import SpmdPlan
from rhino.planning import plan
from rhino.runtime.state.host_data import HostRequest, host_data
from rhino.runtime.state.checkpoint import (CheckpointError, CheckpointManager, restore_checkpoint,
                                            save_checkpoint)
from rhino.runtime.ray.executor import RemoteArray, fetch, init
from rhino.throughput import batch_sizes, throughput_line

__all__ = ["__version__", "HostRequest", "host_data", "CheckpointError", "CheckpointManager", "RemoteArray", "fetch", "restore_checkpoint",
           "save_checkpoint", "ArgumentError", "BatchCouplingError", "HloParseError", "InfeasiblePlanError", "IngestError",
           "LoweringError", "OptionsError", "PlanMismatchError", "PlanningError", "RhinoError",
           "UnsupportedOpError", "GraphAnalysis", "HloGraph", "analyze", "ingest",
           "AbstractMesh", "CostModel", "auto_parallel", "ParallelStep", "Plan", "SpmdPlan", "PlanOptions",
           "ShardingSpec", "plan", "Cluster", "grad", "plan_pipeline", "init",
           "distributed_init", "global_batch", "DistributedError", "PlanDivergenceError",
           "throughput_line", "batch_sizes"]
