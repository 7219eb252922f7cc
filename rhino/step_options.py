"""The options of ``rhino.auto_parallel`` (``StepOptions``), checked when built, and
whether to print the plan report (``report_wanted``)."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Mapping

from rhino.backends import backend_figures
from rhino.cluster import Cluster
from rhino.errors import OptionsError
from rhino.front_door import PlanRequest, positive
from rhino.parallel_plan import Plan
from rhino.pipeline.api import make_cluster
from rhino.planner.cost_model import CostModel
from rhino.planner.mesh import AbstractMesh, from_jax_mesh
from rhino.planner.spmd_plan import SpmdPlan
from rhino.runtime.executors.local import DEFAULT_TIMEOUT_S
from rhino.vocabulary import (REMOVED_TRANSPORTS, ExecutorKind, ScheduleKind, TransportKind,
                              removed_transport)

REPORT_ENV = "RHINO_REPORT"


def report_wanted(flag: bool | None) -> bool:
    """Print the plan report? ``flag`` if given, else whether ``$RHINO_REPORT`` is set
    (to anything but ``0``)."""
    return flag if flag is not None else os.environ.get(REPORT_ENV, "") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Options of ``auto_parallel`` (see its docstring), checked when built.

    Raises:
        OptionsError: a value out of range or of the wrong kind, or options that exclude
            each other (a mesh and a cluster; a plan and a stage count).
    """

    devices: tuple | None = None
    mesh_shape: tuple[int, ...] | None = None
    mesh: Any = None      # AbstractMesh; a jax Mesh / AbstractMesh is converted
    cost: CostModel | str | None = None
    cluster: Cluster | str | None = None
    opt_level: str = "O2"
    memory_budget: int | None = None
    annotations: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    plan: Plan | None = None
    report: bool | None = None
    donate: bool = True
    time_limit: float = 600.0
    num_microbatches: int | None = None
    schedule: ScheduleKind | None = None
    executor: ExecutorKind = ExecutorKind.LOCAL
    stages: int | Mapping[str, int] | None = None
    virtual_stages: int = 1
    accumulate: Any = None
    batch_args: tuple[str, ...] | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    transport: TransportKind | None = None
    ray_address: str | None = None
    ray_actor_options: Mapping[str, Any] | None = None
    ray_pin_cpus: bool | None = None
    per_microbatch_statistics: bool = False
    min_split_flops: float | None = None
    static_argnums: tuple = ()
    static_argnames: tuple = ()
    progress_after_s: float = 2.0

    def __post_init__(self):
        put = functools.partial(object.__setattr__, self)
        # What decides the plan is checked (and normalized) by the request both front
        # doors plan with; the rest here.
        req = self.request
        for name in ("time_limit", "memory_budget", "min_split_flops", "num_microbatches",
                     "schedule", "stages", "virtual_stages", "annotations", "batch_args"):
            put(name, getattr(req, name))
        put("timeout", positive("timeout (seconds)", self.timeout))
        put("executor", ExecutorKind.parse(self.executor, "executor"))
        if self.accumulate is not None:
            raise OptionsError(
                f"accumulate: expected no value, found {self.accumulate!r}: a pipelined step "
                f"computes what the step computes on the whole batch (a sum over the batch "
                f"is summed, a mean is the mean, each value by its own rule), so there is "
                f"nothing to choose; remove the option")
        if self.transport is None:
            put("transport", TransportKind.JAX if self.executor is ExecutorKind.RAY
                else TransportKind.DEVICE_PUT)
        if self.transport in REMOVED_TRANSPORTS:
            fits = [str(t) for t in TransportKind if t.executor is self.executor]
            raise OptionsError(f"transport: expected one of {fits} with executor "
                               f"'{self.executor}', found {self.transport!r}"
                               f"{removed_transport(self.transport)}")
        put("transport", TransportKind.parse(self.transport, "transport"))
        for name, value, kind, expected in (
                ("ray_actor_options", self.ray_actor_options, Mapping,
                 "a mapping of Ray actor options"),
                ("ray_pin_cpus", self.ray_pin_cpus, bool, "True, False or None")):
            if value is None:
                continue
            if not isinstance(value, kind):
                found = type(value).__name__ if kind is Mapping else repr(value)
                raise OptionsError(f"{name}: expected {expected}, found {found}")
            if self.executor is not ExecutorKind.RAY:
                raise OptionsError(f"{name}: only for executor='ray', found executor "
                                   f"{self.executor}")
        if self.mesh_shape is not None:
            put("mesh_shape", tuple(positive("mesh_shape entries", s, int)
                                    for s in self.mesh_shape))
        for name, values, kind in (("static_argnums", self.static_argnums, int),
                                   ("static_argnames", self.static_argnames, str)):
            bad = [v for v in values if not isinstance(v, kind) or isinstance(v, bool)]
            if bad:
                raise OptionsError(f"{name}: expected {kind.__name__}s, found {bad}")
        if self.mesh is not None and not isinstance(self.mesh, AbstractMesh):
            try:     # a JAX mesh: its axis names, and a concrete one's devices in its order
                mesh, on = from_jax_mesh(self.mesh)
            except TypeError as e:
                raise OptionsError(str(e)) from None
            if on is not None and self.devices is not None and tuple(self.devices) != on:
                raise OptionsError("devices: expected the devices of mesh= (a jax Mesh "
                                   "brings its own) or none, found others")
            put("mesh", mesh)
            if on is not None:
                put("devices", on)
        if self.devices is not None:
            put("devices", tuple(self.devices))
            if not self.devices:
                raise OptionsError("devices: expected at least one jax device, found an empty "
                                   "sequence; leave devices out (None) to use every local "
                                   "device, or pass e.g. jax.devices()[:4]")
        if isinstance(self.cluster, str):
            make_cluster(self.cluster)      # checked now; its figures come with the devices
        elif self.cluster is not None:
            put("cluster", make_cluster(self.cluster))
        self._check_cost()
        if isinstance(self.plan, SpmdPlan):
            put("plan", Plan.from_spmd(self.plan, 0.0))
        elif self.plan is not None and not isinstance(self.plan, Plan):
            raise OptionsError(f"plan: expected a rhino.Plan (e.g. Plan.from_json(...)), "
                               f"found {type(self.plan).__name__}")
        self._check_exclusive()

    @property
    def request(self) -> PlanRequest:
        """What decides the plan, as ``rhino.plan`` takes it too (``rhino.front_door``)."""
        return PlanRequest(opt_level=self.opt_level, time_limit=self.time_limit,
                           min_split_flops=self.min_split_flops,
                           memory_budget=self.memory_budget, annotations=self.annotations,
                           num_microbatches=self.num_microbatches, schedule=self.schedule,
                           stages=self.stages, virtual_stages=self.virtual_stages,
                           batch_args=self.batch_args,
                           per_microbatch_statistics=self.per_microbatch_statistics)

    def _check_cost(self) -> None:
        c = self.cost
        if isinstance(c, str):
            backend_figures(c)
        elif isinstance(c, CostModel):
            if self.cluster is not None:
                raise OptionsError("auto_parallel: a cost model prices one mesh; a cluster's "
                                   "stage meshes take the cluster's figures (cost='h100' "
                                   "names built-in ones, or pass a rhino.Cluster)")
            if isinstance(self.mesh, AbstractMesh):
                c.check(self.mesh, "auto_parallel")
            elif self.mesh_shape is not None and c.ndim != len(self.mesh_shape):
                raise OptionsError(f"auto_parallel: expected a cost model for the "
                                   f"{len(self.mesh_shape)} axes of mesh_shape "
                                   f"{self.mesh_shape}, found one for {c.ndim} axes")
        elif c is not None:
            raise OptionsError(f"cost: expected a rhino.CostModel or a backend name such as "
                               f"'h100', found {type(c).__name__}")
        if isinstance(self.cluster, Cluster) and isinstance(c, str):
            raise OptionsError("auto_parallel: a rhino.Cluster carries its figures; found "
                               f"cost={c!r} too")

    def _check_exclusive(self) -> None:
        if self.cluster is not None and (self.mesh is not None or self.mesh_shape is not None):
            raise OptionsError("auto_parallel: expected a mesh (mesh_shape=/mesh=) or a "
                               "cluster, found both; a cluster's stage meshes are searched")
        if self.plan is not None and self.stages is not None:
            raise OptionsError("auto_parallel: a plan fixes its stages; pass plan= or "
                               "stages=, not both")
        if self.transport.executor is not self.executor:
            fits = [str(t) for t in TransportKind if t.executor is self.executor]
            raise OptionsError(f"transport: expected one of {fits} with executor "
                               f"'{self.executor}', found '{self.transport}' (a transport "
                               f"of the {self.transport.executor} executor)")
