"""Pipelines that compute what the step computes (issue 28): training steps written as users
of JAX, optax and Flax write them, pipelined on cluster 2x4 with 2 stages and 4
microbatches (local executor), 5 Adam steps against one-device ``jax.jit``.

The microbatches are a sharding of the batch over time (``rhino.jaxpr.microbatch``): values
computed from the batch alone are computed for the whole batch, sums over the batch are
summed, each value by its own rule.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rhino

PIPE = dict(cluster="2x4", stages=2, num_microbatches=4, timeout=300)
STEPS = 5
B = 16


def _host(tree):
    return jax.tree.map(lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                        else np.array(x), tree)


def compare(step, state, batch, steps=STEPS, loss_at=-1, **options):
    """Train ``steps`` steps of ``step(*state, *batch) -> (... )`` pipelined and with
    jax.jit; the leaves of ``state`` are at the front of the result unless the step says
    where (``state_at``): losses rtol 1e-5, state atol 1e-5 (``state_tol``)."""
    state_at = options.pop("state_at", slice(0, len(state)))
    tol = options.pop("state_tol", 1e-5)
    ref = jax.jit(step)
    piped = rhino.auto_parallel(step, **PIPE, **options)
    s1, s2 = tuple(state), tuple(_host(state))
    try:
        for _ in range(steps):
            o1, o2 = ref(*s1, *batch), piped(*s2, *batch)
            for a, b in zip(jax.tree.leaves(o1[loss_at]), jax.tree.leaves(o2[loss_at])):
                np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
            s1, s2 = tuple(o1[state_at]), tuple(o2[state_at])
        for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
            np.testing.assert_allclose(np.asarray(b, np.float64), np.asarray(a, np.float64),
                                       atol=tol, rtol=tol)
        plan = piped.plan_for(*_host(state), *batch)
        assert plan.num_stages == 2 and plan.num_microbatches == 4
        split = piped.split_for(*_host(state), *batch)
        assert all(split.task(k, s).eqns for k in "FB" for s in range(2)), split.summary()
        return plan
    finally:
        piped.close()


def _mlp(key, sizes=(8, 32, 32, 1)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def _apply(params, x):
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.gelu(x)
    return x


def test_diffusion_time_sampling_follows_the_whole_batch():
    """``t = uniform(k, (n,), maxval=1/n) + arange(n) / n`` (stratified time sampling of a
    score-based diffusion model): traced per microbatch it was ``arange(4) / 4`` in every
    microbatch and the loss was off by 1e-3 from step 0, silently."""
    tx = optax.adam(1e-2)

    def step(params, opt_state, x, key):
        n = x.shape[0]
        kt, kn = jax.random.split(key)
        t = jax.random.uniform(kt, (n,), maxval=1.0 / n) + jnp.arange(n) / n
        noise = jax.random.normal(kn, x.shape)

        def loss_fn(p):
            alpha = jnp.exp(-t)[:, None]
            xt = alpha * x + jnp.sqrt(1 - alpha ** 2) * noise
            pred = _apply(p, jnp.concatenate([xt, t[:, None]], axis=1))
            return jnp.mean((pred - noise) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    params = _mlp(jax.random.key(0), (9, 32, 32, 8))
    x = jax.random.normal(jax.random.key(1), (B, 8))
    compare(step, (params, tx.init(params)), (x, jax.random.key(2)))


def test_token_weighted_lm_loss_with_random_padding():
    """``sum(nll * mask) / sum(mask)`` (Flax lm1b's and Haiku's LM losses): the numerator is
    summed over microbatches, the normaliser computed once for the whole batch."""
    vocab, seq, d = 64, 12, 32
    tx = optax.adam(1e-2)
    k = jax.random.split(jax.random.key(0), 4)
    params = {"emb": jax.random.normal(k[0], (vocab, d)) * 0.1,
              "mlp": _mlp(k[1], (d, 64, d)),
              "out": jax.random.normal(k[2], (d, vocab)) * 0.1}

    def step(params, opt_state, tokens, mask):
        def loss_fn(p):
            h = p["emb"][tokens[:, :-1]]
            logits = _apply(p["mlp"], h) @ p["out"]
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None],
                                       -1)[..., 0]
            w = mask[:, 1:]
            return jnp.sum(nll * w) / jnp.sum(w)
        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    tokens = jax.random.randint(k[3], (B, seq), 0, vocab)
    lengths = jax.random.randint(jax.random.key(5), (B,), 3, seq + 1)
    mask = (jnp.arange(seq)[None] < lengths[:, None]).astype(jnp.float32)
    compare(step, (params, tx.init(params)), (tokens, mask))


def test_loss_first_then_state_in_a_dict():
    """``return loss, state`` (and the state a dict of params, optimizer state, a step
    counter and a count of tokens seen): updated state is found wherever it sits in the
    results, an int counter is updated once per step, the token count is the batch's."""
    tx = optax.adam(1e-2)

    def step(state, x, y, mask):
        def loss_fn(p):
            per = jnp.sum((_apply(p, x) - y) ** 2, axis=-1)
            return jnp.sum(per * mask) / x.shape[0]
        loss, g = jax.value_and_grad(loss_fn)(state["params"])
        u, opt = tx.update(g, state["opt"], state["params"])
        return loss, {"params": optax.apply_updates(state["params"], u), "opt": opt,
                      "step": state["step"] + 1,
                      "tokens": state["tokens"] + jnp.sum(mask).astype(jnp.int32)}

    params = _mlp(jax.random.key(0))
    state = {"params": params, "opt": tx.init(params), "step": jnp.int32(0),
             "tokens": jnp.int32(0)}
    x = jax.random.normal(jax.random.key(1), (B, 8))
    y = jax.random.normal(jax.random.key(2), (B, 1))
    mask = (jax.random.uniform(jax.random.key(3), (B,)) > 0.25).astype(jnp.float32)
    compare(step, (state,), (x, y, mask), loss_at=0, state_at=slice(1, 2))
    piped = rhino.auto_parallel(step, **PIPE)
    try:
        loss, new = piped(_host(state), x, y, mask)
        assert int(new["step"]) == 1 and int(new["tokens"]) == int(jnp.sum(mask))
    finally:
        piped.close()


def test_per_example_keys_vmapped_with_the_examples():
    tx = optax.adam(1e-2)

    def step(params, opt_state, x, key):
        keys = jax.random.split(key, x.shape[0])

        def loss_fn(p):
            def one(k, xi):
                keep = jax.random.bernoulli(k, 0.8, xi.shape)
                return jnp.sum(_apply(p, jnp.where(keep, xi / 0.8, 0.0)) ** 2)
            return jnp.mean(jax.vmap(one)(keys, x))
        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    params = _mlp(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (B, 8))
    compare(step, (params, tx.init(params)), (x, jax.random.key(4)))


@pytest.mark.parametrize("wrap", ["multi_steps", "apply_if_finite", "clip_by_global_norm"])
def test_optax_wrappers_over_every_stage(wrap):
    """``optax.MultiSteps`` (an int mini-step counter and accumulated gradients in the
    state), ``optax.apply_if_finite`` (one finite check over every stage's gradients) and
    global-norm clipping: their update reads every stage's gradients, so apply-gradients
    runs in phases (each stage's part, then what needs all of them)."""
    inner = optax.adam(1e-2)
    tx = {"multi_steps": lambda: optax.MultiSteps(inner, every_k_schedule=2),
          "apply_if_finite": lambda: optax.apply_if_finite(inner, max_consecutive_errors=3),
          "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                                     inner)}[wrap]()

    def step(params, opt_state, x, y):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((_apply(p, x) - y) ** 2))(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    params = _mlp(jax.random.key(0), (8, 32, 32, 32, 1))
    x = jax.random.normal(jax.random.key(1), (B, 8))
    y = jax.random.normal(jax.random.key(2), (B, 1))
    compare(step, (params, tx.init(params)), (x, y))


def test_nnx_gemma_style_step():
    """A Flax NNX decoder written as Gemma's is (RoPE, grouped-query attention, RMSNorm,
    gated MLP), trained with ``nnx.Optimizer`` and ``nnx.MultiMetric`` inside a functional
    step that returns ``nnx.state(...)``."""
    from flax import nnx

    vocab, d, heads, kv_heads, hd, seq = 64, 32, 4, 2, 8, 8

    def rope(x, pos):
        half = x.shape[-1] // 2
        freq = 1.0 / (10000 ** (jnp.arange(half) / half))
        ang = pos[:, None] * freq[None]
        sin, cos = jnp.sin(ang)[None, :, None], jnp.cos(ang)[None, :, None]
        a, b = x[..., :half], x[..., half:]
        return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1, self.norm2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
            self.q = nnx.Linear(d, heads * hd, use_bias=False, rngs=rngs)
            self.kv = nnx.Linear(d, 2 * kv_heads * hd, use_bias=False, rngs=rngs)
            self.o = nnx.Linear(heads * hd, d, use_bias=False, rngs=rngs)
            self.gate = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
            self.up = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(2 * d, d, use_bias=False, rngs=rngs)

        def __call__(self, x):
            b, s, _ = x.shape
            pos = jnp.arange(s, dtype=jnp.float32)
            h = self.norm1(x)
            q = rope(self.q(h).reshape(b, s, heads, hd), pos)
            k, v = jnp.split(self.kv(h).reshape(b, s, 2 * kv_heads, hd), 2, axis=2)
            k = jnp.repeat(rope(k, pos), heads // kv_heads, axis=2)
            v = jnp.repeat(v, heads // kv_heads, axis=2)
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
            att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
            y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v)
            x = x + self.o(y.reshape(b, s, heads * hd))
            h = self.norm2(x)
            return x + self.down(jax.nn.gelu(self.gate(h)) * self.up(h))

    class Gemma(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.norm = nnx.RMSNorm(d, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens) * np.sqrt(d)
            for blk in self.blocks:
                x = blk(x)
            return self.embed.attend(self.norm(x))

    model = Gemma(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    graphdef, state = nnx.split((model, optimizer, metrics))

    def step(state, tokens):
        model, optimizer, metrics = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, tokens[:, 1:]).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        metrics.update(loss=loss)
        return nnx.state((model, optimizer, metrics)), loss

    tokens = jax.random.randint(jax.random.key(1), (B, seq + 1), 0, vocab)
    # AdamW at 1e-2 divides each gradient by its own running scale, so where a gradient
    # is near zero the order its sums are taken in moves the weight by a visible part of
    # the step: one weight of 2048 differed by 2e-5 (of 0.086) after 5 steps when the
    # stage plans changed, the losses equal at 1e-5 throughout.
    compare(step, (state,), (tokens,), state_at=slice(0, 1), state_tol=5e-5)


def _nnx_lm(dtype):
    """A small NNX decoder as the Flax Gemma example builds one: tied embedding, RMSNorm,
    gated MLP blocks with ``nnx.Dropout`` driven by the ``rngs`` the step passes in."""
    from flax import nnx

    vocab, d = 64, 32

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.RMSNorm(d, param_dtype=dtype, rngs=rngs)
            self.gate = nnx.Linear(d, 2 * d, use_bias=False, param_dtype=dtype, rngs=rngs)
            self.up = nnx.Linear(d, 2 * d, use_bias=False, param_dtype=dtype, rngs=rngs)
            self.down = nnx.Linear(2 * d, d, use_bias=False, param_dtype=dtype, rngs=rngs)
            self.dropout = nnx.Dropout(0.1)

        def __call__(self, x, rngs=None):
            h = self.norm(x)
            h = self.dropout(jax.nn.gelu(self.gate(h)) * self.up(h), rngs=rngs)
            return x + self.down(h)

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, d, param_dtype=dtype, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.final_norm = nnx.RMSNorm(d, param_dtype=dtype, rngs=rngs)

        def __call__(self, tokens, rngs=None):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, rngs=rngs)
            return self.embed.attend(self.final_norm(x))

    rngs = nnx.Rngs(params=0, dropout=1)
    model = Decoder(rngs)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=1e-4), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    return vocab, (model, optimizer, rngs, metrics)


def _per_example_loss(module, batch, rngs):
    """(mean loss, per-example losses) of a decoder on next-token targets."""
    logits = module(batch["inputs"], rngs=rngs).astype(jnp.float32)
    per_example = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"]).mean(axis=-1)
    return per_example.mean(), per_example


def _nnx_example_train_step(model, optimizer, rngs, batch, train_metrics):
    """The Flax Gemma example's training step, in the form its ``jax.jit`` path takes:
    parameters split from the rest, a loss over the merged module, the optimizer and the
    metrics updated in place, and everything handed back as ``nnx.state``."""
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rngs):
        return _per_example_loss(nnx.merge(graphdef, params, rest), batch, rngs)

    (loss, per_example), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
        params, rngs.fork())
    optimizer.update(model, grads)
    train_metrics.update(loss=per_example)
    return nnx.state((model, optimizer, rngs, train_metrics)), loss


@pytest.mark.parametrize("run,dtype", [
    ("pipeline", "float32"),
    ("spmd", "bfloat16"),
    ("pipeline", "bfloat16"),
])
def test_nnx_gemma_example_step_with_rngs_and_metrics(run, dtype):
    """The Flax Gemma example's loop: ``train_step(model, optimizer, rngs, batch,
    metrics)`` returns ``nnx.state((model, optimizer, rngs, metrics))``, which the loop
    applies with ``nnx.update``. Its outputs are state dicts (``['blocks'][0]...``) where
    the arguments are objects (``.blocks[0]...``), and the metrics come back third while
    they are passed fifth: the updated state must still be paired with its arguments."""
    from flax import nnx

    dtype = jnp.dtype(dtype)
    vocab, ours = _nnx_lm(dtype)
    _, theirs = _nnx_lm(dtype)
    t = jax.random.randint(jax.random.key(1), (B, 9), 0, vocab)
    batch = {"inputs": t[:, :-1], "targets": t[:, 1:]}
    options = dict(PIPE) if run == "pipeline" else dict(mesh_shape=(8,))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    ref = jax.jit(_nnx_example_train_step)
    step = rhino.auto_parallel(_nnx_example_train_step, **options)

    def train(fn, objects):
        model, optimizer, rngs, metrics = objects
        updates, loss = fn(model, optimizer, rngs, batch, metrics)
        nnx.update(objects, updates)
        return float(loss)

    try:
        for _ in range(3):
            want, got = train(ref, theirs), train(step, ours)
            np.testing.assert_allclose(got, want, **tol)
    finally:
        step.close()
    want, got = nnx.state(theirs), jax.device_get(nnx.state(ours))
    assert int(got[1]["step"].get_value()) == 3 and int(got[2]["dropout"]["count"].get_value()) == 3
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert a.dtype == b.dtype
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if dtype == jnp.float32:
            np.testing.assert_allclose(b, a, **tol)
        else:   # bf16 sums in another order: AdamW's normalised step may turn a near-zero
            # gradient's rounding into a whole learning-rate step on a few elements
            far = np.abs(b - a) > tol["atol"] + tol["rtol"] * np.abs(a)
            assert far.mean() <= 0.01 and np.abs(b - a).max() <= 3 * 1e-2 * 3, (a, b)


@pytest.mark.parametrize("run", ["pipeline", "spmd"])
def test_nnx_objects_passed_straight_in_are_updated_as_nnx_jit_does(run):
    """The ``nnx.jit`` idiom (issue 48): the step takes the module, optimizer, rngs and
    metrics themselves, mutates them and returns nothing. It used to train nothing without
    a word under SPMD (the loss stayed where it was) and be refused when pipelined; the
    objects are now updated in place, equal to ``nnx.jit``."""
    from flax import nnx

    def train_step(model, optimizer, rngs, batch, train_metrics):
        (_, per_example), grads = nnx.value_and_grad(
            lambda model, rngs: _per_example_loss(model, batch, rngs), has_aux=True)(
            model, rngs.fork())
        optimizer.update(model, grads)
        train_metrics.update(loss=per_example)

    vocab, ours = _nnx_lm(jnp.float32)
    _, theirs = _nnx_lm(jnp.float32)
    t = jax.random.randint(jax.random.key(1), (B, 9), 0, vocab)
    batch = {"inputs": t[:, :-1], "targets": t[:, 1:]}
    ref = nnx.jit(train_step)
    step = rhino.auto_parallel(train_step, **(PIPE if run == "pipeline" else
                                              dict(mesh_shape=(8,))))
    losses = []
    try:
        for _ in range(3):
            assert ref(*theirs[:3], batch, theirs[3]) is None
            assert step(*ours[:3], batch, ours[3]) is None
            got = jax.device_get(nnx.state(ours[3]))["loss"]
            losses.append(float(got["total"].get_value() / got["count"].get_value()))
            np.testing.assert_allclose(losses[-1], float(theirs[3].compute()["loss"]),
                                       rtol=1e-5)
        plan = step.plan_for(*ours[:3], batch, ours[3])
        assert plan.num_stages == (2 if run == "pipeline" else 1)
    finally:
        step.close()
    assert losses[2] < losses[0]
    assert int(ours[1].step.get_value()) == 3
    for a, b in zip(jax.tree.leaves(nnx.state(theirs)),
                    jax.tree.leaves(jax.device_get(nnx.state(ours)))):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(b, np.float64), np.asarray(a, np.float64),
                                   rtol=1e-5, atol=1e-5)


def _line(text: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(k + 1 for k, ln in enumerate(lines) if text in ln and "_line(" not in ln)


def test_a_contrastive_loss_is_refused_then_per_microbatch_with_the_opt_in():
    """A whole-batch softmax (SimCLR-style: every example's normaliser sums over every
    example): the gradients need every pair of examples at once. Refused naming the user's
    line; with ``per_microbatch_statistics=True`` each microbatch pairs its own examples
    (the diagonal block of ``z @ z.T``), and 5 Adam steps equal the step's gradient
    computation run on each microbatch alone, averaged, the optimizer applied once."""
    tx = optax.adam(1e-2)
    m = PIPE["num_microbatches"]

    def grads(params, x):
        def loss_fn(p):
            z = _apply(p, x)
            z = z / jnp.linalg.norm(z, axis=1, keepdims=True)
            sim = z @ z.T / 0.5                                  # every pair of the batch
            return -jnp.mean(jax.nn.log_softmax(sim, axis=1).diagonal())
        return jax.value_and_grad(loss_fn)(params)

    def step(params, opt_state, x):
        loss, g = grads(params, x)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    def per_microbatch(params, opt_state, x):
        parts = [grads(params, xs) for xs in jnp.split(x, m)]
        loss, g = jax.tree.map(lambda *a: sum(a) / m, *parts)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    params = _mlp(jax.random.key(0), (8, 32, 32, 16))
    x = jax.random.normal(jax.random.key(1), (B, 8))
    refused = rhino.auto_parallel(step, **PIPE)
    with pytest.raises(rhino.BatchCouplingError) as err:
        refused(_host(params), _host(tx.init(params)), x)
    msg = str(err.value)
    assert f"test_pipeline_exact.py:{_line('every pair of the batch')}" in msg, msg
    assert "pairs examples of the batch" in msg and "one SPMD stage" in msg
    assert "per_microbatch_statistics=True" in msg

    ref = jax.jit(per_microbatch)
    piped = rhino.auto_parallel(step, per_microbatch_statistics=True, **PIPE)
    s1, s2 = (params, tx.init(params)), (_host(params), _host(tx.init(params)))
    losses = []
    try:
        for _ in range(STEPS):
            *s1, l1 = ref(*s1, x)
            *s2, l2 = piped(*s2, x)
            np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5)
            losses.append(float(l2))
        for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
        plan = piped.plan_for(*s2, x)
        assert plan.num_stages == 2 and plan.num_microbatches == m
        split = piped.split_for(*s2, x)
        pairs = [r for r, v in split.layout.layout.items() if v.pair is not None]
        assert pairs and all(split.microbatch_shape(r) == (B // m, B // m) for r in pairs)
    finally:
        piped.close()
    # not the whole batch's loss: each example's negatives are its microbatch's only
    assert abs(losses[0] - float(jax.jit(step)(params, tx.init(params), x)[2])) > 1e-3


@pytest.mark.parametrize("scaled", ["temperature", "before the sum", "by a whole constant",
                                    "by a whole count"])
def test_pairs_scaled_by_the_batch_size_are_refused_with_the_opt_in(scaled):
    """The contrastive step with a constant of the batch's size applied to its pairs: a
    temperature of ``n / 8``, a mean over one dimension of pairs written as a scale by
    ``1 / n`` before the sum, or a product with a whole ``full((n, n), 1 / n)``. Each
    microbatch's block holds ``n / m`` pairs per row (and a count ``ones((n, n)).sum(1)``,
    with no constant of the batch's size in it, is ``n`` per row), and the step on that microbatch alone
    would use its own ``n``: the whole batch's constant would be silently wrong. rhino
    traces the step again at one microbatch and refuses it where a constant the pairs meet
    depends on the batch's size, naming the line."""
    tx = optax.adam(1e-2)

    def step(params, opt_state, x):
        def loss_fn(p):
            z = _apply(p, x)
            z = z / jnp.linalg.norm(z, axis=1, keepdims=True)
            n = x.shape[0]
            sim = z @ z.T / 0.5
            reg = 0.0
            if scaled == "temperature":
                sim = sim * (n / 8.0)                                     # sized: temperature
            elif scaled == "before the sum":
                reg = jnp.mean(jnp.sum(sim ** 2 / n, axis=1))             # sized: before the sum
            elif scaled == "by a whole constant":
                reg = jnp.mean(jnp.sum(sim ** 2 * jnp.full((n, n), 1.0 / n), axis=1))  # sized: whole
            else:
                count = jnp.ones((n, n)).sum(axis=1)                      # sized: count
                reg = jnp.mean(jnp.sum(sim ** 2, axis=1) / count)
            return -jnp.mean(jax.nn.log_softmax(sim, axis=1).diagonal()) + 0.1 * reg
        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    params = _mlp(jax.random.key(0), (8, 32, 32, 16))
    x = jax.random.normal(jax.random.key(1), (B, 8))
    piped = rhino.auto_parallel(step, per_microbatch_statistics=True, **PIPE)
    try:
        with pytest.raises(rhino.BatchCouplingError) as err:
            piped(_host(params), _host(tx.init(params)), x)
    finally:
        piped.close()
    msg = str(err.value)
    tag = {"temperature": "# sized: temperature", "before the sum": "# sized: before the sum",
           "by a whole constant": "# sized: whole", "by a whole count": "# sized: count"}[scaled]
    assert f"test_pipeline_exact.py:{_line(tag)}" in msg, msg
    assert "batch's size" in msg, msg


def test_a_cond_on_the_loss_around_the_gradients_is_named():
    """The gradients computed inside ``lax.cond(jnp.isfinite(loss), ...)`` (marked with
    ``rhino.grad``): the branch needs the whole batch's loss before any gradient; the error
    names the cond's line, not a tensor inside it."""
    tx = optax.sgd(0.1)

    def step(params, opt_state, x, y):
        loss = jnp.mean((_apply(params, x) - y) ** 2)
        g = jax.lax.cond(jnp.isfinite(loss),                     # the cond
                         lambda p: jax.grad(lambda p: jnp.mean((_apply(p, x) - y) ** 2))(p),
                         lambda p: jax.tree.map(jnp.zeros_like, p), params)
        g = rhino.grad(g)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    params = _mlp(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (B, 8))
    y = jax.random.normal(jax.random.key(2), (B, 1))
    step_ = rhino.auto_parallel(step, **PIPE)
    with pytest.raises(rhino.BatchCouplingError) as err:
        step_(_host(params), _host(tx.init(params)), x, y)
    assert f"test_pipeline_exact.py:{_line('# the cond')}" in str(err.value), str(err.value)


def test_rhino_plan_takes_nnx_objects_as_auto_parallel_runs_them():
    """``rhino.plan`` traces a step given NNX objects as ``auto_parallel`` runs it: the
    objects' updates are the step's updated state, so the pipeline is planned (it was
    refused: no apply-gradients part returning updated state)."""
    from flax import nnx

    def train_step(model, optimizer, rngs, batch):
        grads = nnx.grad(lambda m, r: _per_example_loss(m, batch, r)[0])(model, rngs.fork())
        optimizer.update(model, grads)

    vocab, (model, optimizer, rngs, _) = _nnx_lm(jnp.float32)
    t = jax.random.randint(jax.random.key(1), (B, 9), 0, vocab)
    plan = rhino.plan(train_step, model, optimizer, rngs,
                      {"inputs": t[:, :-1], "targets": t[:, 1:]},
                      cluster="2x4", stages=2, num_microbatches=4)
    assert plan.num_stages == 2
    assert any(p.path.startswith("model['blocks'][1]") for st in plan.stages[1:]
               for p in st.spmd.params)


# ------------------------------------------------------------------ issue 43, acceptance 2
def _bf16_rms_mlp(dtype):
    """The issue's reproduction: a 4-layer MLP with RMSNorm weights in ``dtype``, the norm
    computed in float32 and cast back, as every Llama does."""
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    p = {f"w{i}": (jax.random.normal(k[i], (64, 64)) * 0.1).astype(dtype) for i in range(4)}
    p.update({f"g{i}": jnp.ones((64,), dtype) for i in range(4)})
    tx = optax.adamw(1e-3)
    x = jax.random.normal(k[4], (16, 8, 64)).astype(dtype)
    y = jax.random.normal(k[5], (16, 8, 64))

    def rms(g, h):
        h32 = h.astype(jnp.float32)
        return (h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-5) *
                g.astype(jnp.float32)).astype(h.dtype)

    def loss(p, x, y):
        h = x
        for i in range(4):
            h = jnp.tanh(rms(p[f"g{i}"], h) @ p[f"w{i}"])
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    def step(p, o, x, y):
        l, g = jax.value_and_grad(loss)(p, x, y)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, l
    return step, (p, tx.init(p)), (x, y)


def _close_in_bf16(step, state, batch, steps=3, lr=1e-3, **options):
    """``steps`` steps pipelined against jax.jit in bfloat16: losses to 1e-3 relative, each
    parameter within two learning rates per step (AdamW turns a rounding of a near-zero
    gradient into a step of up to ``lr``, either way), themselves rounded in bfloat16
    (``lr`` and the update's ratio each within a bfloat16 epsilon), plus each side's own
    rounding to bfloat16 (one epsilon of its magnitude). The first bound took only the
    reference's magnitude and no rounding of the step: a weight whose gradient's sign
    flipped at step 1 came to -0.00424 on one side and 0.01587 on the other, 0.020111
    apart against a bound of 0.020033 (jax 0.12, after the stage plans changed)."""
    ref, piped = jax.jit(step), rhino.auto_parallel(step, **PIPE, **options)
    s1 = s2 = tuple(state)
    try:
        for k in range(steps):
            o1, o2 = ref(*s1, *batch), piped(*s2, *batch)
            np.testing.assert_allclose(float(o2[-1]), float(o1[-1]), rtol=1e-3)
            s1, s2 = tuple(o1[:-1]), tuple(o2[:-1])
            for a, b in zip(jax.tree.leaves(s1[0]), jax.tree.leaves(s2[0])):
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                eps = float(jnp.finfo(jnp.bfloat16).eps)
                tol = 2 * lr * (k + 1) * (1 + 2 * eps) + (np.abs(a) + np.abs(b)) * eps
                assert np.all(np.abs(a - b) <= tol), (k, float(np.max(np.abs(a - b))))
    finally:
        piped.close()


def test_the_bf16_rmsnorm_mlp_of_the_issue_pipelines_as_jit():
    step, state, batch = _bf16_rms_mlp(jnp.bfloat16)
    _close_in_bf16(step, state, batch)


def test_a_step_marking_its_gradients_with_rhino_grad_pipelines_exactly():
    """``rhino.grad`` marks gradients with ``reduce_precision`` to their own precision: an
    identity, passed on as it is (it was taken for a non-linear use of the batch's sums).
    Momentum SGD, linear in the gradients: Adam divides by √v, which turns the last-bit
    differences of a microbatch-ordered sum of a near-zero gradient into 4e-5 (jax 0.12)."""
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    params = _mlp(k[0])
    tx = optax.sgd(1e-2, momentum=0.9)
    x, y = jax.random.normal(k[1], (B, 8)), jax.random.normal(k[2], (B, 1))

    def step(p, o, x, y):
        l, g = jax.value_and_grad(lambda p: jnp.mean((_apply(p, x) - y) ** 2))(p)
        u, o = tx.update(rhino.grad(g), o, p)
        return optax.apply_updates(p, u), o, l
    compare(step, (params, tx.init(params)), (x, y))


@pytest.mark.parametrize("loop", ["scan", "fori", "while"])
def test_gradient_accumulation_written_in_the_step_pipelines_exactly(loop):
    """The batch taken in 4 chunks inside the step (a scan over the reshaped batch, a
    fori_loop or a while_loop slicing it), gradients summed over the chunks: each
    microbatch holds its part of every chunk (the batch split in groups), so the loop's
    every iteration runs per microbatch. It was refused ('pairs examples')."""
    k = jax.random.split(jax.random.PRNGKey(2), 3)
    params = _mlp(k[0])
    tx = optax.adam(1e-2)
    x, y = jax.random.normal(k[1], (B, 8)), jax.random.normal(k[2], (B, 1))
    chunks, size = 4, B // 4

    def grads(p, xc, yc):
        return jax.value_and_grad(lambda p: jnp.mean((_apply(p, xc) - yc) ** 2))(p)

    def step(p, o, x, y):
        zero = (jnp.float32(0.0), jax.tree.map(jnp.zeros_like, p))

        def add(c, xc, yc):
            l, g = grads(p, xc, yc)
            return c[0] + l, jax.tree.map(jnp.add, c[1], g)

        def at(c, i):
            return add(c, jax.lax.dynamic_slice_in_dim(x, i * size, size),
                       jax.lax.dynamic_slice_in_dim(y, i * size, size))
        if loop == "scan":
            (l, g), _ = jax.lax.scan(lambda c, xy: (add(c, *xy), None), zero,
                                     (x.reshape(chunks, size, 8), y.reshape(chunks, size, 1)))
        elif loop == "fori":
            l, g = jax.lax.fori_loop(0, chunks, lambda i, c: at(c, i), zero)
        else:
            _, l, g = jax.lax.while_loop(lambda c: c[0] < chunks,
                                         lambda c: (c[0] + 1, *at(c[1:], c[0])),
                                         (jnp.int32(0), *zero))
        u, o = tx.update(jax.tree.map(lambda t: t / chunks, g), o, p)
        return optax.apply_updates(p, u), o, l / chunks
    compare(step, (params, tx.init(params)), (x, y))
