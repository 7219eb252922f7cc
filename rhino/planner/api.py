"""``plan_graph``: build the sharding problem → solve (O2/O3) → fit memory → validate →
``SpmdPlan``, for an ingested graph on an abstract mesh priced by a cost model
(``rhino.plan`` is the front door).

Memory (paper §4.4): if the best plan does not fit ``memory_budget`` bytes per device, the
entry parameters are sorted by size, the replicated choices of the largest ``k`` are
forbidden, and the smallest ``k`` whose plan fits is searched (doubling, then bisection;
one build, only the costs change between rounds). If no ``k`` fits,
``InfeasiblePlanError`` reports the least memory any round needed and the budget.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> g = rhino.ingest(lambda x, w: jnp.sum(jnp.tanh(x @ w)), jnp.ones((256, 64)),
    ...                  jnp.ones((64, 64)))
    >>> p = plan_graph(g, AbstractMesh((4,)), CostModel.simulated_cpu(1),
    ...                PlanOptions(opt_level="O3"))
    >>> p.param_spec("x").to_str(p.mesh)
    'S[x]·R'
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Collection, Sequence

import numpy as np

from rhino.errors import InfeasiblePlanError, OptionsError
from rhino.hlo_passes import HloGraph
from rhino.hlo_passes.analyses import liveness
from rhino.hlo_passes.graph import TensorType, shape_str
from rhino.planner.build import BuildOptions, BuiltProblem, build_problem, local_bytes
from rhino.planner.collectives import reshard as _reshard
from rhino.planner.cost_model import CostModel
from rhino.planner.fold import fold_fallback
from rhino.planner.op_cost import matmul_dtype, model_flops
from rhino.planner.hierarchical import solve_o2, solve_o3
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spmd_plan import (SpmdPlan, MemoryEstimate, OpPlan, ParamPlan,
                                PlannedCollective, SearchStats, SplitAlternative,
                                UnevenValue, UnplannedOp)
from rhino.planner.problem import ShardingProblem, Solution
from rhino.planner.spec import ShardingSpec
from rhino.planner.strategies import Strategy
from rhino.planner.validate import validate_built

OPT_LEVELS = ("O2", "O3")


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How ``plan`` searches.

    Attributes:
        opt_level: ``"O2"`` (three-level subgraph search, fast) or ``"O3"`` (whole-graph ILP).
        memory_budget: bytes per device a plan may use, or None for no limit.
        time_limit: seconds for each solve (O3: the ILP; O2: its soft limit).
        mip_rel_gap: relative MIP gap at which ILP solves stop.
        build: options of the problem builder (strides, pins, forced sharding, carry).
        validate: run the independent validator on the result (raises on mismatch).
        refine: O2 ends with its mirrored-window moves (``planner/windows.py``: weight
            groups split between a layer's forward and its backward). They take about as
            long again as the rest of O2 on a layered step; the pipeline search plans its
            candidates without them and refines the chosen one. O3 ignores it.
        memory_tiebreak: each parameter choice also costs ``memory_tiebreak × min β ×
            local bytes`` during the search, so that among plans of equal time the one
            keeping less per device wins (e.g. a batch split rather than replicated and
            sliced). 1e-3 keeps it 100× below the latency of any collective; the reported
            objective excludes it.
        activation_tiebreak: each choice of every other op also costs
            ``activation_tiebreak × min β × local bytes`` of its value: a Lagrangian weight on
            the activation memory. 0 (default) plans for time alone; ``auto_parallel`` raises
            it, with ``memory_tiebreak``, step by step until the compiled program fits its
            ``memory_budget``. The reported objective excludes it.
        fold_seed: on a mesh with two or more axes longer than 1, O2 also solves the
            problem limited to plans that use those axes as one (``S[x,y]``: every plan of
            the one-axis mesh of the same devices, ``planner/fold.py``) and keeps the
            better of that and its own search, so a 2-D plan is never estimated slower
            than the one-axis plan. It costs about one one-axis search more. O3 ignores it.
    """

    opt_level: str = "O2"
    memory_budget: int | None = None
    time_limit: float = 600.0
    mip_rel_gap: float = 1e-4
    build: BuildOptions = BuildOptions()
    validate: bool = True
    refine: bool = True
    memory_tiebreak: float = 1e-3
    activation_tiebreak: float = 0.0
    fold_seed: bool = True

    def __post_init__(self):
        if self.opt_level not in OPT_LEVELS:
            raise OptionsError(f"opt_level: expected one of {OPT_LEVELS}, found {self.opt_level!r}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise OptionsError(f"memory_budget: expected a positive number of bytes, found "
                             f"{self.memory_budget!r}")
        if not self.time_limit > 0:
            raise OptionsError(f"time_limit: expected > 0 seconds, found {self.time_limit!r}")
        for name in ("refine", "fold_seed"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"{name}: expected True or False, found "
                                   f"{getattr(self, name)!r}")
        for name in ("memory_tiebreak", "activation_tiebreak"):
            if not getattr(self, name) >= 0:
                raise OptionsError(f"{name}: expected a weight >= 0, found "
                                 f"{getattr(self, name)!r}")


def _solve(built: BuiltProblem, problem: ShardingProblem, options: PlanOptions) -> Solution:
    """Solve ``problem`` (a cost variant of ``built.problem``) with the memory tie-breaks;
    the returned objective is the true one, ``built.problem.objective(choice)``."""
    beta = min(built.cost.beta or (0.0,))
    if options.memory_tiebreak > 0 and problem.memory is not None:
        eps = options.memory_tiebreak * beta
        if eps > 0:
            problem = dataclasses.replace(problem, costs=tuple(
                c + eps * m for c, m in zip(problem.costs, problem.memory)))
    if options.activation_tiebreak > 0 and beta > 0:
        eps = options.activation_tiebreak * beta
        problem = dataclasses.replace(problem, costs=tuple(
            c + eps * m for c, m in zip(problem.costs, built.activation_bytes)))
    if options.opt_level == "O3":
        sol = solve_o3(problem, time_limit=options.time_limit, mip_rel_gap=options.mip_rel_gap)
    else:
        def o2(p: ShardingProblem) -> Solution:
            return solve_o2(p, built.partition, time_limit=options.time_limit,
                            mip_rel_gap=options.mip_rel_gap, windows=options.refine)
        sol = o2(problem)
        if options.fold_seed:
            sol = fold_fallback(built, problem, sol, o2)
    return dataclasses.replace(sol, objective=built.problem.objective(sol.choice))


def memory_of(graph: HloGraph, mesh: AbstractMesh, plan: Sequence[Strategy],
              in_place: Sequence[tuple[int, int]] = ()) -> MemoryEstimate:
    """Per-device parameter bytes and liveness peak under a plan; ``in_place`` pairs
    (updated output, parameter) share a buffer, as donated training state does."""
    sizes = [local_bytes(op.shape, st.out_spec, mesh) for op, st in zip(graph.ops, plan)]
    _, peak, _ = liveness(graph, sizes, in_place)
    return MemoryEstimate(parameters=int(sum(sizes[p] for p in graph.params)), peak=int(peak))


def _forbid_replicated(built: BuiltProblem, params: Sequence[int]) -> ShardingProblem:
    costs = list(built.problem.costs)
    for p in params:
        c = costs[p].copy()
        for j, st in enumerate(built.strategies[p]):
            if isinstance(st.out_spec, ShardingSpec) and st.out_spec.is_replicated:
                c[j] = np.inf
        if np.isfinite(c).any():
            costs[p] = c
    return dataclasses.replace(built.problem, costs=tuple(costs))


def estimate_lower_bound(built: BuiltProblem) -> int:
    """The smallest liveness peak any plan of ``built`` can have: every value at the
    smallest per-device size among its strategies (the peak only grows with sizes)."""
    graph, mesh = built.graph, built.mesh
    sizes = [min(local_bytes(op.shape, st.out_spec, mesh) for st in built.strategies[op.id])
             if built.strategies[op.id] else local_bytes(op.shape, None, mesh)
             for op in graph.ops]
    _, peak, _ = liveness(graph, sizes, built.carried)
    return int(peak)


def _fit_memory(built: BuiltProblem, options: PlanOptions, progress: Callable[[str], None]
                ) -> tuple[Solution, MemoryEstimate, int, int]:
    """(solution, memory, k forced sharded, rounds) for the smallest k that fits."""
    graph, mesh, budget = built.graph, built.mesh, options.memory_budget
    sol = _solve(built, built.problem, options)
    mem = memory_of(graph, mesh, built.plan(sol.choice), built.carried)
    if budget is None or mem.peak <= budget:
        return sol, mem, 0, 1
    floor = estimate_lower_bound(built)
    if floor > budget:
        raise InfeasiblePlanError(floor, budget, f"a lower bound of the estimated peak on "
                                  f"mesh {mesh}: every value at its smallest layout at once; "
                                  f"forcing parameters sharded cannot go below it")
    order = sorted(graph.params, key=lambda p: -graph.ops[p].out_bytes)
    best_seen = mem.peak
    rounds = 1
    results: dict[int, tuple[Solution, MemoryEstimate]] = {}

    def attempt(k: int) -> bool:
        nonlocal best_seen, rounds
        if k in results:
            return results[k][1].peak <= budget
        rounds += 1
        s = _solve(built, _forbid_replicated(built, order[:k]), options)
        m = memory_of(graph, mesh, built.plan(s.choice), built.carried)
        best_seen = min(best_seen, m.peak)
        results[k] = (s, m)
        progress(f"memory: {k} largest parameters forced sharded -> peak "
                 f"{m.peak / 2**20:.1f} MiB (budget {budget / 2**20:.1f} MiB)")
        return m.peak <= budget

    # Every parameter sharded first: when even that does not fit (the peak is activations),
    # the doubling below would solve about log2(#parameters) times for nothing (12 solves,
    # 2.5 minutes, on a 48-layer GPT stage that needs 214 GiB per device).
    if not attempt(len(order)):
        raise InfeasiblePlanError(best_seen, budget, f"even with all {len(order)} "
                                  f"parameters sharded on mesh {mesh}")
    # The least k that fits, between k = 0 (the plan above, over budget) and every
    # parameter (fits). The peak falls roughly with the bytes forced sharded, so the next k
    # is where those bytes interpolate the budget between the bracket's ends (regula falsi
    # in bytes; the Illinois rule halves the weight of an end kept twice in a row, so a
    # step-shaped peak cannot pin the guesses to one side). A 48-layer GPT on 64 devices
    # took 18 solves by doubling then halving the count.
    cum = np.cumsum([0] + [graph.ops[p].out_bytes for p in order], dtype=float)
    lo, hi = 0, len(order)
    f_lo, f_hi = mem.peak - budget, results[hi][1].peak - budget    # > 0, <= 0
    kept = 0                                                         # +1 lo kept, -1 hi kept
    while hi - lo > 1:
        want = cum[lo] + f_lo / (f_lo - f_hi) * (cum[hi] - cum[lo]) if f_lo > f_hi else 0
        mid = min(max(int(np.searchsorted(cum, want)), lo + 1), hi - 1)
        if attempt(mid):
            hi, f_hi = mid, results[mid][1].peak - budget
            f_lo, kept = (f_lo / 2 if kept == 1 else f_lo), 1
        else:
            lo, f_lo = mid, results[mid][1].peak - budget
            f_hi, kept = (f_hi / 2 if kept == -1 else f_hi), -1
    s, m = results[hi]
    return s, m, hi, rounds


def predicted_collectives(built: BuiltProblem, plan: Sequence[Strategy],
                          resolved: Collection[int] = ()) -> tuple[PlannedCollective, ...]:
    """Every collective the plan implies: operand reshardings, output reductions, carries.

    A pending sum in ``resolved`` (``BuiltProblem.resolved(choice)``) is reduced once
    (consumer ``"<reduced once for N uses>"``) and its uses that need a reduced spec
    reshard from the reduced form. Readers of one value that need the same spec share one
    resharding, as in the compiled program (XLA's CSE); the objective still charges each
    such reader (an upper bound: sharing one resharding among any number of readers is not
    a pairwise cost), so the collectives' seconds can sum to less than the plan's
    communication time.
    """
    graph, mesh, cost = built.graph, built.mesh, built.cost
    out: list[PlannedCollective] = []
    carried = {o: p for o, p in built.carried}
    free_outs = set(graph.outputs) - set(carried)

    def add(rp, u: int, consumer: str) -> None:
        for c in rp.collectives:
            out.append(PlannedCollective(c.kind, tuple(mesh.axis_names[a] for a in c.axes),
                                         int(c.bytes), float(c.cost), graph.ops[u].name,
                                         consumer, graph.ops[u].source, c.alpha_share))

    def reshard(src: Any, dst: Any, u: int):
        return _reshard(src, dst, graph.ops[u].shape, mesh, cost,
                        built.alpha_share.get(u, 1.0))

    def source(u: int, need: Any) -> Any:
        spec = plan[u].out_spec
        if u in resolved and isinstance(need, ShardingSpec) and not need.is_partial:
            return spec.without_partial()
        return spec

    uses: dict[int, int] = {}
    for op in graph.ops:
        for u in op.operands:
            uses[u] = uses.get(u, 0) + 1
    for o, p in built.carried:
        if o != p:
            uses[o] = uses.get(o, 0) + 1
    for u in sorted(resolved):
        spec = plan[u].out_spec
        if u not in free_outs:  # a free output is reduced below, as "<output>"
            add(reshard(spec, spec.without_partial(), u), u,
                f"<reduced once for {uses.get(u, 0)} uses>")
    seen: set = set()
    for op, st in zip(graph.ops, plan):
        for k, u in enumerate(op.operands):
            need = st.in_specs[k]
            src = source(u, need)
            if (u, src, need) in seen:
                continue  # XLA runs one resharding of a value into one layout (CSE)
            seen.add((u, src, need))
            add(reshard(src, need, u), u, op.name)
    for o in dict.fromkeys(graph.outputs):
        spec = plan[o].out_spec
        if o in carried:
            p = carried[o]
            add(reshard(source(o, plan[p].out_spec), plan[p].out_spec, o), o,
                f"<carry to {graph.ops[p].arg.path if graph.ops[p].arg else graph.ops[p].name}>")
        elif isinstance(spec, ShardingSpec) and spec.is_partial:
            add(reshard(spec, spec.without_partial(), o), o, "<output>")
    return tuple(out)


def plan_graph(graph: HloGraph, mesh: AbstractMesh, cost: CostModel,
               options: PlanOptions = PlanOptions(),
               progress: Callable[[str], None] | None = None,
               timings: tuple[float, float] = (0.0, 0.0)) -> SpmdPlan:
    """Plan an ingested graph on an abstract mesh (pure: no devices).

    Args:
        graph: the ingested graph.
        mesh: the logical mesh.
        cost: what collectives, compute and memory cost on it (``CostModel``; built-in
            figures per backend in ``rhino.backends``); the plan records it.
        options: how to search.
        progress: called with a line of text at each phase.
        timings: seconds spent ingesting and analysing, for the plan's statistics.

    Raises:
        OptionsError: the cost model is for another number of mesh axes.
        InfeasiblePlanError: ``options.memory_budget`` cannot be met.
    """
    progress = progress or (lambda msg: None)
    cost.check(mesh, "plan_graph")
    t0 = time.perf_counter()
    progress(f"building the sharding problem ({len(graph.ops)} ops, mesh {mesh}, "
             f"{cost.backend} costs)")
    built = build_problem(graph, mesh, cost, options.build)
    t1 = time.perf_counter()
    progress(f"solving with {options.opt_level}")
    sol, mem, k, rounds = _fit_memory(built, options, progress)
    t2 = time.perf_counter()
    strategies = built.plan(sol.choice)
    if options.validate:
        validate_built(built, sol.choice, sol.objective)
    br = built.breakdown(sol.choice)
    st = built.stats()
    ops = []
    for op, s in zip(graph.ops, strategies):
        tup = not isinstance(s.out_spec, ShardingSpec)
        ops.append(OpPlan(op.name, op.opcode, s.label, None if tup else s.out_spec,
                          tuple(x if isinstance(x, ShardingSpec) else None for x in s.in_specs)))
    params = []
    for p in graph.params:
        op, s = graph.ops[p], strategies[p]
        spec = s.out_spec if isinstance(s.out_spec, ShardingSpec) else ShardingSpec.replicated(
            len(op.tensor.dims) if isinstance(op.shape, TensorType) else 0)
        params.append(ParamPlan(op.arg.index if op.arg else len(params),
                                op.arg.path if op.arg else op.name, shape_str(op.shape), spec,
                                op.out_bytes, local_bytes(op.shape, s.out_spec, mesh),
                                bool(op.arg and op.arg.donated)))
    plan = SpmdPlan(
        program=graph.name, origin=graph.origin, mesh=mesh, cost=cost, ops=tuple(ops),
        params=tuple(params),
        collectives=predicted_collectives(built, strategies, built.resolved(sol.choice)),
        memory=mem, memory_budget=options.memory_budget, compute_s=br.compute,
        communication_s=br.communication,
        search=SearchStats(options.opt_level, sol.status, float(sol.objective), timings[0],
                           timings[1], t1 - t0, t2 - t1, rounds, k, int(st["nodes"]),
                           int(st["choices"]), int(st["edges"])),
        unplanned=tuple(UnplannedOp(u.name, u.opcode, u.source, u.reason)
                        for u in built.unknown_ops),
        overhead_s=cost.program_seconds(), model_flops=model_flops(graph),
        matmul_dtype=matmul_dtype(graph), uneven=_uneven_values(graph, strategies, mesh))
    if plan.splits_nothing and mesh.num_devices > 1:
        progress("the plan splits nothing: pricing the cheapest plan that splits the "
                 "largest op, for the report")
        plan = dataclasses.replace(plan, split_alternative=split_alternative(built, options))
    return plan


def _uneven_values(graph, strategies, mesh: AbstractMesh) -> tuple[UnevenValue, ...]:
    """The plan's values split unevenly, largest first."""
    out = []
    for op, s in zip(graph.ops, strategies):
        spec = s.out_spec
        if isinstance(spec, ShardingSpec) and isinstance(op.shape, TensorType) and \
                spec.uneven_dims(op.shape.dims, mesh):
            padded = TensorType(op.shape.dtype, spec.padded_shape(op.shape.dims, mesh))
            out.append((op.out_bytes, UnevenValue(op.name, shape_str(op.shape),
                                                  spec.to_str(mesh), shape_str(padded),
                                                  op.source)))
    return tuple(u for _, u in sorted(out, key=lambda x: -x[0]))


def split_alternative(built: BuiltProblem, options: PlanOptions) -> SplitAlternative:
    """The cheapest plan found that splits the largest op of ``built.graph``: the same
    search with that op's replicated-work choices removed (``min_split_flops``), no memory
    budget. It says, with numbers, why a plan that splits nothing won."""
    graph = built.graph
    big = max(graph.ops, key=lambda op: op.flops)
    alt = build_problem(graph, built.mesh, built.cost,
                        dataclasses.replace(options.build, min_split_flops=float(big.flops)))
    whole = max(s.compute_cost for s in built.strategies[big.id])
    if big.flops <= 0 or all(s.compute_cost >= whole * (1 - 1e-9)
                             for s in alt.strategies[big.id]):
        return SplitAlternative(big.name, float(big.flops), big.source, 0.0, 0.0, 0.0, 0,
                                f"no op of the step can be split on {built.mesh} (the "
                                f"largest, {big.name}, has no split its sizes divide)")
    sol = _solve(alt, alt.problem, dataclasses.replace(options, memory_budget=None))
    br = alt.breakdown(sol.choice)
    n = len(predicted_collectives(alt, alt.plan(sol.choice), alt.resolved(sol.choice)))
    return SplitAlternative(big.name, float(big.flops), big.source,
                            br.total + built.cost.program_seconds(), br.compute,
                            br.communication, n)
