"""rhino: automatic parallelization of single-device JAX training steps at the HLO level.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> g = rhino.ingest(lambda x, w: x @ w, jnp.ones((8, 4)), jnp.ones((4, 2)))
    >>> a = rhino.analyze(g)
    >>> len(a.critical)
    1
"""

from rhino.errors import (HloParseError, InfeasiblePlanError, IngestError, RhinoError,
                          UnsupportedOpError)
from rhino.hlo_passes import GraphAnalysis, HloGraph, analyze, ingest
from rhino.planner.api import PlanOptions, plan
from rhino.auto_parallel import auto_parallel
from rhino.planner.mesh import AbstractMesh
from rhino.planner.plan import ExecutionPlan
from rhino.planner.spec import ShardingSpec
from rhino.pipeline import Cluster, PipelinePlan, grad, plan_pipeline
from rhino.runtime.ray_executor import init

from rhino._version import __version__

__all__ = ["HloParseError", "InfeasiblePlanError", "IngestError", "RhinoError",
           "UnsupportedOpError", "GraphAnalysis", "HloGraph", "analyze", "ingest",
           "AbstractMesh", "auto_parallel", "ExecutionPlan", "PlanOptions", "ShardingSpec", "plan",
           "Cluster", "PipelinePlan", "grad", "plan_pipeline", "init"]
