"""Ingestion of real lowerings (every zoo model), HLO and StableHLO files, control flow,
argument paths, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rhino
from rhino.errors import HloParseError, IngestError
from rhino.models import MODEL_NAMES, get_model


def _mlp(x, w1, w2):
    return jnp.sum(jnp.tanh(x @ w1) @ w2)


ARGS = (jnp.ones((8, 4)), jnp.ones((4, 16)), jnp.ones((16, 2)))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_zoo_model_ingests(name):
    model = get_model(name)
    args = model.example_args()
    g = rhino.ingest(model.step, *args)
    g.check()
    hist = g.opcode_histogram()
    assert hist["dot"] + hist["convolution"] > 0
    flat = jax.tree_util.tree_leaves(args)
    assert len(g.params) == len(flat)
    for p, leaf in zip(g.params, flat):
        assert g.ops[p].tensor.dims == tuple(leaf.shape)
    paths = [g.ops[p].arg.path for p in g.params]
    assert paths[0].startswith("params[")
    assert any(path.startswith("opt_state") for path in paths)
    assert any(path.startswith("batch[") for path in paths)
    # Three outputs groups: params, opt_state, loss.
    assert len(g.outputs) == len(jax.tree_util.tree_leaves(jax.eval_shape(model.step, *args)))
    assert g.total_flops > 0
    dots = [op for op in g.ops if op.opcode in ("dot", "convolution")]
    assert all(op.source and "rhino/models" in op.source for op in dots)
    a = rhino.analyze(g)
    assert a.critical and len(a.critical) < len(g.ops)


def test_gpt_structure_and_paths():
    model = get_model("gpt", layers=2)
    g = rhino.ingest(model.step, *model.example_args())
    paths = {g.ops[p].arg.path for p in g.params}
    assert "params['layers'][1]['wqkv']" in paths
    assert g.opcode_histogram()["gather"] >= 1  # embedding lookup
    assert not g.opaque


def test_dot_flops_and_attributes():
    g = rhino.ingest(_mlp, *ARGS)
    dots = [op for op in g.ops if op.opcode == "dot"]
    assert [d.flops for d in dots] == [2 * 8 * 16 * 4, 2 * 8 * 2 * 16]
    assert dots[0].attrs["lhs_contracting_dims"] == (1,)
    assert dots[0].attrs["rhs_contracting_dims"] == (0,)
    red = next(op for op in g.ops if op.opcode == "reduce")
    assert red.attrs["dimensions"] == (0, 1) and red.attrs["reducer"] == "add"
    assert all(op.source and op.source.endswith("test_ingest.py:15") for op in dots)


def test_nested_jit_is_inlined():
    inner = jax.jit(lambda a, b: jnp.tanh(a @ b))

    def outer(x, w1, w2):
        return jnp.sum(inner(x, w1) @ w2)

    g = rhino.ingest(outer, *ARGS)
    ref = rhino.ingest(_mlp, *ARGS)
    assert "call" not in g.opcode_histogram()
    assert sorted(g.opcode_histogram().items()) == sorted(ref.opcode_histogram().items())
    # Calling the same jitted function twice inlines two copies with unique names.
    g2 = rhino.ingest(lambda x, w: inner(inner(x, w), w), jnp.ones((4, 4)), jnp.ones((4, 4)))
    names = [op.name for op in g2.ops]
    assert len(names) == len(set(names)) and g2.opcode_histogram()["dot"] == 2


def test_pytree_paths_and_donation():
    def step(params, x):
        return jax.tree.map(lambda p: p - 0.1 * jnp.sum(x), params), jnp.sum(x)

    params = {"a": jnp.ones(3), "b": [jnp.ones(2), jnp.ones(5)]}
    jitted = jax.jit(step, donate_argnums=0)
    g = rhino.ingest(jitted, params, jnp.ones(4))
    info = [g.ops[p].arg for p in g.params]
    assert [i.path for i in info] == ["params['a']", "params['b'][0]", "params['b'][1]", "x"]
    assert [i.donated for i in info] == [True, True, True, False]
    assert [o.path for o in g.output_info] == ["out[0]['a']", "out[0]['b'][0]",
                                               "out[0]['b'][1]", "out[1]"]


def test_unused_argument_keeps_its_parameter():
    g = rhino.ingest(lambda x, unused: x * 2, jnp.ones(3), jnp.ones(7))
    assert [g.ops[p].arg.path for p in g.params] == ["x", "unused"]


def test_hlo_file_matches_function(tmp_path):
    lowered = jax.jit(_mlp).lower(*ARGS)
    path = tmp_path / "mlp.hlo"
    path.write_text(lowered.as_text(dialect="hlo", debug_info=True))
    g = rhino.ingest(str(path))
    ref = rhino.ingest(_mlp, *ARGS)
    assert [op.opcode for op in g.ops] == [op.opcode for op in ref.ops]
    assert g.origin == f"hlo:{path}"
    assert [op.source for op in g.ops] == [op.source for op in ref.ops]


def test_stablehlo_file(tmp_path):
    model = get_model("mlp")
    lowered = jax.jit(model.step).lower(*model.example_args())
    path = tmp_path / "mlp.mlir"
    path.write_text(lowered.as_text(debug_info=True))
    g = rhino.ingest(path)
    ref = rhino.ingest(model.step, *model.example_args())
    assert g.origin.startswith("mlir:")
    assert g.opcode_histogram() == ref.opcode_histogram()
    assert g.total_flops == pytest.approx(ref.total_flops)
    assert [g.ops[p].tensor for p in g.params] == [ref.ops[p].tensor for p in ref.params]


def test_a_scan_past_the_unroll_limit_stays_an_opaque_while(monkeypatch):
    from rhino.hlo_passes import unroll
    monkeypatch.setattr(unroll, "UNROLL_LIMIT", 2)     # 3 layers: a loop
    model = get_model("gpt", layers=3, scan=True)
    g = rhino.ingest(model.step, *model.example_args())
    whiles = [g.ops[i] for i in g.opaque]
    assert whiles and all(op.opcode == "while" for op in whiles)
    assert any(op.attrs["trip_count"] == 3 for op in whiles)
    assert all("while loop" in op.attrs["opaque"] for op in whiles)
    # The loop body's FLOPs (the layers' matmuls) are counted through the opaque node.
    unrolled = rhino.ingest(*((m := get_model("gpt", layers=3)).step,), *m.example_args())
    assert g.total_flops == pytest.approx(unrolled.total_flops, rel=0.25)
    rhino.analyze(g)  # analyses run on graphs with opaque nodes


def test_an_unrolled_scan_reads_each_layer_when_its_iteration_starts(monkeypatch):
    """The forward and backward scans each read their own slice of a stacked weight, at an
    index tied to the carry (``unroll._index_after``): XLA neither merges the backward's
    slices into the forward's nor takes them all at the start, so they are not all held
    across the forward/backward boundary. With constant indices (the old unroller) the
    compiled program holds at least 3 more layer slices at its peak; values equal
    ``jax.jit`` of the scan either way."""
    from rhino.hlo_passes import unroll
    layers, d = 6, 256

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)
        return jnp.sum(h * h)

    step = jax.grad(loss, argnums=(0, 1))
    w = jax.random.normal(jax.random.PRNGKey(0), (layers, d, d)) / 16
    x = jax.random.normal(jax.random.PRNGKey(1), (256, d))

    def unrolled_temp():
        closed = unroll.trace(step, w, x)
        assert not any(e.primitive.name == "scan" for e in closed.jaxpr.eqns)
        run = jax.jit(lambda *a: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a))
        for got, want in zip(run(w, x), jax.jit(step)(w, x)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        return run.lower(w, x).compile().memory_analysis().temp_size_in_bytes

    tied = unrolled_temp()
    monkeypatch.setattr(unroll, "_index_after", lambda i, length, carry: i)
    constant = unrolled_temp()
    assert tied + 3 * d * d * 4 <= constant, (tied, constant)


def test_malformed_files(tmp_path):
    bad = tmp_path / "bad.hlo"
    bad.write_text("HloModule m\nENTRY e {\n  a = f32[2]{0} parameter(0)\n  b = f32[2 negate(a)\n}\n")
    with pytest.raises(HloParseError) as ei:
        rhino.ingest(str(bad))
    assert ei.value.path == str(bad) and ei.value.line == 4
    mlir = tmp_path / "bad.mlir"
    mlir.write_text("module {\n  func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n"
                    "    %0 = stablehlo.frobnicate %a : tensor<2xf32>\n"
                    "    return %0 : tensor<2xf32>\n  }\n}\n")
    with pytest.raises(HloParseError) as ei:
        rhino.ingest(str(mlir))
    assert str(mlir) in str(ei.value)
    weird = tmp_path / "notes.txt"
    weird.write_text("hello world\n")
    with pytest.raises(HloParseError, match="HloModule"):
        rhino.ingest(str(weird))


def test_bad_sources():
    with pytest.raises(IngestError, match="cannot read"):
        rhino.ingest("/nonexistent/file.hlo")
    with pytest.raises(IngestError, match="only for functions"):
        rhino.ingest("/nonexistent/file.hlo", jnp.ones(2))
    with pytest.raises(IngestError, match="expected a JAX function"):
        rhino.ingest(42)
    with pytest.raises(IngestError, match="cannot lower"):
        rhino.ingest(lambda x, y: x @ y, jnp.ones((2, 3)), jnp.ones((4, 5)))


def test_ingest_uses_shape_dtype_structs_without_allocating():
    s = jax.ShapeDtypeStruct((1 << 15, 1 << 15), jnp.float32)  # 4 GiB if allocated
    g = rhino.ingest(lambda a: a * 2.0, s)
    assert g.param_bytes == 4 << 30
    assert np.isclose(g.total_flops, float(1 << 30))


def test_convolution_attributes_and_flops():
    def f(x, k):
        return jax.lax.conv_general_dilated(x, k, (2, 2), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    g = rhino.ingest(f, jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 16)))
    conv = next(op for op in g.ops if op.opcode == "convolution")
    assert conv.attrs["dim_labels"] == "b01f_01io->b01f"
    assert conv.attrs["window"]["size"] == (3, 3) and conv.attrs["window"]["stride"] == (2, 2)
    # 2 * output elements (2*4*4*16) * per-output MACs (3*3*3)
    assert conv.flops == 2 * (2 * 4 * 4 * 16) * 27


def test_slice_pad_concat_transpose_broadcast_gather_attributes():
    def f(x, idx):
        a = jnp.pad(x[1:5:2, :], ((1, 0), (0, 2)))
        b = jnp.concatenate([x, x], axis=1).T
        c = jnp.take(x, idx, axis=0)
        return a.sum() + b.sum() + c.sum() + jnp.broadcast_to(x[0], (3, 6)).sum()

    g = rhino.ingest(f, jnp.ones((6, 6)), jnp.zeros((4,), jnp.int32))
    by = {}
    for op in g.ops:
        by.setdefault(op.opcode, op)
    assert by["slice"].attrs["slice"] == ((1, 5, 2), (0, 6, 1))
    assert by["pad"].attrs["padding"] == ((1, 0, 0), (0, 2, 0))
    assert by["concatenate"].attrs["dimensions"] == (1,)
    assert by["transpose"].attrs["dimensions"] == (1, 0)
    assert "dimensions" in by["broadcast"].attrs
    gather = by["gather"]
    for key in ("offset_dims", "collapsed_slice_dims", "start_index_map", "slice_sizes"):
        assert isinstance(gather.attrs[key], tuple)
    assert gather.attrs["index_vector_dim"] == 1


def test_non_utf8_file_names_line_and_column(tmp_path, capsys):
    """Bytes that are not UTF-8 are an HloParseError at their line (not a UnicodeDecodeError),
    also from ``rhino inspect``; a leading byte-order mark is fine."""
    from rhino.cli import main

    text = jax.jit(_mlp).lower(*ARGS).as_text(dialect="hlo", debug_info=True).encode()
    lines = text.split(b"\n")
    k = next(i for i, ln in enumerate(lines) if b" dot(" in ln)
    lines[k] = lines[k].replace(b" dot(", b" d\xffot(")
    bad = tmp_path / "latin.hlo"
    bad.write_bytes(b"\n".join(lines))
    with pytest.raises(HloParseError) as ei:
        rhino.ingest(str(bad))
    col = lines[k].index(b"\xff") + 1
    assert (ei.value.path, ei.value.line) == (str(bad), k + 1)
    assert ei.value.expected == "UTF-8 text" and f"0xff at column {col}" in ei.value.found
    assert main(["inspect", str(bad)]) == 2
    assert f"{bad}:{k + 1}: expected UTF-8 text" in capsys.readouterr().err
    mlir = tmp_path / "latin.mlir"
    mlir.write_bytes(b"module {\n  func.func @main() {\n    return \xe9\n  }\n}\n")
    with pytest.raises(HloParseError) as ei:
        rhino.ingest(str(mlir))
    assert ei.value.line == 3
    bom = tmp_path / "bom.hlo"
    bom.write_bytes(b"\xef\xbb\xbf" + text)
    assert len(rhino.ingest(str(bom))) == len(rhino.ingest(_mlp, *ARGS))


def test_silently_accepted_before_now_rejected(tmp_path):
    """Negative dimensions, a parameter number out of range, and a header layout that
    disagrees with the body: each an HloParseError at the offending line."""
    text = jax.jit(_mlp).lower(*ARGS).as_text(dialect="hlo", debug_info=True)
    lines = text.split("\n")
    k = next(i for i, ln in enumerate(lines) if " tanh(" in ln)
    cases = {
        "negative": (lines[k].replace("f32[8,16]", "f32[8,-16]", 1), k + 1, "dimensions"),
        "parameter": (lines[k] + "\n  p7 = f32[2]{0} parameter(7)", k + 2,
                      "a parameter number below 4"),
    }
    for name, (line, at, expected) in cases.items():
        f = tmp_path / f"{name}.hlo"
        f.write_text("\n".join(lines[:k] + [line] + lines[k + 1:]))
        with pytest.raises(HloParseError) as ei:
            rhino.ingest(str(f))
        assert ei.value.line == at and expected in ei.value.expected, str(ei.value)
    assert lines[0].startswith("HloModule") and "f32[4,16]" in lines[0]
    f = tmp_path / "layout.hlo"
    f.write_text("\n".join([lines[0].replace("f32[4,16]", "f32[4,17]", 1)] + lines[1:]))
    with pytest.raises(HloParseError) as ei:
        rhino.ingest(str(f))
    entry = next(i for i, ln in enumerate(lines) if ln.startswith("ENTRY"))
    param = next(i for i in range(entry, len(lines)) if "parameter(1)" in lines[i]) + 1
    assert ei.value.line == param
    assert "f32[4,17], as the header's entry_computation_layout (line 1)" in ei.value.expected


def test_mlir_errors_carry_the_mlir_line(tmp_path, monkeypatch):
    lowered = jax.jit(_mlp).lower(*ARGS)
    lines = lowered.as_text().split("\n")
    k = next(i for i, ln in enumerate(lines) if "stablehlo.tanh" in ln)
    f = tmp_path / "typo.mlir"
    f.write_text("\n".join(lines[:k] + [lines[k].replace("tanh", "tanx")] + lines[k + 1:]))
    with pytest.raises(HloParseError) as ei:
        rhino.ingest(str(f))
    assert ei.value.line == k + 1 and "stablehlo.tanx" in ei.value.found
    # HLO that jaxlib converted but that does not validate: the converted line is named.
    import rhino.jaxpr.private as jp
    hlo = "HloModule m\nENTRY e {\n  a = f32[2]{0} parameter(0)\n  b = f32[3]{0} negate(a)\n}\n"
    monkeypatch.setattr(jp, "stablehlo_text_to_hlo_text", lambda text: hlo)
    f.write_text("\n".join(lines))
    with pytest.raises(HloParseError) as ei:
        rhino.ingest(str(f))
    assert ei.value.line is None and ei.value.path == str(f)
    assert "line 4 of the HLO jaxlib converted it to" in ei.value.expected


def test_huge_convolution_dim_number_is_rejected_before_jaxlib(tmp_path):
    """jaxlib's MLIR parser allocates a list as long as a convolution's spatial dimension
    number: such a number is rejected first, fast, at its line."""
    def f(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    lines = jax.jit(f).lower(jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))).as_text().split("\n")
    k = next(i for i, ln in enumerate(lines) if "->[b, 0, 1, f]" in ln)
    lines[k] = lines[k].replace("->[b, 0, 1, f]", "->[b, 4294967296, 1, f]")
    path = tmp_path / "conv.mlir"
    path.write_text("\n".join(lines))
    with pytest.raises(HloParseError) as ei:
        rhino.ingest(str(path))
    assert ei.value.line == k + 1 and ei.value.found == "4294967296"
    assert "numbered below the rank (4)" in ei.value.expected
