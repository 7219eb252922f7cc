"""The executed-timeline Gantt chart: records, JSON, PNG and text rendering, errors."""

import doctest
import json
import re
import struct
import sys

import pytest

from rhino.errors import RhinoError
from rhino.runtime.scheduling.schedules import gpipe, one_f_one_b, simulate
import rhino.runtime.scheduling.timeline as timeline_module
from rhino.runtime.scheduling.timeline import (COLORS, KINDS, ExecutedTimeline, TaskRecord,
                                               TimelineError)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_module_doctests():
    assert doctest.testmod(timeline_module).failed == 0


@pytest.fixture()
def one_f_one_b_timeline():
    """1F1B on 2 stages × 4 microbatches, times from the simulator (stage 1 a bit slower),
    shifted to a perf_counter-like origin, plus one send/recv pair per activation."""
    sched = one_f_one_b(2, 4)
    sim = simulate(sched, [1e-3, 1.2e-3], [2e-3, 2.4e-3], transfer_s=2e-4, apply_s=5e-4)
    origin = 1234.5
    base = ExecutedTimeline.from_simulation(sched, sim)
    records = [TaskRecord(r.stage, r.label, origin + r.start, origin + r.end, r.microbatch, r.kind)
               for r in base.records]
    for t, end in sim.end.items():
        if t.kind == "F" and t.stage == 0:
            records.append(TaskRecord(0, "send→1", origin + end, origin + end + 2e-4,
                                      t.microbatch, "send"))
            records.append(TaskRecord(1, "recv←0", origin + end, origin + end + 2e-4,
                                      t.microbatch, "recv"))
    return sched, sim, ExecutedTimeline(tuple(records), sched.name, 2, 4)


def test_from_simulation_matches_schedule(one_f_one_b_timeline):
    sched, sim, tl = one_f_one_b_timeline
    assert tl.step_s == pytest.approx(sim.makespan)
    for s in range(2):
        compute = [r.label for r in tl.stage_records(s) if r.kind not in ("send", "recv")]
        assert compute == [t.label for t in sched.stage_tasks(s)]
    fwd, bwd = [1e-3, 1.2e-3], [2e-3, 2.4e-3]
    for s in range(2):  # transfers are not busy time
        assert tl.busy_s(s) == pytest.approx(4 * fwd[s] + 4 * bwd[s] + 5e-4)
    kinds = {r.label[0]: r.kind for r in tl.records if r.kind in ("forward", "backward", "apply")}
    assert kinds == {"F": "forward", "B": "backward", "A": "apply"}


def test_busy_merges_overlaps():
    recs = (TaskRecord(0, "x", 0.0, 2.0), TaskRecord(0, "y", 1.0, 3.0),
            TaskRecord(0, "z", 5.0, 6.0), TaskRecord(0, "send→1", 0.0, 10.0, kind="send"))
    tl = ExecutedTimeline(recs, "custom", 1, 0)
    assert tl.busy_s(0) == pytest.approx(4.0)
    assert tl.step_s == pytest.approx(10.0)


def png_size(data):
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_draw_writes_valid_png(one_f_one_b_timeline, tmp_path):
    _, _, tl = one_f_one_b_timeline
    out = tl.draw(tmp_path / "gantt.png", title="measured")
    assert out == tmp_path / "gantt.png"
    data = out.read_bytes()
    w, h = png_size(data)
    assert w >= 600 and h >= 150
    assert len(data) > 10_000  # bars, labels, legend, axes: not a blank image
    assert data.rstrip().endswith(b"IEND\xaeB`\x82")


def test_draw_does_not_touch_pyplot(tmp_path):
    had_pyplot = "matplotlib.pyplot" in sys.modules
    tl = ExecutedTimeline((TaskRecord(0, "F0", 0.0, 1e-3, 0, "forward"),), "x", 1, 1)
    tl.draw(str(tmp_path / "one.png"))
    assert ("matplotlib.pyplot" in sys.modules) == had_pyplot


def test_draw_colors_every_kind(tmp_path):
    assert set(COLORS) == set(KINDS) and len(set(COLORS.values())) == len(KINDS)
    recs = tuple(TaskRecord(0, k[:1].upper(), i, i + 0.9, None, k) for i, k in enumerate(KINDS))
    tl = ExecutedTimeline(recs, "kinds", 1, 0)
    assert png_size(tl.draw(tmp_path / "kinds.png").read_bytes())[0] > 0


def test_draw_empty_timeline(tmp_path):
    path = ExecutedTimeline((), "empty", 3, 0).draw(tmp_path / "empty.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_render_text_one_line_per_stage_in_order(one_f_one_b_timeline):
    sched, _, tl = one_f_one_b_timeline
    text = tl.render_text(width=120)
    lines = text.splitlines()
    assert lines[0].startswith("1f1b: 2 stages × 4 microbatches, step ")
    stage_lines = lines[1:]
    assert len(stage_lines) == 2
    assert all(len(line) == 120 for line in stage_lines)
    for s, line in enumerate(stage_lines):
        assert line.startswith(f"stage {s} |")
        labels = re.findall(r"[FB]\d|A", line.split("|", 1)[1])
        assert labels == [t.label for t in sched.stage_tasks(s)]
    # stage 1 idles while F0 runs on stage 0 and the activation travels
    assert stage_lines[1].split("|", 1)[1].startswith(".")


def test_render_text_narrow_cuts_labels():
    sched = gpipe(3, 8)
    tl = ExecutedTimeline.from_simulation(sched, simulate(sched, 1.0, 2.0))
    lines = tl.render_text(width=30).splitlines()
    assert len(lines) == 1 + 3 and all(len(line) == 30 for line in lines[1:])
    with pytest.raises(TimelineError, match="expected width >"):
        tl.render_text(width=5)


def test_json_round_trip(one_f_one_b_timeline):
    _, _, tl = one_f_one_b_timeline
    text = tl.to_json()
    assert json.loads(text)["schedule"] == "1f1b"
    back = ExecutedTimeline.from_json(text)
    assert back == tl
    assert back.records[0] == tl.records[0] and isinstance(back.records, tuple)
    assert "send→1" in text  # unicode labels kept as is


@pytest.mark.parametrize("kwargs, match", [
    (dict(stage=0, label="F0", start=2.0, end=1.0), "expected end >= start"),
    (dict(stage=-1, label="F0", start=0.0, end=1.0), "expected a stage >= 0"),
    (dict(stage=0, label="F0", start=0.0, end=float("nan")), "expected finite times"),
    (dict(stage=0, label="F0", start=0.0, end=1.0, kind="compute"), "expected kind in"),
    (dict(stage=0, label="F0", start=0.0, end=1.0, microbatch=-2), "expected microbatch"),
])
def test_bad_record(kwargs, match):
    with pytest.raises(TimelineError, match=match) as e:
        TaskRecord(**kwargs)
    assert isinstance(e.value, RhinoError)


def test_stage_and_microbatch_out_of_range():
    with pytest.raises(TimelineError, match=r"expected stage in \[0, 2\), found 2"):
        ExecutedTimeline((TaskRecord(2, "F0", 0.0, 1.0, 0, "forward"),), "1f1b", 2, 1)
    with pytest.raises(TimelineError, match=r"expected microbatch in \[0, 1\), found 1"):
        ExecutedTimeline((TaskRecord(0, "F1", 0.0, 1.0, 1, "forward"),), "1f1b", 2, 1)
    with pytest.raises(TimelineError, match="expected num_stages >= 1"):
        ExecutedTimeline((), "1f1b", 0, 1)
    tl = ExecutedTimeline((), "1f1b", 2, 1)
    with pytest.raises(TimelineError, match=r"expected stage in \[0, 2\), found 5"):
        tl.busy_s(5)


def test_bad_json():
    with pytest.raises(TimelineError, match="expected valid JSON"):
        ExecutedTimeline.from_json("{not json")
    with pytest.raises(TimelineError, match="expected keys"):
        ExecutedTimeline.from_json('{"schedule": "1f1b"}')
    bad = {"schedule": "x", "num_stages": 1, "num_microbatches": 0,
           "records": [{"stage": 0, "label": "F0", "start": 0.0, "end": 1.0, "colour": "red"}]}
    with pytest.raises(TimelineError, match="expected records with fields"):
        ExecutedTimeline.from_dict(bad)


def test_drawing_without_matplotlib_names_the_extra(one_f_one_b_timeline, tmp_path,
                                                    monkeypatch):
    """matplotlib is optional (``rhino[plots]``): without it, drawing says what to install
    and what works without it; trace events need nothing."""
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib fails
    tl = one_f_one_b_timeline[2]
    with pytest.raises(TimelineError, match=r"pip install 'rhino\[plots\]'"):
        tl.draw(tmp_path / "t.png")
    tl.write_trace(tmp_path / "t.json")
    assert (tmp_path / "t.json").stat().st_size > 0
