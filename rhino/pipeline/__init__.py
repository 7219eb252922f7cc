"""The pipeline planner (Rhino paper §3, §5): pure — an HloGraph and a cluster in, a Plan out.

Pass order (data flows top to bottom)::

    gradient.py    compute-gradients / apply-gradients split of a training step; rhino.grad
    coarsen.py     op roles (free / forward / backward / apply), units for the stage ILP
    stage_ilp.py   StageProblem: the §5.1 ILP with §5.2 bound tightening (rhino.milp)
    stages.py      assign_stages: unit stages -> op stages, crossings, validation
    cost.py        stage profiles from SPMD plans, cross-mesh transfers, 1F1B step, memory
    candidates.py  one split's stage subgraphs, costed: 1F1B step and memory per stage
    search.py      the search over splits of the cluster (parallel) and the controller
    api.py         plan_pipeline: ingest + search

The cluster and its splits are ``rhino.cluster``; the answer is a
``rhino.parallel_plan.Plan``. Stage subgraphs are cut out with ``rhino.hlo_passes.subgraph``; each stage is planned by the SPMD
planner (``rhino.planner``). No module here touches devices or imports ray.
"""

from rhino.pipeline.api import plan_pipeline
from rhino.pipeline.gradient import (BoundaryOptions, GradientBoundary, GradientBoundaryError,
                                     find_gradient_boundary, grad)
from rhino.pipeline.search import PipelineOptions, plan_pipeline_graph
from rhino.pipeline.stage_ilp import (StageAssignmentError, StageOptions, StageProblem,
                                      solve_stage_problem)
from rhino.pipeline.stages import StageAssignment, assign_stages, check_assignment

__all__ = ["plan_pipeline", "plan_pipeline_graph", "PipelineOptions", "BoundaryOptions",
           "GradientBoundary", "GradientBoundaryError", "find_gradient_boundary", "grad",
           "StageOptions", "StageProblem", "StageAssignmentError", "solve_stage_problem",
           "StageAssignment", "assign_stages", "check_assignment"]
