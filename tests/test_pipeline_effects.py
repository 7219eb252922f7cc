"""Host effects in pipelined steps (issue 43): ``jax.debug.callback``, ``jax.debug.print``
(ordered too), ``io_callback`` (ordered and not) and ``pure_callback`` run with the values
and the count ``jax.jit`` gives, on the local executor (cluster 2x4, 2 stages, 4
microbatches). Before, a pipelined step ran none of its debug or io callbacks (no error, the
same loss) and computed a ``pure_callback`` of the weights once per microbatch per task.

On Ray and under ``rhino.launch`` (the callback runs in another process):
``tests/test_runtime_ray.py`` and ``tests/test_launch.py``.
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import rhino
from rhino.errors import RhinoError
from rhino.runtime.executors import artifacts
from rhino.runtime.executors.local import LocalExecutor

PIPE = dict(cluster="2x4", stages=2, num_microbatches=4, timeout=300)


def _state():
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    p = {f"w{i}": jax.random.normal(k[i], (16, 16)) * 0.3 for i in range(4)}
    return p, jax.random.normal(k[4], (16, 16)), jax.random.normal(k[5], (16, 16))


def _every_callback(calls: dict):
    """A step with every kind of host callback, each recording ``(tag, values)`` in
    ``calls``."""
    def log(tag):
        def call(*v):
            calls.setdefault(tag, []).append([np.array(a) for a in v])
            return np.float32(0.0) if tag == "io_dead" else None
        return call

    def pure(tag, fn):
        def call(v):
            log(tag)(v)
            return np.asarray(fn(v), np.float32)
        return call

    def step(p, x, y):
        def loss_fn(p):
            h = x
            for i in range(4):
                h = jnp.tanh(h @ p[f"w{i}"])
                if i == 1:     # recomputed by the backward too: jax.jit calls it twice
                    h = jax.checkpoint(lambda h: (jax.debug.callback(
                        log("remat"), jnp.sum(h)), jnp.sin(h))[1])(h)
            jax.debug.callback(log("sum"), jnp.sum(h))        # a partial sum: its total
            jax.debug.callback(log("rows"), h)                # per example: concatenated
            jax.debug.callback(log("whole"), p["w0"])         # a whole value
            jax.debug.print("max {m} first {f}", m=jnp.max(h), f=p["w3"][0, 0],
                            ordered=True)
            io_callback(log("io_ordered"), None, jax.lax.stop_gradient(jnp.mean(h)),
                        ordered=True)
            dead = io_callback(log("io_dead"), jax.ShapeDtypeStruct((), jnp.float32),
                               jax.lax.stop_gradient(jnp.min(h)))
            dead = dead * 2.0               # read by dead code only: jax.jit still calls it
            # From the batch alone (a prologue computes it whole) and from the weights
            # alone (once per step, not once per task and microbatch): both feed the loss.
            s = jax.pure_callback(pure("pure_data", lambda v: 1.0 + np.mean(v * v)),
                                  jax.ShapeDtypeStruct((), jnp.float32), x)
            t = jax.pure_callback(pure("pure_weights", lambda v: 1.0 + np.sum(v * v)),
                                  jax.ShapeDtypeStruct((), jnp.float32),
                                  jax.lax.stop_gradient(p["w3"]))
            return jnp.mean((h - y) ** 2) * s / t
        loss, g = jax.value_and_grad(loss_fn)(p)
        jax.debug.callback(log("grad"), g["w0"])              # a gradient
        io_callback(log("io"), None, loss)
        metric = jax.pure_callback(pure("pure_metric", np.sum),     # read once per step
                                   jax.ShapeDtypeStruct((), jnp.float32), x @ p["w0"])
        return jax.tree.map(lambda w, d: w - 0.1 * d, p, g), loss, metric
    return step


def _printed(text: str) -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in
            re.findall(r"^max (\S+) first (\S+)$", text, re.M)]


def test_every_host_callback_runs_as_under_jit(capfd):
    """Two steps: every callback is called as often as under jax.jit (once per step; the
    one under ``jax.checkpoint`` twice, as jax.jit does), with jax.jit's values (a
    per-example value concatenated over the microbatches, a partial sum's total, a
    gradient); the ordered prints come out in order; the warm-up on zeros calls none."""
    p, x, y = _state()
    want: dict = {}
    ref = jax.jit(_every_callback(want))
    s = p
    for _ in range(2):
        s, loss, metric = ref(s, x, y)
    jax.effects_barrier()
    want_printed = _printed(capfd.readouterr().out)

    got: dict = {}
    with rhino.auto_parallel(_every_callback(got), **PIPE) as piped:
        s = jax.tree.map(np.asarray, p)
        for _ in range(2):
            s, loss2, metric2 = piped(s, x, y)
        jax.effects_barrier()
        split = piped.split_for(jax.tree.map(np.asarray, p), x, y)
        report = piped.report_for(jax.tree.map(np.asarray, p), x, y)
    assert "host effects      10 callbacks nothing reads: once per step" in report, report
    got_printed = _printed(capfd.readouterr().out)
    assert split.num_stages == 2
    assert {t: len(v) for t, v in got.items()} == {t: len(v) for t, v in want.items()}
    assert len(want["remat"]) == 4 and len(want["rows"]) == 2, want.keys()
    for tag, calls in want.items():
        for a, b in zip(calls, got[tag]):
            for u, v in zip(a, b):
                np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-6, err_msg=tag)
    assert len(got_printed) == len(want_printed) == 2
    np.testing.assert_allclose(got_printed, want_printed, rtol=1e-5)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-5)
    np.testing.assert_allclose(float(metric2), float(metric), rtol=1e-5)


def _with_effect(kind: str):
    def step(p, x, y):
        def loss_fn(p):
            h = jnp.tanh(x @ p["w0"])
            if kind == "io_callback":       # its result is needed per microbatch
                h = h + io_callback(lambda v: np.zeros_like(v), jax.ShapeDtypeStruct(
                    h.shape, h.dtype), jax.lax.stop_gradient(h))
            else:                          # a cond holding a print, on per-example values
                h = jax.lax.cond(p["w1"][0, 0] > -10.0, lambda h: (
                    jax.debug.print("{}", h[0, 0]), h)[1], lambda h: -h, h)
            for i in range(1, 4):
                h = jnp.tanh(h @ p[f"w{i}"])
            return jnp.mean((h - y) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda w, d: w - 0.1 * d, p, g), loss
    return step


@pytest.mark.parametrize("kind,named", [
    ("io_callback", r"io_callback at \S*test_pipeline_effects.py:\d+"),
    ("cond", r"it holds debug_print at \S*test_pipeline_effects.py:\d+.*: cond at ")])
def test_an_effect_the_gradients_need_per_example_is_refused_naming_it(kind, named):
    """An effect whose results the gradients need and which reads per-example values
    would run once per microbatch (jax.jit: once per step, on the whole batch): refused,
    naming the callback's primitive and line and how to keep it."""
    p, x, y = _state()
    with rhino.auto_parallel(_with_effect(kind), **PIPE) as piped:
        with pytest.raises(RhinoError, match=named + r".*jax\.jit runs a host callback once "
                                                     r"per step on the whole batch"):
            piped(p, x, y)


def test_an_effect_read_by_two_stages_is_refused():
    """An ``io_callback`` of no per-example value whose result both stages read: each
    stage's prologue would call it (jax.jit: once); refused, naming it."""
    def step(p, x, y):
        def loss_fn(p):
            s = io_callback(lambda: np.float32(1.0), jax.ShapeDtypeStruct((), jnp.float32))
            h = x
            for i in range(4):
                h = jnp.tanh(h @ p[f"w{i}"]) * s
            return jnp.mean((h - y) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda w, d: w - 0.1 * d, p, g), loss

    p, x, y = _state()
    with rhino.auto_parallel(step, **PIPE) as piped:
        with pytest.raises(RhinoError, match=r"io_callback at \S*test_pipeline_effects.py:"
                                             r"\d+: a host effect would run 2 times per step "
                                             r"\(by the prologue of stage 0 and the prologue "
                                             r"of stage 1\)"):
            piped(p, x, y)


def test_effects_on_stage_programs_built_from_artifacts(tmp_path):
    """Exported stage programs (what Ray actors run): a stage binding host callbacks is
    refused for saving, naming them (``jax.export`` cannot serialize callbacks); with the
    step's code carried along (pickled: the callback writes to a file, as it would from an
    actor) it is rebuilt where it runs, warms up on its quiet exported programs, and calls
    each callback as jax.jit does."""
    pytest.importorskip("ray")                # cloudpickle
    path = str(tmp_path / "calls.txt")

    def write(v):
        with open(path, "a") as f:
            f.write(" ".join(f"{a:.6f}" for a in np.asarray(v).ravel()) + "\n")

    def step(p, x, y):
        def loss_fn(p):
            h = x
            for i in range(4):
                h = jnp.tanh(h @ p[f"w{i}"])
            s = jax.pure_callback(lambda v: np.float32(2.0), jax.ShapeDtypeStruct(
                (), jnp.float32), jax.lax.stop_gradient(p["w3"]))
            jax.debug.callback(write, h)
            return jnp.mean((h - y) ** 2) * s
        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda w, d: w - 0.1 * d, p, g), loss

    def lines():
        with open(path) as f:
            return [np.array(line.split(), float) for line in f]

    p, x, y = _state()
    with rhino.auto_parallel(step, **PIPE) as piped:
        piped(p, x, y)
        run = piped._entry((p, x, y)).run
        with pytest.raises(artifacts.ArtifactError, match=r"stage 0: its programs bind host "
                                                          r"callbacks \(debug_callback at "
                                                          r"\S*test_pipeline_effects.py:\d+"):
            artifacts.export_stages(run.specs, run.lowering.split, "cpu")
        arts = artifacts.export_stages(run.specs, run.lowering.split, "cpu", with_code=True)
        assert [a.rebuild is not None for a in arts] == [True, True]
        assert ("quiet:P", False) in arts[1].programs        # the weights' pure_callback
        devs = [w.mesh.devices.flatten().tolist() for w in run.executor.workers]
        jax.effects_barrier()
        open(path, "w").close()
        with LocalExecutor([a.build(d) for a, d in zip(arts, devs)]) as ex:
            old, run.executor = run.executor, ex
            try:
                run.warm_up(lambda msg: None)
                assert lines() == []
                _, loss = piped(p, x, y)
            finally:
                run.executor = old
    jax.effects_barrier()
    want = jax.jit(step)(p, x, y)
    jax.effects_barrier()
    got = lines()
    assert len(got) == 2
    np.testing.assert_allclose(got[0], got[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(want[1]), rtol=1e-5)


def test_an_ordered_effect_is_no_argument_of_the_planned_graph():
    """A step with an ordered effect is lowered with a runtime token in front of its
    arguments and results: the planner's graph has the step's own arguments and results
    (before, the token took the first argument's place and the batch arguments were
    named wrongly)."""
    def f(w, x):
        jax.debug.print("{}", jnp.sum(x), ordered=True)
        return w * 2, jnp.sum(x)

    g = rhino.ingest(f, jnp.ones(3), jnp.ones(4))
    assert [g.ops[i].arg.path for i in g.params] == ["w", "x"]
    assert [str(g.ops[i].shape) for i in g.params] == ["f32[3]", "f32[4]"]
    assert [o.path for o in g.output_info] == ["out[0]", "out[1]"]


@pytest.mark.slow
def test_flax_nnx_blocks_under_nnx_scan_report_their_activations():
    """A Flax NNX LM whose blocks (made by ``nnx.vmap``, run by ``nnx.scan``) each report
    the mean square of their output through ``jax.debug.callback``, with the loss and the
    gradients' global norm printed after ``jax.value_and_grad``, trained with optax Adam:
    pipelined, every block's report comes once per step, in layer order, with jax.jit's
    values, and the printed norms are jax.jit's."""
    import optax
    from flax import nnx

    layers, d, vocab = 4, 32, 64
    reports: list = []

    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.ln = nnx.LayerNorm(d, rngs=rngs)
            self.fc = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, x):
            y = x + jax.nn.gelu(self.fc(self.ln(x)))
            jax.debug.callback(lambda v: reports.append(float(v)), jnp.mean(y ** 2))
            return y

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs):
                return Block(d, rngs)
            self.blocks = blocks(rngs)
            self.head = nnx.Linear(d, vocab, rngs=rngs)

        def __call__(self, tokens):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                return block(x)
            return self.head(run(self.embed(tokens), self.blocks))

    graphdef, params, rest = nnx.split(LM(nnx.Rngs(0)), nnx.Param, ...)
    tx = optax.adam(1e-3)

    def step(params, opt_state, batch):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params, rest)(batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["labels"]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        jax.debug.print("loss {l} norm {g}", l=loss, g=optax.tree.norm(grads))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tokens = jax.random.randint(jax.random.PRNGKey(1), (16, 8), 0, vocab)
    batch = {"tokens": tokens, "labels": jnp.roll(tokens, 1, axis=1)}

    def printed(fn, state):
        reports.clear()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for _ in range(2):
                *state, _ = fn(*state, batch)
            jax.effects_barrier()
        return list(reports), [float(v) for v in re.findall(r"norm (\S+)", out.getvalue())]

    want, want_norms = printed(jax.jit(step), (params, tx.init(params)))
    with rhino.auto_parallel(step, **PIPE) as piped:
        got, got_norms = printed(piped, jax.tree.map(np.asarray, (params, tx.init(params))))
    assert len(want) == len(got) == 2 * layers
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert len(got_norms) == len(want_norms) == 2
    np.testing.assert_allclose(got_norms, want_norms, rtol=1e-5)
