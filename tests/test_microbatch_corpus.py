"""Coverage of the microbatch analysis, generated (issue 43, acceptance 1): every primitive
of ``jax.lax`` that can take a per-example operand, and the composites users write, each in
a training step (``microbatch_corpus``), in float32, bfloat16 and float16.

Default suite: every primitive is covered by a case or excluded with a reason; every case
holds the primitives it claims; the analysis refuses exactly the cases that couple the
batch (every dtype); a sample runs per microbatch (``simulate``) equal to ``jax.jit`` to
its dtype's rounding. With ``-m slow``: every case and dtype through ``rhino.auto_parallel``
on 2x4 (2 stages, 4 microbatches), each equal to ``jax.jit`` or refused, every refusal
shown to be of a step that gradient accumulation computes differently
(``benchmarks/microbatch_coverage.py`` writes the table of ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import jax
import pytest

import microbatch_corpus as C
from rhino.hlo_passes.unroll import INDEX_SCOPE, trace
from rhino.jaxpr.interpret import flatten
from rhino.jaxpr.microbatch import analyze, ancestors
from rhino.jaxpr.private import open_body

RUNS = [(c, dt) for c in C.CASES for dt in c.dtypes]


def _ids(runs):
    return [f"{c.name}-{dt}" for c, dt in runs]


def _primitives_of(jaxpr) -> set[str]:
    """Every primitive of ``jaxpr`` and of the bodies its equations hold."""
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for v in eqn.params.values():
            for x in (v if isinstance(v, (tuple, list)) else (v,)):
                body = open_body(x)
                if body is not None:
                    out |= _primitives_of(body[0])
            for x in getattr(v, "_fields", ()):   # custom_linear_solve's jaxprs
                body = open_body(getattr(v, x))
                if body is not None:
                    out |= _primitives_of(body[0])
    return out


def analysis(c: C.Case, dtype: str):
    """The case's step traced as rhino traces it (scans unrolled), flattened and
    analysed with the gradients' ancestors as what the gradients need."""
    args = C.args_of(dtype)
    step, _ = C.make_step(c, dtype)
    leaves, tree = jax.tree.flatten(args)
    flat = flatten(trace(lambda *f: step(*jax.tree.unflatten(tree, f)), *leaves))
    n_state = len(jax.tree.leaves(args[:2]))
    n_batch = len(jax.tree.leaves(args[2]))
    n_grads = len(jax.tree.leaves(args[0]))
    grads = [flat.outs[k] for k in range(len(flat.outs) - n_grads, len(flat.outs))]
    lay = analyze(flat, range(n_state, n_state + n_batch), C.M,
                  state_refs=range(n_state), feeds_gradient=ancestors(flat, grads),
                  batch_free_scope=INDEX_SCOPE)
    return flat, lay, leaves, args


def test_every_lax_primitive_is_covered_or_excluded_with_a_reason():
    missing = C.lax_primitives() - set(C.covered()) - set(C.NOT_PER_EXAMPLE)
    assert not missing, f"primitives of jax.lax with no case and no reason: {sorted(missing)}"
    for name in ("scan", "while", "cond"):
        assert C.covered().get(name), name
    assert all(why for p, why in C.NOT_PER_EXAMPLE.items() if p not in C.covered())


@pytest.mark.parametrize("c", C.CASES, ids=[c.name for c in C.CASES])
def test_each_case_holds_its_primitives(c):
    args = C.args_of(c.dtypes[0])
    step, _ = C.make_step(c, c.dtypes[0])
    have = _primitives_of(jax.make_jaxpr(step)(*args).jaxpr)
    assert set(c.prims) <= have, f"{c.name}: {sorted(set(c.prims) - have)} not in its step"


@pytest.mark.parametrize("c,dtype", RUNS, ids=_ids(RUNS))
def test_the_analysis_refuses_exactly_the_steps_that_couple_the_batch(c, dtype):
    flat, lay, _, _ = analysis(c, dtype)
    refused = bool(lay.couplings)
    why = lay.couplings[0].describe() if refused else ""
    assert refused == c.refused, f"{c.name} {dtype}: {'refused: ' + why if refused else 'ran'}"
    if refused:
        assert "microbatch_corpus.py:" in why        # the user's line is named


SAMPLE = [(c, dt) for c, dt in RUNS if dt == "bfloat16" and c.name in {
    "rms_norm_f32", "cross_entropy", "pick_by_label", "scatter_by_position", "scan_long",
    "while", "cond", "concat_augment", "strided_batch", "segment_sum_batch", "attention",
    "masked_mean_tokens", "dropout", "sort", "cumsum", "layer_norm", "embedding"}]


@pytest.mark.parametrize("c,dtype", SAMPLE, ids=_ids(SAMPLE))
def test_a_sample_runs_per_microbatch_equal_to_jit(c, dtype):
    from rhino.jaxpr.simulate import simulate

    flat, lay, leaves, args = analysis(c, dtype)
    assert not lay.couplings
    v = C.judge(c, dtype, args, simulate(flat, lay, leaves))
    assert v.ok, f"{c.name} {dtype}: {v}"


@pytest.mark.parametrize("name", ["cond", "while", "scan_long"])
def test_stage_artifacts_of_steps_with_control_flow_pickle(name):
    """What goes to a Ray actor or into a saved artifact is plain data: the split's
    per-microbatch bodies of control flow (jaxprs, whose equations hold tracebacks and
    primitives' local functions) are stripped. They were not, and every step with a
    cond, a while or a long scan failed on Ray ("Can't pickle local object")."""
    import pickle

    import rhino
    from rhino.runtime.executors.artifacts import strip

    c = next(c for c in C.CASES if c.name == name)
    args = C.args_of("bfloat16")
    step, _ = C.make_step(c, "bfloat16")
    run = rhino.auto_parallel(step, cluster="2x4", stages=2, num_microbatches=C.M)
    try:
        split = run.split_for(*args)
    finally:
        run.close()
    assert split.layout.bodies, f"{name}: expected per-microbatch bodies in the layout"
    bare = strip(split)
    assert not bare.layout.bodies
    pickle.loads(pickle.dumps(bare))


@pytest.mark.slow
@pytest.mark.parametrize("c,dtype", SAMPLE, ids=_ids(SAMPLE))
def test_a_sample_pipelined_on_ray_equals_jit(c, dtype, ray_cluster):
    """The sample through ``auto_parallel(..., executor="ray")`` on 2x4: each stage's
    programs on Ray actors, judged as the local executor's runs (issue 43, acceptance 5;
    the whole corpus: ``benchmarks/microbatch_coverage.py --executor ray|launch``, the
    launch job in ``tests/corpus_job.py``; benchmarks/RESULTS.md has the runs)."""
    v = C.pipelined_verdict(c, dtype, executor="ray", timeout=120.0)
    assert v.ok and v.outcome == "exact", f"{c.name} {dtype}: {v}"


@pytest.mark.slow
@pytest.mark.parametrize("c,dtype", RUNS, ids=_ids(RUNS))
def test_every_case_pipelined_on_2x4_is_exact_or_rightly_refused(c, dtype):
    v = C.pipelined_verdict(c, dtype)
    assert v.ok, f"{c.name} {dtype}: {v}"
