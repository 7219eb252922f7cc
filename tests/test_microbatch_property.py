"""Property: a random training step mixing values computed from the batch alone (masks,
positions, random draws, sorted or cumulative values, normalisers) with values that depend
on the parameters (per-example outputs, their sums, maxima, whole-batch statistics), split
into stage programs over 4 microbatches, either computes what ``jax.jit`` computes or is
refused with ``BatchCouplingError`` — never a silent difference (issue 28, acceptance 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from rhino.hlo_passes.lower import refuse_couplings
from rhino.errors import BatchCouplingError
from stage_runner import run_split, split_like_auto_parallel

N, D, H = 8, 4, 6

# Values from the batch alone: x (N, D), w (N,) in (0, 1], the key. Each gives (N,).
DATA = {
    "w": lambda x, w, k: w,
    "w/sum(w)": lambda x, w, k: w / jnp.sum(w),
    "arange/n": lambda x, w, k: jnp.arange(x.shape[0]) / x.shape[0],
    "uniform": lambda x, w, k: jax.random.uniform(k, (x.shape[0],)),
    "cumsum(w)": lambda x, w, k: jnp.cumsum(w) / x.shape[0],
    "sort(x0)": lambda x, w, k: jnp.sort(x[:, 0]),
    "x0-mean": lambda x, w, k: x[:, 0] - jnp.mean(x[:, 0]),
    "max(w)": lambda x, w, k: jnp.full((x.shape[0],), jnp.max(w)),
}
# Per-example values from the parameters: h (N, H) -> (N,).
PER_EXAMPLE = {
    "sum h^2": lambda h: jnp.sum(h ** 2, axis=1),
    "logsumexp h": lambda h: jax.nn.logsumexp(h, axis=1),
    "h0*h1": lambda h: h[:, 0] * h[:, 1],
}
# Combining a per-example value e with a batch value d.
COMBINE = {
    "e*d": lambda e, d: e * d,
    "e+d": lambda e, d: e + d,
    "e*exp(-d)": lambda e, d: e * jnp.exp(-d),
}
# Reducing over the batch to the loss. A loss non-linear in a sum (or maximum) over the
# batch couples the examples: each example's gradient needs the whole batch's total.
REDUCE = {
    "mean": lambda v, w: jnp.mean(v),
    "sum/sum(w)": lambda v, w: jnp.sum(v * w) / jnp.sum(w),
    "mean/max(w)": lambda v, w: jnp.mean(v) / jnp.max(w),
    "max": lambda v, w: jnp.max(v) + jnp.mean(v),
    "logsumexp": lambda v, w: jax.nn.logsumexp(v),
    "normalised": lambda v, w: jnp.mean((v - jnp.mean(v)) ** 2),
    "sqrt(mean)": lambda v, w: jnp.sqrt(jnp.mean(v ** 2) + 1.0),
}
COUPLED = {"max", "logsumexp", "normalised", "sqrt(mean)"}


def make_step(data, per, comb, red, hidden_norm):
    def step(params, x, w, key):
        def loss_fn(p):
            h = jnp.tanh(x @ p["w1"] + p["b"])
            if hidden_norm:                     # a batch statistic mid-network: couples
                h = h - jnp.mean(h, axis=0)
            e = PER_EXAMPLE[per](h @ p["w2"])
            v = COMBINE[comb](e, DATA[data](x, w, key))
            return REDUCE[red](v, w)
        loss, g = jax.value_and_grad(loss_fn)(params)
        new = jax.tree.map(lambda a, b: a - 0.1 * b, params, g)
        return new, loss, jnp.max(jnp.abs(g["w1"]))
    return step


def _args(seed):
    k = jax.random.split(jax.random.key(seed), 5)
    params = {"w1": jax.random.normal(k[0], (D, H)), "b": jax.random.normal(k[1], (H,)),
              "w2": jax.random.normal(k[2], (H, H)) * 0.5}
    x = jax.random.normal(k[3], (N, D))
    w = jax.random.uniform(k[4], (N,), minval=0.1, maxval=1.0)
    return params, x, w, jax.random.key(seed + 1)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.sampled_from(sorted(DATA)), per=st.sampled_from(sorted(PER_EXAMPLE)),
       comb=st.sampled_from(sorted(COMBINE)), red=st.sampled_from(sorted(REDUCE)),
       hidden_norm=st.booleans(), seed=st.integers(0, 3))
def test_a_random_step_is_exact_or_refused(data, per, comb, red, hidden_norm, seed):
    step = make_step(data, per, comb, red, hidden_norm)
    args = _args(seed)
    sp = split_like_auto_parallel(step, args)
    try:
        refuse_couplings(sp.layout, sp.num_microbatches)
    except BatchCouplingError as e:
        # Refused only for what couples the examples, and it names a line of this file.
        assert hidden_norm or red in COUPLED, (data, per, comb, red, e)
        assert "test_microbatch_property.py:" in str(e)
        return
    assert not hidden_norm and red not in COUPLED, "a coupled step was not refused"
    got = run_split(sp, args)
    want = jax.tree_util.tree_leaves(jax.jit(step)(*args))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
