"""Stage plans re-made on the step traced at microbatch shapes.

The pipeline search plans on the whole-batch program; the stage programs run the step
traced at microbatch shapes. Usually the two traces have the same equations and the plan
is written into the microbatch programs as it is (``hlo_passes.lower.lower_stages``). At
some sizes they differ: at a microbatch of one example JAX leaves out the broadcasts that
change nothing, and autodiff then leaves out their transposes. The split is kept (which
weights each stage holds, the stage meshes and devices); each stage's SPMD plan is made
again on the microbatch program, whose shapes are the ones the stages run::

    whole-batch Plan ──► weight -> stage ──► search on the microbatch graph with that
                                             hand-given split, the same stage count and
                                             kind ──► checked: same meshes, devices and
                                             weights per stage ──► Plan at microbatch shapes
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rhino.errors import LoweringError
from rhino.hlo_passes.graph import HloGraph
from rhino.parallel_plan import Plan
from rhino.pipeline.gradient import BoundaryOptions, find_gradient_boundary
from rhino.pipeline.search import PipelineOptions, plan_pipeline_graph
from rhino.pipeline.stages import forward_weights


def weight_stages_of(plan: Plan, weights: set[str]) -> dict[str, int]:
    """Every weight of ``weights`` a stage reads -> the first stage reading it (a weight
    read on several stages, a tied embedding, is owned by its first reader)."""
    out: dict[str, int] = {}
    for st in plan.stages:
        for path in st.weights:
            if path in weights:
                out.setdefault(path, st.index)
    return out


def replan_at_microbatch(graph_mb: HloGraph, plan: Plan, options: PipelineOptions,
                         progress: Callable[[str], None] | None = None) -> Plan:
    """``plan``'s split with every stage's SPMD plan made on ``graph_mb`` (the step at
    microbatch shapes). ``options``: the search options ``plan`` was found with.

    Raises:
        LoweringError: the split cannot be kept on the microbatch program (another stage
            count, mesh, device set, or weights on a stage), naming the difference.
    """
    boundary = find_gradient_boundary(graph_mb, BoundaryOptions(
        options.batch_args, method=options.boundary_method))
    ws = weight_stages_of(plan, forward_weights(graph_mb, boundary))
    if not ws:
        raise LoweringError("re-planning at microbatch shapes: the plan names no weights per "
                            "stage (a plan saved without them?)")
    opts = dataclasses.replace(options, num_stages=plan.num_stages, weight_stages=ws,
                               kinds=(plan.kind.value,), microbatch_divisors=None,
                               two_d=len(plan.stages[0].mesh.shape) > 1, prune=False,
                               num_microbatches=plan.num_microbatches, schedule=plan.schedule)
    got = plan_pipeline_graph(graph_mb, plan.cluster, opts, progress)
    _check_same_split(plan, got)
    return got


def _check_same_split(plan: Plan, got: Plan) -> None:
    def stage_desc(p: Plan) -> list[tuple]:
        return [(tuple(st.mesh.shape), tuple(st.devices), frozenset(st.weights))
                for st in p.stages]

    if (got.num_stages, got.kind) != (plan.num_stages, plan.kind):
        raise LoweringError(f"re-planning at microbatch shapes: expected a {plan.kind} plan "
                            f"of {plan.num_stages} stages, found {got.kind} of "
                            f"{got.num_stages}")
    for s, (a, b) in enumerate(zip(stage_desc(plan), stage_desc(got))):
        if a[:2] != b[:2]:
            raise LoweringError(f"re-planning at microbatch shapes: stage {s} expected mesh "
                                f"{a[0]} on devices {a[1]}, found {b[0]} on {b[1]}")
        if a[2] != b[2]:
            diff = sorted(a[2] ^ b[2])
            raise LoweringError(f"re-planning at microbatch shapes: stage {s} reads other "
                                f"weights than the whole-batch plan's stage {s} "
                                f"({len(diff)} differ, e.g. {diff[0]})")


def lower_at_microbatch(fn: Callable, traced: Any, graph: HloGraph, abstract: tuple,
                        plan: Plan, boundary: Any, options: PipelineOptions,
                        accumulate: Any, per_microbatch_statistics: bool,
                        progress: Callable[[str], None] | None = None) -> tuple[Plan, Any]:
    """The step traced and planned at microbatch shapes, with ``plan``'s split:
    (the plan the stages run, their ``StageLowering``). Batch coupling is checked on the
    whole-batch trace first (at one example the batch axis looks like any size-1 axis)."""
    from rhino.hlo_passes import ingest
    from rhino.hlo_passes.annotate import ScopedFunction
    from rhino.hlo_passes.lower import check_batch_coupling, lower_stages, microbatch_abstract
    from rhino.pipeline.coarsen import classify_ops

    if not per_microbatch_statistics:
        check_batch_coupling(fn, traced, graph, plan, abstract,
                             classify_ops(graph, boundary).role, boundary.batch_params,
                             accumulate)
    _, abstract_mb = microbatch_abstract(traced, graph, abstract, boundary.batch_params,
                                         plan.num_microbatches)
    traced_mb = ScopedFunction(fn, *abstract_mb)
    graph_mb = ingest(traced_mb, *abstract_mb)
    micro = replan_at_microbatch(graph_mb, plan, options, progress)
    boundary_mb = find_gradient_boundary(graph_mb, BoundaryOptions(options.batch_args))
    roles = classify_ops(graph_mb, boundary_mb).role
    return micro, lower_stages(fn, traced_mb, graph_mb, micro, abstract_mb, roles,
                               boundary_mb.batch_params, accumulate,
                               per_microbatch_statistics, whole=traced)
