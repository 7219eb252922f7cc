"""Pipeline schedules as plain data: a clock × stage table of tasks.

A ``Schedule`` is what every executor runs: at clock ``k`` stage ``s`` runs ``table[k][s]``
(or idles on ``None``). Tasks are

* ``F<mb>``: forward of microbatch ``mb`` on the stage;
* ``B<mb>``: backward of ``mb`` (compute gradients, then accumulate them locally — the
  local-accumulation task of Rhino §6.1 runs right after its backward on the same stage);
* ``A``: apply the accumulated gradients, once per stage after its last backward.

Dependencies (checked by ``Schedule.validate``, each at a strictly earlier clock):
``F(s, mb)`` after ``F(s-1, mb)``; ``B(s, mb)`` after ``B(s+1, mb)`` and after ``F(s, mb)``;
``A(s)`` after every ``B(s, ·)``. The *in-flight* microbatches of stage ``s`` at a clock are
those whose forward ran there and whose backward has not yet: they hold activations. Each
schedule promises a bound on them (``in_flight_bound``), also checked by ``validate``:

============  =========================  ==========================================
schedule      forwards before 1st B      in-flight bound on stage ``s`` (p stages)
============  =========================  ==========================================
gpipe         all ``m``                  ``m``
1f1b          ``p - s``                  ``min(p - s, m)``
eager-1f1b    ``2 (p - s) - 1`` (004 §4)  ``min(2 (p - s) - 1, m)``
============  =========================  ==========================================

Each schedule is built from per-stage task *orders* (warm-up forwards, then alternate
backward/forward, then the remaining backwards), placed on the clock table as soon as their
dependencies allow (every task takes one clock). The tables for 3 stages, 4 microbatches:

>>> print(gpipe(3, 4).render())
clock | s0 | s1 | s2
    0 | F0 | .  | .
    1 | F1 | F0 | .
    2 | F2 | F1 | F0
    3 | F3 | F2 | F1
    4 | .  | F3 | F2
    5 | .  | .  | F3
    6 | .  | .  | B0
    7 | .  | B0 | B1
    8 | B0 | B1 | B2
    9 | B1 | B2 | B3
   10 | B2 | B3 | A
   11 | B3 | A  | .
   12 | A  | .  | .
>>> print(one_f_one_b(3, 4).render())
clock | s0 | s1 | s2
    0 | F0 | .  | .
    1 | F1 | F0 | .
    2 | F2 | F1 | F0
    3 | .  | .  | B0
    4 | .  | B0 | F1
    5 | B0 | F2 | B1
    6 | F3 | B1 | F2
    7 | B1 | F3 | B2
    8 | .  | B2 | F3
    9 | B2 | .  | B3
   10 | .  | B3 | A
   11 | B3 | A  | .
   12 | A  | .  | .
>>> print(eager_one_f_one_b(3, 4).render())
clock | s0 | s1 | s2
    0 | F0 | .  | .
    1 | F1 | F0 | .
    2 | F2 | F1 | F0
    3 | F3 | F2 | B0
    4 | .  | B0 | F1
    5 | B0 | F3 | B1
    6 | .  | B1 | F2
    7 | B1 | .  | B2
    8 | .  | B2 | F3
    9 | B2 | .  | B3
   10 | .  | B3 | A
   11 | B3 | A  | .
   12 | A  | .  | .

With unit-time tasks the three take the same number of clocks, ``2 (m + p - 1) + 1`` (the
last row applies gradients); they differ in memory
(in-flight activations) and in how much room they leave to overlap transfers with compute,
which ``simulate`` shows with real task and transfer times (eager-1F1B hides forward
transfers that 1F1B waits on, 004 §4).

Example:
    >>> s = make_schedule("1f1b", num_stages=2, num_microbatches=3)
    >>> s.validate() is s, [s.max_in_flight(k) for k in range(2)]
    (True, [2, 1])
    >>> Schedule.from_json(s.to_json()) == s
    True
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Sequence

from rhino.errors import RhinoError

SCHEDULE_NAMES = ("gpipe", "1f1b", "eager-1f1b")
KINDS = ("F", "B", "A")


class ScheduleError(RhinoError, ValueError):
    """A schedule that breaks a dependency, repeats or misses a task, or exceeds its bound.

    The message names the schedule, the task and clock, what was expected and what was found.
    """


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One cell of a schedule table.

    Attributes:
        kind: ``"F"`` forward, ``"B"`` backward (+ local accumulation), ``"A"`` apply gradients.
        stage: the pipeline stage (= table column) running it.
        microbatch: the microbatch index; None for ``"A"``.
    """

    kind: str
    stage: int
    microbatch: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"task: expected kind in {KINDS}, found {self.kind!r}")
        if (self.kind == "A") != (self.microbatch is None):
            raise ScheduleError(f"task {self.kind}: expected microbatch "
                                f"{'None' if self.kind == 'A' else 'an int'}, found "
                                f"{self.microbatch!r}")

    @property
    def label(self) -> str:
        """``"F3"``, ``"B0"`` or ``"A"`` (the stage is the table column)."""
        return self.kind if self.microbatch is None else f"{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, label: str, stage: int) -> "Task":
        m = re.fullmatch(r"([FB])(\d+)|A", label)
        if m is None:
            raise ScheduleError(f"task label: expected 'F<mb>', 'B<mb>' or 'A', found {label!r}")
        return cls("A", stage) if label == "A" else cls(m.group(1), stage, int(m.group(2)))


def in_flight_bound(name: str, num_stages: int, num_microbatches: int, stage: int) -> int:
    """The most microbatches stage ``stage`` may hold activations for under schedule ``name``."""
    p, m, s = num_stages, num_microbatches, stage
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - s, m)
    if name == "eager-1f1b":
        return min(2 * (p - s) - 1, m)
    raise ScheduleError(f"schedule name: expected one of {SCHEDULE_NAMES}, found {name!r}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static pipeline schedule: ``table[clock][stage]`` is a ``Task`` or None (idle).

    Attributes:
        name: ``"gpipe"``, ``"1f1b"`` or ``"eager-1f1b"`` (selects the in-flight bound).
        num_stages: pipeline stages ``p`` (table width).
        num_microbatches: microbatches ``m`` per step.
        table: one row per clock, one cell per stage.
    """

    name: str
    num_stages: int
    num_microbatches: int
    table: tuple[tuple[Task | None, ...], ...]

    def __post_init__(self):
        object.__setattr__(self, "table", tuple(tuple(row) for row in self.table))

    @property
    def num_clocks(self) -> int:
        return len(self.table)

    def stage_tasks(self, stage: int) -> tuple[Task, ...]:
        """The tasks stage ``stage`` runs, in clock order (its instruction list)."""
        return tuple(row[stage] for row in self.table if row[stage] is not None)

    def clock_of(self) -> dict[Task, int]:
        """Map every task to its clock (first occurrence)."""
        out: dict[Task, int] = {}
        for k, row in enumerate(self.table):
            for t in row:
                if t is not None:
                    out.setdefault(t, k)
        return out

    def in_flight(self, stage: int) -> tuple[int, ...]:
        """Per clock, the microbatches stage ``stage`` holds activations for (after the clock's
        task: an F adds one, a B removes one)."""
        n, out = 0, []
        for row in self.table:
            t = row[stage]
            if t is not None and t.kind == "F":
                n += 1
            out.append(n)  # a backward still holds its activations during its own clock
            if t is not None and t.kind == "B":
                n -= 1
        return tuple(out)

    def max_in_flight(self, stage: int) -> int:
        return max(self.in_flight(stage), default=0)

    def validate(self) -> "Schedule":
        """Check shape, completeness, dependency order and the in-flight bound.

        Returns:
            self, so ``make(...).validate()`` chains.

        Raises:
            ScheduleError: naming the first violation (task, clock, expected, found).
        """
        p, m, who = self.num_stages, self.num_microbatches, f"schedule {self.name!r}"
        if p < 1 or m < 1:
            raise ScheduleError(f"{who}: expected >= 1 stages and microbatches, found "
                                f"p={p}, m={m}")
        seen: dict[Task, int] = {}
        for k, row in enumerate(self.table):
            if len(row) != p:
                raise ScheduleError(f"{who}: expected {p} cells at clock {k}, found {len(row)}")
            for s, t in enumerate(row):
                if t is None:
                    continue
                if t.stage != s:
                    raise ScheduleError(f"{who}: task {t.label} at clock {k}: expected stage "
                                        f"{s} (its column), found stage {t.stage}")
                if t.microbatch is not None and not 0 <= t.microbatch < m:
                    raise ScheduleError(f"{who}: task {t.label} on stage {s} at clock {k}: "
                                        f"expected microbatch in [0, {m}), found {t.microbatch}")
                if t in seen:
                    raise ScheduleError(f"{who}: task {t.label} on stage {s}: expected once, "
                                        f"found at clocks {seen[t]} and {k}")
                seen[t] = k
        expected = {Task(kind, s, mb) for s in range(p) for kind in "FB" for mb in range(m)}
        expected |= {Task("A", s) for s in range(p)}
        missing = sorted(expected - set(seen))
        if missing:
            t = missing[0]
            raise ScheduleError(f"{who}: expected every F, B per (stage, microbatch) and one A "
                                f"per stage, found {len(missing)} missing, first "
                                f"{t.label} on stage {t.stage}")
        for t, k in seen.items():
            for dep in _dependencies(t, p, m):
                if seen[dep] >= k:
                    raise ScheduleError(
                        f"{who}: task {t.label} on stage {t.stage} at clock {k}: expected after "
                        f"{dep.label} on stage {dep.stage}, found that at clock {seen[dep]}")
        for s in range(p):
            bound, got = in_flight_bound(self.name, p, m, s), self.max_in_flight(s)
            if got > bound:
                raise ScheduleError(f"{who}: stage {s}: expected at most {bound} microbatches "
                                    f"in flight, found {got}")
        return self

    def render(self) -> str:
        """The table as text: one line per clock, ``.`` for idle."""
        cells = [[t.label if t is not None else "." for t in row] for row in self.table]
        heads = [f"s{s}" for s in range(self.num_stages)]
        width = [max([len(h)] + [len(r[s]) for r in cells]) for s, h in enumerate(heads)]
        lines = ["clock | " + " | ".join(h.ljust(w) for h, w in zip(heads, width)).rstrip()]
        for k, row in enumerate(cells):
            body = " | ".join(c.ljust(w) for c, w in zip(row, width))
            lines.append(f"{k:>5} | {body}".rstrip())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_stages": self.num_stages,
                "num_microbatches": self.num_microbatches,
                "table": [[t.label if t is not None else None for t in row]
                          for row in self.table]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Schedule":
        table = tuple(tuple(None if c is None else Task.parse(c, s) for s, c in enumerate(row))
                      for row in d["table"])
        return cls(str(d["name"]), int(d["num_stages"]), int(d["num_microbatches"]), table)

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """Inverse of ``to_json``; the result is validated."""
        return cls.from_dict(json.loads(text)).validate()


def _dependencies(t: Task, p: int, m: int) -> list[Task]:
    s, mb = t.stage, t.microbatch
    if t.kind == "F":
        return [Task("F", s - 1, mb)] if s > 0 else []
    if t.kind == "B":
        return [Task("F", s, mb)] + ([Task("B", s + 1, mb)] if s + 1 < p else [])
    return [Task("B", s, j) for j in range(m)]


def _stage_order(stage: int, m: int, warmup: int) -> list[Task]:
    """``warmup`` forwards, then alternate B, F until forwards run out, then the backwards."""
    order = [Task("F", stage, j) for j in range(warmup)]
    f, b = warmup, 0
    while b < m:
        order.append(Task("B", stage, b))
        b += 1
        if f < m:
            order.append(Task("F", stage, f))
            f += 1
    return order + [Task("A", stage)]


def from_stage_orders(name: str, orders: Sequence[Sequence[Task]],
                      num_microbatches: int) -> Schedule:
    """Place per-stage task orders on a clock table, each task as early as its dependencies
    (at earlier clocks) and its stage's previous task allow.

    Raises:
        ScheduleError: if the orders deadlock (a task waits on one queued behind it).
    """
    p, m = len(orders), num_microbatches
    pos, done, rows = [0] * p, {}, []
    total = sum(len(o) for o in orders)
    while len(done) < total:
        k, row = len(rows), [None] * p
        for s in range(p):
            if pos[s] < len(orders[s]):
                t = orders[s][pos[s]]
                if all(done.get(d, k) < k for d in _dependencies(t, p, m)):
                    row[s] = t
        if not any(row):
            stuck = [f"{orders[s][pos[s]].label}@s{s}" for s in range(p)
                     if pos[s] < len(orders[s])]
            raise ScheduleError(f"schedule {name!r}: expected the stage orders to make progress, "
                                f"found a deadlock at clock {k} with {stuck} waiting")
        for s, t in enumerate(row):
            if t is not None:
                done[t] = k
                pos[s] += 1
        rows.append(tuple(row))
    return Schedule(name, p, m, tuple(rows))


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (in microbatch order)."""
    p, m = _check_sizes(num_stages, num_microbatches)
    return from_stage_orders("gpipe", [_stage_order(s, m, m) for s in range(p)], m).validate()


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush), Rhino's default: stage ``s`` warms up with ``p - s - 1``
    forwards, then alternates one forward, one backward."""
    p, m = _check_sizes(num_stages, num_microbatches)
    orders = [_stage_order(s, m, min(p - s, m)) for s in range(p)]
    return from_stage_orders("1f1b", orders, m).validate()


def eager_one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Eager-1F1B (004 §4): stage ``s`` runs ``2 (p - s) - 1`` forwards before its first
    backward, so a forward transfer overlaps other microbatches' compute."""
    p, m = _check_sizes(num_stages, num_microbatches)
    orders = [_stage_order(s, m, min(2 * (p - s) - 1, m)) for s in range(p)]
    return from_stage_orders("eager-1f1b", orders, m).validate()


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build and validate the schedule called ``name`` (one of ``SCHEDULE_NAMES``)."""
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "eager-1f1b": eager_one_f_one_b}
    if name not in builders:
        raise ScheduleError(f"schedule name: expected one of {SCHEDULE_NAMES}, found {name!r}")
    return builders[name](num_stages, num_microbatches)


def _check_sizes(p: int, m: int) -> tuple[int, int]:
    if int(p) < 1 or int(m) < 1:
        raise ScheduleError(f"schedule: expected >= 1 stages and microbatches, found p={p}, "
                            f"m={m}")
    return int(p), int(m)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Start and end times (seconds) of every task when a schedule runs with real durations.

    Attributes:
        start: task -> start time.
        end: task -> end time.
        makespan: the last end time.
    """

    start: Mapping[Task, float]
    end: Mapping[Task, float]
    makespan: float


def simulate(schedule: Schedule, forward_s: float | Sequence[float],
             backward_s: float | Sequence[float], transfer_s: float = 0.0,
             apply_s: float = 0.0) -> Timeline:
    """Run ``schedule``'s per-stage orders with real durations, as an executor would.

    Each stage runs its tasks in table order, one at a time; a task starts when the stage is
    free and its inputs have arrived. A transfer between adjacent stages takes ``transfer_s``
    and overlaps compute (it runs on the network, not on the stage), so a stage may run other
    microbatches' tasks while one is in flight — what eager-1F1B exploits.

    Args:
        schedule: a valid schedule.
        forward_s, backward_s: seconds per forward / backward, one value or one per stage.
        transfer_s: seconds to move one activation (or its gradient) between stages.
        apply_s: seconds per apply-gradients task.

    Returns:
        The ``Timeline``.

    Example:
        >>> simulate(one_f_one_b(2, 2), 1.0, 2.0).makespan
        9.0
    """
    p, m = schedule.num_stages, schedule.num_microbatches
    fwd = _per_stage(forward_s, p, "forward_s")
    bwd = _per_stage(backward_s, p, "backward_s")
    orders = [list(schedule.stage_tasks(s)) for s in range(p)]
    start: dict[Task, float] = {}
    end: dict[Task, float] = {}
    pos, free = [0] * p, [0.0] * p
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                t = orders[s][pos[s]]
                deps = _dependencies(t, p, m)
                if any(d not in end for d in deps):
                    break
                ready = max([free[s]] + [end[d] + (transfer_s if d.stage != s else 0.0)
                                         for d in deps])
                dur = {"F": fwd[s], "B": bwd[s], "A": apply_s}[t.kind]
                start[t], end[t] = ready, ready + dur
                free[s], pos[s], progressed = ready + dur, pos[s] + 1, True
    if any(pos[s] < len(orders[s]) for s in range(p)):
        raise ScheduleError(f"schedule {schedule.name!r}: expected simulate to run every task, "
                            f"found a deadlock (validate the schedule first)")
    return Timeline(start, end, max(end.values(), default=0.0))


def _per_stage(v: float | Sequence[float], p: int, what: str) -> list[float]:
    vals = [float(v)] * p if isinstance(v, (int, float)) else [float(x) for x in v]
    if len(vals) != p or any(x < 0 for x in vals):
        raise ScheduleError(f"simulate {what}: expected one value or {p} non-negative values, "
                            f"found {v!r}")
    return vals
