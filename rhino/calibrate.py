"""Measure a mesh's cost model (α, β per axis, FLOP/s, memory) on the devices at hand.

The planner is pure and takes an ``AbstractMesh`` and a ``CostModel``; this module is the
bridge from real devices to the latter (``rhino.backends`` has published figures instead).
For each mesh axis it times all-reduces of several sizes over that axis and fits the
planner's own all-reduce model ``t = α + 2 (n-1)/n · B · β`` by least squares; FLOP/s
comes from timed float32 and bfloat16 matmuls on one device. Two figures the planner does not
use are measured too, for comparing devices (``benchmarks/gpu_check.py``): device memory
bandwidth (an elementwise pass over a large array) and launch latency (a one-element
program, dispatch to result).

Example:
    >>> from rhino.calibrate import calibrate_cost_model, measure_memory_bandwidth
    >>> cost = calibrate_cost_model((2, 4))          # doctest: +SKIP
    >>> cost.alpha, cost.beta, cost.flops_for("bf16")  # doctest: +SKIP
    >>> measure_memory_bandwidth(nbytes=1 << 20, reps=2) > 0
    True
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from rhino.backends import figures_for_devices
from rhino.planner.cost_model import CostModel


def _median_time(fn, arg, reps: int) -> float:
    fn(arg).block_until_ready()  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(arg).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_flops(device=None, n: int = 1024, reps: int = 5, dtype: str = "float32"
                  ) -> float:
    """FLOP/s of an n×n matmul in ``dtype`` on one device."""
    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    t = _median_time(jax.jit(lambda x: x @ x), a, reps)
    return 2.0 * n ** 3 / max(t, 1e-9)


def measure_memory_bandwidth(device=None, nbytes: int = 1 << 28, reps: int = 5) -> float:
    """Bytes per second that one device's memory moves: an elementwise ``x + 1`` over a
    float32 array of ``nbytes`` bytes, which reads it once and writes a new one (2 ×
    ``nbytes`` moved per run).

    Args:
        device: the device (default: ``jax.devices()[0]``).
        nbytes: the array's size in bytes (at least 4); make it much larger than the
            device's caches (the default, 256 MiB, is for accelerators).
        reps: timed runs (the median is kept).

    Raises:
        ValueError: ``nbytes`` below 4 or ``reps`` below 1.
    """
    import jax
    import jax.numpy as jnp

    if nbytes < 4 or reps < 1:
        raise ValueError(f"measure_memory_bandwidth: expected nbytes >= 4 and reps >= 1, "
                         f"found nbytes={nbytes}, reps={reps}")
    device = device or jax.devices()[0]
    x = jax.device_put(jnp.zeros((nbytes // 4,), jnp.float32), device)
    t = _median_time(jax.jit(lambda v: v + 1), x, reps)
    return 2.0 * (nbytes // 4) * 4 / max(t, 1e-9)


def measure_launch_latency(device=None, reps: int = 100) -> float:
    """Seconds from calling a compiled one-element program (``x + 1``) to holding its
    result: dispatch, one kernel launch and the wait, the floor under every step.

    Raises:
        ValueError: ``reps`` below 1.
    """
    import jax
    import jax.numpy as jnp

    if reps < 1:
        raise ValueError(f"measure_launch_latency: expected reps >= 1, found {reps}")
    device = device or jax.devices()[0]
    x = jax.device_put(jnp.zeros((1,), jnp.float32), device)
    return _median_time(jax.jit(lambda v: v + 1), x, reps)


def measure_axis(mesh_shape: Sequence[int], axis: int, devices=None,
                 sizes: Sequence[int] = (1 << 10, 1 << 16, 1 << 20), reps: int = 5
                 ) -> tuple[float, float]:
    """(α, β) of one mesh axis, fitted to timed all-reduces of ``sizes`` bytes per device."""
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
    mesh = Mesh(np.array(devices).reshape(shape), names)
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
        xs.append(2.0 * (n - 1) / n * k * 4)
    A = np.stack([np.ones(len(xs)), np.array(xs)], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(A, np.array(ts), rcond=None)
    # Noise can push a coefficient negative; the model needs both non-negative.
    beta = max(float(beta), 1e-15)
    alpha = max(float(alpha), 0.0)
    return alpha, beta


def calibrate_cost_model(mesh_shape: Sequence[int], devices=None, reps: int = 5) -> CostModel:
    """A ``CostModel`` of ``mesh_shape`` over local devices, its α, β and FLOP/s (float32,
    and bfloat16 on accelerators) measured; memory from the device's ``bytes_limit``, else
    the devices' built-in figures (``rhino.backends``).

    Args:
        mesh_shape: the mesh, laid row-major over ``devices``.
        devices: the devices (default: the first ``prod(mesh_shape)`` of ``jax.devices()``).
        reps: timed repetitions per measurement (the median is kept).
    """
    import jax

    shape = tuple(mesh_shape)
    ndev = int(np.prod(shape))
    devices = list(devices if devices is not None else jax.devices()[:ndev])
    alphas, betas = [], []
    for axis in range(len(shape)):
        a, b = measure_axis(shape, axis, devices, reps=reps)
        alphas.append(a)
        betas.append(b)
    mem = None
    stats = getattr(devices[0], "memory_stats", lambda: None)()
    if stats and stats.get("bytes_limit"):
        mem = int(stats["bytes_limit"])
    figures = figures_for_devices(devices)
    rates = {} if devices[0].platform == "cpu" else {
        "bf16": measure_flops(devices[0], reps=reps, dtype="bfloat16")}
    return CostModel(tuple(alphas), tuple(betas), measure_flops(devices[0], reps=reps), rates,
                     memory_bytes=mem if mem is not None else figures.memory_bytes,
                     native_reduce_scatter=devices[0].platform != "cpu",
                     backend=f"calibrated-{figures.backend}")
