"""The task graph of Rhino §6.1 as plain data: tasks, edges, topological order, critical path.

A training step with ``p`` pipeline stages and ``m`` microbatches is a DAG of

=====================  =============================================================
kind                   task
=====================  =============================================================
``source``             the step's start (parameters and the batch are ready)
``forward``            ``F(s, mb)``: forward half of compute-gradients of stage s on mb
``backward``           ``B(s, mb)``: backward half (gradients of mb on stage s)
``accumulate``         ``LA(s, mb)``: add mb's gradients into stage s's accumulator
``apply``              ``AG(s)``: apply the accumulated gradients of stage s
``transfer_act``       ``TA(s→d, mb)``: activations of mb from stage s to stage d
``transfer_grad``      ``TG(d→s, mb)``: their gradients back from stage d to stage s
``sink``               the step's end
=====================  =============================================================

Rhino's compute-gradients task ``CG(s, mb)`` is split into ``F`` and ``B`` so a pipeline
schedule can interleave microbatches (Rhino Fig. 6c); the local accumulation ``LA`` exists
only with more than one microbatch (Fig. 6b), and a transfer task only where tensors cross a
stage boundary. The chains of microbatch 0 for 2 stages, 2 microbatches (microbatch 1 is the
same with ``,1)``; 20 nodes in all)::

    source ─► F(0,0) ─► TA(0→1,0) ─► F(1,0) ─► B(1,0) ─► TG(1→0,0) ─► B(0,0) ─► LA(0,0)
                 └──────────────────────────────────────────────────► B(0,0)       │
                                             B(1,0) ─► LA(1,0)                      ▼
    LA(s,0) ─► LA(s,1) ─► AG(s) ─► sink      (for s = 0, 1)                      LA(0,1)

Tensors may also skip stages (U-Net's long skips): a ``BoundaryTensor`` from stage 0 to stage
3 gives ``TA(0→3, mb)`` and ``TG(3→0, mb)``.

The *critical path* under given task durations is the longest path through the graph; adding
a schedule's per-stage order (``with_schedule``) gives the critical path of the static
schedule, and ``step time − critical path`` is the runtime's overhead (Rhino §7).

Example:
    >>> g = build_task_graph(2, 2)
    >>> len(g.nodes), g.topological_order()[0], g.topological_order()[-1]
    (20, 'source', 'sink')
    >>> cp = g.critical_path(lambda n: {"forward": 1.0, "backward": 2.0}.get(n.kind, 0.0))
    >>> cp.length, cp.path[:3]
    (6.0, ('source', 'F(0,1)', 'TA(0→1,1)'))
    >>> TaskGraph.from_json(g.to_json()) == g
    True
"""

from __future__ import annotations

import dataclasses
import heapq
import json
from typing import Any, Callable, Mapping, Sequence

from rhino.errors import RhinoError
from rhino.runtime.scheduling.schedules import Schedule

NODE_KINDS = ("source", "forward", "backward", "accumulate", "apply", "transfer_act",
              "transfer_grad", "sink")


class TaskGraphError(RhinoError, ValueError):
    """A malformed task graph (cycle, unknown node, bad boundary) or a schedule that does not
    fit it. The message says what was expected and what was found."""


@dataclasses.dataclass(frozen=True)
class BoundaryTensor:
    """A tensor produced on one stage and consumed on a later one.

    Attributes:
        src_stage: the producing stage.
        dst_stage: the consuming stage (> ``src_stage``).
        name: a name for reports (e.g. the HLO value).
        nbytes: bytes per microbatch (0 when unknown).
        needs_gradient: whether its gradient flows back (False for integer tensors).
    """

    src_stage: int
    dst_stage: int
    name: str = "activation"
    nbytes: int = 0
    needs_gradient: bool = True


@dataclasses.dataclass(frozen=True)
class TaskNode:
    """One task of the graph.

    Attributes:
        id: unique readable id, e.g. ``"F(1,0)"``, ``"TA(0→1,3)"``, ``"AG(0)"``.
        kind: one of ``NODE_KINDS``.
        stage: the stage running it (a transfer's *sending* stage); None for source/sink.
        microbatch: its microbatch; None for apply, source, sink.
        peer_stage: a transfer's receiving stage; None otherwise.
        tensors: a transfer's tensor names.
        nbytes: a transfer's bytes (sum over its tensors).
    """

    id: str
    kind: str
    stage: int | None = None
    microbatch: int | None = None
    peer_stage: int | None = None
    tensors: tuple[str, ...] = ()
    nbytes: int = 0

    def __post_init__(self):
        if self.kind not in NODE_KINDS:
            raise TaskGraphError(f"task {self.id!r}: expected kind in {NODE_KINDS}, found "
                                 f"{self.kind!r}")
        object.__setattr__(self, "tensors", tuple(self.tensors))


@dataclasses.dataclass(frozen=True)
class CriticalPath:
    """The longest path through a task graph.

    Attributes:
        length: its total duration (seconds, or whatever unit the durations had).
        path: node ids from source to sink.
    """

    length: float
    path: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TaskGraph:
    """A training step's tasks and their dependencies (plain data, JSON round-trips).

    Attributes:
        num_stages: pipeline stages.
        num_microbatches: microbatches per step.
        nodes: the tasks, in construction order.
        edges: ``(before, after)`` pairs of node ids.
    """

    num_stages: int
    num_microbatches: int
    nodes: tuple[TaskNode, ...]
    edges: tuple[tuple[str, str], ...]

    def __post_init__(self):
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "edges", tuple((str(a), str(b)) for a, b in self.edges))

    def node(self, node_id: str) -> TaskNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise TaskGraphError(f"task graph: expected a node {node_id!r}, found none")

    def predecessors(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for a, b in self.edges:
            out[b].append(a)
        return out

    def successors(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for a, b in self.edges:
            out[a].append(b)
        return out

    def topological_order(self) -> tuple[str, ...]:
        """Node ids, every node after its predecessors; ties broken by construction order.

        Raises:
            TaskGraphError: on a cycle or an edge naming an unknown node.
        """
        index = {n.id: i for i, n in enumerate(self.nodes)}
        if len(index) != len(self.nodes):
            raise TaskGraphError(f"task graph: expected unique node ids, found "
                                 f"{len(self.nodes) - len(index)} duplicates")
        indeg = dict.fromkeys(index, 0)
        succ: dict[str, list[str]] = {k: [] for k in index}
        for a, b in self.edges:
            if a not in index or b not in index:
                raise TaskGraphError(f"task graph: expected edges between known nodes, found "
                                     f"({a!r}, {b!r})")
            succ[a].append(b)
            indeg[b] += 1
        heap = [(index[k], k) for k, d in indeg.items() if d == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            _, k = heapq.heappop(heap)
            order.append(k)
            for b in succ[k]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    heapq.heappush(heap, (index[b], b))
        if len(order) != len(index):
            stuck = sorted((k for k, d in indeg.items() if d > 0), key=index.get)[:4]
            raise TaskGraphError(f"task graph: expected a DAG, found a cycle through "
                                 f"{stuck}{'...' if len(stuck) == 4 else ''}")
        return tuple(order)

    def validate(self) -> "TaskGraph":
        """Check: a DAG, exactly one source (no predecessors) and one sink (no successors).

        Returns:
            self.
        """
        self.topological_order()
        preds, succs = self.predecessors(), self.successors()
        roots = [k for k, v in preds.items() if not v]
        leaves = [k for k, v in succs.items() if not v]
        if roots != ["source"] or leaves != ["sink"]:
            raise TaskGraphError(f"task graph: expected only 'source' without predecessors and "
                                 f"only 'sink' without successors, found {roots[:4]} and "
                                 f"{leaves[:4]}")
        return self

    def critical_path(self, duration: Mapping[str, float] | Callable[[TaskNode], float]
                      ) -> CriticalPath:
        """The longest source→sink path with node weights ``duration``.

        Args:
            duration: node id -> seconds (missing ids count 0), or a function of the node.

        Returns:
            ``CriticalPath(length, path)``; among equal paths the first in topological order.
        """
        nodes = {n.id: n for n in self.nodes}
        if callable(duration):
            dur = {k: float(duration(n)) for k, n in nodes.items()}
        else:
            unknown = set(duration) - set(nodes)
            if unknown:
                raise TaskGraphError(f"critical path: expected durations of known nodes, found "
                                     f"unknown {sorted(unknown)[:4]}")
            dur = {k: float(duration.get(k, 0.0)) for k in nodes}
        negative = sorted(k for k, v in dur.items() if not v >= 0)
        if negative:
            raise TaskGraphError(f"critical path: expected durations >= 0, found "
                                 f"{negative[0]!r}: {dur[negative[0]]}")
        preds = self.predecessors()
        finish: dict[str, float] = {}
        best_pred: dict[str, str | None] = {}
        for k in self.topological_order():
            bp = max(preds[k], key=lambda q: finish[q], default=None)
            finish[k] = (finish[bp] if bp is not None else 0.0) + dur[k]
            best_pred[k] = bp
        order = self.topological_order()
        # the last of the longest in topological order: the sink when durations are >= 0
        end = max(range(len(order)), key=lambda i: (finish[order[i]], i))
        end = order[end]
        path = [end]
        while best_pred[path[-1]] is not None:
            path.append(best_pred[path[-1]])
        return CriticalPath(finish[end], tuple(reversed(path)))

    def instructions(self, schedule: Schedule) -> dict[int, tuple[str, ...]]:
        """Per stage, the node ids it executes, in the order ``schedule`` gives.

        For ``F(s,mb)``: the incoming activation transfers (to receive), the forward, the
        outgoing activation transfers (to send). For ``B(s,mb)``: incoming gradient transfers,
        the backward, its accumulation, outgoing gradient transfers. For ``A``: ``AG(s)``.
        A transfer id appears in both its sender's and its receiver's list.

        Raises:
            TaskGraphError: if the schedule's stages/microbatches differ from the graph's.
        """
        self._check_schedule(schedule)
        incoming: dict[tuple[str, int, int], list[str]] = {}
        outgoing: dict[tuple[str, int, int], list[str]] = {}
        ids = {n.id for n in self.nodes}
        for n in self.nodes:
            if n.kind in ("transfer_act", "transfer_grad"):
                k = "F" if n.kind == "transfer_act" else "B"
                outgoing.setdefault((k, n.stage, n.microbatch), []).append(n.id)
                incoming.setdefault((k, n.peer_stage, n.microbatch), []).append(n.id)
        out = {}
        for s in range(self.num_stages):
            seq: list[str] = []
            for t in schedule.stage_tasks(s):
                if t.kind == "A":
                    seq.append(f"AG({s})")
                    continue
                key = (t.kind, s, t.microbatch)
                seq += incoming.get(key, [])
                seq.append(f"{t.kind}({s},{t.microbatch})")
                if t.kind == "B" and f"LA({s},{t.microbatch})" in ids:
                    seq.append(f"LA({s},{t.microbatch})")
                seq += outgoing.get(key, [])
            out[s] = tuple(seq)
        return out

    def with_schedule(self, schedule: Schedule) -> "TaskGraph":
        """This graph plus edges that serialize each stage's compute tasks in schedule order
        (transfers stay asynchronous). Its critical path is the static schedule's.

        Raises:
            TaskGraphError: if the schedule does not fit or its order creates a cycle.
        """
        extra = []
        for s, seq in self.instructions(schedule).items():
            compute = [k for k in seq if not k.startswith(("TA(", "TG("))]
            extra += [(a, b) for a, b in zip(compute, compute[1:])]
        known = set(self.edges)
        g = dataclasses.replace(self, edges=self.edges + tuple(e for e in extra
                                                               if e not in known))
        g.topological_order()
        return g

    def _check_schedule(self, schedule: Schedule) -> None:
        if (schedule.num_stages, schedule.num_microbatches) != (self.num_stages,
                                                                self.num_microbatches):
            raise TaskGraphError(
                f"schedule {schedule.name!r}: expected {self.num_stages} stages × "
                f"{self.num_microbatches} microbatches, found {schedule.num_stages} × "
                f"{schedule.num_microbatches}")

    def to_dict(self) -> dict[str, Any]:
        return {"num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
                "nodes": [dataclasses.asdict(n) for n in self.nodes],
                "edges": [list(e) for e in self.edges]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> "TaskGraph":
        """Inverse of ``to_json``; the result is validated."""
        d = json.loads(text)
        return cls(int(d["num_stages"]), int(d["num_microbatches"]),
                   tuple(TaskNode(**n) for n in d["nodes"]),
                   tuple(tuple(e) for e in d["edges"])).validate()


def build_task_graph(num_stages: int, num_microbatches: int,
                     boundary_tensors: Sequence[BoundaryTensor] | None = None) -> TaskGraph:
    """Build the task graph of one training step.

    Args:
        num_stages: pipeline stages ``p`` (1 = pure SPMD).
        num_microbatches: microbatches ``m`` (1 = no local accumulation).
        boundary_tensors: the tensors crossing stage boundaries, with their bytes; None means
            one anonymous activation (0 bytes) between each pair of adjacent stages.

    Returns:
        A validated ``TaskGraph``.

    Raises:
        TaskGraphError: on sizes < 1 or a boundary tensor that does not go forward.

    Example:
        >>> g = build_task_graph(2, 1, [BoundaryTensor(0, 1, "h", 4096)])
        >>> [n.id for n in g.nodes if n.kind.startswith("transfer")], g.node("TA(0→1,0)").nbytes
        (['TA(0→1,0)', 'TG(1→0,0)'], 4096)
    """
    p, m = int(num_stages), int(num_microbatches)
    if p < 1 or m < 1:
        raise TaskGraphError(f"task graph: expected >= 1 stages and microbatches, found p={p}, "
                             f"m={m}")
    if boundary_tensors is None:
        boundary_tensors = [BoundaryTensor(s, s + 1) for s in range(p - 1)]
    pairs: dict[tuple[int, int], list[BoundaryTensor]] = {}
    for t in boundary_tensors:
        if not 0 <= t.src_stage < t.dst_stage < p:
            raise TaskGraphError(f"boundary tensor {t.name!r}: expected 0 <= src < dst < {p}, "
                                 f"found src={t.src_stage}, dst={t.dst_stage}")
        pairs.setdefault((t.src_stage, t.dst_stage), []).append(t)

    nodes: list[TaskNode] = [TaskNode("source", "source")]
    edges: list[tuple[str, str]] = []
    fed = {d for (_, d) in pairs}
    for mb in range(m):
        for s in range(p):
            nodes.append(TaskNode(f"F({s},{mb})", "forward", s, mb))
            if s not in fed:
                edges.append(("source", f"F({s},{mb})"))
            for (a, d), ts in sorted(pairs.items()):
                if a == s:
                    tid = f"TA({a}→{d},{mb})"
                    nodes.append(TaskNode(tid, "transfer_act", a, mb, d, tuple(t.name for t in ts),
                                          sum(t.nbytes for t in ts)))
                    edges += [(f"F({a},{mb})", tid), (tid, f"F({d},{mb})")]
        for s in reversed(range(p)):
            b = f"B({s},{mb})"
            nodes.append(TaskNode(b, "backward", s, mb))
            edges.append((f"F({s},{mb})", b))
            for (a, d), ts in sorted(pairs.items(), reverse=True):
                grads = [t for t in ts if t.needs_gradient]
                if d == s and grads:
                    tid = f"TG({d}→{a},{mb})"
                    nodes.append(TaskNode(tid, "transfer_grad", d, mb, a,
                                          tuple(t.name for t in grads),
                                          sum(t.nbytes for t in grads)))
                    edges += [(b, tid), (tid, f"B({a},{mb})")]
            if m > 1:
                la = f"LA({s},{mb})"
                nodes.append(TaskNode(la, "accumulate", s, mb))
                edges.append((b, la))
                if mb > 0:
                    edges.append((f"LA({s},{mb - 1})", la))
    for s in range(p):
        nodes.append(TaskNode(f"AG({s})", "apply", s))
        edges += [(f"LA({s},{m - 1})" if m > 1 else f"B({s},0)", f"AG({s})"),
                  (f"AG({s})", "sink")]
    nodes.append(TaskNode("sink", "sink"))
    return TaskGraph(p, m, tuple(nodes), tuple(edges)).validate()
