"""The gradient boundary: split a training step into compute-gradients and apply-gradients.

A training step ``(state..., batch...) -> (new state..., metrics...)`` has two parts (Rhino
§6.1, Fig. 6): *compute-gradients* (CG: forward and backward; it reads the batch, runs once
per microbatch and its gradients are accumulated) and *apply-gradients* (AG: the optimizer
update; it runs once per step on the accumulated gradients). The values crossing from CG to
AG that depend on the batch are the gradients.

How the boundary is found, on the HLO graph alone (first that applies):

1. **marker**: ops whose ``op_name`` has a ``rhino.grad`` component (``rhino.grad(g)`` wraps
   each gradient in an exact identity, ``reduce-precision`` to its own precision, under that
   named scope). CG is every ancestor of a marked op or of a batch-dependent metric output.
2. **autodiff**: JAX names the ops of ``jax.grad`` / ``jax.value_and_grad`` ``jvp(...)``
   (forward) and ``transpose(jvp(...))`` (backward). CG is every ancestor of such an op or
   of a batch-dependent metric output; AG is the rest (optax's ops carry neither name).
3. otherwise ``GradientBoundaryError`` says what was looked for and how to mark gradients.

Arguments: *state* arguments are those whose parameters are carried to an output (the
updated weights and optimizer state pair with them by pytree path) or that are called
``params`` / ``opt_state``; *batch* arguments are the others unless
``BoundaryOptions.batch_args`` names them. Metric outputs are outputs not carried.

Checks (``GradientBoundaryError`` when one fails): some batch argument exists; AG is not
empty and returns a carried output; a gradient exists; with a marker, no unmarked
batch-dependent value enters AG.

Example:
    >>> import jax, jax.numpy as jnp, rhino
    >>> def step(params, batch):
    ...     loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(params)
    ...     return {"w": params["w"] - 0.1 * g["w"]}, loss
    >>> graph = rhino.ingest(step, {"w": jnp.ones((4, 2))}, jnp.ones((8, 4)))
    >>> b = find_gradient_boundary(graph)
    >>> b.method, [graph.ops[g].shape.dims for g in b.gradients]
    ('autodiff', [(4, 2)])
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

from rhino.errors import OptionsError, RhinoError
from rhino.hlo_passes.graph import HloGraph

MARKER = "rhino.grad"
STATE_NAMES = frozenset({"params", "opt_state", "state", "variables", "optimizer_state"})
METHODS = ("auto", "marker", "autodiff")
_HEAD = re.compile(r"^([A-Za-z_]\w*)")


class GradientBoundaryError(RhinoError):
    """The compute-gradients / apply-gradients boundary cannot be found or is inconsistent.

    Attributes:
        expected: what the search needed; found: what the graph has instead.
    """

    def __init__(self, expected: str, found: str, hint: str = ""):
        self.expected, self.found = expected, found
        super().__init__(f"gradient boundary: expected {expected}, found {found}"
                         + (f". {hint}" if hint else ""))


def grad(tree: Any) -> Any:
    """Mark gradients for rhino's pipeline planner (an exact identity on every leaf).

    Use it where the boundary cannot be found automatically (gradients not computed by
    ``jax.grad``, or a step whose optimizer is itself differentiated): apply it to the
    gradients right before the optimizer update. Each floating-point leaf goes through
    ``reduce_precision`` to its own precision under the named scope ``rhino.grad``.

    Args:
        tree: a pytree of gradient arrays.

    Returns:
        The same values.

    Example:
        >>> import jax.numpy as jnp, rhino
        >>> bool((rhino.grad({"w": jnp.arange(3.0)})["w"] == jnp.arange(3.0)).all())
        True
    """
    import jax
    import jax.numpy as jnp

    def mark(x):
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        fi = jnp.finfo(x.dtype)
        with jax.named_scope(MARKER):
            return jax.lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)

    return jax.tree.map(mark, tree)


@dataclasses.dataclass(frozen=True)
class BoundaryOptions:
    """How ``find_gradient_boundary`` searches.

    Attributes:
        batch_args: what carries the batch: top-level argument names (``("batch",)``) or
            pytree paths inside them (``("batch['tokens']", "batch['labels']")``, leaving
            ``batch['rng']`` out); None: every argument that is not state (see the module
            docstring). PRNG keys are never split, wherever they are.
        method: ``"auto"`` (marker, then autodiff), ``"marker"`` or ``"autodiff"``.
    """

    batch_args: tuple[str, ...] | None = None
    method: str = "auto"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, found {self.method!r}")
        if self.batch_args is not None:
            object.__setattr__(self, "batch_args", tuple(self.batch_args))


@dataclasses.dataclass(frozen=True)
class GradientBoundary:
    """The split of a training step (op ids of the graph it was found on).

    Attributes:
        method: ``"marker"`` or ``"autodiff"``.
        batch_args / state_args: top-level argument names of each kind.
        batch_params / state_params: entry parameter op ids of each kind.
        compute: CG op ids (ascending); closed under operands.
        apply: AG op ids (ascending): every other op.
        gradients: CG ops read by AG that depend on the batch: accumulated per microbatch.
        shared: CG ops read by AG that do not depend on the batch (weights, constants).
        metrics: program outputs computed in CG that are not carried (the loss, ...).
        cg_state: carried outputs computed in CG (state updated per microbatch, e.g.
            batch-norm statistics); the last microbatch's value is kept.
        batch_dependent: per op, whether it depends on a batch argument.
    """

    method: str
    batch_args: tuple[str, ...]
    state_args: tuple[str, ...]
    batch_params: tuple[int, ...]
    state_params: tuple[int, ...]
    compute: tuple[int, ...]
    apply: tuple[int, ...]
    gradients: tuple[int, ...]
    shared: tuple[int, ...]
    metrics: tuple[int, ...]
    cg_state: tuple[int, ...]
    batch_dependent: tuple[bool, ...] = dataclasses.field(repr=False, default=())

    def in_compute(self) -> list[bool]:
        """Per op, whether it is in CG."""
        flags = [False] * len(self.batch_dependent)
        for i in self.compute:
            flags[i] = True
        return flags

    def summary(self, graph: HloGraph) -> dict[str, Any]:
        """Plain-data summary with op names (for plans and reports)."""
        return {
            "method": self.method, "batch_args": list(self.batch_args),
            "state_args": list(self.state_args), "compute_ops": len(self.compute),
            "apply_ops": len(self.apply),
            "gradients": [graph.ops[i].name for i in self.gradients],
            "gradient_bytes": int(sum(graph.ops[i].out_bytes for i in self.gradients)),
            "metrics": [graph.ops[i].name for i in self.metrics],
            "cg_state": [graph.ops[i].name for i in self.cg_state],
        }


def gradient_weights(graph: HloGraph, boundary: GradientBoundary) -> dict[int, tuple[int, ...]]:
    """Gradient op id -> the state parameters whose update reads it.

    Walks back from each updated-state output through the apply-gradients ops that depend on
    the batch, to the gradients. With Adam, ``g_w`` maps to ``w`` and its two moments.
    """
    dep = boundary.batch_dependent
    in_cg = boundary.in_compute()
    grads = set(boundary.gradients)
    state = set(boundary.state_params)
    out: dict[int, list[int]] = {}
    for o, p in _carried(graph):
        if p not in state or in_cg[o] or not dep[o]:
            continue
        seen: set[int] = set()
        stack = [o]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            if i in grads:
                out.setdefault(i, []).append(p)
                continue
            stack.extend(x for x in graph.ops[i].operands if dep[x] and x not in seen)
    return {g: tuple(sorted(set(ps))) for g, ps in out.items()}


def arg_name(graph: HloGraph, param: int) -> str:
    """The top-level argument name of an entry parameter (``params`` for
    ``params['w']``); the parameter's path when it has no identifier head."""
    op = graph.ops[param]
    path = op.arg.path if op.arg is not None else op.name
    m = _HEAD.match(path)
    return m.group(1) if m else path


DUMP_HOWTO = ("jax.jit(step, donate_argnums=(0, 1)).lower(*args).as_text(debug_info=True) "
              "(StableHLO; dialect='hlo', debug_info=True for HLO text), the state arguments "
              "donated")
"""How to dump a step that plans on a cluster: with JAX's op names (debug information) and
its updated state paired with its arguments (donation: ``input_output_alias``)."""


def _is_dump(graph: HloGraph) -> bool:
    return graph.origin.startswith(("hlo:", "mlir:"))


def _carried(graph: HloGraph) -> tuple[tuple[int, int], ...]:
    from rhino.planner.build import carried_pairs
    return carried_pairs(graph)


def _path(graph: HloGraph, param: int) -> str:
    op = graph.ops[param]
    return op.arg.path if op.arg is not None else op.name


def _under(path: str, prefix: str) -> bool:
    """``path`` is ``prefix`` or inside it (``batch['x']`` is under ``batch``)."""
    return path == prefix or path.startswith(prefix + "[") or path.startswith(prefix + ".")


def split_arguments(graph: HloGraph, batch_args: Sequence[str] | None = None
                    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(what carries the batch: names or paths, state argument names), in parameter order.

    Raises:
        GradientBoundaryError: a named batch argument or path matches no parameter, or no
            argument is left to carry the batch.
    """
    names = list(dict.fromkeys(arg_name(graph, p) for p in graph.params))
    if batch_args is not None:
        paths = [_path(graph, p) for p in graph.params]
        unknown = [a for a in batch_args if not any(_under(x, a) for x in paths)]
        if unknown:
            raise GradientBoundaryError(
                f"batch_args naming arguments {names} or pytree paths inside them "
                f"(e.g. {paths[-1]!r})", f"{unknown}, which match no argument leaf")
        batch = list(dict.fromkeys(batch_args))
    else:
        carried_args = {arg_name(graph, p) for _, p in _carried(graph)}
        # A scalar (a Python number such as a learning rate, a step count) has no batch
        # dimension to split: it is never guessed to carry the batch.
        scalar = {a for a in names if all(_is_scalar(graph, p) for p in graph.params
                                          if arg_name(graph, p) == a)}
        batch = [a for a in names
                 if a not in carried_args and a not in STATE_NAMES and a not in scalar]
    if not batch:
        raise GradientBoundaryError(
            "an argument carrying the batch (one with a leading batch dimension)",
            f"only state and scalar arguments {names}",
            "Name the arguments that carry the batch: auto_parallel(..., batch_args=('batch',)) "
            "or BoundaryOptions(batch_args=('batch',)).")
    state = [a for a in names if not any(_under(a, b) or _under(b, a) for b in batch)]
    return tuple(batch), tuple(state)


def _is_scalar(graph: HloGraph, param: int) -> bool:
    dims = getattr(graph.ops[param].shape, "dims", None)
    return dims is not None and len(dims) == 0


def check_batch_leaves(graph: HloGraph, boundary: "GradientBoundary", m: int,
                       keys: frozenset[int] = frozenset()) -> None:
    """Every leaf of the batch arguments has a leading dimension that ``m`` microbatches
    divide, PRNG keys aside (``keys``: their flat argument indices; a key is never split).

    Raises:
        OptionsError: a batch leaf without one, naming the leaf, the batch arguments as
            guessed or given, and the ways out (``batch_args=``, ``num_microbatches=``).
    """
    for p in boundary.batch_params:
        dims = tuple(getattr(graph.ops[p].shape, "dims", ()) or ())
        arg = graph.ops[p].arg
        if (dims and dims[0] % m == 0) or (arg is not None and arg.index in keys):
            continue
        path = _path(graph, p)
        others = tuple(a for a in boundary.batch_args if not _under(path, a))
        name = f"batch_args={others!r}" if others else "batch_args=('batch',)"
        fix = (f"if it does not carry the batch, name the arguments that do, e.g. {name}"
               + ("" if not dims else f"; if it does, pass num_microbatches= dividing "
                  f"{dims[0]}"))
        raise OptionsError(f"batch argument {path}: expected a leading dimension divisible by "
                           f"num_microbatches={m}, found shape {dims} (the batch arguments "
                           f"are {list(boundary.batch_args)}); {fix}")


def _ancestors(graph: HloGraph, seeds: Sequence[int]) -> list[bool]:
    flags = [False] * len(graph.ops)
    stack = list(seeds)
    while stack:
        i = stack.pop()
        if flags[i]:
            continue
        flags[i] = True
        stack.extend(o for o in graph.ops[i].operands if not flags[o])
    return flags


def _descendants(graph: HloGraph, seeds: Sequence[int]) -> list[bool]:
    flags = [False] * len(graph.ops)
    for i in seeds:
        flags[i] = True
    for op in graph.ops:                       # ops are in topological order
        if not flags[op.id] and any(flags[o] for o in op.operands):
            flags[op.id] = True
    return flags


def _gradient_values(graph: HloGraph, seeds: Sequence[int], method: str) -> list[int]:
    """The gradient values the autodiff region hands out: marked ops (marker method), or
    ops of a ``transpose(...)`` scope read outside the autodiff region (autodiff)."""
    if method == "marker":
        return list(seeds)
    autodiff = set(seeds)
    out = []
    for op in graph.ops:
        if op.id in autodiff or not op.operands:
            continue
        out += [o for o in op.operands if o in autodiff and _has_component(
            graph.ops[o].op_name, lambda c: c.startswith("transpose("))]
    return sorted(set(out))


def _has_component(op_name: str, pred) -> bool:
    return any(pred(part) for part in op_name.split("/"))


def _is_marker(op_name: str) -> bool:
    return _has_component(op_name, lambda c: c == MARKER)


def _is_autodiff(op_name: str) -> bool:
    return _has_component(op_name, lambda c: c.startswith("jvp(") or c.startswith("transpose("))


def find_gradient_boundary(graph: HloGraph, options: BoundaryOptions = BoundaryOptions()
                           ) -> GradientBoundary:
    """Find the compute-gradients / apply-gradients split of a training step.

    Args:
        graph: the training step's graph.
        options: batch arguments and method.

    Returns:
        The ``GradientBoundary``.

    Raises:
        GradientBoundaryError: no batch argument, no marker or autodiff ops (for the
            method asked), no apply-gradients part, no gradient, or an unmarked value
            entering apply-gradients when a marker is used.
    """
    batch_args, state_args = split_arguments(graph, options.batch_args)
    in_batch = {p: any(_under(_path(graph, p), b) for b in batch_args) for p in graph.params}
    batch_params = tuple(p for p in graph.params if in_batch[p])
    state_params = tuple(p for p in graph.params if not in_batch[p])
    n = len(graph.ops)
    dep = [False] * n
    for p in batch_params:
        dep[p] = True
    for op in graph.ops:
        if not dep[op.id] and any(dep[o] for o in op.operands):
            dep[op.id] = True
    carried_outs = {o for o, _ in _carried(graph)}
    metrics = [o for o in dict.fromkeys(graph.outputs) if o not in carried_outs and dep[o]]

    markers = [op.id for op in graph.ops if _is_marker(op.op_name)]
    autodiff = [op.id for op in graph.ops if _is_autodiff(op.op_name)]
    if options.method == "marker" or (options.method == "auto" and markers):
        if not markers:
            raise GradientBoundaryError(f"ops marked {MARKER!r} (rhino.grad)", "none",
                                        "Wrap the gradients with rhino.grad(...).")
        method, seeds = "marker", markers
    elif options.method == "autodiff" or autodiff:
        if not autodiff:
            raise GradientBoundaryError("jax.grad / value_and_grad ops (op_name jvp(...) or "
                                        "transpose(...))", "none",
                                        "Wrap the gradients with rhino.grad(...).")
        method, seeds = "autodiff", autodiff
    else:
        named = any(op.op_name for op in graph.ops)
        raise GradientBoundaryError(
            f"ops of jax.grad (op_name jvp(...)/transpose(...)) or ops marked {MARKER!r}",
            f"neither in {len(graph.ops)} ops (op_name metadata "
            f"{'present' if named else 'absent'})",
            "A dump keeps JAX's op names only with its debug information: dump the step as "
            + DUMP_HOWTO if _is_dump(graph) and not named else
            "Wrap the gradients with rhino.grad(...) before the optimizer update.")
    # A metric computed from the gradients (a logged gradient norm, say) belongs after
    # accumulation: it is apply-gradients, computed once per step from the summed
    # gradients, not averaged over per-microbatch values.
    from_grads = _descendants(graph, _gradient_values(graph, seeds, method))
    cg_metrics = [o for o in metrics if not from_grads[o]]
    in_cg = _ancestors(graph, list(seeds) + cg_metrics)
    compute = tuple(i for i in range(n) if in_cg[i])
    apply = tuple(i for i in range(n) if not in_cg[i])
    users = graph.users
    crossing = sorted({o for i in apply for o in graph.ops[i].operands if in_cg[o]})
    gradients = tuple(o for o in crossing if dep[o])
    shared = tuple(o for o in crossing if not dep[o])
    ag_outs = [o for o in graph.outputs if not in_cg[o]]
    if not any(o in carried_outs for o in ag_outs):
        hint = "Is this a training step? Its updated parameters must be outputs."
        if _is_dump(graph) and not graph.aliases:
            hint = ("A dump pairs its outputs with the arguments they update through "
                    "input_output_alias, and this one has none: dump the step with its state "
                    "donated, as " + DUMP_HOWTO)
        raise GradientBoundaryError(
            "an apply-gradients part that returns updated state (an output paired with a "
            "state argument)", f"{len(apply)} apply-gradients ops returning "
            f"{[graph.output_info[graph.outputs.index(o)].path for o in ag_outs][:3]}", hint)
    if not gradients:
        raise GradientBoundaryError("a batch-dependent value entering apply-gradients",
                                    "none: the update does not depend on the batch")
    if method == "marker":
        marked = set(markers)
        unmarked = [o for o in gradients if o not in marked]
        if unmarked:
            op = graph.ops[unmarked[0]]
            raise GradientBoundaryError(
                "only rhino.grad-marked values entering apply-gradients",
                f"{len(unmarked)} unmarked, e.g. {op.name} ({op.opcode} {op.shape}, "
                f"{op.source}) read by {graph.ops[users[op.id][-1]].name}",
                "Mark every gradient the optimizer reads.")
    cg_state = tuple(o for o in dict.fromkeys(graph.outputs) if o in carried_outs and in_cg[o]
                     and dep[o])
    return GradientBoundary(method, batch_args, state_args, batch_params, state_params,
                            compute, apply, gradients, shared, tuple(cg_metrics), cg_state,
                            tuple(dep))
