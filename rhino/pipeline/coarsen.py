"""Op roles and the coarsening of a training step into units for the stage ILP.

Pass order::

    HloGraph + GradientBoundary
        │ classify_ops   free (no batch dependence: weights, constants, state-only values;
        │                copied into every stage that reads them) · fwd · bwd · ag
        ▼
        │ coarsen        forward ops -> units (see *granularity*), ordered topologically;
        │                each backward op joins the unit of its forward counterpart
        ▼
    Coarsening          unit of every op + the unit DAG as a ``StageProblem``

Granularity of forward units:

* ``layer`` (default when the weights have pytree paths): the forward ops reading the weights
  of one *group* (``weight_group``: a layer, ``params['layers'][3]``) form one unit together
  with every op on a path between two of them (they could not sit on another stage anyway),
  so a layer is never cut in two. Ops outside every group are units of their own, a chain
  of single-reader ops contracted into one; the cut between layers is left to the ILP
  (e.g. at the residual stream, not after the next layer's normalisation statistics). A
  group spanning more than ``max_group_share`` of the forward compute (a tied weight read
  at both ends) is not grouped.
* ``segment``: the segments between the critical nodes of the forward graph (§4.3), one
  unit per critical node and its preceding segment; values computed from the batch alone
  (labels, masks) move to their first reader's unit.
* ``op``: one unit per forward op (exact; small graphs).

The graph is never linearized: units keep the true edges, so a tensor may skip stages (UNet
skip connections cross from an encoder stage to a decoder stage directly).

Backward counterpart. A forward value is *available* on its unit and on the units of its
forward readers (a tensor cut between stages exists on both sides); a weight (or a free value
computed from parameters) on the units of the forward ops reading it. Walking backward ops in
program order, an op goes to the latest unit (topological rank) among those where its
forward operands are available that is not after any unit of its backward operands
(gradients only flow from later stages to earlier ones); with no forward operand it joins
its backward operands' earliest unit. A weight's gradient is also available where the weight
is read. So the weight gradient ``xᵀ·dy`` of a layer lands with the layer, ``dy·Wᵀ`` with
``W``, and a bias gradient ``Σ dy`` with its bias. Each backward edge ``i -> j`` then requires ``stage(j)
≤ stage(i)``: the unit DAG gets the edge ``unit(j) -> unit(i)``, and backward tensors count
when cut. Each stage thus owns its layers' weights and both passes. Cycles among units (a
counterpart rule that disagrees with the forward order) are merged into one unit.

Example:
    >>> import rhino
    >>> from rhino.models import get_model
    >>> from rhino.pipeline.gradient import find_gradient_boundary
    >>> m = get_model("gpt", layers=2, hidden=64, heads=2, seq=16, vocab=256)
    >>> g = rhino.ingest(m.step, *m.example_args())
    >>> b = find_gradient_boundary(g)
    >>> c = coarsen(g, classify_ops(g, b), state_params=b.state_params)
    >>> c.granularity, c.problem.num_units < 100
    ('layer', True)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

from rhino.hlo_passes.analyses import analyze
from rhino.hlo_passes.graph import HloGraph
from rhino.hlo_passes.subgraph import extract_subgraph
from rhino.pipeline.gradient import GradientBoundary
from rhino.pipeline.stage_ilp import CutTensor, StageAssignmentError, StageProblem
from rhino.vocabulary import Role

GRANULARITIES = ("auto", "layer", "segment", "op")
_GROUP = re.compile(r"^(.*\[\d+\])")


@dataclasses.dataclass(frozen=True)
class OpRoles:
    """The role of every op.

    Attributes:
        role: per op: ``free``, ``fwd``, ``bwd`` or ``ag``.
        method: how forward and backward were told apart: ``autodiff-names`` (backward =
            descendants of ``transpose(...)`` ops), ``loss-ancestors`` (forward = ancestors
            of the metric outputs) or ``forward-only`` (no backward found).
    """

    role: tuple[str, ...]
    method: str

    def ids(self, role: str) -> list[int]:
        return [i for i, r in enumerate(self.role) if r == role]


def classify_ops(graph: HloGraph, boundary: GradientBoundary) -> OpRoles:
    """Free / forward / backward / apply-gradients role of each op (see module docstring)."""
    n = len(graph.ops)
    dep = boundary.batch_dependent
    in_cg = boundary.in_compute()
    cg = [i for i in range(n) if in_cg[i] and dep[i] and graph.ops[i].opcode != "parameter"]
    role = [Role.FREE] * n
    for i in range(n):
        if dep[i] and not in_cg[i] and graph.ops[i].opcode != "parameter":
            role[i] = Role.APPLY
    seeds = [i for i in cg if any(c.startswith("transpose(")
                                  for c in graph.ops[i].op_name.split("/"))]
    bwd = [False] * n
    if seeds:
        method = "autodiff-names"
        for i in seeds:
            bwd[i] = True
        for i in cg:
            if not bwd[i] and any(bwd[o] for o in graph.ops[i].operands):
                bwd[i] = True
    elif boundary.metrics:
        method = "loss-ancestors"
        anc = [False] * n
        stack = list(boundary.metrics)
        while stack:
            i = stack.pop()
            if not anc[i]:
                anc[i] = True
                stack.extend(graph.ops[i].operands)
        for i in cg:
            bwd[i] = not anc[i]
    else:
        method = "forward-only"
    for i in cg:
        role[i] = Role.BACKWARD if bwd[i] else Role.FORWARD
    return OpRoles(tuple(role), method)


def weight_group(path: str) -> str | None:
    """The pytree group of a weight: its path up to the last list index
    (``params['layers'][3]['wqkv']`` -> ``params['layers'][3]``), else without its last key
    (``params['ln_f']['scale']`` -> ``params['ln_f']``); None for a top-level leaf.

    Example:
        >>> weight_group("params['layers'][3]['ln1']['scale']"), weight_group("params['wte']")
        ("params['layers'][3]", None)
    """
    m = _GROUP.match(path)
    if m:
        return m.group(1)
    cut = path.rfind("[")
    return path[:cut] if cut > 0 and "[" in path[:cut] else None


@dataclasses.dataclass(frozen=True)
class Coarsening:
    """Forward and backward ops grouped into units, and the unit DAG as a ``StageProblem``.

    Attributes:
        unit_of: per op, its unit (a topological rank), or -1 (free and apply ops).
        units: member op ids of each unit (forward and backward).
        problem: the stage problem on the units (``num_stages`` = 1; replace it per split).
        granularity: the granularity used (``layer``, ``segment`` or ``op``).
        groups: weight groups made into units.
    """

    unit_of: tuple[int, ...]
    units: tuple[tuple[int, ...], ...]
    problem: StageProblem
    granularity: str
    groups: tuple[str, ...]


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _weight_readers(graph: HloGraph, role: Sequence[str], state_params: Sequence[int]
                    ) -> dict[str, list[int]]:
    """Group -> forward ops reading its weights (directly or through free ops); only groups
    of two or more weights."""
    n = len(graph.ops)
    groups: list[frozenset[str]] = [frozenset()] * n
    leaves: dict[str, int] = {}
    for p in state_params:
        arg = graph.ops[p].arg
        g = weight_group(arg.path) if arg is not None else None
        if g is not None:
            groups[p] = frozenset((g,))
            leaves[g] = leaves.get(g, 0) + 1
    readers: dict[str, list[int]] = {}
    for op in graph.ops:
        i = op.id
        if role[i] not in (Role.FREE, Role.FORWARD) or not op.operands:
            continue
        acc = frozenset().union(*(groups[o] for o in op.operands))
        if not acc:
            continue
        if role[i] == Role.FREE:
            groups[i] = groups[i] | acc
        else:
            for g in acc:
                readers.setdefault(g, []).append(i)
    return {g: r for g, r in readers.items() if leaves.get(g, 0) >= 2}


def _layer_keys(graph: HloGraph, role: Sequence[str], fwd: list[int],
                readers: dict[str, list[int]], max_group_share: float
                ) -> tuple[list[int], list[str]]:
    n = len(graph.ops)
    users = graph.users
    is_fwd = [r == Role.FORWARD for r in role]
    total = sum(graph.ops[i].flops for i in fwd) or 1.0
    uf = _UnionFind(n)
    grouped = [False] * n
    kept: list[str] = []
    for g, rs in readers.items():
        down: set[int] = set()
        stack = list(rs)
        while stack:
            i = stack.pop()
            if i not in down:
                down.add(i)
                stack.extend(j for j in users[i] if is_fwd[j])
        up: set[int] = set()
        stack = list(rs)
        while stack:
            i = stack.pop()
            if i not in up:
                up.add(i)
                stack.extend(o for o in graph.ops[i].operands if is_fwd[o])
        closure = down & up
        if sum(graph.ops[i].flops for i in closure) > max_group_share * total:
            continue
        kept.append(g)
        first = min(closure)
        for i in closure:
            uf.union(first, i)
            grouped[i] = True
    # Chains outside the groups: an op whose only forward operand has it as only reader.
    for i in fwd:
        if grouped[i]:
            continue
        ins = {o for o in graph.ops[i].operands if is_fwd[o]}
        if len(ins) == 1:
            (o,) = ins
            if not grouped[o] and sum(1 for j in users[o] if is_fwd[j]) == 1:
                uf.union(o, i)
    # Forward values only the backward reads (JAX's residuals: derivative terms, and chains
    # of them) stay with the latest forward value they are computed from.
    outputs = set(graph.outputs)
    leads = [False] * n
    for i in reversed(fwd):
        leads[i] = i in outputs or any(is_fwd[j] and leads[j] for j in users[i])
    for i in fwd:
        if not leads[i]:
            ins = [o for o in graph.ops[i].operands if is_fwd[o]]
            if ins:
                uf.union(max(ins), i)
    key = [-1] * n
    for i in fwd:
        key[i] = uf.find(i)
    return key, kept


def _segment_keys(graph: HloGraph, role: Sequence[str], fwd: list[int]) -> list[int]:
    n = len(graph.ops)
    free = [i for i in range(n) if role[i] == Role.FREE]
    sub = extract_subgraph(graph, fwd, duplicate=free, name=f"{graph.name}.forward")
    an = analyze(sub.graph)
    crit_index = {c: k for k, c in enumerate(an.critical)}
    key = [-1] * n
    critical = [False] * n
    for j, src in enumerate(sub.origin):
        if src in sub.inputs or role[src] != Role.FORWARD:
            continue
        key[src] = crit_index[j] if j in crit_index else an.segment_of[j]
        critical[src] = j in crit_index
    users = graph.users
    # Values computed from the batch alone (labels, masks) sit with their first reader.
    after = [False] * n
    for i in fwd:
        after[i] = critical[i] or any(after[o] for o in graph.ops[i].operands)
    for i in reversed(fwd):
        if not after[i]:
            later = [key[j] for j in users[i] if role[j] == Role.FORWARD]
            if later:
                key[i] = max(key[i], min(later))
    for i in fwd:  # monotone: a reader never sits in an earlier unit than what it reads
        for o in graph.ops[i].operands:
            if role[o] == Role.FORWARD and key[o] > key[i]:
                key[i] = key[o]
    return key


def _data_with_first_reader(graph: HloGraph, role: Sequence[str], fwd: list[int],
                            state_params: Sequence[int], key: list[int]) -> None:
    """Forward ops computed from the batch alone (no weight reaches them: masks, positions,
    noise, a normaliser) join the unit of their first reader, in place: a stage program
    computes them for the whole batch where they are read (``rhino.jaxpr.microbatch``),
    so a unit of them alone would be a stage with nothing of its own to run."""
    state = [False] * len(graph.ops)
    for p in state_params:
        state[p] = True
    for op in graph.ops:
        if not state[op.id] and any(state[o] for o in op.operands):
            state[op.id] = True
    users = graph.users
    for i in reversed(fwd):
        if not state[i]:
            later = [key[j] for j in users[i] if role[j] == Role.FORWARD]
            if later:
                key[i] = min(later)


def _unit_problem(graph: HloGraph, role: Sequence[str], unit_of: list[int],
                  backward: bool) -> tuple[StageProblem, list[list[int]], list[int]]:
    """Renumber units topologically (merging cycles) and build the unit DAG.

    Returns (problem, members, unit_of) with dense topological unit numbers.
    """
    import networkx as nx

    n = len(graph.ops)
    users = graph.users
    for _ in range(2):
        keys = sorted({u for u in unit_of if u >= 0})
        dag = nx.DiGraph()
        dag.add_nodes_from(keys)
        for i in range(n):
            u = unit_of[i]
            if u < 0:
                continue
            for j in users[i]:
                v = unit_of[j]
                if v < 0 or v == u:
                    continue
                if role[i] == Role.FORWARD and role[j] == Role.FORWARD:
                    dag.add_edge(u, v)
                elif backward and role[i] == Role.BACKWARD and role[j] == Role.BACKWARD:
                    dag.add_edge(v, u)       # gradients flow to earlier stages
        cond = nx.condensation(dag)
        comp = cond.graph["mapping"]
        # Topological order, ties by the smallest op id of the component (program order).
        first = {}
        for i in range(n):
            if unit_of[i] >= 0:
                c = comp[unit_of[i]]
                first[c] = min(first.get(c, i), i)
        order = list(nx.lexicographical_topological_sort(cond, key=lambda c: first[c]))
        rank = {c: r for r, c in enumerate(order)}
        unit_of = [rank[comp[u]] if u >= 0 else -1 for u in unit_of]
        if all(len(cond.nodes[c]["members"]) == 1 for c in cond.nodes):
            break
    num = max(unit_of) + 1
    members: list[list[int]] = [[] for _ in range(num)]
    for i in range(n):
        if unit_of[i] >= 0:
            members[unit_of[i]].append(i)
    compute = [float(sum(graph.ops[i].flops for i in m)) for m in members]
    edges: set[tuple[int, int]] = set()
    tensors: list[CutTensor] = []
    for i in range(n):
        u = unit_of[i]
        if u < 0:
            continue
        cons = set()
        for j in users[i]:
            v = unit_of[j]
            if v < 0 or v == u:
                continue
            cons.add(v)
            if role[i] == Role.FORWARD and role[j] == Role.FORWARD:
                edges.add((u, v))
            elif role[i] == Role.BACKWARD and role[j] == Role.BACKWARD:
                edges.add((v, u))
        if cons:
            tensors.append(CutTensor(u, tuple(sorted(cons)), int(graph.ops[i].out_bytes),
                                     graph.ops[i].name))
    names = []
    for m in members:
        heavy = max(m, key=lambda i: (role[i] == Role.FORWARD, graph.ops[i].flops, -i))
        names.append(graph.ops[heavy].name)
    problem = StageProblem(tuple(names), tuple(compute), tuple(sorted(edges)), tuple(tensors), 1)
    return problem, members, unit_of


def _attach_backward(graph: HloGraph, role: Sequence[str], unit_of: list[int],
                     gradient_weights: Mapping[int, Sequence[int]]) -> None:
    """Backward ops join their forward counterpart's unit (module docstring)."""
    n = len(graph.ops)
    users = graph.users
    avail: list[set[int]] = [set() for _ in range(n)]
    for i in range(n):
        if role[i] == Role.FORWARD:
            avail[i].add(unit_of[i])
            avail[i].update(unit_of[j] for j in users[i] if role[j] == Role.FORWARD)
    # A weight (or a value computed from weights / the batch alone) is at home where forward
    # ops read it, through free ops: dy·Wᵀ joins the layer of W.
    from_param = [False] * n
    for op in graph.ops:
        from_param[op.id] = role[op.id] == Role.FREE and (
            op.opcode == "parameter" or any(from_param[o] for o in op.operands))
    for i in range(n - 1, -1, -1):
        if from_param[i]:
            for j in users[i]:
                if role[j] == Role.FORWARD:
                    avail[i].add(unit_of[j])
                elif from_param[j]:
                    avail[i] |= avail[j]
    # A gradient's private chain (ops only it reads, e.g. Σ over the batch, then over the
    # sequence, then a reshape) belongs with the weight too.
    owner: dict[int, Sequence[int]] = dict(gradient_weights)
    for g, ws in gradient_weights.items():
        chain = {g}
        stack = [g]
        while stack:
            i = stack.pop()
            for o in graph.ops[i].operands:
                if role[o] == Role.BACKWARD and o not in chain and \
                        all(j in chain for j in users[o]):
                    chain.add(o)
                    owner.setdefault(o, ws)
                    stack.append(o)
    pending = []
    last = max(unit_of)
    for op in graph.ops:
        i = op.id
        if role[i] != Role.BACKWARD:
            continue
        grads = [unit_of[o] for o in op.operands if role[o] == Role.BACKWARD and unit_of[o] >= 0]
        resid: set[int] = set()
        for o in op.operands:
            if role[o] == Role.FORWARD or from_param[o]:
                resid |= avail[o]
        for w in owner.get(i, ()):   # a weight's gradient: at home with the weight
            resid |= avail[w]
        upper = min(grads) if grads else None
        cands = [r for r in resid if upper is None or r <= upper]
        if cands:
            unit_of[i] = max(cands)
        elif upper is not None:
            unit_of[i] = upper
        else:
            pending.append(i)
    for i in reversed(pending):  # no anchor: beside its backward readers (latest of them)
        later = [unit_of[j] for j in users[i] if role[j] == Role.BACKWARD and unit_of[j] >= 0]
        unit_of[i] = max(later) if later else last


def coarsen(graph: HloGraph, roles: OpRoles, granularity: str = "auto",
            state_params: Sequence[int] = (), max_group_share: float = 0.5,
            gradient_weights: Mapping[int, Sequence[int]] | None = None) -> Coarsening:
    """Group forward ops into units, attach backward ops, and build the unit DAG.

    Args:
        graph: the training-step graph.
        roles: from ``classify_ops``.
        granularity: ``auto`` (``layer`` if some weight group exists, else ``segment``),
            ``layer``, ``segment`` or ``op`` (see the module docstring).
        state_params: the weight (state) parameter ops, for the weight groups.
        max_group_share: a group spanning more of the forward compute is not grouped.
        gradient_weights: gradient op -> the weights it updates
            (``gradient.gradient_weights``): a gradient joins its weight's unit even when it
            reads no forward value (a bias gradient ``Σ dy``).

    Raises:
        ValueError: unknown granularity.
        StageAssignmentError: no forward op.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, found "
                         f"{granularity!r}")
    role = roles.role
    fwd = roles.ids(Role.FORWARD)
    if not fwd:
        raise StageAssignmentError("stage assignment: expected forward ops that depend on the "
                                   "batch, found none")
    readers = (_weight_readers(graph, role, state_params)
               if granularity in ("auto", "layer") else {})
    groups: list[str] = []
    if granularity == "op":
        key = [-1] * len(graph.ops)
        for k, i in enumerate(fwd):
            key[i] = k
    elif granularity == "segment" or (granularity == "auto" and not readers):
        granularity = "segment"
        key = _segment_keys(graph, role, fwd)
    else:
        granularity = "layer"
        key, groups = _layer_keys(graph, role, fwd, readers, max_group_share)
    if state_params:
        _data_with_first_reader(graph, role, fwd, state_params, key)
    _, _, unit_of = _unit_problem(graph, role, key, backward=False)
    _attach_backward(graph, role, unit_of, gradient_weights or {})
    problem, members, unit_of = _unit_problem(graph, role, unit_of, backward=True)
    return Coarsening(tuple(unit_of), tuple(tuple(m) for m in members), problem, granularity,
                      tuple(groups))
