"""The pipeline planner (Rhino paper §3, §5): pure — an HloGraph and a cluster in, a plan out.

Modules (data flows top to bottom)::

    gradient.py    compute-gradients / apply-gradients split of a training step; rhino.grad
    coarsen.py     op roles (free / forward / backward / apply), units for the stage ILP
    stage_ilp.py   StageProblem: the §5.1 ILP with §5.2 bound tightening (highspy)
    stages.py      assign_stages: unit stages -> op stages, crossings, validation
    cluster.py     Cluster (hosts × devices, intra/inter-host links), splits into stage meshes
    cost.py        stage profiles from SPMD plans, cross-mesh transfers, 1F1B step, memory
    search.py      the search over splits (parallel) and the controller
    plan.py        PipelinePlan: report(), to_json()/from_json()
    api.py         plan_pipeline: ingest + search

Stage subgraphs are cut out with ``rhino.hlo_passes.subgraph``; each stage is planned by the
SPMD planner (``rhino.planner``). No module here touches devices or imports ray.
"""

from rhino.pipeline.api import plan_pipeline
from rhino.pipeline.cluster import Cluster, MeshSplit, enumerate_splits
from rhino.pipeline.gradient import (BoundaryOptions, GradientBoundary, GradientBoundaryError,
                                     find_gradient_boundary, grad)
from rhino.pipeline.plan import Candidate, CrossTensor, PipelinePlan, StagePlan
from rhino.pipeline.search import PipelineOptions, plan_pipeline_graph
from rhino.pipeline.stage_ilp import (StageAssignmentError, StageOptions, StageProblem,
                                      solve_stage_problem)
from rhino.pipeline.stages import StageAssignment, assign_stages, check_assignment

__all__ = ["plan_pipeline", "plan_pipeline_graph", "PipelineOptions", "PipelinePlan",
           "StagePlan", "CrossTensor", "Candidate", "Cluster", "MeshSplit", "enumerate_splits",
           "BoundaryOptions", "GradientBoundary", "GradientBoundaryError",
           "find_gradient_boundary", "grad", "StageOptions", "StageProblem",
           "StageAssignmentError", "solve_stage_problem", "StageAssignment", "assign_stages",
           "check_assignment"]
