"""HLO passes: ingestion, analyses and (later) rewrites, installed as ``rhino.hlo_passes``.

Pass order::

    source (fn + args | .hlo | .mlir)
        │ ingest.ingest            lower / read → hlo_text.parse_hlo_text → inline calls
        ▼
    HloGraph (graph.py)           ops in topological order, FLOPs, bytes, sources, arg paths
        │ analyses.analyze         backbone → critical nodes → cones → segments → liveness
        ▼
    GraphAnalysis                 consumed by the planner (rhino.planner)

    annotate.py                   for execution: a jaxpr interpreter naming every equation
                                  (eqn<i> scopes in op_name), EqnMap from HLO ops to
                                  equation outputs, hooks that apply sharding constraints

Each pass takes the previous pass's product and checks its invariants (``HloGraph.check``).
"""

from .graph import ArgInfo, HloGraph, Op, TensorType
from .ingest import ingest
from .analyses import GraphAnalysis, analyze

__all__ = ["ArgInfo", "HloGraph", "Op", "TensorType", "ingest", "GraphAnalysis", "analyze"]
