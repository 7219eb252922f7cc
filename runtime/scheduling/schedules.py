"""Pipeline schedules as plain data: a clock × stage table of tasks.

A ``Schedule`` is what every executor runs: at clock ``k`` stage ``s`` runs ``table[k][s]``
(or idles on ``None``). Tasks are

* ``F<mb>``: forward of microbatch ``mb`` on the stage;
* ``B<mb>``: backward of ``mb`` (compute gradients, then accumulate them locally — the
  local-accumulation task of Rhino §6.1 runs right after its backward on the same stage);
* ``W<mb>`` (split schedules, ``zb-h1``): the backward's second half, the gradients of the
  stage's weights; ``B`` is then only the gradients of the stage's inputs;
* ``A``: apply the accumulated gradients, once per stage after its last backward.

Dependencies (checked by ``Schedule.validate``, each at a strictly earlier clock):
``F(s, mb)`` after ``F(s-1, mb)``; ``B(s, mb)`` after ``B(s+1, mb)`` and after ``F(s, mb)``;
``W(s, mb)`` after ``B(s, mb)``; ``A(s)`` after every ``B(s, ·)`` (split: every
``W(s, ·)``). The *in-flight* microbatches of stage ``s`` at a clock are those whose forward
ran there and whose backward (split: W) has not yet: they hold activations. Each schedule
promises a bound on them (``in_flight_bound``), also checked by ``validate``:

================  ===============================  ====================================
schedule          forwards before 1st B            in-flight bound on stage ``s``
================  ===============================  ====================================
gpipe             all ``m``                        ``m``
1f1b              ``p - s``                        ``min(p - s, m)``
eager-1f1b        ``2 (p - s) - 1`` (004 §4)        ``min(2 (p - s) - 1, m)``
zb-h1             ``p - s``, then up to ``s`` W's  ``min(p, m)`` (1F1B's peak, stage 0)
                  deferred
interleaved-1f1b  ``2 (p - g - 1) + (v - 1) p + 1``  the same, at most ``v m`` (group ``g``)
================  ===============================  ====================================

The executors run ``SCHEDULE_NAMES`` (``zb-h1`` on stage programs whose backward is cut in
two, ``rhino.hlo_passes.backward_split``) and ``VIRTUAL_SCHEDULES``: ``interleaved-1f1b``
with one worker per device group running its stages' programs in the order of the group's
column (``executors.group_worker``: a thread per group on the local executor, a process
per group under ``rhino.launch``, an actor per group and host on Ray).

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

# The schedules of one stage per device group, and those whose groups run several stages
# (virtual stages). Every executor runs the first; the local executor and rhino.launch the
# second (one worker per group: ``executors.group_worker``).
SCHEDULE_NAMES = ("gpipe", "1f1b", "eager-1f1b", "zb-h1")
VIRTUAL_SCHEDULES = ("interleaved-1f1b",)
ALL_SCHEDULES = SCHEDULE_NAMES + VIRTUAL_SCHEDULES
# Schedules whose backward is split into B (gradients of the stage's inputs) and W (of its
# weights); schedules whose device groups each run several stages (virtual stages).
SPLIT_BACKWARD = frozenset({"zb-h1"})
INTERLEAVED = frozenset({"interleaved-1f1b"})
KINDS = ("F", "B", "W", "A")


class ScheduleError(RhinoError, ValueError):
    """A schedule that breaks a dependency, repeats or misses a task, or exceeds its bound.

    The message names the schedule, the task and clock, what was expected and what was found.
    """


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One cell of a schedule table.

    Attributes:
        kind: ``"F"`` forward, ``"B"`` backward (+ local accumulation; under a split
            schedule the gradients of the stage's inputs only), ``"W"`` the gradients of the
            stage's weights (split schedules), ``"A"`` apply gradients.
        stage: the pipeline stage running it; its table column is ``stage % num_stages``
            (the stage itself but under interleaving, where a column is a device group
            running ``virtual_stages`` stages).
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

    def cell(self, interleaved: bool) -> str:
        """The task's text in a table: its label, and under interleaving its stage
        (``"F3/s5"``: forward of microbatch 3 on stage 5)."""
        return f"{self.label}/s{self.stage}" if interleaved else self.label

    @classmethod
    def parse(cls, label: str, stage: int) -> "Task":
        """The task of ``label`` (``"F3"``, ``"W0"``, ``"A"``, or ``"F3/s5"`` naming its
        stage) in column ``stage``."""
        m = re.fullmatch(r"(?:([FBW])(\d+)|A)(?:/s(\d+))?", label)
        if m is None:
            raise ScheduleError(f"task label: expected 'F<mb>', 'B<mb>', 'W<mb>' or 'A' "
                                f"(optionally '/s<stage>'), found {label!r}")
        if m.group(3) is not None:
            stage = int(m.group(3))
        return cls("A", stage) if m.group(1) is None else cls(m.group(1), stage,
                                                               int(m.group(2)))


def in_flight_bound(name: str, num_stages: int, num_microbatches: int, stage: int,
                    virtual_stages: int = 1) -> int:
    """The most microbatches column ``stage`` (a stage, or under interleaving a device group
    of ``virtual_stages`` stages) may hold activations for under schedule ``name``; under a
    split schedule a microbatch is held from its F until its W."""
    p, m, s, v = num_stages, num_microbatches, stage, virtual_stages
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - s, m)
    if name == "eager-1f1b":
        return min(2 * (p - s) - 1, m)
    if name == "zb-h1":
        return min(p, m)
    if name == "interleaved-1f1b":
        return min(_interleaved_warmup(p, v, s), v * m)
    raise ScheduleError(f"schedule name: expected one of {ALL_SCHEDULES}, found {name!r}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static pipeline schedule: ``table[clock][stage]`` is a ``Task`` or None (idle).

    Attributes:
        name: one of ``ALL_SCHEDULES`` (selects the dependencies and the in-flight bound).
        num_stages: pipeline stages ``p`` (table width): under interleaving, device groups.
        num_microbatches: microbatches ``m`` per step.
        table: one row per clock, one cell per stage (device group).
        virtual_stages: stages per device group (``interleaved-1f1b``; 1 otherwise). The
            model is cut into ``num_stages * virtual_stages`` stages; stage ``c`` runs on
            group ``c % num_stages`` (Megatron's order: group ``g`` holds stages ``g``,
            ``g + p``, ``g + 2p``, ...).
    """

    name: str
    num_stages: int
    num_microbatches: int
    table: tuple[tuple[Task | None, ...], ...]
    virtual_stages: int = 1

    def __post_init__(self):
        object.__setattr__(self, "table", tuple(tuple(row) for row in self.table))

    @property
    def num_clocks(self) -> int:
        return len(self.table)

    @property
    def num_chunks(self) -> int:
        """Stages of the model: ``num_stages * virtual_stages``."""
        return self.num_stages * self.virtual_stages

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into B and W tasks."""
        return self.name in SPLIT_BACKWARD

    def stage_tasks(self, stage: int) -> tuple[Task, ...]:
        """The tasks column ``stage`` runs, in clock order (its instruction list)."""
        return tuple(row[stage] for row in self.table if row[stage] is not None)

    def group_of(self, chunk: int) -> int:
        """The column (device group) that runs stage ``chunk`` of the model."""
        return chunk % self.num_stages

    def chunks_of(self, group: int) -> tuple[int, ...]:
        """The stages of the model column ``group`` runs: ``g, g + p, ...``."""
        return tuple(range(group, self.num_chunks, self.num_stages))

    def chunk_tasks(self, chunk: int) -> tuple[Task, ...]:
        """The tasks of stage ``chunk`` of the model, in clock order (the stage's
        instruction list; under interleaving a subsequence of its group's column)."""
        return tuple(t for t in self.stage_tasks(self.group_of(chunk)) if t.stage == chunk)

    def chunk_in_flight(self, chunk: int) -> int:
        """The most microbatches stage ``chunk`` of the model holds activations for at
        once (``in_flight`` for that stage alone)."""
        done = "W" if self.splits_backward else "B"
        n = most = 0
        for t in self.chunk_tasks(chunk):
            n += t.kind == "F"
            most = max(most, n)
            n -= t.kind == done
        return most

    def clock_of(self) -> dict[Task, int]:
        """Map every task to its clock (first occurrence)."""
        out: dict[Task, int] = {}
        for k, row in enumerate(self.table):
            for t in row:
                if t is not None:
                    out.setdefault(t, k)
        return out

    def in_flight(self, stage: int) -> tuple[int, ...]:
        """Per clock, the microbatches column ``stage`` holds activations for (after the
        clock's task: an F adds one, a B removes one; under a split schedule a W)."""
        done = "W" if self.splits_backward else "B"
        n, out = 0, []
        for row in self.table:
            t = row[stage]
            if t is not None and t.kind == "F":
                n += 1
            out.append(n)  # a backward still holds its activations during its own clock
            if t is not None and t.kind == done:
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
        v, n = self.virtual_stages, self.num_chunks
        if p < 1 or m < 1:
            raise ScheduleError(f"{who}: expected >= 1 stages and microbatches, found "
                                f"p={p}, m={m}")
        if self.name not in ALL_SCHEDULES:
            raise ScheduleError(f"{who}: expected a name in {ALL_SCHEDULES}")
        if (v >= 2) != (self.name in INTERLEAVED):
            raise ScheduleError(f"{who}: expected virtual_stages "
                                f"{'>= 2' if self.name in INTERLEAVED else '1'}, found {v}")
        seen: dict[Task, int] = {}
        for k, row in enumerate(self.table):
            if len(row) != p:
                raise ScheduleError(f"{who}: expected {p} cells at clock {k}, found {len(row)}")
            for s, t in enumerate(row):
                if t is None:
                    continue
                if not 0 <= t.stage < n or t.stage % p != s:
                    raise ScheduleError(f"{who}: task {t.label} at clock {k}: expected a stage "
                                        f"of column {s} below {n}, found stage {t.stage}")
                if t.kind == "W" and not self.splits_backward:
                    raise ScheduleError(f"{who}: task {t.label} on stage {s} at clock {k}: "
                                        f"expected no W (the backward is not split), found one")
                if t.microbatch is not None and not 0 <= t.microbatch < m:
                    raise ScheduleError(f"{who}: task {t.label} on stage {s} at clock {k}: "
                                        f"expected microbatch in [0, {m}), found {t.microbatch}")
                if t in seen:
                    raise ScheduleError(f"{who}: task {t.label} on stage {s}: expected once, "
                                        f"found at clocks {seen[t]} and {k}")
                seen[t] = k
        kinds = "FBW" if self.splits_backward else "FB"
        expected = {Task(kind, s, mb) for s in range(n) for kind in kinds for mb in range(m)}
        expected |= {Task("A", s) for s in range(n)}
        missing = sorted(expected - set(seen))
        if missing:
            t = missing[0]
            raise ScheduleError(f"{who}: expected every {', '.join(kinds)} per (stage, "
                                f"microbatch) and one A "
                                f"per stage, found {len(missing)} missing, first "
                                f"{t.label} on stage {t.stage}")
        for t, k in seen.items():
            for dep in _dependencies(t, n, m, self.splits_backward):
                if seen[dep] >= k:
                    raise ScheduleError(
                        f"{who}: task {t.label} on stage {t.stage} at clock {k}: expected after "
                        f"{dep.label} on stage {dep.stage}, found that at clock {seen[dep]}")
        for s in range(p):
            bound, got = in_flight_bound(self.name, p, m, s, v), self.max_in_flight(s)
            if got > bound:
                raise ScheduleError(f"{who}: stage {s}: expected at most {bound} microbatches "
                                    f"in flight, found {got}")
        return self

    def render(self) -> str:
        """The table as text: one line per clock, ``.`` for idle."""
        inter = self.virtual_stages > 1
        cells = [[t.cell(inter) if t is not None else "." for t in row] for row in self.table]
        heads = [f"{'g' if inter else 's'}{s}" for s in range(self.num_stages)]
        width = [max([len(h)] + [len(r[s]) for r in cells]) for s, h in enumerate(heads)]
        lines = ["clock | " + " | ".join(h.ljust(w) for h, w in zip(heads, width)).rstrip()]
        for k, row in enumerate(cells):
            body = " | ".join(c.ljust(w) for c, w in zip(row, width))
            lines.append(f"{k:>5} | {body}".rstrip())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        inter = self.virtual_stages > 1
        out = {"name": self.name, "num_stages": self.num_stages,
               "num_microbatches": self.num_microbatches,
               "table": [[t.cell(inter) if t is not None else None for t in row]
                         for row in self.table]}
        if inter:
            out["virtual_stages"] = self.virtual_stages
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Schedule":
        table = tuple(tuple(None if c is None else Task.parse(c, s) for s, c in enumerate(row))
                      for row in d["table"])
        return cls(str(d["name"]), int(d["num_stages"]), int(d["num_microbatches"]), table,
                   int(d.get("virtual_stages", 1)))

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """Inverse of ``to_json``; the result is validated."""
        return cls.from_dict(json.loads(text)).validate()


def _dependencies(t: Task, p: int, m: int, split: bool = False) -> list[Task]:
    """What ``t`` waits for, with ``p`` stages (all stages, virtual ones included)."""
    s, mb = t.stage, t.microbatch
    if t.kind == "F":
        return [Task("F", s - 1, mb)] if s > 0 else []
    if t.kind == "B":
        return [Task("F", s, mb)] + ([Task("B", s + 1, mb)] if s + 1 < p else [])
    if t.kind == "W":
        return [Task("B", s, mb)]
    return [Task("W" if split else "B", s, j) for j in range(m)]


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
                      num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Place per-column task orders on a clock table, each task as early as its dependencies
    (at earlier clocks) and its column's previous task allow.

    Raises:
        ScheduleError: if the orders deadlock (a task waits on one queued behind it).
    """
    p, m = len(orders), num_microbatches
    n, split = p * virtual_stages, name in SPLIT_BACKWARD
    pos, done, rows = [0] * p, {}, []
    total = sum(len(o) for o in orders)
    while len(done) < total:
        k, row = len(rows), [None] * p
        for s in range(p):
            if pos[s] < len(orders[s]):
                t = orders[s][pos[s]]
                if all(done.get(d, k) < k for d in _dependencies(t, n, m, split)):
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
    return Schedule(name, p, m, tuple(rows), virtual_stages)


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


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (zero bubble, Qi et al. 2024): each backward split into B (gradients of the
    stage's inputs, which the previous stage waits for) and W (gradients of the stage's
    weights, which nothing downstream waits for). Stage ``s`` warms up as 1F1B, then runs
    B as soon as it can and defers up to ``s`` W's into what would be bubbles, so no stage
    holds more than ``p`` microbatches (stage 0's peak under 1F1B). With F, B and W of equal
    time the bubble is a third of 1F1B's: ``(p - 1) / 3m`` against ``(p - 1) / m``.

    >>> print(zb_h1(3, 3).render())
    clock | s0 | s1 | s2
        0 | F0 | .  | .
        1 | F1 | F0 | .
        2 | F2 | F1 | F0
        3 | .  | .  | B0
        4 | .  | B0 | F1
        5 | B0 | F2 | B1
        6 | W0 | B1 | F2
        7 | B1 | W0 | B2
        8 | W1 | B2 | W0
        9 | B2 | W1 | W1
       10 | W2 | W2 | W2
       11 | A  | A  | A
    """
    p, m = _check_sizes(num_stages, num_microbatches)
    orders = []
    for s in range(p):
        warm = min(p - s, m)
        order = [Task("F", s, j) for j in range(warm)]
        f, pending = warm, []
        for j in range(m):
            order.append(Task("B", s, j))
            pending.append(j)
            while len(pending) > s:
                order.append(Task("W", s, pending.pop(0)))
            if f < m:
                order.append(Task("F", s, f))
                f += 1
        orders.append(order + [Task("W", s, j) for j in pending] + [Task("A", s)])
    return from_stage_orders("zb-h1", orders, m).validate()


def _interleaved_warmup(p: int, v: int, group: int) -> int:
    """Forwards device group ``group`` runs before its first backward under interleaved
    1F1B: Megatron's ``2 (p - g - 1) + (v - 1) p`` warm-up, and the steady state's first."""
    return 2 * (p - group - 1) + (v - 1) * p + 1


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int,
                            virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline stages): the model is cut into
    ``p v`` stages and device group ``g`` runs stages ``g, g + p, ..., g + (v - 1) p``.
    Microbatches (a multiple of ``p``) go through in blocks of ``p``: a group runs a
    block's forwards on its first stage, then its second, ...; backwards the other way
    round. Each task is ``1/v`` of a 1F1B task, so the bubble is ``(p - 1) / (v m)``, paid
    for by ``v`` times the stage-to-stage transfers and more activations in flight. Cells
    name their stage.

    >>> print(interleaved_one_f_one_b(2, 2, 2).render())
    clock | g0    | g1
        0 | F0/s0 | .
        1 | F1/s0 | F0/s1
        2 | F0/s2 | F1/s1
        3 | F1/s2 | F0/s3
        4 | .     | B0/s3
        5 | B0/s2 | F1/s3
        6 | .     | B1/s3
        7 | B1/s2 | B0/s1
        8 | B0/s0 | B1/s1
        9 | B1/s0 | A/s1
       10 | A/s0  | A/s3
       11 | A/s2  | .
    """
    p, m = _check_sizes(num_stages, num_microbatches)
    v = int(virtual_stages)
    if v < 2:
        raise ScheduleError(f"interleaved-1f1b: expected virtual_stages >= 2, found "
                            f"{virtual_stages!r} (one stage per group is '1f1b')")
    if m % p:
        # Megatron asks the same: with a partial block of microbatches the orders below
        # can deadlock, and the bubble is no longer (p - 1) / (v m).
        raise ScheduleError(f"interleaved-1f1b: expected microbatches a multiple of the "
                            f"{p} device groups, found {m}")
    orders = []
    for g in range(p):
        fwd, bwd = [], []
        for b in range(0, m, p):
            block = range(b, min(b + p, m))
            fwd += [Task("F", k * p + g, j) for k in range(v) for j in block]
            bwd += [Task("B", k * p + g, j) for k in reversed(range(v)) for j in block]
        warm = min(_interleaved_warmup(p, v, g), len(fwd))
        order, rest = fwd[:warm], fwd[warm:]
        for i, t in enumerate(bwd):
            order.append(t)
            if i < len(rest):
                order.append(rest[i])
        orders.append(order + [Task("A", k * p + g) for k in range(v)])
    return from_stage_orders("interleaved-1f1b", orders, m, v).validate()


def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  virtual_stages: int = 1) -> Schedule:
    """Build and validate the schedule called ``name`` (one of ``ALL_SCHEDULES``).

    ``virtual_stages`` (stages per device group) is for ``interleaved-1f1b``, which needs
    at least 2; the other schedules take 1.
    """
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "eager-1f1b": eager_one_f_one_b,
                "zb-h1": zb_h1}
    if name == "interleaved-1f1b":
        return interleaved_one_f_one_b(num_stages, num_microbatches, virtual_stages)
    if name not in builders:
        raise ScheduleError(f"schedule name: expected one of {ALL_SCHEDULES}, found {name!r}")
    if virtual_stages != 1:
        raise ScheduleError(f"schedule {name!r}: expected virtual_stages 1 (only "
                            f"'interleaved-1f1b' has virtual stages), found {virtual_stages!r}")
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
             apply_s: float = 0.0, weight_s: float | Sequence[float] | None = None
             ) -> Timeline:
    """Run ``schedule``'s per-column orders with real durations, as an executor would.

    Each column (stage, or device group under interleaving) runs its tasks in table order,
    one at a time; a task starts when the column is free and its inputs have arrived. A
    transfer between columns takes ``transfer_s`` and overlaps compute (it runs on the
    network, not on the stage), so a stage may run other microbatches' tasks while one is
    in flight — what eager-1F1B exploits. Between two stages of one device group nothing
    moves.

    Args:
        schedule: a valid schedule.
        forward_s, backward_s: seconds per forward / backward, one value or one per stage
            (``num_chunks`` values under interleaving). Under a split schedule
            ``backward_s`` is B's time (the gradients of the stage's inputs) and
            ``weight_s`` W's.
        transfer_s: seconds to move one activation (or its gradient) between stages.
        apply_s: seconds per apply-gradients task.
        weight_s: seconds per W task; required by split schedules, refused by the others.

    Returns:
        The ``Timeline``.

    Example:
        >>> simulate(one_f_one_b(2, 2), 1.0, 2.0).makespan
        9.0
        >>> simulate(zb_h1(2, 2), 1.0, 1.0, weight_s=1.0).makespan
        7.0
    """
    p, m, n = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
    split = schedule.splits_backward
    if split != (weight_s is not None):
        raise ScheduleError(f"simulate {schedule.name!r}: expected weight_s "
                            f"{'(its W tasks take time)' if split else 'None (no W tasks)'}, "
                            f"found {weight_s!r}")
    fwd = _per_stage(forward_s, n, "forward_s")
    bwd = _per_stage(backward_s, n, "backward_s")
    wgt = _per_stage(weight_s, n, "weight_s") if split else [0.0] * n
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
                deps = _dependencies(t, n, m, split)
                if any(d not in end for d in deps):
                    break
                ready = max([free[s]] + [end[d] + (transfer_s if d.stage % p != s else 0.0)
                                         for d in deps])
                c = t.stage
                dur = {"F": fwd[c], "B": bwd[c], "W": wgt[c], "A": apply_s}[t.kind]
                start[t], end[t] = ready, ready + dur
                free[s], pos[s], progressed = ready + dur, pos[s] + 1, True
    if any(pos[s] < len(orders[s]) for s in range(p)):
        raise ScheduleError(f"schedule {schedule.name!r}: expected simulate to run every task, "
                            f"found a deadlock (validate the schedule first)")
    return Timeline(start, end, max(end.values(), default=0.0))


def bubble_rate(schedule: Schedule, timeline: Timeline) -> float:
    """Idle time over busy time, summed over the columns: ``(p T - busy) / busy`` for a
    makespan ``T`` — the rate whose closed forms are ``(p - 1) / m`` (1F1B, equal stages),
    ``(p - 1) / 3m`` (ZB-H1 with F, B and W of equal time) and ``(p - 1) / (v m)``
    (interleaved). Apply tasks count as busy.

    >>> s = one_f_one_b(4, 8)
    >>> bubble_rate(s, simulate(s, 1.0, 2.0))
    0.375
    """
    busy = sum(timeline.end[t] - timeline.start[t] for t in timeline.end)
    if busy <= 0:
        raise ScheduleError(f"bubble_rate {schedule.name!r}: expected tasks that take time, "
                            f"found {busy} s busy")
    return (schedule.num_stages * timeline.makespan - busy) / busy


def _per_stage(v: float | Sequence[float], p: int, what: str) -> list[float]:
    vals = [float(v)] * p if isinstance(v, (int, float)) else [float(x) for x in v]
    if len(vals) != p or any(x < 0 for x in vals):
        raise ScheduleError(f"simulate {what}: expected one value or {p} non-negative values, "
                            f"found {v!r}")
    return vals
