"""Stage programs run one after the other in one thread (no executor), and a step split
the way ``auto_parallel`` splits it: the reference the executors and the property tests
check against."""

from __future__ import annotations

import jax

from rhino.hlo_passes import ingest
from rhino.hlo_passes.annotate import ScopedFunction
from rhino.hlo_passes.lower import batch_leaves, key_args
from rhino.hlo_passes.stage_programs import (assignment_from_ops, finish_acc, flatten,
                                             prologue_function, split_step, task_function)
from rhino.pipeline.coarsen import classify_ops
from rhino.pipeline.gradient import find_gradient_boundary
from rhino.runtime.scheduling.schedules import make_schedule


def split_like_auto_parallel(step, args, m=4, per_microbatch_statistics=False):
    """``step`` on ``args`` split into one stage's programs over ``m`` microbatches, with
    the roles the pipeline planner gives its ops (so what the gradients need is known)."""
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    traced = ScopedFunction(step, *abstract)
    g = ingest(traced, *abstract)
    b = find_gradient_boundary(g)
    roles = classify_ops(g, b).role
    asg = assignment_from_ops(traced, g, [0] * len(g.ops), roles)
    refs = batch_leaves(traced, g, abstract, b.batch_params, m)
    return split_step(flatten(traced.closed, platform_branches=per_microbatch_statistics),
                      asg, refs, 1, m,
                      key_refs=tuple(sorted(key_args(traced))),
                      per_microbatch_statistics=per_microbatch_statistics)


def run_split(sp, args):
    """The step's flat results from its stage programs (1F1B order)."""
    flat = jax.tree_util.tree_leaves(args)
    return run_sequentially(sp, flat, make_schedule("1f1b", sp.num_stages,
                                                    sp.num_microbatches))


def run_sequentially(sp, args, schedule):
    """Run the stage programs in the schedule's order in one thread (no executor): each
    stage's prologue, then F/B in schedule order, then the apply phases in order."""
    m = sp.num_microbatches
    vals, accs = {}, {}
    whole = {s: {r: args[r] for r in sp.whole_batch_args(s)} for s in range(sp.num_stages)}
    for s, pro in sp.prologues.items():
        if pro.outputs:
            ins = [args[r] for r in pro.inputs]
            whole[s].update(zip(pro.outputs, jax.jit(prologue_function(sp, s))(ins)))

    def run(t, k):
        ins = []
        for i in t.inputs:
            if i.source == "arg":
                ins.append(args[i.ref])
            elif i.source == "batch":
                n = args[i.ref].shape[0] // m
                ins.append(args[i.ref][k * n:(k + 1) * n])
            elif i.source == "pre":
                ins.append(whole[t.stage][i.ref])
            elif i.source == "acc":
                ins.append(accs[i.ref])          # as accumulated: the program finishes it
            else:
                ins.append(vals[(i.ref, None if i.producer[0].startswith("A") else k)])
        first = k is None or k == 0
        outs, new = jax.jit(task_function(sp, t, not first))(
            ins, [] if first else [accs[r] for r in t.accumulate], 0 if k is None else k)
        vals.update({(r, k): v for r, v in zip(t.outputs, outs)})
        accs.update(zip(t.accumulate, new))

    for row in schedule.table:
        for s, task in enumerate(row):
            if task is not None and task.kind != "A":
                run(sp.task(task.kind, s), task.microbatch)
    for phase in sorted({k for ks in sp.apply_phases.values() for k in ks},
                        key=lambda k: int(k[1:] or 0)):
        for s in range(sp.num_stages):
            if phase in sp.apply_phases[s]:
                run(sp.task(phase, s), None)
    res = []
    for o in sp.outputs:
        res.append(o.value if o.source == "lit" else args[o.ref] if o.source == "arg"
                   else finish_acc(sp, o.ref, accs[o.ref]) if o.source == "acc"
                   else whole[o.producer[1]][o.ref] if o.source == "pre"
                   else vals[(o.ref, None)])
    return res
