"""The abstract device mesh the planner plans for: axis sizes plus an α-β-FLOP/s cost model.

The planner is pure: it never sees real devices. An ``AbstractMesh`` is all it knows about the
hardware: the logical mesh shape (e.g. ``(2, 4)`` = 2 hosts × 4 devices), a latency ``alpha``
and an inverse bandwidth ``beta`` per mesh axis (used by ``rhino.planner.collectives``), the
device's FLOP/s (compute cost) and its memory (the memory constraint of §4.4). Measuring these
numbers on real devices is the job of a calibration routine elsewhere.

Example:
    >>> mesh = AbstractMesh.simulated_cpu((2, 4))
    >>> mesh.axis_names, mesh.num_devices
    (('x', 'y'), 8)
    >>> AbstractMesh.from_json(mesh.to_json()) == mesh
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Sequence

_DEFAULT_NAMES = "xyzuvw"

# Defaults for simulated CPU devices (one host, shared memory "network").
CPU_ALPHA = 1e-5            # s per collective
CPU_BETA = 1.0 / 5e9        # s per byte (5 GB/s)
CPU_FLOPS = 5e10            # FLOP/s per device
CPU_MEMORY = 4 * 2**30      # bytes per device


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """``x, y, z, u, v, w`` then ``a6, a7, ...`` for the first ``ndim`` axes."""
    return tuple(_DEFAULT_NAMES[i] if i < len(_DEFAULT_NAMES) else f"a{i}" for i in range(ndim))


@dataclasses.dataclass(frozen=True)
class AbstractMesh:
    """A logical device mesh with its communication and compute cost parameters.

    Attributes:
        shape: number of devices along each mesh axis, e.g. ``(2, 4)``.
        axis_names: one name per axis; defaults to ``("x", "y", ...)``.
        alpha: seconds of latency per collective, per axis (a collective over several axes
            pays the sum). A single float is broadcast to every axis.
        beta: seconds per byte per axis (1 / bandwidth; a collective over several axes uses
            the slowest). A single float is broadcast to every axis.
        flops_per_s: FLOP/s of one device.
        memory_bytes: memory of one device in bytes, or None when unconstrained.
        native_reduce_scatter: the platform's SPMD partitioner emits reduce-scatter for a
            pending sum resharded to a split (XLA:GPU/TPU); False where it all-reduces and
            slices instead (XLA:CPU), so the planner charges what will run.
        strided_moves_all_to_all: moving a split between strides (into or out of a strided
            layout, on the same mesh axis) is one all-to-all (paper §4.1). False charges an
            all-gather (then a free slice) instead: that is what XLA's partitioner runs for
            a reshape between incompatible splits, which is how ``auto_parallel`` executes
            strided values (``runtime.strided``), so it plans with False.

    Raises:
        ValueError: on empty or non-positive sizes, wrong-length per-axis tuples, repeated
            axis names or non-positive rates.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()
    alpha: tuple[float, ...] | float = CPU_ALPHA
    beta: tuple[float, ...] | float = CPU_BETA
    flops_per_s: float = CPU_FLOPS
    memory_bytes: int | None = None
    native_reduce_scatter: bool = True
    strided_moves_all_to_all: bool = True

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape: expected a non-empty tuple of positive sizes, "
                             f"found {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        names = tuple(self.axis_names) or default_axis_names(len(shape))
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise ValueError(f"mesh axis_names: expected {len(shape)} distinct names, found "
                             f"{names!r}")
        object.__setattr__(self, "axis_names", names)
        for field in ("alpha", "beta"):
            v = getattr(self, field)
            vals = (float(v),) * len(shape) if isinstance(v, (int, float)) else tuple(
                float(x) for x in v)
            if len(vals) != len(shape) or any(x < 0 or not math.isfinite(x) for x in vals):
                raise ValueError(f"mesh {field}: expected {len(shape)} finite non-negative "
                                 f"values (one per axis), found {v!r}")
            object.__setattr__(self, field, vals)
        if not self.flops_per_s > 0:
            raise ValueError(f"mesh flops_per_s: expected > 0, found {self.flops_per_s!r}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"mesh memory_bytes: expected > 0 or None, found "
                             f"{self.memory_bytes!r}")

    @classmethod
    def simulated_cpu(cls, shape: Sequence[int], **overrides: Any) -> "AbstractMesh":
        """A mesh of simulated CPU devices: α = 10 µs, β = 1/(5 GB/s), 50 GFLOP/s, 4 GiB,
        no native reduce-scatter.

        Args:
            shape: the mesh shape.
            **overrides: any other field (``alpha``, ``beta``, ``axis_names``, ...).
        """
        fields = dict(alpha=CPU_ALPHA, beta=CPU_BETA, flops_per_s=CPU_FLOPS,
                      memory_bytes=CPU_MEMORY, native_reduce_scatter=False)
        fields.update(overrides)
        return cls(tuple(shape), **fields)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_name(self, axis: int) -> str:
        return self.axis_names[axis]

    def axis_index(self, name: str) -> int:
        """Index of the axis called ``name``."""
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise ValueError(f"mesh has no axis named {name!r}; axes are "
                             f"{self.axis_names!r}") from None

    def group_size(self, axes: Sequence[int]) -> int:
        """Number of devices in a group spanning ``axes``."""
        return math.prod(self.shape[a] for a in axes)

    def group_alpha(self, axes: Sequence[int]) -> float:
        """Latency of one collective over ``axes``: the sum of the axes' α."""
        return float(sum(self.alpha[a] for a in axes))

    def group_beta(self, axes: Sequence[int]) -> float:
        """Seconds per byte of a collective over ``axes``: the slowest axis' β."""
        return float(max((self.beta[a] for a in axes), default=0.0))

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names),
                "alpha": list(self.alpha), "beta": list(self.beta),
                "flops_per_s": self.flops_per_s, "memory_bytes": self.memory_bytes,
                "native_reduce_scatter": self.native_reduce_scatter,
                "strided_moves_all_to_all": self.strided_moves_all_to_all}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AbstractMesh":
        try:
            return cls(tuple(d["shape"]), tuple(d.get("axis_names", ())),
                       tuple(d["alpha"]), tuple(d["beta"]), float(d["flops_per_s"]),
                       d.get("memory_bytes"), bool(d.get("native_reduce_scatter", True)),
                       bool(d.get("strided_moves_all_to_all", True)))
        except KeyError as e:
            raise ValueError(f"mesh JSON: expected key {e.args[0]!r}, found keys "
                             f"{sorted(d)}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "AbstractMesh":
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape)) + ")"
