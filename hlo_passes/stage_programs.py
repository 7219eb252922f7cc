"""Stage programs: a training step split into per-stage forward, backward and apply programs.

Rhino §6.1 runs a pipelined step as tasks: ``F(s, mb)`` and ``B(s, mb)`` (the forward and
backward halves of compute-gradients of stage ``s`` on microbatch ``mb``; the local
accumulation of Fig. 6b is fused into them) and ``A(s)`` (apply-gradients, once per step).
This module cuts a one-device step into those programs, at the level of the step's jaxpr.

Pass order::

    step fn + example args (microbatch-sized batch)
        │ flatten          the jaxpr with call-like equations (pjit, custom_jvp, remat...)
        │                  inlined, as in hlo_passes.annotate: one flat list of leaf equations,
        │                  each with its path (e.g. (3, 0)) and integer value refs
        ▼
        │ assignment       path -> (role, stage), from the pipeline plan's op stages through
        │                  the HLO op_name scopes (``assignment_from_ops``) or given by hand
        ▼
        │ split_step       roles re-derived on the jaxpr (free = batch-independent); stage
        │                  repairs so that forward data flows to later stages and backward
        │                  data to earlier ones; a sum of gradient parts from two
        │                  stages (a tied weight) moved to apply-gradients, so each part
        │                  is accumulated where it is made and crosses once per step;
        │                  per task its equations (plus the free equations it needs,
        │                  recomputed), inputs, outputs, accumulators
        ▼
    StepSplit            tasks F/B/A per stage; compile_task() builds a jitted program

Accumulation over microbatches: every batch-dependent value that leaves compute-gradients
(gradients for apply-gradients, metrics such as the loss for the step's outputs) is summed
over the ``m`` microbatches inside the F/B programs and divided by ``m`` where it is read:
the step's value for a loss that is a *mean* over the batch, and its gradient. A step that
*sums* over the batch needs ``accumulate="sum"``.

The split is a pure function of the traced jaxpr and the assignment, so a Ray actor rebuilds
the same programs from the step function, the argument shapes and the assignment (plain
data) and never receives a jaxpr.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def step(w, x):
    ...     loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    ...     return w - 0.1 * g, loss
    >>> flat = flatten(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4))))
    >>> sp = split_step(flat, {}, batch_refs=(1,), num_stages=1, num_microbatches=2)
    >>> sorted(t.label for t in sp.tasks.values() if t.eqns)   # no assignment: all forward
    ['F0']
    >>> [o.source for o in sp.outputs]   # new weights and loss, summed over microbatches
    ['acc', 'acc']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax

from rhino.errors import RhinoError
from rhino.jaxpr import primitives as prims
from rhino.jaxpr.interpret import FlatEqn, FlatProgram, Lit, flatten
from rhino.jaxpr.private import bind, bind_params, eqn_context, eqn_source
from rhino.vocabulary import Accumulate, Role, TaskKind

__all__ = ["FlatEqn", "FlatProgram", "Lit", "flatten", "StageSplitError", "StageShardings",
           "split_step", "task_function", "finish_sum", "assignment_from_ops", "apply_order"]



class StageSplitError(RhinoError):
    """The step cannot be split into stage programs as asked."""


@dataclasses.dataclass(frozen=True)
class StageShardings:
    """The shardings a stage uses, as PartitionSpecs on its mesh (plain data).

    Attributes:
        values: ``(equation path, result index) -> PartitionSpec`` constraints inside the
            stage's programs.
        refs: ``ref -> PartitionSpec`` for values the stage receives or is given
            (arguments, microbatch slices, values from other stages). Unlisted: replicated.
    """

    values: Mapping[tuple[tuple[int, ...], int], Any] = dataclasses.field(default_factory=dict)
    refs: Mapping[int, Any] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------ the split
@dataclasses.dataclass(frozen=True)
class TaskInput:
    """Where a task input comes from.

    Attributes:
        ref: the value.
        source: ``arg`` (a state argument), ``batch`` (a batch argument: the task's
            microbatch slice), ``task`` (an output of task ``producer`` on the same
            microbatch, or of an apply task), ``acc`` (a value accumulated over all
            microbatches by ``producer``, divided by m for ``mean``).
        producer: ``(kind, stage)`` of the producing task, for ``task`` and ``acc``.
    """

    ref: int
    source: str
    producer: tuple[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One stage program.

    Attributes:
        kind: ``F``, ``B`` or ``A``; stage: its stage.
        eqns: indices into ``FlatProgram.eqns`` in program order (own and recomputed free
            equations).
        inputs: its inputs, in the program's argument order.
        outputs: refs it produces that other tasks or the step's results read.
        accumulate: refs (among its values) summed over microbatches (F and B only).
    """

    kind: str
    stage: int
    eqns: tuple[int, ...]
    inputs: tuple[TaskInput, ...]
    outputs: tuple[int, ...]
    accumulate: tuple[int, ...]

    @property
    def key(self) -> tuple[str, int]:
        return (self.kind, self.stage)

    @property
    def label(self) -> str:
        return f"{self.kind}{self.stage}"


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Where a flat result of the step comes from: ``lit`` (value), ``arg`` (ref),
    ``task`` (an apply task's ref), ``acc`` (accumulated ref of producer)."""

    source: str
    ref: int | None = None
    producer: tuple[str, int] | None = None
    value: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class StepSplit:
    """A step cut into stage programs (see the module docstring).

    Attributes:
        flat: the flattened step (microbatch-sized).
        num_stages, num_microbatches, accumulate: as asked.
        tasks: ``(kind, stage) -> TaskSpec`` for every kind and stage (possibly empty).
        outputs: per flat result of the step, its source.
        role, stage: per flat equation, its role and stage (-1 for free equations).
        batch_refs: the flat arguments carrying the batch (split along axis 0).
        consumers: ``ref -> {(kind, stage) of tasks reading it}``.
        rng_shapes: equation path -> the whole batch's shape, for every random equation
            (``random_bits``, ``random_split``) whose shape follows the batch: its
            microbatch program draws the whole batch's values and keeps its microbatch's
            slice, so random masks (dropout) and per-example keys equal the whole-batch
            step's (``task_function``).
    """

    flat: FlatProgram
    num_stages: int
    num_microbatches: int
    accumulate: str
    tasks: Mapping[tuple[str, int], TaskSpec]
    outputs: tuple[StepOutput, ...]
    role: tuple[str, ...]
    stage: tuple[int, ...]
    batch_refs: tuple[int, ...]
    consumers: Mapping[int, frozenset]
    rng_shapes: Mapping[tuple[int, ...], tuple[int, ...]] = dataclasses.field(
        default_factory=dict)

    def task(self, kind: str, stage: int) -> TaskSpec:
        return self.tasks[(kind, stage)]

    def stage_args(self, stage: int) -> tuple[int, ...]:
        """Flat arguments (state and batch) any task of ``stage`` reads."""
        return tuple(sorted({i.ref for k in TaskKind for i in self.tasks[(k, stage)].inputs
                             if i.source in ("arg", "batch")}))

    def summary(self) -> dict[str, Any]:
        counts = {t.label: len(t.eqns) for t in self.tasks.values()}
        return {"num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
                "eqns": counts}


def _role_rank(role: str) -> int:
    return Role(role).rank


def split_step(flat: FlatProgram, assignment: Mapping[tuple[int, ...], tuple[str, int]],
               batch_refs: Sequence[int], num_stages: int, num_microbatches: int,
               accumulate: str = "mean",
               rng_shapes: Mapping[tuple[int, ...], tuple[int, ...]] | None = None
               ) -> StepSplit:
    """Cut a flattened step into F/B/A programs per stage.

    Args:
        flat: ``flatten(jax.make_jaxpr(step)(*microbatch_args))``.
        assignment: equation path -> ``(role, stage)`` (role ``fwd``/``bwd``/``ag``/``free``);
            equations missing from it get their role and stage from their operands.
        batch_refs: flat argument refs that carry the batch.
        num_stages, num_microbatches: ``p`` and ``m``.
        accumulate: ``mean`` or ``sum`` over microbatches.
        rng_shapes: equation path -> shape in the whole-batch trace, for ``random_bits``
            equations (see ``StepSplit.rng_shapes``).

    Returns:
        The ``StepSplit``.

    Raises:
        StageSplitError: bad sizes, an assignment naming a stage out of range, apply
            tasks that depend on each other in a cycle, or an integer value to average.
    """
    if num_stages < 1 or num_microbatches < 1:
        raise StageSplitError(f"expected num_stages >= 1 and num_microbatches >= 1, found "
                              f"{num_stages} and {num_microbatches}")
    try:
        accumulate = Accumulate(accumulate)
    except ValueError:
        raise StageSplitError(f"accumulate: expected one of {[a.value for a in Accumulate]}, "
                              f"found {accumulate!r}") from None
    bad = [b for b in batch_refs if not 0 <= b < flat.num_args]
    if bad or not batch_refs:
        raise StageSplitError(f"batch arguments: expected flat argument indices in "
                              f"[0, {flat.num_args}), found {list(batch_refs)}")
    for path, (role, stage) in assignment.items():
        if role not in tuple(Role) or not -1 <= stage < num_stages:
            raise StageSplitError(f"assignment of equation {path}: expected a role in "
                                  f"free/fwd/bwd/ag and a stage in [-1, {num_stages}), found "
                                  f"({role!r}, {stage})")
    n = len(flat.eqns)
    dep: dict[int, bool] = {r: (r in set(batch_refs)) for r in range(flat.num_args)}
    prod: dict[int, int] = {}  # ref -> producing flat eqn
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
        # The role: at least what the operands force (forward < backward < apply).
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

    _sink_cross_stage_sums(flat, role, stage, prod)

    # Values each equation reads, and the free equations each task recomputes.
    task_eqns: dict[tuple[str, int], list[int]] = {(k, s): [] for k in TaskKind
                                                   for s in range(num_stages)}
    for i in range(n):
        if role[i] != Role.FREE:
            task_eqns[(role[i].task, stage[i])].append(i)
    free_needed: dict[tuple[str, int], set[int]] = {k: set() for k in task_eqns}

    def need_free(key, refs):
        stack = [r for r in refs if r in prod and role[prod[r]] == Role.FREE]
        seen = free_needed[key]
        while stack:
            e = prod[stack.pop()]
            if e in seen:
                continue
            seen.add(e)
            stack.extend(x for x in flat.eqns[e].ins if isinstance(x, int) and x in prod
                         and role[prod[x]] == Role.FREE)

    for key, idx in task_eqns.items():
        need_free(key, [x for i in idx for x in flat.eqns[i].ins if isinstance(x, int)])
    # Free values among the step's results are computed by A0.
    out_free = [x for x in flat.outs if isinstance(x, int) and x in prod
                and role[prod[x]] == Role.FREE]
    need_free(("A", 0), out_free)

    owner: dict[int, tuple[str, int]] = {}
    for key, idx in task_eqns.items():
        for i in idx:
            for r in flat.eqns[i].outs:
                if r is not None:
                    owner[r] = key

    consumers: dict[int, set] = {}
    acc_refs: dict[tuple[str, int], set[int]] = {k: set() for k in task_eqns}
    tasks: dict[tuple[str, int], TaskSpec] = {}
    all_eqns = {k: sorted(set(task_eqns[k]) | free_needed[k]) for k in task_eqns}
    batch = set(batch_refs)
    a_deps: dict[int, set[int]] = {s: set() for s in range(num_stages)}
    inputs_of: dict[tuple[str, int], list[TaskInput]] = {}
    for key, idx in all_eqns.items():
        kind, s = key
        made = {r for i in idx for r in flat.eqns[i].outs if r is not None}
        ins: list[TaskInput] = []
        seen: set[int] = set()
        for i in idx:
            for x in flat.eqns[i].ins:
                if not isinstance(x, int) or x in made or x in seen:
                    continue
                seen.add(x)
                if x in flat.consts:
                    continue  # the program holds it
                if x < flat.num_args:
                    ins.append(TaskInput(x, "batch" if x in batch else "arg"))
                else:
                    src = owner[x]
                    _check_direction(key, src, flat.eqns[i].path)
                    if kind == "A" and src[0] != "A":
                        ins.append(TaskInput(x, "acc", src))
                        acc_refs[src].add(x)
                    else:
                        ins.append(TaskInput(x, "task", src))
                        if kind == "A" and src[1] != s:
                            a_deps[s].add(src[1])
                    consumers.setdefault(x, set()).add(key)
        inputs_of[key] = ins
    outputs: list[StepOutput] = []
    for x in flat.outs:
        if isinstance(x, Lit):
            outputs.append(StepOutput("lit", value=x.value))
        elif x in flat.consts:
            outputs.append(StepOutput("lit", value=flat.consts[x]))
        elif x < flat.num_args:
            outputs.append(StepOutput("arg", x))
        elif x in owner and owner[x][0] != "A":
            outputs.append(StepOutput("acc", x, owner[x]))
            acc_refs[owner[x]].add(x)
        else:
            outputs.append(StepOutput("task", x, owner.get(x, ("A", 0))))
    for key, refs in acc_refs.items():
        for r in refs:
            dt = flat.avals[r].dtype
            if accumulate == "mean" and not jax.numpy.issubdtype(dt, jax.numpy.inexact):
                raise StageSplitError(
                    f"value #{r} ({dt}) is accumulated over microbatches by {key[0]}{key[1]}: "
                    f"expected a floating-point value to average, found {dt}; use "
                    f"accumulate='sum' or compute it outside the gradient")
    _check_acyclic(a_deps)
    for key, idx in all_eqns.items():
        made = {r for i in idx for r in flat.eqns[i].outs if r is not None}
        outs = sorted(r for r in made if (consumers.get(r, set()) - {key})
                      or any(o.ref == r and o.source == "task" for o in outputs))
        tasks[key] = TaskSpec(key[0], key[1], tuple(idx), tuple(inputs_of[key]), tuple(outs),
                              tuple(sorted(acc_refs[key])))
    return StepSplit(flat, num_stages, num_microbatches, accumulate, tasks, tuple(outputs),
                     tuple(role), tuple(stage), tuple(sorted(batch)),
                     {r: frozenset(c) for r, c in consumers.items()},
                     _batch_rng(flat, role, rng_shapes or {}, num_microbatches))


RNG_SHAPED = prims.RNG_SHAPED


def _batch_rng(flat: FlatProgram, role: Sequence[Role],
               whole: Mapping[tuple[int, ...], tuple[int, ...]], m: int
               ) -> dict[tuple[int, ...], tuple[int, ...]]:
    """The random equations (``RNG_SHAPED``: bits, and key splits such as one key per
    example) whose shape follows the batch (``StepSplit.rng_shapes``).

    Raises:
        StageSplitError: such an equation whose shape differs from the whole batch's other
            than by ``m`` in its leading dimension, or that is not per microbatch.
    """
    out = {}
    for i, fe in enumerate(flat.eqns):
        if prims.rng_shape(fe.eqn) is None or fe.path not in whole:
            continue
        mine, full = prims.rng_shape(fe.eqn), tuple(whole[fe.path])
        if mine == full:
            continue
        where = _source(fe.eqn)
        if not (mine and len(mine) == len(full) and full[0] == m * mine[0]
                and mine[1:] == full[1:]):
            raise StageSplitError(
                f"random values of shape {full} at {where}: expected the batch as the leading "
                f"dimension ({m} microbatches of {full[0] // m if full else '?'}), found "
                f"{mine} per microbatch; a pipelined step draws each microbatch's slice of "
                f"the whole batch's bits, which needs the batch dimension first")
        if role[i] is Role.APPLY:
            raise StageSplitError(f"random values of shape {full} at {where}: expected them "
                                  f"per microbatch (forward or backward), found them in "
                                  f"apply-gradients")
        out[fe.path] = full
    return out


def _source(eqn: Any) -> str:
    """``file:line`` of the user code that made ``eqn`` (or its primitive's name)."""
    return eqn_source(eqn) or eqn.primitive.name




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
        name = fe.eqn.primitive.name
        if name in prims.SUMS or name in prims.LINEAR_UNARY or (
                name == prims.INTEGER_POW and fe.eqn.params.get("y") == 1):
            return all(gradient(x, moving) for x in fe.ins)
        if name in (prims.MUL, prims.DIV):   # scaling by a literal
            a, b = fe.ins
            return (gradient(a, moving) and isinstance(b, Lit)) or \
                (name == prims.MUL and isinstance(a, Lit) and gradient(b, moving))
        return False

    for i, fe in enumerate(flat.eqns):
        if role[i] != Role.BACKWARD or fe.eqn.primitive.name not in prims.ADDS:
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
    """Forward data flows to later (or the same) stages, backward data to earlier ones."""
    (dk, ds), (sk, ss) = dst, src
    ok = {("F", "F"): ss <= ds, ("B", "F"): True, ("B", "B"): ss >= ds,
          ("A", "F"): True, ("A", "B"): True, ("A", "A"): True}.get((dk, sk), False)
    if not ok:
        raise StageSplitError(f"equation {path} on task {dk}{ds} reads a value of task "
                              f"{sk}{ss}: no schedule runs that dependency (forward values "
                              f"flow to later stages, gradients to earlier ones)")


def _check_acyclic(deps: Mapping[int, set[int]]) -> None:
    state: dict[int, int] = {}

    def visit(s, chain):
        if state.get(s) == 1:
            raise StageSplitError(f"apply-gradients tasks depend on each other in a cycle "
                                  f"(stages {chain + [s]}): e.g. global-norm clipping over "
                                  f"weights of several stages is not supported")
        if state.get(s) == 2:
            return
        state[s] = 1
        for t in deps.get(s, ()):
            visit(t, chain + [s])
        state[s] = 2

    for s in deps:
        visit(s, [])


def apply_order(split: StepSplit) -> list[int]:
    """Stages in an order in which their apply tasks can run (dependencies first)."""
    deps = {s: {i.producer[1] for i in split.task("A", s).inputs
                if i.source == "task" and i.producer[0] == "A" and i.producer[1] != s}
            for s in range(split.num_stages)}
    order: list[int] = []
    done: set[int] = set()
    while len(order) < split.num_stages:
        for s in sorted(deps, reverse=True):
            if s not in done and deps[s] <= done:
                order.append(s)
                done.add(s)
                break
    return order


# ------------------------------------------------------------------------------ programs
def task_function(split: StepSplit, task: TaskSpec, with_acc: bool,
                  constrain: Callable[[tuple[int, ...], int, Any], Any] | None = None
                  ) -> Callable:
    """The Python function of a stage program (to ``jax.jit``).

    Signature: ``fn(inputs, accs, mb) -> (outputs, new_accs)``; ``inputs`` in
    ``task.inputs`` order (``acc`` inputs are the raw sums over microbatches: the program
    divides them by m for ``mean`` and returns them to their own dtype), ``accs`` in
    ``task.accumulate`` order (ignored unless ``with_acc``), ``mb`` the microbatch index (an
    int32 scalar; 0 for apply tasks), ``outputs`` in ``task.outputs`` order, ``new_accs`` =
    ``accs + value`` (or the value on the first microbatch), summed in float32 for
    lower-precision floats. ``constrain(path, k, x)`` may apply sharding constraints to
    results. A ``random_bits`` equation of ``split.rng_shapes`` draws the whole batch's bits
    and keeps microbatch ``mb``'s slice.
    """
    flat = split.flat
    eqns = [flat.eqns[i] for i in task.eqns]
    consts = {x: flat.consts[x] for fe in eqns for x in fe.ins
              if isinstance(x, int) and x in flat.consts}

    def fn(inputs, accs, mb):
        env: dict[int, Any] = dict(consts)
        for spec, x in zip(task.inputs, inputs):
            # An accumulated sum becomes the step's value here, inside the program.
            env[spec.ref] = finish_sum(split, spec.ref, x) if spec.source == "acc" else x
        for fe in eqns:
            invals = [x.value if isinstance(x, Lit) else env[x] for x in fe.ins]
            params = bind_params(fe.eqn)
            full = split.rng_shapes.get(fe.path)
            if full is not None:
                params = dict(params, shape=tuple(full))
            with eqn_context(fe.eqn):
                outs = bind(fe.eqn, invals, params)
            if full is not None:
                size = full[0] // split.num_microbatches
                outs = [jax.lax.dynamic_slice_in_dim(outs[0], mb * size, size, axis=0)]
            for k, (r, x) in enumerate(zip(fe.outs, outs)):
                if r is not None:
                    env[r] = constrain(fe.path, k, x) if constrain is not None else x
        outs = [env[r] for r in task.outputs]
        if with_acc:
            new = [a + _wide(env[r]) for r, a in zip(task.accumulate, accs)]
        else:
            new = [_wide(env[r]) for r in task.accumulate]
        return outs, new

    return fn


def _wide(x: Any) -> Any:
    """The accumulator's type of ``x``: float32 for lower-precision floats."""
    dt = jax.numpy.result_type(x)
    if jax.numpy.issubdtype(dt, jax.numpy.floating) and jax.numpy.finfo(dt).bits < 32:
        return x.astype(jax.numpy.float32)
    return x


def finish_sum(split: StepSplit, ref: int, x: Any) -> Any:
    """An accumulated sum of value ``ref`` as the step's value: divided by m for ``mean``,
    in the accumulator's precision, then returned to the value's own dtype."""
    if split.accumulate == "mean" and split.num_microbatches > 1:
        x = x * jax.numpy.asarray(1.0 / split.num_microbatches, dtype=x.dtype)
    return x.astype(split.flat.avals[ref].dtype)


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
