"""Stage programs as artifacts (``rhino.runtime.executors.artifacts``): exported where the step is
planned, run where the stage is, without the user's code."""

from __future__ import annotations

import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino
from rhino.models import get_model
from rhino.runtime.executors import artifacts
from rhino.runtime.executors.local import LocalExecutor

from handmade import frozen_front_step, loss_only_last_step

GPT = dict(layers=4, hidden=64, heads=2, seq=16, vocab=256, batch=16)


def _staged(step, *args):
    step(*args)
    return step._entry(args).run


def _run_from_artifacts(run, arts, flat):
    """The step's run with its executor swapped for one whose workers are built from
    ``arts`` on the same devices."""
    devs = [w.mesh.devices.flatten().tolist() for w in run.executor.workers]
    workers = [a.build(d) for a, d in zip(arts, devs)]
    return workers, LocalExecutor(workers)


WHOLE_BACKWARD = [("A", False), ("B", False), ("B", True), ("F", False), ("F", True)]
CUT = [("W", False), ("W", True)]


@pytest.mark.parametrize("schedule,programs", [
    ("1f1b", [WHOLE_BACKWARD] * 2),
    # zb-h1: stage 0 sends no gradient back, its whole backward is W
    ("zb-h1", [[("A", False), ("F", False), ("F", True)] + CUT, WHOLE_BACKWARD + CUT])])
def test_a_pipeline_from_artifacts_is_bitwise_the_traced_one(schedule, programs):
    """GPT, 2 stages of 4 devices, 4 microbatches: every stage program exported (F, B, their
    +acc forms, A; W under zb-h1), shipped through plain pickle, built on the same devices:
    2 steps equal the traced pipeline bit for bit, and its compiled programs hold the same
    collectives."""
    m = get_model("gpt", **GPT)
    params, opt = m.init(jax.random.PRNGKey(0))
    batches = [m.make_batch(jax.random.PRNGKey(1 + i)) for i in range(2)]
    with rhino.auto_parallel(m.step, cluster="2x4", stages=2, num_microbatches=4,
                             schedule=schedule) as step:
        run = _staged(step, params, opt, batches[0])
        arts = artifacts.export_stages(run.specs, run.lowering.split, "cpu")
        assert [sorted(a.programs) for a in arts] == [sorted(p) for p in programs]
        arts = pickle.loads(pickle.dumps(arts))
        traced = [step(params, opt, b) for b in batches]
        workers, ex = _run_from_artifacts(run, arts, None)
        old, run.executor = run.executor, ex
        try:
            exported = [step(params, opt, b) for b in batches]
            for w, v in zip(workers, old.workers):
                assert w.collectives() == v.collectives()
        finally:
            run.executor = old
            ex.close()
    for a, b in zip(jax.tree_util.tree_leaves(traced), jax.tree_util.tree_leaves(exported)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_artifacts_hold_no_user_code_and_prologues_export():
    """A step closing over an instance of a class local to this test (plain pickle cannot
    find it by name), with a whole-batch statistic (the stage's prologue) and a typed PRNG
    key: its artifacts pickle with plain ``pickle``, hold a prologue program, and run equal
    to jax.jit."""

    class Scale:            # local: pickle by reference would fail
        def __init__(self, s):
            self.s = s

    scale = Scale(0.5)

    def step(p, x, key):
        def loss_fn(p):
            z = x - x.mean(0)                                  # whole-batch: a prologue
            keep = jax.random.bernoulli(key, 0.9, (x.shape[0], 32))
            h = jnp.where(keep, jnp.tanh(z @ p["a"]), 0.0) * scale.s
            return jnp.mean((h @ p["b"]) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda w, d: w - 0.1 * d, p, g), loss

    ks = jax.random.split(jax.random.key(0), 2)
    p = {"a": jax.random.normal(ks[0], (8, 32)) / 3, "b": jax.random.normal(ks[1], (32, 4))}
    x = jax.random.normal(jax.random.key(1), (16, 8))
    key = jax.random.key(2)
    with pytest.raises(Exception):
        pickle.dumps(step)
    with rhino.auto_parallel(step, cluster="2x2", stages=2, num_microbatches=4) as piped:
        run = _staged(piped, p, x, key)
        arts = artifacts.export_stages(run.specs, run.lowering.split, "cpu")
        blob = pickle.dumps(arts)
        assert b"Scale" not in blob
        arts = pickle.loads(blob)
        assert any(("P", False) in a.programs for a in arts)
        workers, ex = _run_from_artifacts(run, arts, None)
        old, run.executor = run.executor, ex
        try:
            got = piped(p, x, key)
        finally:
            run.executor = old
            ex.close()
    want = jax.jit(step)(p, x, key)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_saved_artifacts_load_and_are_checked(tmp_path):
    """``save``/``load`` round trip; another JAX, another platform, another format or a
    missing file are refused, each naming what was expected and found."""
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    w = jnp.ones((8, 8)) / 8
    x = jnp.ones((16, 8))
    with rhino.auto_parallel(step, cluster="1x4", stages=2, num_microbatches=2) as piped:
        run = _staged(piped, w, x)
        arts = artifacts.export_stages(run.specs, run.lowering.split, "cpu")
    artifacts.save(str(tmp_path), arts)
    back = artifacts.load(str(tmp_path))
    assert [a.programs for a in back] == [a.programs for a in arts]
    back[0].build(jax.devices()[:int(np.prod(back[0].mesh_shape))])
    with pytest.raises(artifacts.ArtifactError, match=r"exported by jax 0\.0\.1, this "
                                                      r"process has jax"):
        dataclasses.replace(arts[0], jax_version="0.0.1").check()
    with pytest.raises(artifacts.ArtifactError, match=r"lowered for 'cuda', this process "
                                                      r"runs on 'cpu'"):
        dataclasses.replace(arts[0], platform="cuda").check()
    with pytest.raises(artifacts.ArtifactError, match=r"artifact format 99"):
        dataclasses.replace(arts[0], format=99).check()
    with pytest.raises(artifacts.ArtifactError, match=r"expected saved stage programs"):
        artifacts.load(str(tmp_path / "nowhere"))


@pytest.mark.slow
def test_saved_stages_run_later_in_a_process_without_the_steps_code(tmp_path):
    """``save_stages`` here; a fresh Python process that imports only rhino, jax and numpy
    runs them (``SavedPipeline``) on the saved arguments: its results equal this process's
    jax.jit."""
    import subprocess
    import sys
    import textwrap

    m = get_model("gpt", **GPT)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    args = (params, opt, batch)
    with rhino.auto_parallel(m.step, cluster="2x2", stages=2, num_microbatches=2) as step:
        step(*args)
        step.save_stages(str(tmp_path), *args)
    np.savez(tmp_path / "args.npz", *[np.asarray(x) for x in jax.tree_util.tree_leaves(args)])
    want = jax.tree_util.tree_leaves(jax.jit(m.step)(*args))
    script = textwrap.dedent("""
        import os, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        import numpy as np
        from rhino.runtime.executors.artifacts import SavedPipeline
        d = sys.argv[1]
        got = np.load(os.path.join(d, "args.npz"))
        flat = [got[f"arr_{i}"] for i in range(len(got.files))]
        with SavedPipeline(d) as run:
            out = run(*flat)
        np.savez(os.path.join(d, "out.npz"), *[np.asarray(x) for x in out])
        print("modules:", sorted(m for m in sys.modules if m.startswith("rhino.models")))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "modules: []" in done.stdout      # the zoo model's code was never imported
    out = np.load(tmp_path / "out.npz")
    assert len(out.files) == len(want)
    for i, w in enumerate(want):
        np.testing.assert_allclose(out[f"arr_{i}"], np.asarray(w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make,empty", [(frozen_front_step, [("A", 0), ("B", 0)]),
                                        (loss_only_last_step, [("A", 1)])])
def test_stages_with_an_empty_task_run_from_their_artifacts(make, empty, tmp_path):
    """Issue 43: a stage with no trained weights (its backward and apply tasks empty) or
    that is only the loss (its apply task empty): no program is exported for an empty task
    and none is asked for; the saved stages run (``SavedPipeline``) equal to jax.jit.
    (Before: "no program B among its artifacts", the instruction list still ran it.)"""
    step, args, opts = make()
    with rhino.auto_parallel(step, cluster="2x4", stages=2, num_microbatches=4,
                             **opts) as piped:
        host = jax.tree_util.tree_map(np.array, args)
        split = piped.split_for(*host)
        assert sorted(k for k, t in split.tasks.items() if t.empty) == empty
        piped.save_stages(str(tmp_path), *host)
    arts = artifacts.load(str(tmp_path))
    for kind, s in empty:
        assert not [k for k in arts[s].programs if k[0] == kind], arts[s].programs.keys()
    want = jax.tree_util.tree_leaves(jax.jit(step)(*args))
    with artifacts.SavedPipeline(arts) as run:
        for _ in range(2):
            got = run(*host)
            for a, b in zip(got, want):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_exported_programs_get_a_received_value_in_the_plans_layout(tmp_path):
    """A value taken in its sender's layout reached a stage's exported program, which
    changes layouts inside the inlined module: with a LAPACK custom call (tridiagonal_solve)
    XLA's partitioner failed its HLO verifier ('ElementsIn(reshape)'), on Ray (whose
    transfers keep the sender's layout) and here when both stages share devices. Exported
    programs now get received values in the plan's layout; the step equals the traced one."""
    import microbatch_corpus as C

    case = next(c for c in C.CASES if c.name == "tridiagonal_solve")
    args = C.args_of("float32")
    step, _ = C.make_step(case, "float32")
    with rhino.auto_parallel(step, cluster="2x4", stages=2, num_microbatches=C.M) as piped:
        want = [np.asarray(x) for x in jax.tree_util.tree_leaves(piped(*args))]
        piped.save_stages(str(tmp_path), *args)
    mesh = jax.devices()[:4]
    with artifacts.SavedPipeline(str(tmp_path), devices=[mesh, mesh]) as run:
        got = run(*args)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
