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
