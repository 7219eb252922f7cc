"""The cluster (hosts × devices per host, two link speeds) and its splits into stage meshes.

A cluster carries its devices' figures (FLOP/s per dtype, memory, intra- and inter-host α
and β, the partitioner's facts): by default the simulated-CPU ones, or a backend's
(``Cluster.parse("2x8", figures=backend_figures("h100"))``); fields given override them.
Each stage mesh gets its cost model from these figures (``MeshSplit.stage_cost``), as
``rhino.backends.BackendFigures.cost_model`` does for one mesh.

Devices are numbered host-major (device ``h·D + d`` is device ``d`` of host ``h``). A split
into ``p`` pipeline stages gives each stage ``N/p`` consecutive devices: either a part of
one host (``D`` divisible by ``N/p``) or whole hosts (``N/p`` divisible by ``D``); other
sizes would straddle hosts unevenly and are not enumerated. Each stage's devices form a
logical SPMD mesh, 1-D ``(n,)`` or 2-D ``(a, b)`` (row-major over the stage's devices):
an axis is *intra-host* when all its groups lie within a host, else it pays the inter-host
α and β. With ``p = 1`` the split is SPMD over the whole cluster.

Example:
    >>> c = Cluster.parse("2x8", beta_inter=1e-9)
    >>> [(s.num_stages, s.stage_shape) for s in enumerate_splits(c, max_stages=2)]
    [(1, (16,)), (1, (2, 8)), (1, (4, 4)), (1, (8, 2)), (2, (8,)), (2, (2, 4))]
    >>> s = enumerate_splits(c, 2)[1]
    >>> s.stage_mesh(c, 0).shape, s.stage_cost(c).beta
    ((2, 8), (1e-09, 2e-10))
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from rhino.backends import BACKENDS, BackendFigures, inter_host_axes
from rhino.errors import OptionsError
from rhino.planner.cost_model import (CPU_ALPHA, CPU_BETA, CPU_FLOPS, CPU_MEMORY, CostModel)
from rhino.planner.mesh import AbstractMesh, check_device_total
from rhino.planner.roofline import Roofline

_FIGURES = ("flops_per_s", "dtype_flops_per_s", "memory_bytes", "alpha_intra", "beta_intra",
            "alpha_inter", "beta_inter", "native_reduce_scatter", "backend", "roofline")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Hosts × devices per host, with the links within and across hosts.

    Attributes:
        hosts: number of hosts ``H``.
        devices_per_host: devices per host ``D``.
        alpha_intra, beta_intra: latency (s) and seconds per byte of links within a host.
        alpha_inter, beta_inter: the same across hosts.
        flops_per_s: FLOP/s of one device (float32, and dtypes without a rate).
        memory_bytes: memory of one device (None: unlimited).
        native_reduce_scatter: the devices' SPMD partitioner emits reduce-scatter (GPU,
            TPU); False for simulated CPU devices, which all-reduce and slice.
        dtype_flops_per_s: FLOP/s per dtype (``bf16``, ...), as ``(dtype, rate)`` pairs.
        backend: the name of the figures (``cpu``, ``h100``, ...).
        roofline: what the devices' kernels achieve (``rhino.planner.roofline``), or None.
    """

    hosts: int
    devices_per_host: int
    alpha_intra: float = CPU_ALPHA
    beta_intra: float = CPU_BETA
    alpha_inter: float = CPU_ALPHA
    beta_inter: float = CPU_BETA
    flops_per_s: float = CPU_FLOPS
    memory_bytes: int | None = CPU_MEMORY
    native_reduce_scatter: bool = False
    dtype_flops_per_s: tuple[tuple[str, float], ...] = ()
    backend: str = "cpu"
    roofline: Roofline | None = None

    def __post_init__(self):
        if self.hosts < 1 or self.devices_per_host < 1:
            raise ValueError(f"cluster: expected >= 1 hosts and devices per host, found "
                             f"{self.hosts}x{self.devices_per_host}")
        check_device_total(f"cluster {self.hosts}x{self.devices_per_host}",
                           self.hosts * self.devices_per_host)
        for f in ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"cluster {f}: expected >= 0, found {getattr(self, f)!r}")
        if not self.flops_per_s > 0:
            raise ValueError(f"cluster flops_per_s: expected > 0, found {self.flops_per_s!r}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"cluster memory_bytes: expected > 0 or None, found "
                             f"{self.memory_bytes!r}")
        # The figures' own checks (rates per dtype, the backend's name), and their form.
        fig = self.figures()
        object.__setattr__(self, "dtype_flops_per_s", fig.dtype_flops_per_s)
        object.__setattr__(self, "roofline", fig.roofline)

    @classmethod
    def parse(cls, text: str, figures: BackendFigures | None = None, **fields: Any
              ) -> "Cluster":
        """``"2x8"`` (hosts × devices per host) or ``"8"`` (one host), with ``figures``'
        FLOP/s, memory, links and facts (default: simulated CPU) and ``fields`` over them.

        Raises:
            ValueError: text not of that form.
        """
        m = re.fullmatch(r"\s*(\d+)\s*(?:[xX×]\s*(\d+))?\s*", str(text))
        if m is None:
            raise ValueError(f"cluster: expected HOSTSxDEVICES such as '2x8' (or DEVICES), "
                             f"found {text!r}")
        hosts, per = (int(m.group(1)), int(m.group(2))) if m.group(2) else (1, int(m.group(1)))
        return cls.from_figures(hosts, per, figures or BACKENDS["cpu"], **fields)

    @classmethod
    def from_figures(cls, hosts: int, devices_per_host: int, figures: BackendFigures,
                     **fields: Any) -> "Cluster":
        """A cluster of ``figures``' devices, ``fields`` overriding them."""
        base = {f: getattr(figures, f) for f in _FIGURES}
        base.update(fields)
        return cls(hosts, devices_per_host, **base)

    def figures(self) -> BackendFigures:
        """The cluster's devices and links as ``BackendFigures``."""
        try:
            return BackendFigures(
                self.backend, self.flops_per_s, self.dtype_flops_per_s, self.memory_bytes,
                self.alpha_intra, self.beta_intra, self.alpha_inter, self.beta_inter,
                self.devices_per_host, self.native_reduce_scatter, roofline=self.roofline)
        except OptionsError as e:
            raise OptionsError(f"cluster {self.hosts}x{self.devices_per_host}: {e}") from None

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    def __str__(self) -> str:
        return f"{self.hosts}x{self.devices_per_host}"

    def to_dict(self) -> dict[str, Any]:
        d = dict(dataclasses.asdict(self), dtype_flops_per_s=dict(self.dtype_flops_per_s))
        d["roofline"] = self.roofline.to_dict() if self.roofline is not None else None
        if d["roofline"] is None:
            del d["roofline"]     # as plans written before the roofline read
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Cluster":
        """The cluster of ``to_dict`` (a dict without the per-dtype rates and backend, as
        plans of format 2 wrote, is a simulated-CPU cluster)."""
        d = dict(d)
        rates = d.pop("dtype_flops_per_s", {})
        return cls(**d, dtype_flops_per_s=tuple(dict(rates).items()))


def _factor_pairs(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in range(2, n) if n % a == 0]


@dataclasses.dataclass(frozen=True)
class MeshSplit:
    """``num_stages`` stages, each a block of ``devices_per_stage`` devices as a mesh.

    Attributes:
        num_stages: ``p``.
        stage_shape: the logical SPMD mesh of every stage.
        devices_per_stage: ``N / p``.
        hosts_per_stage: hosts a stage spans (1 when stages share hosts).
        virtual_stages: stages per device group (``interleaved-1f1b``): the ``num_stages``
            stages run on ``num_stages / virtual_stages`` groups, stage ``c`` on group
            ``c % groups`` (Megatron's order).
    """

    num_stages: int
    stage_shape: tuple[int, ...]
    devices_per_stage: int
    hosts_per_stage: int
    virtual_stages: int = 1

    @property
    def groups(self) -> int:
        """Device groups: the stages but under virtual stages."""
        return self.num_stages // self.virtual_stages

    @property
    def kind(self) -> str:
        """``spmd`` (one stage), ``pipeline`` (one device per stage) or ``hybrid``."""
        if self.num_stages == 1:
            return "spmd"
        return "pipeline" if self.devices_per_stage == 1 else "hybrid"

    def devices(self, cluster: Cluster, stage: int) -> tuple[int, ...]:
        n, g = self.devices_per_stage, stage % self.groups
        return tuple(range(g * n, (g + 1) * n))

    def hosts(self, cluster: Cluster, stage: int) -> tuple[int, ...]:
        return tuple(sorted({d // cluster.devices_per_host for d in self.devices(cluster, stage)}))

    def _axis_inter(self, cluster: Cluster, shape: tuple[int, ...]) -> list[bool]:
        """Per axis: whether some group along it crosses hosts."""
        if math.prod(shape) != self.devices_per_stage:
            raise ValueError(f"stage mesh {shape}: expected {self.devices_per_stage} devices")
        return list(inter_host_axes(shape, cluster.devices_per_host))

    def stage_mesh(self, cluster: Cluster, stage: int = 0) -> AbstractMesh:
        """The abstract mesh of one stage (all stages have the same)."""
        return AbstractMesh(self.stage_shape)

    def stage_cost(self, cluster: Cluster, **overrides: Any) -> CostModel:
        """The cost model of a stage's mesh: the cluster's figures, an axis whose groups
        cross hosts paying the inter-host α and β (``overrides``: any ``CostModel``
        field)."""
        return cluster.figures().cost_model(self.stage_shape, cluster.devices_per_host,
                                            **overrides)

    def link(self, cluster: Cluster, src: int, dst: int) -> tuple[float, float]:
        """(α, β) of the links between two stages: intra-host when both sit on one host;
        nothing between two stages of one device group (virtual stages)."""
        if src % self.groups == dst % self.groups:
            return 0.0, 0.0
        hs, hd = self.hosts(cluster, src), self.hosts(cluster, dst)
        if len(hs) == 1 and hs == hd:
            return cluster.alpha_intra, cluster.beta_intra
        return cluster.alpha_inter, cluster.beta_inter

    def label(self) -> str:
        shape = "x".join(map(str, self.stage_shape))
        virtual = f" ({self.groups} groups × {self.virtual_stages})" \
            if self.virtual_stages > 1 else ""
        return f"pp={self.num_stages}{virtual} × ({shape})"


def enumerate_splits(cluster: Cluster, max_stages: int | None = None,
                     two_d: bool = True) -> list[MeshSplit]:
    """Every split of the cluster into ``p ≤ max_stages`` stages × a stage mesh.

    2-D stage meshes ``(a, b)`` with both axes of one link kind are enumerated once
    (``a ≤ b``): the SPMD planner sees the same mesh up to axis names.

    Args:
        cluster: the cluster.
        max_stages: the most stages (default: all devices).
        two_d: also enumerate 2-D stage meshes.
    """
    n = cluster.num_devices
    per = cluster.devices_per_host
    max_stages = n if max_stages is None else max(1, min(max_stages, n))
    out: list[MeshSplit] = []
    for p in range(1, max_stages + 1):
        if n % p:
            continue
        size = n // p
        if size <= per:
            if per % size:
                continue
            hosts_per_stage = 1
        else:
            if size % per:
                continue
            hosts_per_stage = size // per
        shapes: list[tuple[int, ...]] = [(size,)]
        if two_d:
            probe = MeshSplit(p, (size,), size, hosts_per_stage)
            for a, b in _factor_pairs(size):
                kinds = probe._axis_inter(cluster, (a, b))
                if kinds[0] == kinds[1] and a > b:
                    continue
                shapes.append((a, b))
        for shape in shapes:
            out.append(MeshSplit(p, shape, size, hosts_per_stage))
    return out


def check_device_count(what: str, need: int, devices: Any) -> None:
    """Refuse ``what`` (an option as the user wrote it: a mesh or cluster) when it needs
    more than the ``devices`` there are, with advice for their platform: the simulated-device
    flag on CPU only; elsewhere a smaller plan, or more devices through ``rhino.launch`` or
    Ray.

    Raises:
        OptionsError: ``need`` > ``len(devices)``.
    """
    have = len(devices)
    if need <= have:
        return
    platform = devices[0].platform if have else "no"
    if platform == "cpu":
        advice = (f"to simulate {need} devices on CPU, set XLA_FLAGS="
                  f"--xla_force_host_platform_device_count={need} before importing jax")
    else:
        advice = (f"plan for at most {have} devices, or run on more: several processes "
                  f"under rhino.launch (each with its own devices), or executor='ray' on a "
                  f"Ray cluster")
    raise OptionsError(f"{what}: needs {need} devices, found {have} {platform} "
                       f"device{'s' if have != 1 else ''} here; {advice}")
