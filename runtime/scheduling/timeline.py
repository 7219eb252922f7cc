"""The executed timeline of a pipeline step: measured task times, drawn per stage.

An executor records one `TaskRecord` per task it ran (forward, backward, apply, send, recv)
with wall-clock start and end times; `ExecutedTimeline` holds them with the schedule's name and
sizes, serializes to JSON, and draws a Gantt chart — one row per stage, stage 0 on top —
as a PNG (`ExecutedTimeline.draw`) or as text (`ExecutedTimeline.render_text`)::

    1f1b: 2 stages × 4 microbatches, step 13.00 ms
    stage 0 |F0-F1-F2-...B0----F3-B1----...
    stage 1 |...F0-B0----F1-B1----F2-...

Compute tasks (forward, backward, apply, other) run one at a time per stage; transfers
(send, recv) may overlap them and are drawn in a thin lane under the stage's compute lane.
`ExecutedTimeline.from_simulation` converts `rhino.runtime.scheduling.schedules.simulate`'s
prediction, so a measured and a simulated step can be drawn side by side.

Example:
    >>> from rhino.runtime.scheduling.schedules import one_f_one_b, simulate
    >>> sched = one_f_one_b(2, 2)
    >>> tl = ExecutedTimeline.from_simulation(sched, simulate(sched, 1e-3, 2e-3))
    >>> round(tl.step_s * 1e3, 3), round(tl.busy_s(0) * 1e3, 3)
    (9.0, 6.0)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from rhino.errors import RhinoError

KINDS = ("prologue", "forward", "backward", "apply", "send", "recv", "other")
"""Task kinds a `TaskRecord` may have."""

COMM_KINDS = frozenset({"send", "recv"})

COLORS = {"prologue": "#937860", "forward": "#4C72B0", "backward": "#DD8452", "apply": "#55A868", "send": "#C44E52",
          "recv": "#8172B3", "other": "#8C8C8C"}
"""Bar colour per kind in `ExecutedTimeline.draw`."""

_SCHEDULE_KINDS = {"F": "forward", "B": "backward", "W": "backward", "A": "apply",
                   "P": "prologue"}


class TimelineError(RhinoError, ValueError):
    """A record or timeline that is not well formed (says expected, found and which record)."""


@dataclasses.dataclass(frozen=True)
class TaskRecord:
    """One task an executor ran, with its measured wall-clock times.

    Attributes:
        stage: the pipeline stage that ran it.
        label: a short name drawn in its bar, e.g. ``"F0"``, ``"B3"``, ``"A"``, ``"send→1"``.
        start: start time in seconds (any common origin, e.g. ``time.perf_counter()``).
        end: end time in seconds, ``>= start``.
        microbatch: the microbatch, or None (apply, other).
        kind: one of `KINDS`.
    """

    stage: int
    label: str
    start: float
    end: float
    microbatch: int | None = None
    kind: str = "other"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise TimelineError(f"record {self.label!r}: expected kind in {KINDS}, "
                                f"found {self.kind!r}")
        if not (isinstance(self.stage, int) and self.stage >= 0):
            raise TimelineError(f"record {self.label!r}: expected a stage >= 0, "
                                f"found {self.stage!r}")
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise TimelineError(f"record {self.label!r} on stage {self.stage}: expected finite "
                                f"times, found start={self.start!r}, end={self.end!r}")
        if self.end < self.start:
            raise TimelineError(f"record {self.label!r} on stage {self.stage}: expected end >= "
                                f"start, found start={self.start!r} > end={self.end!r}")
        if self.microbatch is not None and self.microbatch < 0:
            raise TimelineError(f"record {self.label!r}: expected microbatch >= 0 or None, "
                                f"found {self.microbatch!r}")

    @property
    def duration_s(self) -> float:
        """``end - start``."""
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class ExecutedTimeline:
    """The measured task times of one executed pipeline step.

    Attributes:
        records: every task run, any order.
        schedule: the schedule's name, e.g. ``"1f1b"``.
        num_stages: the number of pipeline stages; every record's stage is below it.
        num_microbatches: the number of microbatches; every record's microbatch is below it.

    Example:
        >>> tl = ExecutedTimeline((TaskRecord(0, "F0", 0.0, 0.002, 0, "forward"),
        ...                        TaskRecord(1, "F0", 0.003, 0.004, 0, "forward")), "1f1b", 2, 1)
        >>> round(tl.step_s, 6), ExecutedTimeline.from_json(tl.to_json()) == tl
        (0.004, True)
    """

    records: tuple[TaskRecord, ...]
    schedule: str
    num_stages: int
    num_microbatches: int

    def __post_init__(self):
        object.__setattr__(self, "records", tuple(self.records))
        if self.num_stages < 1 or self.num_microbatches < 0:
            raise TimelineError(f"timeline {self.schedule!r}: expected num_stages >= 1 and "
                                f"num_microbatches >= 0, found {self.num_stages}, "
                                f"{self.num_microbatches}")
        for r in self.records:
            if not isinstance(r, TaskRecord):
                raise TimelineError(f"timeline {self.schedule!r}: expected TaskRecord records, "
                                    f"found {type(r).__name__}")
            if r.stage >= self.num_stages:
                raise TimelineError(f"timeline {self.schedule!r}: record {r.label!r} expected "
                                    f"stage in [0, {self.num_stages}), found {r.stage}")
            if r.microbatch is not None and r.microbatch >= self.num_microbatches:
                raise TimelineError(f"timeline {self.schedule!r}: record {r.label!r} expected "
                                    f"microbatch in [0, {self.num_microbatches}), "
                                    f"found {r.microbatch}")

    @property
    def t0(self) -> float:
        """The earliest start (0.0 when there are no records)."""
        return min((r.start for r in self.records), default=0.0)

    @property
    def step_s(self) -> float:
        """Step time: the last end minus the first start."""
        return max((r.end for r in self.records), default=0.0) - self.t0

    def stage_records(self, stage: int) -> tuple[TaskRecord, ...]:
        """The records of ``stage``, by start time."""
        return tuple(sorted((r for r in self.records if r.stage == stage),
                            key=lambda r: (r.start, r.end)))

    def busy_s(self, stage: int) -> float:
        """Seconds ``stage`` spent computing (the union of its non-transfer records' spans)."""
        if not 0 <= stage < self.num_stages:
            raise TimelineError(f"busy_s: expected stage in [0, {self.num_stages}), "
                                f"found {stage}")
        busy, reach = 0.0, -math.inf
        for r in self.stage_records(stage):
            if r.kind in COMM_KINDS:
                continue
            lo = max(r.start, reach)
            busy += max(0.0, r.end - lo)
            reach = max(reach, r.end)
        return busy

    @classmethod
    def from_simulation(cls, schedule: Any, timeline: Any) -> "ExecutedTimeline":
        """Converts a `schedules.Schedule` and its `schedules.simulate` `Timeline`.

        Example:
            >>> from rhino.runtime.scheduling.schedules import gpipe, simulate
            >>> tl = ExecutedTimeline.from_simulation(gpipe(2, 1), simulate(gpipe(2, 1), 1, 1))
            >>> [r.label for r in tl.stage_records(1)]
            ['F0', 'B0', 'A']
        """
        records = tuple(TaskRecord(t.stage, t.label, float(timeline.start[t]),
                                   float(timeline.end[t]), t.microbatch, _SCHEDULE_KINDS[t.kind])
                        for t in sorted(timeline.start))
        return cls(records, schedule.name, schedule.num_stages, schedule.num_microbatches)

    # ------------------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (see `from_dict`)."""
        return {"schedule": self.schedule, "num_stages": self.num_stages,
                "num_microbatches": self.num_microbatches,
                "records": [dataclasses.asdict(r) for r in self.records]}

    def to_json(self) -> str:
        """JSON text; `from_json` reads it back."""
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExecutedTimeline":
        """Inverse of `to_dict`; raises `TimelineError` on missing or unknown fields."""
        fields = {"schedule", "num_stages", "num_microbatches", "records"}
        if not isinstance(d, Mapping) or set(d) != fields:
            found = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise TimelineError(f"timeline dict: expected keys {sorted(fields)}, found {found}")
        try:
            records = tuple(TaskRecord(**r) for r in d["records"])
        except TypeError as e:
            raise TimelineError(f"timeline dict: expected records with fields "
                                f"{[f.name for f in dataclasses.fields(TaskRecord)]}, "
                                f"found {e}") from e
        return cls(records, d["schedule"], int(d["num_stages"]), int(d["num_microbatches"]))

    @classmethod
    def from_json(cls, text: str) -> "ExecutedTimeline":
        """Inverse of `to_json`."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise TimelineError(f"timeline JSON: expected valid JSON, found {e}") from e
        return cls.from_dict(d)

    # ------------------------------------------------------------------------ trace events
    def to_trace_events(self) -> dict[str, Any]:
        """The step as Chrome / Perfetto trace events (the JSON ``chrome://tracing`` and
        ui.perfetto.dev open): one process per stage, its compute tasks on one thread and
        its transfers on another, each task a complete event (``"ph": "X"``) in
        microseconds from the step's first start, with its kind and microbatch as
        arguments.

        Example:
            >>> tl = ExecutedTimeline((TaskRecord(0, "F0", 1.0, 1.002, 0, "forward"),
            ...                        TaskRecord(0, "send→1", 1.002, 1.003, 0, "send")),
            ...                       "1f1b", 1, 1)
            >>> [(e["name"], e["tid"], e["ts"], e["dur"]) for e in
            ...  tl.to_trace_events()["traceEvents"] if e["ph"] == "X"]
            [('F0', 0, 0.0, 2000.0), ('send→1', 1, 2000.0, 1000.0)]
        """
        t0 = self.t0
        events: list[dict[str, Any]] = []
        for stage in range(self.num_stages):
            events.append({"ph": "M", "name": "process_name", "pid": stage, "tid": 0,
                           "args": {"name": f"stage {stage}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": stage, "tid": 0,
                           "args": {"sort_index": stage}})
            for tid, lane in ((0, "compute"), (1, "transfers")):
                events.append({"ph": "M", "name": "thread_name", "pid": stage, "tid": tid,
                               "args": {"name": lane}})
        for r in sorted(self.records, key=lambda r: (r.stage, r.start, r.end)):
            args: dict[str, Any] = {"kind": r.kind}
            if r.microbatch is not None:
                args["microbatch"] = r.microbatch
            events.append({"ph": "X", "name": r.label, "cat": r.kind, "pid": r.stage,
                           "tid": 1 if r.kind in COMM_KINDS else 0,
                           "ts": round((r.start - t0) * 1e6, 3),
                           "dur": round((r.end - r.start) * 1e6, 3), "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"schedule": self.schedule, "num_stages": self.num_stages,
                              "num_microbatches": self.num_microbatches,
                              "step_ms": round(self.step_s * 1e3, 6)}}

    def write_trace(self, path: str | os.PathLike) -> str | os.PathLike:
        """Write `to_trace_events` as JSON to ``path``; returns ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_trace_events(), f, ensure_ascii=False)
        return path

    # ------------------------------------------------------------------------------ drawing

    def summary(self) -> str:
        """``'1f1b: 2 stages × 4 microbatches, step 13.00 ms'``."""
        return (f"{self.schedule}: {self.num_stages} stages × {self.num_microbatches} "
                f"microbatches, step {self.step_s * 1e3:.2f} ms")

    def render_text(self, width: int = 80) -> str:
        """An ASCII Gantt chart: a summary line, then one line per stage (stage 0 first).

        Time runs left to right; each stage line is exactly ``width`` characters. A compute task fills its
        span with its label then ``-``; idle time is ``.``. Transfers are not drawn (they
        overlap compute); a label longer than its span is cut.

        Example:
            >>> tl = ExecutedTimeline((TaskRecord(0, "F0", 0, 1, 0, "forward"),
            ...                        TaskRecord(1, "F0", 1, 2, 0, "forward")), "gpipe", 2, 1)
            >>> print(tl.render_text(width=20))
            gpipe: 2 stages × 1 microbatches, step 2000.00 ms
            stage 0 |F0----.....
            stage 1 |......F0---
        """
        prefix_len = len(f"stage {self.num_stages - 1} |")
        cols = width - prefix_len
        if cols < 1:
            raise TimelineError(f"render_text: expected width > {prefix_len}, found {width}")
        t0, span = self.t0, self.step_s
        scale = cols / span if span > 0 else 0.0
        lines = [self.summary()]
        for s in range(self.num_stages):
            row = ["."] * cols
            for r in self.stage_records(s):
                if r.kind in COMM_KINDS:
                    continue
                a = min(cols - 1, int(round((r.start - t0) * scale)))
                b = min(cols, max(a + 1, int(round((r.end - t0) * scale))))
                text = (r.label + "-" * (b - a))[:b - a]
                row[a:b] = list(text)
            lines.append(f"stage {s:>{len(str(self.num_stages - 1))}} |" + "".join(row))
        return "\n".join(lines)

    def draw(self, path: str | os.PathLike, title: str | None = None) -> str | os.PathLike:
        """Writes a PNG Gantt chart to ``path`` and returns ``path``.

        One row per stage (stage 0 on top); a bar per record coloured by kind (`COLORS`),
        transfers in a thin lane under each stage's compute lane; labels inside the bars that
        are wide enough; x axis in milliseconds from the first start; a legend; the title
        names the schedule and the step time. Uses matplotlib's object API with the Agg
        canvas: no pyplot, no global backend change.

        Args:
            path: where to write the PNG.
            title: an optional first title line.

        Example:
            >>> import os, tempfile
            >>> tl = ExecutedTimeline((TaskRecord(0, "F0", 0.0, 0.001, 0, "forward"),), "x", 1, 1)
            >>> p = tl.draw(os.path.join(tempfile.mkdtemp(), "t.png"))
            >>> open(p, "rb").read(8) == b"\\x89PNG\\r\\n\\x1a\\n"
            True
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as e:
            raise TimelineError("drawing the timeline as a PNG needs matplotlib, an optional "
                                "dependency: pip install 'rhino[plots]' (or matplotlib); "
                                "timeline(trace='t.json') writes trace events without it, "
                                "render_text() draws it as text") from e

        p, t0 = self.num_stages, self.t0
        fig = Figure(figsize=(12, 1.2 + 0.75 * p), dpi=100)
        canvas = FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        labels = []
        for r in self.records:
            y = p - 1 - r.stage  # stage 0 on top
            comm = r.kind in COMM_KINDS
            y_lo, height = (y - 0.42, 0.2) if comm else (y - 0.2, 0.55)
            left, width = (r.start - t0) * 1e3, r.duration_s * 1e3
            ax.broken_barh([(left, width)], (y_lo, height), facecolors=COLORS[r.kind],
                           edgecolor="white", linewidth=0.5)
            labels.append((ax.text(left + width / 2, y_lo + height / 2, r.label, ha="center",
                                   va="center", fontsize=6 if comm else 8, color="white",
                                   clip_on=True), left, width))
        step_ms = self.step_s * 1e3
        ax.set_xlim(0, step_ms * 1.01 if step_ms > 0 else 1.0)
        ax.set_ylim(-0.6, p - 0.4)
        ax.set_yticks(range(p), [f"stage {p - 1 - y}" for y in range(p)])
        ax.set_xlabel("time (ms) from the first task's start")
        ax.grid(axis="x", alpha=0.3)
        kinds = [k for k in KINDS if any(r.kind == k for r in self.records)]
        if kinds:
            ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds],
                      loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        heading = f"{self.summary()}"
        ax.set_title(f"{title}\n{heading}" if title else heading, fontsize=10)
        fig.tight_layout()
        # keep only labels that fit inside their bar
        renderer = canvas.get_renderer()
        for text, left, width in labels:
            x0, x1 = ax.transData.transform([(left, 0), (left + width, 0)])[:, 0]
            if text.get_window_extent(renderer).width > (x1 - x0) - 2:
                text.set_visible(False)
        canvas.print_png(os.fspath(path))
        return path
