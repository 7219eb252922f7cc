"""``PipelinePlan``: the pipeline planner's answer as plain, JSON-serializable data.

A plan names the kind the controller chose (``spmd``, ``pipeline`` or ``hybrid``), the
cluster, the gradient boundary, and per stage: its devices and SPMD mesh, the ops it runs
(by name), op counts, FLOPs, the estimated per-microbatch compute / communication / sends,
the once-per-step apply-gradients and gradient synchronization, its memory, and its SPMD
plan (an ``ExecutionPlan``). It lists the tensors crossing between stages, the weights
read on several stages, every candidate the controller weighed with its estimate, why the
winner won, and the time of each search phase. ``to_json`` / ``from_json`` round-trip it.

Example:
    >>> import rhino
    >>> from rhino.models import get_model
    >>> m = get_model("mlp", batch=64, hidden=64, layers=2)
    >>> p = rhino.plan_pipeline(m.step, *m.example_args(), cluster="1x2", max_stages=2)
    >>> PipelinePlan.from_json(p.to_json()) == p
    True
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rhino.errors import format_bytes
from rhino.pipeline.cluster import Cluster
from rhino.planner.mesh import AbstractMesh
from rhino.planner.plan import ExecutionPlan

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Per-device bytes of one stage under 1F1B.

    Attributes:
        state: weights and optimizer state (local shards).
        gradients: the gradient accumulation buffer.
        per_microbatch: activations and inputs of one microbatch.
        in_flight: microbatches whose activations are held at once (``min(m, p - s)``).
        total: ``state + gradients + in_flight · per_microbatch``.
    """

    state: int
    gradients: int
    per_microbatch: int
    in_flight: int
    total: int


@dataclasses.dataclass(frozen=True)
class StageEstimate:
    """Estimated seconds of one stage.

    Attributes:
        compute_s: forward + backward compute of one microbatch.
        communication_s: the stage's own collectives for one microbatch.
        send_s: sending its outputs (activations forward, gradients backward) for one
            microbatch to the other stages' meshes.
        apply_s: once per step: apply-gradients compute plus gradient synchronization.
    """

    compute_s: float
    communication_s: float
    send_s: float
    apply_s: float

    @property
    def microbatch_s(self) -> float:
        return self.compute_s + self.communication_s + self.send_s


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One pipeline stage.

    Attributes:
        index: the stage number.
        devices: global device ids (host-major numbering); hosts: the hosts they sit on.
        mesh: the stage's SPMD mesh.
        ops: names of the program ops the stage runs (forward, backward, apply).
        op_counts: ``{"forward", "backward", "apply", "copied"}`` (copied: weights,
            constants and state-only values the stage recomputes or reads itself).
        flops: ``(forward, backward, apply)`` FLOPs for the whole batch.
        weights: pytree paths of the state arguments the stage reads.
        estimate: seconds; memory: bytes per device.
        spmd: the stage's SPMD plan (None when left out of the JSON).
    """

    index: int
    devices: tuple[int, ...]
    hosts: tuple[int, ...]
    mesh: AbstractMesh
    ops: tuple[str, ...]
    op_counts: dict[str, int]
    flops: tuple[float, float, float]
    weights: tuple[str, ...]
    estimate: StageEstimate
    memory: StageMemory
    spmd: ExecutionPlan | None = None


@dataclasses.dataclass(frozen=True)
class CrossTensor:
    """A tensor sent between stages.

    Attributes:
        name: the producing op; shape: e.g. ``f32[4,64,512]``; bytes: whole-batch size.
        src: producing stage; dsts: stages receiving it.
        kind: ``activation``, ``residual``, ``gradient`` (per microbatch),
            ``weight-gradient`` or ``apply`` (per step).
        seconds: estimated transfer time (per microbatch, or per step).
    """

    name: str
    shape: str
    bytes: int
    src: int
    dsts: tuple[int, ...]
    kind: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration the controller weighed.

    Attributes:
        kind: ``spmd``, ``pipeline`` or ``hybrid``.
        num_stages: ``p``; stage_mesh: the mesh shape of each stage.
        feasible: fits in device memory (and could be planned).
        step_s: estimated step time (None when infeasible).
        compute_s / communication_s / transfer_s / bubble_s / apply_s: the parts of
            ``step_s`` (see ``cost.pipeline_step``).
        memory: the largest per-device bytes of any stage.
        note: why it is infeasible (or pruned), or what limited it.
        lower_bound_s: no plan of this stage count can be faster (``search._lower_bound``).
    """

    kind: str
    num_stages: int
    stage_mesh: tuple[int, ...]
    feasible: bool
    step_s: float | None
    compute_s: float
    communication_s: float
    transfer_s: float
    bubble_s: float
    apply_s: float
    memory: int
    note: str = ""
    lower_bound_s: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.kind:<8} pp={self.num_stages:<2} stage mesh " \
               f"({'x'.join(map(str, self.stage_mesh))})"


@dataclasses.dataclass(frozen=True)
class SearchTimes:
    """Seconds spent per phase (wall time; phases overlap when run in parallel).

    Attributes:
        ingest, boundary, coarsen: before the search.
        stage_ilp: all stage ILPs; spmd: all per-stage SPMD plans (summed over workers);
        estimate: costing; total: the whole search, wall clock.
        candidates: configurations weighed; spmd_plans: SPMD plans made (others reused).
    """

    ingest: float
    boundary: float
    coarsen: float
    stage_ilp: float
    spmd: float
    estimate: float
    total: float
    candidates: int
    spmd_plans: int


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """The plan (see the module docstring)."""

    program: str
    origin: str
    cluster: Cluster
    kind: str
    num_stages: int
    num_microbatches: int
    epsilon: float
    epsilon_used: float
    boundary: dict[str, Any]
    stages: tuple[StagePlan, ...]
    crossings: tuple[CrossTensor, ...]
    shared_weights: tuple[tuple[str, tuple[int, ...]], ...]
    step_s: float
    memory_budget: int | None
    candidates: tuple[Candidate, ...]
    decision: str
    search: SearchTimes

    @property
    def winner(self) -> Candidate:
        """The candidate this plan realizes."""
        for c in self.candidates:
            if c.feasible and c.step_s == self.step_s and c.num_stages == self.num_stages \
                    and c.stage_mesh == self.stages[0].mesh.shape:
                return c
        raise LookupError("the plan's own candidate is missing from its candidates")

    # ------------------------------------------------------------------ serialization
    def to_dict(self, include_spmd: bool = True) -> dict[str, Any]:
        def stage(s: StagePlan) -> dict[str, Any]:
            return {"index": s.index, "devices": list(s.devices), "hosts": list(s.hosts),
                    "mesh": s.mesh.to_dict(), "ops": list(s.ops), "op_counts": s.op_counts,
                    "flops": list(s.flops), "weights": list(s.weights),
                    "estimate": dataclasses.asdict(s.estimate),
                    "memory": dataclasses.asdict(s.memory),
                    "spmd": s.spmd.to_dict() if include_spmd and s.spmd is not None else None}
        return {
            "format": FORMAT_VERSION, "program": self.program, "origin": self.origin,
            "cluster": self.cluster.to_dict(), "kind": self.kind,
            "num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
            "epsilon": self.epsilon, "epsilon_used": self.epsilon_used,
            "boundary": self.boundary, "stages": [stage(s) for s in self.stages],
            "crossings": [dataclasses.asdict(c) for c in self.crossings],
            "shared_weights": [[p, list(s)] for p, s in self.shared_weights],
            "step_s": self.step_s, "memory_budget": self.memory_budget,
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
            "decision": self.decision, "search": dataclasses.asdict(self.search),
        }

    def to_json(self, indent: int | None = None, include_spmd: bool = True) -> str:
        return json.dumps(self.to_dict(include_spmd), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PipelinePlan":
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(f"pipeline plan JSON: expected format {FORMAT_VERSION}, found "
                             f"{d.get('format')!r}")

        def stage(s: dict[str, Any]) -> StagePlan:
            return StagePlan(
                s["index"], tuple(s["devices"]), tuple(s["hosts"]),
                AbstractMesh.from_dict(s["mesh"]), tuple(s["ops"]), dict(s["op_counts"]),
                tuple(s["flops"]), tuple(s["weights"]), StageEstimate(**s["estimate"]),
                StageMemory(**s["memory"]),
                ExecutionPlan.from_dict(s["spmd"]) if s["spmd"] is not None else None)
        return cls(
            program=d["program"], origin=d["origin"], cluster=Cluster.from_dict(d["cluster"]),
            kind=d["kind"], num_stages=d["num_stages"], num_microbatches=d["num_microbatches"],
            epsilon=d["epsilon"], epsilon_used=d["epsilon_used"], boundary=d["boundary"],
            stages=tuple(stage(s) for s in d["stages"]),
            crossings=tuple(CrossTensor(**dict(c, dsts=tuple(c["dsts"])))
                            for c in d["crossings"]),
            shared_weights=tuple((p, tuple(s)) for p, s in d["shared_weights"]),
            step_s=d["step_s"], memory_budget=d["memory_budget"],
            candidates=tuple(Candidate(**dict(c, stage_mesh=tuple(c["stage_mesh"])))
                             for c in d["candidates"]),
            decision=d["decision"], search=SearchTimes(**d["search"]))

    @classmethod
    def from_json(cls, text: str) -> "PipelinePlan":
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ report
    def report(self, max_crossings: int = 12, max_candidates: int = 24) -> str:
        """A report a person can read: decision, candidates, stages, crossings, timings."""
        c, t = self.cluster, self.search
        ms = 1e3
        lines = [
            f"rhino pipeline plan: {self.program}  ({self.origin})",
            f"  cluster           {c} = {c.num_devices} devices; intra-host α {c.alpha_intra:g} s"
            f" β {c.beta_intra:g} s/B, inter-host α {c.alpha_inter:g} s β {c.beta_inter:g} "
            f"s/B; {c.flops_per_s:.3g} FLOP/s, memory "
            f"{format_bytes(c.memory_bytes) if c.memory_bytes else 'unlimited'}",
            f"  chosen            {self.kind}: {self.num_stages} stage(s) × mesh "
            f"{self.stages[0].mesh}, {self.num_microbatches} microbatches, est. step "
            f"{ms * self.step_s:.3f} ms",
            f"  why               {self.decision}",
            f"  gradient boundary {self.boundary.get('method')}: batch "
            f"{self.boundary.get('batch_args')}, state {self.boundary.get('state_args')}; "
            f"{self.boundary.get('compute_ops')} compute-gradients ops, "
            f"{self.boundary.get('apply_ops')} apply-gradients ops, "
            f"{len(self.boundary.get('gradients', ()))} gradients "
            f"({format_bytes(self.boundary.get('gradient_bytes', 0))})",
            f"  search            {t.total:.2f} s wall: ingest {t.ingest:.2f}, boundary "
            f"{t.boundary:.2f}, coarsen {t.coarsen:.2f}, stage ILP {t.stage_ilp:.2f}, SPMD "
            f"{t.spmd:.2f} ({t.spmd_plans} plans), estimate {t.estimate:.2f}; "
            f"{t.candidates} candidates; ε {self.epsilon:g} (used {self.epsilon_used:g})",
            "  candidates (estimated step; fastest feasible first):",
        ]
        order = sorted(self.candidates, key=lambda x: (not x.feasible, x.step_s or 0.0))
        for x in order[:max_candidates]:
            mark = "*" if x == self.winner else " "
            if x.feasible:
                lines.append(f"   {mark}{x.label:<34} {ms * x.step_s:10.3f} ms = compute "
                             f"{ms * x.compute_s:.3f} + comm {ms * x.communication_s:.3f} + "
                             f"transfer {ms * x.transfer_s:.3f} + bubble {ms * x.bubble_s:.3f} "
                             f"+ apply {ms * x.apply_s:.3f}; mem {format_bytes(x.memory)}"
                             + (f"  ({x.note})" if x.note else ""))
            elif x.note.startswith("pruned"):
                lines.append(f"   {mark}{x.label:<34} {x.note}")
            else:
                lines.append(f"   {mark}{x.label:<34} infeasible: {x.note}")
        if len(order) > max_candidates:
            lines.append(f"    ... {len(order) - max_candidates} more")
        lines.append("  stages:")
        for s in self.stages:
            e, m = s.estimate, s.memory
            lines.append(
                f"    stage {s.index}: devices {s.devices[0]}..{s.devices[-1]} (hosts "
                f"{','.join(map(str, s.hosts))}), mesh {s.mesh}; ops fwd "
                f"{s.op_counts.get('forward', 0)} bwd {s.op_counts.get('backward', 0)} apply "
                f"{s.op_counts.get('apply', 0)} copied {s.op_counts.get('copied', 0)}; "
                f"{sum(s.flops[:2]) / 1e9:.3g} GFLOP/batch")
            lines.append(
                f"      per microbatch: compute {ms * e.compute_s:.3f} ms, comm "
                f"{ms * e.communication_s:.3f} ms, send {ms * e.send_s:.3f} ms; per step: "
                f"apply+sync {ms * e.apply_s:.3f} ms; memory {format_bytes(m.total)} "
                f"(state {format_bytes(m.state)}, grads {format_bytes(m.gradients)}, "
                f"{m.in_flight} × {format_bytes(m.per_microbatch)} in flight)")
        if self.crossings:
            lines.append(f"  tensors between stages ({len(self.crossings)}):")
            big = sorted(self.crossings, key=lambda x: -x.bytes)[:max_crossings]
            for x in big:
                lines.append(f"    {x.kind:<15} {x.name:<28} {x.shape:<22} "
                             f"{format_bytes(x.bytes):>12}  stage {x.src} -> "
                             f"{','.join(map(str, x.dsts))}  {ms * x.seconds:.3f} ms")
            if len(self.crossings) > len(big):
                lines.append(f"    ... {len(self.crossings) - len(big)} more")
        if self.shared_weights:
            lines.append("  weights read on several stages (sent after each update): " +
                         ", ".join(f"{p} on {list(s)}" for p, s in self.shared_weights))
        return "\n".join(lines)
