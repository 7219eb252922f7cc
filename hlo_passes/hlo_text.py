"""Parser for HLO text as XLA prints and dumps it (both the current and the older ``%``-style
syntax), into raw computations that ``hlo_passes.ingest`` inlines into an ``HloGraph``.

Only the structure the planner needs is decoded; attribute values stay strings until
``parse_attr_value`` / the typed helpers read them. One pass over the lines, no backtracking:
time is linear in the text size.

Example:
    >>> m = parse_hlo_text('''HloModule m
    ... ENTRY main {
    ...   a = f32[4]{0} parameter(0)
    ...   ROOT n = f32[4]{0} negate(a)
    ... }''')
    >>> m.entry.instrs[1].opcode, m.entry.root
    ('negate', 'n')
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from rhino.errors import HloParseError

from .graph import Shape, TensorType, DTYPE_BYTES

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_DELIM_RE = re.compile(r'[{}()\[\]",\\]')
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*)?\{$")
_META_RE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_LITERAL_OPS = frozenset({"parameter", "constant"})


@dataclasses.dataclass(slots=True)
class RawInstr:
    """One instruction line, decoded but not yet linked."""

    name: str
    shape: Shape
    opcode: str
    operands: tuple[str, ...]
    literal: str | None
    attrs: dict[str, str]
    line: int


@dataclasses.dataclass
class RawComputation:
    name: str
    instrs: list[RawInstr]
    root: str
    is_entry: bool
    line: int

    def by_name(self) -> dict[str, RawInstr]:
        return {i.name: i for i in self.instrs}


@dataclasses.dataclass
class RawModule:
    name: str
    computations: dict[str, RawComputation]
    entry_name: str
    path: str
    # Stack-frame tables (newer XLA prints them once per module).
    file_names: dict[int, str]
    file_locations: dict[int, tuple[int, int]]   # id -> (file_name_id, line)
    stack_frames: dict[int, int]                 # id -> file_location_id

    @property
    def entry(self) -> RawComputation:
        return self.computations[self.entry_name]

    def source_of(self, metadata: dict[str, str]) -> str | None:
        """``file:line`` from an instruction's metadata, or None."""
        sf = metadata.get("stack_frame_id")
        if sf is not None:
            loc = self.file_locations.get(self.stack_frames.get(int(sf), -1))
            if loc is not None:
                fname = self.file_names.get(loc[0], "?")
                return f"{fname}:{loc[1]}"
        f = metadata.get("source_file")
        if f is not None:
            return f"{f}:{metadata.get('source_line', '?')}"
        return None


def _matching(s: str, start: int, path: str, lineno: int) -> int:
    """Index just past the bracket matching ``s[start]``, honouring quotes and nesting."""
    depth = 0
    in_str = False
    for m in _DELIM_RE.finditer(s, start):
        c = m.group()
        if in_str:
            if c == '"':
                in_str = False
            continue
        if c == '"':
            in_str = True
        elif c in "{([":
            depth += 1
        elif c in "})]":
            depth -= 1
            if depth == 0:
                return m.end()
    raise HloParseError(path, lineno, f"a closing bracket for {s[start]!r}", s[start:])


def split_top(s: str, sep: str = ",") -> list[str]:
    """Split ``s`` on ``sep`` outside brackets and quotes; pieces are stripped."""
    out: list[str] = []
    depth = 0
    in_str = False
    last = 0
    escaped_pos = -2
    for m in _DELIM_RE.finditer(s):
        c = m.group()
        if in_str:
            if c == "\\":
                escaped_pos = m.start()
            elif c == '"' and escaped_pos != m.start() - 1:
                in_str = False
            continue
        if c == '"':
            in_str = True
        elif c in "{([":
            depth += 1
        elif c in "})]":
            depth -= 1
        elif c == sep and depth == 0:
            out.append(s[last:m.start()].strip())
            last = m.end()
    tail = s[last:].strip()
    if tail or out:
        out.append(tail)
    return out


def parse_shape(text: str, path: str = "<string>", lineno: int | None = None) -> Shape:
    """Parse ``f32[8,4]{1,0}`` or a (nested) tuple ``(f32[2], (s32[], pred[]))``."""
    text = text.strip()
    if text.startswith("("):
        inner = text[1:-1].strip()
        if not inner:
            return ()
        return tuple(parse_shape(p, path, lineno) for p in split_top(inner))
    m = _ARRAY_RE.fullmatch(text)
    if m is None or (m.group(1) not in DTYPE_BYTES and not m.group(1).startswith("f")):
        raise HloParseError(path, lineno, "a shape such as f32[8,4]{1,0} or a tuple of shapes",
                            text)
    dims_txt = m.group(2).strip()
    try:
        dims = tuple(int(d.strip().lstrip("<=")) for d in dims_txt.split(",")) if dims_txt else ()
    except ValueError:
        raise HloParseError(path, lineno, "integer dimensions", dims_txt) from None
    return TensorType(m.group(1), dims)


def parse_metadata(value: str) -> dict[str, str]:
    """``{op_name="a/b" source_line=3}`` -> ``{'op_name': 'a/b', 'source_line': '3'}``."""
    body = value.strip()
    if body.startswith("{"):
        body = body[1:-1]
    out = {}
    for k, v in _META_RE.findall(body):
        if v.startswith('"'):
            v = v[1:-1].replace('\\"', '"')
        out[k] = v
    return out


def parse_int_list(value: str) -> tuple[int, ...]:
    """``{1,0}`` -> (1, 0); ``{}`` -> ()."""
    body = value.strip().strip("{}").strip()
    if not body:
        return ()
    return tuple(int(x) for x in body.split(","))


def parse_slice(value: str) -> tuple[tuple[int, int, int], ...]:
    """``{[0:2], [1:4:2]}`` -> ((0, 2, 1), (1, 4, 2))."""
    out = []
    for part in re.findall(r"\[([^\]]*)\]", value):
        nums = [int(x) for x in part.split(":")]
        out.append((nums[0], nums[1], nums[2] if len(nums) > 2 else 1))
    return tuple(out)


def parse_padding(value: str) -> tuple[tuple[int, int, int], ...]:
    """``0_0x1_2_1`` -> ((0, 0, 0), (1, 2, 1)): (low, high, interior) per dim."""
    out = []
    for part in value.strip().split("x"):
        nums = [int(x) for x in part.split("_")]
        out.append((nums[0], nums[1], nums[2] if len(nums) > 2 else 0))
    return tuple(out)


def parse_window(value: str) -> dict[str, Any]:
    """``{size=3x3 stride=2x2 pad=1_1x1_1}`` -> {'size': (3, 3), 'stride': (2, 2), 'pad': ...}."""
    out: dict[str, Any] = {}
    for k, v in re.findall(r"(\w+)=(\S+)", value.strip().strip("{}")):
        if k == "pad":
            out[k] = tuple(tuple(int(x) for x in p.split("_")) for p in v.split("x"))
        else:
            out[k] = tuple(int(x) for x in v.split("x"))
    return out


def _parse_operands(opcode: str, body: str) -> tuple[tuple[str, ...], str | None]:
    if opcode in _LITERAL_OPS:
        return (), body
    if not body.strip():
        return (), None
    names = []
    for tok in split_top(body):
        # Older syntax prints the operand's shape first: "f32[2]{0} %x".
        name = tok.rsplit(" ", 1)[-1] if " " in tok else tok
        names.append(name.lstrip("%"))
    return tuple(names), None


def parse_instruction(line: str, path: str, lineno: int) -> tuple[RawInstr, bool]:
    """Decode one instruction line; returns (instruction, is_root)."""
    s = line.strip()
    if "/*" in s:
        s = _COMMENT_RE.sub("", s)
    is_root = s.startswith("ROOT ")
    if is_root:
        s = s[5:]
    eq = s.find(" = ")
    if eq <= 0:
        raise HloParseError(path, lineno, "an instruction 'name = shape opcode(operands)'", line)
    name = s[:eq].strip().lstrip("%")
    rest = s[eq + 3:].lstrip()
    if rest.startswith("("):
        end = _matching(rest, 0, path, lineno)
    else:
        end = rest.find(" ")
        if end < 0:
            raise HloParseError(path, lineno, "a shape followed by an opcode", line)
    shape = parse_shape(rest[:end], path, lineno)
    rest = rest[end:].lstrip()
    paren = rest.find("(")
    if paren <= 0:
        raise HloParseError(path, lineno, "an opcode followed by '(operands)'", line)
    opcode = rest[:paren].strip()
    close = _matching(rest, paren, path, lineno)
    operands, literal = _parse_operands(opcode, rest[paren + 1:close - 1])
    attrs: dict[str, str] = {}
    tail = rest[close:].strip()
    if tail:
        if not tail.startswith(","):
            raise HloParseError(path, lineno, "',' and attributes after the operands", tail)
        for part in split_top(tail[1:]):
            k, sep, v = part.partition("=")
            if not sep:
                raise HloParseError(path, lineno, "an attribute 'key=value'", part)
            attrs[k.strip()] = v.strip()
    return RawInstr(name, shape, opcode, operands, literal, attrs, lineno), is_root


_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def parse_hlo_text(text: str, path: str = "<string>") -> RawModule:
    """Parse a whole HLO module.

    Raises:
        HloParseError: naming the file, line and what was expected, on malformed input.
    """
    lines = text.splitlines()
    module_name = None
    comps: dict[str, RawComputation] = {}
    entry_name = None
    cur: RawComputation | None = None
    section = None
    file_names: dict[int, str] = {}
    file_locs: dict[int, tuple[int, int]] = {}
    frames: dict[int, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        s = raw.strip()
        if not s or s.startswith("//") or s.startswith("#"):
            continue
        if cur is not None:
            if s == "}":
                if not cur.root:
                    if not cur.instrs:
                        raise HloParseError(path, lineno, "at least one instruction", "}")
                    cur.root = cur.instrs[-1].name
                comps[cur.name] = cur
                cur = None
                continue
            instr, is_root = parse_instruction(raw, path, lineno)
            cur.instrs.append(instr)
            if is_root:
                cur.root = instr.name
            continue
        if module_name is None:
            if not s.startswith("HloModule "):
                raise HloParseError(path, lineno, "an 'HloModule <name>' header", s)
            module_name = s[len("HloModule "):].split(",")[0].strip()
            continue
        if s in _SECTIONS:
            section = s
            continue
        if s.endswith("{") and " = " not in s:
            m = _HEADER_RE.match(s)
            if m is None:
                raise HloParseError(path, lineno, "a computation header 'name {'", s)
            cur = RawComputation(m.group(2), [], "", bool(m.group(1)), lineno)
            if cur.is_entry:
                entry_name = cur.name
            section = None
            continue
        if section is not None:
            _parse_section_line(section, s, path, lineno, file_names, file_locs, frames)
            continue
        raise HloParseError(path, lineno, "a computation header, a debug-info table or '}'", s)
    if cur is not None:
        raise HloParseError(path, len(lines), f"'}}' closing computation {cur.name!r}",
                            "end of file")
    if module_name is None:
        raise HloParseError(path, None, "an 'HloModule <name>' header", "an empty file")
    if entry_name is None:
        raise HloParseError(path, None, "an 'ENTRY' computation", "none")
    return RawModule(module_name, comps, entry_name, path, file_names, file_locs, frames)


def _parse_section_line(section, s, path, lineno, file_names, file_locs, frames) -> None:
    num, _, rest = s.partition(" ")
    try:
        key = int(num)
    except ValueError:
        raise HloParseError(path, lineno, f"a numbered {section} entry", s) from None
    if section == "FileNames":
        file_names[key] = rest.strip().strip('"')
    elif section == "FileLocations":
        md = parse_metadata(rest)
        file_locs[key] = (int(md.get("file_name_id", -1)), int(md.get("line", 0)))
    elif section == "StackFrames":
        md = parse_metadata(rest)
        frames[key] = int(md.get("file_location_id", -1))
