"""The private JAX/XLA API rhino uses, on the installed version (a JAX upgrade breaks here)."""

import jax
import jax.numpy as jnp
import pytest

from rhino import _jax_private as jp


def test_stablehlo_to_hlo_text_keeps_metadata():
    lowered = jax.jit(lambda x: jnp.tanh(x) * 2).lower(jnp.ones(4))
    text = jp.stablehlo_text_to_hlo_text(lowered.as_text(debug_info=True))
    assert text.startswith("HloModule")
    assert "tanh" in text and "op_name=" in text


def test_stablehlo_to_hlo_text_rejects_garbage():
    with pytest.raises(ValueError):
        jp.stablehlo_text_to_hlo_text("module { this is not mlir }")


def test_kept_arg_indices():
    lowered = jax.jit(lambda a, b: a * 2).lower(jnp.ones(3), jnp.ones(3))
    assert jp.kept_arg_indices(lowered) in (None, (0,), (0, 1))
    kept_all = jax.jit(lambda a, b: a * 2, keep_unused=True).lower(jnp.ones(3), jnp.ones(3))
    assert jp.kept_arg_indices(kept_all) in (None, (0, 1))
