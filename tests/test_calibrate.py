"""Calibration of α, β and FLOP/s on the (simulated) local devices."""

import math

import pytest

from rhino.calibrate import calibrate_mesh, measure_axis


def test_calibrate_2x4_mesh():
    mesh = calibrate_mesh((2, 4), reps=2)
    assert mesh.shape == (2, 4)
    assert all(a >= 0 and math.isfinite(a) for a in mesh.alpha)
    assert all(b > 0 and math.isfinite(b) for b in mesh.beta)
    assert mesh.flops_per_s > 1e6
    assert mesh.memory_bytes and mesh.memory_bytes > 0


def test_calibrate_needs_enough_devices():
    with pytest.raises(ValueError, match="needs 64 devices"):
        measure_axis((8, 8), 0)
