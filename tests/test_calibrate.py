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
