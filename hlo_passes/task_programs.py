"""The programs of a split step (``stage_programs.StepSplit``): the Python function of each
task (``task_function``: a forward, backward or apply program, per microbatch, with its
accumulators) and of each stage's prologue (``prologue_function``), to ``jax.jit``. Cut from
``stage_programs`` (issue 47): that module decides which equations each task runs and what
it reads and leaves; this one turns a task into a program.

Per microbatch, a per-microbatch equation reads its microbatch's chunk of the whole values
it reads (``jaxpr.mb_eval.read_operand``) and is bound at microbatch shapes; what leaves a
task into an accumulator is added by its value's rule (``StepSplit.acc_rules``: a partial
sum summed in float32 for lower-precision floats, a maximum or minimum kept, a per-example
value put in its place of the whole batch), and ``finish_acc`` returns it to the value's
own dtype.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from rhino.hlo_passes import stage_effects
from rhino.jaxpr.interpret import Lit
from rhino.jaxpr.mb_eval import bind_micro, place_chunk, read_operand
from rhino.jaxpr.private import bind, eqn_context

# ``split``: a ``stage_programs.StepSplit``, ``task``: one of its ``TaskSpec``s (typed Any:
# stage_programs imports this module, and re-exports its functions).

__all__ = ["finish_acc", "prologue_function", "task_function"]


def task_function(split: Any, task: Any, with_acc: bool,
                  constrain: Callable[[tuple[int, ...], int, Any], Any] | None = None,
                  finish: Callable[[int, Any], Any] | None = None, quiet: bool = False
                  ) -> Callable:
    """The Python function of a stage program (to ``jax.jit``).

    Signature: ``fn(inputs, accs, mb) -> (outputs, new_accs)``; ``inputs`` in
    ``task.inputs`` order (``acc`` inputs as accumulated: the program finishes them,
    ``finish_acc``), ``accs`` in ``task.accumulate`` order (ignored unless ``with_acc``),
    ``mb`` the microbatch index (an int32 scalar; 0 for apply tasks), ``outputs`` in
    ``task.outputs`` order (a 0-d boolean token if there is none), ``new_accs`` the accumulators with this microbatch's values
    added by their rules (``split.acc_rules``; started from this microbatch's without
    ``with_acc``). Per-microbatch equations read whole values' chunks of microbatch ``mb``
    and are bound at microbatch shapes. ``constrain(path, k, x)`` may apply sharding
    constraints to results, ``finish(ref, x)`` to the outputs as they leave (both:
    ``constraints``). ``task.effect_inputs`` follow the outputs (for its effects program,
    ``stage_effects``); ``quiet``: host callbacks give zeros instead of running (the
    warm-up's variant).
    """
    flat = split.flat
    idx = list(task.eqns)
    loud = stage_effects.loud(split, idx) if quiet else frozenset()
    consts = {x: flat.consts[x] for i in idx for x in flat.eqns[i].ins
              if isinstance(x, int) and x in flat.consts}
    m = split.num_microbatches

    def fn(inputs, accs, mb):
        env: dict[int, Any] = dict(consts)
        whole: dict[int, Any] = {}
        for spec, x in zip(task.inputs, inputs):
            if spec.source == "pre":
                whole[spec.ref] = x
            elif spec.source == "acc":
                env[spec.ref] = finish_acc(split, spec.ref, x)
            else:
                env[spec.ref] = x
        for i in idx:
            fe = flat.eqns[i]
            vals = [read_operand(split.layout, i, j, x, env, whole, mb)
                    for j, x in enumerate(fe.ins)]
            outs = stage_effects.quiet_outputs(split, i) if i in loud else \
                bind_micro(flat, split.layout, i, vals, mb)
            for k, (r, x) in enumerate(zip(fe.outs, outs)):
                if r is not None:
                    env[r] = constrain(fe.path, k, x) if constrain is not None else x
        # A task whose results are all accumulators (a first stage's backward) returns a
        # token: its end is watched on it (the accumulators are donated to the next
        # microbatch's call), so dispatch need not wait for the task to finish.
        outs = [env[r] if finish is None else finish(r, env[r]) for r in task.outputs] \
            or [jax.numpy.zeros((), bool)]
        outs += [env[r] if r in env else whole[r] for r in task.effect_inputs]
        new = [_accumulate(split, r, a if with_acc else None, env[r], mb, m)
               for r, a in zip(task.accumulate, accs if with_acc else
                               [None] * len(task.accumulate))]
        return outs, new

    return fn


def prologue_function(split: Any, stage: int,
                      constrain: Callable[[tuple[int, ...], int, Any], Any] | None = None,
                      quiet: bool = False) -> Callable:
    """``fn(args) -> outputs``: ``stage``'s prologue (``args`` in ``Prologue.inputs``
    order, whole; ``outputs`` in ``Prologue.outputs`` order), every equation bound at its
    whole shapes (``quiet``: host callbacks give zeros, as in ``task_function``)."""
    flat = split.flat
    pro = split.prologues[stage]
    loud = stage_effects.loud(split, pro.eqns) if quiet else frozenset()

    def fn(args):
        env: dict[int, Any] = dict(zip(pro.inputs, args))
        for i in pro.eqns:
            fe = flat.eqns[i]
            vals = [x.value if isinstance(x, Lit) else
                    flat.consts[x] if x in flat.consts else env[x] for x in fe.ins]
            if i in loud:
                outs = stage_effects.quiet_outputs(split, i)
            else:
                with eqn_context(fe.eqn):
                    outs = bind(fe.eqn, vals)
            for k, (r, x) in enumerate(zip(fe.outs, outs)):
                if r is not None:
                    env[r] = constrain(fe.path, k, x) if constrain is not None else x
        return [env[r] for r in pro.outputs]

    return fn


def _wide(x: Any) -> Any:
    """The accumulator's type of ``x``: float32 for lower-precision floats."""
    dt = jax.numpy.result_type(x)
    if jax.numpy.issubdtype(dt, jax.numpy.floating) and jax.numpy.finfo(dt).bits < 32:
        return x.astype(jax.numpy.float32)
    return x


def _accumulate(split: Any, ref: int, acc: Any, x: Any, mb: Any, m: int) -> Any:
    """``acc`` with microbatch ``mb``'s value ``x`` added by ``ref``'s rule (``acc`` None:
    the first microbatch's accumulator)."""
    rule, axis = split.acc_rules[ref]
    jnp = jax.numpy
    if rule == "concat":
        if acc is None:
            acc = jnp.zeros(split.flat.avals[ref].shape, x.dtype)
        return place_chunk(acc, x, axis, mb, m, split.layout.layout[ref].group)
    if rule in ("sum", "mean"):
        return _wide(x) if acc is None else acc + _wide(x)
    if acc is None:
        return x
    return jnp.maximum(acc, x) if rule == "max" else jnp.minimum(acc, x)


def finish_acc(split: Any, ref: int, x: Any) -> Any:
    """An accumulator as the step's value (a sum returned to the value's own dtype)."""
    rule, _ = split.acc_rules[ref]
    if rule == "mean":
        x = x * np.asarray(1.0 / split.num_microbatches, dtype=jax.numpy.result_type(x))
    if rule in ("sum", "mean"):
        return x.astype(split.flat.avals[ref].dtype)
    return x
