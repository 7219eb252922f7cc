"""Measure a mesh's cost parameters (α, β per axis, FLOP/s, memory) on the devices at hand.

The planner is pure and takes an ``AbstractMesh``; this module is the bridge from real
devices to it. For each mesh axis it times all-reduces of several sizes over that axis and
fits the planner's own all-reduce model ``t = α + 2 (n-1)/n · B · β`` by least squares;
FLOP/s comes from a timed matmul on one device.

Example:
    >>> from rhino.calibrate import calibrate_mesh
    >>> mesh = calibrate_mesh((2, 4))          # doctest: +SKIP
    >>> mesh.alpha, mesh.beta, mesh.flops_per_s  # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from rhino.planner.mesh import AbstractMesh


def _median_time(fn, arg, reps: int) -> float:
    fn(arg).block_until_ready()  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(arg).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_flops(device=None, n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of an n×n float32 matmul on one device."""
    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    t = _median_time(jax.jit(lambda x: x @ x), a, reps)
    return 2.0 * n ** 3 / max(t, 1e-9)


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


def calibrate_mesh(mesh_shape: Sequence[int], devices=None, reps: int = 5) -> AbstractMesh:
    """An ``AbstractMesh`` whose α, β and FLOP/s were measured on local devices."""
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
    defaults = AbstractMesh.simulated_cpu(shape)
    return AbstractMesh(shape, alpha=tuple(alphas), beta=tuple(betas),
                        flops_per_s=measure_flops(devices[0], reps=reps),
                        memory_bytes=mem if mem is not None else defaults.memory_bytes,
                        native_reduce_scatter=devices[0].platform != "cpu")
