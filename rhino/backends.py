"""Built-in hardware figures per backend, and the choice among them from the devices at hand.

A ``BackendFigures`` describes one kind of device and its links: FLOP/s per dtype, memory,
the latency α and inverse bandwidth β of links within a host (or TPU slice) and across
hosts, devices per host, and whether its SPMD partitioner emits reduce-scatter. Given a mesh
shape it makes the planner's ``CostModel`` (``figures.cost_model(shape)``): a mesh axis
whose device groups all lie within one host gets the intra-host link, any other the
inter-host one (devices numbered host-major, the mesh row-major over them), as
``rhino.cluster`` does for stage meshes.

``figures_for_devices`` picks the figures of ``jax.devices()``-like objects by ``platform``
and ``device_kind``; ``cost_model_for_devices`` also counts the devices per host (per
process; per slice on TPU). Unknown accelerators get the simulated-CPU figures with the
platform's partitioner facts and a warning: pass a cost model (``rhino.calibrate``) there.

Sources (peak dense rates: the datasheets' "with sparsity" figures halved). FLOP/s of
``f32`` is the rate of a float32 matmul at JAX's default precision, which on GPU uses
TF32 tensor cores and on TPU one bfloat16 pass (docs.jax.dev, "Matmul precision").
β is one device's link bandwidth in one direction (the ring all-reduce's model).
α is not a published figure: 10 µs per collective within a host or slice and 20 µs across
hosts are order-of-magnitude assumptions (NCCL's and ICI's small-message latencies); use
``rhino.calibrate`` for measured values. Memory: the datasheets' GB (10^9 bytes), or GiB
where the vendor states GiB.

Example:
    >>> fig = backend_figures("h100")
    >>> cost = fig.cost_model((2, 8), devices_per_host=8)   # 2 hosts × 8 GPUs
    >>> [round(1 / b / 1e9) for b in cost.beta], cost.flops_for("bf16") / 1e12
    ([50, 450], 989.5)
    >>> backend_figures("cpu").cost_model((4,)) == CostModel.simulated_cpu(1)
    True
"""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings
from typing import Any, Mapping, Sequence

from rhino.errors import OptionsError
from rhino.planner.cost_model import (CPU_ALPHA, CPU_BETA, CPU_FLOPS, CPU_MEMORY, CostModel)
from rhino.planner.mesh import AbstractMesh
from rhino.planner.roofline import Roofline

GB = 10**9
GIB = 2**30
_ALPHA_INTRA = 1e-5     # s: assumed (see the module docstring)
_ALPHA_INTER = 2e-5     # s: assumed


def inter_host_axes(shape: Sequence[int], devices_per_host: int | None) -> tuple[bool, ...]:
    """Per mesh axis: whether some device group along it crosses hosts.

    The mesh's devices are ``prod(shape)`` consecutive devices, numbered host-major; an axis
    is intra-host when the consecutive block its groups span fits a host evenly.

    Example:
        >>> inter_host_axes((2, 8), 8), inter_host_axes((4, 4), 8), inter_host_axes((8,), 8)
        ((True, False), (True, False), (False,))
    """
    n = math.prod(shape)
    per = n if devices_per_host is None else devices_per_host
    out = []
    inner = 1
    for size in reversed(tuple(shape)):
        span = inner * size                 # consecutive devices a group spans
        out.append(n > per and not (span <= per and per % span == 0))
        inner = span
    return tuple(reversed(out))


def _positive(name: str, value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise OptionsError(f"backend figures {name}: expected a finite number >= 0, found "
                           f"{value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class BackendFigures:
    """One kind of device and its links: what a ``CostModel`` is made from.

    Attributes:
        backend: the name (``cpu``, ``h100``, ...).
        flops_per_s: FLOP/s of one device for float32 (and dtypes without a rate).
        dtype_flops_per_s: FLOP/s per HLO element type (``bf16``, ``f16``, ...).
        memory_bytes: memory of one device (None: unlimited).
        alpha_intra, beta_intra: latency (s) and seconds per byte within a host (a TPU
            slice: its ICI).
        alpha_inter, beta_inter: the same across hosts (slices: the data-center network).
        devices_per_host: devices sharing the intra-host links; None: any number.
        native_reduce_scatter: the SPMD partitioner emits reduce-scatter (GPU, TPU).
        roofline: what its kernels achieve (``rhino.planner.roofline.Roofline``), or None.
        source: where the figures come from (not compared).
    """

    backend: str
    flops_per_s: float
    dtype_flops_per_s: Mapping[str, float] | tuple[tuple[str, float], ...] = ()
    memory_bytes: int | None = None
    alpha_intra: float = CPU_ALPHA
    beta_intra: float = CPU_BETA
    alpha_inter: float = CPU_ALPHA
    beta_inter: float = CPU_BETA
    devices_per_host: int | None = None
    native_reduce_scatter: bool = True
    source: str = dataclasses.field(default="", compare=False)
    roofline: Roofline | None = None

    def __post_init__(self):
        # The cost model validates the rates, memory and roofline; keep its normal form here.
        probe = CostModel((0.0,), (0.0,), self.flops_per_s, self.dtype_flops_per_s,
                          self.memory_bytes, backend=self.backend, roofline=self.roofline)
        object.__setattr__(self, "flops_per_s", probe.flops_per_s)
        object.__setattr__(self, "dtype_flops_per_s", probe.dtype_flops_per_s)
        object.__setattr__(self, "memory_bytes", probe.memory_bytes)
        object.__setattr__(self, "roofline", probe.roofline)
        for f in ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter"):
            object.__setattr__(self, f, _positive(f, getattr(self, f)))
        per = self.devices_per_host
        if per is not None and (isinstance(per, bool) or not isinstance(per, int) or per < 1):
            raise OptionsError(f"backend figures devices_per_host: expected a positive "
                               f"integer or None, found {per!r}")

    def cost_model(self, mesh: AbstractMesh | Sequence[int],
                   devices_per_host: int | None = None, **overrides: Any) -> CostModel:
        """The cost model of a mesh of these devices.

        Args:
            mesh: the mesh, or its shape.
            devices_per_host: devices per host (default: the figures'); an axis whose
                groups cross hosts gets the inter-host α and β.
            **overrides: any ``CostModel`` field; ``alpha`` / ``beta`` as one number for
                every axis or one per axis.
        """
        shape = mesh.shape if isinstance(mesh, AbstractMesh) else tuple(int(s) for s in mesh)
        per = devices_per_host if devices_per_host is not None else self.devices_per_host
        inter = inter_host_axes(shape, per)
        alpha = overrides.pop("alpha", None)
        beta = overrides.pop("beta", None)
        alpha = (tuple(self.alpha_inter if x else self.alpha_intra for x in inter)
                 if alpha is None else (alpha,) * len(shape) if isinstance(alpha, (int, float))
                 else alpha)
        beta = (tuple(self.beta_inter if x else self.beta_intra for x in inter)
                if beta is None else (beta,) * len(shape) if isinstance(beta, (int, float))
                else beta)
        fields: dict[str, Any] = dict(
            flops_per_s=self.flops_per_s, dtype_flops_per_s=self.dtype_flops_per_s,
            memory_bytes=self.memory_bytes, native_reduce_scatter=self.native_reduce_scatter,
            backend=self.backend, roofline=self.roofline, inter_host=inter)
        fields.update(overrides)
        return CostModel(alpha, beta, **fields)


def _dense(sparse_tflops: float) -> float:
    """A datasheet's "with sparsity" TFLOPS as dense FLOP/s."""
    return sparse_tflops * 1e12 / 2


# NVIDIA H100 SXM5 80GB, "NVIDIA H100 Tensor Core GPU" datasheet: FP64 Tensor 67 TF, TF32
# 989 TF*, BF16/FP16 1,979 TF*, FP8 3,958 TF* (* with sparsity), 80 GB HBM3, NVLink 900 GB/s
# (both directions: 450 GB/s each way); DGX H100 user guide: 8 GPUs and 8 ConnectX-7
# 400 Gb/s compute NICs per node (50 GB/s per GPU). PCIe and NVL parts are slower: give
# those a CostModel of their own.
_H100_RATES = {"bf16": _dense(1979), "f16": _dense(1979), "f64": 67e12,
               "f8e4m3fn": _dense(3958), "f8e5m2": _dense(3958)}
# ---- Achievable figures (``Roofline``): what kernels reach, not the datasheets' peaks.
# H200, measured here by ``benchmarks/gpu_check.py`` on the lent H200 (jax 0.11.2, CUDA 13,
# RESULTS.md "Issue 32" 2026-11-26 and "Issue 45" 2026-11-28): an 8192³ matmul reached
# 0.69 (bf16; 0.73 on 11-26) and 0.78 (TF32; 0.76) of the datasheet figures; an ``x + 1``
# over 1 GiB moved 2.78 TB/s (3.13 on 11-26) of the 4.8 TB/s datasheet (0.58); a
# one-element program took 78.7 µs from call to result (64.5 µs on 11-26). With these,
# XLA's own compiled GPT-Medium step (gpt_step.compiled.hlo of 11-28, priced kernel by
# kernel) comes to 144 ms against 145.7 ms measured. Not measured yet (assumptions until
# the next gpu_check run, which measures them): the matmul curve below 8192³ (flat here),
# the launch cost per kernel (2 µs: XLA launches kernels back to back, each adds little
# past its own roofline), fused attention at 0.5 of the bf16 peak (published
# FlashAttention-2/3 and cuDNN figures on H100: 0.35-0.75 forward, less backward), and
# the non-tensor FP32 rate (the datasheet's 67 TFLOPS).
_H200_ROOFLINE = Roofline(
    2.78e12, 67e12, {"bf16": ((1.1e12, 0.69),), "f16": ((1.1e12, 0.69),),
                     "f32": ((1.1e12, 0.78),)},
    attention_efficiency=0.5, launch_s=2e-6, program_s=78.7e-6, fusion="gpu",
    source="H200 measured by benchmarks/gpu_check.py (2026-11-26, 2026-11-28); launch per "
           "kernel, attention and vector rate assumed")
# H100 SXM: the H200's compute die, so its matmul fractions; HBM3 3.35 TB/s datasheet at
# the H200's measured fraction (0.58): 1.94 TB/s (assumed, not measured).
_H100_ROOFLINE = dataclasses.replace(
    _H200_ROOFLINE, memory_bandwidth=3.35e12 * 2.78 / 4.8,
    source="the H200's measured fractions applied to the H100 SXM datasheet (assumed)")
# A100 SXM 80GB: HBM2e 2.039 TB/s datasheet at the H200's fraction, FP32 19.5 TFLOPS
# non-tensor, the H200's matmul fractions (assumed, not measured).
_A100_ROOFLINE = dataclasses.replace(
    _H200_ROOFLINE, memory_bandwidth=2.039e12 * 2.78 / 4.8, vector_flops_per_s=19.5e12,
    source="the H200's measured fractions applied to the A100 SXM datasheet (assumed)")


def _tpu_roofline(hbm: float, bf16: float) -> Roofline:
    """A TPU's roofline: HBM bandwidth from its page (cloud.google.com/tpu/docs) at the
    fraction the H200 reached of its own, matmuls at 0.7 of the peak, the vector units at
    an eighth of it (assumptions: no TPU has been measured here)."""
    return Roofline(hbm * 2.78 / 4.8, bf16 / 8, {"*": ((1e12, 0.7),)},
                    attention_efficiency=0.5, launch_s=2e-6, program_s=50e-6, fusion="gpu",
                    source="TPU page's HBM bandwidth and peak; fractions assumed")


BACKENDS: dict[str, BackendFigures] = {
    "cpu": BackendFigures(
        "cpu", CPU_FLOPS, (), CPU_MEMORY, CPU_ALPHA, CPU_BETA, CPU_ALPHA, CPU_BETA, None,
        native_reduce_scatter=False,
        source="rhino's simulated CPU devices: one host, shared-memory collectives"),
    "h100": BackendFigures(
        "h100", _dense(989), _H100_RATES, 80 * GB, _ALPHA_INTRA, 1 / (450 * GB),
        _ALPHA_INTER, 1 / (50 * GB), 8,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5); NVIDIA DGX H100 user guide",
        roofline=_H100_ROOFLINE),
    # NVIDIA H200 SXM 141GB, "NVIDIA H200 Tensor Core GPU" datasheet: the H100's compute
    # figures (TF32 989 TF*, BF16/FP16 1,979 TF*, FP8 3,958 TF*, FP64 Tensor 67 TF), 141 GB
    # HBM3e, NVLink 900 GB/s; DGX H200: 8 ConnectX-7 400 Gb/s compute NICs per node.
    "h200": BackendFigures(
        "h200", _dense(989), _H100_RATES, 141 * GB, _ALPHA_INTRA, 1 / (450 * GB),
        _ALPHA_INTER, 1 / (50 * GB), 8,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM); NVIDIA DGX H200 user guide",
        roofline=_H200_ROOFLINE),
    # NVIDIA A100 SXM4 80GB, "NVIDIA A100 Tensor Core GPU" datasheet: FP64 Tensor 19.5 TF,
    # TF32 312 TF*, BF16/FP16 624 TF*, 80 GB HBM2e (the 40 GB part: see _variant), NVLink
    # 600 GB/s (300 GB/s each way); DGX A100: 8 GPUs, 8 ConnectX-6 200 Gb/s (25 GB/s/GPU).
    "a100": BackendFigures(
        "a100", _dense(312), {"bf16": _dense(624), "f16": _dense(624), "f64": 19.5e12},
        80 * GB, _ALPHA_INTRA, 1 / (300 * GB), _ALPHA_INTER, 1 / (25 * GB), 8,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4); NVIDIA DGX A100 user guide",
        roofline=_A100_ROOFLINE),
    # Cloud TPU v4 (cloud.google.com/tpu/docs/v4): 275 TFLOPS bf16 per chip, 32 GiB HBM2
    # at 1,200 GB/s;
    # ICI: "all-reduce bandwidth per Pod 1.1 PB/s" over 4096 chips = 268.6 GB/s per chip.
    # Its DCN figure is not published there: v5p's 50 Gb/s per chip is assumed.
    "tpu-v4": BackendFigures(
        "tpu-v4", 275e12, {"bf16": 275e12}, 32 * GIB, _ALPHA_INTRA, 4096 / 1.1e15,
        _ALPHA_INTER, 1 / 6.25e9, None,
        source="cloud.google.com/tpu/docs/v4 (DCN assumed as v5p's)",
        roofline=_tpu_roofline(1.2e12, 275e12)),
    # Cloud TPU v5e (cloud.google.com/tpu/docs/v5e): 197 TFLOPS bf16, 16 GB HBM2 at
    # 819 GB/s, ICI
    # 1,600 Gb/s = 200 GB/s per chip each way (400 GB/s bidirectional; all-reduce
    # 51.2 TB/s over 256 chips agrees), DCN 2 × 100 Gb/s NICs per host of 8 chips.
    "tpu-v5e": BackendFigures(
        "tpu-v5e", 197e12, {"bf16": 197e12}, 16 * GB, _ALPHA_INTRA, 1 / (200 * GB),
        _ALPHA_INTER, 8 / 25e9, None,
        source="cloud.google.com/tpu/docs/v5e", roofline=_tpu_roofline(819e9, 197e12)),
    # Cloud TPU v5p (cloud.google.com/tpu/docs/v5p): 459 TFLOPS bf16, 95 GiB HBM2e at
    # 2,765 GB/s, ICI
    # 1,200 GB/s bidirectional (4,800 Gb/s = 600 GB/s each way), DCN 50 Gb/s per chip.
    "tpu-v5p": BackendFigures(
        "tpu-v5p", 459e12, {"bf16": 459e12}, 95 * GIB, _ALPHA_INTRA, 1 / (600 * GB),
        _ALPHA_INTER, 1 / 6.25e9, None,
        source="cloud.google.com/tpu/docs/v5p", roofline=_tpu_roofline(2.765e12, 459e12)),
}

# (platform, substring of device_kind) -> figures, first match wins.
_DEVICE_KINDS = (
    ("gpu", "h200", "h200"), ("gpu", "h100", "h100"), ("gpu", "a100", "a100"),
    ("tpu", "v4", "tpu-v4"), ("tpu", "v5 lite", "tpu-v5e"), ("tpu", "v5e", "tpu-v5e"),
    ("tpu", "v5p", "tpu-v5p"), ("tpu", "v5", "tpu-v5p"),
)


def backend_names() -> tuple[str, ...]:
    """The names of the built-in figures."""
    return tuple(BACKENDS)


def backend_figures(name: str) -> BackendFigures:
    """The built-in figures called ``name`` (``cpu``, ``h100``, ``h200``, ``a100``,
    ``tpu-v4``, ``tpu-v5e``, ``tpu-v5p``; case and ``_`` / ``-`` do not matter).

    Raises:
        OptionsError: an unknown name.
    """
    key = str(name).strip().lower().replace("_", "-")
    key = {"tpuv4": "tpu-v4", "v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p"}.get(key, key)
    if key not in BACKENDS:
        raise OptionsError(f"backend: expected one of {', '.join(BACKENDS)}, found {name!r}")
    return BACKENDS[key]


def _variant(fig: BackendFigures, kind: str) -> BackendFigures:
    if fig.backend == "a100" and "40gb" in kind.replace(" ", "").lower():
        return dataclasses.replace(fig, memory_bytes=40 * GB)
    return fig


def figures_for_devices(devices: Sequence[Any]) -> BackendFigures:
    """The figures of ``devices`` (``jax.Device``-like: ``platform``, ``device_kind``).

    CPU devices get the simulated-CPU figures. An accelerator without built-in figures gets
    them too, with its platform's ``native_reduce_scatter`` and a warning.

    Raises:
        OptionsError: no devices, or devices of several kinds.
    """
    devices = list(devices)
    if not devices:
        raise OptionsError("cost model: expected at least one device, found none")
    kinds = {(str(d.platform).lower(), str(getattr(d, "device_kind", ""))) for d in devices}
    if len(kinds) > 1:
        raise OptionsError(f"cost model: expected devices of one kind, found "
                           f"{sorted(kinds)}; pass cost=... for a mixed set")
    platform, kind = kinds.pop()
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if platform == "cpu":
        return BACKENDS["cpu"]
    low = kind.lower()
    for plat, part, name in _DEVICE_KINDS:
        if platform == plat and part in low:
            return _variant(BACKENDS[name], kind)
    warnings.warn(f"rhino: no built-in figures for {platform} device kind {kind!r} (built-in: "
                  f"{', '.join(BACKENDS)}); planning with the simulated-CPU figures. Pass "
                  f"cost=... (e.g. rhino.calibrate.calibrate_cost_model) for real ones",
                  stacklevel=2)
    return dataclasses.replace(BACKENDS["cpu"], backend=f"unknown-{platform}",
                               native_reduce_scatter=True,
                               source=f"simulated-CPU figures for {kind!r}")


def devices_per_host(devices: Sequence[Any]) -> int | None:
    """Devices per host among ``devices`` (grouped by ``process_index``; by
    ``slice_index`` on TPU, whose ICI spans the hosts of a slice); None when one host
    holds them all."""
    devices = list(devices)
    tpu = bool(devices) and str(devices[0].platform).lower() == "tpu"
    key = (lambda d: getattr(d, "slice_index", 0)) if tpu else \
        (lambda d: getattr(d, "process_index", 0))
    counts = collections.Counter(key(d) for d in devices)
    if len(counts) <= 1:
        return None
    return max(counts.values())


def cost_model_for_devices(devices: Sequence[Any], mesh: AbstractMesh | Sequence[int],
                           **overrides: Any) -> CostModel:
    """The cost model of ``mesh`` laid over ``devices`` (in order, row-major): their
    figures (``figures_for_devices``) and hosts (``devices_per_host``).

    Example:
        >>> import jax
        >>> cost_model_for_devices(jax.devices()[:1], (1,)).backend
        'cpu'
    """
    return figures_for_devices(devices).cost_model(mesh, devices_per_host(devices),
                                                   **overrides)
