"""The SPMD planner (Rhino paper §4): pure — an HloGraph and an abstract mesh in, a plan out.

Modules (data flows top to bottom)::

    mesh.py          AbstractMesh: axis names/sizes, α/β per axis, FLOP/s, memory
    spec.py          ShardingSpec: per tensor dim the mesh axes and stride; replicated; partial
    collectives.py   α-β costs of all-reduce / all-gather / reduce-scatter / all-to-all,
                     resharding cost and collective list between two specs
    strategies.py    per-op strategies (output spec, required operand specs, costs);
                     the per-opcode rules live in strategies_rules.py
    build.py         HloGraph + mesh -> ShardingProblem (problem.py), partition for O2
    problem.py       ShardingProblem / Edge / Solution: the named ILP data object
    solvers.py       brute force, exact PBQP reductions, highspy ILP (tight pairwise form)
    hierarchical.py  O2: cone DP -> segment ILP -> segment-chain DP
    validate.py      independent validator of a plan
    spmd_plan.py     SpmdPlan: report(), to_json()/from_json()
    api.py           plan_graph: build -> solve (O2/O3) -> memory (§4.4) -> validate

No module here touches devices or imports ray.
"""
