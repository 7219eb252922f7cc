"""``SpmdPlan``: the planner's answer as plain, JSON-serializable data, with a report.

A plan holds, for the program it was made for: the mesh and the cost model it was priced
with, a spec per op (what the annotator writes into the program), a spec per entry parameter by pytree path, the collectives the plan
predicts with their bytes, per-device memory, the estimated step time, the search statistics
and every op left replicated for lack of a rule. ``to_json`` / ``from_json`` round-trip it
exactly, so a plan can be saved, diffed, reloaded and run later; ``from_json`` also reads
format 1, whose mesh carried the cost figures.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> p = rhino.plan(lambda x, w: jnp.sum(x @ w), jnp.ones((64, 32)), jnp.ones((32, 32)),
    ...                mesh_shape=(4,)).spmd
    >>> SpmdPlan.from_json(p.to_json()) == p, p.cost.backend
    (True, 'cpu')
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

from rhino.planner.cost_model import CostModel, legacy_mesh
from rhino.planner.utilization import Utilization, utilization
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spec import ShardingSpec
from rhino.vocabulary import SolverStatus

FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class OpPlan:
    """The chosen strategy of one op.

    Attributes:
        name: the op's name in the graph (stable across ingestions of the same program).
        opcode: the HLO opcode.
        strategy: the strategy's label (e.g. ``dot[m0@x]``).
        out_spec: output spec; None for tuple-shaped ops (kept replicated).
        in_specs: the spec each operand is resharded to before the op (None for tuples).
    """

    name: str
    opcode: str
    strategy: str
    out_spec: ShardingSpec | None
    in_specs: tuple[ShardingSpec | None, ...]


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """Spec of one entry parameter.

    Attributes:
        index: flat parameter index; path: pytree path; shape: e.g. ``f32[512,2048]``.
        spec: its spec; local_bytes: bytes per device under the spec; donated: donated.
    """

    index: int
    path: str
    shape: str
    spec: ShardingSpec
    global_bytes: int
    local_bytes: int
    donated: bool


@dataclasses.dataclass(frozen=True)
class PlannedCollective:
    """A collective the plan implies.

    Attributes:
        kind: all-reduce / all-gather / reduce-scatter / all-to-all.
        axes: mesh axis names of the device group.
        bytes: per-device bytes (convention of ``planner.collectives``).
        seconds: α-β cost.
        tensor: the op whose value is communicated; consumer: the op that needs it, or
            ``"<output>"`` / ``"<carry to PARAM>"``.
        source: ``file:line`` of the producing op.
        alpha_share: the part of the latency α charged: ``1/K`` for one of ``K`` scalar
            reductions XLA combines into one all-reduce (``build.combined_reductions``).
    """

    kind: str
    axes: tuple[str, ...]
    bytes: int
    seconds: float
    tensor: str
    consumer: str
    source: str | None
    alpha_share: float = 1.0


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes: entry parameters (weights, optimizer state, batch) and the peak
    of everything live at once in program order (parameters included)."""

    parameters: int
    peak: int


@dataclasses.dataclass(frozen=True)
class SearchStats:
    """How the plan was found. Times in seconds."""

    opt_level: str
    status: SolverStatus
    objective: float
    ingest_s: float
    analyze_s: float
    build_s: float
    solve_s: float
    memory_rounds: int
    forced_sharded: int
    nodes: int
    choices: int
    edges: int

    @property
    def total_s(self) -> float:
        return self.ingest_s + self.analyze_s + self.build_s + self.solve_s


@dataclasses.dataclass(frozen=True)
class UnplannedOp:
    """An op kept replicated because no sharding rule covers it."""

    name: str
    opcode: str
    source: str | None
    reason: str


@dataclasses.dataclass(frozen=True)
class UnevenValue:
    """A value split over shards that do not divide its dimension (padded, as XLA runs it;
    only inside the step: its arguments and results keep even splits).

    Attributes:
        name: the op's name; shape: its type (``f32[8,50257]``); spec: its spec's text;
        padded: the padded shape each shard is a slice of; source: ``file:line``.
    """

    name: str
    shape: str
    spec: str
    padded: str
    source: str | None


@dataclasses.dataclass(frozen=True)
class SplitAlternative:
    """Why a plan that splits nothing won: the cheapest plan found that splits the step's
    largest op (its replicated choices removed), priced by the same cost model.

    Attributes:
        op: the largest op's name; flops: its FLOPs; source: its ``file:line``.
        step_s, compute_s, communication_s: that plan's estimates.
        collectives: how many collectives it needs.
        note: why there is no such plan (e.g. no op can be split), else "".
    """

    op: str
    flops: float
    source: str | None
    step_s: float
    compute_s: float
    communication_s: float
    collectives: int
    note: str = ""


@dataclasses.dataclass(frozen=True)
class SpmdPlan:
    """An SPMD plan for one program on one mesh (see the module docstring).

    Attributes:
        program, origin: the program's name and where it came from.
        mesh: the logical mesh; cost: the cost model the plan was priced with.
        ops, params: the spec of every op and entry parameter.
        collectives: those the plan implies; memory: per-device bytes.
        memory_budget: the budget planned for; compute_s, communication_s: estimates.
        search: how it was found; unplanned: ops kept replicated for lack of a rule.
        split_alternative: where the plan splits nothing on a mesh of several devices,
            the cheapest plan that splits the largest op, for the report's "why".
        overhead_s: dispatching the step's program (``CostModel.program_seconds``).
        model_flops: the step's matmul FLOPs (``op_cost.model_flops``), for its MFU.
        matmul_dtype: the dtype most of them run in.
        uneven: the values split unevenly (padded) inside the step.
    """

    program: str
    origin: str
    mesh: AbstractMesh
    cost: CostModel
    ops: tuple[OpPlan, ...]
    params: tuple[ParamPlan, ...]
    collectives: tuple[PlannedCollective, ...]
    memory: MemoryEstimate
    memory_budget: int | None
    compute_s: float
    communication_s: float
    search: SearchStats
    unplanned: tuple[UnplannedOp, ...]
    split_alternative: SplitAlternative | None = None
    overhead_s: float = 0.0
    model_flops: float = 0.0
    matmul_dtype: str = "f32"
    uneven: tuple[UnevenValue, ...] = ()

    @property
    def splits_nothing(self) -> bool:
        """Whether every device runs the whole step: no value split, no collective."""
        return not self.collectives and all(
            o.out_spec is None or o.out_spec.is_replicated for o in self.ops)

    @property
    def step_time_s(self) -> float:
        """Estimated step time: compute plus communication (no overlap assumed) plus the
        program's dispatch."""
        return self.compute_s + self.communication_s + self.overhead_s

    def utilization(self) -> Utilization:
        """The plan's estimated MFU and its ceiling (``planner.utilization``)."""
        return utilization(self.model_flops, self.matmul_dtype, self.mesh.num_devices,
                           self.step_time_s, self.cost)

    def param_spec(self, path: str) -> ShardingSpec:
        """The spec of the entry parameter at ``path`` (e.g. ``params['wte']``)."""
        for p in self.params:
            if p.path == path:
                return p.spec
        raise KeyError(f"no parameter {path!r} in the plan; parameters are e.g. "
                       f"{[p.path for p in self.params[:5]]}")

    def collective_summary(self) -> dict[str, tuple[int, int]]:
        """kind -> (count, total bytes)."""
        count: Counter = Counter()
        nbytes: Counter = Counter()
        for c in self.collectives:
            count[c.kind] += 1
            nbytes[c.kind] += c.bytes
        return {k: (count[k], nbytes[k]) for k in sorted(count)}

    def why_whole(self) -> str:
        """Why every device runs the whole step (for a plan that ``splits_nothing``)."""
        a, ms = self.split_alternative, 1e3
        head = (f"every one of the {self.mesh.num_devices} devices runs the whole step "
                f"({ms * self.compute_s:.3f} ms of compute each)")
        if a is None:
            return head
        if a.note:
            return f"{head}: {a.note}"
        return (f"{head}: the cheapest plan found that splits its largest op ({a.op}, "
                f"{a.flops:.3g} FLOP{', ' + a.source if a.source else ''}) is estimated at "
                f"{ms * a.step_s:.3f} ms: compute falls to {ms * a.compute_s:.3f} ms but its "
                f"{a.collectives} collectives cost {ms * a.communication_s:.3f} ms. A larger "
                f"batch (more work per collective) or slower devices favour splitting")

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        def spec(s):
            return None if s is None else s.to_dict()
        return {
            "format": FORMAT_VERSION, "program": self.program, "origin": self.origin,
            "mesh": self.mesh.to_dict(), "cost": self.cost.to_dict(),
            "ops": [[o.name, o.opcode, o.strategy, spec(o.out_spec),
                     [spec(s) for s in o.in_specs]] for o in self.ops],
            "params": [dict(dataclasses.asdict(p), spec=p.spec.to_dict()) for p in self.params],
            "collectives": [dataclasses.asdict(c) for c in self.collectives],
            "memory": dataclasses.asdict(self.memory), "memory_budget": self.memory_budget,
            "compute_s": self.compute_s, "communication_s": self.communication_s,
            "search": dataclasses.asdict(self.search),
            "unplanned": [dataclasses.asdict(u) for u in self.unplanned],
            "split_alternative": (None if self.split_alternative is None
                                  else dataclasses.asdict(self.split_alternative)),
            "overhead_s": self.overhead_s, "model_flops": self.model_flops,
            "matmul_dtype": self.matmul_dtype,
            "uneven": [dataclasses.asdict(u) for u in self.uneven],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpmdPlan":
        """The plan of ``to_dict``, or of a format-1 document (cost figures in its mesh).

        Raises:
            ValueError: another format, or a malformed mesh or cost model.
        """
        if d.get("format") not in (1, FORMAT_VERSION):
            raise ValueError(f"plan JSON: expected format {FORMAT_VERSION} (or 1), found "
                             f"{d.get('format')!r}")
        if d["format"] == 1:
            mesh, cost = legacy_mesh(d["mesh"])
        else:
            mesh, cost = AbstractMesh.from_dict(d["mesh"]), CostModel.from_dict(d["cost"])

        def spec(x):
            return None if x is None else ShardingSpec.from_dict(x)
        return cls(
            program=d["program"], origin=d["origin"], mesh=mesh, cost=cost,
            ops=tuple(OpPlan(n, oc, st, spec(o), tuple(spec(s) for s in ins))
                      for n, oc, st, o, ins in d["ops"]),
            params=tuple(ParamPlan(**dict(p, spec=ShardingSpec.from_dict(p["spec"])))
                         for p in d["params"]),
            collectives=tuple(PlannedCollective(**dict(c, axes=tuple(c["axes"])))
                              for c in d["collectives"]),
            memory=MemoryEstimate(**d["memory"]), memory_budget=d["memory_budget"],
            compute_s=d["compute_s"], communication_s=d["communication_s"],
            search=SearchStats(**dict(d["search"], status=SolverStatus(d["search"]["status"]))),
            unplanned=tuple(UnplannedOp(**u) for u in d["unplanned"]),
            split_alternative=(None if d.get("split_alternative") is None
                               else SplitAlternative(**d["split_alternative"])),
            overhead_s=float(d.get("overhead_s", 0.0)),
            model_flops=float(d.get("model_flops", 0.0)),
            matmul_dtype=str(d.get("matmul_dtype", "f32")),
            uneven=tuple(UnevenValue(**u) for u in d.get("uneven", ())))

    @classmethod
    def from_json(cls, text: str) -> "SpmdPlan":
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ report
    def report(self, max_params: int = 40, max_collectives: int = 15, full: bool = False
               ) -> str:
        """A report a person can read: specs, collectives, memory, time, search, gaps.

        Args:
            max_params, max_collectives: rows listed (the largest first).
            full: list every row (``rhino plan --all``).
        """
        from rhino.errors import format_bytes as _bytes

        if full:
            max_params = max_collectives = len(self.params) + len(self.collectives) + 1
        m, s = self.mesh, self.search
        status = SEARCH_STATUS.get(str(s.status), str(s.status))
        lines = [
            f"rhino plan: {self.program}  ({self.origin})",
            f"  mesh              {m}  ({m.num_devices} devices)",
            f"  cost model        {self.cost.summary()}",
            f"  search            {s.opt_level}, {s.status} ({status}), {s.total_s:.2f} s "
            f"(ingest {s.ingest_s:.2f}, analyses {s.analyze_s:.2f}, build {s.build_s:.2f}, "
            f"solve {s.solve_s:.2f}); {s.nodes} ops, {s.choices} strategies, {s.edges} edges",
            f"  step time (est.)  {1e3 * self.step_time_s:.3f} ms = compute "
            f"{1e3 * self.compute_s:.3f} ms + communication {1e3 * self.communication_s:.3f} ms"
            + (f" + dispatch {1e3 * self.overhead_s:.3f} ms" if self.overhead_s else "")
            + " (the cost model's estimate, not a measurement)",
            f"  utilization       {self.utilization().line()}",
            f"  memory / device   parameters {_bytes(self.memory.parameters)}, peak "
            f"{_bytes(self.memory.peak)} (estimated)" + self._budget_text(),
        ]
        if self.splits_nothing and m.num_devices > 1:
            lines.append("  splits nothing    " + self.why_whole())
        summary = self.collective_summary()
        lines.append("  collectives       " + (", ".join(
            f"{k} ×{c} ({_bytes(b)})" for k, (c, b) in summary.items()) or "none")
            + ("; per collective: kind, mesh axes, bytes per device, estimated time, the "
               "value -> its reader, source line" if self.collectives else ""))
        big = sorted(self.collectives, key=lambda c: -c.seconds)[:max_collectives]
        for c in big:
            lines.append(f"    {c.kind:<15} over {','.join(c.axes):<5} {_bytes(c.bytes):>12}  "
                         f"{1e3 * c.seconds:8.3f} ms  {c.tensor} -> {c.consumer}"
                         + (f" (combined with {round(1 / c.alpha_share) - 1} others)"
                            if c.alpha_share < 1 else "")
                         + (f"  [{c.source}]" if c.source else ""))
        if len(self.collectives) > len(big):
            lines.append(f"    ... {len(self.collectives) - len(big)} more ({MORE_HINT})")
        lines.append("  parameters (path, global shape, spec, bytes per device; largest "
                     "first):")
        ranked = sorted(self.params, key=lambda p: -p.global_bytes)
        counts = Counter(p.spec.to_str(m) for p in self.params)
        shown = ranked[:max_params]
        # Columns as wide as the longest path and shape shown (NNX paths run long).
        wp = max([44] + [len(p.path) for p in shown])
        ws = max([20] + [len(p.shape) for p in shown])
        for p in shown:
            lines.append(f"    {p.path:<{wp}} {p.shape:<{ws}} {p.spec.to_str(m):<16} "
                         f"{_bytes(p.local_bytes):>12}")
        if len(ranked) > max_params:
            lines.append(f"    ... {len(ranked) - max_params} more ({MORE_HINT}); specs "
                         f"overall: " + ", ".join(f"{k} ×{v}" for k, v in counts.most_common()))
        if self.uneven:
            lines.append(f"  uneven splits     {len(self.uneven)} values split over shards "
                         f"that do not divide them, padded as XLA runs them (only inside "
                         f"the step: JAX holds no uneven split at its arguments and "
                         f"results); the largest:")
            shown = self.uneven if full else self.uneven[:5]
            for u in shown:
                lines.append(f"    {u.name:<24} {u.shape:<20} {u.spec:<12} padded to "
                             f"{u.padded}" + (f"  [{u.source}]" if u.source else ""))
            if len(self.uneven) > len(shown):
                lines.append(f"    ... {len(self.uneven) - len(shown)} more ({MORE_HINT})")
        if self.unplanned:
            lines.append(f"  replicated for lack of a rule ({len(self.unplanned)} ops):")
            shown = self.unplanned if full else self.unplanned[:20]
            for u in shown:
                lines.append(f"    {u.name} ({u.opcode}) {u.reason}"
                             + (f"  at {u.source}" if u.source else ""))
            if len(self.unplanned) > len(shown):
                lines.append(f"    ... {len(self.unplanned) - len(shown)} more ({MORE_HINT})")
        else:
            lines.append("  replicated for lack of a rule: none")
        return "\n".join(lines)

    def _budget_text(self) -> str:
        if self.memory_budget is None:
            return ""
        from rhino.errors import format_bytes as _bytes

        s = self.search
        forced = ("no parameter had to be forced sharded" if not s.forced_sharded else
                  f"the {s.forced_sharded} largest parameters forced sharded to fit "
                  f"({s.memory_rounds} rounds of planning)")
        return f" (budget {_bytes(self.memory_budget)}: {forced})"


MORE_HINT = "report(full=True) or rhino plan --all lists them"
"""What a report says where it leaves rows out."""

SEARCH_STATUS = {
    "optimal": "the solver proved no plan is cheaper under the cost model",
    "heuristic": "O2's three-level search: a good plan without a proof that none is cheaper",
    "time_limit": "the best plan found before the time limit",
    "brute_force": "every assignment tried",
    "given": "given, not searched",
}
"""What each search status means, as the report says it."""
