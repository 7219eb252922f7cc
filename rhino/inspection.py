"""``rhino inspect``: what a program looks like to the planner, as text, JSON or Graphviz.

Example:
    >>> import jax.numpy as jnp
    >>> from rhino.inspection import inspect_source
    >>> rep = inspect_source(lambda x, w: x @ w, jnp.ones((8, 4)), jnp.ones((4, 2)))
    >>> rep.summary["ops"], rep.summary["critical_nodes"]
    (3, 1)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from rhino.errors import format_bytes
from rhino.hlo_passes import GraphAnalysis, HloGraph, analyze, ingest
from rhino.hlo_passes.graph import shape_str


@dataclasses.dataclass(frozen=True)
class Inspection:
    """A graph, its analyses, timings and the summary shown to people."""

    graph: HloGraph
    analysis: GraphAnalysis
    ingest_s: float
    analyze_s: float
    summary: dict[str, Any]

    def to_text(self) -> str:
        return format_summary(self.summary)

    def to_dot(self) -> str:
        return coarse_dot(self.graph, self.analysis)


def inspect_source(source: Any, *example_args: Any, top: int = 10) -> Inspection:
    """Ingest and analyse ``source`` (function + args, or a file path) and summarize."""
    t0 = time.perf_counter()
    graph = ingest(source, *example_args)
    t1 = time.perf_counter()
    analysis = analyze(graph)
    t2 = time.perf_counter()
    return Inspection(graph, analysis, t1 - t0, t2 - t1,
                      summarize(graph, analysis, t1 - t0, t2 - t1, top))


def summarize(graph: HloGraph, a: GraphAnalysis, ingest_s: float, analyze_s: float,
              top: int = 10) -> dict[str, Any]:
    """A JSON-able summary of a graph and its analyses."""
    n = len(graph.ops)
    hist = graph.opcode_histogram().most_common()
    params = sorted((graph.ops[p] for p in graph.params), key=lambda op: -op.out_bytes)
    return {
        "name": graph.name,
        "origin": graph.origin,
        "ops": n,
        "opcodes": dict(hist),
        "critical_nodes": len(a.critical),
        "critical_share": round(len(a.critical) / max(1, n), 6),
        "backbone_ops": len(a.backbone),
        "critical_path_length": a.length,
        "cones": len(a.cones),
        "segments": a.num_segments,
        "total_flops": graph.total_flops,
        "param_bytes": graph.param_bytes,
        "num_params": len(graph.params),
        "peak_live_bytes": a.peak_bytes,
        "largest_params": [
            {"path": op.arg.path if op.arg else op.name, "shape": shape_str(op.shape),
             "bytes": op.out_bytes, "donated": bool(op.arg and op.arg.donated)}
            for op in params[:top]],
        "opaque_ops": [
            {"name": graph.ops[i].name, "why": graph.ops[i].attrs.get("opaque", ""),
             "source": graph.ops[i].source} for i in graph.opaque],
        "ingest_seconds": round(ingest_s, 4),
        "analysis_seconds": round(analyze_s, 4),
    }


_bytes = format_bytes


def format_summary(s: dict[str, Any], hist_rows: int = 12) -> str:
    """The human-readable report."""
    lines = [
        f"rhino inspect: {s['name']}  ({s['origin']})",
        f"  ops                  {s['ops']}",
        f"  critical nodes       {s['critical_nodes']}  ({100 * s['critical_share']:.2f}% of ops;"
        f" backbone {s['backbone_ops']} ops, path length {s['critical_path_length']})",
        f"  cones                {s['cones']}",
        f"  segments             {s['segments']}",
        f"  total FLOPs          {s['total_flops']:.4g}",
        f"  parameters           {s['num_params']} arrays, {_bytes(s['param_bytes'])}",
        f"  peak live memory     {_bytes(s['peak_live_bytes'])} (single device, no reuse)",
        f"  ingestion            {s['ingest_seconds']:.3f} s",
        f"  analyses             {s['analysis_seconds']:.3f} s",
        "  opcodes:",
    ]
    hist = list(s["opcodes"].items())
    for op, c in hist[:hist_rows]:
        lines.append(f"    {op:<24} {c:>8}")
    if len(hist) > hist_rows:
        rest = sum(c for _, c in hist[hist_rows:])
        lines.append(f"    {'(' + str(len(hist) - hist_rows) + ' others)':<24} {rest:>8}")
    lines.append("  largest parameters:")
    for p in s["largest_params"]:
        don = "  donated" if p["donated"] else ""
        lines.append(f"    {p['path']:<40} {p['shape']:<24} {_bytes(p['bytes']):>12}{don}")
    if s["opaque_ops"]:
        lines.append("  opaque ops (kept whole; not partitioned inside):")
        for o in s["opaque_ops"]:
            lines.append(f"    {o['name']}: {o['why']}" + (f"  at {o['source']}" if o["source"]
                                                              else ""))
    return "\n".join(lines)


def _q(text: str) -> str:
    """Escape text for a double-quoted Graphviz label."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def coarse_dot(graph: HloGraph, a: GraphAnalysis, max_cones: int = 2000) -> str:
    """Graphviz text of the coarsened graph: segments (boxes) and critical nodes (ellipses),
    with edges labelled by the bytes crossing them. Cones appear as nodes inside their
    segment's cluster when there are at most ``max_cones`` of them."""
    def node_of(i: int) -> str:
        return f"c{i}" if a.segment_of[i] < 0 else f"s{a.segment_of[i]}"

    edges: dict[tuple[str, str], int] = {}
    for op in graph.ops:
        dst = node_of(op.id)
        for o in set(op.operands):
            src = node_of(o)
            if src != dst:
                edges[(src, dst)] = edges.get((src, dst), 0) + graph.ops[o].out_bytes
    show_cones = len(a.cones) <= max_cones
    cones_by_seg: dict[int, list] = {}
    for cone in a.cones:
        cones_by_seg.setdefault(a.segment_of[cone.root], []).append(cone)
    out = [f'digraph "{_q(graph.name)}" {{', "  rankdir=TB; node [fontsize=10];"]
    for k, members in enumerate(a.segments):
        if not members:
            continue
        flops = sum(graph.ops[i].flops for i in members)
        label = f"segment {k}\\n{len(members)} ops, {flops:.3g} FLOPs"
        if show_cones and cones_by_seg.get(k):
            out.append(f'  subgraph cluster_s{k} {{ label="{label}";')
            out.append(f'    s{k} [shape=point];')
            for cone in cones_by_seg[k]:
                r = graph.ops[cone.root]
                out.append(f'    k{cone.root} [shape=box, style=rounded, '
                           f'label="cone {_q(r.name)}\\n{len(cone.members)} ops"];')
            out.append("  }")
        else:
            out.append(f'  s{k} [shape=box, label="{label}"];')
    for c in a.critical:
        op = graph.ops[c]
        src = f"\\n{_q(op.source)}" if op.source else ""
        out.append(f'  c{c} [shape=ellipse, style=filled, fillcolor=lightblue, '
                   f'label="{_q(op.name)}\\n{shape_str(op.shape)}{src}"];')
    for (s, d), b in sorted(edges.items()):
        out.append(f'  {s} -> {d} [label="{b / 2**20:.2f} MiB"];')
    out.append("}")
    return "\n".join(out) + "\n"
