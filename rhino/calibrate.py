"""Measure what the devices at hand achieve: a ``CostModel`` with its roofline figures.

The planner is pure and takes an ``AbstractMesh`` and a ``CostModel``; this module is the
bridge from real devices to the latter (``rhino.backends`` has published and recorded
figures instead). ``calibrate_cost_model(mesh_shape)`` measures, with *every device of the
mesh working at once* (one ``shard_map`` program over all of them, so that devices sharing
hardware are measured sharing it):

* matmul FLOP/s per device by size and dtype (``n×n @ n×n`` per device, float32 and
  bfloat16): the efficiency curve of ``Roofline.matmul_efficiency``, as a fraction of the
  dtype's peak (an accelerator's datasheet peak from ``rhino.backends``; on CPU, which has
  none, the best rate measured, so its curve tops out at 1); and 3×3 convolutions
  (forward and weight gradient) by size, their own curve (``conv:f32``);
* memory bandwidth (``x + 1`` over an array per device: bytes read + written), by size:
  the largest array, much larger than the caches, gives the streaming figure; smaller ones
  the curve of ``Roofline.bandwidth_by_size`` (on CPU a kernel whose data fit in the
  caches moves them several times faster);
* vector FLOP/s (a fused chain of multiply-adds on every device) and transcendental
  elements per second (a fused chain of ``tanh``);
* on accelerators, the efficiency of cuDNN's fused attention (forward and backward);
* the launch cost of one kernel (the slope of a program of K dependent tiny matmuls over K)
  and the latency of one program (a one-element-per-device program, dispatch to result);
* collectives: for each kind (all-reduce, all-gather, reduce-scatter, all-to-all) and each
  group size that divides the mesh, all groups at once, in the planner's own formulas
  (``rhino.planner.collectives``): α from a chain of dependent collectives on a few bytes
  (what one more adds), β the slope over several sizes, and the time by size (a CPU's
  all-reduce of 32 MiB per device takes eight times the time per byte of 4 MiB); per link (``intra``: a group
  within one process/host; ``inter``: groups spanning processes, measured when the devices
  span several).

The per-axis α and β of the cost model are those of an all-reduce over that axis' group
size and link.

On the simulated CPU mesh (``--xla_force_host_platform_device_count=8`` on a 2-core
machine) this is what captures the hardware: the 8 devices share 2 cores, so each device's
matmul and elementwise rates measured together are about an eighth of what the machine
does for one device alone, a program over the 8 devices costs ~0.1 ms to dispatch, and a
collective is a rendezvous of 8 threads plus memory copies whose α and β per group size
come out of the fit. A plan priced with these figures predicts this machine; the same
calibration on a GPU cluster predicts that cluster.

Example:
    >>> from rhino.calibrate import calibrate_cost_model, measure_memory_bandwidth
    >>> cost = calibrate_cost_model((2, 4))             # doctest: +SKIP
    >>> cost.roofline.summary()                         # doctest: +SKIP
    >>> measure_memory_bandwidth(nbytes=1 << 20, reps=2) > 0
    True
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from rhino.backends import BACKENDS, BackendFigures, figures_for_devices
from rhino.planner.cost_model import CostModel
from rhino.planner.roofline import COLLECTIVE_KINDS, Roofline

_HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclasses.dataclass(frozen=True)
class CalibrationSizes:
    """What the calibration measures (sizes are per device).

    Attributes:
        matmul_n: sizes ``n`` of the ``n×n`` matmuls.
        dtypes: their dtypes (``float32``, ``bfloat16``).
        bandwidth_bytes: the streamed arrays, smallest to largest (the largest, much larger
            than the caches, gives ``memory_bandwidth``; all of them the curve by size).
        vector_elements: the array of the multiply-add and ``tanh`` chains.
        launch_kernels: K, the matmuls in the launch program.
        collective_bytes: per-device sizes of each collective.
        collective_kinds: the kinds measured.
        conv_shapes: ``(batch, size, channels)`` of the 3×3 convolutions measured (in the
            first dtype; none: convolutions run at the matmul curve).
        attention: ``(batch, sequence, heads, head dim)`` of the cuDNN attention measured
            on accelerators (None: the figures' attention efficiency is kept).
        statistic: ``median`` (default) or ``min`` of each measurement's timed runs:
            ``min`` measures the machine as it is without the other work it shares its
            cores with (a launch and a collective's latency, differences of two programs,
            always use the fastest runs).
        reps: timed runs per measurement (the median is kept).
    """

    matmul_n: tuple[int, ...] = (64, 128, 256, 512, 1024)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    bandwidth_bytes: tuple[int, ...] = (1 << 18, 1 << 22, 1 << 25)
    vector_elements: int = 1 << 18
    launch_kernels: int = 128
    collective_bytes: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24,
                                         1 << 25)
    collective_kinds: tuple[str, ...] = COLLECTIVE_KINDS
    conv_shapes: tuple[tuple[int, int, int], ...] = ((2, 32, 8), (2, 16, 32), (8, 32, 16),
                                                      (8, 32, 32), (8, 16, 64), (8, 8, 128))
    attention: tuple[int, int, int, int] | None = None
    reps: int = 7
    statistic: str = "median"

    @classmethod
    def for_platform(cls, platform: str) -> "CalibrationSizes":
        """Sizes for a CPU (the default) or an accelerator (larger: their caches and
        rates are larger)."""
        if platform == "cpu":
            return cls()
        return cls(matmul_n=(256, 512, 1024, 2048, 4096, 8192),
                   bandwidth_bytes=(1 << 24, 1 << 27, 1 << 30),
                   vector_elements=1 << 26, launch_kernels=256,
                   collective_bytes=(1 << 12, 1 << 20, 1 << 24, 1 << 26),
                   conv_shapes=((32, 64, 64), (32, 32, 128), (32, 16, 256), (32, 8, 512)),
                   attention=(4, 2048, 16, 128), reps=10)

    @classmethod
    def quick(cls) -> "CalibrationSizes":
        """Small sizes and few runs: a check that calibration works, not figures."""
        return cls(matmul_n=(32, 64), dtypes=("float32",), bandwidth_bytes=(1 << 18,),
                   vector_elements=1 << 12, launch_kernels=16,
                   collective_bytes=(1 << 10, 1 << 14), collective_kinds=("all-reduce",),
                   conv_shapes=((2, 8, 8),), reps=2)


# ------------------------------------------------------------------------------ timing
def _times(fn: Callable, arg: Any, reps: int) -> list[float]:
    fn(arg).block_until_ready()  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(arg).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times


def _median_time(fn: Callable, arg: Any, reps: int, stat: str = "median") -> float:
    """The median of ``reps`` timed runs, or with ``stat="min"`` the fastest (the machine
    without the other work it shares its cores with: see ``CalibrationSizes.statistic``)."""
    ts = _times(fn, arg, reps)
    return float(min(ts) if stat == "min" else np.median(ts))


def _least_time(fn: Callable, arg: Any, reps: int) -> float:
    """The fastest of ``reps`` runs: for a figure taken as the difference of two programs'
    times (a launch, a collective's latency), whose noise — other work on the machine —
    only ever adds, and would not cancel in the difference of medians."""
    return float(min(_times(fn, arg, reps)))


def _net(t: float, overhead: float) -> float:
    """A program's time less its dispatch (``overhead``): what its kernels took (at least
    a tenth of the whole, against noise)."""
    return max(t - overhead, 0.1 * t, 1e-9)


def _mesh(devices: Sequence[Any], shape: tuple[int, ...] | None = None):
    from jax.sharding import Mesh

    shape = shape or (len(devices),)
    names = ("d",) if len(shape) == 1 else ("g", "d")
    return Mesh(np.array(list(devices)).reshape(shape), names)


def _per_device(devices: Sequence[Any], local: Callable, shape: tuple[int, ...], dtype: str
                ) -> tuple[Callable, Any]:
    """``local`` run on every device at once on its own ``shape`` array (a ``shard_map``
    over a 1-D mesh of ``devices``), and the argument to run it on."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = _mesh(devices)
    n = len(devices)
    x = jax.device_put(jnp.ones((n * shape[0],) + tuple(shape[1:]), dtype),
                       NamedSharding(mesh, P("d")))
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    return f, x


def _devices(devices: Sequence[Any] | None) -> list:
    import jax

    return list(devices) if devices is not None else list(jax.devices())


# ------------------------------------------------------------------------------ compute
def measure_matmul_rates(devices: Sequence[Any] | None = None,
                         sizes: Sequence[int] = (256, 512, 1024), dtype: str = "float32",
                         reps: int = 5, overhead: float = 0.0, stat: str = "median"
                         ) -> list[tuple[float, float]]:
    """``(FLOPs, FLOP/s per device)`` of an ``n×n`` matmul on every device at once, for
    each ``n`` in ``sizes`` (``overhead``: seconds of each program that are not the
    matmul's, its dispatch and launch, taken off)."""
    out = []
    for n in sizes:
        f, x = _per_device(_devices(devices), lambda a: a @ a, (n, n), dtype)
        t = _net(_median_time(f, x, reps, stat), overhead)
        out.append((2.0 * n ** 3, 2.0 * n ** 3 / t))
    return out


def measure_flops(device=None, n: int = 1024, reps: int = 5, dtype: str = "float32"
                  ) -> float:
    """FLOP/s of an n×n matmul in ``dtype`` on one device."""
    dev = device if device is not None else _devices(None)[0]
    return measure_matmul_rates([dev], (n,), dtype, reps)[0][1]


def conv_square_flops(batch: int, hw: int, cin: int, cout: int, window: int = 3) -> float:
    """``2·s³`` of a ``window×window`` same-padded convolution's implicit GEMM (M = batch ×
    positions, N = output features, K = window² × input features): the size its efficiency
    is read at (``hlo_passes.fusion.matmul_square_flops``)."""
    m, n, k = batch * hw * hw, cout, window * window * cin
    return 2.0 * (3.0 / (1 / m + 1 / n + 1 / k)) ** 3


def measure_conv_rates(devices: Sequence[Any] | None = None,
                       shapes: Sequence[tuple[int, int, int]] = ((8, 32, 16), (8, 32, 32),
                                                                  (8, 16, 64), (8, 8, 128)),
                       dtype: str = "float32", reps: int = 5, overhead: float = 0.0,
                       stat: str = "median") -> list[tuple[float, float]]:
    """``(square FLOPs, FLOP/s per device)`` of 3×3 convolutions ``(batch, size,
    channels)`` in NHWC on every device at once: the forward convolution and the weight
    gradient's (a training step runs both kinds), their FLOPs over their summed time."""
    import jax
    import jax.numpy as jnp

    dn = ("NHWC", "HWIO", "NHWC")
    out = []
    for b, hw, c in shapes:
        kernel = jnp.ones((3, 3, c, c), dtype)

        def conv(x, k):
            return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn)

        def fwd(v, b=b, hw=hw, c=c, kernel=kernel):
            return conv(v.reshape(b, hw, hw, c), kernel).reshape(-1)

        def wgrad(v, b=b, hw=hw, c=c, kernel=kernel):
            x = v.reshape(b, hw, hw, c)
            g = jax.grad(lambda k: jnp.sum(conv(x, k).astype(jnp.float32)))(kernel)
            return v + jnp.sum(g).astype(v.dtype)

        t = 0.0
        for fn in (fwd, wgrad):
            f, x = _per_device(_devices(devices), fn, (b * hw * hw * c,), dtype)
            t += _net(_median_time(f, x, reps, stat), overhead)
        flops = 2.0 * b * hw * hw * c * c * 9
        out.append((conv_square_flops(b, hw, c, c), 2 * flops / t))
    return out


def measure_memory_bandwidth(device=None, nbytes: int = 1 << 28, reps: int = 5,
                             devices: Sequence[Any] | None = None,
                             overhead: float = 0.0, stat: str = "median") -> float:
    """Bytes per second that one device's memory moves: an elementwise ``x + 1`` over a
    float32 array of ``nbytes`` bytes, which reads it once and writes a new one (2 ×
    ``nbytes`` moved per run); with ``devices``, on each of them at once (per device).

    Args:
        device: the device (default: ``jax.devices()[0]``), when ``devices`` is None.
        nbytes: the array's size in bytes (at least 4); make it much larger than the
            device's caches (the default, 256 MiB, is for accelerators).
        reps: timed runs (the median is kept).
        devices: measure on all of these at once instead.
        overhead: seconds of the program that are not its kernel (taken off).

    Raises:
        ValueError: ``nbytes`` below 4 or ``reps`` below 1.
    """
    if nbytes < 4 or reps < 1:
        raise ValueError(f"measure_memory_bandwidth: expected nbytes >= 4 and reps >= 1, "
                         f"found nbytes={nbytes}, reps={reps}")
    devs = list(devices) if devices is not None else [device or _devices(None)[0]]
    k = nbytes // 4
    f, x = _per_device(devs, lambda v: v + 1, (k,), "float32")
    return 2.0 * k * 4 / _net(_median_time(f, x, reps, stat), overhead)


def measure_vector_rate(devices: Sequence[Any] | None = None, elements: int = 1 << 18,
                        reps: int = 5, steps: int = 32, overhead: float = 0.0,
                        stat: str = "median") -> float:
    """FLOP/s per device of fused elementwise work: ``steps`` multiply-adds per element of
    a float32 array (HLO counts 2 FLOPs each), one kernel, on every device at once."""
    def chain(v):
        for _ in range(steps):
            v = v * 1.0001 + 0.5
        return v

    f, x = _per_device(_devices(devices), chain, (elements,), "float32")
    return 2.0 * steps * elements / _net(_median_time(f, x, reps, stat), overhead)


def measure_transcendental_rate(devices: Sequence[Any] | None = None,
                                elements: int = 1 << 18, reps: int = 5, steps: int = 8,
                                overhead: float = 0.0, stat: str = "median") -> float:
    """Transcendental elements per second per device: ``steps`` chained ``tanh`` per
    element of a float32 array, one kernel, on every device at once."""
    import jax.numpy as jnp

    def chain(v):
        for _ in range(steps):
            v = jnp.tanh(v)
        return v

    f, x = _per_device(_devices(devices), chain, (elements,), "float32")
    return float(steps * elements) / _net(_median_time(f, x, reps, stat), overhead)


def measure_kernel_launch(devices: Sequence[Any] | None = None, kernels: int = 128,
                          reps: int = 9) -> float:
    """Seconds one more kernel adds to a program on every device at once: programs of 1
    and of ``1 + kernels`` dependent 8×8 matmuls (each its own kernel), the difference of
    their fastest runs over ``kernels``."""
    import jax.numpy as jnp

    def program(k: int):
        def body(v):
            w = v.reshape(8, 8)
            m = jnp.transpose(w) * 0.5
            for _ in range(k):
                w = w @ m
            return w.reshape(-1)
        return body

    devs = _devices(devices)
    ts = []
    for k in (1, 1 + kernels):
        f, x = _per_device(devs, program(k), (64,), "float32")
        ts.append(_least_time(f, x, reps))
    return max(0.0, (ts[1] - ts[0]) / kernels)


def measure_launch_latency(device=None, reps: int = 100,
                           devices: Sequence[Any] | None = None, stat: str = "median") -> float:
    """Seconds from calling a compiled one-element program (``x + 1``) to holding its
    result: dispatch, one kernel launch and the wait, the floor under every step; with
    ``devices``, one element on each of them (one program over all).

    Raises:
        ValueError: ``reps`` below 1.
    """
    if reps < 1:
        raise ValueError(f"measure_launch_latency: expected reps >= 1, found {reps}")
    devs = list(devices) if devices is not None else [device or _devices(None)[0]]
    f, x = _per_device(devs, lambda v: v + 1, (1,), "float32")
    return _median_time(f, x, reps, stat)


def measure_attention_efficiency(device=None, shape: tuple[int, int, int, int] = (4, 2048,
                                                                             16, 128),
                                 reps: int = 5, peak: float | None = None) -> float:
    """The fraction of the bf16 peak that causal fused attention (cuDNN's, through
    ``jax.nn.dot_product_attention(implementation="cudnn")``) reaches forward and backward
    at ``shape`` = (batch, sequence, heads, head dim): its matmul FLOPs (forward
    ``2·B·N·T²·2D``, backward ``2·B·N·T²·5D``, halved for the causal mask, as
    ``hlo_passes.custom_calls`` counts them) over the time of one step of both.

    Raises:
        Exception: where cuDNN attention does not run (a CPU, an unsupported shape): the
            caller keeps its figure.
    """
    import jax
    import jax.numpy as jnp

    dev = device if device is not None else _devices(None)[0]
    b, t, h, d = shape

    def step(q):
        def loss(q):
            out = jax.nn.dot_product_attention(q, q, q, is_causal=True,
                                               implementation="cudnn")
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss)(q)

    q = jax.device_put(jnp.ones((b, t, h, d), jnp.bfloat16) * 0.01, dev)
    secs = _median_time(jax.jit(step), q, reps)
    flops = 2.0 * b * h * t * t * (2 * d + 5 * d) / 2
    if peak is None:
        peak = figures_for_devices([dev]).cost_model((1,)).flops_for("bf16")
    return flops / (secs * peak)


# ------------------------------------------------------------------------------ collectives
def fit_alpha_beta(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = α + x·β`` with α, β >= 0 (a negative fit, from noise, is
    refitted with that coefficient at 0).

    Example:
        >>> fit_alpha_beta([0.0, 1e6, 2e6], [1e-5, 1e-5 + 1e-3, 1e-5 + 2e-3])
        (1e-05, 1e-09)
    """
    x, t = np.asarray(xs, float), np.asarray(ts, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return float(max(np.mean(t), 0.0)), 0.0
    A = np.stack([np.ones(len(x)), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(A, t, rcond=None)
    if beta < 0:
        return float(max(np.mean(t), 0.0)), 0.0
    if alpha < 0:
        beta = float(np.dot(x, t) / np.dot(x, x))
        return 0.0, max(beta, 0.0)
    return float(round(alpha, 15)), float(round(beta, 18))


def _slope(xs: Sequence[float], ts: Sequence[float]) -> float:
    """The least-squares slope of ``ts`` over ``xs`` (intercept free), at least 0."""
    x, t = np.asarray(xs, float), np.asarray(ts, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return 0.0
    return float(max(np.polyfit(x, t, 1)[0], 0.0))


def _wire(kind: str, n: int) -> float:
    """The planner's bandwidth factor of a collective over ``n`` devices."""
    frac = (n - 1) / n
    return 2.0 * frac if kind == "all-reduce" else frac


def _collective_program(kind: str, mesh, axis: str, chain: int = 1):
    """A program of ``chain`` dependent ``kind`` collectives over ``axis`` (each result
    made to differ across devices again, so that XLA cannot fold a collective of a
    replicated value)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    group = mesh.shape[axis]

    def once(x):
        if kind == "all-reduce":
            return jax.lax.psum(x, axis)
        if kind == "all-gather":
            return jax.lax.all_gather(x, axis, tiled=True)
        if kind == "reduce-scatter":
            return jax.lax.psum_scatter(x, axis, tiled=True)
        return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)

    def body(x):
        if chain == 1:
            return once(x)
        k = x.shape[0]
        for _ in range(chain):
            y = once(x)
            if kind == "all-gather":
                y = y[:k]
            elif kind == "reduce-scatter":
                y = jnp.tile(y, group)
            x = y.at[0].add(jax.lax.axis_index(axis).astype(y.dtype))
        return x

    spec = P(mesh.axis_names)
    single_gather = kind == "all-gather" and chain == 1
    out = P(tuple(a for a in mesh.axis_names if a != axis)) if single_gather else spec
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out,
                                 check_vma=False))


def measure_collective(kind: str, group: int, devices: Sequence[Any] | None = None,
                       sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20), reps: int = 5,
                       strided: bool = False, chain: int = 16, stat: str = "median"
                       ) -> tuple[float, float, tuple[tuple[float, float], ...]]:
    """(α, β, curve) of a ``kind`` collective over groups of ``group`` devices, all groups
    at once, in the planner's formula ``α + c·(n-1)/n·B·β`` (``c`` 2 for an all-reduce,
    ``B`` in the planner's byte convention): α from a program of ``chain`` dependent
    collectives on a few bytes against one of a single one (the difference of their fastest
    runs over ``chain - 1``: no dispatch in it), β the slope of single collectives' times
    over ``sizes`` bytes per device (least squares; the intercept, dispatch and α, is not
    used), and the curve: per size, its formula bytes ``x`` and its time past that of the
    same program on a few bytes (``Roofline.collective_curves``: the time per byte grows
    for large buffers).

    Groups are consecutive devices, or with ``strided`` every ``len/group``-th device (the
    groups that cross hosts when the devices span several).

    Raises:
        ValueError: ``group`` does not divide the devices, or an unknown kind.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    devs = _devices(devices)
    n = len(devs)
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"measure_collective: expected a kind in {COLLECTIVE_KINDS}, found "
                         f"{kind!r}")
    if group < 2 or n % group:
        raise ValueError(f"measure_collective: expected a group size >= 2 dividing "
                         f"{n} devices, found {group}")
    shape = (group, n // group) if strided else (n // group, group)
    mesh = _mesh(devs, shape)
    axis = "g" if strided else "d"
    sharding = NamedSharding(mesh, P(mesh.axis_names))

    def arg(nbytes: int):
        k = max(group, (nbytes // 4) // group * group)    # divisible for scatters
        return k, jax.device_put(jnp.ones((n * k,), jnp.float32), sharding)

    _, tiny = arg(256 * group)
    f = _collective_program(kind, mesh, axis)
    one = _least_time(f, tiny, max(reps, 5))
    many = _least_time(_collective_program(kind, mesh, axis, chain), tiny, max(reps, 5))
    alpha = max(0.0, (many - one) / max(chain - 1, 1))
    base = _median_time(f, tiny, reps, stat)
    xs, ts = [], []
    for nbytes in sizes:
        k, x = arg(nbytes)
        ts.append(_median_time(f, x, reps, stat))
        b = k * 4 * (group if kind == "all-gather" else 1)   # all-gather: the result
        xs.append(_wire(kind, group) * b)
    curve, top = [], 0.0
    for x, t in sorted(zip(xs, ts)):
        top = max(top, t - base)                 # time only grows with size
        curve.append((x, top))
    return float(alpha), _slope(xs, ts), tuple(curve)
def _processes(devices: Sequence[Any]) -> int:
    return len({getattr(d, "process_index", 0) for d in devices})


def measure_collectives(devices: Sequence[Any] | None = None,
                        sizes: CalibrationSizes = CalibrationSizes()
                        ) -> tuple[tuple, tuple]:
    """``(link, kind, group size, α, β)`` entries and ``(link, kind, group size, curve)``
    curves (``measure_collective``) of every kind in ``sizes.collective_kinds`` and every
    group size >= 2 dividing the devices: ``intra`` over consecutive devices of one
    process, ``inter`` over strided groups when the devices span several processes."""
    devs = _devices(devices)
    n = len(devs)
    hosts = _processes(devs)
    per_host = n // hosts if hosts and n % hosts == 0 else n
    out, curves = [], []
    for g in range(2, n + 1):
        if n % g:
            continue
        links = []
        if hosts == 1 or per_host % g == 0:
            links.append(("intra", False))
        if hosts > 1 and g <= hosts:
            links.append(("inter", True))
        for link, strided in links:
            for kind in sizes.collective_kinds:
                a, b, curve = measure_collective(kind, g, devs, sizes.collective_bytes,
                                                 sizes.reps, strided, stat=sizes.statistic)
                out.append((link, kind, g, a, b))
                curves.append((link, kind, g, curve))
    return tuple(out), tuple(curves)


def measure_axis(mesh_shape: Sequence[int], axis: int, devices=None,
                 sizes: Sequence[int] = (1 << 10, 1 << 16, 1 << 20), reps: int = 5
                 ) -> tuple[float, float]:
    """(α, β) of one mesh axis, fitted to timed all-reduces of ``sizes`` bytes per device
    over that axis (all its groups at once)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    shape = tuple(mesh_shape)
    ndev = int(np.prod(shape))
    devices = list(devices if devices is not None else jax.devices()[:ndev])
    if len(devices) < ndev:
        raise ValueError(f"calibration needs {ndev} devices for mesh {shape}, found "
                         f"{len(devices)}")
    names = tuple(f"a{i}" for i in range(len(shape)))
    mesh = Mesh(np.array(devices[:ndev]).reshape(shape), names)
    n = shape[axis]
    if n == 1:
        return 0.0, 0.0
    spec = P(names)
    f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, names[axis]), mesh=mesh,
                              in_specs=spec, out_specs=spec))
    xs, ts = [], []
    for nbytes in sizes:
        k = max(1, nbytes // 4)
        x = jax.device_put(jnp.ones((ndev * k,), jnp.float32), NamedSharding(mesh, spec))
        ts.append(_median_time(f, x, reps))
        xs.append(_wire("all-reduce", n) * k * 4)
    alpha, beta = fit_alpha_beta(xs, ts)
    return alpha, max(beta, 1e-15)


# ------------------------------------------------------------------------------ the model
def calibrate_roofline(devices: Sequence[Any] | None = None,
                       sizes: CalibrationSizes | None = None,
                       peaks: dict[str, float] | None = None,
                       progress: Callable[[str], None] | None = None
                       ) -> tuple[Roofline, dict[str, float]]:
    """The ``Roofline`` of ``devices`` working at once (module docstring), and the peak
    FLOP/s per HLO dtype its matmul efficiencies are fractions of.

    Args:
        devices: the devices (default: all of ``jax.devices()``).
        sizes: what to measure (default: ``CalibrationSizes.for_platform``).
        peaks: peak FLOP/s per HLO dtype (``f32``, ``bf16``); default: the devices'
            built-in figures on accelerators, the best measured rate on CPU.
        progress: called with a line per measurement.
    """
    devs = _devices(devices)
    say = progress or (lambda msg: None)
    platform = str(devs[0].platform).lower()
    sizes = sizes or CalibrationSizes.for_platform(platform)
    figures = figures_for_devices(devs)
    say("calibrate: program dispatch and kernel launch")
    st = sizes.statistic
    program = measure_launch_latency(reps=max(3 * sizes.reps, 20), devices=devs, stat=st)
    launch = measure_kernel_launch(devs, sizes.launch_kernels, max(sizes.reps, 9))
    over = program + launch
    measured: dict[str, list[tuple[float, float]]] = {}
    for dt in sizes.dtypes:
        say(f"calibrate: {dt} matmuls {list(sizes.matmul_n)}")
        measured[_HLO_DTYPE.get(dt, dt)] = measure_matmul_rates(devs, sizes.matmul_n, dt,
                                                                sizes.reps, over, st)
    peak_of = dict(peaks or {})
    for dt, pts in measured.items():
        if dt not in peak_of:
            fig = figures.cost_model((1,)).flops_for(dt)
            peak_of[dt] = max(r for _, r in pts) if platform == "cpu" else fig
    eff = {dt: tuple((f, min(1.5, r / peak_of[dt])) for f, r in pts)
           for dt, pts in measured.items()}
    if sizes.conv_shapes:
        say(f"calibrate: convolutions {list(sizes.conv_shapes)}")
        dt = sizes.dtypes[0]
        conv = measure_conv_rates(devs, sizes.conv_shapes, dt, sizes.reps, over, st)
        hlo = _HLO_DTYPE.get(dt, dt)
        eff[f"conv:{hlo}"] = tuple((f, min(1.5, r / peak_of[hlo])) for f, r in conv)
    say("calibrate: bandwidth, vector and transcendental rates")
    curve = tuple((2.0 * nb, measure_memory_bandwidth(nbytes=nb, reps=sizes.reps,
                                                      devices=devs, overhead=over, stat=st))
                  for nb in sorted(sizes.bandwidth_bytes))
    bw = curve[-1][1]
    vec = measure_vector_rate(devs, sizes.vector_elements, sizes.reps, overhead=over, stat=st)
    trans = measure_transcendental_rate(devs, sizes.vector_elements, sizes.reps,
                                        overhead=over, stat=st)
    colls: tuple = ()
    curves: tuple = ()
    if len(devs) > 1:
        say(f"calibrate: collectives {list(sizes.collective_kinds)} over groups of the "
            f"{len(devs)} devices")
        colls, curves = measure_collectives(devs, sizes)
    base = figures.roofline
    attention = base.attention_efficiency if base else 1.0
    if platform != "cpu" and sizes.attention is not None:
        say(f"calibrate: cuDNN attention {sizes.attention}")
        try:
            attention = min(1.5, measure_attention_efficiency(devs[0], sizes.attention,
                                                              sizes.reps,
                                                              peak_of.get("bf16")))
        except Exception as e:  # noqa: BLE001 - no cuDNN attention here: keep the figure
            say(f"calibrate: no cuDNN attention ({type(e).__name__}: {str(e)[:200]}); "
                f"keeping {attention}")
    roof = Roofline(
        bw, vec, eff,
        attention_efficiency=attention,
        launch_s=launch, program_s=program, collectives=colls,
        fusion="cpu" if platform == "cpu" else "gpu",
        transcendentals_per_s=trans if platform == "cpu" else None,
        bandwidth_by_size=curve if len(curve) > 1 else (), collective_curves=curves,
        source=f"rhino.calibrate on {len(devs)} {platform} device(s) "
               f"({getattr(devs[0], 'device_kind', platform)}), "
               f"{time.strftime('%Y-%m-%d')}")
    return roof, peak_of


def figures_from_roofline(roofline: Roofline, peaks: dict[str, float], backend: str,
                          base: BackendFigures | None = None,
                          devices_per_host: int | None = None) -> BackendFigures:
    """Measured figures as ``BackendFigures`` (for a ``Cluster``): the peaks, the roofline,
    α and β within and across hosts from the all-reduce over the most devices measured on
    each link (the roofline's per-size figures price the planner's collectives anyway);
    memory and the partitioner's facts from ``base`` (default: the simulated CPU's)."""
    base = base or BACKENDS["cpu"]

    def link(name: str, default: tuple[float, float]) -> tuple[float, float]:
        sizes = [n for lk, k, n, _, _ in roofline.collectives
                 if lk == name and k == "all-reduce"]
        return roofline.collective(name, "all-reduce", max(sizes)) if sizes else default

    intra = link("intra", (base.alpha_intra, base.beta_intra))
    inter = link("inter", intra)
    rates = dict(base.dtype_flops_per_s)
    rates.update({k: v for k, v in peaks.items() if k != "f32"})
    return BackendFigures(backend, peaks.get("f32", base.flops_per_s), rates,
                          base.memory_bytes, intra[0], intra[1], inter[0], inter[1],
                          devices_per_host, base.native_reduce_scatter,
                          source=roofline.source, roofline=roofline)


def cost_model_from_roofline(roofline: Roofline, peaks: dict[str, float],
                             mesh_shape: Sequence[int], backend: str = "calibrated-cpu",
                             base: BackendFigures | None = None,
                             devices_per_host: int | None = None,
                             memory_bytes: int | None = None) -> CostModel:
    """The ``CostModel`` of ``mesh_shape`` from measured figures: each axis' α and β
    those of an all-reduce over its group size on its link (``intra`` unless its groups
    cross hosts), else ``figures_from_roofline``'s."""
    from rhino.backends import inter_host_axes

    shape = tuple(int(s) for s in mesh_shape)
    fig = figures_from_roofline(roofline, peaks, backend, base, devices_per_host)
    inter = inter_host_axes(shape, devices_per_host)
    alphas, betas = [], []
    for axis, size in enumerate(shape):
        link = "inter" if inter[axis] else "intra"
        got = roofline.collective(link, "all-reduce", size) if size > 1 else None
        if got is None:
            got = (fig.alpha_inter, fig.beta_inter) if inter[axis] else \
                (fig.alpha_intra, fig.beta_intra)
        alphas.append(got[0])
        betas.append(got[1])
    cost = fig.cost_model(shape, devices_per_host, alpha=tuple(alphas), beta=tuple(betas))
    if memory_bytes is not None:
        cost = dataclasses.replace(cost, memory_bytes=memory_bytes)
    return cost


def calibrate_cost_model(mesh_shape: Sequence[int], devices=None, reps: int | None = None,
                         sizes: CalibrationSizes | None = None,
                         progress: Callable[[str], None] | None = None) -> CostModel:
    """A ``CostModel`` of ``mesh_shape`` over local devices with measured figures (module
    docstring): the roofline of the mesh's devices working at once, each axis' α and β
    from an all-reduce over its group size and link, the peak FLOP/s per dtype
    (``calibrate_roofline``), memory from the device's ``bytes_limit``, else the devices'
    built-in figures (``rhino.backends``).

    Args:
        mesh_shape: the mesh, laid row-major over ``devices``.
        devices: the devices (default: the first ``prod(mesh_shape)`` of ``jax.devices()``).
        reps: timed repetitions per measurement (default: the sizes').
        sizes: what to measure (default: ``CalibrationSizes.for_platform``).
        progress: called with a line per measurement.

    Raises:
        ValueError: fewer devices than the mesh has.
    """
    import jax

    shape = tuple(int(s) for s in mesh_shape)
    ndev = math.prod(shape)
    devices = list(devices if devices is not None else jax.devices()[:ndev])[:ndev]
    if len(devices) < ndev:
        raise ValueError(f"calibration needs {ndev} devices for mesh {shape}, found "
                         f"{len(devices)}")
    platform = str(devices[0].platform).lower()
    sizes = sizes or CalibrationSizes.for_platform(platform)
    if reps is not None:
        sizes = dataclasses.replace(sizes, reps=reps)
    roof, peaks = calibrate_roofline(devices, sizes, progress=progress)
    figures = figures_for_devices(devices)
    hosts = _processes(devices)
    mem = None
    stats = getattr(devices[0], "memory_stats", lambda: None)()
    if stats and stats.get("bytes_limit"):
        mem = int(stats["bytes_limit"])
    return cost_model_from_roofline(roof, peaks, shape, f"calibrated-{figures.backend}",
                                    figures, ndev // hosts if hosts > 1 else None, mem)
