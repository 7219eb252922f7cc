"""Gradient boundary (compute-gradients / apply-gradients) and stage subgraphs."""

import doctest

import jax
import jax.numpy as jnp
import pytest

import rhino
from rhino.hlo_passes import subgraph as subgraph_module
from rhino.hlo_passes.subgraph import extract_subgraph, structural_key
from rhino.models import get_model
from rhino.pipeline import gradient as gradient_module
from rhino.pipeline.gradient import (BoundaryOptions, GradientBoundaryError,
                                     find_gradient_boundary, split_arguments)


def _mlp():
    m = get_model("mlp", batch=16, hidden=32, layers=2)
    return rhino.ingest(m.step, *m.example_args())


def test_doctests():
    for mod in (subgraph_module, gradient_module):
        assert doctest.testmod(mod).failed == 0


@pytest.mark.parametrize("name,kw", [("mlp", dict(batch=16, hidden=32, layers=2)),
                                     ("gpt", dict(layers=1, hidden=32, heads=2, seq=8,
                                                  vocab=64))])
def test_autodiff_boundary_of_zoo_steps(name, kw):
    m = get_model(name, **kw)
    g = rhino.ingest(m.step, *m.example_args())
    b = find_gradient_boundary(g)
    assert b.method == "autodiff"
    assert b.batch_args == ("batch",) and b.state_args == ("params", "opt_state")
    n_weights = sum(1 for p in g.params if g.ops[p].arg.path.startswith("params"))
    # One gradient per weight, each of its weight's type; the loss is a metric.
    assert len(b.gradients) == n_weights
    weight_types = sorted(str(g.ops[p].shape) for p in g.params
                          if g.ops[p].arg.path.startswith("params"))
    assert sorted(str(g.ops[i].shape) for i in b.gradients) == weight_types
    assert len(b.metrics) == 1 and g.ops[b.metrics[0]].shape.dims == ()
    # CG is closed under operands; AG is the rest; every AG op reading CG reads a boundary.
    cg = set(b.compute)
    assert cg | set(b.apply) == set(range(len(g.ops))) and not cg & set(b.apply)
    for i in b.compute:
        assert all(o in cg for o in g.ops[i].operands)
    crossing = {o for i in b.apply for o in g.ops[i].operands if o in cg}
    assert crossing == set(b.gradients) | set(b.shared)
    # Optimizer ops are all in AG: the updated weights and Adam moments are AG outputs.
    for o, info in zip(g.outputs, g.output_info):
        if info.path.startswith(("out[0]", "out[1]")):
            assert o not in cg, info.path


def test_marker_boundary_with_hand_written_gradients():
    def step(params, batch):
        x, y = batch["x"], batch["y"]
        err = x @ params["w"] - y
        g = rhino.grad({"w": x.T @ err / x.shape[0]})
        return {"w": params["w"] - 0.1 * g["w"]}, jnp.mean(err ** 2)

    args = ({"w": jnp.ones((4, 2))}, {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 2))})
    g = rhino.ingest(step, *args)
    b = find_gradient_boundary(g)
    assert b.method == "marker"
    assert [g.ops[i].opcode for i in b.gradients] == ["reduce-precision"]
    # The marker is an exact identity.
    w = jax.jit(step)(*args)[0]["w"]
    ref = args[0]["w"] - 0.1 * (args[1]["x"].T @ (args[1]["x"] @ args[0]["w"] - args[1]["y"]) / 8)
    assert jnp.allclose(w, ref)


def test_errors_say_what_was_expected():
    def manual(params, batch):  # no jax.grad, no marker
        g = batch.T @ (batch @ params)
        return params - 0.1 * g, jnp.sum(g)

    g = rhino.ingest(manual, jnp.ones((4, 2)), jnp.ones((8, 4)))
    with pytest.raises(GradientBoundaryError, match="rhino.grad"):
        find_gradient_boundary(g)
    with pytest.raises(GradientBoundaryError, match="marked"):
        find_gradient_boundary(g, BoundaryOptions(method="marker"))
    mlp = _mlp()
    with pytest.raises(GradientBoundaryError, match="batch_args naming arguments .*nope"):
        find_gradient_boundary(mlp, BoundaryOptions(batch_args=("nope",)))
    with pytest.raises(GradientBoundaryError, match="only state and scalar arguments"):
        find_gradient_boundary(mlp, BoundaryOptions(batch_args=()))
    with pytest.raises(ValueError, match="method"):
        BoundaryOptions(method="guess")

    def not_training(x, w):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    g2 = rhino.ingest(not_training, jnp.ones((8, 4)), jnp.ones((4, 4)))
    with pytest.raises(GradientBoundaryError, match="updated state"):
        find_gradient_boundary(g2, BoundaryOptions(batch_args=("x",)))

    def partly_marked(params, batch):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p["a"] @ p["b"]) ** 2))(params)
        ga = rhino.grad(g["a"])
        return {"a": params["a"] - ga, "b": params["b"] - g["b"]}, loss

    g3 = rhino.ingest(partly_marked, {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 2))},
                      jnp.ones((8, 4)))
    with pytest.raises(GradientBoundaryError, match="unmarked"):
        find_gradient_boundary(g3)


def test_batch_args_option_and_default():
    mlp = _mlp()
    assert split_arguments(mlp) == (("batch",), ("params", "opt_state"))
    b = find_gradient_boundary(mlp, BoundaryOptions(batch_args=("batch",)))
    assert b.batch_args == ("batch",)


def test_extract_subgraph_cuts_and_copies():
    g = rhino.ingest(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2,
                     jnp.ones((8, 4)), jnp.ones((4, 4)), jnp.ones((4, 2)))
    first = extract_subgraph(g, [2, 3], duplicate=g.params)
    assert [op.opcode for op in first.graph.ops] == ["parameter", "parameter", "dot", "tanh"]
    assert first.outputs == (3,) and first.graph.output_info[0].path == "cut:tanh.1"
    second = extract_subgraph(g, [5], duplicate=g.params)
    assert second.inputs == (3,) and second.graph.output_info[0].path == g.output_info[0].path
    with pytest.raises(ValueError, match="expected outputs"):
        extract_subgraph(g, [5], outputs=[2])
    with pytest.raises(ValueError, match="op ids"):
        extract_subgraph(g, [99])


def test_structural_key_matches_identical_layers():
    m = get_model("gpt", layers=3, hidden=32, heads=2, seq=8, vocab=64)
    g = rhino.ingest(m.step, *m.example_args())
    layer = {}
    for op in g.ops:
        for k in range(3):
            if f"['layers'][{k}]" in (op.arg.path if op.arg else ""):
                layer[op.id] = k
    # Ops reading layer k's weights directly.
    subs = [extract_subgraph(g, [op.id for op in g.ops if op.opcode != "parameter" and any(
        layer.get(o) == k for o in op.operands)], duplicate=g.params) for k in range(3)]
    keys = [structural_key(s.graph) for s in subs]
    assert keys[1] == keys[2]   # layer 0 differs: it reads the embedding
    assert structural_key(subs[1].graph, "x") != keys[1]
