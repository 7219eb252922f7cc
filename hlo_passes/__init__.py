"""HLO passes: ingestion, analyses and the rewrites that execute a plan, installed as
``rhino.hlo_passes``.

Pass order::

    source (fn + args | .hlo | .mlir)
        │ ingest.ingest            lower / read → hlo_text.parse_hlo_text → inline calls
        ▼
    HloGraph (graph.py)           ops in topological order, FLOPs, bytes, sources, arg paths
        │ analyses.analyze         backbone → critical nodes → cones → segments → liveness
        ▼
    GraphAnalysis                 consumed by the planner (rhino.planner)

    ... the planner (rhino.planner, rhino.pipeline) makes a rhino.Plan ...

    Plan + the step
        │ lower.check_plan         the plan is for this program (names every mismatch)
        │ lower.lower_spmd         one stage: constraints at the equations that produce each
        │                          value (annotate.py), strided values kept split
        │                          (strided.py), argument/result shardings, donation
        │ lower.lower_stages       several stages: the step cut into per-stage F/B/A programs
        ▼                          (stage_programs.py; each task's program:
                                   task_programs.py), each stage's specs on its values
    SpmdLowering | StageLowering  run by rhino.runtime

    annotate.py                   a jaxpr interpreter naming every equation (eqn<i> scopes in
                                  op_name), EqnMap from HLO ops to equation outputs, hooks
                                  that apply sharding constraints

Each pass takes the previous pass's product and checks its invariants (``HloGraph.check``).
"""

from .graph import ArgInfo, HloGraph, Op, TensorType
from .ingest import ingest
from .analyses import GraphAnalysis, analyze

__all__ = ["ArgInfo", "HloGraph", "Op", "TensorType", "ingest", "GraphAnalysis", "analyze"]
