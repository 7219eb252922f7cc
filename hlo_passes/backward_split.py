"""A stage's backward program cut in two for zero-bubble schedules (``zb-h1``): ``B``, the
gradients of the stage's inputs, which the previous stage waits for, and ``W``, the
gradients of its weights, which only the stage's own apply-gradients reads.

The cut is of the backward task's equations (``TaskSpec.eqns``), not a new derivation:
``B`` keeps the equations its per-microbatch outputs need (what other tasks read: the
gradients sent to the previous stage), ``W`` runs every other equation of the backward, in
program order, reading what ``B`` computed for it as values of the same microbatch. Each
equation runs once, on the same operands as in the unsplit backward, so the weight
gradients are the same numbers. Accumulators go with the program whose equations compute
them, and the apply tasks (and the step's results) read them from there.

A backward that binds host callbacks is left whole (its ``W`` empty): cut, the callbacks'
order against the rest of the backward could change.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from rhino.hlo_passes.stage_programs import flatten, split_step
    >>> def step(w, x):
    ...     loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    ...     return w - 0.1 * g, loss
    >>> flat = flatten(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((8, 4))))
    >>> sp = split_backward(split_step(flat, {}, batch_refs=(1,), num_stages=1,
    ...                                num_microbatches=2))
    >>> sorted(t.label for t in sp.tasks.values() if not t.empty)
    ['A0', 'F0']
"""

from __future__ import annotations

import dataclasses

from rhino.hlo_passes import stage_effects
from rhino.hlo_passes.stage_programs import StepSplit, TaskInput, TaskSpec, is_apply


def split_backward(split: StepSplit) -> StepSplit:
    """``split`` with every stage's ``B`` task cut into ``B`` and ``W`` (see the module
    docstring); a stage whose backward has nothing to cut gets an empty ``W``."""
    flat = split.flat
    tasks = dict(split.tasks)
    consumers = {r: set(c) for r, c in split.consumers.items()}
    moved: dict[int, tuple[str, int]] = {}      # accumulated ref -> its producer now
    for s in range(split.num_stages):
        key, wkey = ("B", s), ("W", s)
        b = split.tasks.get(key)
        tasks[wkey] = TaskSpec("W", s, (), (), (), ())
        if b is None or b.empty or stage_effects.loud(split, b.eqns):
            continue
        need, keep = set(b.outputs), set()
        for i in reversed(b.eqns):
            fe = flat.eqns[i]
            if any(r is not None and r in need for r in fe.outs):
                keep.add(i)
                need.update(x for x in fe.ins if isinstance(x, int))
        w_eqns = tuple(i for i in b.eqns if i not in keep)
        if not w_eqns:
            continue
        b_eqns = tuple(i for i in b.eqns if i in keep)
        made_b = {r for i in b_eqns for r in flat.eqns[i].outs if r is not None}
        made_w = {r for i in w_eqns for r in flat.eqns[i].outs if r is not None}
        read_b = {x for i in b_eqns for x in flat.eqns[i].ins if isinstance(x, int)}
        read_w = {x for i in w_eqns for x in flat.eqns[i].ins if isinstance(x, int)}
        handed = sorted(read_w & made_b)
        w_acc = tuple(r for r in b.accumulate if r in made_w)
        b_acc = tuple(r for r in b.accumulate if r not in made_w)
        # W reads the backward's own inputs it needs, then what B hands it
        w_inputs = [i for i in b.inputs if i.ref in read_w and i.ref not in made_w]
        w_inputs += [TaskInput(r, "task", key) for r in handed]
        b_inputs = tuple(i for i in b.inputs if i.ref in read_b or i.ref in b_acc)
        tasks[key] = dataclasses.replace(
            b, eqns=b_eqns, inputs=b_inputs,
            outputs=tuple(sorted(set(b.outputs) | set(handed))),
            accumulate=b_acc)
        tasks[wkey] = TaskSpec("W", s, w_eqns, tuple(w_inputs), (), w_acc)
        for i in w_inputs:
            if i.source in ("task", "acc"):
                consumers.setdefault(i.ref, set()).add(wkey)
        for i in b.inputs:
            if i.source in ("task", "acc") and i not in b_inputs:
                consumers.get(i.ref, set()).discard(key)
        moved.update((r, wkey) for r in w_acc)
    if not moved and all(t.empty for (k, _), t in tasks.items() if k == "W"):
        return dataclasses.replace(split, tasks=tasks)
    for k, t in list(tasks.items()):
        if is_apply(k[0]) and any(i.source == "acc" and i.ref in moved for i in t.inputs):
            tasks[k] = dataclasses.replace(t, inputs=tuple(
                dataclasses.replace(i, producer=moved[i.ref])
                if i.source == "acc" and i.ref in moved else i for i in t.inputs))
    outputs = tuple(dataclasses.replace(o, producer=moved[o.ref])
                    if o.source == "acc" and o.ref in moved else o for o in split.outputs)
    return dataclasses.replace(split, tasks=tasks, outputs=outputs,
                               consumers={r: frozenset(c) for r, c in consumers.items()})
