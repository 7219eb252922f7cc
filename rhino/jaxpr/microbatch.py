"""Microbatches as a sharding of the batch over time.

A pipelined step runs its per-example work once per microbatch: it is the whole-batch step
whose batch dimension is split into ``m`` equal contiguous chunks that take turns, as a
mesh axis of size ``m`` would split it across devices. This pass decides, on the step
traced at the *whole* batch (the program the planner saw), how every value is computed so
that the pipelined step computes what the step computes:

==========  ======================================================================  =========
layout      the value                                                                place
==========  ======================================================================  =========
whole       one value per step, before any microbatch: constants, state, keys,       free /
            and values computed from the batch alone where they are needed whole     prologue
            (a mask's sum, ``arange(n) / n``, random bits of the batch's shape)
split(d)    per microbatch, its chunk along dimension ``d`` (the batch, and what is  micro
            computed per example from it)
partial     per microbatch, a term; the value is the sum (max, min) of the terms    micro
            (a loss summed over the batch, a weight gradient ``xᵀ·dy``)
total       one value per step, after every microbatch: computed from the sums of   post
            partial values and the concatenations of split ones (the optimizer
            update, a metric of the mean loss)
==========  ======================================================================  =========

Each equation's operands and results are related by *factors* (as a sharding rule relates
them): a factor is a set of operand and result dimensions that are sliced together (a
``dot_general``'s batch dimensions, an elementwise op's dimension ``d``), and a *reduction*
factor has no result dimension (a contracting dimension: splitting it makes the result a
partial sum). A split operand makes every member of its factor split: a whole operand in
that factor is read as its microbatch's slice (``Use.slice``), a result takes the split,
or becomes a partial sum. A partial value passes unreduced only through an equation linear
in it (a sum of terms, a product with a whole value, a reshape). Anywhere else the
equation needs the total: for a value computed from the batch alone (``data``), the
prologue computes it whole instead (``Use.whole``: ``sum(mask)`` as a normaliser);
otherwise the equation is computed once per step after the microbatches (``total``,
reading sums and concatenations: exact, not pipelined). A total that the gradients depend
on is a *coupling* (BatchNorm's statistics, a whole-batch softmax): the pipeline cannot run
it per microbatch and the step is refused, naming the equation and the statistic's
source line, unless ``per_microbatch_statistics`` accepts that each microbatch uses its own
estimate (its partial sum times ``m``: for a mean over the batch, the microbatch's mean).

*Pairs* (``per_microbatch_statistics`` only). An equation whose per-example operands meet
along two factors (``z @ z.T``: every example against every example) is computed by each
microbatch on its own examples against its own examples, the diagonal block, which is what
the step computes on that microbatch alone: its result is ``split(a,b)``, cut along both
dimensions by the same microbatch index. Later equations keep it consistent (``_pairs``):
elementwise with values of the same block; a sum, maximum or minimum over one dimension of
pairs reduces within the block (the result is split along the other, no partial value);
a whole constant is read as its diagonal block only where every block is alike (a
comparison of iotas such as ``eye`` or ``tril``, a broadcast of a scalar: ``pairs.PairFacts``); a
per-example value along its other dimension only where it is constant along it. Refused,
naming the line: index values (positions of the whole batch, outside the block), a
reshape merging a dimension of pairs, a contraction of pairs with a whole value, a mean
over a dimension of pairs (a sum over it scaled by a constant or a count of the batch: it
counts the whole batch's pairs), a sum over pairs used as a statistic, and a value over
pairs read once per step or returned. ``jnp.diagonal``'s platform-dependent branches are
read as its mask-and-reduce one (``interpret.flatten(platform_branches=True)``).

Nothing here depends on tracing at microbatch shapes: per-microbatch equations are bound
with the shape parameters of their results rewritten (``MicrobatchLayout.params``), and
the stage programs check every result's shape against ``mb_avals``.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from rhino.jaxpr.interpret import flatten
    >>> def loss(w, x, mask):   # token-weighted mean: sum(l * mask) / sum(mask)
    ...     l = jnp.sum((x @ w) ** 2, axis=1)
    ...     return jnp.sum(l * mask) / jnp.sum(mask)
    >>> flat = flatten(jax.make_jaxpr(loss)(jnp.ones((3, 2)), jnp.ones((8, 3)), jnp.ones(8)))
    >>> lay = analyze(flat, batch_refs=(1, 2), num_microbatches=4)
    >>> [str(lay.layout[r]) for r in flat.outs], sorted(lay.wholes) != []
    (['partial(sum)'], True)
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from rhino.jaxpr import primitives as prims
from rhino.jaxpr.factors import ORDER_PRESERVING, factors, linear_groups, operand_shape
from rhino.jaxpr.interpret import FlatProgram, Lit
from rhino.jaxpr.pairs import PAIR_OPS, PairFacts
from rhino.jaxpr.private import eqn_source, name_stack_text


# ------------------------------------------------------------------------------ data
@dataclasses.dataclass(frozen=True)
class Layout:
    """How a value is computed over the microbatches (see the module docstring)."""

    kind: str                  # whole | split | partial | total | local
    axis: int | None = None    # split: the dimension cut into microbatches
    op: str | None = None      # partial: sum | max | min
    pair: int | None = None    # split: a second dimension cut by the same microbatch index

    def __str__(self) -> str:
        cut = f"{self.axis}" if self.pair is None else f"{self.axis},{self.pair}"
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


def split(axis: int, pair: int | None = None) -> Layout:
    if pair is None:
        return Layout("split", axis=int(axis))
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
    total (``m`` times its term; ``per_microbatch_statistics`` only)."""

    kind: str
    axis: int | None = None
    pair: int | None = None


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
        """On a host callback (``_effect``, or a ``pure_callback`` read per example)."""
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

    def use(self, eqn: int, operand: int) -> Use | None:
        return self.uses.get((eqn, operand))

    def split_dims(self) -> dict[int, int]:
        """ref -> the dimension of a split value (what a microbatch divides)."""
        return {r: lay.axis for r, lay in self.layout.items() if lay.kind == "split"}

    def cut_dims(self) -> dict[int, tuple[int, ...]]:
        """ref -> every dimension a microbatch divides of a split value (two for a value
        over pairs of the batch)."""
        return {r: lay.dims for r, lay in self.layout.items() if lay.kind == "split"}


# ------------------------------------------------------------------------------ analysis
@dataclasses.dataclass
class _Outcome:
    outs: list[Layout]
    uses: dict[int, Use]
    params: dict | None = None
    needs_total: tuple[int, ...] = ()      # operands whose total it needs
    reason: str = ""
    block_sum: bool = False                # sums over a dimension of pairs (in its block)
    pairable: bool = False                 # pairs the examples (two factors of the batch)


def analyze(flat: FlatProgram, batch_refs: Sequence[int], num_microbatches: int, *,
            state_refs: Collection[int] | None = None, post: Collection[int] = (),
            feeds_gradient: Collection[int] | None = None,
            per_microbatch_statistics: bool = False,
            per_microbatch: Collection[int] | None = None,
            batch_free_scope: str | None = None) -> MicrobatchLayout:
    """How every value of ``flat`` is computed over ``num_microbatches`` microbatches.

    Args:
        flat: the step flattened at the whole batch (``interpret.flatten``).
        batch_refs: flat arguments split into microbatches along their dimension 0.
        num_microbatches: ``m``.
        state_refs: flat arguments that are training state (default: every argument not in
            ``batch_refs``); values computed without them are ``data``.
        post: equation indices computed once per step after the microbatches whatever they
            read (apply-gradients).
        feeds_gradient: equation indices the gradients depend on (a total among them is a
            ``Coupling``); None: none is.
        per_microbatch_statistics: an equation of ``per_microbatch`` (default: every
            equation not in ``post``) that needs a total reads partial values as each
            microbatch's own estimate instead (``Use.local``); what it makes is averaged
            over the microbatches where it is read once per step (``Use.mean``).
        batch_free_scope: equations whose name stack holds this scope give the same result
            on any part of the batch (an unrolled scan's iteration index, computed from the
            carry only to order its reads): they read partial values as their microbatch's
            own, and are no coupling.
    """
    m = int(num_microbatches)
    avals = flat.avals
    batch = set(batch_refs)
    state = set(range(flat.num_args)) - batch if state_refs is None else set(state_refs)
    layout: dict[int, Layout] = {}
    for r in range(flat.num_args):
        layout[r] = split(0) if r in batch else WHOLE
    for r in flat.consts:
        layout[r] = WHOLE
    dep_batch: set[int] = set(batch)
    dep_state: set[int] = set(state)
    zero: set[int] = set()
    producer: dict[int, int] = {}
    place: list[Place] = []
    uses: dict[tuple[int, int], Use] = {}
    params: dict[int, dict] = {}
    mb_shapes: dict[int, tuple[int, ...]] = {r: (avals[r].shape[0] // m,) +
                                             tuple(avals[r].shape[1:]) for r in batch}
    wholes: set[int] = set()
    couplings: list[Coupling] = []
    local_eqns: set[int] = set()
    post = set(post)
    feeds = set(feeds_gradient or ())
    own = None if per_microbatch is None else set(per_microbatch)
    facts = PairFacts(avals)
    steady = facts.steady

    def is_data(x: Any) -> bool:
        return isinstance(x, int) and x not in dep_state

    def lay(x: Any) -> Layout:
        return WHOLE if isinstance(x, Lit) else layout[x]

    for i, fe in enumerate(flat.eqns):
        refs = [x for x in fe.ins if isinstance(x, int)]
        bdep = any(r in dep_batch for r in refs)
        sdep = any(r in dep_state for r in refs)
        outs_shapes = [tuple(v.aval.shape) for v in fe.eqn.outvars]
        ins_shapes = [operand_shape(x, avals) for x in fe.ins]
        ins = [lay(x) for x in fe.ins]
        kinds = {x.kind for x in ins}
        pairs = per_microbatch_statistics and (own is None or i in own)
        why = ""
        if i in post or "total" in kinds:
            got = _total(fe, ins)
        elif prims.is_effect(fe.eqn) and any(x.per_microbatch for x in ins):
            got = _effect(flat, fe, ins, i in feeds, couplings)
        elif kinds <= {"whole"}:
            got = _Outcome([WHOLE] * len(fe.outs), {})
            if bdep and sdep and prims.name(fe.eqn) in (prims.DOT, prims.CONV):
                # Training state applied to the whole batch in one piece (its batch
                # dimension was lost, e.g. to a concatenation along the batch): not made
                # per step in a prologue.
                got = _Outcome([], {}, needs_total=(), reason=(
                    "a weight applied to the whole batch at once (a value whose batch "
                    "dimension the microbatches do not follow)"))
                if i in feeds:
                    couplings.append(Coupling(got.reason, prims.name(fe.eqn),
                                              flat.source(fe), fe.path, None, False))
                got = _total(fe, ins)
        else:
            got = _micro(fe, ins, ins_shapes, outs_shapes, m, zero, is_data, pairs, steady)
            if got.needs_total:
                data_ops = [j for j in got.needs_total if is_data(fe.ins[j])]
                if data_ops:
                    # Computed from the batch alone: read whole, from the prologue.
                    ins2 = list(ins)
                    for j in data_ops:
                        ins2[j] = WHOLE
                    got2 = (_Outcome([WHOLE] * len(fe.outs), {}) if all(
                        x.kind == "whole" for x in ins2) else
                        _micro(fe, ins2, ins_shapes, outs_shapes, m, zero, is_data, pairs,
                               steady))
                    if not got2.needs_total and not (pairs and any(
                            j in got2.uses for j in data_ops)):
                        # (a value of the batch alone read whole cannot also be read as
                        # its block: what it addresses is the whole batch's positions)
                        for j in data_ops:
                            got2.uses[j] = Use("whole")
                            wholes.add(fe.ins[j])
                        got = got2
                scoped = batch_free_scope is not None and \
                    batch_free_scope in name_stack_text(fe.eqn)
                localized = scoped or (per_microbatch_statistics and
                                       (own is None or i in own))
                if got.needs_total and (i in feeds or localized):
                    stat = _statistic(flat, fe, got, ins, producer)
                    over_pairs = facts.summed_pairs([fe.ins[j] for j in got.needs_total])
                    if over_pairs:
                        got.reason = ("a sum over pairs of the batch's examples used as a "
                                      "statistic (a microbatch's estimate of it would count "
                                      "its own pairs m times)")
                    if localized and not over_pairs and all(
                            ins[j].kind == "partial" for j in got.needs_total):
                        ins3 = list(ins)
                        for j in got.needs_total:
                            ins3[j] = LOCAL
                        got3 = _micro(fe, ins3, ins_shapes, outs_shapes, m, zero, is_data,
                                      pairs, steady)
                        if not got3.needs_total:
                            for j in got.needs_total:
                                u = got3.uses.get(j)
                                got3.uses[j] = Use("local", u.axis if u is not None else None)
                            if not scoped:
                                local_eqns.add(i)
                            got = got3
                    if got.needs_total and i in feeds:
                        couplings.append(Coupling(
                            got.reason, prims.name(fe.eqn), flat.source(fe), fe.path, stat,
                            not over_pairs and all(ins[j].kind == "partial"
                                                   for j in got.needs_total),
                            got.pairable))
                if got.needs_total:
                    why = got.reason
                    got = _total(fe, ins)
        paired = [x for x in fe.ins if isinstance(x, int) and layout[x].pair is not None]
        if paired and any(x.kind == "total" for x in got.outs) and not (
                couplings and couplings[-1].path == fe.path):
            couplings.append(Coupling(
                why or "a value over pairs of the batch's examples read once per step (each "
                "microbatch holds only its own pairs)", prims.name(fe.eqn), flat.source(fe),
                fe.path, None, False))
        name = prims.name(fe.eqn)
        if facts.mean_over_pairs(fe, dep_state):
            couplings.append(Coupling(
                "a sum over pairs of the batch's examples scaled by a constant (a mean over "
                "pairs counts the whole batch's; each microbatch holds only its own)",
                name, flat.source(fe), fe.path, None, False))
        facts.update(fe, ins_shapes, outs_shapes, got.block_sum, not bdep and not sdep)
        for j, u in got.uses.items():
            uses[(i, j)] = u
        if got.params is not None:
            params[i] = got.params
        kinds_out = {x.kind for x in got.outs}
        if kinds_out <= {"whole"}:
            whole_reads = any(u.kind == "whole" for u in got.uses.values())
            place.append(Place.PROLOGUE if bdep or whole_reads else Place.FREE)
        elif "total" in kinds_out:
            place.append(Place.POST)
        else:
            place.append(Place.MICRO)
        for k, r in enumerate(fe.outs):
            if r is None:
                continue
            layout[r] = got.outs[k]
            producer[r] = i
            if bdep:
                dep_batch.add(r)
            if sdep:
                dep_state.add(r)
            if got.outs[k].kind == "split":
                shape = list(avals[r].shape)
                for d in got.outs[k].dims:
                    shape[d] //= m
                mb_shapes[r] = tuple(shape)
        if _makes_zero(fe, zero):
            zero.update(r for r in fe.outs if r is not None)
    for x in flat.outs:
        if isinstance(x, int) and layout[x].pair is not None and x in producer:
            fe = flat.eqns[producer[x]]
            couplings.append(Coupling(
                "a value over pairs of the batch's examples returned by the step (each "
                "microbatch holds only its own pairs)", prims.name(fe.eqn), flat.source(fe),
                fe.path, None, False))
    wholes = _close_wholes(flat, wholes, producer, dep_state)
    return MicrobatchLayout(m, layout, tuple(place), uses, params, mb_shapes,
                            frozenset(r for r in layout if r not in dep_state),
                            frozenset(wholes), frozenset(dep_batch), tuple(couplings),
                            frozenset(local_eqns))


def _makes_zero(fe: Any, zero: set[int]) -> bool:
    """Results that are zeros: a broadcast or conversion of a literal 0 or of zeros."""
    name = prims.name(fe.eqn)
    if name not in (prims.BROADCAST, prims.CONVERT, "copy") or len(fe.ins) != 1:
        return False
    x = fe.ins[0]
    if isinstance(x, Lit):
        return bool(np.all(np.asarray(x.value) == 0))
    return x in zero


def _total(fe: Any, ins: list[Layout]) -> _Outcome:
    """Computed once per step after the microbatches: partial operands summed, split ones
    put together."""
    uses = {}
    for j, x in enumerate(ins):
        if x.kind == "partial":
            uses[j] = Use("total")
        elif x.kind == "split":
            uses[j] = Use("concat", x.axis)
        elif x.kind == "local":
            uses[j] = Use("mean")             # each microbatch's own: their average
    return _Outcome([TOTAL] * len(fe.outs), uses)


def _effect(flat: FlatProgram, fe: Any, ins: list[Layout], feeds_gradient: bool,
            couplings: list[Coupling]) -> _Outcome:
    """A host effect (a debug or io callback) reading per-microbatch values: run once per
    step, as under ``jax.jit``, on their totals and concatenations (``_total``). One whose
    results the gradients need (it would have to run per microbatch), or that reads values
    over pairs of the batch (no microbatch holds them all), is a coupling."""
    pairs = any(x.pair is not None for x in ins)
    if feeds_gradient or pairs:
        inner = [s for s in prims.callback_sites(fe.eqn) if s is not fe.eqn][:1]
        held = "".join(f" (it holds {prims.name(s)} at {eqn_source(s) or 'an unknown line'})"
                       for s in inner)
        couplings.append(Coupling(
            f"a host effect{held} reads " + (
                "values over pairs of the batch's examples (each microbatch holds only its "
                "own pairs)" if pairs else "per-example values and the gradients need its "
                "results (jax.jit runs it once per step on the whole batch; a pipeline "
                "would run it once per microbatch)"),
            prims.name(fe.eqn), flat.source(fe), fe.path, None, False))
    return _total(fe, ins)


def _statistic(flat: FlatProgram, fe: Any, got: _Outcome, ins: list[Layout],
               producer: Mapping[int, int]) -> tuple[str, str | None] | None:
    """Where the partial value an equation needs the total of was reduced over the batch:
    the first reduction found walking back through partial values."""
    for j in got.needs_total:
        x = fe.ins[j]
        seen = set()
        while isinstance(x, int) and x in producer and x not in seen:
            seen.add(x)
            e = flat.eqns[producer[x]]
            back = [y for y in e.ins if isinstance(y, int) and y in producer
                    and y not in seen]
            name = prims.name(e.eqn)
            if name in prims.REDUCTIONS or name == prims.DOT or name in prims.SCATTER_ADD \
                    or name == prims.CONV:
                return name, flat.source(e)
            x = back[0] if back else None
    return None


def _micro(fe: Any, ins: list[Layout], ins_shapes: list[tuple], outs_shapes: list[tuple],
           m: int, zero: set[int], is_data: Callable[[Any], bool], pairs: bool = False,
           spread: Callable[[Any], Collection[int]] = lambda x: ()) -> _Outcome:
    """An equation with a per-microbatch operand: its results' layouts and how it reads
    its operands, or the operands whose totals it needs. ``pairs``: an equation pairing
    the examples of the batch is computed per microbatch on its own pairs (``_pairs``);
    ``spread(x)``: the dimensions operand ``x`` is constant along (a broadcast's)."""
    n_out = len(fe.outs)
    partials = [j for j, x in enumerate(ins) if x.kind == "partial"]
    splits = [j for j, x in enumerate(ins) if x.kind == "split"]
    name = prims.name(fe.eqn)
    if name in prims.IDENTITY_LIKE and len(fe.ins) == n_out:    # values passed on as they are
        return _Outcome(list(ins), {})
    if partials:
        if splits:
            return _Outcome([], {}, needs_total=tuple(partials),
                            reason="a statistic over the batch combined with per-example "
                                   "values")
        ops = {ins[j].op for j in partials}
        if ops != {"sum"}:
            if len(ops) == 1 and name in ORDER_PRESERVING and len(fe.ins) == 1:
                return _Outcome([ins[0]] * n_out, {})
            return _Outcome([], {}, needs_total=tuple(partials),
                            reason="a maximum or minimum over the batch used further")
        pset = set(partials)
        for g in linear_groups(fe.eqn, fe.ins):
            if pset <= g and all(j in pset or _is_zero(fe.ins[j], zero) for j in g) and \
                    not any(ins[j].kind == "local" for j in g):
                return _Outcome([partial("sum")] * n_out, {})
        return _Outcome([], {}, needs_total=tuple(partials),
                        reason="a sum over the batch used non-linearly")
    rules = factors(fe.eqn, ins_shapes, outs_shapes)
    if not splits:                                   # local (and whole) operands only
        return _Outcome([LOCAL] * n_out, {})
    if rules is None:
        return _unsupported(fe, ins, splits, f"a per-example value enters {name}, which "
                                             f"cannot be cut into microbatches")
    hit: list | None = []
    for j in splits:
        for d in ins[j].dims:
            fa = next((fa for fa in rules if (j, d) in fa[0]), None)
            if fa is None:
                hit = None
                break
            if fa not in hit:
                hit.append(fa)
        if hit is None:
            break
    over_pairs = any(ins[j].pair is not None for j in splits)
    if pairs and (over_pairs or (hit is not None and len(hit) == 2)):
        return _pairs(fe, ins, ins_shapes, outs_shapes, m, hit or [], spread)
    if any(ins[j].pair is not None for j in splits):
        return _unsupported(fe, ins, splits, f"{name} mixes the examples of the batch "
                                             f"(over pairs of them)")
    first = splits[0]
    f = next((fa for fa in rules if (first, ins[first].axis) in fa[0]), None)
    if f is None or not all((j, ins[j].axis) in f[0] for j in splits):
        got = _unsupported(fe, ins, splits, f"{name} mixes the examples of the batch "
                                            f"(along the dimension split into microbatches)")
        got.pairable = hit is not None and len(hit) == 2 and name in PAIR_OPS
        return got
    members, reduce = f
    size = ins_shapes[first][ins[first].axis]
    uses: dict[int, Use] = {}
    for slot, d in members:
        if slot < 0 or ins[slot].kind == "split":
            continue
        if ins_shapes[slot][d] != size:
            return _unsupported(fe, ins, splits, f"{name} reads a value along the batch "
                                                 f"at another size")
        uses[slot] = Use("slice", d)          # a local value: its own chunk too
    res = {-1 - slot: d for slot, d in members if slot < 0}
    if reduce in ("sum", "max", "min") and not res:
        if reduce == "sum" and prims.name(fe.eqn) in prims.SCATTER_ADD and \
                not _is_zero(fe.ins[0], zero) and ins[0].kind != "partial":
            return _unsupported(fe, ins, splits, "examples scattered into a value that is "
                                                 "not zeros")
        return _Outcome([partial(reduce)] * n_out, uses)
    if reduce == "whole" or not res:
        return _unsupported(fe, ins, splits, f"{name} reduces over the batch")
    if len(res) != n_out:
        return _unsupported(fe, ins, splits, f"{name} gives results not cut with the batch")
    outs: list[Layout] = []
    for k in range(n_out):
        if outs_shapes[k][res[k]] % m:
            return _unsupported(fe, ins, splits, f"{name}'s result dimension "
                                                 f"{outs_shapes[k][res[k]]} is not divisible "
                                                 f"by {m} microbatches")
        outs.append(split(res[k]))
    return _Outcome(outs, uses, _rewrite(fe.eqn, ins, ins_shapes, outs_shapes, res, m))


def _pairs(fe: Any, ins: list[Layout], ins_shapes: list[tuple], outs_shapes: list[tuple],
           m: int, hit: list, spread: Callable[[Any], Collection[int]]) -> _Outcome:
    """An equation whose per-example operands meet along two factors (``per_microbatch_
    statistics``): ``z @ z.T`` pairs every example with every example. Each microbatch
    computes the diagonal block (its examples against its own examples), what the step
    computes on that microbatch alone: a result keeping both factors is split along both
    dimensions by the same microbatch index; one reduced by a sum, maximum or minimum
    within the block is split along the other (no partial value: no other microbatch
    holds a term of it); both reduced, a partial value. A whole operand is read as its
    diagonal block (iota comparisons are the same on every block), a per-example operand
    along its other dimension only where it is constant along it (a broadcast). Anything
    else is unsupported (named): index values (global positions of the batch), a reshape
    merging a dimension of pairs, a contraction of pairs with a value of the whole batch's
    positions, an operand of another size."""
    name = prims.name(fe.eqn)
    splits = [j for j, x in enumerate(ins) if x.kind == "split"]
    if name in prims.INDEXING:
        return _unsupported(fe, ins, splits, f"{name} addresses values over pairs of the "
                                             f"batch's examples by index values (positions "
                                             f"of the whole batch, outside a microbatch's "
                                             f"own pairs)")
    if name not in PAIR_OPS:
        return _unsupported(fe, ins, splits, f"{name} on values over pairs of the batch's "
                                             f"examples (it addresses positions of the "
                                             f"whole batch)")
    if len(hit) != 2:
        return _unsupported(fe, ins, splits, f"{name} mixes the examples of the batch "
                                             f"(over pairs of them)")
    cut: dict[int, list[int]] = {}
    kept: list[dict[int, int]] = []
    reduced: list[str | None] = []
    for members, reduce in hit:
        slots = [(s, d) for s, d in members if s >= 0]
        size = next(ins_shapes[s][d] for s, d in slots
                    if ins[s].kind == "split" and d in ins[s].dims)
        for s, d in slots:
            x = ins[s]
            if ins_shapes[s][d] != size:
                return _unsupported(fe, ins, splits, f"{name} reads a value along the batch "
                                                     f"at another size")
            if x.kind == "split" and d in x.dims:
                continue
            if reduce is not None and x.kind == "whole":
                return _unsupported(fe, ins, splits, f"{name} contracts pairs of the batch's "
                                                     f"examples with a value over the whole "
                                                     f"batch's positions")
            if x.kind == "whole" or (x.kind == "split" and d in spread(fe.ins[s])):
                cut.setdefault(s, []).append(d)
                continue
            return _unsupported(fe, ins, splits, f"{name} reads a per-example value along "
                                                 f"the positions of the batch against pairs "
                                                 f"of its examples (a microbatch holds only "
                                                 f"its own pairs)")
        res = {-1 - s: d for s, d in members if s < 0}
        if res:
            kept.append(res)
        else:
            reduced.append(reduce)
    uses = {s: Use("slice", d[0], d[1] if len(d) > 1 else None) for s, d in cut.items()}
    n_out = len(fe.outs)
    if any(len(r) != n_out for r in kept):
        return _unsupported(fe, ins, splits, f"{name} gives results not cut with the batch")
    if any(op not in ("sum", "max", "min") for op in reduced) or len(set(reduced)) > 1:
        return _unsupported(fe, ins, splits, f"{name} reduces over pairs of the batch")
    block_sum = name in prims.REDUCTIONS and reduced == ["sum"]
    if not kept:
        return _Outcome([partial(reduced[0])] * n_out, uses, block_sum=block_sum)
    dims = [tuple(r[k] for r in kept) for k in range(n_out)]
    for k, ds in enumerate(dims):
        if any(outs_shapes[k][d] % m for d in ds):
            return _unsupported(fe, ins, splits, f"{name}'s result {outs_shapes[k]} is not "
                                                 f"divisible by {m} microbatches")
    params = None
    key = _SHAPE_PARAMS.get(name)
    if key is not None:
        from rhino.jaxpr.private import bind_params

        params = bind_params(fe.eqn)
        sizes = list(params[key])
        for d in dims[0]:
            sizes[d] //= m
        params[key] = tuple(sizes)
    return _Outcome([split(*ds) for ds in dims], uses, params, block_sum=block_sum)


def _unsupported(fe: Any, ins: list[Layout], splits: list[int], reason: str) -> _Outcome:
    return _Outcome([], {}, needs_total=tuple(splits), reason=reason)


def _is_zero(x: Any, zero: set[int]) -> bool:
    if isinstance(x, Lit):
        return bool(np.all(np.asarray(x.value) == 0))
    return x in zero


# Primitives whose named parameter lists their result's sizes (a dynamic slice's and a
# slice's along dimensions kept whole: the split one runs to its end).
_SHAPE_PARAMS = {prims.BROADCAST: "shape", prims.RESHAPE: "new_sizes",
                 prims.DYNAMIC_SLICE: "slice_sizes", prims.SLICE: "limit_indices"}


def _rewrite(eqn: Any, ins: list[Layout], ins_shapes: list[tuple], outs_shapes: list[tuple],
             res: Mapping[int, int], m: int) -> dict | None:
    """Bind parameters of ``eqn`` at microbatch shapes, where they name a result shape
    (None: its own parameters fit)."""
    from rhino.jaxpr.private import bind_params

    name = prims.name(eqn)
    params = bind_params(eqn)
    key = _SHAPE_PARAMS.get(name)
    if key is not None:          # the parameter lists the result's sizes: cut the split one
        sizes = list(params[key])
        sizes[res[0]] //= m
        params[key] = tuple(sizes)
        return params
    split_in = next((j, x.axis) for j, x in enumerate(ins) if x.kind == "split")
    if name == prims.GATHER:
        j, d = split_in
        if j == 0 and d not in (getattr(params["dimension_numbers"], "operand_batching_dims",
                                        ()) or ()):
            sizes = list(params["slice_sizes"])
            sizes[d] //= m
            params["slice_sizes"] = tuple(sizes)
            return params
        return None
    return None


def _close_wholes(flat: FlatProgram, wholes: set[int], producer: Mapping[int, int],
                  dep_state: set[int]) -> set[int]:
    """The data values read whole (every one is computed by the prologue)."""
    return {r for r in wholes if r not in dep_state}


def prologue_equations(flat: FlatProgram, layout: MicrobatchLayout, refs: Collection[int]
                       ) -> list[int]:
    """Equation indices (in program order) that compute ``refs`` whole, from the whole
    batch arguments: every equation they depend on, bound at its own shapes."""
    return sorted(ancestors(flat, refs))


class MicrobatchError(ValueError):
    """A step this pass cannot make per-microbatch programs of."""


def ancestors(flat: FlatProgram, refs: Collection[int]) -> set[int]:
    """Indices of the equations ``refs`` depend on."""
    producer = {r: i for i, fe in enumerate(flat.eqns) for r in fe.outs if r is not None}
    out: set[int] = set()
    stack = [r for r in refs if isinstance(r, int) and r in producer]
    while stack:
        e = producer[stack.pop()]
        if e in out:
            continue
        out.add(e)
        stack.extend(x for x in flat.eqns[e].ins if isinstance(x, int) and x in producer)
    return out
