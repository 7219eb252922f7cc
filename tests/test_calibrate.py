"""Calibration of the cost model on the (simulated) local devices: the fits on hand-made
timings, and a quick calibration of every figure on the 8 CPU devices."""

import math

import numpy as np
import pytest

from rhino.calibrate import (CalibrationSizes, calibrate_cost_model, conv_square_flops,
                             cost_model_from_roofline, figures_from_roofline, fit_alpha_beta,
                             measure_axis, measure_collective)
from rhino.planner.collectives import collective_cost
from rhino.planner.mesh import AbstractMesh
from rhino.planner.roofline import Roofline


def test_fit_recovers_alpha_and_beta_of_exact_timings():
    xs = [1e3, 1e5, 1e6, 4e6]
    ts = [2e-5 + x * 5e-10 for x in xs]
    a, b = fit_alpha_beta(xs, ts)
    assert a == pytest.approx(2e-5, rel=1e-6) and b == pytest.approx(5e-10, rel=1e-6)


def test_fit_keeps_both_coefficients_non_negative():
    # Noise that makes the line's intercept negative: α is 0 and β fits through the origin.
    a, b = fit_alpha_beta([1e6, 2e6, 3e6], [0.9e-3, 2.0e-3, 3.1e-3])
    assert a == 0.0 and b == pytest.approx(np.dot([1e6, 2e6, 3e6], [0.9e-3, 2.0e-3, 3.1e-3])
                                           / np.dot([1e6, 2e6, 3e6], [1e6, 2e6, 3e6]))
    # A falling line (noise on flat timings): β 0, α the mean.
    a, b = fit_alpha_beta([1e3, 1e6], [2e-4, 1e-4])
    assert b == 0.0 and a == pytest.approx(1.5e-4)
    # One size: no slope to fit.
    assert fit_alpha_beta([1e3], [3e-5]) == (3e-5, 0.0)


def test_conv_square_size_is_the_harmonic_mean_of_the_implicit_gemm():
    # 8 images of 32x32, 16 -> 16 channels: M = 8192, N = 16, K = 144.
    s = 3 / (1 / 8192 + 1 / 16 + 1 / 144)
    assert conv_square_flops(8, 32, 16, 16) == pytest.approx(2 * s ** 3)


def test_quick_calibration_of_a_2x4_mesh_measures_every_figure():
    cost = calibrate_cost_model((2, 4), sizes=CalibrationSizes.quick())
    assert cost.ndim == 2 and cost.backend == "calibrated-cpu" and not cost.native_reduce_scatter
    assert all(a >= 0 and math.isfinite(a) for a in cost.alpha)
    assert all(b >= 0 and math.isfinite(b) for b in cost.beta)
    assert cost.flops_per_s > 1e6 and cost.memory_bytes and cost.memory_bytes > 0
    roof = cost.roofline
    assert roof.fusion == "cpu" and roof.program_s > 0 and roof.launch_s >= 0
    assert 1e6 < roof.memory_bandwidth < 1e13 and roof.vector_flops_per_s > 1e6
    assert roof.transcendentals_per_s > 0
    eff = dict(roof.matmul_efficiency)
    # On CPU the peak is the best measured rate: the curve tops out at 1.
    assert max(e for _, e in eff["f32"]) == pytest.approx(1.0) and "conv:f32" in eff
    sizes = sorted(n for link, kind, n, _, _ in roof.collectives
                   if link == "intra" and kind == "all-reduce")
    assert sizes == [2, 4, 8]
    # Each axis prices its all-reduce with the figures measured for its group size.
    for axis, n in enumerate((2, 4)):
        assert (cost.alpha[axis], cost.beta[axis]) == roof.collective("intra", "all-reduce", n)


def test_measured_collectives_replace_the_axis_figures_by_group_size():
    roof = Roofline(1e9, 1e9, collectives=(("intra", "all-reduce", 2, 1e-5, 1e-9),
                                            ("intra", "all-reduce", 8, 4e-5, 2e-9),
                                            ("intra", "all-gather", 8, 3e-5, 3e-9)))
    cost = cost_model_from_roofline(roof, {"f32": 1e10}, (2, 4))
    mesh = AbstractMesh((2, 4))
    # Axis x (2 devices) has its own entry; y (4) the nearest in log size: 2 and 8 are as
    # near, the larger is kept.
    assert cost.alpha == (1e-5, 4e-5) and cost.beta == (1e-9, 2e-9)
    # A collective over both axes (8 devices) reads the 8-device entry of its kind.
    assert collective_cost("all-reduce", (0, 1), 1e6, mesh, cost) == pytest.approx(
        4e-5 + 2 * 7 / 8 * 1e6 * 2e-9)
    assert collective_cost("all-gather", (0, 1), 1e6, mesh, cost) == pytest.approx(
        3e-5 + 7 / 8 * 1e6 * 3e-9)
    # A kind not measured falls back to the axes' α and β (the slowest axis').
    assert collective_cost("all-to-all", (0, 1), 1e6, mesh, cost) == pytest.approx(
        4e-5 + 7 / 8 * 1e6 * 2e-9)
    fig = figures_from_roofline(roof, {"f32": 1e10, "bf16": 2e10}, "calibrated-cpu")
    assert fig.roofline == roof and fig.flops_per_s == 1e10
    assert dict(fig.dtype_flops_per_s)["bf16"] == 2e10
    assert (fig.alpha_intra, fig.beta_intra) == (4e-5, 2e-9)   # the largest group measured


def test_one_collective_fit_on_the_devices():
    a, b, curve = measure_collective("all-gather", 4, sizes=(1 << 10, 1 << 14), reps=2,
                                     chain=3)
    assert a >= 0 and b >= 0 and math.isfinite(a) and math.isfinite(b)
    # The curve: per size, the formula's bytes (3/4 of the gathered result) and the time
    # past a few bytes' (never falling with size).
    assert [x for x, _ in curve] == [3 / 4 * 4 * (1 << 10), 3 / 4 * 4 * (1 << 14)]
    assert 0 <= curve[0][1] <= curve[1][1]
    with pytest.raises(ValueError, match="dividing 8 devices, found 3"):
        measure_collective("all-reduce", 3)


def test_a_measured_curve_prices_a_collective_by_its_size():
    # 1 ms per MB up to 4 MB, then 8 ms per MB: a CPU's large all-reduces.
    roof = Roofline(1e9, 1e9, collectives=(("intra", "all-reduce", 8, 1e-4, 1e-9),),
                    collective_curves=(("intra", "all-reduce", 8,
                                        ((1e6, 1e-3), (4e6, 4e-3), (8e6, 3.6e-2))),))
    cost = cost_model_from_roofline(roof, {"f32": 1e10}, (8,))
    mesh = AbstractMesh((8,))
    # (formula bytes x = 2·7/8·B, seconds past α): on the curve, between its points and
    # past its last at the last segment's slope.
    for x, past_alpha in ((2e6, 2e-3), (6e6, 2e-2), (1.2e7, 6.8e-2)):
        nbytes = x / (2 * 7 / 8)
        assert collective_cost("all-reduce", (0,), nbytes, mesh, cost) == pytest.approx(
            1e-4 + past_alpha)
    # A kind without a curve keeps the α-β formula with its measured α and β.
    roof2 = Roofline(1e9, 1e9, collectives=(("intra", "all-gather", 8, 1e-4, 2e-9),))
    cost2 = cost_model_from_roofline(roof2, {"f32": 1e10}, (8,))
    assert collective_cost("all-gather", (0,), 1e6, mesh, cost2) == pytest.approx(
        1e-4 + 7 / 8 * 1e6 * 2e-9)


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
