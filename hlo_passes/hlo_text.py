"""Parser for HLO text as XLA prints and dumps it (both the current and the older ``%``-style
syntax), into raw computations that ``hlo_passes.ingest`` validates and inlines into an
``HloGraph``.

``parse_hlo_text`` decodes the lines in one pass, no backtracking (time is linear in the text
size): module header (with its ``entry_computation_layout``), computations (with old-style
signatures), instructions, debug-info tables. Tokens are checked as they are read: known
element types, dimensions that are integers in [0, 2**63), layouts that permute the
dimensions, balanced brackets and quotes, names defined once, one ROOT and one ENTRY.
What XLA would reject beyond the syntax (unknown opcodes, parameter numbering, operand
shapes, calls) is ``hlo_validate.validate_module``'s job.

Every failure is an ``HloParseError`` naming the file, the 1-based line, what was expected and
what was found; nothing else escapes (an unexpected Python error while decoding a line is
re-raised as an ``HloParseError`` for that line by ``unexpected_error``).

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
import functools
import re
from typing import Any, Iterator

from rhino.errors import HloParseError

from .graph import DTYPE_BYTES, Shape, TensorType

# Element types XLA prints (``s1``/``u1`` are left out: rhino has no byte size for them).
ELEMENT_TYPES = frozenset(DTYPE_BYTES) | frozenset({
    "f8e3m4", "f8e4m3", "f8e4m3b11fnuz", "f8e4m3fn", "f8e4m3fnuz", "f8e5m2", "f8e5m2fnuz",
    "f8e8m0fnu", "f4e2m1fn", "f6e2m3fn", "f6e3m2fn"})

# HLO opcodes as XLA prints them (xla/hlo/ir/hlo_opcode.h), checked against jaxlib 0.10.2
# (which prints clz as count-leading-zeros and JAX's mulhi as a mulhi instruction).
# Ingestion rejects others; the parser alone (also used on compiled HLO from other XLA
# versions, e.g. by runtime.executors.spmd) accepts any opcode-like token.
OPCODES = frozenset("""
abs add add-dependency after-all all-gather all-gather-done all-gather-start all-reduce
all-reduce-done all-reduce-start all-to-all and async-done async-start async-update atan2
batch-norm-grad batch-norm-inference batch-norm-training bitcast bitcast-convert broadcast
call cbrt ceil cholesky clamp clz collective-broadcast collective-permute
collective-permute-done collective-permute-start compare complex concatenate conditional
count-leading-zeros mulhi
constant convert convolution copy copy-done copy-start cosine custom-call divide domain dot
dynamic-reshape dynamic-slice dynamic-update-slice erf exponential exponential-minus-one fft
floor fusion gather get-dimension-size get-tuple-element imag infeed iota is-finite log
log-plus-one logistic map maximum minimum multiply negate not opt-barrier or outfeed pad
parameter partition-id popcnt power ragged-all-to-all ragged-dot real recv recv-done reduce
reduce-precision reduce-scatter reduce-window remainder replica-id reshape reverse rng
rng-bit-generator rng-get-and-update-state round-nearest-afz round-nearest-even rsqrt
scaled-dot scatter select select-and-scatter send send-done set-dimension-size shift-left
shift-right-arithmetic shift-right-logical sign sine slice sort sqrt stochastic-convert
subtract tan tanh topk transpose triangular-solve tuple while xor
""".split())

# Attributes decoded into Python values (others stay strings; metadata is dropped).
INT_LIST_KEYS = frozenset({
    "dimensions", "lhs_batch_dims", "lhs_contracting_dims", "rhs_batch_dims",
    "rhs_contracting_dims", "offset_dims", "collapsed_slice_dims", "start_index_map",
    "slice_sizes", "update_window_dims", "inserted_window_dims",
    "scatter_dims_to_operand_dims", "operand_batching_dims", "start_indices_batching_dims",
    "input_batching_dims", "scatter_indices_batching_dims", "dynamic_slice_sizes",
})
INT_KEYS = frozenset({"index", "iota_dimension", "index_vector_dim", "feature_group_count",
                      "batch_group_count"})
REGION_KEYS = ("to_apply", "calls", "body", "condition", "true_computation",
               "false_computation", "branch_computations", "called_computations")
_INT64_MAX = (1 << 63) - 1
_MAX_TUPLE_DEPTH = 64

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_DIM_RE = re.compile(r"(<=)?([0-9]+)")
_INT_RE = re.compile(r"-?[0-9]+")
NAME_RE = re.compile(r"%?[A-Za-z_][A-Za-z0-9_.\-]*")  # an instruction or computation name
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")   # control-predecessors has a dash
_OPCODE_RE = re.compile(r"[a-z][a-z0-9\-]*")
_DELIM_RE = re.compile(r'"(?:[^"\\]|\\.)*"|["{}()\[\],]')  # a whole string, or one delimiter
# name {  /  name (a: f32[]) -> f32[] {  /  name, execution_thread="x" {  (optionally ENTRY)
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*|,.*)?\{$", re.ASCII)
_META_RE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_LITERAL_OPS = frozenset({"parameter", "constant"})
_CLOSERS = {")": "(", "]": "[", "}": "{"}
# Python errors a parser gap could raise; ``unexpected_error`` turns them into HloParseErrors.
DECODE_ERRORS = (ValueError, IndexError, KeyError, TypeError, AttributeError, OverflowError,
                 RecursionError, ZeroDivisionError)


@dataclasses.dataclass(slots=True)
class RawInstr:
    """One instruction line, decoded (``typed``: attributes as Python values, filled in by
    ``hlo_validate.validate_module``) but not yet linked."""

    name: str
    shape: Shape
    opcode: str
    operands: tuple[str, ...]
    literal: str | None
    attrs: dict[str, str]
    line: int
    dynamic: bool = False
    typed: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RawComputation:
    """A computation; ``params[k]`` is its ``parameter(k)`` (set by
    ``hlo_validate.validate_module``) and ``signature`` the ``(params) -> result`` shapes its header
    declares, if it does."""

    name: str
    instrs: list[RawInstr]
    root: str
    is_entry: bool
    line: int
    params: list[RawInstr] = dataclasses.field(default_factory=list)
    signature: tuple[list[Shape], Shape] | None = None

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
    # The header's entry_computation_layout as (parameter shapes, result shape), if given.
    entry_layout: tuple[list[Shape], Shape] | None = None
    header_line: int = 1
    frame_parents: dict[int, int] = dataclasses.field(default_factory=dict)  # id -> caller
    # The header's input_output_alias: result index -> the parameter number whose buffer it
    # reuses (top-level results aliasing whole parameters: a donated argument's update).
    aliases: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def entry(self) -> RawComputation:
        return self.computations[self.entry_name]

    def source_of(self, metadata: dict[str, str]) -> str | None:
        """``file:line`` from an instruction's metadata, or None: of its stack (JAX writes
        the whole traceback), the innermost frame outside installed libraries (a user's
        line, not ``flax/nnx/nn/linear.py``), else the innermost frame."""
        sf = metadata.get("stack_frame_id")
        if sf is not None and sf.isdigit():
            chain = self.frame_chain(int(sf))
            lines = [(self.file_names.get(loc[0], "?"), loc[1]) for loc in
                     (self.file_locations.get(self.stack_frames.get(f, -1)) for f in chain)
                     if loc is not None]
            if lines:
                fname, line = next((x for x in lines if not is_library_file(x[0])), lines[0])
                return f"{fname}:{line}"
        f = metadata.get("source_file")
        if f is not None:
            return f"{f}:{metadata.get('source_line', '?')}"
        return None


    def frame_chain(self, frame: int) -> list[int]:
        """Stack frame ids from ``frame`` (innermost) out to the outermost caller."""
        out: list[int] = []
        while frame in self.stack_frames and frame not in out:
            out.append(frame)
            frame = self.frame_parents.get(frame, 0)
        return out


LIBRARY_DIRS = ("site-packages", "dist-packages")
"""Folders of installed libraries: a source line inside them is not the user's."""


def is_library_file(path: str) -> bool:
    """Whether ``path`` lies in an installed library (``LIBRARY_DIRS``).

    >>> is_library_file("/venv/lib/python3.11/site-packages/flax/nnx/nn/linear.py")
    True
    >>> is_library_file("/home/me/train.py")
    False
    """
    parts = path.replace("\\", "/").split("/")
    return any(d in parts for d in LIBRARY_DIRS)


def frame_parents(printed: dict[int, int]) -> dict[int, int]:
    """Caller frame ids from the ``parent_frame_id`` values of an HLO text's
    ``StackFrames`` (0: none). XLA (jaxlib 0.10) prints each parent one above its id, so
    that the outermost frame reads as its own parent, which no frame can be: where some
    frame does, every value is read one lower.

    >>> frame_parents({1: 1, 2: 2, 3: 3})       # 3 called from 2, from 1, from nothing
    {1: 0, 2: 1, 3: 2}
    >>> frame_parents({1: 0, 2: 1})
    {1: 0, 2: 1}
    """
    shift = 1 if any(k == v for k, v in printed.items()) else 0
    return {k: max(0, v - shift) for k, v in printed.items()}


# --- brackets, lists and shapes ------------------------------------------------------------

def _scan(s: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """Yield ``(index, char, depth)`` for brackets and commas outside quoted strings (depth
    after an opener, before a closer); raise ValueError on a mismatched bracket or an
    unterminated string."""
    stack: list[str] = []
    for m in _DELIM_RE.finditer(s, start):
        c, i = m.group(), m.start()
        if c[0] == '"':
            if len(c) == 1:  # a quote the string pattern could not close
                raise ValueError("an unterminated string")
        elif c in "{([":
            stack.append(c)
            yield i, c, len(stack)
        elif c == ",":
            yield i, c, len(stack)
        else:
            if not stack or stack.pop() != _CLOSERS[c]:
                raise ValueError(f"an unmatched {c!r} at column {i + 1}")
            yield i, c, len(stack) + 1
    if stack:
        raise ValueError(f"an unclosed {stack[-1]!r}")


def _matching(s: str, start: int, path: str, lineno: int) -> int:
    """Index just past the bracket matching ``s[start]``, honouring quotes and nesting."""
    try:
        for i, c, depth in _scan(s, start):
            if c in _CLOSERS and depth == 1:
                return i + 1
    except ValueError:
        pass  # reported below with the text that is left open
    raise HloParseError(path, lineno, f"a closing bracket for {s[start]!r}", s[start:])


def _split(s: str) -> list[str]:
    """Split on commas outside brackets and quotes (ValueError if unbalanced)."""
    out: list[str] = []
    last = 0
    for i, c, depth in _scan(s):
        if c == "," and depth == 0:
            out.append(s[last:i].strip())
            last = i + 1
    tail = s[last:].strip()
    if tail or out:
        out.append(tail)
    return out


def split_top(s: str) -> list[str]:
    """Split ``s`` on commas outside brackets and quotes; pieces are stripped.

    Raises:
        ValueError: on unbalanced brackets or an unterminated string.
    """
    return _split(s)


def _split_checked(s: str, path: str, lineno: int, what: str) -> list[str]:
    try:
        return _split(s)
    except ValueError as e:
        raise HloParseError(path, lineno, f"{what} with balanced brackets and quotes",
                            f"{e} in {s!r}") from None


def parse_shape(text: str, path: str = "<string>", lineno: int | None = None) -> Shape:
    """Parse ``f32[8,4]{1,0}`` or a (nested) tuple ``(f32[2], (s32[], pred[]))``.

    Dimensions must be non-negative integers below 2**63 (``<=N`` for a bounded dynamic
    one), the element type one XLA knows, and a layout's minor-to-major list (if given) a
    permutation of the dimensions.

    Raises:
        HloParseError: at ``path``:``lineno``, saying which of these the text breaks.
    """
    try:
        return _shape(text.strip())
    except _BadShape as e:
        raise HloParseError(path, lineno, e.args[0], e.args[1]) from None


class _BadShape(Exception):
    """(expected, found) for a shape text; ``parse_shape`` adds the file and line."""


@functools.lru_cache(maxsize=4096)  # a module repeats few distinct shapes many times
def _shape(text: str, depth: int = 0) -> Shape:
    if text.startswith("("):
        if depth >= _MAX_TUPLE_DEPTH:
            raise _BadShape(f"tuple shapes nested at most {_MAX_TUPLE_DEPTH} deep", text[:80])
        if not text.endswith(")"):
            raise _BadShape("a tuple shape closed by ')'", text)
        inner = text[1:-1].strip()
        if not inner:
            return ()
        try:
            parts = _split(inner)
        except ValueError as e:
            raise _BadShape("a tuple shape with balanced brackets and quotes",
                            f"{e} in {inner!r}") from None
        return tuple(_shape(p, depth + 1) for p in parts)
    m = _ARRAY_RE.fullmatch(text)
    if m is None or m.group(1) not in ELEMENT_TYPES:
        raise _BadShape("a shape such as f32[8,4]{1,0} or a tuple of shapes", text)
    dims = []
    if m.group(2).strip():
        for d in m.group(2).split(","):
            dm = _DIM_RE.fullmatch(d.strip())
            if dm is None or int(dm.group(2)) > _INT64_MAX:
                raise _BadShape("dimensions that are integers in [0, 2**63) (or <=N for a "
                                "bounded dynamic one)", f"[{m.group(2)}]")
            dims.append(int(dm.group(2)))
    t = TensorType(m.group(1), tuple(dims))
    if t.numel > _INT64_MAX or t.nbytes > _INT64_MAX:
        raise _BadShape("a shape of fewer than 2**63 bytes", text)
    if m.group(3):
        minor_to_major = m.group(3)[1:-1].split(":")[0].strip()
        if minor_to_major:
            order = minor_to_major.split(",")
            if (not all(_INT_RE.fullmatch(x.strip()) for x in order)
                    or sorted(int(x) for x in order) != list(range(len(dims)))):
                raise _BadShape(f"a layout listing each of the {len(dims)} dimensions once",
                                m.group(3))
    return t


# --- attributes ---------------------------------------------------------------------------

def _ints(body: str, sep: str) -> list[int]:
    parts = body.split(sep)
    if not all(_INT_RE.fullmatch(p.strip()) for p in parts):
        raise ValueError(f"integers separated by {sep!r}")
    return [int(p) for p in parts]


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
    """``{1,0}`` -> (1, 0); ``{}`` -> (). Raises ValueError on anything else."""
    body = value.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError("a list such as {1,0}")
    body = body[1:-1].strip()
    return tuple(_ints(body, ",")) if body else ()


def parse_slice(value: str) -> tuple[tuple[int, int, int], ...]:
    """``{[0:2], [1:4:2]}`` -> ((0, 2, 1), (1, 4, 2)). Raises ValueError on anything else."""
    body = value.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError("a list of [start:limit(:stride)] ranges in braces")
    out = []
    for part in (p.strip() for p in body[1:-1].split(",")):
        if not part:
            continue
        if not (part.startswith("[") and part.endswith("]")):
            raise ValueError("a [start:limit(:stride)] range")
        nums = _ints(part[1:-1], ":")
        if len(nums) not in (2, 3):
            raise ValueError("a [start:limit(:stride)] range")
        out.append((nums[0], nums[1], nums[2] if len(nums) > 2 else 1))
    return tuple(out)


def parse_padding(value: str) -> tuple[tuple[int, int, int], ...]:
    """``0_0x1_2_1`` -> ((0, 0, 0), (1, 2, 1)): (low, high, interior) per dim."""
    out = []
    for part in value.strip().split("x"):
        nums = _ints(part, "_")
        if len(nums) not in (2, 3) or (len(nums) == 3 and nums[2] < 0):
            raise ValueError("low_high(_interior) per dimension, interior >= 0")
        out.append((nums[0], nums[1], nums[2] if len(nums) > 2 else 0))
    return tuple(out)


def parse_window(value: str) -> dict[str, Any]:
    """``{size=3x3 stride=2x2 pad=1_1x1_1}`` -> {'size': (3, 3), 'stride': (2, 2), 'pad': ...}.

    Sizes, strides and dilations must be positive (XLA rejects others)."""
    out: dict[str, Any] = {}
    body = value.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError("a window such as {size=3x3 stride=2x2}")
    for item in body[1:-1].split():
        k, sep, v = item.partition("=")
        if not sep or not _KEY_RE.fullmatch(k):
            raise ValueError("key=value items")
        if k == "pad":
            out[k] = tuple(tuple(_ints(p, "_")) for p in v.split("x"))
        else:
            out[k] = tuple(_ints(v, "x"))
            if k != "rhs_reversal" and any(x < 1 for x in out[k]):
                raise ValueError(f"positive {k} values")
    return out


def decode_attrs(raw: dict[str, str], path: str = "<string>",
                 lineno: int | None = None) -> dict[str, Any]:
    """Decode the attributes a planner reads; others stay strings (metadata is dropped).

    Raises:
        HloParseError: an attribute that does not have its documented form.
    """
    out: dict[str, Any] = {}
    for k, v in raw.items():
        try:
            if k == "metadata":
                continue
            if k in INT_LIST_KEYS:
                out[k] = parse_int_list(v)
            elif k in INT_KEYS:
                if not _INT_RE.fullmatch(v):
                    raise ValueError("an integer")
                out[k] = int(v)
            elif k == "slice":
                out[k] = parse_slice(v)
            elif k == "padding":
                out[k] = parse_padding(v)
            elif k == "window":
                out[k] = parse_window(v)
            elif v.startswith('"') and v.endswith('"') and len(v) >= 2:
                out[k] = v[1:-1]
            else:
                out[k] = v.lstrip("%") if k in REGION_KEYS else v
        except ValueError as e:
            raise HloParseError(path, lineno, f"{k}= as {e}", v) from None
    return out


# --- lines ------------------------------------------------------------------------------

def _parse_operands(opcode: str, body: str, path: str,
                    lineno: int) -> tuple[tuple[str, ...], str | None]:
    if opcode in _LITERAL_OPS:
        return (), body
    if not body.strip():
        return (), None
    names = []
    for tok in _split_checked(body, path, lineno, "operands"):
        # Older syntax prints the operand's shape first: "f32[2]{0} %x".
        name = tok.rsplit(" ", 1)[-1] if " " in tok else tok
        if not NAME_RE.fullmatch(name):
            raise HloParseError(path, lineno, "an operand name such as %x or add.3", tok)
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
    name = s[:eq].strip()
    if not NAME_RE.fullmatch(name):
        raise HloParseError(path, lineno, "an instruction name such as %x or add.3", name)
    name = name.lstrip("%")
    rest = s[eq + 3:].lstrip()
    if rest.startswith("("):
        end = _matching(rest, 0, path, lineno)
    else:
        end = rest.find(" ")
        if end < 0:
            raise HloParseError(path, lineno, "a shape followed by an opcode", line)
    shape_text = rest[:end]
    shape = parse_shape(shape_text, path, lineno)
    rest = rest[end:].lstrip()
    paren = rest.find("(")
    if paren <= 0:
        raise HloParseError(path, lineno, "an opcode followed by '(operands)'", line)
    opcode = rest[:paren].strip()
    if not _OPCODE_RE.fullmatch(opcode):  # known opcodes: hlo_validate.validate_module
        raise HloParseError(path, lineno, "an HLO opcode such as add or dot", opcode)
    close = _matching(rest, paren, path, lineno)
    operands, literal = _parse_operands(opcode, rest[paren + 1:close - 1], path, lineno)
    attrs: dict[str, str] = {}
    tail = rest[close:].strip()
    if tail:
        if not tail.startswith(","):
            raise HloParseError(path, lineno, "',' and attributes after the operands", tail)
        for part in _split_checked(tail[1:], path, lineno, "attributes"):
            k, sep, v = part.partition("=")
            k, v = k.strip(), v.strip()
            if not sep or not _KEY_RE.fullmatch(k) or not v:
                raise HloParseError(path, lineno, "an attribute 'key=value'", part)
            if k in attrs:
                raise HloParseError(path, lineno, f"attribute {k} given once", part)
            attrs[k] = v
    return (RawInstr(name, shape, opcode, operands, literal, attrs, lineno,
                     dynamic="<=" in shape_text), is_root)


def _parse_signature(sig: str, path: str, lineno: int,
                     named: bool) -> tuple[list[Shape], Shape]:
    """``(a: f32[2], b: s32[]) -> f32[2]`` (named) or ``(f32[2], s32[])->f32[2]``."""
    sig = _COMMENT_RE.sub("", sig).strip()
    if not sig.startswith("("):
        raise HloParseError(path, lineno, "a signature '(parameters) -> result'", sig)
    end = _matching(sig, 0, path, lineno)
    rest = sig[end:].strip()
    if not rest.startswith("->"):
        raise HloParseError(path, lineno, "'->' and a result shape after the parameters", rest)
    params = []
    for p in _split_checked(sig[1:end - 1], path, lineno, "parameters"):
        if named:
            pname, colon, p = p.partition(":")
            if not colon or not NAME_RE.fullmatch(pname.strip()):
                raise HloParseError(path, lineno, "a parameter 'name: shape'", pname + colon + p)
        params.append(parse_shape(p, path, lineno))
    result, *attrs = _split_checked(rest[2:], path, lineno, "a result shape")
    for a in attrs:  # e.g. execution_thread="host" on a computation header
        if not _KEY_RE.fullmatch(a.partition("=")[0].strip()) or "=" not in a:
            raise HloParseError(path, lineno, "attributes 'key=value' after the result", a)
    return params, parse_shape(result, path, lineno)


_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


class _Reader:
    """Line-by-line state of ``parse_hlo_text``."""

    def __init__(self, path: str):
        self.path = path
        self.module_name: str | None = None
        self.entry_layout: tuple[list[Shape], Shape] | None = None
        self.aliases: dict[int, int] = {}
        self.header_line = 1
        self.comps: dict[str, RawComputation] = {}
        self.entry_name: str | None = None
        self.cur: RawComputation | None = None
        self.names: set[str] = set()
        self.section: str | None = None
        self.file_names: dict[int, str] = {}
        self.file_locs: dict[int, tuple[int, int]] = {}
        self.frames: dict[int, int] = {}
        self.parents: dict[int, int] = {}

    def line(self, lineno: int, raw: str) -> None:
        path, s, cur = self.path, raw.strip(), self.cur
        if not s or s.startswith("//") or s.startswith("#"):
            return
        if cur is not None:
            if s == "}":
                if not cur.root:
                    if not cur.instrs:
                        raise HloParseError(path, lineno, "at least one instruction", "}")
                    cur.root = cur.instrs[-1].name
                self.comps[cur.name] = cur
                self.cur = None
                return
            instr, is_root = parse_instruction(raw, path, lineno)
            if instr.name in self.names:
                raise HloParseError(path, lineno, f"a name not used before in {cur.name!r}",
                                    instr.name)
            if is_root and cur.root:
                raise HloParseError(path, lineno, f"one ROOT in {cur.name!r} (already "
                                    f"{cur.root!r})", "a second ROOT")
            self.names.add(instr.name)
            cur.instrs.append(instr)
            if is_root:
                cur.root = instr.name
            return
        if self.module_name is None:
            self._module_header(s, lineno)
            return
        if s in _SECTIONS:
            self.section = s
            return
        if s.endswith("{") and " = " not in s:
            m = _HEADER_RE.match(s)
            if m is None:
                raise HloParseError(path, lineno, "a computation header 'name {'", s)
            name = m.group(2)
            if name in self.comps:
                raise HloParseError(path, lineno, "a computation name not used before "
                                    f"(line {self.comps[name].line})", name)
            sig = None
            if m.group(3) and m.group(3).startswith(","):
                for a in _split_checked(m.group(3)[1:], path, lineno, "header attributes"):
                    if "=" not in a or not _KEY_RE.fullmatch(a.partition("=")[0].strip()):
                        raise HloParseError(path, lineno, "a header attribute 'key=value'", a)
            elif m.group(3):
                sig = _parse_signature(m.group(3), path, lineno, True)
            self.cur = RawComputation(name, [], "", bool(m.group(1)), lineno, signature=sig)
            self.names = set()
            if self.cur.is_entry:
                if self.entry_name is not None:
                    raise HloParseError(path, lineno, "one ENTRY computation (already "
                                        f"{self.entry_name!r})", s)
                self.entry_name = name
            self.section = None
            return
        if self.section is not None:
            self._section_line(s, lineno)
            return
        raise HloParseError(path, lineno, "a computation header, a debug-info table or '}'", s)

    def _module_header(self, s: str, lineno: int) -> None:
        if not s.startswith("HloModule "):
            raise HloParseError(self.path, lineno, "an 'HloModule <name>' header", s)
        parts = _split_checked(s[len("HloModule "):], self.path, lineno, "a module header")
        if not parts or not NAME_RE.fullmatch(parts[0]):
            raise HloParseError(self.path, lineno, "a module name after 'HloModule'", s)
        self.module_name, self.header_line = parts[0], lineno
        for part in parts[1:]:
            k, sep, v = part.partition("=")
            if not sep or not _KEY_RE.fullmatch(k.strip()):
                raise HloParseError(self.path, lineno, "a module attribute 'key=value'", part)
            if k.strip() == "entry_computation_layout":
                v = v.strip()
                if not (v.startswith("{") and v.endswith("}")):
                    raise HloParseError(self.path, lineno, "entry_computation_layout={(...)->...}",
                                        v)
                self.entry_layout = _parse_signature(v[1:-1], self.path, lineno, False)
            elif k.strip() == "input_output_alias":
                self.aliases = _parse_aliases(v, self.path, lineno)

    def _section_line(self, s: str, lineno: int) -> None:
        num, _, rest = s.partition(" ")
        if not num.isdigit() or not num.isascii():
            raise HloParseError(self.path, lineno, f"a numbered {self.section} entry", s)
        key = int(num)
        if self.section == "FileNames":
            self.file_names[key] = rest.strip().strip('"')
        elif self.section in ("FileLocations", "StackFrames"):
            md = parse_metadata(rest)
            fields = (("file_name_id", "line") if self.section == "FileLocations"
                      else ("file_location_id",))
            vals = [md.get(f, "-1") for f in fields]
            if not all(_INT_RE.fullmatch(v) for v in vals):
                raise HloParseError(self.path, lineno, f"integer {', '.join(fields)} in a "
                                    f"{self.section} entry", s)
            if self.section == "FileLocations":
                self.file_locs[key] = (int(vals[0]), int(vals[1]))
            else:
                self.frames[key] = int(vals[0])
                parent = md.get("parent_frame_id", "0")
                if not _INT_RE.fullmatch(parent):
                    raise HloParseError(self.path, lineno, "an integer parent_frame_id in a "
                                        "StackFrames entry", s)
                self.parents[key] = int(parent)

    def finish(self, nlines: int) -> RawModule:
        path = self.path
        if self.cur is not None:
            raise HloParseError(path, nlines, f"'}}' closing computation {self.cur.name!r}",
                                "end of file")
        if self.module_name is None:
            raise HloParseError(path, None, "an 'HloModule <name>' header", "an empty file")
        if self.entry_name is None:
            raise HloParseError(path, None, "an 'ENTRY' computation", "none")
        return RawModule(self.module_name, self.comps, self.entry_name, path, self.file_names,
                         self.file_locs, self.frames, self.entry_layout, self.header_line,
                         frame_parents(self.parents), self.aliases)


_ALIAS_RE = re.compile(r"\{\s*([\d,\s]*)\}\s*:\s*\(\s*(\d+)\s*,\s*\{\s*([\d,\s]*)\}"
                       r"\s*(?:,\s*[\w-]+\s*)?\)")


def _parse_aliases(text: str, path: str, lineno: int) -> dict[int, int]:
    """``input_output_alias={ {0}: (0, {}, may-alias), {1}: (2, {}, must-alias) }`` as
    {result index: parameter number}, for results and parameters aliased whole (a tuple
    element inside a result or a parameter is not a step's argument or result: skipped).

    >>> _parse_aliases("{ {0}: (0, {}, may-alias), {2}: (1, {}, may-alias), {1, 0}: (3, {}) }",
    ...                "<s>", 1)
    {0: 0, 2: 1}
    """
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise HloParseError(path, lineno, "input_output_alias={ {i}: (p, {}, kind), ... }",
                            text)
    entries = _ALIAS_RE.findall(body[1:-1])
    if body[1:-1].strip() and not entries:
        raise HloParseError(path, lineno, "input_output_alias entries '{i}: (p, {}, kind)'",
                            text)
    out: dict[int, int] = {}
    for result, param, inner in entries:
        result_index = [x for x in result.replace(" ", "").split(",") if x]
        if len(result_index) == 1 and not inner.strip():
            out[int(result_index[0])] = int(param)
    return out


def parse_hlo_text(text: str, path: str = "<string>") -> RawModule:
    """Parse a whole HLO module (its syntax and tokens; ``hlo_validate.validate_module`` checks
    what XLA would reject on top).

    Lines are numbered as editors do: only ``\\n`` ends a line.

    Raises:
        HloParseError: naming the file, line and what was expected, on malformed input.
    """
    reader = _Reader(path)
    lines = text.split("\n")
    for lineno, raw in enumerate(lines, start=1):
        try:
            reader.line(lineno, raw)
        except DECODE_ERRORS as e:
            raise unexpected_error(path, lineno, raw, e) from e
    return reader.finish(len(lines) - (lines[-1] == ""))  # a final newline ends, not starts


def unexpected_error(path: str, lineno: int | None, text: str, e: BaseException) -> HloParseError:
    """An HloParseError for a Python error met while decoding ``text`` (a parser gap)."""
    return HloParseError(path, lineno, "a line rhino can decode (unexpected "
                         f"{type(e).__name__}: {e})", text.strip()[:120])


def region_refs(ins: RawInstr) -> list[str]:
    """Names of the computations an instruction calls (``to_apply``, ``body``, ...)."""
    keys = REGION_KEYS + (("select", "scatter") if ins.opcode == "select-and-scatter" else ())
    out = []
    for k in keys:
        v = ins.attrs.get(k)
        if v is not None:
            out.extend(x.strip().lstrip("%") for x in v.strip("{}").split(",") if x.strip())
    return out
