"""Estimated MFU of a plan, and whether the estimate is believable.

MFU (model FLOPs utilization) = model FLOPs ÷ (devices × peak FLOP/s × step time): the
step's matmul FLOPs (``op_cost.model_flops``: dots, convolutions, library and attention
calls; recomputed ones count too) over what the devices could do at their datasheet peak
in the dtype most of those FLOPs run in. A plan's report states it from the estimated
step. No step can beat a bare matmul: when the estimated MFU is above the efficiency the
cost model's roofline gives a matmul of that dtype at its best size (calibrated:
``rhino.calibrate``, or a backend's measured figure), the estimate is optimistic and the
report says so (a cost model without a roofline is checked against the built-in roofline of
its backend's name: datasheet FLOP/s alone make steps look faster than any device runs
them).

Example:
    >>> u = Utilization(model_flops=8e15, devices=8, peak_flops_per_s=1e15, dtype="bf16",
    ...                 step_s=2.0, ceiling=0.7)
    >>> round(u.mfu, 3), u.optimistic
    (0.5, False)
    >>> print(Utilization(8e15, 8, 1e15, "bf16", 1.25, 0.7).line())   # doctest: +ELLIPSIS
    estimated MFU 80.0 % (8e+15 model FLOP ÷ (8 devices × 1e+15 FLOP/s bf16 × 1250.000 ms)); \
WARNING: above the 70.0 % a bare bf16 matmul reaches (...): this estimate is optimistic
"""

from __future__ import annotations

import dataclasses

from rhino.planner.cost_model import CostModel


@dataclasses.dataclass(frozen=True)
class Utilization:
    """The numbers behind an MFU figure.

    Attributes:
        model_flops: matmul FLOPs of one step (the whole batch).
        devices: devices the step runs on.
        peak_flops_per_s: one device's peak in ``dtype``.
        dtype: the dtype of most matmul FLOPs.
        step_s: the step time (estimated).
        ceiling: the best fraction of the peak a bare matmul of ``dtype`` reaches under the
            cost model's roofline, or None (no roofline: no measured ceiling).
        measured: ``step_s`` was measured (a step that ran), not estimated.
    """

    model_flops: float
    devices: int
    peak_flops_per_s: float
    dtype: str
    step_s: float
    ceiling: float | None = None
    measured: bool = False

    @property
    def mfu(self) -> float:
        """Model FLOPs ÷ (devices × peak × step); 0 for an empty step."""
        den = self.devices * self.peak_flops_per_s * self.step_s
        return self.model_flops / den if den > 0 else 0.0

    @property
    def optimistic(self) -> bool:
        """Whether the estimated MFU is above what a bare matmul reaches."""
        return not self.measured and self.ceiling is not None and self.mfu > self.ceiling

    def line(self) -> str:
        """One report line: the MFU, how it is made and, where it is above the ceiling,
        a warning."""
        text = (f"{'measured' if self.measured else 'estimated'} MFU {100 * self.mfu:.1f} % "
                f"({self.model_flops:.3g} model FLOP ÷ ({self.devices} devices × "
                f"{self.peak_flops_per_s:.3g} FLOP/s {self.dtype} × {1e3 * self.step_s:.3f} ms))")
        if self.measured:
            return text
        if self.optimistic:
            text += (f"; WARNING: above the {100 * self.ceiling:.1f} % a bare {self.dtype} "
                     f"matmul reaches (the cost model's roofline, from calibration or the "
                     f"backend's measured figures): this estimate is optimistic")
        elif self.ceiling is None:
            text += "; no measured matmul ceiling to check it against (no roofline figures)"
        return text


def matmul_ceiling(cost: CostModel, dtype: str) -> float | None:
    """The best efficiency a ``dtype`` matmul reaches under ``cost``'s roofline, or, for a
    cost model without one, under the roofline of the built-in figures of its backend's
    name (``rhino.backends``: what was measured on such a device); None when neither has
    one, 1.0 where the roofline has no table for the dtype."""
    roof = cost.roofline
    if roof is None:
        from rhino.backends import BACKENDS

        fig = BACKENDS.get(cost.backend)
        roof = fig.roofline if fig is not None else None
    if roof is None:
        return None
    curve = dict(roof.matmul_efficiency).get(dtype) or dict(roof.matmul_efficiency).get("*")
    return max(e for _, e in curve) if curve else 1.0


def utilization(model_flops: float, dtype: str, devices: int, step_s: float,
                cost: CostModel) -> Utilization:
    """The ``Utilization`` of a step of ``model_flops`` matmul FLOPs (mostly in ``dtype``)
    on ``devices`` devices priced by ``cost`` in ``step_s`` seconds."""
    return Utilization(float(model_flops), int(devices), cost.flops_for(dtype), dtype,
                       float(step_s), matmul_ceiling(cost, dtype))
