"""What one device's kernels achieve: the roofline figures a ``CostModel`` may carry.

A kernel (one fused loop, one matmul, one attention call, ...) takes

    max(FLOPs / achievable FLOP/s, bytes moved / achievable memory bandwidth) + launch

seconds (``rhino.planner.op_cost`` groups a graph's ops into kernels the way XLA fuses
them and prices each). ``Roofline`` holds the achievable figures of one kind of device:

* ``memory_bandwidth``: bytes/s a streaming kernel moves (read + written) over arrays much
  larger than the caches; ``bandwidth_by_size``: where measured, the same by the bytes a
  kernel moves, ``(bytes, bytes/s)`` points interpolated in log bytes (a kernel whose data
  fits in a CPU's caches moves it several times faster);
* ``vector_flops_per_s``: FLOP/s of work that is not a matmul (elementwise ops,
  reductions; HLO counts one FLOP per element and op);
* ``transcendentals_per_s``: elements per second of transcendental ops (``exp``, ``log``,
  ``tanh``, ``erf``, ...: ``fusion.TRANSCENDENTAL``), which a CPU evaluates in tens of
  instructions each (None: at the vector FLOP/s, as on GPUs, where they are cheap);
* ``matmul_efficiency``: per dtype, the fraction of the dtype's peak (the ``CostModel``'s
  ``flops_for``) a matmul of a given size reaches, as ``(FLOPs, efficiency)`` points,
  interpolated in log FLOPs and held flat past the ends (key ``"*"``: any other dtype;
  ``conv:<dtype>``: convolutions, where measured); a large matmul reaches 0.7-0.8 of a
  GPU's datasheet figure, a small one far less. A matmul's size is that of the square
  matmul it runs like (``hlo_passes.fusion.matmul_square_flops``: a skinny product is
  slow like a small one);
* ``attention_efficiency``: the same fraction for a fused attention kernel (cuDNN's flash
  attention) at its FLOPs;
* ``launch_s``: seconds each kernel adds (launch, ramp-up, tail) on top of its roofline;
* ``program_s``: seconds one program costs to dispatch and wait for (a step, or a pipeline
  task): ``rhino.calibrate.measure_launch_latency``;
* ``fusion``: whose fusion rules the kernels follow: ``cpu`` (XLA:CPU: transcendental
  ops and divisions are not duplicated into several consumers) or ``gpu`` (XLA:GPU: they
  are, as f32 math is cheap there, and a row reduction joins the elementwise kernel that
  reads it back over the same rows, as Triton's softmax fusion does);
* ``collectives``: measured collective costs per link (``intra``: within a host, ``inter``:
  across hosts), kind and group size, as ``(link, kind, n, α, β)`` in the planner's
  formulas (``rhino.planner.collectives``), which they then replace for that group;
  ``collective_curves``: where measured, the time past α by the formula's bytes ``x``
  (``c·(n-1)/n·B``) as ``(link, kind, n, ((x, seconds), ...))``, piecewise linear (and
  past the last point, at the last segment's slope): a CPU's all-reduce of 32 MiB per
  device takes eight times the time per byte of one of 4 MiB.

Figures per backend, with where each comes from, are in ``rhino.backends``; measured ones
from ``rhino.calibrate.calibrate_roofline``.

Example:
    >>> r = Roofline(2e12, 5e13, {"bf16": ((1e9, 0.3), (1e12, 0.7))}, launch_s=2e-6)
    >>> r.matmul_efficiency_for("bf16", 1e12), r.matmul_efficiency_for("bf16", 1e15)
    (0.7, 0.7)
    >>> round(r.matmul_efficiency_for("bf16", 10 ** 10.5), 3)    # halfway in log FLOPs
    0.5
    >>> r.matmul_efficiency_for("f32", 1e12)                       # no table: the peak
    1.0
    >>> Roofline.from_dict(r.to_dict()) == r
    True
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any, Mapping, Sequence

from rhino.errors import OptionsError

ANY_DTYPE = "*"
LINKS = ("intra", "inter")
FUSION_RULES = ("cpu", "gpu")
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def _positive(value: Any, where: str, zero_ok: bool = False) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if isinstance(value, bool) or not math.isfinite(x) or x < 0 or (x == 0 and not zero_ok):
        raise OptionsError(f"roofline {where}: expected a finite number "
                           f"{'>= 0' if zero_ok else '> 0'}, found {value!r}")
    return x


def keyed_table(value: Any, convert: Any, where: str, expected: str
                ) -> tuple[tuple[str, Any], ...]:
    """``((key, convert(v, f"{where}[key]")), ...)`` sorted by key, from a mapping or from
    ``(key, value)`` pairs; malformed input raises ``OptionsError`` saying ``expected`` and
    what was found (an ``OptionsError`` of ``convert`` passes through)."""
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        table = {str(k): convert(v, f"{where}[{k!r}]") for k, v in pairs}
    except (TypeError, ValueError) as e:
        if isinstance(e, OptionsError):
            raise
        raise OptionsError(f"{expected}, found {value!r}") from None
    return tuple(sorted(table.items()))


def _curve(points: Any, where: str) -> tuple[tuple[float, float], ...]:
    try:
        pts = [(float(f), float(e)) for f, e in points]
    except (TypeError, ValueError):
        raise OptionsError(f"roofline {where}: expected (FLOPs, efficiency) pairs, found "
                           f"{points!r}") from None
    if not pts or any(not (f > 0 and math.isfinite(f)) or not 0 < e <= 1.5 for f, e in pts):
        raise OptionsError(f"roofline {where}: expected at least one (FLOPs > 0, 0 < "
                           f"efficiency <= 1.5) pair, found {points!r}")
    pts.sort()
    out: list[tuple[float, float]] = []
    for f, e in pts:             # one efficiency per size: the last given wins
        if out and out[-1][0] == f:
            out[-1] = (f, e)
        else:
            out.append((f, e))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Achievable figures of one device's kernels (module docstring).

    Attributes:
        memory_bandwidth: bytes/s moved by a streaming kernel.
        bandwidth_by_size: ``(bytes moved, bytes/s)`` points, or empty (module docstring).
        vector_flops_per_s: FLOP/s of non-matmul work.
        transcendentals_per_s: transcendental elements per second (None: one FLOP each).
        matmul_efficiency: dtype -> ``(FLOPs, fraction of the dtype's peak)`` points; a
            mapping, kept as sorted ``(dtype, points)`` pairs.
        attention_efficiency: fraction of the peak of the kernel's dtype a fused attention
            kernel reaches.
        launch_s: seconds added per kernel.
        program_s: seconds per program dispatched (a step, a pipeline task).
        collectives: measured ``(link, kind, group size, α, β)`` entries.
        collective_curves: measured ``(link, kind, group size, ((x, seconds), ...))``.
        fusion: ``cpu`` or ``gpu`` (whose fusion rules; module docstring).
        source: where the figures come from (not compared).
    """

    memory_bandwidth: float
    vector_flops_per_s: float
    matmul_efficiency: Mapping[str, Any] | tuple = ()
    attention_efficiency: float = 1.0
    launch_s: float = 0.0
    program_s: float = 0.0
    collectives: tuple[tuple[str, str, int, float, float], ...] = ()
    fusion: str = "cpu"
    transcendentals_per_s: float | None = None
    bandwidth_by_size: tuple[tuple[float, float], ...] = ()
    collective_curves: tuple = ()
    source: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        put = object.__setattr__
        put(self, "memory_bandwidth", _positive(self.memory_bandwidth, "memory_bandwidth"))
        put(self, "vector_flops_per_s", _positive(self.vector_flops_per_s,
                                                  "vector_flops_per_s"))
        put(self, "matmul_efficiency", keyed_table(
            self.matmul_efficiency, _curve, "matmul_efficiency",
            "roofline matmul_efficiency: expected a mapping dtype -> (FLOPs, efficiency) "
            "pairs"))
        eff = _positive(self.attention_efficiency, "attention_efficiency")
        if eff > 1.5:
            raise OptionsError(f"roofline attention_efficiency: expected a fraction of the "
                               f"peak (<= 1.5), found {eff!r}")
        put(self, "attention_efficiency", eff)
        put(self, "launch_s", _positive(self.launch_s, "launch_s", zero_ok=True))
        put(self, "program_s", _positive(self.program_s, "program_s", zero_ok=True))
        put(self, "collectives", tuple(sorted(self._entry(e) for e in self.collectives)))
        curves = []
        for e in self.collective_curves:
            try:
                link, kind, n, pts = e
                pts = tuple(sorted((float(x), float(t)) for x, t in pts))
            except (TypeError, ValueError):
                pts = None
            if pts is None or not pts or any(x < 0 or t < 0 or not math.isfinite(x + t)
                                              for x, t in pts):
                raise OptionsError(f"roofline collective_curves: expected (link, kind, group "
                                   f"size, ((bytes, seconds >= 0), ...)), found {e!r}")
            link, kind, n = self._entry((link, kind, n, 0.0, 0.0))[:3]
            curves.append((link, kind, n, pts))
        put(self, "collective_curves", tuple(sorted(curves)))
        if self.bandwidth_by_size:
            try:
                pts = sorted((float(b), _positive(r, "bandwidth_by_size rate"))
                             for b, r in self.bandwidth_by_size)
            except (TypeError, ValueError):
                raise OptionsError(f"roofline bandwidth_by_size: expected (bytes, bytes/s) "
                                   f"pairs, found {self.bandwidth_by_size!r}") from None
            if any(b <= 0 for b, _ in pts):
                raise OptionsError(f"roofline bandwidth_by_size: expected sizes > 0, found "
                                   f"{self.bandwidth_by_size!r}")
            put(self, "bandwidth_by_size", tuple(pts))
        if self.transcendentals_per_s is not None:
            put(self, "transcendentals_per_s", _positive(self.transcendentals_per_s,
                                                         "transcendentals_per_s"))
        if self.fusion not in FUSION_RULES:
            raise OptionsError(f"roofline fusion: expected one of {FUSION_RULES}, found "
                               f"{self.fusion!r}")

    @staticmethod
    def _entry(e: Any) -> tuple[str, str, int, float, float]:
        try:
            link, kind, n, a, b = e
            n_ok = not isinstance(n, bool) and int(n) == n and int(n) >= 2
        except (TypeError, ValueError):
            link = kind = None
            n_ok = False
        if link not in LINKS or kind not in COLLECTIVE_KINDS or not n_ok:
            raise OptionsError(f"roofline collectives: expected (link in {LINKS}, kind in "
                               f"{COLLECTIVE_KINDS}, group size >= 2, α, β), found {e!r}")
        return (link, kind, int(n), _positive(a, "collective α", True),
                _positive(b, "collective β", True))

    # ---------------------------------------------------------------- reading
    def matmul_efficiency_for(self, dtype: str | None, flops: float,
                              fallback: str | None = None) -> float:
        """The fraction of ``dtype``'s peak a matmul of ``flops`` FLOPs (its size) reaches:
        from the table of ``dtype``, else of ``fallback``, else ``"*"``; 1.0 without any
        (``conv:f32`` keys a convolution's own curve, falling back to ``f32``'s)."""
        table = dict(self.matmul_efficiency)
        for key in (dtype, fallback, ANY_DTYPE):
            if key is not None and key in table:
                return interpolate(table[key], flops)
        return 1.0

    def bandwidth_for(self, nbytes: float) -> float:
        """Bytes/s of a kernel moving ``nbytes`` (``memory_bandwidth`` without a curve)."""
        if not self.bandwidth_by_size or nbytes <= 0:
            return self.memory_bandwidth
        return interpolate(self.bandwidth_by_size, nbytes)

    def best_bandwidth(self) -> float:
        """The highest bandwidth any kernel gets (for lower bounds)."""
        return max([self.memory_bandwidth] + [r for _, r in self.bandwidth_by_size])

    def collective_seconds(self, link: str, kind: str, n: int, x: float,
                           alpha_share: float = 1.0) -> float | None:
        """Measured seconds of a ``kind`` collective over ``n`` devices on ``link`` moving
        ``x`` formula bytes (``c·(n-1)/n·B``): α (times ``alpha_share``) plus the curve at
        ``x`` where measured, else ``α + x·β``; None without a measurement (the nearest
        group size as ``collective`` picks)."""
        ab = self.collective(link, kind, n)
        if ab is None:
            return None
        alpha, beta = ab
        best = None
        for lk, k, m, pts in self.collective_curves:
            if lk != link or k != kind:
                continue
            key = (round(abs(math.log(m) - math.log(max(n, 1))), 9), -m)
            if best is None or key < best[0]:
                best = (key, pts)
        if best is None:
            return alpha * alpha_share + x * beta
        return alpha * alpha_share + _along(best[1], x)

    def collective(self, link: str, kind: str, n: int) -> tuple[float, float] | None:
        """Measured (α, β) of a ``kind`` collective over ``n`` devices on ``link``: the entry
        of that size, else of the nearest measured size (in log n; between two as near, the
        larger), else None."""
        best = None
        for lk, k, m, a, b in self.collectives:
            if lk != link or k != kind:
                continue
            key = (round(abs(math.log(m) - math.log(max(n, 1))), 9), -m)
            if best is None or key < best[0]:
                best = (key, a, b)
        return None if best is None else (best[1], best[2])

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {"memory_bandwidth": self.memory_bandwidth,
                "vector_flops_per_s": self.vector_flops_per_s,
                "matmul_efficiency": {k: [list(p) for p in v]
                                      for k, v in self.matmul_efficiency},
                "attention_efficiency": self.attention_efficiency,
                "launch_s": self.launch_s, "program_s": self.program_s,
                "collectives": [list(e) for e in self.collectives],
                "fusion": self.fusion, "transcendentals_per_s": self.transcendentals_per_s,
                "bandwidth_by_size": [list(p) for p in self.bandwidth_by_size],
                "collective_curves": [[lk, k, n, [list(p) for p in pts]]
                                      for lk, k, n, pts in self.collective_curves],
                "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Roofline":
        """The figures of ``to_dict``.

        Raises:
            OptionsError: not an object, a required key missing or an unknown key.
        """
        if not isinstance(d, Mapping):
            raise OptionsError(f"roofline JSON: expected an object, found {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [k for k in ("memory_bandwidth", "vector_flops_per_s") if k not in d]
        extra = sorted(set(d) - known)
        if missing or extra:
            raise OptionsError(f"roofline JSON: expected the keys {sorted(known)} "
                               f"(memory_bandwidth and vector_flops_per_s required), found "
                               f"{sorted(d)}")
        fields = dict(d)
        fields["collectives"] = tuple(tuple(e) for e in fields.get("collectives", ()))
        fields["bandwidth_by_size"] = tuple(tuple(e) for e in
                                            fields.get("bandwidth_by_size", ()))
        return cls(**fields)

    def summary(self) -> str:
        """One line for reports."""
        eff = "; ".join(f"{k} {min(e for _, e in v):.2g}-{max(e for _, e in v):.2g}"
                        for k, v in self.matmul_efficiency) or "1"
        tr = ("" if self.transcendentals_per_s is None else
              f", transcendentals {self.transcendentals_per_s:.3g}/s")
        return (f"bandwidth {self.memory_bandwidth / 1e9:.3g} GB/s, vector "
                f"{self.vector_flops_per_s:.3g} FLOP/s{tr}, matmul efficiency {eff}, attention "
                f"{self.attention_efficiency:.2g}, launch {self.launch_s * 1e6:.3g} µs per "
                f"kernel, {self.program_s * 1e6:.3g} µs per program, {self.fusion} fusion"
                + (f", {len(self.collectives)} measured collectives" if self.collectives
                   else ""))


def _along(points: Sequence[tuple[float, float]], x: float) -> float:
    """A piecewise-linear curve through (0, 0) and ``points`` at ``x``, past the last point
    at the last segment's slope."""
    pts = [(0.0, 0.0)] + [p for p in points if p[0] > 0]
    if x <= 0 or len(pts) == 1:
        return 0.0
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (x - x0) * (y1 - y0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (x - x1) * (y1 - y0) / (x1 - x0)


def interpolate(curve: Sequence[tuple[float, float]], x: float) -> float:
    """``curve``'s value at ``x``: linear in log ``x`` between its points, flat past its
    ends (``curve``: sorted ``(x, y)`` pairs, x > 0)."""
    if x <= curve[0][0]:
        return curve[0][1]
    if x >= curve[-1][0]:
        return curve[-1][1]
    xs = [p[0] for p in curve]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + t * (y1 - y0)
