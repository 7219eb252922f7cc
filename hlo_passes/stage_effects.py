"""Host effects in stage programs: a ``jax.debug.callback`` / ``jax.debug.print`` /
``io_callback`` runs once per step, with the values and the count ``jax.jit`` gives; a
``pure_callback`` is computed once where it can be, and never dropped where it is read.

Under ``jax.jit`` an effect runs once per step even where nothing reads its results. A
pipelined step computes per-microbatch values in pieces, so an effect reading one
(``jnp.sum(h)``: a partial sum; ``h``: a per-example value) runs once per step after the
microbatches, on the total or the concatenation (``microbatch._effect``). Where it runs::

    effect nothing reads (a print, a callback)   ─► an *effects program* of stage 0, after
        an apply task of it: the task hands the effects' operands out
        (``TaskSpec.effect_inputs``); they are put on the stage's first device and the
        effects are bound there, in program order (``effects_function``), as ``jax.jit``
        runs a callback on its program's first device (an ordered one on one device only)
    effect or pure_callback whose result is read, computed whole from state alone
        ─► the prologue of the stage reading it (once per step; never recomputed by every
        task, as other values computed from state alone are)
    one reading per-microbatch values ─► its apply task (once per step, on totals)

An effect that would run more than once per step (its results read by two stages'
prologues, or needed per microbatch) or out of program order (ordered effects on two
stages) is refused, naming its primitive and source line (``check``). A ``pure_callback``
(pure by JAX's contract: it may be called any number of times) read by two stages'
prologues is computed by each.

The warm-up step on zeros runs every program once before the first step: there the
programs that bind callbacks are replaced by *quiet* variants whose callbacks give zeros
(``task_function(..., quiet=True)``), and no effects program runs, so a callback never
sees the zeros.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from rhino.hlo_passes.stage_programs import flatten, split_step
    >>> def step(w, x):
    ...     def loss(w):
    ...         h = jnp.tanh(x @ w)
    ...         jax.debug.print("{}", jnp.sum(h))
    ...         return jnp.mean(h ** 2)
    ...     l, g = jax.value_and_grad(loss)(w)
    ...     return w - 0.1 * g, l
    >>> flat = flatten(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((8, 4))))
    >>> sp = split_step(flat, {}, batch_refs=(1,), num_stages=1, num_microbatches=2)
    >>> [(t.label, len(t.effects), len(t.effect_inputs)) for t in sp.tasks.values()
    ...  if t.effects]
    [('A0', 1, 1)]
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

from rhino.jaxpr import primitives as prims
from rhino.jaxpr.interpret import Lit
from rhino.jaxpr.microbatch import Place
from rhino.jaxpr.private import bind, eqn_context, eqn_source
from rhino.vocabulary import Role


def describe(flat: Any, i: int) -> str:
    """``debug_callback at train.py:12`` for equation ``i`` (the callback it holds, for
    control flow holding one)."""
    fe = flat.eqns[i]
    sites = prims.callback_sites(fe.eqn)
    if sites and sites[0] is not fe.eqn:
        inner = sites[0]
        return (f"{prims.name(inner)} at {eqn_source(inner) or 'an unknown line'} (inside "
                f"{prims.name(fe.eqn)} at {flat.source(fe) or 'an unknown line'})")
    return f"{prims.name(fe.eqn)} at {flat.source(fe) or 'an unknown line'}"


def liveness(flat: Any) -> tuple[frozenset[int], frozenset[int]]:
    """``(dead, once)``: the equations nothing live reads a result of (no step result, no
    effect depends on them: ``jax.jit`` leaves them out, and so do the stage programs),
    and the effect equations among the live ones whose results nothing live reads (a
    print, a debug callback, an ``io_callback`` whose result is dropped or read only by
    dead code): each of those runs in an effects program."""
    live = {x for x in flat.outs if isinstance(x, int)}
    dead, once = set(), set()
    for i in range(len(flat.eqns) - 1, -1, -1):
        fe = flat.eqns[i]
        read = any(r in live for r in fe.outs if r is not None)
        effect = prims.is_effect(fe.eqn)
        if read or effect:
            live.update(x for x in fe.ins if isinstance(x, int))
        if effect and not read:
            once.add(i)
        elif not read and not effect:
            dead.add(i)
    return frozenset(dead), frozenset(once)


def whole_callbacks(flat: Any, layout: Any, once: Collection[int]) -> set[int]:
    """Free equations (computed from state alone: ``layout.place``) holding a host callback
    whose results are read: computed by a prologue, once per step, instead of by every
    task reading them."""
    return {i for i, where in enumerate(layout.place) if where is Place.FREE
            and i not in once and prims.callback_sites(flat.eqns[i].eqn)}


def place_once(flat: Any, once: Collection[int], role: list, stage: list) -> dict[int, int]:
    """Give the effects of ``once`` the apply role on stage 0 (``role``, ``stage`` updated
    in place): ``jax.jit`` runs a callback on the first device of its program, with the
    values gathered there, so a pipeline runs it on its first stage's first device (in a
    multi-controller job, the process ``jax.jit`` would run it in; one stage for every
    effect keeps ordered ones in program order). Returns ``after``: ordered effect -> the
    ordered apply equation before it (``_apply_phases`` runs it in no earlier phase)."""
    for i in once:
        role[i] = Role.APPLY
        stage[i] = 0
    ordered = [i for i, fe in enumerate(flat.eqns)
               if prims.is_ordered(fe.eqn) and role[i] == Role.APPLY]
    return {b: a for a, b in zip(ordered, ordered[1:])}


def effect_inputs(flat: Any, effects: Sequence[int]) -> tuple[int, ...]:
    """The values the effects program of ``effects`` reads (refs, each once, in order)."""
    out: list[int] = []
    for i in effects:
        for x in flat.eqns[i].ins:
            if isinstance(x, int) and x not in flat.consts and x not in out:
                out.append(x)
    return tuple(out)


def effects_function(split: Any, task: Any) -> Any:
    """``fn(values) -> token``: the effects of ``task`` (``TaskSpec.effects``) bound in
    program order on ``values`` (``task.effect_inputs`` order, as the task hands them out,
    on one device). The 0-d token returned is ready when the program (its callbacks) has
    run."""
    import jax

    flat = split.flat

    def fn(values):
        env = dict(zip(task.effect_inputs, values))
        for i in task.effects:
            fe = flat.eqns[i]
            vals = [x.value if isinstance(x, Lit) else
                    flat.consts[x] if x in flat.consts else env[x] for x in fe.ins]
            with eqn_context(fe.eqn):
                bind(fe.eqn, vals)
        return jax.numpy.zeros((), bool)

    return fn


def quiet_outputs(split: Any, i: int) -> list:
    """Zeros for the results of callback equation ``i`` (its quiet variant, the warm-up's:
    the callback is not called); None for a result nothing reads."""
    import jax

    fe, avals = split.flat.eqns[i], split.flat.avals
    micro = split.layout.place[i] is Place.MICRO
    return [None if r is None else jax.numpy.zeros(
        split.microbatch_shape(r) if micro else avals[r].shape, avals[r].dtype)
        for r in fe.outs]


def loud(split: Any, eqns: Sequence[int]) -> frozenset[int]:
    """The equations among ``eqns`` that hold a host callback."""
    return frozenset(i for i in eqns if prims.callback_sites(split.flat.eqns[i].eqn))


def check(split: Any) -> str | None:
    """Why ``split`` cannot keep its effects' meaning, naming the effect's primitive and
    source line (None: it can): an effect that would not run exactly once per step (or
    that runs per microbatch), ordered effects that would run on two stages or out of
    program order (``split_step`` raises it)."""
    flat = split.flat
    runs: dict[int, list[tuple]] = {}
    for s, pro in split.prologues.items():
        for i in pro.eqns:
            runs.setdefault(i, []).append((s, 0, 0, f"the prologue of stage {s}"))
    for (kind, s), t in split.tasks.items():
        phases = split.apply_phases.get(s, ())
        phase = phases.index(kind) + 1 if kind in phases else -1
        for i in t.eqns:
            runs.setdefault(i, []).append((s, phase, 0, f"task {t.label}"))
        for i in t.effects:
            runs.setdefault(i, []).append((s, phase, 1, f"the effects of task {t.label}"))
    ordered = []
    for i, fe in enumerate(flat.eqns):
        if not prims.is_effect(fe.eqn):
            continue
        where = runs.get(i, [])
        what = ("is run by no stage program" if not where else
                f"would run {len(where)} times per step (by "
                f"{' and '.join(w[3] for w in where)})" if len(where) > 1 else
                f"would run once per microbatch (in {where[0][3]})" if where[0][1] < 0
                else None)
        if what is not None:
            return (f"{describe(flat, i)}: a host effect {what}; jax.jit runs it once per "
                    f"step. Read its results on one stage only, or compute them outside "
                    f"the step and pass them in")
        if prims.is_ordered(fe.eqn):
            ordered.append((i, where[0]))
    for (a, wa), (b, wb) in zip(ordered, ordered[1:]):
        if wa[0] != wb[0] or wa[1:3] > wb[1:3]:
            return (f"ordered effects {describe(flat, a)} and then {describe(flat, b)}: the "
                    f"pipeline would not run them in program order (the first in {wa[3]}, "
                    f"the second in {wb[3]}{', before it' if wa[0] == wb[0] else ''}); make "
                    f"one of them unordered (ordered=False), or leave the results of an "
                    f"ordered io_callback unread")
    return None


def same_tasks(a: Any, b: Any, stage: int) -> str | None:
    """Where two splits of one step differ on ``stage`` (None: its tasks and prologue read
    and write the same values): a step re-traced by another process must split alike."""
    for key, t in a.tasks.items():
        if key[1] != stage:
            continue
        u = b.tasks.get(key)
        if u is None or (t.inputs, t.outputs, t.accumulate, t.effects, t.effect_inputs) != \
                (u.inputs, u.outputs, u.accumulate, u.effects, u.effect_inputs):
            return f"task {t.label}"
    pa, pb = a.prologues[stage], b.prologues[stage]
    if (pa.inputs, pa.outputs) != (pb.inputs, pb.outputs):
        return f"the prologue of stage {stage}"
    return None


QUIET = "quiet:"
"""Program key prefix of a task's quiet variant (``("quiet:F", with_acc)``)."""
EFFECTS = "effects:"
"""Program key prefix of an apply task's effects program (``("effects:A", False)``)."""


def quiet_kinds(split: Any, stage: int, programs: Collection[tuple[str, bool]] = ()
                ) -> frozenset[str]:
    """The program kinds of ``stage`` (``F``, ``A1``, ``P`` for the prologue...) that bind
    host callbacks, whose warm-up runs a quiet variant: from the split's equations, or, for
    a split without them (an artifact's), from the quiet programs among ``programs``."""
    if not split.flat.eqns:
        return frozenset(k[len(QUIET):] for k, _ in programs if k.startswith(QUIET))
    out = {k for (k, s), t in split.tasks.items() if s == stage and loud(split, t.eqns)}
    if loud(split, split.prologues[stage].eqns):
        out.add("P")
    return frozenset(out)


def check_mesh(split: Any, stage: int, devices: int) -> str | None:
    """Why ``stage`` cannot run on a mesh of ``devices`` devices, naming the effect (None:
    it can): an ordered effect bound in one of its programs (its results are read, so it
    is no effects program's) on more than one device, where ``jax.jit`` runs ordered
    effects on one device only."""
    if devices <= 1 or not split.flat.eqns:
        return None
    bound = [i for (k, s), t in split.tasks.items() if s == stage for i in t.eqns]
    bound += list(split.prologues[stage].eqns)
    for i in sorted(bound):
        if prims.is_ordered(split.flat.eqns[i].eqn):
            return (f"{describe(split.flat, i)}: an ordered effect whose results the step "
                    f"reads runs in a program of stage {stage}, on a mesh of {devices} "
                    f"devices; jax.jit runs ordered effects on one device only. Make it "
                    f"unordered (ordered=False), or leave its results unread")
    return None


def stage_callbacks(split: Any, stage: int) -> tuple[str, ...]:
    """The host callbacks ``stage``'s programs bind or its effects programs run
    (``describe``), in program order."""
    eqns = set(split.prologues[stage].eqns)
    for (k, s), t in split.tasks.items():
        if s == stage:
            eqns |= set(t.eqns) | set(t.effects)
    return tuple(describe(split.flat, i) for i in sorted(loud(split, sorted(eqns))))
