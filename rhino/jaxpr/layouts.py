"""The data of the microbatch analysis (``rhino.jaxpr.microbatch``): how a value is
computed over the microbatches (``Layout``), how an equation reads an operand (``Use``),
where it runs (``Place``), what couples the batch (``Coupling``) and the whole result
(``MicrobatchLayout``). Plain frozen data over a flat program's integer refs."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from rhino.errors import RhinoError


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a value is computed over the microbatches (see the module docstring)."""

    kind: str                  # whole | split | partial | total | local
    axis: int | None = None    # split: the dimension cut into microbatches
    op: str | None = None      # partial: sum | max | min
    pair: int | None = None    # split: a second dimension cut by the same microbatch index
    group: int | None = None   # split: the dimension is this many equal blocks, each cut

    def __str__(self) -> str:
        cut = f"{self.axis}" if self.pair is None else f"{self.axis},{self.pair}"
        if self.group:
            cut += f" in {self.group} groups"
        return {"split": f"split({cut})", "partial": f"partial({self.op})"}.get(
            self.kind, self.kind)

    @property
    def per_microbatch(self) -> bool:
        return self.kind in ("split", "partial", "local")

    @property
    def dims(self) -> tuple[int, ...]:
        """The dimensions a microbatch cuts (split only)."""
        if self.kind != "split":
            return ()
        return (self.axis,) if self.pair is None else (self.axis, self.pair)


WHOLE, TOTAL, LOCAL = Layout("whole"), Layout("total"), Layout("local")


def split(axis: int, pair: int | None = None, group: int | None = None) -> Layout:
    """A value split along ``axis`` (contiguous chunks; with ``group``, the dimension is
    ``group`` equal blocks and each microbatch holds its chunk of every block: the examples
    of a batch reshaped into chunks that a loop takes one by one)."""
    if pair is None:
        return Layout("split", axis=int(axis), group=int(group) if group and group > 1
                      else None)
    a, b = sorted((int(axis), int(pair)))
    return Layout("split", axis=a, pair=b)


def partial(op: str = "sum") -> Layout:
    return Layout("partial", op=op)


@dataclasses.dataclass(frozen=True)
class Use:
    """How an equation reads an operand when that is not as it was made.

    ``slice``: a whole value's chunk of the current microbatch along ``axis`` (and along
    ``pair`` too: its diagonal block; a split value's chunk along another dimension it is
    constant along, ``pair`` None); ``whole``: a
    value computed from the batch alone, computed whole by the prologue; ``total``: the sum
    over microbatches of a partial value; ``concat``: a split value's chunks put together
    along ``axis``; ``local``: a partial value as the microbatch's own estimate of the
    total (``m`` times its term; ``per_microbatch_statistics`` only). ``group``: the
    chunk of each of that many blocks (``Layout.group``). ``steady``: a slice of a value
    constant along ``axis`` (a broadcast): every microbatch's chunk is the first.
    ``rebase``: ``(coordinate, chunk)`` of an index array (read as it is, ``rebase``, or
    sliced) whose coordinate holds positions along the batch: the microbatch's offset
    ``mb * chunk`` is taken off it, making them positions in the microbatch."""

    kind: str
    axis: int | None = None
    pair: int | None = None
    group: int | None = None
    steady: bool = False
    rebase: tuple[int, int] | None = None


class Place(str, enum.Enum):
    FREE = "free"            # no batch in it: computed wherever it is read
    PROLOGUE = "prologue"    # from the batch, whole: once per step by each stage needing it
    MICRO = "micro"          # once per microbatch
    POST = "post"            # once per step, after every microbatch


@dataclasses.dataclass(frozen=True)
class Coupling:
    """An equation the gradients depend on that needs the whole batch at once.

    Attributes:
        what: why; primitive / source / path: the equation (user file:line, flat path);
        statistic: ``(primitive, source)`` of the reduction over the batch it reads, if any.
        estimable: each microbatch could use its own estimate instead (it reads sums or
            maxima over the batch: ``per_microbatch_statistics``); not where it pairs the
            examples of the batch with each other (a whole-batch softmax's ``z @ z.T``).
        pairable: it pairs the examples (two factors of the batch) in a way the pairs of
            ``per_microbatch_statistics`` could compute (found without that option).
    """

    what: str
    primitive: str
    source: str | None
    path: tuple[int, ...]
    statistic: tuple[str, str | None] | None = None
    estimable: bool = True
    pairable: bool = False

    def describe(self) -> str:
        at = f"{self.primitive} at {self.source or 'an unknown line'}"
        made = (f" (the statistic is a {self.statistic[0]} over the batch at "
                f"{self.statistic[1] or 'an unknown line'})" if self.statistic else "")
        return f"{self.what}: {at}{made}"

    @property
    def on_callback(self) -> bool:
        """On a host callback (``microbatch._effect``, or a ``pure_callback`` read per
        example)."""
        from rhino.jaxpr import primitives as prims

        return self.primitive in prims.CALLBACKS or self.what.startswith("a host effect")


@dataclasses.dataclass(frozen=True, eq=False)
class MicrobatchLayout:
    """The result of ``analyze`` (plain data over the flat program's refs and equations).

    Attributes:
        num_microbatches: ``m``.
        layout: ref -> its ``Layout`` (arguments and equation results).
        place: per flat equation, its ``Place``.
        uses: ``(equation index, operand index) -> Use`` where an operand is not read as
            it was made.
        params: equation index -> bind parameters of a per-microbatch equation whose
            result shapes they name (rewritten to microbatch shapes).
        mb_shapes: ref -> the microbatch shape of a split value.
        data: refs computed from the batch alone (no training state).
        wholes: data refs some equation reads whole (the prologue computes them).
        batch_dependent: refs that depend on a batch argument.
        couplings: equations the gradients depend on that need the whole batch.
        local: equations reading a partial value as a per-microbatch estimate.
        bodies: equation index -> how a per-microbatch equation holding bodies (control
            flow, a custom call's body) runs them per microbatch (``rhino.jaxpr.bodies``).
    """

    num_microbatches: int
    layout: Mapping[int, Layout]
    place: tuple[Place, ...]
    uses: Mapping[tuple[int, int], Use]
    params: Mapping[int, dict]
    mb_shapes: Mapping[int, tuple[int, ...]]
    data: frozenset[int]
    wholes: frozenset[int]
    batch_dependent: frozenset[int]
    couplings: tuple[Coupling, ...] = ()
    local: frozenset[int] = frozenset()
    bodies: Mapping[int, Any] = dataclasses.field(default_factory=dict)

    def use(self, eqn: int, operand: int) -> Use | None:
        return self.uses.get((eqn, operand))

    def split_dims(self) -> dict[int, int]:
        """ref -> the dimension of a split value (what a microbatch divides)."""
        return {r: lay.axis for r, lay in self.layout.items() if lay.kind == "split"}

    def cut_dims(self) -> dict[int, tuple[int, ...]]:
        """ref -> every dimension a microbatch divides of a split value (two for a value
        over pairs of the batch)."""
        return {r: lay.dims for r, lay in self.layout.items() if lay.kind == "split"}


@dataclasses.dataclass
class Outcome:
    """What a rule (``mb_rules``, ``bodies``) says of one equation: its results' layouts,
    how it reads its operands, the parameters it is bound with per microbatch, or the
    operands whose totals it needs (and why)."""

    outs: list[Layout]
    uses: dict[int, Use]
    params: dict | None = None
    needs_total: tuple[int, ...] = ()      # operands whose total it needs
    reason: str = ""
    block_sum: bool = False                # sums over a dimension of pairs (in its block)
    pairable: bool = False                 # pairs the examples (two factors of the batch)
    nested: Any = None                     # how its bodies run per microbatch (bodies.py)


class MicrobatchError(RhinoError, ValueError):
    """A step this pass cannot make per-microbatch programs of."""
