"""What ``rhino plan`` / ``rhino inspect`` read besides the zoo (issue 48, item 7): a saved
plan (printed as saved), a user's step in a script (``SCRIPT.py:FUNCTION`` with the
script's ``example_args``), an HLO dump planned on a cluster (its outputs paired with the
arguments they update through the dump's ``input_output_alias``), and
``--per-microbatch-statistics``."""

import json
import textwrap

import jax
import pytest

from rhino.cli import main
from rhino.models import get_model

SCRIPT = textwrap.dedent('''
    """A user's script: an MLP step whose loss centres each hidden feature on the batch."""
    import jax
    import jax.numpy as jnp
    import optax

    opt = optax.sgd(0.1)


    def train_step(params, opt_state, x, y):
        def loss_fn(p):
            h = jax.nn.relu(x @ p["w1"])
            h = h - h.mean(axis=0)          # a statistic of the whole batch
            return jnp.mean((h @ p["w2"] - y) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(g, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss


    def example_args():
        p = {"w1": jnp.ones((64, 256)) * 0.01, "w2": jnp.ones((256, 8)) * 0.01}
        return p, opt.init(p), jnp.ones((64, 64)), jnp.ones((64, 8))


    if __name__ == "__main__":
        raise SystemExit("the script's main part must not run under rhino plan")
''')


def test_a_saved_plan_is_printed_by_plan_and_inspect(tmp_path, capsys):
    saved = tmp_path / "plan.json"
    assert main(["plan", "mlp:batch=32,hidden=64", "--mesh", "2", "--quiet",
                 "--output", str(saved)]) == 0
    planned = capsys.readouterr().out
    assert main(["plan", str(saved)]) == 0
    assert capsys.readouterr().out == planned
    assert main(["plan", str(saved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(saved.read_text())
    assert main(["inspect", str(saved)]) == 0
    assert "Mesh(x=2)" in capsys.readouterr().out
    # Planning options beside a saved plan are refused, not dropped.
    assert main(["plan", str(saved), "--mesh", "4"]) == 2
    err = capsys.readouterr().err
    assert "--mesh: options for planning a step; found a saved plan" in err
    other = tmp_path / "other.json"
    other.write_text('{"not": "a plan"}')
    assert main(["plan", str(other)]) == 2
    assert f"{other}: expected a plan saved as JSON" in capsys.readouterr().err


def test_a_users_step_is_planned_from_its_script(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # The statistic of the whole batch: refused for a pipeline, naming the CLI's flag ...
    assert main(["plan", f"{script}:train_step", "--cluster", "1x4", "--quiet"]) == 2
    err = capsys.readouterr().err
    line = SCRIPT.splitlines().index("        h = h - h.mean(axis=0)          # a statistic "
                                     "of the whole batch") + 1
    assert f"{script}:{line}" in err and "--per-microbatch-statistics" in err
    # ... which lets it be planned over the cluster.
    assert main(["plan", f"{script}:train_step", "--cluster", "1x4", "--quiet", "--json",
                 "--per-microbatch-statistics"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["cluster"]["hosts"] * plan["cluster"]["devices_per_host"] == 4
    assert main(["inspect", f"{script}:train_step"]) == 0
    assert "params['w1']" in capsys.readouterr().out
    # The flag is the pipeline planner's: refused on a mesh.
    assert main(["plan", f"{script}:train_step", "--per-microbatch-statistics"]) == 2
    assert "--per-microbatch-statistics: expected with --cluster" in capsys.readouterr().err


def test_a_script_without_the_function_or_its_arguments_is_refused(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert main(["plan", f"{script}:no_step"]) == 2
    err = capsys.readouterr().err
    assert "expected a function 'no_step'" in err and "train_step" in err
    assert main(["plan", f"{script}:train_step:make_args"]) == 2
    assert "to define make_args() returning train_step's example arguments" in \
        capsys.readouterr().err
    assert main(["plan", f"{tmp_path / 'none.py'}:train_step"]) == 2
    assert "found no file" in capsys.readouterr().err


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    m = get_model("gpt", layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=8)
    args = m.example_args()
    d = tmp_path_factory.mktemp("dumps")
    for name, donate in (("donated", (0, 1)), ("plain", ())):
        lowered = jax.jit(m.step, donate_argnums=donate).lower(*args)
        (d / f"{name}.hlo").write_text(lowered.as_text(dialect="hlo", debug_info=True))
        (d / f"{name}.mlir").write_text(lowered.as_text(debug_info=True))
    # As the user dumped it: StableHLO without debug information (no op names).
    (d / "bare.mlir").write_text(jax.jit(m.step, donate_argnums=(0, 1)).lower(*args)
                                 .as_text())
    return d


def test_a_dump_with_its_state_donated_plans_on_a_cluster(dumps, capsys):
    import rhino
    from rhino.planner.build import carried_pairs

    g = rhino.ingest(str(dumps / "donated.hlo"))
    pairs = carried_pairs(g)
    assert len(pairs) == len(g.aliases) > 0
    names = [g.ops[p].arg.path for _, p in pairs]
    assert "params['wte']" in names              # JAX's quotes, unescaped
    assert all(g.ops[p].arg.donated for _, p in pairs)
    assert main(["plan", str(dumps / "donated.hlo"), "--cluster", "1x2", "--quiet",
                 "--all"]) == 0
    out = capsys.readouterr().out
    assert "candidates" in out and "pp=2" in out and "params['wte']" in out


def test_a_stablehlo_dump_with_debug_information_and_donation_plans_on_a_cluster(dumps,
                                                                                capsys):
    assert main(["plan", str(dumps / "donated.mlir"), "--cluster", "1x2", "--quiet"]) == 0
    assert "pp=2" in capsys.readouterr().out
    # Without debug information JAX's op names are gone: the error says how to dump.
    assert main(["plan", str(dumps / "bare.mlir"), "--cluster", "1x2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "op_name metadata absent" in err and "as_text(debug_info=True)" in err
    assert main(["plan", str(dumps / "plain.mlir"), "--cluster", "1x2", "--quiet"]) == 2
    assert "donate_argnums=(0, 1)" in capsys.readouterr().err


def test_a_dump_without_donation_says_how_to_make_one_that_plans(dumps, capsys):
    assert main(["plan", str(dumps / "plain.hlo"), "--cluster", "1x2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "input_output_alias" in err and "donate_argnums=(0, 1)" in err
    # An SPMD plan needs no pairing.
    assert main(["plan", str(dumps / "plain.hlo"), "--mesh", "2", "--quiet"]) == 0
