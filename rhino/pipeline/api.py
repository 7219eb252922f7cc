"""``rhino.plan_pipeline``: ingest a training step and weigh SPMD, pipeline and hybrid plans.

Example:
    >>> import rhino
    >>> from rhino.models import get_model
    >>> m = get_model("gpt", layers=2, hidden=64, heads=2, seq=16, vocab=256)
    >>> p = rhino.plan_pipeline(m.step, *m.example_args(), cluster="2x2", microbatches=4,
    ...                         beta_inter=1e-8)
    >>> p.kind in ("spmd", "pipeline", "hybrid"), len(p.candidates) > 3
    (True, True)
    >>> opts = PipelineOptions(num_microbatches=4, epsilon=0.3, max_stages=2)
    >>> q = rhino.plan_pipeline(m.step, *m.example_args(), cluster="1x2", options=opts)
    >>> q.epsilon                      # the options are honoured
    0.3
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from rhino.backends import BackendFigures, backend_figures
from rhino.errors import OptionsError
from rhino.hlo_passes import HloGraph, ingest
from rhino.cluster import Cluster
from rhino.parallel_plan import Plan
from rhino.pipeline.search import PipelineOptions, plan_pipeline_graph


def make_cluster(cluster: str | Cluster, figures: BackendFigures | str | None = None,
                 **links: float | int | None) -> Cluster:
    """A ``Cluster`` from ``"HxD"`` of ``figures``' devices (a name: built-in figures;
    default: simulated CPU), or a ``Cluster`` as is, with the given fields overriding.

    Raises:
        OptionsError: malformed text or values, or figures for a given ``Cluster`` (it
            carries its own).
    """
    fields = {k: v for k, v in links.items() if v is not None}
    if isinstance(figures, str):
        figures = backend_figures(figures)
    if "flops_per_s" in fields:
        fields.setdefault("dtype_flops_per_s", ())   # one rate for every dtype
    try:
        if isinstance(cluster, Cluster):
            if figures is not None:
                raise OptionsError(f"cluster: a rhino.Cluster carries its figures; found "
                                   f"figures {figures.backend!r} given too")
            return dataclasses.replace(cluster, **fields)
        return Cluster.parse(cluster, figures, **fields)
    except (TypeError, ValueError) as e:
        if isinstance(e, OptionsError):
            raise
        text = str(e)
        raise OptionsError(text if text.startswith("cluster") else f"cluster: {text}") from None


def plan_pipeline(source: Any, *example_args: Any, cluster: str | Cluster = "1x8",
                  microbatches: int | None = None, epsilon: float | None = None,
                  max_stages: int | None = None,
                  alpha_intra: float | None = None, beta_intra: float | None = None,
                  alpha_inter: float | None = None, beta_inter: float | None = None,
                  flops_per_s: float | None = None, memory_bytes: int | None = None,
                  backend: str | None = None,
                  batch_args: tuple[str, ...] | None = None,
                  options: PipelineOptions | None = None,
                  progress: Callable[[str], None] | None = None) -> Plan:
    """Plan a training step over a cluster: SPMD-only, pipeline-only or hybrid.

    Args:
        source: a JAX training step (with ``example_args``), an ``.hlo``/``.mlir`` path, or
            an ingested ``HloGraph``.
        *example_args: example arguments (arrays, ShapeDtypeStructs or pytrees of them).
        cluster: ``"HOSTSxDEVICES"`` such as ``"2x8"``, or a ``Cluster``.
        microbatches: microbatches per step for 1F1B (default: ``options``', else 8).
        epsilon: stage imbalance tolerance of the stage ILP (§5.2; default: ``options``',
            else 0.1).
        max_stages: the most pipeline stages (default: ``options``', else every device).
        alpha_intra, beta_intra, alpha_inter, beta_inter: link latency (s) and seconds per
            byte within and across hosts (default: the figures' of ``backend``).
        flops_per_s, memory_bytes: per device (override the cluster's; ``flops_per_s`` for
            every dtype).
        backend: built-in figures of the cluster's devices (``rhino.backends``; default
            simulated CPU), for a cluster given as text.
        batch_args: argument names that carry the batch (default: the non-state ones).
        options: all other search options; ``microbatches``, ``epsilon``, ``max_stages``
            and ``batch_args`` given here (not None) replace theirs.
        progress: called with a line of text at each phase.

    Returns:
        The ``Plan`` (``.report()``, ``.to_json()``).

    Raises:
        GradientBoundaryError: the step's gradient boundary cannot be found (pipeline
            candidates need it; ``max_stages=1`` plans SPMD only).
        InfeasiblePlanError: nothing fits in device memory.
    """
    c = make_cluster(cluster, backend, alpha_intra=alpha_intra, beta_intra=beta_intra,
                     alpha_inter=alpha_inter, beta_inter=beta_inter, flops_per_s=flops_per_s,
                     memory_bytes=memory_bytes)
    given = {"num_microbatches": microbatches, "epsilon": epsilon, "max_stages": max_stages,
             "batch_args": batch_args}
    opts = dataclasses.replace(options or PipelineOptions(),
                               **{k: v for k, v in given.items() if v is not None})
    t0 = time.perf_counter()
    graph = source if isinstance(source, HloGraph) else ingest(source, *example_args)
    t1 = time.perf_counter()
    if progress:
        progress(f"ingested {len(graph.ops)} ops in {t1 - t0:.2f} s")
    return plan_pipeline_graph(graph, c, opts, progress, ingest_s=t1 - t0)
