"""``Plan``: how a training step runs in parallel, as plain, JSON-serializable data.

One type for every parallel execution. A plan has one or more *stages*; each stage has its
devices, its SPMD mesh, the cost model it was planned with and its SPMD plan (``SpmdPlan``: a spec per op and parameter, the
collectives, memory). A plan with one stage is pure SPMD (``kind`` ``spmd``); with several
it is a pipeline (``pipeline``: one device per stage; ``hybrid``: an SPMD mesh per stage),
run with ``num_microbatches`` microbatches under ``schedule``. ``rhino.plan`` makes plans and
``rhino.auto_parallel`` runs them (``auto_parallel(step, plan=Plan.from_json(...))``).

A plan also records how it was chosen: the cluster, the gradient boundary, the tensors
crossing between stages, the weights read on several stages, every candidate the controller
weighed with its estimate, why the winner won, and the time of each search phase.

JSON (``to_json`` / ``from_json``) round-trips exactly and carries a format version;
``from_json`` also reads the documents of earlier releases: format 2 (whose stage meshes
carried the cost figures) and the two format-1 documents (an SPMD plan, and a pipeline
plan).

Example:
    >>> import rhino
    >>> from rhino.models import get_model
    >>> m = get_model("mlp", batch=64, hidden=64, layers=2)
    >>> p = rhino.plan(m.step, *m.example_args(), cluster="1x2", max_stages=2)
    >>> Plan.from_json(p.to_json()) == p
    True
    >>> q = rhino.plan(m.step, *m.example_args(), mesh_shape=(2,))
    >>> q.kind, q.num_stages, Plan.from_json(q.to_json()) == q
    (<PlanKind.SPMD: 'spmd'>, 1, True)
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

from rhino.cluster import Cluster
from rhino.errors import PlanMismatchError, format_bytes
from rhino.planner.cost_model import CostModel, legacy_mesh
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spmd_plan import SpmdPlan
from rhino.planner.utilization import Utilization, utilization
from rhino.vocabulary import PlanKind, ScheduleKind

FORMAT_VERSION = 3


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Per-device bytes of one stage under its schedule.

    Attributes:
        state: weights and optimizer state (local shards).
        gradients: the gradient accumulation buffer (float32 where the weights are
            narrower: accumulated in float32, cast once).
        per_microbatch: one microbatch's working set: its activations and inputs, and its
            weight gradients before they are added to the buffer.
        in_flight: microbatches whose forward values are held at once (``min(m, p - s)``
            under 1F1B).
        total: ``state + gradients + (in_flight - 1) · handed + per_microbatch``.
        handed: what a microbatch's forward keeps for its backward (per microbatch): the
            forward values a backward op reads. With ``jax.checkpoint`` only a
            checkpointed region's inputs (its backward recomputes the rest).
    """

    state: int
    gradients: int
    per_microbatch: int
    in_flight: int
    total: int
    handed: int = 0


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
        mesh: the stage's SPMD mesh; cost: its cost model.
        ops: names of the program ops the stage runs (forward, backward, apply); empty for
            the one stage of an SPMD plan, which runs every op.
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
    cost: CostModel
    ops: tuple[str, ...]
    op_counts: dict[str, int]
    flops: tuple[float, float, float]
    weights: tuple[str, ...]
    estimate: StageEstimate
    memory: StageMemory
    spmd: SpmdPlan | None = None


@dataclasses.dataclass(frozen=True)
class CrossTensor:
    """A tensor sent between stages.

    Attributes:
        name: the producing op; shape: e.g. ``f32[4,64,512]``; bytes: whole-batch size.
        src: producing stage; dsts: stages receiving it.
        kind: ``activation``, ``residual``, ``gradient`` (per microbatch),
            ``weight-gradient`` or ``apply`` (per step).
        seconds: estimated transfer time (per microbatch, or per step).
        source: the user's source line of the producing op (``file:line``), if known.
    """

    name: str
    shape: str
    bytes: int
    src: int
    dsts: tuple[int, ...]
    kind: str
    seconds: float
    source: str = ""


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
    feasible: bool = False
    step_s: float | None = None
    compute_s: float = 0.0
    communication_s: float = 0.0
    transfer_s: float = 0.0
    bubble_s: float = 0.0
    apply_s: float = 0.0
    memory: int = 0
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
class Plan:
    """The plan (see the module docstring).

    Attributes:
        program, origin: the program's name and where it came from (``jax:step``, a file).
        kind: ``spmd`` (one stage), ``pipeline`` or ``hybrid``.
        cluster: the hosts × devices planned for.
        stages: per stage its devices, mesh, ops and SPMD plan.
        num_microbatches: microbatches per step (1 for SPMD plans).
        schedule: the pipeline schedule (``1f1b``; irrelevant with one stage).
        step_s: the estimated step time (seconds).
        memory_budget: the per-device budget planned for, or None.
        boundary: the gradient boundary's summary (empty for SPMD plans of a mesh).
        crossings: tensors sent between stages; shared_weights: weights read on several.
        epsilon, epsilon_used: the stage ILP's imbalance tolerance, asked and used.
        candidates: every configuration weighed; decision: why the winner won.
        search: the time of each search phase.
        model_flops: the step's matmul FLOPs (``planner.op_cost.model_flops``), for its
            estimated MFU; matmul_dtype: the dtype most of them run in.
        virtual_stages: stages per device group (``interleaved-1f1b``; 1 otherwise): stage
            ``c`` runs on the devices of stage ``c % (num_stages / virtual_stages)``.
    """

    program: str
    origin: str
    kind: PlanKind
    cluster: Cluster
    stages: tuple[StagePlan, ...]
    num_microbatches: int = 1
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    step_s: float = 0.0
    memory_budget: int | None = None
    boundary: dict[str, Any] = dataclasses.field(default_factory=dict)
    crossings: tuple[CrossTensor, ...] = ()
    shared_weights: tuple[tuple[str, tuple[int, ...]], ...] = ()
    epsilon: float = 0.0
    epsilon_used: float = 0.0
    candidates: tuple[Candidate, ...] = ()
    decision: str = ""
    search: SearchTimes | None = None
    model_flops: float = 0.0
    matmul_dtype: str = "f32"
    virtual_stages: int = 1

    def __post_init__(self):
        object.__setattr__(self, "kind", PlanKind(self.kind))
        object.__setattr__(self, "schedule", ScheduleKind(self.schedule))
        if not self.stages:
            raise ValueError("plan: expected at least one stage, found none")
        v, n = self.virtual_stages, len(self.stages)
        inter = self.schedule is ScheduleKind.INTERLEAVED
        if v < 1 or (v > 1) != inter or (v > 1 and (n % v or n // v < 2)):
            raise ValueError(f"plan: expected virtual_stages >= 2 dividing the stages into "
                             f">= 2 device groups exactly with schedule 'interleaved-1f1b' "
                             f"(1 otherwise), found {v} with {n} stages and schedule "
                             f"'{self.schedule}'")
        if v > 1:
            groups = n // v
            bad = [s.index for s in self.stages
                   if s.devices != self.stages[s.index % groups].devices]
            if bad:
                raise ValueError(f"plan: stage {bad[0]} of {v} virtual stages per group: "
                                 f"expected the devices of stage {bad[0] % groups} (its "
                                 f"device group), found others")
        if (len(self.stages) == 1) != (self.kind is PlanKind.SPMD):
            raise ValueError(f"plan: a {self.kind} plan with {len(self.stages)} stage(s); "
                             f"expected one stage exactly for spmd")

    # ------------------------------------------------------------------ views
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def spmd(self) -> SpmdPlan:
        """The SPMD plan of a one-stage plan.

        Raises:
            PlanMismatchError: the plan has several stages (each has its own:
                ``plan.stages[i].spmd``), or its SPMD plan was left out of the JSON.
        """
        if self.num_stages != 1:
            raise PlanMismatchError(f"plan.spmd: expected a one-stage (SPMD) plan, found "
                                    f"{self.num_stages} stages; read plan.stages[i].spmd")
        if self.stages[0].spmd is None:
            raise PlanMismatchError("plan.spmd: the stage's SPMD plan was left out of this "
                                    "plan (saved with include_spmd=False)")
        return self.stages[0].spmd

    def utilization(self) -> Utilization:
        """The estimated MFU of the plan's step over every device of its cluster
        (``planner.utilization``; peak and ceiling from the first stage's cost model)."""
        return utilization(self.model_flops, self.matmul_dtype, self.cluster.num_devices,
                           self.step_s, self.stages[0].cost)

    @property
    def winner(self) -> Candidate:
        """The candidate this plan realizes."""
        for c in self.candidates:
            if c.feasible and c.step_s == self.step_s and c.num_stages == self.num_stages \
                    and c.stage_mesh == self.stages[0].mesh.shape:
                return c
        raise LookupError("the plan's own candidate is missing from its candidates")

    @classmethod
    def from_spmd(cls, spmd: SpmdPlan, total_flops: float, cluster: Cluster | None = None,
                  devices: tuple[int, ...] | None = None,
                  candidates: tuple[Candidate, ...] = (), decision: str = "",
                  search: SearchTimes | None = None,
                  boundary: dict[str, Any] | None = None) -> "Plan":
        """A one-stage plan running ``spmd`` on its mesh (over ``cluster`` when the
        controller chose it; otherwise one host holding the mesh's devices)."""
        mesh, cost = spmd.mesh, spmd.cost
        n = mesh.num_devices
        if cluster is None:
            cluster = Cluster(1, n, alpha_intra=max(cost.alpha), beta_intra=max(cost.beta),
                              alpha_inter=max(cost.alpha), beta_inter=max(cost.beta),
                              flops_per_s=cost.flops_per_s, memory_bytes=cost.memory_bytes,
                              native_reduce_scatter=cost.native_reduce_scatter,
                              dtype_flops_per_s=cost.dtype_flops_per_s, backend=cost.backend,
                              roofline=cost.roofline)
        devices = tuple(range(n)) if devices is None else tuple(devices)
        hosts = tuple(sorted({d // cluster.devices_per_host for d in devices}))
        mem = StageMemory(spmd.memory.parameters, 0, spmd.memory.peak - spmd.memory.parameters,
                          1, spmd.memory.peak)
        stage = StagePlan(0, devices, hosts, mesh, cost, (),
                          {"forward": 0, "backward": 0, "apply": 0, "copied": 0},
                          (float(total_flops), 0.0, 0.0), tuple(p.path for p in spmd.params),
                          StageEstimate(spmd.compute_s, spmd.communication_s, 0.0, 0.0), mem,
                          spmd)
        if not candidates:
            candidates = (Candidate(PlanKind.SPMD.value, 1, mesh.shape, feasible=True,
                                    step_s=spmd.step_time_s, compute_s=spmd.compute_s,
                                    communication_s=spmd.communication_s,
                                    memory=int(spmd.memory.peak)),)
            decision = decision or f"SPMD on the given mesh {mesh} (nothing else weighed)"
        if search is None:
            st = spmd.search
            search = SearchTimes(st.ingest_s, 0.0, 0.0, 0.0, st.build_s + st.solve_s, 0.0,
                                 st.total_s, 1, 1)
        return cls(spmd.program, spmd.origin, PlanKind.SPMD, cluster, (stage,),
                   step_s=spmd.step_time_s, memory_budget=spmd.memory_budget,
                   boundary=dict(boundary or {}), candidates=tuple(candidates),
                   decision=decision, search=search, model_flops=spmd.model_flops,
                   matmul_dtype=spmd.matmul_dtype)

    # ------------------------------------------------------------------ serialization
    def to_dict(self, include_spmd: bool = True) -> dict[str, Any]:
        def stage(s: StagePlan) -> dict[str, Any]:
            return {"index": s.index, "devices": list(s.devices), "hosts": list(s.hosts),
                    "mesh": s.mesh.to_dict(), "cost": s.cost.to_dict(), "ops": list(s.ops),
                    "op_counts": s.op_counts,
                    "flops": list(s.flops), "weights": list(s.weights),
                    "estimate": dataclasses.asdict(s.estimate),
                    "memory": dataclasses.asdict(s.memory),
                    "spmd": s.spmd.to_dict() if include_spmd and s.spmd is not None else None}
        return {
            "format": FORMAT_VERSION, "program": self.program, "origin": self.origin,
            "kind": self.kind.value, "cluster": self.cluster.to_dict(),
            "stages": [stage(s) for s in self.stages],
            "num_microbatches": self.num_microbatches, "schedule": self.schedule.value,
            "step_s": self.step_s, "memory_budget": self.memory_budget,
            "boundary": self.boundary,
            "crossings": [dataclasses.asdict(c) for c in self.crossings],
            "shared_weights": [[p, list(s)] for p, s in self.shared_weights],
            "epsilon": self.epsilon, "epsilon_used": self.epsilon_used,
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
            "decision": self.decision,
            "search": dataclasses.asdict(self.search) if self.search is not None else None,
            "model_flops": self.model_flops, "matmul_dtype": self.matmul_dtype,
            **({"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {}),
        }

    def to_json(self, indent: int | None = None, include_spmd: bool = True,
                search_times: bool = True) -> str:
        """The plan as JSON (``from_json`` reads it back exactly).

        Args:
            indent: as ``json.dumps``.
            include_spmd: keep each stage's SPMD plan.
            search_times: keep how long the search took (wall seconds, and how many SPMD
                plans it made, which parallel workers can change); without them two
                searches of the same program and options give the same text.
        """
        d = self.to_dict(include_spmd)
        if not search_times:
            d["search"] = None
            for st in d["stages"]:
                if st["spmd"] is not None:
                    st["spmd"]["search"] = {k: (0.0 if k.endswith("_s") else v)
                                            for k, v in st["spmd"]["search"].items()}
        return json.dumps(d, indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """The plan of ``to_dict``, or of a format-2 or format-1 document (see the module
        docstring).

        Raises:
            PlanMismatchError: not a plan, or a format this release does not read.
        """
        if not isinstance(d, dict) or "format" not in d:
            raise PlanMismatchError(f"plan JSON: expected an object with a 'format' key, "
                                    f"found {type(d).__name__}"
                                    + (f" with keys {sorted(d)[:8]}" if isinstance(d, dict)
                                       else ""))
        fmt = d["format"]
        if fmt == 1 and "ops" in d and "params" in d:        # a format-1 SPMD plan
            spmd = SpmdPlan.from_dict(d)
            return cls.from_spmd(spmd, spmd.compute_s * spmd.cost.flops_per_s
                                 * spmd.mesh.num_devices)
        if fmt == 1 and "stages" in d:                        # a format-1 pipeline plan
            d = dict(d, schedule=ScheduleKind.ONE_F_ONE_B.value)
        elif fmt not in (2, FORMAT_VERSION):
            raise PlanMismatchError(f"plan JSON: expected format {FORMAT_VERSION} (or 2, 1), "
                                    f"found {fmt!r}")
        try:
            return cls._from_fields(d, legacy=fmt < FORMAT_VERSION)
        except (KeyError, TypeError, ValueError) as e:
            raise PlanMismatchError(f"plan JSON: malformed ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_fields(cls, d: dict[str, Any], legacy: bool = False) -> "Plan":
        def stage(s: dict[str, Any]) -> StagePlan:
            mesh, cost = (legacy_mesh(s["mesh"]) if legacy else
                          (AbstractMesh.from_dict(s["mesh"]), CostModel.from_dict(s["cost"])))
            return StagePlan(
                s["index"], tuple(s["devices"]), tuple(s["hosts"]),
                mesh, cost, tuple(s["ops"]), dict(s["op_counts"]),
                tuple(s["flops"]), tuple(s["weights"]), StageEstimate(**s["estimate"]),
                StageMemory(**s["memory"]),
                SpmdPlan.from_dict(s["spmd"]) if s["spmd"] is not None else None)
        return cls(
            program=d["program"], origin=d["origin"], kind=PlanKind(d["kind"]),
            cluster=Cluster.from_dict(d["cluster"]),
            stages=tuple(stage(s) for s in d["stages"]),
            num_microbatches=d["num_microbatches"], schedule=ScheduleKind(d["schedule"]),
            step_s=d["step_s"], memory_budget=d["memory_budget"], boundary=d["boundary"],
            crossings=tuple(CrossTensor(**dict(c, dsts=tuple(c["dsts"])))
                            for c in d["crossings"]),
            shared_weights=tuple((p, tuple(s)) for p, s in d["shared_weights"]),
            epsilon=d["epsilon"], epsilon_used=d["epsilon_used"],
            candidates=tuple(Candidate(**dict(c, stage_mesh=tuple(c["stage_mesh"])))
                             for c in d["candidates"]),
            decision=d["decision"],
            search=SearchTimes(**d["search"]) if d.get("search") is not None else None,
            model_flops=float(d.get("model_flops", 0.0)),
            matmul_dtype=str(d.get("matmul_dtype", "f32")),
            virtual_stages=int(d.get("virtual_stages", 1)))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanMismatchError(f"plan JSON: not JSON ({e})") from None
        return cls.from_dict(d)

    # ------------------------------------------------------------------ report
    @property
    def from_controller(self) -> bool:
        """Whether a cluster's controller chose this plan (``decision_text``), rather than
        SPMD on a mesh given or weighed (``Plan.from_spmd``: "SPMD on ...")."""
        return (self.num_stages > 1 or len(self.candidates) > 1
                or not self.decision.startswith("SPMD on "))

    def choice_line(self) -> str:
        """What a controller chose and why, in one line (a cluster plan's report starts
        with it; ``auto_parallel(cluster=...)`` logs it before it compiles)."""
        what = {"spmd": "SPMD", "pipeline": "a pipeline", "hybrid": "a hybrid pipeline"}
        mesh = self.stages[0].mesh
        shape = "x".join(map(str, mesh.shape))
        how = (f" on mesh ({shape})" if self.num_stages == 1 else
               f" of {self.num_stages} stages × mesh ({shape}), {self.num_microbatches} "
               f"microbatches")
        return (f"chose {what.get(self.kind.value, self.kind.value)}{how} over cluster "
                f"{self.cluster} (estimated step {1e3 * self.step_s:.3f} ms): {self.decision}")

    def report(self, max_crossings: int = 12, max_candidates: int = 24, full: bool = False
               ) -> str:
        """A report a person can read: for one stage its SPMD plan; for a pipeline the
        decision, candidates, stages, crossings and timings; how it was chosen when a
        controller weighed several candidates (then its first line says what was chosen
        and why). ``full``: every row of every list (``rhino plan --all``)."""
        if full:
            max_crossings = len(self.crossings) + 1
            max_candidates = len(self.candidates) + 1
        head = f"rhino plan: {self.program}  ({self.origin})"
        if self.num_stages == 1 and self.stages[0].spmd is not None:
            text = self.stages[0].spmd.report(full=full)
            if self.decision.startswith("SPMD on mesh ") and len(self.candidates) <= 1:
                text += f"\n  mesh chosen       {self.decision}"   # weighed mesh shapes
            if self.from_controller:
                text = text.replace(head, f"{head}: {self.choice_line()}", 1)
                text += "\n" + "\n".join(self._controller_lines(max_candidates))
                text += "\n" + "\n".join(LEGEND)
            return text
        return "\n".join(self._pipeline_lines(max_crossings, max_candidates) + LEGEND)

    def _controller_lines(self, max_candidates: int) -> list[str]:
        c, t = self.cluster, self.search
        ms = 1e3
        rates = "".join(f", {k} {v:.3g}" for k, v in c.dtype_flops_per_s)
        lines = [
            f"  cluster           {c} = {c.num_devices} {c.backend} devices; intra-host α "
            f"{c.alpha_intra:g} s β {c.beta_intra:g} s/B, inter-host α {c.alpha_inter:g} s β "
            f"{c.beta_inter:g} s/B; {c.flops_per_s:.3g} FLOP/s{rates}, memory "
            f"{format_bytes(c.memory_bytes) if c.memory_bytes else 'unlimited'}"
            + (f"; budget {format_bytes(self.memory_budget)} per device (estimated peaks)"
               if self.memory_budget is not None and self.memory_budget != c.memory_bytes
               else ""),
            f"  chosen            {self.kind}: {self.num_stages} stage(s) × mesh "
            f"{self.stages[0].mesh}, {self.num_microbatches} microbatches, est. step "
            f"{ms * self.step_s:.3f} ms",
            f"  utilization       {self.utilization().line()}",
            f"  why               {self.decision}",
        ]
        if t is not None:
            relaxed = (f", relaxed to {self.epsilon_used:g}: no split met {self.epsilon:g}"
                       if self.epsilon_used > self.epsilon else "")
            lines.append(
                f"  search            {t.total:.2f} s wall: ingest {t.ingest:.2f}, boundary "
                f"{t.boundary:.2f}, coarsen {t.coarsen:.2f}, stage ILP {t.stage_ilp:.2f}, SPMD "
                f"{t.spmd:.2f} ({t.spmd_plans} plans), estimate {t.estimate:.2f}; "
                f"{t.candidates} candidates")
            lines.append(
                f"  stage balance     ε {self.epsilon:g}{relaxed} (the stage ILP keeps each "
                f"stage's compute within (1 ± ε) × the mean; where no split meets it, ε is "
                f"doubled up to 4)")
        lines.append("  candidates (estimated step = compute + comm + transfer + bubble + "
                     "apply, ms; fastest feasible first; * the chosen):")
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
            lines.append(f"    ... {len(order) - max_candidates} more ({MORE_HINT})")
        return lines

    def _pipeline_lines(self, max_crossings: int, max_candidates: int) -> list[str]:
        ms = 1e3
        b = self.boundary
        lines = [f"rhino plan: {self.program}  ({self.origin}): {self.choice_line()}",
                 *self._controller_lines(max_candidates)]
        lines.insert(4, f"  gradient boundary {b.get('method')}: batch {b.get('batch_args')}, "
                        f"state {b.get('state_args')}; {b.get('compute_ops')} "
                        f"compute-gradients ops, {b.get('apply_ops')} apply-gradients ops, "
                        f"{len(b.get('gradients', ()))} gradients "
                        f"({format_bytes(b.get('gradient_bytes', 0))})")
        v = self.virtual_stages
        lines.append("  stages:" if v == 1 else
                     f"  stages ({v} per device group, interleaved: stage c runs on group "
                     f"c % {len(self.stages) // v}; memory per group is the sum of its "
                     f"stages'):")
        for s in self.stages:
            e, m = s.estimate, s.memory
            lines.append(
                f"    stage {s.index}: devices {s.devices[0]}..{s.devices[-1]} (hosts "
                f"{','.join(map(str, s.hosts))}), mesh {s.mesh}; ops fwd "
                f"{s.op_counts.get('forward', 0)} bwd {s.op_counts.get('backward', 0)} apply "
                f"{s.op_counts.get('apply', 0)} copied {s.op_counts.get('copied', 0)}; "
                f"{sum(s.flops[:2]) / 1e9:.3g} GFLOP/batch")
            if s.weights:
                lines.append(f"      weights: {summarize_paths(s.weights)}")
            lines.append(
                f"      per microbatch: compute {ms * e.compute_s:.3f} ms, comm "
                f"{ms * e.communication_s:.3f} ms, send {ms * e.send_s:.3f} ms; per step: "
                f"apply+sync {ms * e.apply_s:.3f} ms; memory {format_bytes(m.total)} "
                f"(state {format_bytes(m.state)}, grads {format_bytes(m.gradients)}, "
                f"working set {format_bytes(m.per_microbatch)}, {m.in_flight} × "
                f"{format_bytes(m.handed)} held for the backward)")
            if s.spmd is not None:
                summary = s.spmd.collective_summary()
                lines.append("      SPMD: " + (", ".join(
                    f"{k} ×{n} ({format_bytes(v)})" for k, (n, v) in summary.items())
                    or "no collectives") + f"; {s.spmd.search.opt_level} "
                    f"{s.spmd.search.status}")
        if self.crossings:
            m = self.num_microbatches
            lines.append(f"  tensors between stages ({len(self.crossings)}; shape and bytes "
                         f"of the whole batch, of which each of the {m} microbatches carries "
                         f"1/{m} for activations, residuals and gradients; time per "
                         f"microbatch for those, per step for weight-gradient and apply):")
            big = sorted(self.crossings, key=lambda x: -x.bytes)[:max_crossings]
            wn = max([28] + [len(x.name) for x in big])
            ws = max([22] + [len(x.shape) for x in big])
            for x in big:
                lines.append(f"    {x.kind:<15} {x.name:<{wn}} {x.shape:<{ws}} "
                             f"{format_bytes(x.bytes):>12}  stage {x.src} -> "
                             f"{','.join(map(str, x.dsts))}  {ms * x.seconds:.3f} ms"
                             + (f"  [{x.source}]" if x.source else ""))
            if len(self.crossings) > len(big):
                lines.append(f"    ... {len(self.crossings) - len(big)} more ({MORE_HINT})")
        if self.shared_weights:
            lines.append("  weights read on several stages (sent after each update): " +
                         ", ".join(f"{p} on {list(s)}" for p, s in self.shared_weights))
        return lines


MORE_HINT = "report(full=True) or rhino plan --all lists them"

_INDEXED = re.compile(r"^(.*?)\[(\d+)\]")
_PART = re.compile(r"\[[^\]]*\]|\.[A-Za-z_]\w*|^[A-Za-z_]\w*")


def summarize_paths(paths: Sequence[str], most: int = 10) -> str:
    """The weights a stage holds, as a person reads a model: the paths of the first state
    argument (the parameters; the optimizer state mirrors them), a run of layers as one
    entry with its index range, other paths cut to their first two parts.

    >>> summarize_paths(["params['layers'][0]['w']", "params['layers'][1]['w']",
    ...                  "params['wte']", "opt_state[0].mu['wte']",
    ...                  "model.blocks[2].attn.kernel", "model.blocks[3].mlp.kernel"])
    "params['layers'][0..1], params['wte']"
    >>> summarize_paths(["model.blocks[2].attn.kernel", "model.blocks[3].mlp.kernel",
    ...                  "model.embed.embedding"])
    'model.blocks[2..3], model.embed'
    """
    if not paths:
        return "none"
    first = _PART.match(paths[0])
    head = first.group(0) if first else ""
    mine = [p for p in paths if _PART.match(p) and _PART.match(p).group(0) == head] or \
        list(paths)
    runs: dict[str, list[int]] = {}
    for p in mine:
        m = _INDEXED.match(p)
        if m is not None and len(_PART.findall(m.group(1))) <= 3:
            runs.setdefault(m.group(1), []).append(int(m.group(2)))
        else:
            runs.setdefault("".join(_PART.findall(p)[:2]), [])
    out = []
    for prefix, ks in runs.items():
        ks = sorted(set(ks))
        if not ks:
            out.append(prefix)
        elif ks == list(range(ks[0], ks[-1] + 1)):
            out.append(f"{prefix}[{ks[0]}..{ks[-1]}]" if len(ks) > 1 else f"{prefix}[{ks[0]}]")
        else:
            out.append(f"{prefix}[{','.join(map(str, ks))}]")
    more = len(out) - most
    return ", ".join(out[:most]) + (f", ... {more} more" if more > 0 else "")

LEGEND = [
    "  legend            every time and memory figure above is the planner's estimate (its "
    "α-β cost model and FLOP/s), not a measurement; compute/comm: a stage's own work and "
    "collectives per microbatch; transfer: sends between stages; bubble: 1F1B's idle time; "
    "apply: the update and gradient synchronization once per step; SPMD search status "
    "'heuristic': O2's three-level search (no proof that no plan is cheaper), 'optimal': "
    "proven under the cost model",
]
"""The short legend ending a controller's report (README: "Reading the plan report")."""


def decision_text(winner: Candidate, cands: Sequence[Candidate], kinds: Sequence[str]) -> str:
    """Why the search chose ``winner``: its step, and for every other kind of candidate
    (``kinds``) the best one and where its extra time goes, or why there is none."""
    ms = 1e3
    parts = [f"{winner.kind} pp={winner.num_stages} × ({'x'.join(map(str, winner.stage_mesh))})"
             f" has the least estimated step time, {ms * winner.step_s:.3f} ms"]
    for kind in kinds:
        if kind == winner.kind:
            continue
        others = [c for c in cands if c.kind == kind]
        feas = [c for c in others if c.feasible]
        if feas:
            best = min(feas, key=lambda c: c.step_s)
            comps = {"compute": best.compute_s - winner.compute_s,
                     "communication": best.communication_s - winner.communication_s,
                     "transfers": best.transfer_s - winner.transfer_s,
                     "bubble": best.bubble_s - winner.bubble_s,
                     "apply/sync": best.apply_s - winner.apply_s}
            top = max(comps, key=lambda k: comps[k])
            parts.append(f"best {kind} pp={best.num_stages} × "
                         f"({'x'.join(map(str, best.stage_mesh))}) {ms * best.step_s:.3f} ms "
                         f"({best.step_s / winner.step_s:.2f}×; mostly +{ms * comps[top]:.3f}"
                         f" ms of {top})")
        elif others and all(c.note.startswith("pruned") for c in others):
            lb = min(c.lower_bound_s for c in others)
            parts.append(f"every {kind} candidate pruned: even with perfect scaling its "
                         f"compute and 1F1B bubble take at least {ms * lb:.3f} ms")
        elif others and all("not fitted" in c.note for c in others):
            smallest = min(others, key=lambda c: c.memory)
            parts.append(f"every {kind} candidate is over the memory budget and not faster "
                         f"even with no memory limit (the smallest: {smallest.note})")
        elif others:
            parts.append(f"no {kind} candidate fits ({others[0].note})")
    return "; ".join(parts)
