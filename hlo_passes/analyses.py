"""Graph analyses of the Rhino paper §4.3: backbone, critical nodes, cones, segments, liveness.

All are linear in the number of ops and edges (one forward and one backward sweep each).

* **Backbone** (§4.3.1): with unit op time and zero transfer time, an op's earliest time is
  one more than its latest-finishing operand (sources at 0); its latest time is one less than
  its earliest-needed user (sinks at the critical-path length). Ops whose earliest equals
  latest are on the critical path: the backbone.
* **Critical nodes**: the compute-intensive ops (``dot``, ``convolution``) on the backbone,
  ordered by time. They cut the graph into a near-linear chain.
* **Cones** (§4.3.2): a cone root is an op with two or more distinct inputs. Every other op
  has at most one input and joins the cone of its first user (walking users backward from
  the end), so a cone is its root plus single-input ops hanging above it; an op with one or
  no input and no user roots its own cone. Inside a cone every op but the root has one input.
* **Segments**: the ops strictly between consecutive critical nodes. An op that feeds some
  critical node is placed as late as it can run (its latest time), any other op as early as
  it can run (its earliest time), so parameters sit next to their first use and gradient
  updates next to the backward op producing them. Segment k lies between critical node k-1
  and critical node k (segment 0 before the first, segment K after the last).
* **Liveness**: in program (id) order, a value is live from its definition (parameters from
  the start) to its last use (outputs to the end); ``live_bytes[i]`` is the total after op i.
  Broadcasts, iotas, constants and tuple plumbing count nothing (XLA fuses or aliases them).

Example:
    >>> import jax.numpy as jnp, rhino
    >>> g = rhino.ingest(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2,
    ...                  jnp.ones((8, 4)), jnp.ones((4, 4)), jnp.ones((4, 2)))
    >>> a = analyze(g)
    >>> [g.ops[c].opcode for c in a.critical]
    ['dot', 'dot']
    >>> a.num_segments
    2
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Sequence

from .costs import COMPUTE_INTENSIVE
from .graph import HloGraph


@dataclasses.dataclass(frozen=True)
class Cone:
    """A cone: its root and its member ops (root included), ascending ids."""

    root: int
    members: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GraphAnalysis:
    """The analyses of one ``HloGraph``; every list is indexed by op id.

    Attributes:
        earliest, latest: unit-time schedule bounds of each op.
        length: critical-path length (max earliest).
        backbone: ids with earliest == latest, ascending.
        critical: critical node ids, ordered by time (then id).
        cone_of: id of the root of each op's cone.
        cones: every cone, ordered by root id.
        segment_of: segment index of each op; -1 for critical nodes.
        segments: member ids of each segment (K+1 lists for K critical nodes).
        live_bytes: bytes live after each op in program order.
        peak_bytes: max of live_bytes; peak_at: the op where it is reached.
    """

    earliest: list[int]
    latest: list[int]
    length: int
    backbone: list[int]
    critical: list[int]
    cone_of: list[int]
    cones: list[Cone]
    segment_of: list[int]
    segments: list[list[int]]
    live_bytes: list[int]
    peak_bytes: int
    peak_at: int

    @property
    def num_segments(self) -> int:
        """Number of non-empty segments."""
        return sum(1 for s in self.segments if s)

    def critical_share(self, num_ops: int) -> float:
        return len(self.critical) / max(1, num_ops)


def schedule_bounds(graph: HloGraph) -> tuple[list[int], list[int], int]:
    """Earliest and latest unit-time start of every op, and the critical-path length."""
    ops = graph.ops
    n = len(ops)
    earliest = [0] * n
    for op in ops:
        e = 0
        for o in op.operands:
            if earliest[o] + 1 > e:
                e = earliest[o] + 1
        earliest[op.id] = e
    length = max(earliest, default=0)
    latest = [length] * n
    for op in reversed(ops):
        lt = latest[op.id]
        for o in op.operands:
            if lt - 1 < latest[o]:
                latest[o] = lt - 1
    return earliest, latest, length


def find_critical(graph: HloGraph, earliest: list[int], latest: list[int],
                  compute_intensive: Iterable[str] = COMPUTE_INTENSIVE) -> tuple[list[int],
                                                                                 list[int]]:
    """(backbone ids, critical node ids ordered by time)."""
    heavy = frozenset(compute_intensive)
    backbone = [i for i in range(len(graph.ops)) if earliest[i] == latest[i]]
    critical = [i for i in backbone if graph.ops[i].opcode in heavy]
    critical.sort(key=lambda i: (earliest[i], i))
    return backbone, critical


def find_cones(graph: HloGraph) -> tuple[list[int], list[Cone]]:
    """(cone root of each op, the cones)."""
    n = len(graph.ops)
    users = graph.users
    cone_of = [-1] * n
    for op in reversed(graph.ops):
        i = op.id
        if len(set(op.operands)) >= 2 or not users[i]:
            cone_of[i] = i
        else:
            cone_of[i] = cone_of[users[i][0]]
    members: dict[int, list[int]] = {}
    for i in range(n):
        members.setdefault(cone_of[i], []).append(i)
    cones = [Cone(r, tuple(m)) for r, m in sorted(members.items())]
    return cone_of, cones


def find_segments(graph: HloGraph, earliest: list[int], latest: list[int],
                  critical: list[int]) -> tuple[list[int], list[list[int]]]:
    """(segment index of each op, -1 for critical nodes; members of each segment)."""
    n = len(graph.ops)
    users = graph.users
    is_crit = [False] * n
    for c in critical:
        is_crit[c] = True
    feeds = [False] * n  # op is an ancestor of some critical node
    for i in range(n - 1, -1, -1):
        for u in users[i]:
            if is_crit[u] or feeds[u]:
                feeds[i] = True
                break
    times = [earliest[c] for c in critical]
    segment_of = [-1] * n
    segments: list[list[int]] = [[] for _ in range(len(critical) + 1)]
    for i in range(n):
        if is_crit[i]:
            continue
        # An op at the same time as a critical node runs beside it, so after it.
        k = bisect.bisect_right(times, latest[i] if feeds[i] else earliest[i])
        segment_of[i] = k
        segments[k].append(i)
    return segment_of, segments


# Values XLA never materializes on their own: broadcasts and iotas are fused into their
# consumers; tuples and get-tuple-element alias their elements; constants are scalars or
# small literals held in the program.
NOT_MATERIALIZED = frozenset({"broadcast", "iota", "constant", "tuple", "get-tuple-element",
                              "bitcast"})


def liveness(graph: HloGraph, sizes: Sequence[float] | None = None,
             in_place: Sequence[tuple[int, int]] = ()) -> tuple[list[float], float, int]:
    """(bytes live after each op, peak bytes, op id at the peak).

    Ops in ``NOT_MATERIALIZED`` hold no memory of their own.

    Args:
        graph: the graph.
        sizes: bytes of each op's value (e.g. per-device bytes under a plan); defaults to
            ``op.out_bytes``.
        in_place: ``(output op id, parameter op id)`` pairs whose output overwrites the
            parameter's buffer (donated training state): the parameter's buffer lives to the
            end and the output adds nothing.
    """
    n = len(graph.ops)
    users = graph.users
    delta = [0.0] * (n + 1)
    is_out = [False] * n
    for o in graph.outputs:
        is_out[o] = True
    aliased_out = {o for o, _ in in_place}
    kept_param = {p for _, p in in_place}
    for op in graph.ops:
        i = op.id
        if op.opcode in NOT_MATERIALIZED or i in aliased_out:
            continue
        start = 0 if op.opcode == "parameter" else i
        end = n - 1 if (is_out[i] or i in kept_param) else (users[i][-1] if users[i] else i)
        if op.opcode == "parameter":
            end = max(end, i)
        size = op.out_bytes if sizes is None else sizes[i]
        delta[start] += size
        delta[end + 1] -= size
    live = [0.0] * n
    acc = 0.0
    peak, peak_at = 0.0, 0
    for i in range(n):
        acc += delta[i]
        live[i] = acc
        if acc > peak:
            peak, peak_at = acc, i
    return live, peak, peak_at


def analyze(graph: HloGraph,
            compute_intensive: Iterable[str] = COMPUTE_INTENSIVE) -> GraphAnalysis:
    """Run every analysis on ``graph``.

    Args:
        graph: an ingested graph.
        compute_intensive: opcodes that count as compute-intensive for critical nodes.
    """
    earliest, latest, length = schedule_bounds(graph)
    backbone, critical = find_critical(graph, earliest, latest, compute_intensive)
    cone_of, cones = find_cones(graph)
    segment_of, segments = find_segments(graph, earliest, latest, critical)
    live, peak, peak_at = liveness(graph)
    return GraphAnalysis(earliest, latest, length, backbone, critical, cone_of, cones,
                         segment_of, segments, live, peak, peak_at)
