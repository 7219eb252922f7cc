"""Property-based tests of file ingestion: real HLO and StableHLO dumps of a zoo model's
training step, mutated (bytes flipped, lines cut, truncated, duplicated, deleted or swapped,
dimensions and numbers changed to negative or huge values, tokens replaced, non-UTF-8 bytes
inserted), must either be rejected with an ``HloParseError`` that names the file (and, for
errors about a line, a line of it) or give a graph that passes ``HloGraph.check()``. Any other
exception fails the test.

The runs are derandomized (reproducible in CI) and parse in-process; ``FUZZ_SCALE=10`` runs
ten times as many cases.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import rhino
from rhino.errors import HloParseError
from rhino.models import get_model

SCALE = float(os.environ.get("FUZZ_SCALE", "1"))

# Whole-file errors: the only HloParseErrors of an HLO file allowed without a line.
_NO_LINE_HLO = ("an 'HloModule <name>' header", "an 'ENTRY' computation")

_HLO_DIM = re.compile(rb"(?<=[\[,])[0-9]+(?=[,\]])")       # f32[8,16]
_MLIR_DIM = re.compile(rb"(?<=[<x])[0-9]+(?=x)")          # tensor<8x16xf32>
_NUMBER = re.compile(rb"-?[0-9]+")
_TOKEN = re.compile(rb"[A-Za-z_][A-Za-z0-9_.\-]*|[{}()\[\],=%:<>]")

DIM_VALUES = (-(2 ** 63), -16, -1, 0, 1, 2, 3, 7, 9, 17, 4096, 2 ** 31, 2 ** 40, 2 ** 62,
              2 ** 63 - 1, 2 ** 63, 2 ** 64 + 1, 10 ** 30)
NON_UTF8 = (b"\xff", b"\xfe\xff", b"\x80", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80",
            b"\xf8\x88\x80\x80\x80", b"\xc0\xaf")
ODD_TEXT = (b"\x00", b"\x0c", b"\x0b", b"\r", b"\t", b"\xe2\x80\xa8", b"\xc2\x85", b"\xef\xbb\xbf",
            b"/*", b"*/", b'"', b"\\", b"{", b"}", b"(", b")", b"[", b"]", b",", b"=", b"->",
            b"ROOT ", b"ENTRY ", b"%", b"<=", b"?", b"\xd9\xa3", b" ", b"\n")
TOKENS = (b"add", b"dot", b"tuple", b"parameter", b"constant", b"call", b"while", b"reduce",
          b"broadcast", b"reshape", b"transpose", b"get-tuple-element", b"fusion", b"f32",
          b"s32", b"pred", b"bf16", b"f64", b"token", b"ROOT", b"ENTRY", b"HloModule",
          b"dimensions", b"index", b"to_apply", b"stablehlo.add", b"stablehlo.dot_general",
          b"func.func", b"module", b"tensor", b"return", b"i32", b"i1", b"f16", b"%arg0",
          b"frobnicate", b"x")

# One mutation: (kind, a, b), with a and b reduced modulo what the kind indexes into.
_KINDS = ("flip", "bitflip", "delete_line", "duplicate_line", "truncate_line", "cut_file",
          "swap_lines", "dim", "number", "non_utf8", "odd_text", "token")
_mutation = st.tuples(
    st.sampled_from(_KINDS),
    st.integers(0, 2 ** 20),
    st.one_of(st.integers(0, 2 ** 20), st.sampled_from(DIM_VALUES), st.integers(-40, 40)))


def mutate(data: bytes, mutation: tuple[str, int, int], dim_re: re.Pattern) -> bytes:
    """Apply one mutation to a file's bytes (indices wrap around what they index)."""
    kind, a, b = mutation
    if not data:
        return data
    a = (a * 2654435761) % (1 << 32)  # spread hypothesis's small integers over the file
    lines = data.split(b"\n")
    i = a % len(lines)
    if kind == "flip":  # an ASCII byte (other bytes: bitflip and non_utf8)
        return data[:a % len(data)] + bytes([b % 128]) + data[a % len(data) + 1:]
    if kind == "bitflip":
        k = a % len(data)
        return data[:k] + bytes([data[k] ^ (1 << (b % 8))]) + data[k + 1:]
    if kind == "delete_line":
        return b"\n".join(lines[:i] + lines[i + 1:])
    if kind == "duplicate_line":
        return b"\n".join(lines[:i + 1] + lines[i:])
    if kind == "truncate_line":
        lines[i] = lines[i][:b % (len(lines[i]) + 1)]
        return b"\n".join(lines)
    if kind == "cut_file":
        return data[:a % (len(data) + 1)]
    if kind == "swap_lines":
        j = b % len(lines)
        lines[i], lines[j] = lines[j], lines[i]
        return b"\n".join(lines)
    if kind in ("dim", "number"):
        spans = [m.span() for m in (dim_re if kind == "dim" else _NUMBER).finditer(data)]
        if not spans:
            return data
        s, e = spans[a % len(spans)]
        return data[:s] + str(b).encode() + data[e:]
    if kind in ("non_utf8", "odd_text"):
        pool = NON_UTF8 if kind == "non_utf8" else ODD_TEXT
        k = a % (len(data) + 1)
        return data[:k] + pool[b % len(pool)] + data[k:]
    if kind == "token":
        spans = [m.span() for m in _TOKEN.finditer(data)]
        s, e = spans[a % len(spans)]
        return data[:s] + TOKENS[b % len(TOKENS)] + data[e:]
    raise ValueError(f"unknown mutation kind {kind!r}")


def _first_bad_utf8_line(data: bytes) -> int | None:
    try:
        data.decode("utf-8")
        return None
    except UnicodeDecodeError as e:
        return data.count(b"\n", 0, e.start) + 1


def ingest_outcome(path: str, data: bytes, is_hlo: bool) -> str:
    """Write ``data`` to ``path`` and ingest it: 'accepted' (a graph that passes its check),
    'rejected: <what was expected>' (an HloParseError as specified), or an AssertionError."""
    with open(path, "wb") as f:
        f.write(data)
    try:
        g = rhino.ingest(path)
    except HloParseError as e:
        assert e.path == path
        assert "unexpected" not in e.expected, f"a parser gap, not a check: {e}"
        nlines = max(1, data.count(b"\n") + (not data.endswith(b"\n")))
        if e.line is not None:
            assert 1 <= e.line <= nlines, f"line {e.line} of {nlines}: {e}"
        elif is_hlo:
            assert e.expected in _NO_LINE_HLO, f"no line for a line error: {e}"
        bad = _first_bad_utf8_line(data)
        if bad is not None:
            assert e.expected == "UTF-8 text" and e.line == bad, str(e)
        label = "rejected: " + re.sub(r"[0-9]+", "N", e.expected)[:48]
        return label + (" (no line)" if e.line is None else "")
    g.check()
    assert len(g.params) == sum(op.opcode == "parameter" for op in g.ops)
    return "accepted"


def _conv_step(x, k):
    """A small convolution + max-pool + loss gradient: convolution dim_numbers, windows,
    reduce-window and select-and-scatter, which the MLP lacks."""
    def loss(k):
        y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return jnp.sum(y ** 2)
    return k - 0.1 * jax.grad(loss)(k)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """HLO text and StableHLO of a small MLP training step and of a convolution step, and a
    scratch directory."""
    model = get_model("mlp", batch=8, hidden=16, layers=2)
    mlp = jax.jit(model.step).lower(*model.example_args())
    conv = jax.jit(_conv_step).lower(jnp.ones((2, 6, 6, 3)), jnp.ones((3, 3, 3, 4)))
    return {"hlo": mlp.as_text(dialect="hlo", debug_info=True).encode(),
            "mlir": mlp.as_text().encode(),
            "conv.hlo": conv.as_text(dialect="hlo", debug_info=True).encode(),
            "conv.mlir": conv.as_text().encode(),
            "dir": str(tmp_path_factory.mktemp("fuzz"))}


def test_unmutated_dumps_ingest(dumps):
    model = get_model("mlp", batch=8, hidden=16, layers=2)
    refs = {"": rhino.ingest(model.step, *model.example_args()),
            "conv.": rhino.ingest(_conv_step, jnp.ones((2, 6, 6, 3)), jnp.ones((3, 3, 3, 4)))}
    for prefix, ref in refs.items():
        for kind in ("hlo", "mlir"):
            path = os.path.join(dumps["dir"], f"clean.{prefix}{kind}")
            assert ingest_outcome(path, dumps[prefix + kind], kind == "hlo") == "accepted"
            g = rhino.ingest(path)
            assert g.opcode_histogram() == ref.opcode_histogram()
            assert g.total_flops == pytest.approx(ref.total_flops)


def test_every_mutation_kind_applies():
    data = b"HloModule m\nENTRY e {\n  a = f32[8,16]{1,0} parameter(0)\n}\n"
    for kind in _KINDS:
        assert mutate(data, (kind, 2, 5), _HLO_DIM) != data, kind


_FUZZ = settings(derandomize=True, deadline=None, database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(_FUZZ, max_examples=int(2500 * SCALE))
@given(mutations=st.lists(_mutation, min_size=1, max_size=3))
def test_mutated_hlo_is_rejected_with_a_line_or_checks(dumps, mutations):
    data = dumps["hlo"]
    for m in mutations:
        data = mutate(data, m, _HLO_DIM)
    event(ingest_outcome(os.path.join(dumps["dir"], "m.hlo"), data,
                         data.lstrip().startswith(b"HloModule")))


@settings(_FUZZ, max_examples=int(1500 * SCALE))
@given(mutations=st.lists(_mutation, min_size=1, max_size=3))
def test_mutated_stablehlo_is_rejected_or_checks(dumps, mutations):
    data = dumps["mlir"]
    for m in mutations:
        data = mutate(data, m, _MLIR_DIM)
    event(ingest_outcome(os.path.join(dumps["dir"], "m.mlir"), data, False))


@settings(_FUZZ, max_examples=int(500 * SCALE))
@given(mutations=st.lists(_mutation, min_size=1, max_size=3))
def test_mutated_convolution_hlo_and_stablehlo(dumps, mutations):
    for kind, dim_re in (("hlo", _HLO_DIM), ("mlir", _MLIR_DIM)):
        data = dumps["conv." + kind]
        for m in mutations:
            data = mutate(data, m, dim_re)
        event(kind + " " + ingest_outcome(os.path.join(dumps["dir"], "m.conv." + kind), data,
                                          data.lstrip().startswith(b"HloModule")))
