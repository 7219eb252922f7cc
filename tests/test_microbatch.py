"""Microbatches as a sharding of the batch over time (``rhino.jaxpr.microbatch``): the layout
of every value, checked by running the step per microbatch (``simulate``) against the
step on the whole batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhino.jaxpr import primitives as prims
from rhino.jaxpr.interpret import flatten
from rhino.jaxpr.microbatch import Place, analyze, ancestors
from rhino.jaxpr.simulate import simulate

M = 4


def run(step, args, batch, m=M, grads=None, per_microbatch_statistics=False):
    """(layout, flat, pipelined-by-simulation results, whole-batch results) of ``step``
    on ``args``; ``batch``: which top-level arguments are split; ``grads``: indices of the
    flat results the couplings are checked against."""
    flat_args, tree = jax.tree_util.tree_flatten(args)
    counts = [len(jax.tree_util.tree_leaves(a)) for a in args]
    starts = np.cumsum([0] + counts)
    keyish = {k for k, x in enumerate(flat_args)
              if jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)}
    batch_refs = [k for a in batch for k in range(starts[a], starts[a + 1]) if k not in keyish]
    state = [k for k in range(len(flat_args)) if k not in batch_refs and k not in keyish]
    closed = jax.make_jaxpr(lambda *f: step(*jax.tree_util.tree_unflatten(tree, f)))(
        *flat_args)
    flat = flatten(closed, platform_branches=per_microbatch_statistics)
    feeds = None
    if grads is not None:
        feeds = ancestors(flat, [flat.outs[k] for k in grads])
    lay = analyze(flat, batch_refs, m, state_refs=state, feeds_gradient=feeds,
                  per_microbatch_statistics=per_microbatch_statistics)
    want = jax.tree_util.tree_leaves(jax.jit(step)(*args))
    got = simulate(flat, lay, flat_args) if not lay.couplings else None
    return lay, flat, got, want


def close(got, want, rtol=1e-5, atol=1e-6):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if jax.dtypes.issubdtype(jnp.result_type(w), jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def mlp_params(key, d=8, h=16):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (d, h)) * 0.3, "w2": jax.random.normal(k2, (h, 1)) * 0.3}


def test_a_token_weighted_mean_is_a_ratio_of_sums():
    """``sum(l * w) / sum(w)``: the numerator is summed over microbatches, the normaliser
    depends on the batch alone and is computed whole, once (not per microbatch)."""
    def step(p, x, w):
        def loss(p):
            l = jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"], axis=-1) ** 2
            return jnp.sum(l * w) / jnp.sum(w)
        return jax.value_and_grad(loss)(p)

    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    w = (jax.random.uniform(jax.random.PRNGKey(2), (16,)) > 0.4).astype(jnp.float32)
    lay, flat, got, want = run(step, (mlp_params(jax.random.PRNGKey(0)), x, w), batch=(1, 2),
                               grads=(1, 2))
    assert not lay.couplings
    close(got, want)
    assert [lay.layout[r].kind for r in flat.outs] == ["partial"] * 3
    # sum(w) is read whole, made by the prologue
    assert lay.wholes and all(r in lay.data for r in lay.wholes)


def test_positions_and_time_sampling_follow_the_whole_batch():
    """A diffusion model's time sampling ``uniform(k, (n,)) / n + arange(n) / n``: each
    microbatch gets its slice of the whole batch's times (traced at microbatch shapes it
    got ``arange(n / m)``)."""
    def step(p, x, key):
        n = x.shape[0]
        t = jax.random.uniform(key, (n,), maxval=1.0 / n) + jnp.arange(n) / n
        noise = jax.random.normal(jax.random.fold_in(key, 1), x.shape)

        def loss(p):
            xt = x * (1 - t)[:, None] + noise * t[:, None]
            pred = jnp.tanh(xt @ p["w1"]) @ p["w2"]
            return jnp.mean((pred[:, 0] - t) ** 2)
        return jax.value_and_grad(loss)(p)

    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    lay, flat, got, want = run(step, (mlp_params(jax.random.PRNGKey(0)), x,
                                      jax.random.key(3)), batch=(1,), grads=(1, 2))
    assert not lay.couplings
    close(got, want)


def test_per_example_keys_vmapped_with_the_examples():
    def step(p, x, key):
        keys = jax.random.split(key, x.shape[0])

        def loss(p):
            def one(k, xi):
                keep = jax.random.bernoulli(k, 0.8, xi.shape)
                return jnp.sum(jnp.tanh((xi * keep) @ p["w1"]) @ p["w2"])
            return jnp.mean(jax.vmap(one)(keys, x) ** 2)
        return jax.value_and_grad(loss)(p)

    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    lay, flat, got, want = run(step, (mlp_params(jax.random.PRNGKey(0)), x,
                                      jax.random.key(5)), batch=(1,), grads=(1, 2))
    assert not lay.couplings
    close(got, want)


def test_counts_and_metrics_are_kept_each_by_its_rule():
    """An int count of tokens, the number of correct predictions (an int partial sum),
    the largest per-example loss (a partial maximum), per-example predictions returned
    whole (concatenated), a metric of the mean loss (computed once, after)."""
    def step(p, x, y, mask, count):
        def loss(p):
            logits = jnp.tanh(x @ p["w1"]) @ p["w2"]
            per = (logits[:, 0] - y) ** 2
            return jnp.sum(per * mask) / x.shape[0], (per, logits)
        (l, (per, logits)), g = jax.value_and_grad(loss, has_aux=True)(p)
        correct = jnp.sum((logits[:, 0] > 0) == (y > 0))
        return (l, g, count + jnp.sum(mask.astype(jnp.int32)), correct, jnp.max(per),
                logits, jnp.sqrt(l) + 1.0)

    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    y = jax.random.normal(jax.random.PRNGKey(2), (16,))
    mask = (jax.random.uniform(jax.random.PRNGKey(3), (16,)) > 0.3).astype(jnp.float32)
    lay, flat, got, want = run(step, (mlp_params(jax.random.PRNGKey(0)), x, y, mask,
                                      jnp.int32(7)), batch=(1, 2, 3), grads=(1, 2))
    assert not lay.couplings
    close(got, want)
    kinds = [str(lay.layout[r]) for r in flat.outs]
    assert kinds == ["partial(sum)", "partial(sum)", "partial(sum)", "whole", "partial(sum)",
                     "partial(max)", "split(0)", "total"], kinds


def test_batch_norm_statistics_are_a_coupling_named_with_their_line():
    def step(p, x):
        def loss(p):
            h = x @ p["w1"]
            mean = jnp.mean(h, axis=0)
            centered = h - mean                            # the coupling
            var = jnp.mean(centered ** 2, axis=0)
            h = centered / jnp.sqrt(var + 1e-5)
            return jnp.mean((jnp.tanh(h) @ p["w2"]) ** 2)
        return jax.value_and_grad(loss)(p)

    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    lay, flat, got, want = run(step, (mlp_params(jax.random.PRNGKey(0)), x), batch=(1,),
                               grads=(1, 2))
    assert lay.couplings
    c = lay.couplings[0]
    assert "statistic over the batch combined with per-example values" in c.describe()
    assert c.source and c.source.endswith(f"test_microbatch.py:{_line('centered = h - mean')}")
    assert c.statistic[0] == "reduce_sum"
    assert c.statistic[1].endswith(f"test_microbatch.py:{_line('mean = jnp.mean(h, axis=0)')}")
    # accepted per microbatch: each microbatch normalises with its own statistics,
    # which is what running the step on each microbatch and averaging computes
    lay2, flat2, got2, _ = run(step, (mlp_params(jax.random.PRNGKey(0)), x), batch=(1,),
                               grads=(1, 2), per_microbatch_statistics=True)
    assert not lay2.couplings and lay2.local
    chunks = [jax.jit(step)(mlp_params(jax.random.PRNGKey(0)), x[4 * k:4 * k + 4])
              for k in range(M)]
    mean_of_parts = jax.tree_util.tree_map(lambda *v: sum(v) / M, *chunks)
    close(got2, jax.tree_util.tree_leaves(mean_of_parts), rtol=1e-4, atol=1e-5)


def test_a_whole_batch_softmax_is_a_coupling():
    """A contrastive loss: each example's normaliser sums over every example."""
    def step(p, x):
        def loss(p):
            z = jnp.tanh(x @ p["w1"])
            sim = z @ z.T
            return -jnp.mean(jax.nn.log_softmax(sim, axis=1).diagonal())
        return jax.value_and_grad(loss)(p)

    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    lay, *_ = run(step, (mlp_params(jax.random.PRNGKey(0)), x), batch=(1,), grads=(1, 2))
    assert lay.couplings
    assert lay.couplings[0].source.endswith(f"test_microbatch.py:{_line('sim = z @ z.T')}")
    assert lay.couplings[0].pairable and not lay.couplings[0].estimable


def _per_microbatch(step, p, x, m=M):
    """The step on each microbatch alone, its results averaged over the microbatches."""
    n = x.shape[0] // m
    chunks = [jax.jit(step)(p, x[n * k:n * (k + 1)]) for k in range(m)]
    return jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda *v: sum(v) / m, *chunks))


def _contrastive(p, x):
    z = jnp.tanh(x @ p["w1"]) @ p["w2"]
    z = z / jnp.linalg.norm(z, axis=1, keepdims=True)
    return z @ z.T / 0.5                                  # every pair of the batch


def test_pairs_of_the_batch_are_each_microbatchs_own_under_the_opt_in():
    """SimCLR-style: with ``per_microbatch_statistics`` each microbatch computes its
    diagonal block of ``z @ z.T`` (its examples against its own), as running the step on
    that microbatch alone does; ``diagonal`` is the mask-and-reduce branch of its
    platform-dependent cond (an iota comparison, the same on every block)."""
    def step(p, x):
        def loss(p):
            sim = _contrastive(p, x)
            return -jnp.mean(jax.nn.log_softmax(sim, axis=1).diagonal())
        return jax.value_and_grad(loss)(p)

    p = {"w1": jax.random.normal(jax.random.PRNGKey(0), (8, 12)) * 0.3,
         "w2": jax.random.normal(jax.random.PRNGKey(3), (12, 6)) * 0.3}
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    lay, flat, got, whole = run(step, (p, x), batch=(1,), grads=(1, 2),
                                per_microbatch_statistics=True)
    assert not lay.couplings
    pairs = [r for r, v in lay.layout.items() if v.pair is not None]
    assert pairs and all(lay.mb_shapes[r] == (4, 4) for r in pairs)
    close(got, _per_microbatch(step, p, x), rtol=1e-5, atol=1e-6)
    # not the whole batch's loss: each example's negatives are its microbatch's only
    assert abs(float(got[0]) - float(whole[0])) > 1e-3


def test_clip_style_pairs_with_a_learned_scale_and_both_directions():
    """Two encoders, a learned temperature, the cross entropy over rows and over columns
    with labels from ``eye(n)``: reductions over either dimension of pairs stay within the
    microbatch's block; the temperature's gradient sums over both."""
    def step(p, x):
        def loss(p):
            a = x @ p["wa"]
            b = jnp.tanh(x) @ p["wb"]
            logits = (a @ b.T) * jnp.exp(p["t"])
            labels = jnp.eye(x.shape[0])
            rows = -jnp.sum(labels * jax.nn.log_softmax(logits, axis=1), axis=1)
            cols = -jnp.sum(labels * jax.nn.log_softmax(logits, axis=0), axis=0)
            return jnp.mean(rows + cols) / 2
        return jax.value_and_grad(loss)(p)

    p = {"wa": jax.random.normal(jax.random.PRNGKey(0), (8, 6)) * 0.3,
         "wb": jax.random.normal(jax.random.PRNGKey(3), (8, 6)) * 0.3,
         "t": jnp.float32(0.7)}
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    lay, flat, got, _ = run(step, (p, x), batch=(1,), grads=(1, 2, 3),
                            per_microbatch_statistics=True)
    assert not lay.couplings
    close(got, _per_microbatch(step, p, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["take_along_axis", "fancy_index", "mean_over_pairs",
                                     "labels_along_positions", "returned"])
def test_pairs_read_by_positions_of_the_whole_batch_are_refused(variant):
    """What a microbatch's block cannot compute as the microbatch alone would is refused
    under the opt-in too, naming the line: index values from ``arange(n)`` (global
    positions, pointing outside the block), a mean over a dimension of pairs (it counts
    the whole batch's pairs), a per-example value along the batch's positions (labels of
    other examples), a value over pairs returned whole."""
    def step(p, x, y):
        def loss(p):
            sim = _contrastive(p, x)
            n = x.shape[0]
            lsm = jax.nn.log_softmax(sim, axis=1)
            if variant == "take_along_axis":
                d = jnp.take_along_axis(lsm, jnp.arange(n)[:, None], axis=1)  # refused
            elif variant == "fancy_index":
                d = lsm[jnp.arange(n), jnp.arange(n)]                      # refused
            elif variant == "mean_over_pairs":
                d = lsm.diagonal() - jnp.mean(sim, axis=1)                 # refused
            elif variant == "labels_along_positions":
                d = jnp.sum(jax.nn.one_hot(y, n) * lsm, axis=1)            # refused
            else:
                d = lsm.diagonal()
            return -jnp.mean(d), sim
        (l, sim), g = jax.value_and_grad(loss, has_aux=True)(p)
        return (l, g, sim) if variant == "returned" else (l, g)

    p = {"w1": jax.random.normal(jax.random.PRNGKey(0), (8, 12)) * 0.3,
         "w2": jax.random.normal(jax.random.PRNGKey(3), (12, 6)) * 0.3}
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    y = (jnp.arange(16) + 8) % 16                   # each example's positive: another one
    lay, *_ = run(step, (p, x, y), batch=(1, 2), grads=(1, 2),
                  per_microbatch_statistics=True)
    assert lay.couplings
    assert not any(c.estimable for c in lay.couplings)
    want = "every pair of the batch" if variant == "returned" else "# refused"
    lines = {int(c.source.rsplit(":", 1)[1]) for c in lay.couplings
             if c.source and "test_microbatch.py" in c.source}
    assert _line_of(want, variant) in lines, [c.describe() for c in lay.couplings]


def _line_of(text: str, variant: str) -> int:
    """The line holding ``text`` (for ``# refused``: the one of ``variant``'s branch)."""
    lines = open(__file__).read().splitlines()
    if text != "# refused":
        return _line(text)
    start = next(k for k, ln in enumerate(lines) if f'variant == "{variant}"' in ln)
    return next(k + 1 for k in range(start, len(lines)) if text in lines[k])


def test_a_statistic_used_only_after_the_gradients_is_no_coupling():
    """A loss that is only returned (its total computed once) and a step that skips the
    update when the loss is not finite: nothing the gradients need is a total."""
    def step(p, x):
        l, g = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2))(p)
        ok = jnp.isfinite(l)
        new = jax.tree_util.tree_map(lambda w, gw: jnp.where(ok, w - 0.1 * gw, w), p, g)
        return new, l, jnp.log(l)

    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    lay, flat, got, want = run(step, (mlp_params(jax.random.PRNGKey(0)), x), batch=(1,))
    close(got, want)
    assert [lay.layout[r].kind for r in flat.outs] == ["total", "total", "partial", "total"]


def test_shapes_of_per_microbatch_equations_are_rewritten():
    """Broadcasts and reshapes whose results carry the batch are bound at microbatch
    shapes (the whole-batch trace names whole shapes)."""
    def step(p, x):
        def loss(p):
            h = (x @ p["w1"]).reshape(x.shape[0] * 2, -1)       # (n * 2, h / 2)
            h = jnp.broadcast_to(h[:, None, :], (h.shape[0], 3, h.shape[1]))
            return jnp.sum(jnp.tanh(h).reshape(x.shape[0], -1) @ jnp.ones((48, 1)))
        return jax.value_and_grad(loss)(p)

    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    lay, flat, got, want = run(step, (mlp_params(jax.random.PRNGKey(0)), x), batch=(1,))
    close(got, want)
    reshapes = [i for i, fe in enumerate(flat.eqns) if prims.name(fe.eqn) == prims.RESHAPE
                and lay.place[i] is Place.MICRO]
    assert reshapes and all(i in lay.params for i in reshapes)


def _line(text: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(k + 1 for k, ln in enumerate(lines) if text in ln and "_line(" not in ln)


@pytest.mark.parametrize("m", [2, 4])
def test_gradients_of_an_embedding_and_a_gather(m):
    def step(p, tok, lab):
        def loss(p):
            h = p["emb"][tok]                               # gather
            logits = jnp.tanh(h) @ p["out"]
            lp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(lp, lab[..., None], -1))
        return jax.value_and_grad(loss)(p)

    k = jax.random.PRNGKey(0)
    p = {"emb": jax.random.normal(k, (32, 8)), "out": jax.random.normal(k, (8, 32)) * 0.2}
    tok = jax.random.randint(jax.random.PRNGKey(1), (8, 6), 0, 32)
    lab = jax.random.randint(jax.random.PRNGKey(2), (8, 6), 0, 32)
    lay, flat, got, want = run(step, (p, tok, lab), batch=(1, 2), m=m, grads=(1, 2))
    assert not lay.couplings
    close(got, want)


def test_convolutions_and_their_weight_gradients():
    def step(p, x):
        def loss(p):
            y = jax.lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jnp.mean(jnp.tanh(y) ** 2)
        return jax.value_and_grad(loss)(p)

    p = {"k": jax.random.normal(jax.random.PRNGKey(0), (3, 3, 3, 5)) * 0.2}
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 6, 6, 3))
    lay, flat, got, want = run(step, (p, x), batch=(1,), grads=(1,))
    assert not lay.couplings
    close(got, want, rtol=1e-4)


def test_a_sum_over_pairs_used_as_a_statistic_is_refused():
    """``sim / sum(sim)``: the total over pairs normalises every pair; a microbatch's
    estimate (``m`` times its own sum, as for a statistic over examples) would count its
    pairs ``m`` times, so it is refused under the opt-in, naming the line."""
    def step(p, x):
        def loss(p):
            sim = jnp.exp(_contrastive(p, x))
            total = jnp.sum(jnp.sum(sim, axis=1))
            return -jnp.mean(jnp.log(sim / total).diagonal())        # the statistic
        return jax.value_and_grad(loss)(p)

    p = {"w1": jax.random.normal(jax.random.PRNGKey(0), (8, 12)) * 0.3,
         "w2": jax.random.normal(jax.random.PRNGKey(3), (12, 6)) * 0.3}
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    lay, *_ = run(step, (p, x), batch=(1,), grads=(1, 2), per_microbatch_statistics=True)
    assert lay.couplings and not lay.couplings[0].estimable
    assert "used as a statistic" in lay.couplings[0].describe()
    assert lay.couplings[0].source.endswith(f"test_microbatch.py:{_line('# the statistic')}")
