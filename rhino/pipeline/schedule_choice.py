"""Which schedule a pipelined plan runs (``schedule="auto"``): every schedule the executors
run, priced on the plan's stages, the fastest whose activations fit the memory budget.

A stage's estimate (``StageEstimate``) gives its per-microbatch time; its forward and
backward FLOPs (``StagePlan.flops``) split that time into F and the backward, and the
backward into B (the gradients of the stage's inputs) and W (its weight gradients, taken as
long as F: the weight-gradient matmuls mirror the forward's, as in the zero-bubble paper)
for the schedules that split it. Each schedule's table is run with these times by
``schedules.simulate`` (sends as the transfer time, apply-gradients once at the end); the
plan's own 1F1B estimate is scaled by each schedule's simulated step over 1F1B's, so the
schedules are compared by one model and 1F1B keeps the estimate the search made.

Memory: a stage holds ``in_flight_bound(schedule, ...)`` microbatches' handed values
(``StageMemory``: state + gradients + one microbatch's working set + (in_flight - 1) ×
handed); a schedule any of whose stages exceeds the budget is not chosen. Ties go to 1F1B.

Example:
    >>> from rhino.parallel_plan import StageEstimate, StageMemory
    >>> est = [StageEstimate(3.0, 0.0, 0.0, 0.0)] * 4
    >>> handed = [3, 3, 3, 10]        # the last stage hands on most per microbatch
    >>> mem = [StageMemory(0, 0, 10, 4 - s, 10 + (3 - s) * h, handed=h)
    ...        for s, h in enumerate(handed)]
    >>> flops = [(1.0, 2.0, 0.0)] * 4
    >>> c = choose(est, mem, flops, 4, step_1f1b=21.0, budget=100)
    >>> c.name, round(c.step_s, 3), round(c.steps["1f1b"], 3), c.peaks["zb-h1"]
    ('zb-h1', 15.0, 21.0, 40)
    >>> choose(est, mem, flops, 4, step_1f1b=21.0, budget=20).name   # zb-h1 holds 4 on s3
    '1f1b'
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from rhino.runtime.scheduling import schedules as S

# The schedules the executors run, in the order ties are broken (1F1B first).
CHOICES = ("1f1b", "zb-h1", "eager-1f1b", "gpipe")


@dataclasses.dataclass(frozen=True)
class ScheduleChoice:
    """The chosen schedule and what the others were priced at.

    Attributes:
        name: the schedule chosen.
        step_s: its estimated step (seconds).
        steps: every schedule's estimated step.
        peaks: every schedule's largest stage memory (bytes per device).
        fits: whether each fits the budget.
        in_flight: per stage, the chosen schedule's microbatches in flight.
    """

    name: str
    step_s: float
    steps: Mapping[str, float]
    peaks: Mapping[str, int]
    fits: Mapping[str, bool]
    in_flight: tuple[int, ...]

    def text(self) -> str:
        """One line for the plan's report: the winner and the others against 1F1B."""
        base = self.steps["1f1b"]
        others = ", ".join(f"{n} {1e3 * self.steps[n]:.3f} ms"
                           + ("" if self.fits[n] else " (over the memory budget)")
                           for n in CHOICES if n != self.name)
        if self.name == "1f1b":
            return f"schedule 1f1b (est. {1e3 * base:.3f} ms; {others})"
        gain = 100.0 * (1.0 - self.step_s / base)
        return (f"schedule {self.name}: est. {1e3 * self.step_s:.3f} ms, {gain:.1f} % under "
                f"1f1b's {1e3 * base:.3f} ms ({others})")


def stage_times(est, flops) -> tuple[float, float, float, float]:
    """(F, B, W, send) seconds per microbatch of one stage (module docstring)."""
    micro = est.compute_s + est.communication_s
    f, b = float(flops[0]), float(flops[1])
    share = f / (f + b) if f + b > 0 else 1.0 / 3.0
    tf = share * micro
    tw = min(tf, micro - tf)
    return tf, micro - tf - tw, tw, est.send_s


def choose(estimates: Sequence, memories: Sequence, flops: Sequence, num_microbatches: int,
           step_1f1b: float, budget: int | None) -> ScheduleChoice:
    """Price every schedule of ``CHOICES`` on the stages (their ``StageEstimate``,
    ``StageMemory`` and ``(forward, backward, apply)`` FLOPs) and choose (module
    docstring); ``budget`` None: no memory limit."""
    p, m = len(estimates), int(num_microbatches)
    times = [stage_times(e, fl) for e, fl in zip(estimates, flops)]
    f = [t[0] for t in times]
    b = [t[1] for t in times]
    w = [t[2] for t in times]
    send = max((t[3] for t in times), default=0.0)
    apply_s = max((e.apply_s for e in estimates), default=0.0)
    sim = {}
    for name in CHOICES:
        s = S.make_schedule(name, p, m)
        if s.splits_backward:
            tl = S.simulate(s, f, b, transfer_s=send, apply_s=apply_s, weight_s=w)
        else:
            tl = S.simulate(s, f, [x + y for x, y in zip(b, w)], transfer_s=send,
                            apply_s=apply_s)
        sim[name] = tl.makespan
    steps = {n: step_1f1b * (sim[n] / sim["1f1b"] if sim["1f1b"] > 0 else 1.0)
             for n in CHOICES}
    peaks, fits, flights = {}, {}, {}
    for name in CHOICES:
        flights[name] = tuple(S.in_flight_bound(name, p, m, s) for s in range(p))
        peak = max(mm.state + mm.gradients + mm.per_microbatch
                   + (k - 1) * mm.handed for mm, k in zip(memories, flights[name]))
        peaks[name] = int(peak)
        fits[name] = budget is None or peak <= budget
    best = "1f1b"
    for name in CHOICES:
        if fits[name] and steps[name] < steps[best] * (1 - 1e-9):
            best = name
    return ScheduleChoice(best, steps[best], steps, peaks, fits, flights[best])


@dataclasses.dataclass(frozen=True)
class InterleavedPrice:
    """``interleaved-1f1b`` on a plan's stages (``price_interleaved``).

    Attributes:
        step_s: its estimated step; step_1f1b: the same stages' 1F1B estimate, each stage
            on its own devices; grouped_1f1b: 1F1B on the device groups (each group's stages
            as one stage: what the same devices run without interleaving).
        in_flight: per stage, the microbatches it holds activations for at once.
        group_peaks: per device group, the sum of its stages' memory (bytes per device).
    """

    step_s: float
    step_1f1b: float
    grouped_1f1b: float
    in_flight: tuple[int, ...]
    group_peaks: tuple[int, ...]

    def text(self) -> str:
        gain = 100.0 * (1.0 - self.step_s / self.grouped_1f1b) if self.grouped_1f1b else 0.0
        return (f"schedule interleaved-1f1b: est. {1e3 * self.step_s:.3f} ms, "
                f"{abs(gain):.1f} % {'under' if gain >= 0 else 'over'} 1f1b on the same "
                f"device groups ({1e3 * self.grouped_1f1b:.3f} ms)")


def price_interleaved(estimates: Sequence, memories: Sequence, flops: Sequence,
                      num_microbatches: int, virtual_stages: int,
                      step_1f1b: float) -> InterleavedPrice:
    """Price ``interleaved-1f1b`` on ``p v`` stages (their estimates, memories and FLOPs,
    as ``choose`` takes them): its table and 1F1B's on the same stages are simulated with
    the stages' times, and ``step_1f1b`` (the search's 1F1B estimate of the stages, each
    on its own devices) scaled by their ratio; 1F1B on the device groups (each group's
    stages run as one, back to back) is simulated the same way, for the report."""
    n, m, v = len(estimates), int(num_microbatches), int(virtual_stages)
    p = n // v
    times = [stage_times(e, fl) for e, fl in zip(estimates, flops)]
    f = [t[0] for t in times]
    b = [t[1] + t[2] for t in times]
    send = max((t[3] for t in times), default=0.0)
    apply_s = max((e.apply_s for e in estimates), default=0.0)
    inter = S.make_schedule("interleaved-1f1b", p, m, v)
    sim = S.simulate(inter, f, b, transfer_s=send, apply_s=apply_s).makespan
    base = S.simulate(S.make_schedule("1f1b", n, m), f, b, transfer_s=send,
                      apply_s=apply_s).makespan
    groups = range(p)
    gf = [sum(f[c] for c in inter.chunks_of(g)) for g in groups]
    gb = [sum(b[c] for c in inter.chunks_of(g)) for g in groups]
    grouped = S.simulate(S.make_schedule("1f1b", p, m), gf, gb, transfer_s=send,
                         apply_s=v * apply_s).makespan
    scale = step_1f1b / base if base > 0 else 1.0
    flights = tuple(inter.chunk_in_flight(c) for c in range(n))
    peaks = tuple(int(sum(with_in_flight(memories[c], flights[c]).total
                          for c in inter.chunks_of(g))) for g in groups)
    return InterleavedPrice(sim * scale, step_1f1b, grouped * scale, flights, peaks)


def with_in_flight(memory, in_flight: int):
    """``memory`` (a ``StageMemory``) holding ``in_flight`` microbatches."""
    total = memory.state + memory.gradients + memory.per_microbatch \
        + (in_flight - 1) * memory.handed
    return dataclasses.replace(memory, in_flight=in_flight, total=int(total))
