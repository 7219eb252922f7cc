"""Cost model of a pipeline: per-stage profiles from SPMD plans, transfers, 1F1B step time.

A stage's SPMD plan is made for its subgraph at the whole batch; ``profile_stage`` splits
it into what runs per microbatch and what runs once per step:

* compute: the apply-gradients ops' share is their seconds (``op_cost.OpTimes``) split over
  the devices sharing each op under the plan's output specs; the rest of the plan's
  compute is forward + backward, its work divided by ``m`` per microbatch and its kernel
  launches paid by every microbatch (``launch_s``; each of the stage's forward and
  backward tasks also costs a program dispatch, ``CostModel.program_seconds``);
* communication: collectives whose consumer is a compute-gradients op run per microbatch on
  ``1/m`` of the bytes (α stays); the others (consumer an apply-gradients op, a carried
  output: the gradient all-reduces and weight updates) run once per step — the gradient
  synchronization after local accumulation;
* memory (``stage_memory``): weights and optimizer state (the state arguments' local
  shards); a gradient accumulation buffer (the local shards of the stage's gradients, in
  float32 where they are narrower: accumulated in float32); what each microbatch's forward
  keeps for its backward (*handed*: the local shards of forward values a backward op of the
  stage reads, ``1/m`` of the whole batch's; with ``jax.checkpoint`` only the checkpointed
  regions' inputs, since their backward ops recompute the rest), held for the microbatches
  in flight; and one microbatch's working set: its batch and cut inputs and activations
  (the plan's peak minus its parameters, ``1/m`` of the whole batch's) plus its weight
  gradients before they are added to the buffer (a backward program computes them whole,
  then adds). Checked against the compiled programs (``StageWorker.memory``): within 20 %
  on a 4-layer Llama with and without remat (``tests/test_pipeline_memory.py``).

Transfers between stage meshes (cross-mesh resharding): ``α + β · B / min(n_src, n_dst)``
for ``B`` bytes — every source device holding the data sends a share (load-balanced senders,
as in broadcast-based resharding) over links of the given α, β; when the destination spec
keeps ``k`` copies, an all-gather inside the destination mesh completes them.

1F1B with ``p`` stages and ``m`` microbatches, ``t_s`` the per-microbatch time of stage s
(compute + communication + sends)::

    step = Σ_s t_s + (m - 1) · max_s t_s + max_s apply_s

(one microbatch flows through every stage and back — fill and drain — and the slowest stage
paces the other m-1; apply-gradients and gradient synchronization run once at the end). For
equal stages this is ``(m + p - 1) · t + apply``: the bubble is ``(p - 1) / m`` of the
useful time. Stage s holds the activations of ``min(m, p - s)`` microbatches at once.

Example:
    >>> pipeline_step([0.1, 0.1], 4, [0.0, 0.0])["step"]
    0.5
    >>> in_flight(0, 4, 8), in_flight(3, 4, 8), in_flight(0, 4, 2)
    (4, 1, 2)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from rhino.hlo_passes.analyses import NOT_MATERIALIZED, liveness
from rhino.hlo_passes.graph import HloGraph, TensorType, flatten_shape
from rhino.hlo_passes.subgraph import CUT_PREFIX
from rhino.parallel_plan import StageMemory
from rhino.planner.build import carried_pairs
from rhino.planner.collectives import collective_cost
from rhino.planner.cost_model import CostModel
from rhino.planner.op_cost import OpTimes
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spmd_plan import SpmdPlan
from rhino.planner.spec import ShardingSpec


def memory_floor(graph: HloGraph) -> int:
    """Bytes live at the step's peak on one device, updated state in place: no plan over
    ``n`` devices keeps less than this over ``n`` on some device (the values live at that
    point of the program order are live there under every plan, and each needs at least
    ``1/n`` of its bytes per device). The pipeline search refuses an SPMD candidate whose
    floor is over the budget without planning it."""
    sizes = [sum(t.nbytes for t in flatten_shape(op.shape)) for op in graph.ops]
    return int(liveness(graph, sizes, carried_pairs(graph))[1])


def in_flight(stage: int, num_stages: int, num_microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at once under 1F1B."""
    return max(1, min(num_microbatches, num_stages - stage))


def transfer_seconds(nbytes: float, src_devices: int, dst_devices: int, alpha: float,
                     beta: float) -> float:
    """Seconds to move ``nbytes`` from one mesh to another (module docstring)."""
    if nbytes <= 0:
        return 0.0
    return alpha + beta * nbytes / max(1, min(src_devices, dst_devices))


def gather_seconds(nbytes: float, spec: ShardingSpec | None, mesh: AbstractMesh,
                   cost: CostModel) -> float:
    """All-gather inside the destination mesh when ``spec`` keeps replicas there."""
    if spec is None or mesh.num_devices <= 1:
        return 0.0
    shards = spec.shard_count(mesh)
    if shards >= mesh.num_devices:
        return 0.0
    return collective_cost("all-gather", tuple(range(mesh.ndim)), nbytes / shards, mesh, cost)


@dataclasses.dataclass(frozen=True)
class StageProfile:
    """A stage's SPMD plan split into per-microbatch and per-step parts (whole batch).

    Attributes:
        compute_s: forward + backward compute for the whole batch.
        apply_compute_s: apply-gradients compute (once per step).
        micro_collectives: ``(kind, axes, bytes)`` of collectives run per microbatch
            (bytes for the whole batch).
        step_comm_s: collectives run once per step (gradient sync, updates).
        state_bytes: local weights and optimizer state.
        gradient_bytes: local gradient accumulation buffer.
        input_bytes: local batch and cut inputs for the whole batch.
        activation_bytes: the plan's peak minus its parameters (whole batch).
        handed_bytes: forward values a backward op of the stage reads (whole batch).
        launch_s: kernel launches of the forward and backward ops (paid per microbatch;
            not part of ``compute_s``).
    """

    compute_s: float
    apply_compute_s: float
    micro_collectives: tuple[tuple[str, tuple[int, ...], int], ...]
    step_comm_s: float
    state_bytes: int
    gradient_bytes: int
    input_bytes: int
    activation_bytes: int
    launch_s: float = 0.0
    handed_bytes: int = 0

    def microbatch_compute_s(self, m: int, program_s: float = 0.0) -> float:
        """Seconds of one microbatch's forward and backward: ``1/m`` of the work, every
        kernel launch, and two program dispatches (the forward and the backward task)."""
        return self.compute_s / m + self.launch_s + 2.0 * program_s

    def microbatch_comm_s(self, mesh: AbstractMesh, cost: CostModel, m: int) -> float:
        return float(sum(collective_cost(k, axes, b / m, mesh, cost)
                         for k, axes, b in self.micro_collectives))


def profile_stage(sub_graph: HloGraph, plan: SpmdPlan, apply_ops: set[str],
                  gradient_ops: set[str], state_args: Sequence[str],
                  forward_ops: set[str] = frozenset(),
                  backward_ops: set[str] = frozenset()) -> StageProfile:
    """Split a stage's SPMD plan (see the module docstring).

    Args:
        sub_graph: the stage subgraph the plan was made for.
        plan: its SPMD plan.
        apply_ops: names of the apply-gradients ops in it.
        gradient_ops: names of the gradient values it accumulates.
        state_args: top-level argument names that are training state.
        forward_ops / backward_ops: names of its forward and backward ops (what a
            backward op reads of the forward is held from a microbatch's forward to its
            backward).
    """
    mesh, cost = plan.mesh, plan.cost
    specs = {o.name: o.out_spec for o in plan.ops}
    times = OpTimes(sub_graph, cost)
    apply_s = launch_s = 0.0
    grad_bytes = handed = 0
    users = sub_graph.users
    for op in sub_graph.ops:
        spec = specs.get(op.name)
        if op.name in apply_ops:
            div = 1
            if isinstance(spec, ShardingSpec):
                div = spec.shard_count(mesh) * mesh.group_size(
                    [a for a in spec.used_axes if a not in spec.split_axes])
            apply_s += times.seconds(op.id, max(1, div))
        else:
            launch_s += times.launch_seconds((op.id,))
        if not isinstance(op.shape, TensorType):
            continue
        shards = max(1, spec.shard_count(mesh)) if isinstance(spec, ShardingSpec) else 1
        if op.name in gradient_ops:
            grad_bytes += accumulated_bytes(op.shape) // shards
        if op.name in forward_ops and op.opcode not in NOT_MATERIALIZED and any(
                sub_graph.ops[u].name in backward_ops for u in users[op.id]):
            handed += op.out_bytes // shards
    micro, step_comm = [], 0.0
    for c in plan.collectives:
        if c.consumer.startswith("<") or c.consumer in apply_ops:
            step_comm += c.seconds
        else:
            micro.append((c.kind, tuple(mesh.axis_index(a) for a in c.axes), int(c.bytes)))
    state = inputs = 0
    state_set = set(state_args)
    for p in plan.params:
        head = p.path.split("[", 1)[0].split(".", 1)[0]
        if head in state_set and not p.path.startswith(CUT_PREFIX):
            state += p.local_bytes
        else:
            inputs += p.local_bytes
    act = max(0, plan.memory.peak - plan.memory.parameters)
    return StageProfile(max(0.0, plan.compute_s - apply_s - launch_s), apply_s, tuple(micro),
                        step_comm, state, grad_bytes, inputs, act, launch_s, handed)


def accumulated_bytes(t: TensorType) -> int:
    """Bytes of a gradient's accumulator: float32 where the gradient is a narrower float
    (rhino accumulates those in float32 and casts once, as the step computes the sum)."""
    if t.dtype in ("bf16", "f16") or t.dtype.startswith("f8"):
        return t.numel * 4
    return t.nbytes


def stage_memory(pr: StageProfile, in_flight: int, m: int) -> StageMemory:
    """A stage's per-device memory (module docstring) with ``in_flight`` microbatches'
    handed values held, ``m`` microbatches a step."""
    m = max(1, m)
    handed = pr.handed_bytes // m
    working = (pr.activation_bytes + pr.input_bytes) // m + pr.gradient_bytes
    total = pr.state_bytes + pr.gradient_bytes + max(0, in_flight - 1) * handed + working
    return StageMemory(pr.state_bytes, pr.gradient_bytes, working, in_flight, total, handed)


def pipeline_step(micro_s: Sequence[float], num_microbatches: int,
                  apply_s: Sequence[float]) -> dict[str, float]:
    """1F1B step time and its parts (module docstring).

    Returns:
        ``{"step", "bottleneck" (the slowest stage's microbatch time), "fill" (Σ t_s minus
        the bottleneck's: the bubble), "apply"}``.
    """
    m = max(1, int(num_microbatches))
    if not micro_s:
        raise ValueError("pipeline_step: expected at least one stage")
    t_max = max(micro_s)
    fill = sum(micro_s) - t_max
    apply = max(apply_s) if apply_s else 0.0
    return {"step": m * t_max + fill + apply, "bottleneck": t_max, "fill": fill,
            "apply": apply}
