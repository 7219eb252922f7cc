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

from typing import Any, Collection, Mapping, Sequence

import numpy as np

from rhino.jaxpr import primitives as prims
from rhino.jaxpr.factors import operand_shape
from rhino.jaxpr.interpret import FlatProgram, Lit
from rhino.jaxpr.layouts import (LOCAL, TOTAL, WHOLE, Coupling, Layout, MicrobatchError,
                                 MicrobatchLayout, Place, Use, partial, split)
from rhino.jaxpr.mb_rules import Facts, Outcome, makes_zero, micro_rule, total_rule
from rhino.jaxpr.pairs import PairFacts
from rhino.jaxpr.private import eqn_source, name_stack_text

__all__ = ["Layout", "Use", "Place", "Coupling", "MicrobatchLayout", "MicrobatchError",
           "WHOLE", "TOTAL", "LOCAL", "split", "partial", "analyze", "ancestors",
           "prologue_equations"]


# ------------------------------------------------------------------------------ analysis
def analyze(flat: FlatProgram, batch_refs: Sequence[int], num_microbatches: int, *,
            state_refs: Collection[int] | None = None, post: Collection[int] = (),
            feeds_gradient: Collection[int] | None = None,
            per_microbatch_statistics: bool = False,
            per_microbatch: Collection[int] | None = None,
            batch_free_scope: str | None = None,
            arg_layouts: Mapping[int, Layout] | None = None,
            arg_zeros: Collection[int] = ()) -> MicrobatchLayout:
    """How every value of ``flat`` is computed over ``num_microbatches`` microbatches.

    A statistic of the batch that an equation uses non-linearly (a sum cast to a narrower
    type, a norm of a summed gradient) is first *deferred*: computed once per step after the
    microbatches on the sums, which is what the step computes. Only where such a value meets
    a per-example value that the gradients need is the step coupled (``Coupling``); under
    ``per_microbatch_statistics`` the analysis then runs again with each such statistic
    estimated per microbatch where it was first used non-linearly (``Use.local``), and
    repeats until no deferred statistic meets a per-example value.

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
        arg_layouts: the layouts of arguments other than the batch's ``split(0)`` and the
            rest's ``whole`` (a nested body's operands: ``rhino.jaxpr.bodies``); default:
            the batch arguments a loop takes in chunks split in groups
            (``batch_groups``).
        arg_zeros: arguments known to be zeros (a loop's carry on its first iteration).
    """
    if arg_layouts is None:
        arg_layouts = batch_groups(flat, batch_refs, num_microbatches)
    eager: set[int] = set()
    while True:
        lay, roots = _analyze(flat, batch_refs, num_microbatches, state_refs, post,
                              feeds_gradient, per_microbatch_statistics, per_microbatch,
                              batch_free_scope, arg_layouts or {}, set(arg_zeros), eager)
        if not per_microbatch_statistics or not roots - eager:
            return lay
        eager |= roots


def batch_groups(flat: FlatProgram, batch_refs: Sequence[int], m: int) -> dict[int, Layout]:
    """Batch arguments the step takes in ``k`` chunks (gradient accumulation written in the
    step: the batch reshaped to ``(k, n / k, ...)`` and indexed chunk by chunk, or sliced
    ``n / k`` examples at a time by a loop): split in ``k`` groups, so that each microbatch
    holds its part of every chunk and each chunk's computation runs per microbatch. One
    chunk size per argument, dividing into ``m`` parts; otherwise the argument keeps the
    contiguous ``split(0)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from rhino.jaxpr.interpret import flatten
        >>> def acc(w, x):      # two chunks of the batch, one after the other
        ...     xs = x.reshape(2, 4, 3)
        ...     return jnp.sum(jnp.tanh(xs[0] @ w)) + jnp.sum(jnp.tanh(xs[1] @ w))
        >>> flat = flatten(jax.make_jaxpr(acc)(jnp.ones((3, 3)), jnp.ones((8, 3))))
        >>> {r: str(x) for r, x in batch_groups(flat, [1], 4).items()}
        {1: 'split(0 in 2 groups)'}
    """
    out: dict[int, Layout] = {}
    for r in batch_refs:
        shape = tuple(flat.avals[r].shape)
        if not shape:
            continue
        ks = _chunk_counts(flat, r, shape[0])
        if len(ks) == 1:
            k = ks.pop()
            if 1 < k < shape[0] and shape[0] % k == 0 and (shape[0] // k) % m == 0:
                out[r] = split(0, group=k)
    return out


def _chunk_counts(flat: FlatProgram, ref: int, n: int) -> set[int]:
    """How many chunks of its dimension 0 (of size ``n``) the program takes ``ref`` in,
    looking through conversions, into reshapes indexed along their new first dimension,
    and into the bodies of control flow it enters."""
    from rhino.jaxpr.interpret import flatten

    readers: dict[int, list[tuple[int, int]]] = {}
    for i, fe in enumerate(flat.eqns):
        for j, x in enumerate(fe.ins):
            if isinstance(x, int):
                readers.setdefault(x, []).append((i, j))
    ks: set[int] = set()

    def indexed(x: int) -> bool:
        """Whether ``x`` is read one index of its dimension 0 at a time."""
        for i, j in readers.get(x, ()):
            fe = flat.eqns[i]
            name = prims.name(fe.eqn)
            shape = flat.avals[x].shape
            if name == prims.SLICE and j == 0:
                p = fe.eqn.params
                if p["limit_indices"][0] - p["start_indices"][0] < shape[0]:
                    return True
            if name in (prims.DYNAMIC_SLICE, prims.GATHER) and j == 0:
                return True
        return False

    def walk(x: int) -> None:
        for i, j in readers.get(x, ()):
            fe = flat.eqns[i]
            name = prims.name(fe.eqn)
            p = fe.eqn.params
            out = fe.outs[0] if fe.outs else None
            if name == prims.CONVERT and out is not None:
                walk(out)
            elif name == prims.RESHAPE and out is not None and j == 0:
                new = tuple(flat.avals[out].shape)
                old = tuple(flat.avals[x].shape)
                if len(new) == len(old) + 1 and new[0] * new[1] == n and \
                        new[2:] == old[1:] and indexed(out):
                    ks.add(new[0])
            elif name == prims.DYNAMIC_SLICE and j == 0:
                c = p["slice_sizes"][0]
                if c < n and n % c == 0:
                    ks.add(n // c)
            elif name == prims.SLICE and j == 0:
                lo, hi = p["start_indices"][0], p["limit_indices"][0]
                c = hi - lo
                if 0 < c < n and n % c == 0 and lo % c == 0:
                    ks.add(n // c)
            else:
                for closed, k in _body_args(fe.eqn, j):
                    body = flatten(closed)
                    ks.update(_chunk_counts(body, k, n))

    walk(ref)
    return ks


def _body_args(eqn: Any, j: int) -> list[tuple[Any, int]]:
    """The bodies of a control-flow equation that operand ``j`` enters, each with the
    argument it becomes there."""
    name = prims.name(eqn)
    p = eqn.params
    if name == prims.COND:
        return [(b, j - 1) for b in p["branches"]] if j > 0 else []
    if name == prims.WHILE:
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        out = []
        if j < nc:
            out.append((p["cond_jaxpr"], j))
        elif j < nc + nb:
            out.append((p["body_jaxpr"], j - nc))
        else:
            out += [(p["cond_jaxpr"], j - nb), (p["body_jaxpr"], j - nc)]
        return out
    if name == prims.SCAN:
        nc, nk, _ = prims.scan_info(eqn)[:3]
        return [(p["jaxpr"], j)] if j < nc + nk else []
    return []


class IndexFacts:
    """Index arrays computed from ``iota`` alone whose values are positions along one of
    their dimensions (``arange(n)``, broadcast, converted, with ``jnp``'s wrapping of
    negative indices), and index arrays whose last dimension lists coordinates some of
    which are such positions (``x[arange(n), labels]``'s ``concatenate``)."""

    def __init__(self, flat: FlatProgram):
        self.flat = flat
        self.pos: dict[int, int] = {}                 # ref -> the dimension it counts
        self.comps: dict[int, dict[int, int]] = {}    # ref -> {coordinate: dimension}
        self.producer: dict[int, Any] = {}

    def components(self, x: Any) -> Mapping[int, int]:
        return self.comps.get(x, {}) if isinstance(x, int) else {}

    def update(self, fe: Any) -> None:
        name = prims.name(fe.eqn)
        out = fe.outs[0] if len(fe.outs) == 1 else None
        if out is None:
            return
        self.producer[out] = fe
        ins = fe.ins
        first = ins[0] if ins else None
        p = fe.eqn.params
        pos = self.pos.get(first) if isinstance(first, int) else None
        if name == prims.IOTA:
            self.pos[out] = int(p["dimension"])
        elif name == prims.CONVERT and pos is not None:
            self.pos[out] = pos
        elif name == prims.BROADCAST and pos is not None:
            self.pos[out] = int(p["broadcast_dimensions"][pos])
        elif name == prims.RESHAPE and pos is not None and p.get("dimensions") is None:
            old = self.flat.avals[first].shape
            new = self.flat.avals[out].shape
            kept = [d for d, n in enumerate(new) if n != 1]
            if [n for n in old if n != 1] == [new[d] for d in kept] and old[pos] != 1:
                self.pos[out] = kept[[d for d, n in enumerate(old) if n != 1].index(pos)]
        elif name == prims.SELECT_N and len(ins) == 3 and isinstance(ins[1], int) and \
                ins[1] in self.pos and self._wraps(ins[0], ins[1], ins[2]):
            self.pos[out] = self.pos[ins[1]]
        elif name == prims.CONCATENATE:
            rank = len(self.flat.avals[out].shape)
            if int(p["dimension"]) != rank - 1:
                return
            comps, k = {}, 0
            for x in ins:
                if isinstance(x, int) and x in self.pos and self.pos[x] != rank - 1:
                    comps[k] = self.pos[x]
                k += self.flat.avals[x].shape[-1] if isinstance(x, int) else 1
            if comps:
                self.comps[out] = comps
        if out in self.pos and self.flat.avals[out].shape and \
                self.flat.avals[out].shape[-1] == 1 and self.pos[out] != \
                len(self.flat.avals[out].shape) - 1:
            self.comps[out] = {0: self.pos[out]}

    def _wraps(self, pred: Any, x: int, wrapped: Any) -> bool:
        """``select_n(x < 0, x, x + n)``: ``x`` itself for positions (never negative)."""
        a = self.producer.get(pred) if isinstance(pred, int) else None
        b = self.producer.get(wrapped) if isinstance(wrapped, int) else None
        return a is not None and b is not None and prims.name(a.eqn) == "lt" and \
            a.ins[0] == x and prims.name(b.eqn) == "add" and b.ins[0] == x


def _analyze(flat: FlatProgram, batch_refs: Sequence[int], num_microbatches: int,
             state_refs: Collection[int] | None, post: Collection[int],
             feeds_gradient: Collection[int] | None, per_microbatch_statistics: bool,
             per_microbatch: Collection[int] | None, batch_free_scope: str | None,
             arg_layouts: Mapping[int, Layout], arg_zeros: set[int], eager: Collection[int]
             ) -> tuple[MicrobatchLayout, set[int]]:
    """One pass of ``analyze``: ``eager`` are the equations that, needing the total of
    partial values, are estimated per microbatch (``per_microbatch_statistics``) or named
    as couplings rather than deferred. Returns the layout and the deferred equations
    whose totals meet per-example values the gradients need."""
    m = int(num_microbatches)
    avals = flat.avals
    batch = set(batch_refs)
    state = set(range(flat.num_args)) - batch if state_refs is None else set(state_refs)
    layout: dict[int, Layout] = {}
    for r in range(flat.num_args):
        layout[r] = arg_layouts.get(r) or (split(0) if r in batch else WHOLE)
    for r in flat.consts:
        layout[r] = WHOLE
    dep_batch: set[int] = set(batch) | {r for r, x in layout.items() if x.per_microbatch}
    dep_state: set[int] = set(state)
    zero: set[int] = set(arg_zeros)
    producer: dict[int, int] = {}
    place: list[Place] = []
    uses: dict[tuple[int, int], Use] = {}
    params: dict[int, dict] = {}
    nested: dict[int, Any] = {}
    mb_shapes: dict[int, tuple[int, ...]] = {
        r: tuple(n // m if d in layout[r].dims else n for d, n in enumerate(avals[r].shape))
        for r in range(flat.num_args) if layout[r].kind == "split"}
    wholes: set[int] = set()
    couplings: list[Coupling] = []
    local_eqns: set[int] = set()
    post = set(post)
    feeds = set(feeds_gradient or ())
    own = None if per_microbatch is None else set(per_microbatch)
    eager = set(eager)
    # Deferred statistics: ref -> the deferred equations its total comes from; per such
    # equation, the reduction over the batch it reads (for the coupling's message).
    roots_of: dict[int, frozenset[int]] = {}
    root_stat: dict[int, tuple[str, str | None] | None] = {}
    met: set[int] = set()
    facts = PairFacts(avals)
    steady = facts.steady

    def divisible(x: Any, k: int, depth: int = 0) -> bool:
        """Whether index operand ``x`` is a multiple of ``k``: a literal; a product with
        one (an offset ``i * chunk``); sums, conversions and selects of such (``jnp``'s
        wrapping of negative indices)."""
        if isinstance(x, Lit):
            return int(np.asarray(x.value)) % k == 0
        fe = flat.eqns[producer[x]] if x in producer else None
        if fe is None or depth > 8:
            return False
        name = prims.name(fe.eqn)
        if name == prims.MUL:
            return any(divisible(y, k, depth + 1) for y in fe.ins)
        if name in (prims.CONVERT, "add", "sub"):
            return all(divisible(y, k, depth + 1) for y in fe.ins)
        if name == prims.SELECT_N:
            return all(divisible(y, k, depth + 1) for y in fe.ins[1:])
        return False

    def is_data(x: Any) -> bool:
        return isinstance(x, int) and x not in dep_state

    def lay(x: Any) -> Layout:
        return WHOLE if isinstance(x, Lit) else layout[x]

    index = IndexFacts(flat)
    known = Facts(zero, is_data, steady, facts.spread_of, divisible, index.components, analyze)
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
        roots = frozenset().union(*(roots_of.get(x, ()) for x in fe.ins
                                    if isinstance(x, int)))
        if i in post or "total" in kinds:
            got = total_rule(fe, ins)
            if i in feeds and roots and any(x.kind == "split" for x in ins):
                # A deferred statistic of the whole batch meets per-example values the
                # gradients need: no microbatch has it before the last one.
                couplings.append(Coupling(
                    "a statistic over the batch combined with per-example values",
                    prims.name(fe.eqn), flat.source(fe), fe.path,
                    next((root_stat[r] for r in sorted(roots) if root_stat[r]), None),
                    all(root_stat.get(r) is not None for r in roots)))
                met |= roots
        elif prims.is_effect(fe.eqn) and any(x.per_microbatch for x in ins):
            got = _effect(flat, fe, ins, i in feeds, couplings)
        elif kinds <= {"whole"}:
            got = Outcome([WHOLE] * len(fe.outs), {})
            if bdep and sdep and prims.name(fe.eqn) in (prims.DOT, prims.CONV):
                # Training state applied to the whole batch in one piece (its batch
                # dimension was lost, e.g. to a concatenation along the batch): not made
                # per step in a prologue.
                got = Outcome([], {}, needs_total=(), reason=(
                    "a weight applied to the whole batch at once (a value whose batch "
                    "dimension the microbatches do not follow)"))
                if i in feeds:
                    couplings.append(Coupling(got.reason, prims.name(fe.eqn),
                                              flat.source(fe), fe.path, None, False))
                got = total_rule(fe, ins)
        else:
            got = micro_rule(fe, ins, ins_shapes, outs_shapes, m, known, pairs)
            if got.needs_total:
                data_ops = [j for j in got.needs_total if is_data(fe.ins[j])]
                if data_ops:
                    # Computed from the batch alone: read whole, from the prologue.
                    ins2 = list(ins)
                    for j in data_ops:
                        ins2[j] = WHOLE
                    got2 = (Outcome([WHOLE] * len(fe.outs), {}) if all(
                        x.kind == "whole" for x in ins2) else
                        micro_rule(fe, ins2, ins_shapes, outs_shapes, m, known, pairs))
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
                if got.needs_total and not scoped and i not in eager and \
                        not any(x.kind in ("split", "local") for x in ins) and \
                        all(ins[j].kind == "partial" for j in got.needs_total):
                    # Deferred: computed once per step on the sums (what the step
                    # computes); a coupling only where it meets per-example values.
                    root_stat[i] = _statistic(flat, fe, got, ins, producer)
                    roots = roots | {i}
                    got = total_rule(fe, ins)
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
                        got3 = micro_rule(fe, ins3, ins_shapes, outs_shapes, m, known, pairs)
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
                    got = total_rule(fe, ins)
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
        index.update(fe)
        for j, u in got.uses.items():
            uses[(i, j)] = u
        if got.params is not None:
            params[i] = got.params
        if got.nested is not None:
            nested[i] = got.nested
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
            if roots and got.outs[k].kind == "total":
                roots_of[r] = roots
            if bdep:
                dep_batch.add(r)
            if sdep:
                dep_state.add(r)
            if got.outs[k].kind == "split":
                shape = list(avals[r].shape)
                for d in got.outs[k].dims:
                    shape[d] //= m
                mb_shapes[r] = tuple(shape)
        if makes_zero(fe, zero):
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
                            frozenset(local_eqns), nested), met


def _effect(flat: FlatProgram, fe: Any, ins: list[Layout], feeds_gradient: bool,
            couplings: list[Coupling]) -> Outcome:
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
    return total_rule(fe, ins)


def _statistic(flat: FlatProgram, fe: Any, got: Outcome, ins: list[Layout],
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


def _close_wholes(flat: FlatProgram, wholes: set[int], producer: Mapping[int, int],
                  dep_state: set[int]) -> set[int]:
    """The data values read whole (every one is computed by the prologue)."""
    return {r for r in wholes if r not in dep_state}


def prologue_equations(flat: FlatProgram, layout: MicrobatchLayout, refs: Collection[int]
                       ) -> list[int]:
    """Equation indices (in program order) that compute ``refs`` whole, from the whole
    batch arguments: every equation they depend on, bound at its own shapes."""
    return sorted(ancestors(flat, refs))


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
