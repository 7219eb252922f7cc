"""The HLO text parser: shapes, syntaxes, attributes, debug info, and malformed input."""

import pytest

from rhino.errors import HloParseError
from rhino.hlo_passes import hlo_text as ht
from rhino.hlo_passes.graph import TensorType
from rhino.hlo_passes.ingest import graph_from_hlo_text

OLD_STYLE = """HloModule old_style, entry_computation_layout={(f32[8,4]{1,0})->f32[8]{0}}

%add_region (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main.5 (x: f32[8,4]) -> f32[8] {
  %x = f32[8,4]{1,0} parameter(0), metadata={op_name="x"}
  %c = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(f32[8,4]{1,0} %x, f32[] %c), dimensions={1}, to_apply=%add_region, metadata={op_name="jit(f)/reduce_sum" source_file="/src/model.py" source_line=12}
}
"""


def test_shapes():
    assert ht.parse_shape("f32[8,4]{1,0}") == TensorType("f32", (8, 4))
    assert ht.parse_shape("pred[]") == TensorType("pred", ())
    assert ht.parse_shape("(f32[2]{0}, (s32[], bf16[3,3]))") == (
        TensorType("f32", (2,)), (TensorType("s32", ()), TensorType("bf16", (3, 3))))
    assert ht.parse_shape("f32[<=8,2]") == TensorType("f32", (8, 2))
    assert TensorType("bf16", (3, 3)).nbytes == 18


def test_split_top_respects_brackets_and_quotes():
    assert ht.split_top('a={1,2}, b="x, y", c=(d, e)') == ['a={1,2}', 'b="x, y"', 'c=(d, e)']
    assert ht.split_top("") == []


def test_attribute_helpers():
    assert ht.parse_slice("{[0:2], [1:9:2]}") == ((0, 2, 1), (1, 9, 2))
    assert ht.parse_padding("0_0x1_2_1") == ((0, 0, 0), (1, 2, 1))
    assert ht.parse_window("{size=3x3 stride=2x2 pad=1_1x0_1}") == {
        "size": (3, 3), "stride": (2, 2), "pad": ((1, 1), (0, 1))}
    md = ht.parse_metadata('{op_name="jit(f)/a \\"q\\"" source_line=3}')
    assert md == {"op_name": 'jit(f)/a "q"', "source_line": "3"}


def test_old_percent_syntax_and_source_file():
    g = graph_from_hlo_text(OLD_STYLE, "old.hlo")
    assert [op.opcode for op in g.ops] == ["parameter", "constant", "reduce"]
    red = g.ops[2]
    assert red.operands == (0, 1)
    assert red.attrs["dimensions"] == (1,)
    assert red.attrs["reducer"] == "add"
    assert red.source == "/src/model.py:12"
    assert red.flops == 32.0
    assert g.ops[0].arg.path == "x"
    assert g.outputs == [2]


def test_tuple_shape_with_index_comments():
    text = """HloModule t
ENTRY e {
  a = f32[2]{0} parameter(0)
  b = s32[] parameter(1)
  t = (f32[2]{0}, /*index=1*/s32[]) tuple(a, b)
  ROOT g = s32[] get-tuple-element(t), index=1
}"""
    g = graph_from_hlo_text(text)
    # get-tuple-element(tuple(...)) is forwarded; the dead tuple is dropped.
    assert [op.opcode for op in g.ops] == ["parameter", "parameter"]
    assert g.outputs == [1]


@pytest.mark.parametrize("text,line,expected", [
    ("HloModule m\nENTRY e {\n  a = f32[2]{0} parameter(0)\n  b = f32[2]{0} negate(zz)\n}",
     4, "operand defined earlier"),
    ("HloModule m\nENTRY e {\n  a = f32[2]{0} parameter(0)\n  garbage here\n}", 4,
     "an instruction"),
    ("HloModule m\nENTRY e {\n  a = q99[2] parameter(0)\n}", 3, "a shape"),
    ("HloModule m\nENTRY e {\n  a = f32[2]{0} parameter(0)\n", 3, "'}' closing"),
    ("ENTRY e {\n}", 1, "'HloModule"),
    ("HloModule m\nfoo bar\n", 2, "a computation header"),
    ("HloModule m\nENTRY e {\n  a = f32[2]{0} negate(b\n}", 3, "a closing bracket"),
    ("HloModule m\nENTRY e {\n  a = f32[2]{0} parameter(0) junk\n}", 3, "',' and attributes"),
])
def test_malformed_input_names_file_line_and_expectation(text, line, expected):
    with pytest.raises(HloParseError) as ei:
        graph_from_hlo_text(text, "bad.hlo")
    err = ei.value
    assert err.path == "bad.hlo"
    assert err.line == line
    assert expected in err.expected
    assert "bad.hlo" in str(err) and "expected" in str(err)


def test_missing_entry():
    with pytest.raises(HloParseError, match="ENTRY"):
        graph_from_hlo_text("HloModule m\nc {\n  a = f32[] parameter(0)\n}\n", "x.hlo")


def _module(body: str, header: str = "HloModule m") -> str:
    """An HLO module: ``header``, then an ENTRY computation whose lines are ``body``."""
    return f"{header}\nENTRY e {{\n{body}\n}}\n"


P2 = "  a = f32[2,3]{1,0} parameter(0)\n  b = f32[2,3]{1,0} parameter(1)\n"
# A header and a computation f(f32[2]) -> f32[2] (lines 1-5).
F = "HloModule m\nf {\n  x = f32[2]{0} parameter(0)\n  ROOT y = f32[2]{0} negate(x)\n}"


@pytest.mark.parametrize("text,line,expected,found", [
    # Tokens: dimensions, element types, layouts, opcodes, names, brackets, attributes.
    (_module("  a = f32[2,-3]{1,0} parameter(0)"), 3, "dimensions that are integers", "-3"),
    (_module("  a = f32[99999999999999999999] parameter(0)"), 3, "integers in [0, 2**63)", ""),
    (_module("  a = f32[4294967296,4294967296] parameter(0)"), 3, "fewer than 2**63 bytes", ""),
    (_module("  a = f32[2,x] parameter(0)"), 3, "dimensions that are integers", "x"),
    (_module("  a = f32[?] parameter(0)"), 3, "dimensions that are integers", "?"),
    (_module("  a = foo[2] parameter(0)"), 3, "a shape", "foo[2]"),
    (_module("  a = f32[2,3]{0,0} parameter(0)"), 3, "a layout listing each of the 2", "{0,0}"),
    (_module("  a = f32[2]{0} parameter(0)\n  b = f32[2]{0} negat(a)"), 4, "an HLO opcode",
     "negat"),
    (_module("  a b = f32[2]{0} parameter(0)"), 3, "an instruction name", "a b"),
    (_module("  a = f32[2]{0} parameter(0)\n  b = f32[2]{0} negate(a), metadata={op_name=\"x"),
     4, "attributes with balanced brackets", "unterminated string"),
    (_module("  a = f32[2]{0} parameter(0)\n  b = f32[2]{0} negate(a), x={1)"), 4,
     "attributes with balanced brackets", "unmatched ')'"),
    (_module("  a = f32[2]{0} parameter(0)\n  b = f32[2]{0} negate(a), x=1, x=2"), 4,
     "attribute x given once", "x=2"),
    (_module("  a = f32[2,3]{1,0} parameter(0)\n  b = f32[3,2]{1,0} transpose(a), "
             "dimensions={1,q}"), 4, "dimensions= as integers", "{1,q}"),
    (_module("  a = f32[2]{0} parameter(0)\n  a = f32[2]{0} negate(a)"), 4, "a name not used "
     "before", "a"),
    (_module("  ROOT a = f32[2]{0} parameter(0)\n  ROOT b = f32[2]{0} negate(a)"), 4,
     "one ROOT", "a second ROOT"),
    ("HloModule m\nENTRY e {\n  a = f32[] parameter(0)\n}\nENTRY f {\n  a = f32[] "
     "parameter(0)\n}\n", 5, "one ENTRY computation", "ENTRY f {"),
    ("HloModule m, entry_computation_layout={(f32[2]{0})->f32[2]{0}\nENTRY e {\n  a = f32[2]{0}"
     " parameter(0)\n}\n", 1, "a module header with balanced brackets", "unclosed"),
    # Parameters: numbers in range, unique, contiguous.
    (_module("  a = f32[2]{0} parameter(0)\n  b = f32[2]{0} parameter(7)"), 4,
     "a parameter number below 2", "parameter(7)"),
    (_module("  a = f32[2]{0} parameter(0)\n  b = f32[2]{0} parameter(0)"), 4,
     "a parameter number not used before (line 3)", "parameter(0)"),
    (_module("  a = f32[2]{0} parameter(-1)"), 3, "a parameter number", "-1"),
    # The header's entry_computation_layout and old-style signatures against the body.
    (_module(P2 + "  ROOT c = f32[2,3]{1,0} add(a, b)",
             "HloModule m, entry_computation_layout="
             "{(f32[2,3]{1,0}, f32[2,4]{1,0})->f32[2,3]{1,0}}"),
     4, "parameter 1 of shape f32[2,4], as the header's entry_computation_layout (line 1)",
     "f32[2,3]"),
    (_module(P2 + "  ROOT c = f32[2,3]{1,0} add(a, b)",
             "HloModule m, entry_computation_layout={(f32[2,3]{1,0})->f32[2,3]{1,0}}"),
     1, "2 parameter shape(s) in the header's entry_computation_layout", "1"),
    (_module(P2 + "  ROOT c = f32[2,3]{1,0} add(a, b)",
             "HloModule m, entry_computation_layout={(f32[2,3]{1,0}, f32[2,3])->f32[3,2]{1,0}}"),
     5, "a root of shape f32[3,2]", "f32[2,3]"),
    ("HloModule m\nENTRY %e (x: f32[4]) -> f32[5] {\n  %x = f32[4]{0} parameter(0)\n}\n", 3,
     "a root of shape f32[5], as its header (line 2) declares", "f32[4]"),
    # Operand shapes against the opcode's rule.
    (_module(P2 + "  c = f32[2,4]{1,0} add(a, b)"), 5, "add: operand 0 with the result's "
     "dimensions [2, 4]", "f32[2,3]"),
    (_module(P2 + "  c = f32[2,3]{1,0} add(a)"), 5, "add: 2 operand(s)", "1"),
    (_module(P2 + "  c = s32[2,3]{1,0} add(a, b)"), 5, "add: operand 0 of element type s32",
     "f32[2,3]"),
    (_module(P2 + "  c = f32[2,3]{1,0} compare(a, b), direction=LT"), 5, "compare: a pred "
     "result", "f32[2,3]"),
    (_module(P2 + "  c = f32[2,2]{1,0} dot(a, b), lhs_contracting_dims={1}, "
             "rhs_contracting_dims={0}"), 5, "dot: lhs dimension 1 (3) equal to rhs dimension 0",
     "f32[2,3] x f32[2,3]"),
    (_module(P2 + "  c = f32[2,2]{1,0} dot(a, b), lhs_contracting_dims={1}"), 5,
     "dot: as many lhs as rhs contracting", "contracting [1] x []"),
    (_module(P2 + "  c = f32[2,9]{1,0} dot(a, b), lhs_contracting_dims={1}, "
             "rhs_contracting_dims={1}"), 5, "dot: result dimensions [2, 2]", "f32[2,9]"),
    (_module(P2 + "  c = f32[2,2]{1,0} dot(a, b), lhs_contracting_dims={5}, "
             "rhs_contracting_dims={1}"), 5, "dot: distinct lhs contracting/batch dimensions",
     "[5]"),
    (_module(P2 + "  c = f32[7]{0} reshape(a)"), 5, "reshape: an operand of 7 elements",
     "f32[2,3]"),
    (_module(P2 + "  c = f32[3,2]{1,0} transpose(a), dimensions={0,0}"), 5,
     "transpose: dimensions= a permutation", "[0, 0]"),
    (_module(P2 + "  c = f32[2,3,4]{2,1,0} broadcast(a), dimensions={0,3}"), 5,
     "broadcast: dimensions= one distinct result dimension", "[0, 3]"),
    (_module(P2 + "  c = f32[2,3]{1,0} broadcast(a)"), 5, "broadcast: a dimensions= attribute",
     "none"),
    (_module(P2 + "  t = (f32[2,3]{1,0}, f32[2,3]{1,0}) tuple(a, b)\n"
             "  g = f32[2,3]{1,0} get-tuple-element(t), index=2"), 6,
     "get-tuple-element: a tuple operand whose element index=2", ""),
    (_module(P2 + "  t = (f32[2,3]{1,0}, f32[2,3]{1,0}) tuple(a, b)\n"
             "  g = f32[2,3]{1,0} get-tuple-element(t), index=-1"), 6,
     "get-tuple-element: a tuple operand whose element index=-1", ""),
    (_module(P2 + "  t = (f32[2,3]{1,0}, f32[2]{0}) tuple(a, b)"), 5, "tuple: a result shape "
     "(f32[2,3], f32[2,3])", "(f32[2,3], f32[2])"),
    (_module(P2 + "  c = f32[2,2]{1,0} slice(a), slice={[0:2], [1:4]}"), 5, "slice: one "
     "in-bounds [start:limit:stride]", "{[0:2], [1:4]}"),
    (_module(P2 + "  c = f32[2,6]{1,0} concatenate(a, b), dimensions={0}"), 5,
     "concatenate: operands matching f32[2,6] except along dimension 0", ""),
    (_module("  a = f32[] parameter(0)\n  c = f32[3]{0} constant(1)"), 4, "constant: a literal "
     "of rank 1", "1"),
    (_module(P2 + "  i = s32[1,1]{1,0} parameter(2)\n  u = f32[1]{0} parameter(3)\n"
             "  c = f32[2,4]{1,0} scatter(a, i, u), update_window_dims={}, "
             "inserted_window_dims={0,1}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, "
             "to_apply=f", F), 11, "scatter: a result of the shape of the 1 operand(s) it updates: "
     "f32[2,3]", "f32[2,4]"),
    (_module("  x = f32[1,4,4,2]{3,2,1,0} parameter(0)\n  k = f32[3,3,2,5]{3,2,1,0} "
             "parameter(1)\n  c = f32[1,4,4,5]{3,2,1,0} convolution(x, k), window={size=3x3 "
             "pad=1_1x1_1}, dim_labels=b01f_01io->b0ff"), 5, "convolution: dim_labels= like "
     "b01f_01io->b01f", "b01f_01io->b0ff"),
    # Calls: the callee exists, takes the operands' shapes, and the call graph has no cycle.
    (_module("  a = f32[3]{0} parameter(0)\n  ROOT c = f32[2]{0} call(a), to_apply=f", F), 8,
     "call: operands of the shapes 'f' takes: (f32[2])", "(f32[3])"),
    (_module("  a = f32[2]{0} parameter(0)\n  ROOT c = f32[2]{0} call(a, a), to_apply=f", F), 8,
     "call: operands of the shapes 'f' takes", "(f32[2], f32[2])"),
    (_module("  a = f32[2]{0} parameter(0)\n  ROOT c = f32[2]{0} call(a), to_apply=nowhere"), 4,
     "a computation defined in the module", "nowhere"),
    (_module("  a = f32[2]{0} parameter(0)\n  ROOT c = f32[2]{0} call(a), to_apply=f",
             "HloModule m\nf {\n  x = f32[2]{0} parameter(0)\n  ROOT y = f32[2]{0} call(x), "
             "to_apply=g\n}\ng {\n  x = f32[2]{0} parameter(0)\n  ROOT y = f32[2]{0} call(x), "
             "to_apply=f\n}"), 8,
     "a call graph without cycles", "'g' calling 'f'"),
    # Deep nesting is an error, not a RecursionError.
    (_module("  a = " + "(" * 200 + "f32[]" + ")" * 200 + " parameter(0)"), 3,
     "tuple shapes nested at most 64 deep", ""),
])
def test_invalid_input_names_line_expected_and_found(text, line, expected, found):
    with pytest.raises(HloParseError) as ei:
        graph_from_hlo_text(text, "bad.hlo")
    err = ei.value
    assert (err.path, err.line) == ("bad.hlo", line), str(err)
    assert expected in err.expected, str(err)
    assert found in err.found, str(err)


@pytest.mark.parametrize("body", [
    P2 + "  p = pred[] parameter(2)\n  ROOT c = f32[2,3]{1,0} select(p, a, b)",
    P2 + "  lo = f32[] parameter(2)\n  ROOT c = f32[2,3]{1,0} clamp(lo, a, lo)",
    P2 + "  ROOT c = f32[2,1,3]{2,1,0} broadcast(a), dimensions={0,2}",
    "  a = f32[1,3]{1,0} parameter(0)\n  ROOT c = f32[4,3]{1,0} broadcast(a), dimensions={0,1}",
    "  a = f32[<=8,3]{1,0} parameter(0)\n  ROOT c = f32[<=4,3]{1,0} reshape(a)",
    "  a = f32[5,2,3]{2,1,0} parameter(0)\n  b = f32[5,3,4]{2,1,0} parameter(1)\n"
    "  ROOT c = f32[5,2,4]{2,1,0} dot(a, b), lhs_batch_dims={0}, lhs_contracting_dims={2}, "
    "rhs_batch_dims={0}, rhs_contracting_dims={1}",
    P2 + "  ROOT c = f32[2,1]{1,0} slice(a), slice={[0:2], [1:3:2]}",
    P2 + "  z = f32[] constant(0)\n  ROOT c = f32[3,10]{1,0} pad(a, z), padding=0_1x1_2_2",
    P2 + "  ROOT c = f32[2,6]{1,0} concatenate(a, b), dimensions={1}",
    "  a = f32[2,3]{1,0:T(2,128)} parameter(0)\n  ROOT c = f32[] constant(0)",
    "  a = f32[2,3]{1,0} parameter(0)\n  ROOT c = f32[2,3]{1,0} copy(a), a_future_attribute={x}",
])
def test_valid_shapes_are_accepted(body):
    """Shapes XLA allows (scalar select predicate and clamp bounds, degenerate broadcast,
    bounded dynamic reshape, batch dot, tiled layouts, attributes rhino does not know)."""
    graph_from_hlo_text(_module(body), "ok.hlo").check()


def test_line_numbers_count_newlines_only():
    """A form feed or U+2028 inside a line does not shift the line numbers of errors."""
    text = _module("  a = f32[2]{0} parameter(0), metadata={op_name=\"x\x0cy\u2028z\"}\n"
                   "  b = f32[2]{0} negate(zz)")
    with pytest.raises(HloParseError) as ei:
        graph_from_hlo_text(text, "ff.hlo")
    assert ei.value.line == 4


def test_while_with_an_infinite_bound_has_unknown_trips():
    text = """HloModule w
cond {
  s = s32[] parameter(0)
  c = s32[] constant(inf)
  ROOT lt = pred[] compare(s, c), direction=LT
}
body {
  s = s32[] parameter(0)
  ROOT n = s32[] negate(s)
}
ENTRY e {
  a = s32[] parameter(0)
  ROOT w = s32[] while(a), condition=cond, body=body
}"""
    g = graph_from_hlo_text(text, "w.hlo")
    assert g.ops[1].attrs["trip_count"] is None
    g.check()


def test_computation_headers_with_attributes():
    """Headers as XLA prints them for other execution threads, with or without a signature."""
    text = """HloModule m
%async_comp (p: f32[2]) -> f32[2], execution_thread="parallel" {
  %p = f32[2]{0} parameter(0)
  ROOT %n = f32[2]{0} negate(%p)
}
%other, execution_thread="host" {
  %q = f32[2]{0} parameter(0)
  ROOT %n = f32[2]{0} negate(%q)
}
ENTRY %e (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0)
  ROOT %c = f32[2]{0} call(%x), to_apply=%async_comp
}
"""
    g = graph_from_hlo_text(text, "threads.hlo")
    assert [op.opcode for op in g.ops] == ["parameter", "negate"]
    with pytest.raises(HloParseError) as ei:
        graph_from_hlo_text(text.replace('execution_thread="host"', "junk"), "threads.hlo")
    assert ei.value.line == 6 and "a header attribute" in ei.value.expected
