"""Tests of the model zoo (`rhino.models`): training, abstract arguments, lowering, specs."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhino.models import (GPT_CONFIGS, MODEL_NAMES, MOE_CONFIGS, ZooModel, get_model,
                          parse_model_spec)
from rhino.models.moe import top2_routing


def _assert_same_structs(real, abstract):
    """Real arrays and ShapeDtypeStructs have the same tree, shapes and dtypes."""
    assert jax.tree.structure(real) == jax.tree.structure(abstract)
    jax.tree.map(lambda r, a: (r.shape, r.dtype) == (a.shape, a.dtype) or pytest.fail(
        f"real {r.shape} {r.dtype} != abstract {a.shape} {a.dtype}"), real, abstract)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_default_model_trains_and_matches_example_args(name):
    model = get_model(name)
    params, opt_state = model.init(jax.random.key(0))
    batch = model.make_batch(jax.random.key(1))

    abstract = model.example_args()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    _assert_same_structs((params, opt_state, batch), abstract)
    want = jnp.dtype(getattr(model.config, "dtype", "float32"))   # llama: bf16 weights
    assert all(x.dtype == want for x in jax.tree.leaves(params))

    step = jax.jit(model.step)
    losses = []
    new_params, new_opt_state = params, opt_state
    for _ in range(4):  # The 4th step reports the loss after 3 updates.
        new_params, new_opt_state, loss = step(new_params, new_opt_state, batch)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)), losses
    assert np.all(np.diff(losses) < 0), f"{name}: loss did not decrease over 3 steps: {losses}"
    _assert_same_structs((new_params, new_opt_state), abstract[:2])


def test_steps_are_deterministic():
    model = get_model("mlp", hidden=32, batch=8)
    runs = []
    for _ in range(2):
        params, opt_state = model.init(jax.random.key(3))
        batch = model.make_batch(jax.random.key(4))
        runs.append(jax.jit(model.step)(params, opt_state, batch))
    jax.tree.map(np.testing.assert_array_equal, runs[0], runs[1])


@pytest.mark.parametrize("name, overrides", [
    ("gpt", {"preset": "GPT-Medium", "layers": 2}),
    ("moe", {"preset": "MoE-8E-380M", "layers": 2, "seq": 1024}),
    ("vgg19", {"classes": 1_000_000, "width": 64, "fc_hidden": 4096, "image": 224}),
    ("wide_resnet", {"preset": "WR-1.3B", "image": 64}),
    ("dnabert", {"seq": 4096, "layers": 12, "hidden": 768, "heads": 12}),
])
def test_large_configs_lower_without_allocating(name, overrides):
    model = get_model(name, **overrides)
    args = model.example_args()
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[0]))
    assert param_bytes > 100e6  # Large enough that allocating would be noticed.
    lowered = jax.jit(model.step).lower(*args)
    assert lowered.as_text(dialect="hlo")


def test_gpt_presets_fill_fields_and_overrides_win():
    cfg = get_model("gpt", preset="GPT-Medium", layers=4).config
    assert (cfg.layers, cfg.hidden, cfg.ffn, cfg.heads) == (4, 1024, 4096, 16)
    assert set(GPT_CONFIGS) == {"GPT-Medium", "GPT-Large", "GPT-XL", "GPT-2.7B", "GPT-6.7B"}
    assert GPT_CONFIGS["GPT-6.7B"] == {"layers": 32, "hidden": 4096, "ffn": 16384, "heads": 32}
    assert MOE_CONFIGS["MoE-32E-10B"]["experts"] == 32
    n_params = sum(x.size for x in jax.tree.leaves(
        get_model("gpt", preset="GPT-Medium", vocab=51200, seq=1024).example_args()[0]))
    assert 340e6 < n_params < 370e6  # Table 1: 350M.


def test_gpt_scan_lowers_to_while_and_matches_unrolled():
    scanned = get_model("gpt", scan=True, layers=3, hidden=32, heads=2, seq=16, vocab=64)
    text = jax.jit(scanned.step).lower(*scanned.example_args()).as_text(dialect="hlo")
    assert " while(" in text
    unrolled = dataclasses.replace(scanned, config=dataclasses.replace(scanned.config, scan=False))
    params, _ = unrolled.init(jax.random.key(0))
    stacked, _ = scanned.init(jax.random.key(0))
    assert stacked["layers"]["wqkv"].shape == (3, 32, 96)
    np.testing.assert_array_equal(stacked["layers"]["wqkv"][1], params["layers"][1]["wqkv"])
    batch = unrolled.make_batch(jax.random.key(1))
    np.testing.assert_allclose(jax.jit(scanned.loss)(stacked, batch),
                               jax.jit(unrolled.loss)(params, batch), rtol=1e-5)


def test_gpt_param_paths_are_readable():
    params = get_model("gpt").example_args()[0]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert "['layers'][1]['wqkv']" in paths
    assert "['wte']" in paths
    assert params["layers"][1]["wqkv"].shape == (128, 384)


def test_moe_layers_alternate_dense_and_experts():
    params = get_model("moe", layers=4).example_args()[0]
    assert ["wg" in layer for layer in params["layers"]] == [False, True, False, True]
    assert params["layers"][1]["w1"].shape == (4, 128, 512)
    assert params["layers"][1]["w2"].shape == (4, 512, 128)


def test_top2_routing_respects_capacity_and_normalizes_gates():
    groups, tokens, experts, capacity = 3, 32, 4, 6
    gates = jax.nn.softmax(jax.random.normal(jax.random.key(0), (groups, tokens, experts)))
    combine, dispatch, aux = jax.jit(top2_routing, static_argnums=1)(gates, capacity)
    combine, dispatch = np.asarray(combine), np.asarray(dispatch)
    assert combine.shape == dispatch.shape == (groups, tokens, experts, capacity)
    assert np.all(dispatch.sum(axis=1) <= 1)  # A slot holds at most one token.
    assert np.all(dispatch.sum(axis=(2, 3)) <= 2)  # A token goes to at most two experts.
    per_token = combine.sum(axis=(2, 3))
    routed = dispatch.sum(axis=(2, 3)) > 0
    np.testing.assert_allclose(per_token[routed], 1.0, rtol=1e-5)
    top1 = np.argmax(np.asarray(gates), axis=-1)
    first_choice = dispatch.sum(axis=3)[np.arange(groups)[:, None], np.arange(tokens), top1]
    # Tokens are dropped only when their first choice is full.
    full = dispatch.sum(axis=(1, 3))[np.arange(groups)[:, None], top1] == capacity
    assert np.all((first_choice == 1) | full)
    assert np.isfinite(float(aux)) and float(aux) > 0


def test_parse_model_spec():
    model = parse_model_spec("gpt:layers=3,hidden=64")
    assert isinstance(model, ZooModel) and model.name == "gpt"
    assert (model.config.layers, model.config.hidden, model.config.heads) == (3, 64, 4)
    assert parse_model_spec("gpt").config == get_model("gpt").config
    assert parse_model_spec("moe: capacity_factor=1.5 ").config.capacity_factor == 1.5
    assert parse_model_spec("gpt:scan=true,ffn=none").config.scan is True
    assert parse_model_spec("moe:capacity_factor=1").config.capacity_factor == 1.0
    assert parse_model_spec("gpt:preset=GPT-XL,layers=1").config.heads == 32
    assert parse_model_spec("wide_resnet:block=bottleneck,layers=50").config.block == "bottleneck"


@pytest.mark.parametrize("spec, message", [
    ("resnet", "valid models: mlp, gpt, moe"),
    ("gpt:depth=3", "valid options: .*layers.*hidden"),
    ("gpt:preset=GPT-Huge", "valid presets: GPT-Medium"),
    ("gpt:layers=3.5", "expected int"),
    ("gpt:layers", "expected key=value"),
    ("gpt:hidden=100,heads=3", "divisible"),
    ("wide_resnet:layers=12", "6k \\+ 4"),
])
def test_bad_specs_raise_value_error(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_model_spec(spec)


def test_unknown_model_in_get_model_names_choices():
    with pytest.raises(ValueError, match="dnabert"):
        get_model("bert")


def test_import_and_configs_work_without_optax():
    code = ("import sys; sys.modules['optax'] = None\n"
            "import rhino.models as m\n"
            "model = m.get_model('gpt', layers=1)\n"
            "try:\n"
            "    model.example_args()\n"
            "except ImportError:\n"
            "    print('needs optax')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "needs optax"
