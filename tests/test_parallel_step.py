"""One step type, one plan type, lowering that refuses what it cannot place.

``auto_parallel`` returns a ``ParallelStep`` for an SPMD mesh and for a cluster alike; both
give a ``rhino.Plan`` that round-trips through JSON and re-runs to the same losses; a plan
naming a value the program lacks is refused with the value's name, on both paths.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino
from rhino.models import get_model

GPT = dict(layers=2, hidden=64, heads=2, seq=16, vocab=256, batch=16)


def _copy(tree):
    return jax.tree.map(np.array, tree)


def _losses(step, params, opt, batch, n):
    p, o, out = _copy(params), _copy(opt), []
    for _ in range(n):
        p, o, loss = step(p, o, batch)
        out.append(float(loss))
    return out


@pytest.fixture(scope="module")
def gpt():
    m = get_model("gpt", **GPT)
    params, opt = m.init(jax.random.PRNGKey(0))
    return m, params, opt, m.make_batch(jax.random.PRNGKey(1))


@pytest.fixture(scope="module")
def runs(gpt):
    """The SPMD and the pipelined step, each run 3 steps."""
    m, params, opt, batch = gpt
    spmd = rhino.auto_parallel(m.step, mesh_shape=(2, 4))
    piped = rhino.auto_parallel(m.step, cluster="2x4", stages=2, num_microbatches=4,
                                timeout=120)
    out = {"spmd": (spmd, _losses(spmd, params, opt, batch, 3)),
           "pipeline": (piped, _losses(piped, params, opt, batch, 3))}
    yield out
    piped.close()


def test_one_step_type_for_both_paths(runs, gpt):
    spmd, piped = runs["spmd"][0], runs["pipeline"][0]
    assert type(spmd) is type(piped) is rhino.ParallelStep
    ref = jax.jit(gpt[0].step)
    want = _losses(ref, *gpt[1:], 3)
    for name in ("spmd", "pipeline"):
        np.testing.assert_allclose(runs[name][1], want, rtol=1e-4)


@pytest.mark.parametrize("path", ["spmd", "pipeline"])
def test_one_plan_class_round_trips_and_reruns(runs, gpt, path):
    m, params, opt, batch = gpt
    step, losses = runs[path]
    plan = step.plan_for(params, opt, batch)
    assert isinstance(plan, rhino.Plan)
    assert plan.num_stages == (1 if path == "spmd" else 2)
    again = rhino.Plan.from_json(plan.to_json())
    assert again == plan
    rerun = rhino.auto_parallel(m.step, plan=again, timeout=120)
    try:
        assert rerun.plan_for(params, opt, batch) == plan
        assert _losses(rerun, params, opt, batch, 3) == losses
    finally:
        rerun.close()


def _renamed(plan: rhino.Plan, edit) -> rhino.Plan:
    d = json.loads(plan.to_json())
    edit(d)
    return rhino.Plan.from_dict(d)


def test_spmd_plan_naming_a_missing_parameter_is_refused(runs, gpt):
    m, params, opt, batch = gpt
    plan = runs["spmd"][0].plan_for(params, opt, batch)

    def edit(d):
        d["stages"][0]["spmd"]["params"][3]["path"] = "params['not_here']"
    bad = rhino.auto_parallel(m.step, plan=_renamed(plan, edit))
    with pytest.raises(rhino.PlanMismatchError, match=r"params\['not_here'\]"):
        bad(params, opt, batch)


def test_pipeline_plan_naming_a_missing_op_is_refused(runs, gpt):
    m, params, opt, batch = gpt
    plan = runs["pipeline"][0].plan_for(params, opt, batch)

    def edit(d):
        d["stages"][1]["ops"][0] = "no_such_op.123"
    bad = rhino.auto_parallel(m.step, plan=_renamed(plan, edit), timeout=120)
    with pytest.raises(rhino.PlanMismatchError, match=r"stage 1 runs op 'no_such_op.123'"):
        bad(params, opt, batch)

    def edit_weight(d):
        d["stages"][0]["spmd"]["params"][0]["path"] = "params['gone']"
    bad = rhino.auto_parallel(m.step, plan=_renamed(plan, edit_weight), timeout=120)
    with pytest.raises(rhino.PlanMismatchError, match=r"params\['gone'\]"):
        bad(params, opt, batch)


def test_a_spec_no_sharding_expresses_is_a_lowering_error_naming_the_value(runs, gpt):
    m, params, opt, batch = gpt
    plan = runs["spmd"][0].plan_for(params, opt, batch)
    target = next(p for p in plan.spmd.params if p.path == "params['wte']")

    def edit(d):
        for p in d["stages"][0]["spmd"]["params"]:
            if p["path"] == target.path:     # dim 0 dealt round-robin in chunks of 2
                p["spec"] = rhino.ShardingSpec.parse("S[x/s2]·R").to_dict()
    bad = rhino.auto_parallel(m.step, plan=_renamed(plan, edit))
    with pytest.raises(rhino.LoweringError, match=r"params\['wte'\].*strided"):
        bad(params, opt, batch)


def test_options_are_checked_when_the_step_is_built():
    f = lambda x: x  # noqa: E731
    with pytest.raises(rhino.OptionsError, match="opt_level"):
        rhino.auto_parallel(f, opt_level="O7")
    with pytest.raises(rhino.OptionsError, match="timeout"):
        rhino.auto_parallel(f, cluster="2x4", timeout=-1)
    with pytest.raises(rhino.OptionsError, match="transport"):
        rhino.auto_parallel(f, cluster="2x4", transport="pigeon")
    with pytest.raises(rhino.OptionsError, match=r"transport: expected one of \['jax'\] with "
                                                 r"executor 'ray', found 'broadcast'"):
        rhino.auto_parallel(f, cluster="2x4", executor="ray", transport="broadcast")
    with pytest.raises(rhino.OptionsError, match="found 'jax' .a transport of the ray"):
        rhino.auto_parallel(f, cluster="2x4", transport="jax")
    with pytest.raises(rhino.OptionsError, match="ray_pin_cpus: expected True, False or "
                                                 "None, found 'yes'"):
        rhino.auto_parallel(f, cluster="2x4", executor="ray", ray_pin_cpus="yes")
    with pytest.raises(rhino.OptionsError, match="ray_pin_cpus: only for executor='ray'"):
        rhino.auto_parallel(f, cluster="2x4", ray_pin_cpus=True)
    with pytest.raises(rhino.OptionsError, match="cluster"):
        rhino.auto_parallel(f, cluster="2by4")
    with pytest.raises(rhino.OptionsError, match="stages"):
        rhino.auto_parallel(f, cluster="2x4", stages=0)
    with pytest.raises(rhino.OptionsError, match="plan"):
        rhino.auto_parallel(f, plan="plan.json")


@pytest.mark.parametrize("executor", ["ray", "local"])
@pytest.mark.parametrize("name", ["object_store", "direct"])
def test_the_removed_ray_transports_are_refused_saying_so(name, executor):
    """The Ray executor's ``"object_store"`` and ``"direct"`` transports were removed (issue
    30): asking for one names what is expected, what was found and that it was removed,
    when the step is built (``auto_parallel``) and from ``RayExecutor`` itself (before it
    reaches any cluster)."""
    from rhino.runtime.executors.local import ExecutorError
    from rhino.runtime.ray.executor import RayExecutor

    removed = (r": the Ray executor's 'object_store' and 'direct' transports were removed; "
               r"values between stages on Ray move by JAX's transfers \(transport='jax', the "
               r"default\)$")
    fits = r"\['jax'\]" if executor == "ray" else \
        r"\['device_put', 'broadcast', 'send_recv'\]"
    with pytest.raises(rhino.OptionsError, match=rf"^transport: expected one of {fits} with "
                                                 rf"executor '{executor}', found '{name}'"
                                                 + removed):
        rhino.auto_parallel(lambda x: x, cluster="2x4", executor=executor, transport=name)
    if executor == "ray":
        with pytest.raises(ExecutorError, match=rf"^transport: expected one of \['jax'\] for "
                                                rf"the Ray executor, found '{name}'" + removed):
            RayExecutor([], transport=name)


def test_plan_pipeline_honours_its_options(gpt):
    from rhino.pipeline import PipelineOptions

    m = gpt[0]
    opts = PipelineOptions(num_microbatches=4, epsilon=0.3, max_stages=2, kinds=("hybrid",),
                           two_d=False, executor="serial")
    p = rhino.plan_pipeline(m.step, *m.example_args(), cluster="2x4", options=opts)
    assert p.num_microbatches == 4 and p.epsilon == 0.3 and p.num_stages == 2


def test_arguments_the_step_never_reads_stay_arguments():
    """An argument (and a batch field) the step never reads: ``jax.jit`` drops it from the
    executable unless told to keep it, and the plan's shardings no longer lined up with
    the compiled program's (``ShardingMismatchError: ... has 2 shardings, the plan 3``).
    Unused batch fields, Haiku state and ``optax.apply_if_finite`` counters all do this."""
    import jax.numpy as jnp

    def step(w, batch, unused):
        def loss(v):
            return jnp.mean(jnp.tanh(batch["x"] @ v) ** 2)
        l, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, l

    w = jnp.full((64, 64), 0.01)
    batch = {"x": jnp.ones((32, 64)), "label_never_read": jnp.zeros((32,), jnp.int32)}
    ref = jax.jit(step)
    s1, s2 = w, np.asarray(w)
    with rhino.auto_parallel(step, mesh_shape=(8,)) as par:
        for _ in range(2):
            s1, l1 = ref(s1, batch, jnp.ones(3))
            s2, l2 = par(s2, _copy(batch), np.ones(3, np.float32))
            np.testing.assert_allclose(float(l2), float(l1), rtol=1e-6)
        paths = [p.path for p in par.plan_for(s2, _copy(batch), np.ones(3, np.float32))
                 .spmd.params]
        assert any("unused" in p for p in paths) and any("label_never_read" in p
                                                          for p in paths), paths
    np.testing.assert_allclose(np.asarray(s2), np.asarray(s1), rtol=1e-6)


@pytest.mark.parametrize("options", [dict(mesh_shape=(8,)),
                                     dict(cluster="2x1", stages=1)])
def test_a_python_float_keeps_its_weak_type(options):
    """bf16 state minus a Python-float learning rate stays bf16, as under ``jax.jit`` (the
    float was traced as a strong float32 and the weights came back float32)."""
    import jax.numpy as jnp

    def step(w, x, lr):
        return w - lr * (x.T @ (x @ w)), jnp.sum(x @ w)

    w = jnp.full((64, 64), 0.01, jnp.bfloat16)
    x = jnp.ones((32, 64), jnp.bfloat16)
    want = jax.jit(step)(w, x, 0.1)
    with rhino.auto_parallel(step, **options) as par:
        got = par(np.asarray(w), np.asarray(x), 0.1)
    assert [a.dtype for a in got] == [a.dtype for a in want] == [jnp.bfloat16] * 2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=1e-2)


def test_a_pipeline_plan_run_on_a_model_of_other_sizes_is_refused(runs, gpt):
    """A saved pipeline plan given a model of other shapes (same op names: the same program
    at another width) is a PlanMismatchError naming a weight and both shapes, before
    anything is split or run."""
    m, params, opt, batch = gpt
    plan = runs["pipeline"][0].plan_for(params, opt, batch)
    wide = get_model("gpt", **dict(GPT, hidden=2 * GPT["hidden"]))
    wp, wo = wide.init(jax.random.PRNGKey(0))
    bad = rhino.auto_parallel(wide.step, plan=plan, timeout=120)
    with pytest.raises(rhino.PlanMismatchError, match=r"reads \"params\[.*\]\" as f32\[.*\], "
                                                     r"where this program has f32\["):
        bad(wp, wo, wide.make_batch(jax.random.PRNGKey(1)))


def test_results_passed_back_keep_the_signature_the_step_was_planned_for():
    """A weakly typed state leaf (a Python-number step count) comes back weakly typed,
    whether it came through the host (0-d) or stays on Ray actors (a ``RemoteArray``
    handle): passed back, it has the same signature, so nothing is planned again."""
    import numpy as np

    from rhino.runtime.state.remote_array import RemoteArray
    from rhino.runtime.executors.runs import _typed_as
    from rhino.step_arguments import signature

    weak = jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)
    arg = (3,)
    back = _typed_as(jnp.asarray(np.int32(4)), weak)
    assert signature(None, (back,)) == signature(None, arg)
    handle = _typed_as(RemoteArray(None, 0, 7, 1, (), np.int32), weak)
    assert signature(None, (handle,)) == signature(None, arg)
    strong = jax.ShapeDtypeStruct((), jnp.int32)
    assert not _typed_as(jnp.asarray(np.int32(4)), strong).weak_type
