"""Plan reports that name the user's code (issue 48, item 6): each pipeline stage's
weights by the model's own paths, every tensor between stages with its source line, and
parameter columns as wide as the paths."""

import re

import jax.numpy as jnp

import rhino
from rhino.models import get_model


def test_a_pipelined_report_names_each_stages_layers_and_the_sources_of_crossings():
    m = get_model("gpt", layers=4, hidden=64, heads=2, seq=16, vocab=128, batch=8)
    plan = rhino.plan(m.step, *m.example_args(), cluster="2x4", stages=2)
    text = plan.report(full=True)
    weights = re.findall(r"^      weights: (.*)$", text, re.M)
    assert len(weights) == 2, text
    assert "params['layers'][0..1]" in weights[0] and "params['layers'][2..3]" in weights[1]
    assert "opt_state" not in " ".join(weights)       # the optimizer state mirrors them
    rows = text.split("tensors between stages")[1].split("\n  weights read")[0]
    crossings = [r for r in rows.splitlines()[1:] if r.startswith("    ")]
    assert crossings and all(re.search(r"\[.*rhino/models/\w+\.py:\d+\]$", r)
                             for r in crossings), rows
    # Saved and read back, the report is the same (the source lines travel in the JSON).
    assert rhino.Plan.from_json(plan.to_json()).report(full=True) == text


def test_long_parameter_paths_keep_the_columns():
    name = "a_parameter_whose_path_is_longer_than_the_usual_column_of_the_table"
    params = {name: jnp.ones((64, 64)), "b": jnp.ones((64,))}
    plan = rhino.plan(lambda p, x: {k: v - 0.1 * jnp.mean(x) * v for k, v in p.items()},
                      params, jnp.ones((128, 64)), mesh_shape=(2,))
    text = plan.report(full=True)
    table = text.split("parameters (path, global shape")[1].splitlines()[1:4]
    assert len(table) == 3 and any(name in row for row in table), text
    # the shape column starts at the same place in every row
    starts = {row.index("f32[") for row in table}
    assert len(starts) == 1, table
