"""The cost model the planner prices plans with, separate from the mesh it plans for.

A ``CostModel`` holds what the hardware costs, per axis of one logical mesh
(``rhino.planner.mesh.AbstractMesh``):

* ``alpha``, ``beta``: latency (s per collective) and inverse bandwidth (s per byte) of a
  collective over each mesh axis (``rhino.planner.collectives``: a group of axes pays the
  α and the β of its slowest axis, so a collective over every axis of a (2, 4) mesh costs
  what it costs over the one axis of an (8) mesh of the same devices);
* ``flops_per_s``: FLOP/s of one device for float32 work and for any dtype without its own
  rate; ``dtype_flops_per_s``: the rates of other dtypes (``bf16``, ``f16``, ...). An op's
  compute costs ``op.flops / (rate of its dtype × devices sharing it)``, its dtype read from
  the graph by ``compute_dtype`` (a dot's or convolution's operand type, else its result's);
* ``memory_bytes``: memory of one device (None: unconstrained);
* ``roofline``: what the device's kernels achieve (``rhino.planner.roofline.Roofline``:
  memory bandwidth, non-matmul FLOP/s, matmul efficiency by dtype and size, launch costs,
  measured collectives), or None. With it an op's compute is its kernel's roofline time
  (``rhino.planner.op_cost``: max(FLOPs / achievable FLOP/s, bytes / bandwidth) + launch,
  ops fused as XLA fuses them); without it, ``op.flops / rate`` as above (the model the
  hand-derived examples use). ``flops_for`` stays the peak either way (MFU's denominator);
* ``inter_host``: per axis, whether its groups cross hosts (the link a measured collective
  of ``roofline.collectives`` is looked up for); empty: every axis within a host;
* backend facts: ``native_reduce_scatter`` (the SPMD partitioner emits reduce-scatter, as
  XLA:GPU and XLA:TPU do; XLA:CPU all-reduces and slices), ``strided_moves_all_to_all``
  (moving a split into or out of a strided layout is one all-to-all; ``auto_parallel``
  runs strided values with gathers and plans with False), and ``backend``, the name of the
  figures it was made from (``cpu``, ``h100``, ... or ``custom``).

The planner's entry points take it next to the mesh: ``plan_graph(graph, mesh, cost,
options)``, ``build_problem(graph, mesh, cost)``, ``reshard(src, dst, tensor, mesh, cost)``.
Built-in figures per backend, and the choice among them from the devices at hand, live in
``rhino.backends``; measured ones come from ``rhino.calibrate``.

Example:
    >>> cost = CostModel.simulated_cpu(2)
    >>> cost.alpha, cost.flops_for("bf16")
    ((1e-05, 1e-05), 50000000000.0)
    >>> gpu = CostModel((1e-5,), (1 / 450e9,), 67e12, {"bf16": 989e12}, backend="h100")
    >>> gpu.flops_for("bf16"), gpu.flops_for("s32")
    (989000000000000.0, 67000000000000.0)
    >>> CostModel.from_json(gpu.to_json()) == gpu
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, Sequence

from rhino.errors import OptionsError
from rhino.hlo_passes.fusion import kernel_dtype as compute_dtype  # noqa: F401 (re-export)
from rhino.planner.mesh import AbstractMesh
from rhino.planner.roofline import Roofline, keyed_table

# Simulated CPU devices (one host, shared-memory "network").
CPU_ALPHA = 1e-5            # s per collective
CPU_BETA = 1.0 / 5e9        # s per byte (5 GB/s)
CPU_FLOPS = 5e10            # FLOP/s per device, every dtype
CPU_MEMORY = 4 * 2**30      # bytes per device

DEFAULT_DTYPE = "f32"
CUSTOM = "custom"
_MATMUL_OPCODES = frozenset({"dot", "convolution"})


def _rate(value: Any, where: str) -> float:
    try:
        r = float(value)
    except (TypeError, ValueError):
        r = math.nan
    if isinstance(value, bool) or not math.isfinite(r) or r <= 0:
        raise OptionsError(f"cost model {where}: expected a positive FLOP/s, found {value!r}")
    return r


def _per_axis(value: Any, field: str) -> tuple[float, ...]:
    try:
        items = None if isinstance(value, (str, bytes)) else list(value)
    except TypeError:
        items = None
    if not items:
        raise OptionsError(f"cost model {field}: expected one value per mesh axis (a "
                           f"non-empty sequence; CostModel.uniform(ndim, ...) broadcasts "
                           f"one), found {value!r}")
    try:
        vals = tuple(float(x) for x in items)
    except (TypeError, ValueError):
        vals = ()
    if len(vals) != len(items) or any(not math.isfinite(x) or x < 0 for x in vals):
        raise OptionsError(f"cost model {field}: expected finite values >= 0, one per mesh "
                           f"axis, found {value!r}")
    return vals


def _memory(value: Any) -> int | None:
    if value is None:
        return None
    try:
        ok = not isinstance(value, bool) and float(value) > 0 and float(value).is_integer()
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise OptionsError(f"cost model memory_bytes: expected a positive number of bytes or "
                           f"None, found {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What collectives, compute and memory cost on one logical mesh (module docstring).

    Attributes:
        alpha: seconds of latency per collective, per mesh axis.
        beta: seconds per byte, per mesh axis (1 / bandwidth of one device's link).
        flops_per_s: FLOP/s of one device for float32 and any dtype without its own rate.
        dtype_flops_per_s: FLOP/s of one device per HLO element type (``bf16``, ``f16``,
            ...); a mapping, kept as sorted ``(dtype, rate)`` pairs.
        memory_bytes: memory of one device in bytes, or None when unconstrained.
        native_reduce_scatter: a pending sum resharded to a split is one reduce-scatter
            (XLA:GPU/TPU); False: an all-reduce and a local slice (XLA:CPU).
        strided_moves_all_to_all: moving a split between strides is one all-to-all (paper
            §4.1); False charges an all-gather (then a free slice), which is what XLA runs
            for a reshape between incompatible splits and so what ``auto_parallel`` plans.
        backend: the figures' name (``cpu``, ``h100``, ... see ``rhino.backends``), or
            ``custom``.
        roofline: achievable kernel figures (module docstring), or None: FLOPs at the
            dtypes' rates only.
        inter_host: per axis, True where its groups cross hosts (empty: none does).

    Raises:
        OptionsError: α and β not one finite non-negative value per axis (the same number
            of axes), a rate not positive, memory not positive, or an empty backend name.
    """

    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    flops_per_s: float = CPU_FLOPS
    dtype_flops_per_s: Mapping[str, float] | tuple[tuple[str, float], ...] = ()
    memory_bytes: int | None = None
    native_reduce_scatter: bool = True
    strided_moves_all_to_all: bool = True
    backend: str = CUSTOM
    roofline: Roofline | None = None
    inter_host: tuple[bool, ...] = ()

    def __post_init__(self):
        put = object.__setattr__
        put(self, "alpha", _per_axis(self.alpha, "alpha"))
        put(self, "beta", _per_axis(self.beta, "beta"))
        if len(self.alpha) != len(self.beta):
            raise OptionsError(f"cost model: expected α and β for the same axes, found "
                               f"{len(self.alpha)} α and {len(self.beta)} β")
        put(self, "flops_per_s", _rate(self.flops_per_s, "flops_per_s"))
        put(self, "dtype_flops_per_s", keyed_table(
            self.dtype_flops_per_s, _rate, "dtype_flops_per_s",
            "cost model dtype_flops_per_s: expected a mapping dtype -> FLOP/s"))
        put(self, "memory_bytes", _memory(self.memory_bytes))
        put(self, "native_reduce_scatter", bool(self.native_reduce_scatter))
        put(self, "strided_moves_all_to_all", bool(self.strided_moves_all_to_all))
        if not isinstance(self.backend, str) or not self.backend:
            raise OptionsError(f"cost model backend: expected a name, found {self.backend!r}")
        roof = self.roofline
        if isinstance(roof, Mapping):
            roof = Roofline.from_dict(roof)
        if roof is not None and not isinstance(roof, Roofline):
            raise OptionsError(f"cost model roofline: expected a Roofline, its dict or None, "
                               f"found {type(roof).__name__}")
        put(self, "roofline", roof)
        inter = tuple(self.inter_host or ())
        if inter and (len(inter) != len(self.alpha)
                      or any(not isinstance(x, bool) for x in inter)):
            raise OptionsError(f"cost model inter_host: expected one True/False per mesh "
                               f"axis ({len(self.alpha)}), found {self.inter_host!r}")
        put(self, "inter_host", inter if any(inter) else ())

    # ---------------------------------------------------------------- constructors
    @classmethod
    def uniform(cls, ndim: int, alpha: float = CPU_ALPHA, beta: float = CPU_BETA,
                **fields: Any) -> "CostModel":
        """A cost model with the same α and β on each of ``ndim`` axes.

        Args:
            ndim: the number of mesh axes.
            alpha, beta: latency (s) and seconds per byte of every axis.
            **fields: the other fields (``flops_per_s``, ``memory_bytes``, ...).
        """
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 1:
            raise OptionsError(f"cost model: expected a number of mesh axes >= 1, found "
                               f"{ndim!r}")
        return cls((alpha,) * ndim, (beta,) * ndim, **fields)

    @classmethod
    def simulated_cpu(cls, ndim: int, **overrides: Any) -> "CostModel":
        """Simulated CPU devices on ``ndim`` mesh axes: α = 10 µs, β = 1/(5 GB/s), 50 GFLOP/s
        for every dtype, 4 GiB, no native reduce-scatter.

        Args:
            ndim: the number of mesh axes.
            **overrides: any field (``alpha``, ``beta`` per axis, ``flops_per_s``, ...).
        """
        fields: dict[str, Any] = dict(flops_per_s=CPU_FLOPS, memory_bytes=CPU_MEMORY,
                                      native_reduce_scatter=False, backend="cpu")
        fields.update(overrides)
        alpha = fields.pop("alpha", CPU_ALPHA)
        beta = fields.pop("beta", CPU_BETA)
        n = ndim if isinstance(ndim, int) and not isinstance(ndim, bool) else -1
        if n < 1:
            raise OptionsError(f"cost model: expected a number of mesh axes >= 1, found "
                               f"{ndim!r}")
        alpha = (alpha,) * n if isinstance(alpha, (int, float)) else alpha
        beta = (beta,) * n if isinstance(beta, (int, float)) else beta
        return cls(alpha, beta, **fields)

    def with_flops(self, flops_per_s: float) -> "CostModel":
        """The same model with one rate, ``flops_per_s``, for every dtype."""
        return dataclasses.replace(self, flops_per_s=flops_per_s, dtype_flops_per_s=())

    # ---------------------------------------------------------------- reading
    @property
    def ndim(self) -> int:
        """The number of mesh axes the model prices."""
        return len(self.alpha)

    def check(self, mesh: AbstractMesh, where: str = "plan") -> None:
        """Raise ``OptionsError`` unless the model prices exactly ``mesh``'s axes."""
        if self.ndim != mesh.ndim:
            raise OptionsError(f"{where}: expected a cost model with α and β for the "
                               f"{mesh.ndim} axes of {mesh}, found one for {self.ndim} "
                               f"axes (α {list(self.alpha)})")

    def flops_for(self, dtype: str | None) -> float:
        """FLOP/s of one device for work in ``dtype`` (``flops_per_s`` when it has no
        rate of its own, or is None)."""
        if dtype is not None and dtype != DEFAULT_DTYPE:
            for k, v in self.dtype_flops_per_s:
                if k == dtype:
                    return v
        return self.flops_per_s

    def group_alpha(self, axes: Sequence[int]) -> float:
        """Latency of one collective over ``axes``: the largest of the axes' α.

        One collective over a group of devices is launched and synchronised once; its
        latency is that of its slowest link, as its bandwidth is (``group_beta``). (A sum
        would price the same 8 devices' all-reduce higher when they are viewed as a (2, 4)
        mesh than as an (8) one, and so every 2-D plan that uses both axes together.)
        """
        return float(max((self.alpha[a] for a in axes), default=0.0))

    def group_beta(self, axes: Sequence[int]) -> float:
        """Seconds per byte of a collective over ``axes``: the slowest axis' β."""
        return float(max((self.beta[a] for a in axes), default=0.0))

    def group_link(self, axes: Sequence[int]) -> str:
        """``inter`` when some axis of ``axes`` crosses hosts, else ``intra``."""
        return "inter" if any(self.inter_host[a] for a in axes if a < len(self.inter_host)) \
            else "intra"

    def collective_alpha_beta(self, kind: str, axes: Sequence[int], n: int
                              ) -> tuple[float, float]:
        """(α, β) of a ``kind`` collective over ``axes`` (``n`` devices): the roofline's
        measured figures for that link, kind and group size where it has them, else the
        axes' (``group_alpha``, ``group_beta``)."""
        if self.roofline is not None and self.roofline.collectives:
            got = self.roofline.collective(self.group_link(axes), kind, n)
            if got is not None:
                return got
        return self.group_alpha(axes), self.group_beta(axes)

    def measured_collective(self, kind: str, axes: Sequence[int], n: int, x: float,
                            alpha_share: float = 1.0) -> float | None:
        """Seconds of a ``kind`` collective over ``axes`` (``n`` devices) moving ``x``
        formula bytes, from the roofline's measurements for the group's link (None where
        there are none: the α-β formula applies)."""
        if self.roofline is None or not self.roofline.collectives:
            return None
        return self.roofline.collective_seconds(self.group_link(axes), kind, n, x,
                                                alpha_share)

    def program_seconds(self) -> float:
        """Seconds to dispatch one program and wait for it (0 without a roofline)."""
        return self.roofline.program_s if self.roofline is not None else 0.0

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "alpha": list(self.alpha), "beta": list(self.beta),
                "flops_per_s": self.flops_per_s,
                "dtype_flops_per_s": dict(self.dtype_flops_per_s),
                "memory_bytes": self.memory_bytes,
                "native_reduce_scatter": self.native_reduce_scatter,
                "strided_moves_all_to_all": self.strided_moves_all_to_all,
                **({"roofline": self.roofline.to_dict()} if self.roofline else {}),
                **({"inter_host": list(self.inter_host)} if self.inter_host else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostModel":
        """The model of ``to_dict``.

        Raises:
            OptionsError: a key missing, an unknown key, or a value the model rejects.
        """
        if not isinstance(d, dict):
            raise OptionsError(f"cost model JSON: expected an object, found "
                               f"{type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [k for k in ("alpha", "beta", "flops_per_s") if k not in d]
        extra = sorted(set(d) - known)
        if missing or extra:
            raise OptionsError(f"cost model JSON: expected the keys {sorted(known)} "
                               f"(alpha, beta and flops_per_s required), found "
                               f"{sorted(d)}")
        fields = dict(d)
        if "inter_host" in fields:
            fields["inter_host"] = tuple(fields["inter_host"])
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        return cls.from_dict(json.loads(text))

    def summary(self) -> str:
        """One line for reports: backend, α, β, FLOP/s (per dtype), memory."""
        rates = f"{self.flops_per_s:.3g} FLOP/s" + "".join(
            f", {k} {v:.3g}" for k, v in self.dtype_flops_per_s)
        mem = "unlimited" if self.memory_bytes is None else f"{self.memory_bytes / 2**30:.3g} GiB"
        return (f"{self.backend}: α {list(self.alpha)} s, β {list(self.beta)} s/B, {rates}, "
                f"memory {mem}" + (f"; {self.roofline.summary()}" if self.roofline else ""))


def legacy_mesh(d: dict[str, Any]) -> tuple[AbstractMesh, CostModel]:
    """The mesh and cost model of a mesh written before they were separate (SPMD plan
    format 1, ``Plan`` format 2: ``shape``, ``axis_names``, ``alpha``, ``beta``,
    ``flops_per_s``, ``memory_bytes`` and the backend facts in one object).

    Raises:
        ValueError: a key the old mesh always had is missing.
    """
    try:
        mesh = AbstractMesh(tuple(d["shape"]), tuple(d.get("axis_names", ())))
        cost = CostModel(tuple(d["alpha"]), tuple(d["beta"]), float(d["flops_per_s"]),
                         memory_bytes=d.get("memory_bytes"),
                         native_reduce_scatter=bool(d.get("native_reduce_scatter", True)),
                         strided_moves_all_to_all=bool(d.get("strided_moves_all_to_all",
                                                             True)))
    except KeyError as e:
        raise ValueError(f"mesh JSON (older format): expected key {e.args[0]!r}, found keys "
                         f"{sorted(d)}") from None
    return mesh, cost
