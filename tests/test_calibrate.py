"""Calibration of α, β and FLOP/s on the (simulated) local devices."""

import math

import pytest

from rhino.calibrate import calibrate_cost_model, measure_axis


def test_calibrate_2x4_mesh():
    cost = calibrate_cost_model((2, 4), reps=2)
    assert cost.ndim == 2 and cost.backend == "calibrated-cpu"
    assert all(a >= 0 and math.isfinite(a) for a in cost.alpha)
    assert all(b > 0 and math.isfinite(b) for b in cost.beta)
    assert cost.flops_per_s > 1e6
    assert cost.memory_bytes and cost.memory_bytes > 0
    assert not cost.native_reduce_scatter


def test_calibrate_needs_enough_devices():
    with pytest.raises(ValueError, match="needs 64 devices"):
        measure_axis((8, 8), 0)


def test_memory_bandwidth_and_launch_latency():
    from rhino.calibrate import measure_launch_latency, measure_memory_bandwidth

    bw = measure_memory_bandwidth(nbytes=1 << 22, reps=2)
    assert math.isfinite(bw) and 1e6 < bw < 1e13      # bytes/s: a CPU's, not 0 nor absurd
    lat = measure_launch_latency(reps=5)
    assert 0 < lat < 1.0                               # seconds for a one-element program
    with pytest.raises(ValueError, match="expected nbytes >= 4"):
        measure_memory_bandwidth(nbytes=2)
    with pytest.raises(ValueError, match="expected reps >= 1, found 0"):
        measure_launch_latency(reps=0)
