"""Stage programs: a training step split into per-stage forward, backward and apply programs.

Rhino §6.1 runs a pipelined step as tasks: ``F(s, mb)`` and ``B(s, mb)`` (the forward and
backward halves of compute-gradients of stage ``s`` on microbatch ``mb``; the local
accumulation of Fig. 6b is fused into them) and ``A(s)`` (apply-gradients, once per step).
This module cuts a one-device step into those programs, at the level of the step's jaxpr
traced at the *whole* batch: the microbatches are a sharding of the batch over time
(``rhino.jaxpr.microbatch``), so the programs compute what the step computes on the whole
batch, by construction.

Pass order::

    step traced at the whole batch
        │ flatten          one flat list of leaf equations (calls inlined), integer refs
        ▼
        │ assignment       path -> (role, stage), from the pipeline plan's op stages through
        │                  the HLO op_name scopes (``assignment_from_ops``) or given by hand
        ▼
        │ split_step       roles re-derived on the jaxpr; a sum of gradient parts from two
        │                  stages (a tied weight) moved to apply-gradients; every value's
        │                  microbatch layout (whole / split / partial / total); per stage a
        │                  prologue (values computed whole from the batch, once per step),
        │                  per task its equations (plus the free equations it needs,
        │                  recomputed), inputs, outputs and accumulators; apply tasks cut
        │                  into phases where stages' updates read each other (global-norm
        │                  clipping, a finite check over every gradient)
        ▼
    StepSplit            tasks F/B/A per stage; task_function() builds each program

Per microbatch, F and B read their microbatch's slice of the batch and of the whole values
cut along the batch, and add what leaves them into accumulators, each by its value's rule:
a partial sum is summed (``sum(loss) / n`` of each microbatch adds up to the mean over the
batch, in float32 for lower-precision floats), a maximum kept, a per-example value put in
its place of the whole batch. Apply-gradients reads the results.

The split is a pure function of the traced jaxpr and the assignment, so a Ray actor rebuilds
the same programs from the step function, the argument shapes and the assignment (plain
data) and never receives a jaxpr.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def step(w, x):
    ...     loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    ...     return w - 0.1 * g, loss
    >>> flat = flatten(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((8, 4))))
    >>> sp = split_step(flat, {}, batch_refs=(1,), num_stages=1, num_microbatches=2)
    >>> sorted(t.label for t in sp.tasks.values() if t.eqns)
    ['A0', 'F0']
    >>> [o.source for o in sp.outputs]   # new weights once per step; the loss summed
    ['task', 'acc']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Mapping, Sequence

from rhino.errors import RhinoError
from rhino.hlo_passes.unroll import INDEX_SCOPE
from rhino.jaxpr import primitives as prims
from rhino.jaxpr.interpret import FlatEqn, FlatProgram, Lit, flatten
from rhino.jaxpr.microbatch import (MicrobatchLayout, Place, analyze, ancestors,
                                    prologue_equations)
from rhino.jaxpr.layouts import Layout
from rhino.hlo_passes import stage_effects
from rhino.hlo_passes.stage_shardings import StageShardings, constraints
from rhino.vocabulary import Role
# The programs of a split (``task_programs``), still importable from here.
from rhino.hlo_passes.task_programs import finish_acc, prologue_function, task_function

__all__ = ["FlatEqn", "FlatProgram", "Lit", "flatten", "StageSplitError", "StageShardings",
           "constraints",
           "TaskInput", "TaskSpec", "StepOutput", "StepSplit", "Prologue", "split_step",
           "task_function", "prologue_function", "finish_acc", "assignment_from_ops",
           "is_apply"]


class StageSplitError(RhinoError):
    """The step cannot be split into stage programs as asked."""


def is_apply(kind: str) -> bool:
    """An apply-gradients task kind: ``A``, or a later phase of it (``A1``, ``A2``...)."""
    return kind.startswith("A")


def apply_kind(phase: int) -> str:
    return "A" if phase == 0 else f"A{phase}"


@dataclasses.dataclass(frozen=True)
class TaskInput:
    """Where a task input comes from.

    Attributes:
        ref: the value.
        source: ``arg`` (a state argument), ``batch`` (a batch argument: the task's
            microbatch slice), ``pre`` (a value of the stage's prologue, whole, or a batch
            argument whole), ``task`` (an output of task ``producer`` on the same
            microbatch, or of an apply task), ``acc`` (a value accumulated over all
            microbatches by ``producer``).
        producer: ``(kind, stage)`` of the producing task, for ``task`` and ``acc``.
    """

    ref: int
    source: str
    producer: tuple[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One stage program.

    Attributes:
        kind: ``F``, ``B``, ``A`` (or a later apply phase ``A1``...); stage: its stage.
        eqns: indices into ``FlatProgram.eqns`` in program order (own and recomputed free
            equations).
        inputs: its inputs, in the program's argument order.
        outputs: refs it produces that other tasks or the step's results read.
        accumulate: refs (among its values) accumulated over microbatches (F and B only),
            each by its rule (``StepSplit.acc_rules``).
        effects: host effects nothing reads a result of, run after the task by its
            effects program (apply tasks only; ``stage_effects``), on ``effect_inputs``,
            which the task hands out after its outputs.
    """

    kind: str
    stage: int
    eqns: tuple[int, ...]
    inputs: tuple[TaskInput, ...]
    outputs: tuple[int, ...]
    accumulate: tuple[int, ...]
    effects: tuple[int, ...] = ()
    effect_inputs: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[str, int]:
        return (self.kind, self.stage)

    @property
    def label(self) -> str:
        return f"{self.kind}{self.stage}"

    @property
    def empty(self) -> bool:
        """The task computes nothing: no equations, outputs or accumulators (the backward
        task of a stage holding no trained weights, the apply task of a stage that is only
        the loss), and no host effects. An empty task has no program: none is exported for
        it (``runtime.executors.artifacts``) and no instruction list runs it
        (``runtime.scheduling.instructions``)."""
        return not (self.eqns or self.outputs or self.accumulate or self.effects)


@dataclasses.dataclass(frozen=True)
class Prologue:
    """What a stage computes once per step before its first microbatch: values computed
    from the batch (and state) that its tasks read whole, at their whole shapes.

    Attributes:
        eqns: flat equation indices, in program order.
        inputs: flat arguments it reads (whole).
        outputs: refs its tasks (or the step's results) read.
    """

    eqns: tuple[int, ...] = ()
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Where a flat result of the step comes from: ``lit`` (value), ``arg`` (ref),
    ``task`` (an apply task's ref), ``acc`` (accumulated ref of producer), ``pre`` (a
    prologue value of stage ``producer[1]``)."""

    source: str
    ref: int | None = None
    producer: tuple[str, int] | None = None
    value: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class StepSplit:
    """A step cut into stage programs (see the module docstring).

    Attributes:
        flat: the flattened step (whole-batch shapes).
        num_stages, num_microbatches: as asked.
        tasks: ``(kind, stage) -> TaskSpec`` for every kind and stage (possibly empty).
        outputs: per flat result of the step, its source.
        role, stage: per flat equation, its role and stage (-1 for free equations).
        batch_refs: the flat arguments carrying the batch (split along axis 0).
        consumers: ``ref -> {(kind, stage) of tasks reading it}``.
        layout: every value's microbatch layout (``rhino.jaxpr.microbatch``).
        prologues: per stage, its ``Prologue``.
        acc_rules: accumulated ref -> ``(rule, axis)``: ``sum``, ``max``, ``min``, ``mean``
            (of per-microbatch statistics, ``per_microbatch_statistics``; axis None) or
            ``concat`` (the axis its microbatches' chunks make up).
        apply_phases: per stage, its apply task kinds in order (``A``, ``A1``, ...).
    """

    flat: FlatProgram
    num_stages: int
    num_microbatches: int
    tasks: Mapping[tuple[str, int], TaskSpec]
    outputs: tuple[StepOutput, ...]
    role: tuple[str, ...]
    stage: tuple[int, ...]
    batch_refs: tuple[int, ...]
    consumers: Mapping[int, frozenset]
    layout: MicrobatchLayout
    prologues: Mapping[int, Prologue]
    acc_rules: Mapping[int, tuple[str, int | None]]
    apply_phases: Mapping[int, tuple[str, ...]]

    def task(self, kind: str, stage: int) -> TaskSpec:
        return self.tasks[(kind, stage)]

    def stage_args(self, stage: int) -> tuple[int, ...]:
        """Flat arguments (state and batch) any task or the prologue of ``stage`` reads."""
        refs = {i.ref for (k, s), t in self.tasks.items() if s == stage for i in t.inputs
                if i.source in ("arg", "batch") or (i.source == "pre"
                                                    and i.ref < self.flat.num_args)}
        refs |= set(self.prologues[stage].inputs)
        return tuple(sorted(refs))

    def whole_batch_args(self, stage: int) -> frozenset[int]:
        """Batch arguments ``stage`` reads whole (its prologue, or whole reads)."""
        whole = set(self.prologues[stage].inputs)
        whole |= {i.ref for (k, s), t in self.tasks.items() if s == stage for i in t.inputs
                  if i.source == "pre" and i.ref < self.flat.num_args}
        return frozenset(whole & set(self.batch_refs))

    def sliced_batch_args(self, stage: int) -> frozenset[int]:
        """Batch arguments ``stage``'s tasks read microbatch by microbatch."""
        return frozenset(i.ref for (k, s), t in self.tasks.items() if s == stage
                         for i in t.inputs if i.source == "batch")

    def microbatch_shape(self, ref: int) -> tuple[int, ...]:
        """The shape a task sees of ``ref``: its microbatch chunk's where it is split."""
        return tuple(self.layout.mb_shapes.get(ref, self.flat.avals[ref].shape))

    def summary(self) -> dict[str, Any]:
        counts = {t.label: len(t.eqns) for t in self.tasks.values()}
        counts.update({f"P{s}": len(p.eqns) for s, p in self.prologues.items() if p.eqns})
        return {"num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
                "eqns": counts}


def _role_rank(role: str) -> int:
    return Role(role).rank


def split_step(flat: FlatProgram, assignment: Mapping[tuple[int, ...], tuple[str, int]],
               batch_refs: Sequence[int], num_stages: int, num_microbatches: int, *,
               key_refs: Collection[int] = (), per_microbatch_statistics: bool = False
               ) -> StepSplit:
    """Cut a flattened step into per-stage programs.

    Args:
        flat: ``flatten(...)`` of the step traced at the whole batch.
        assignment: equation path -> ``(role, stage)`` (role ``fwd``/``bwd``/``ag``/``free``);
            equations missing from it get their role and stage from their operands.
        batch_refs: flat argument refs that carry the batch (split along their dimension 0).
        num_stages, num_microbatches: ``p`` and ``m``.
        key_refs: flat arguments that are PRNG keys (neither batch nor training state).
        per_microbatch_statistics: statistics of the whole batch that the gradients need
            are each microbatch's own (``microbatch.analyze``) instead of refused.

    Returns:
        The ``StepSplit``; its ``layout.couplings`` lists what needs the whole batch at once
        (the caller refuses the step: ``hlo_passes.lower``).

    Raises:
        StageSplitError: bad sizes, an assignment naming a stage out of range, or a value
            no program can be made of (named).
    """
    m = int(num_microbatches)
    if num_stages < 1 or m < 1:
        raise StageSplitError(f"expected num_stages >= 1 and num_microbatches >= 1, found "
                              f"{num_stages} and {num_microbatches}")
    bad = [b for b in batch_refs if not 0 <= b < flat.num_args]
    if bad or not batch_refs:
        raise StageSplitError(f"batch arguments: expected flat argument indices in "
                              f"[0, {flat.num_args}), found {list(batch_refs)}")
    for path, (role, stage) in assignment.items():
        if role not in tuple(Role) or not -1 <= stage < num_stages:
            raise StageSplitError(f"assignment of equation {path}: expected a role in "
                                  f"free/fwd/bwd/ag and a stage in [-1, {num_stages}), found "
                                  f"({role!r}, {stage})")
    for r in batch_refs:
        shape = tuple(flat.avals[r].shape)
        if not shape or shape[0] % m:
            raise StageSplitError(f"batch argument #{r}: expected a leading dimension "
                                  f"divisible by num_microbatches={m}, found shape {shape}")
    n = len(flat.eqns)
    batch = set(batch_refs)
    role, stage, prod = _roles(flat, assignment, batch, num_stages)
    _sink_cross_stage_sums(flat, role, stage, prod)

    # What compute-gradients hands to apply-gradients (the gradients) must be made per
    # microbatch: a whole-batch value among what it depends on is a coupling.
    cg = {i for i in range(n) if role[i] in (Role.FORWARD, Role.BACKWARD)}
    post = {i for i in range(n) if role[i] == Role.APPLY}
    handed = {x for i in post for x in flat.eqns[i].ins
              if isinstance(x, int) and x in prod and prod[x] in cg}
    feeds = ancestors(flat, handed) & cg
    state = [r for r in range(flat.num_args) if r not in batch and r not in set(key_refs)]
    layout = analyze(flat, sorted(batch), m, state_refs=state, post=post,
                     feeds_gradient=feeds, per_microbatch=cg,
                     per_microbatch_statistics=per_microbatch_statistics,
                     batch_free_scope=INDEX_SCOPE)
    dead, once = stage_effects.liveness(flat)      # host effects: once per step
    after = stage_effects.place_once(flat, once, role, stage)
    for i in range(n):
        where = layout.place[i]
        if i in dead:                   # nothing reads it (jax.jit leaves it out too)
            role[i], stage[i] = Role.FREE, -1
        elif where is Place.POST:
            if role[i] != Role.APPLY:
                role[i] = Role.APPLY
                stage[i] = max(stage[i], 0)
        elif where in (Place.FREE, Place.PROLOGUE) and i not in once:
            role[i] = Role.FREE
            stage[i] = -1
    pre = {i for i in range(n) if layout.place[i] is Place.PROLOGUE and i not in once | dead}
    pre |= stage_effects.whole_callbacks(flat, layout, once)
    phase = _apply_phases(flat, role, stage, prod, after)

    def key_of(i: int) -> tuple[str, int]:
        r = role[i]
        return (apply_kind(phase[i]), stage[i]) if r == Role.APPLY else (r.task, stage[i])

    task_eqns: dict[tuple[str, int], list[int]] = {}
    for s in range(num_stages):
        for k in ("F", "B", "A"):
            task_eqns[(k, s)] = []
    for i in range(n):
        if role[i] != Role.FREE:
            task_eqns.setdefault(key_of(i), []).append(i)
    owner: dict[int, tuple[str, int]] = {}
    for key, idx in task_eqns.items():
        for i in idx:
            for r in flat.eqns[i].outs:
                if r is not None:
                    owner[r] = key

    def free(x: Any) -> bool:
        return isinstance(x, int) and x in prod and role[prod[x]] == Role.FREE and \
            prod[x] not in pre

    def free_closure(refs: list) -> set[int]:
        seen: set[int] = set()
        stack = [prod[r] for r in refs if free(r)]
        while stack:
            e = stack.pop()
            if e in seen:
                continue
            seen.add(e)
            stack.extend(prod[x] for x in flat.eqns[e].ins if free(x))
        return seen

    # The step's results: where each comes from.
    outputs: list[StepOutput] = []
    out_free: list[int] = []
    pre_out: set[int] = set()
    acc_refs: dict[tuple[str, int], set[int]] = {k: set() for k in task_eqns}
    for x in flat.outs:
        if isinstance(x, Lit):
            outputs.append(StepOutput("lit", value=x.value))
        elif x in flat.consts:
            outputs.append(StepOutput("lit", value=flat.consts[x]))
        elif x < flat.num_args:
            outputs.append(StepOutput("arg", x))
        elif prod[x] in pre:
            outputs.append(StepOutput("pre", x, ("P", 0)))
            pre_out.add(x)
        elif free(x):
            out_free.append(x)
            outputs.append(StepOutput("task", x, ("A", 0)))
        elif not is_apply(owner[x][0]):
            outputs.append(StepOutput("acc", x, owner[x]))
            acc_refs[owner[x]].add(x)
        else:
            outputs.append(StepOutput("task", x, owner[x]))
    all_eqns = {k: sorted(set(idx) | free_closure(
        [x for i in idx for x in flat.eqns[i].ins])) for k, idx in task_eqns.items()}
    all_eqns[("A", 0)] = sorted(set(all_eqns[("A", 0)]) | free_closure(out_free))

    consumers: dict[int, set] = {}
    # Tasks reading a value per microbatch (or an apply's value); a value only applies read
    # accumulated is no output of its producer: one buffer per microbatch, held to the
    # step's end, for what the accumulator already carries.
    task_readers: dict[int, set] = {}
    inputs_of: dict[tuple[str, int], list[TaskInput]] = {}
    pre_refs: dict[int, set[int]] = {s: set() for s in range(num_stages)}
    pre_refs[0] |= pre_out
    split0 = Layout("split", axis=0)
    for key, idx in all_eqns.items():
        kind, s = key
        made = {r for i in idx for r in flat.eqns[i].outs if r is not None}
        ins: list[TaskInput] = []
        seen: set[tuple[int, str]] = set()

        def add(x: int, source: str, producer=None) -> None:
            if (x, source) not in seen:
                seen.add((x, source))
                ins.append(TaskInput(x, source, producer))

        for i in idx:
            for j, x in enumerate(flat.eqns[i].ins):
                if not isinstance(x, int) or x in flat.consts:
                    continue
                use = layout.use(i, j)
                whole_read = use is not None and use.kind == "whole"
                if x < flat.num_args:
                    if x not in batch:
                        add(x, "arg")
                    elif layout.place[i] is Place.MICRO and not whole_read and \
                            layout.layout[x] == split0:
                        add(x, "batch")       # sliced by the executor; else chunked here
                    else:
                        add(x, "pre")         # the whole batch argument
                    continue
                if whole_read or prod[x] in pre:
                    if x not in made or whole_read:
                        add(x, "pre")
                        pre_refs[s].add(x)
                    continue
                if x in made:
                    continue
                src = owner[x]
                _check_direction(key, src, flat.eqns[i].path)
                if is_apply(kind) and not is_apply(src[0]):
                    add(x, "acc", src)
                    acc_refs[src].add(x)
                else:
                    add(x, "task", src)
                    task_readers.setdefault(x, set()).add(key)
                consumers.setdefault(x, set()).add(key)
        inputs_of[key] = ins
    acc_rules = {r: _acc_rule(layout, r) for refs in acc_refs.values() for r in refs}
    tasks: dict[tuple[str, int], TaskSpec] = {}
    for key, idx in all_eqns.items():
        made = {r for i in idx for r in flat.eqns[i].outs if r is not None}
        outs = sorted(r for r in made if (task_readers.get(r, set()) - {key})
                      or any(o.ref == r and o.source == "task" for o in outputs))
        fx = tuple(i for i in idx if i in once)      # run by its effects program
        acc = tuple(sorted(acc_refs.get(key, ())))
        tasks[key] = TaskSpec(key[0], key[1], tuple(i for i in idx if i not in once),
                              tuple(inputs_of[key]), tuple(outs), acc, fx,
                              stage_effects.effect_inputs(flat, fx))
    prologues = {}
    for s in range(num_stages):
        eqns = prologue_equations(flat, layout, pre_refs[s])
        args = sorted({x for i in eqns for x in flat.eqns[i].ins
                       if isinstance(x, int) and x < flat.num_args}
                      | {x for x in pre_refs[s] if x < flat.num_args})
        prologues[s] = Prologue(tuple(eqns), tuple(args), tuple(sorted(pre_refs[s])))
    phases = {s: tuple(sorted({k for (k, t) in tasks if t == s and is_apply(k)},
                              key=lambda k: int(k[1:] or 0))) for s in range(num_stages)}
    split = StepSplit(flat, num_stages, m, tasks, tuple(outputs), tuple(role), tuple(stage),
                      tuple(sorted(batch)), {r: frozenset(c) for r, c in consumers.items()},
                      layout, prologues, acc_rules, phases)
    if (refused := stage_effects.check(split)) is not None:
        raise StageSplitError(refused)
    return split


def _acc_rule(layout: MicrobatchLayout, ref: int) -> tuple[str, int | None]:
    lay = layout.layout[ref]
    if lay.kind == "partial":
        return (lay.op, None)
    if lay.kind == "split" and lay.pair is None:
        return ("concat", lay.axis)
    if lay.kind == "local":
        return ("mean", None)       # each microbatch's own (per_microbatch_statistics)
    raise StageSplitError(f"value #{ref} ({lay}) leaves a per-microbatch task: expected a "
                          f"partial, split or per-microbatch value")


def _roles(flat: FlatProgram, assignment: Mapping, batch: set[int], num_stages: int
           ) -> tuple[list, list, dict[int, int]]:
    """Per equation its role and stage: given by ``assignment`` or derived from its
    operands (forward < backward < apply; forward data flows to later stages, backward
    data to earlier ones); batch-independent equations are free."""
    n = len(flat.eqns)
    dep: dict[int, bool] = {r: (r in batch) for r in range(flat.num_args)}
    prod: dict[int, int] = {}
    role = [Role.FREE] * n
    stage = [-1] * n
    for i, fe in enumerate(flat.eqns):
        refs = [x for x in fe.ins if isinstance(x, int)]
        d = any(dep.get(r, False) for r in refs)
        for r in fe.outs:
            if r is not None:
                dep[r] = d
                prod[r] = i
        if not d:
            continue
        given = assignment.get(fe.path)
        in_roles = [role[prod[r]] for r in refs if r in prod and role[prod[r]] != Role.FREE]
        ranks = [_role_rank(x) for x in in_roles]
        want = given[0] if given is not None and given[0] != Role.FREE else Role.FORWARD
        r_i = max([_role_rank(want)] + ranks)
        role[i] = (Role.FORWARD, Role.BACKWARD, Role.APPLY)[r_i]
        s = given[1] if given is not None and given[1] >= 0 else None
        fwd_in = [stage[prod[r]] for r in refs if r in prod and role[prod[r]] == Role.FORWARD]
        bwd_in = [stage[prod[r]] for r in refs if r in prod and role[prod[r]] == Role.BACKWARD]
        any_in = [stage[prod[r]] for r in refs if r in prod and role[prod[r]] != Role.FREE]
        if role[i] == Role.FORWARD:
            s = max([s if s is not None else 0] + fwd_in)
        elif role[i] == Role.BACKWARD:
            if s is None:
                s = min(bwd_in) if bwd_in else (max(any_in) if any_in else num_stages - 1)
            s = min([s] + bwd_in)
        elif s is None:
            s = any_in[0] if any_in else 0
        stage[i] = s
    return role, stage, prod


def _apply_phases(flat: FlatProgram, role: Sequence, stage: Sequence,
                  prod: Mapping[int, int], after: Mapping[int, int] | None = None
                  ) -> dict[int, int]:
    """Per apply equation its phase: apply-gradients of a stage that reads apply values of
    another stage runs after them, in a later phase (global-norm clipping: every stage's
    sum of squares, then the norm, then every stage's update). Phases never wait on each
    other in a cycle: a value crosses stages only into a later phase. ``after``: equation
    -> an apply equation it runs in no earlier phase than (ordered effects)."""
    phase: dict[int, int] = {}
    for i, fe in enumerate(flat.eqns):
        if role[i] != Role.APPLY:
            continue
        ph = phase.get((after or {}).get(i), 0)
        for x in fe.ins:
            j = prod.get(x) if isinstance(x, int) else None
            if j is not None and role[j] == Role.APPLY:
                ph = max(ph, phase[j] + (stage[j] != stage[i]))
        phase[i] = ph
    return phase


def _sink_cross_stage_sums(flat: FlatProgram, role: list, stage: list,
                           prod: Mapping[int, int]) -> None:
    """Move to apply-gradients the sums of gradients that come from two stages.

    A weight read on two stages (a tied embedding) gets its gradient as a sum of both
    stages' parts; the sum lands on the earlier stage's backward task, so the later stage
    would send its part every microbatch. The sum and what follows it up to
    apply-gradients are linear, so summing over microbatches first gives the same value:
    moved to ``A`` (same stage), each part is accumulated where it is made and crosses
    once per step. Moved: an ``add``/``add_any`` of backward values of which one comes from
    another stage, with the chain of linear equations after it on its stage, when every
    value of that chain is read only by apply-gradients or the chain, none is a step
    result, and every operand is a backward value or the chain's (literals: scaling only).
    ``role`` is updated in place."""
    consumers: dict[int, list[int]] = {}
    for i, fe in enumerate(flat.eqns):
        for x in fe.ins:
            if isinstance(x, int):
                consumers.setdefault(x, []).append(i)
    results = {x for x in flat.outs if isinstance(x, int)}

    def gradient(x: Any, moving: set[int]) -> bool:
        return isinstance(x, int) and x in prod and (
            prod[x] in moving or role[prod[x]] == Role.BACKWARD)

    def linear(i: int, moving: set[int]) -> bool:
        fe = flat.eqns[i]
        name = prims.name(fe.eqn)
        if name in prims.SUMS or name in prims.LINEAR_UNARY or prims.is_identity_pow(fe.eqn):
            return all(gradient(x, moving) for x in fe.ins)
        if name in (prims.MUL, prims.DIV):   # scaling by a literal
            a, b = fe.ins
            return (gradient(a, moving) and isinstance(b, Lit)) or \
                (name == prims.MUL and isinstance(a, Lit) and gradient(b, moving))
        return False

    for i, fe in enumerate(flat.eqns):
        if role[i] != Role.BACKWARD or prims.name(fe.eqn) not in prims.ADDS:
            continue
        s = stage[i]
        if not any(isinstance(x, int) and x in prod and role[prod[x]] == Role.BACKWARD
                   and stage[prod[x]] != s for x in fe.ins):
            continue
        moving, todo, ok = {i}, [i], True
        while todo and ok:
            j = todo.pop()
            ok = linear(j, moving)
            for r in flat.eqns[j].outs:
                if r is None or not ok:
                    continue
                ok = r not in results
                for c in consumers.get(r, ()):
                    if c in moving or role[c] == Role.APPLY:
                        continue
                    if role[c] == Role.BACKWARD and stage[c] == s:
                        moving.add(c)
                        todo.append(c)
                    else:
                        ok = False
        if ok:
            for j in moving:
                role[j] = Role.APPLY


def _check_direction(dst: tuple[str, int], src: tuple[str, int], path) -> None:
    """Forward data flows to later (or the same) stages, backward data to earlier ones;
    apply-gradients reads anything, and nothing per microbatch reads it."""
    (dk, ds), (sk, ss) = dst, src
    if is_apply(dk):
        return
    ok = {("F", "F"): ss <= ds, ("B", "F"): True, ("B", "B"): ss >= ds}.get((dk, sk), False)
    if not ok:
        raise StageSplitError(f"equation {path} on task {dk}{ds} reads a value of task "
                              f"{sk}{ss}: no schedule runs that dependency (forward values "
                              f"flow to later stages, gradients to earlier ones)")


# ------------------------------------------------------------------------------ assignment
def assignment_from_ops(traced: Any, graph: Any, stage_of_op: Sequence[int],
                        role_of_op: Sequence[str]) -> dict[tuple[int, ...], tuple[str, int]]:
    """Equation path -> ``(role, stage)`` from per-op roles and stages of the HLO graph of
    a ``ScopedFunction`` (ops carry their equation path in ``op_name``).

    An equation takes the role and stage of the ops producing its results (the latest role
    among them: forward < backward < apply); equations with no op of their own are left out
    (``split_step`` derives them from their operands).
    """
    from rhino.hlo_passes.annotate import EqnMap

    emap = EqnMap(traced, graph)
    out: dict[tuple[int, ...], tuple[str, int]] = {}
    for (path, _k), op in emap.producer.items():
        role, stage = role_of_op[op], int(stage_of_op[op])
        old = out.get(path)
        if old is None or _role_rank(role) > _role_rank(old[0]):
            out[path] = (role, stage)
    return out
