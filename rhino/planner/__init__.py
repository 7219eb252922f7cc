"""The SPMD planner (Rhino paper §4): pure — an HloGraph, a mesh and its cost model in, a plan out.

Pass order (``plan_graph(graph, mesh, cost, options)``)::

    HloGraph  +  AbstractMesh (axis names, sizes)  +  CostModel (α, β per axis, FLOP/s per
       │                                               dtype, memory, backend facts)
       ▼
    strategies   per op: output spec, operand specs, compute seconds (FLOP/s of its dtype)
       ▼
    build        ShardingProblem: unary costs, resharding edges (α-β collectives), memory
       ▼
    solve        O3 whole-graph ILP | O2 cone DP -> segment ILP -> segment-chain DP
       ▼
    memory       force the largest parameters sharded until the plan fits (§4.4)
       ▼
    validate     an independent recomputation of every spec and cost
       ▼
    SpmdPlan     specs, collectives, memory, estimates, and the mesh and cost model used

Modules (data flows top to bottom)::

    mesh.py          AbstractMesh: axis names and sizes (the logical mesh only)
    cost_model.py    CostModel: α/β per axis, FLOP/s per dtype, memory, backend facts
                     (built-in figures per backend: rhino.backends)
    spec.py          ShardingSpec: per tensor dim the mesh axes and stride; replicated; partial
    collectives.py   α-β costs of all-reduce / all-gather / reduce-scatter / all-to-all,
                     resharding cost and collective list between two specs
    strategies.py    per-op strategies (output spec, required operand specs, costs);
                     the per-opcode rules live in strategies_rules.py
    build.py         HloGraph + mesh + cost -> ShardingProblem (problem.py), partition for O2
    problem.py       ShardingProblem / Edge / Solution: the named ILP data object
    solvers.py       brute force, exact PBQP reductions, highspy ILP (tight pairwise form)
    hierarchical.py  O2: cone DP -> segment ILP -> segment-chain DP
                     (segments and the chain DP: chain.py; exact min-sum variable
                     elimination: elimination.py)
    validate.py      independent validator of a plan
    spmd_plan.py     SpmdPlan: report(), to_json()/from_json()
    api.py           plan_graph: build -> solve (O2/O3) -> memory (§4.4) -> validate

No module here touches devices or imports ray.
"""
