"""The first call behaves as every later one (issue 33): stage programs are compiled before it,
so ``timeline()`` shows a steady-state step; an SPMD program deletes its donated inputs on it
too (stage programs keep theirs on every call); a Ray run raises no fork warning and its
actors print no per-rank gloo lines."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

import rhino
from rhino.models import get_model
from rhino.runtime.ray.actor import GLOO_CHATTER

# The extended tier (Ray, several processes, the docs' commands, the slowest runs): run by
# .ci/run after the default suite (README, Tests: `-m "extended and not slow"`).
pytestmark = pytest.mark.extended

GPT = dict(layers=2, hidden=32, heads=2, seq=8, vocab=64, batch=8)


def _fresh(m):
    """New state and batch (jax arrays: donation deletes them)."""
    params, opt = m.init(jax.random.PRNGKey(0))
    return params, opt, m.make_batch(jax.random.PRNGKey(1))


@pytest.fixture(scope="module")
def gpt():
    return get_model("gpt", **GPT)


@pytest.fixture(scope="module")
def piped(gpt):
    """A 2-stage pipeline, its first and second call: (step, inputs of call 1, timeline
    and seconds of call 1, of call 2)."""
    step = rhino.auto_parallel(gpt.step, cluster="2x4", stages=2, num_microbatches=2)
    first_in = _fresh(gpt)
    p, o, _ = step(*first_in)
    tl1, s1 = step.timeline(), step.last_step_s
    p, o, _ = step(p, o, first_in[2])
    tl2, s2 = step.timeline(), step.last_step_s
    yield step, first_in, (tl1, s1), (tl2, s2)
    step.close()


def test_the_first_timeline_is_a_steady_state_step(piped):
    step, args, (tl1, s1), (tl2, s2) = piped
    run = step._entry(args).run
    assert run.warm_up_s is not None and run.warm_up_s > 0
    # Compiling took the warm-up; the first step is a step like the second one.
    assert s1 < run.warm_up_s / 2, (s1, run.warm_up_s)
    assert tl1.step_s < 10 * tl2.step_s + 0.05, (tl1.step_s, tl2.step_s)
    assert "compiled          every stage program before the first step" in \
        step.report_for(*args)


def test_a_pipeline_keeps_its_inputs_on_every_call(piped):
    step, (params, opt, batch), _, _ = piped
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, opt, batch)))


def test_spmd_deletes_donated_inputs_on_the_first_call(gpt):
    params, opt, batch = _fresh(gpt)
    step = rhino.auto_parallel(gpt.step, mesh_shape=(8,))
    p, o, _ = step(params, opt, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves((params, opt)))
    assert not any(x.is_deleted() for x in jax.tree.leaves(batch))
    step(p, o, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves((p, o)))
    kept = _fresh(gpt)
    rhino.auto_parallel(gpt.step, mesh_shape=(8,), donate=False)(*kept)
    assert not any(x.is_deleted() for x in jax.tree.leaves(kept))


def test_gloo_lines_are_dropped_and_other_output_kept(tmp_path):
    script = tmp_path / "chatter.py"
    script.write_text(
        "import os\n"
        "from rhino.runtime.ray.actor import GLOO_CHATTER, drop_output_lines\n"
        "drop_output_lines(GLOO_CHATTER)\n"
        "os.write(1, b'[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of "
        "connected peer ranks is : 7\\n')\n"
        "os.write(1, b'step 1 loss 2.5\\n')\n"
        "print('from python', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "RHINO_SHOW_GLOO"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["step 1 loss 2.5", "from python"]
    assert GLOO_CHATTER.startswith(rb"^\[Gloo\]")


def test_a_ray_run_raises_no_fork_warning(ray_cluster):
    ray = pytest.importorskip("ray")
    from rhino.runtime.ray.executor import init

    m = get_model("mlp", batch=8, hidden=16, layers=2)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    jax.numpy.ones(4).sum().block_until_ready()       # JAX has run in this process
    ray.shutdown()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        init(num_cpus=4, log_to_driver=False)
        with rhino.auto_parallel(m.step, cluster="2x1", stages=2, num_microbatches=2,
                                 executor="ray", timeout=120.0) as step:
            _, _, loss = step(jax.tree.map(np.asarray, params),
                              jax.tree.map(np.asarray, opt), batch)
    assert np.isfinite(float(loss))
    forks = [w for w in seen if issubclass(w.category, RuntimeWarning)
             and "fork" in str(w.message)]
    assert not forks, [str(w.message)[:120] for w in forks]
