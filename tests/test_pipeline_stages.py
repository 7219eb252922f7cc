"""Stage ILP (§5.1) with bound tightening (§5.2), coarsening, and stage assignment."""

import dataclasses
import doctest
import random

import pytest

import rhino
from rhino.models import get_model
from rhino.pipeline import coarsen as coarsen_module
from rhino.pipeline import stage_ilp as stage_ilp_module
from rhino.pipeline import stages as stages_module
from rhino.pipeline.coarsen import classify_ops, coarsen, weight_group
from rhino.pipeline.gradient import find_gradient_boundary
from rhino.pipeline.stage_ilp import (CutTensor, StageAssignmentError, StageOptions,
                                      StageProblem, solve_brute_force, solve_stage_problem)
from rhino.pipeline.stages import assign_stages, check_assignment
from rhino.vocabulary import Role


def test_doctests():
    for mod in (stage_ilp_module, coarsen_module, stages_module):
        assert doctest.testmod(mod).failed == 0


def _random_problem(rng, n, d, max_in=2):
    edges = set()
    for v in range(1, n):
        for u in rng.sample(range(v), min(v, rng.randint(1, max_in))):
            edges.add((u, v))
    tensors = []
    for u in range(n):
        cons = sorted({v for a, v in edges if a == u})
        if cons:
            tensors.append(CutTensor(u, tuple(cons), rng.randint(1, 64)))
    comp = tuple(float(rng.randint(1, 10)) for _ in range(n))
    return StageProblem(tuple(map(str, range(n))), comp, tuple(sorted(edges)), tuple(tensors), d)


def _chain_problem(rng, n, d):
    """A chain with skip edges (the shape of real coarsened graphs)."""
    edges = set()
    for u in range(n - 1):
        edges.add((u, u + 1))
        if rng.random() < 0.3:
            edges.add((u, min(n - 1, u + rng.randint(2, 6))))
    tensors = []
    for u in range(n):
        cons = sorted({v for a, v in edges if a == u})
        if cons:
            tensors.append(CutTensor(u, tuple(cons), rng.randint(1, 64)))
    comp = tuple(float(rng.randint(1, 10)) for _ in range(n))
    return StageProblem(tuple(map(str, range(n))), comp, tuple(sorted(edges)), tuple(tensors), d)


def test_ilp_equals_brute_force_on_tiny_problems():
    rng = random.Random(0)
    for _ in range(25):
        p = _random_problem(rng, rng.randint(3, 8), rng.choice([2, 3]))
        for eps, weight in ((0.3, 0.0), (0.6, 0.05), (2.0, 1.0)):
            o = StageOptions(epsilon=eps, balance_weight=weight, tighten=False, relax=False,
                             mip_rel_gap=0.0)
            try:
                bf = solve_brute_force(p, o)
            except StageAssignmentError:
                with pytest.raises(StageAssignmentError):
                    solve_stage_problem(p, o)
                continue
            il = solve_stage_problem(p, o)
            assert il.objective == pytest.approx(bf.objective, abs=1e-9)
            assert not p.violations(il.stage_of, eps, o.min_stage_load)
            assert il.cut_bytes == p.cut_bytes(il.stage_of)


def test_backward_edges_and_multi_reader_tensors_count_once_per_stage():
    # a -> b -> c forward; tensor of a read by b and c; a backward edge c -> a (a <= c).
    p = StageProblem(("a", "b", "c"), (1.0, 1.0, 1.0), ((0, 1), (1, 2)),
                     (CutTensor(0, (1, 2), 10), CutTensor(1, (2,), 1)), 3)
    assert p.cut_bytes((0, 1, 1)) == 10 + 0
    assert p.cut_bytes((0, 1, 2)) == 20 + 1
    sol = solve_stage_problem(p, StageOptions(epsilon=0.0, balance_weight=0.0))
    assert sol.stage_of == (0, 1, 2) and sol.cut_bytes == 21


def test_bound_tightening_keeps_the_optimum_with_generous_epsilon():
    """Acceptance 1: graphs up to ~200 ops, tightened ILP = plain ILP optimum."""
    rng = random.Random(1)
    for n, d in ((60, 3), (120, 4), (200, 4)):
        p = _chain_problem(rng, n, d)
        for eps in (0.5, 1.0):
            o = StageOptions(epsilon=eps, relax=False, mip_rel_gap=1e-7, time_limit=60)
            plain = solve_stage_problem(p, dataclasses.replace(o, tighten=False))
            tight = solve_stage_problem(p, o)
            assert plain.status == tight.status == "optimal"
            assert tight.objective == pytest.approx(plain.objective, rel=1e-6, abs=1e-9)
            assert tight.free_choices < plain.free_choices


def test_bound_tightening_on_a_real_graph_per_op():
    """Acceptance 1 on an HLO graph: one unit per forward op (~100 units), 3 stages."""
    m = get_model("gpt", layers=1, hidden=16, heads=2, seq=4, vocab=32, batch=2)
    g = rhino.ingest(m.step, *m.example_args())
    b = find_gradient_boundary(g)
    c = coarsen(g, classify_ops(g, b), "op")
    assert 50 <= c.problem.num_units <= 250
    p = dataclasses.replace(c.problem, num_stages=3)
    o = StageOptions(epsilon=1.0, relax=False, mip_rel_gap=0.0, time_limit=60)
    plain = solve_stage_problem(p, dataclasses.replace(o, tighten=False))
    tight = solve_stage_problem(p, o)
    assert tight.objective == pytest.approx(plain.objective, rel=1e-6)
    assert tight.num_vars < plain.num_vars


def test_bounds_follow_section_5_2():
    # A chain of 4 equal units into 2 stages: with ε = 0 the bounds fix the answer.
    p = StageProblem(tuple("abcd"), (1.0,) * 4, ((0, 1), (1, 2), (2, 3)), (), 2)
    assert p.bounds(0.0) == ([0, 0, 1, 1], [0, 0, 1, 1])
    lb, ub = p.bounds(0.5)
    assert lb == [0, 0, 0, 1] and ub == [0, 1, 1, 1]
    assert p.bounds(0.5, tighten=False) == ([0] * 4, [1] * 4)


def test_relaxes_epsilon_and_reports_it():
    p = StageProblem(("a", "b"), (1.0, 3.0), ((0, 1),), (CutTensor(0, (1,), 4),), 2)
    sol = solve_stage_problem(p, StageOptions(epsilon=0.1))
    assert sol.stage_of == (0, 1) and sol.epsilon >= 0.5 and sol.rounds > 1
    with pytest.raises(StageAssignmentError, match="balanced within"):
        solve_stage_problem(p, StageOptions(epsilon=0.1, relax=False))
    with pytest.raises(StageAssignmentError, match="at least 3 units"):
        solve_stage_problem(dataclasses.replace(p, num_stages=3))


def test_one_unit_holding_nearly_all_the_work_still_gets_the_stages_asked_for():
    """A factorization in a tiny model: no split gives each stage a tenth of the mean load
    at any ε; the least unbalanced split that leaves no stage empty is returned (with its
    imbalance as the ε used) rather than an error."""
    p = StageProblem(("a", "b", "c"), (0.01, 100.0, 0.01), ((0, 1), (1, 2)),
                     (CutTensor(0, (1,), 4), CutTensor(1, (2,), 4)), 2)
    sol = solve_stage_problem(p)
    assert len(set(sol.stage_of)) == 2 and sol.stage_of[0] <= sol.stage_of[1] <= sol.stage_of[2]
    assert sol.epsilon == pytest.approx(p.imbalance(sol.stage_of)) and sol.rounds > 1


def _gpt(layers, **kw):
    m = get_model("gpt", layers=layers, hidden=64, heads=2, seq=16, vocab=32, batch=4, **kw)
    g = rhino.ingest(m.step, *m.example_args())
    return g, find_gradient_boundary(g)


def _layer_of(g, i):
    arg = g.ops[i].arg
    if arg is None or "['layers'][" not in arg.path:
        return None
    return int(arg.path.split("['layers'][", 1)[1].split("]", 1)[0])


@pytest.mark.parametrize("layers,stages", [(4, 2), (6, 3)])
def test_gpt_layers_split_at_layer_boundaries(layers, stages):
    """Acceptance 2: balanced within ε, cuts at layer boundaries, fwd+bwd of a layer on one
    stage (and its optimizer update too)."""
    g, b = _gpt(layers)
    eps = 0.15
    a = assign_stages(g, b, stages, StageOptions(epsilon=eps, relax=False))
    assert check_assignment(g, b, a) == []
    loads = [f + w for f, w, _ in a.flops]
    mean = sum(loads) / stages
    assert max(abs(x - mean) for x in loads) <= eps * mean
    hidden = (4, 16, 64)
    acts = [c for c in a.crossings if c.kind == "activation"]
    assert len(acts) == stages - 1
    import rhino.models.base as base
    lines = open(base.__file__, encoding="utf-8").read().splitlines()
    residual = 1 + lines.index('    return x + ffn_fn(p, layernorm(p["ln2"], x))')
    for c in acts:   # the residual stream leaving a layer: x + mlp(ln2(x))
        op = g.ops[c.op]
        assert op.opcode == "add" and op.shape.dims == hidden and c.dsts == (c.src + 1,)
        assert op.source and op.source.endswith(f"base.py:{residual}"), op.source
    for c in a.crossings:
        if c.kind == "gradient" and g.ops[c.op].shape.dims != (32, 64):   # tied wte
            assert g.ops[c.op].shape.dims == hidden and c.dsts == (c.src - 1,)
    assert {c.kind for c in a.crossings} <= {"activation", "gradient"}
    # Every op touching layer k's weights (forward, backward, update) is on one stage.
    role = a.roles.role
    stage_of_layer = {}
    for op in g.ops:
        if a.stage_of[op.id] < 0:
            continue
        for o in op.operands:
            k = _layer_of(g, o)
            if k is not None:
                assert role[op.id] in (Role.FORWARD, Role.BACKWARD, Role.APPLY)
                assert stage_of_layer.setdefault(k, a.stage_of[op.id]) == a.stage_of[op.id], k
    assert sorted(stage_of_layer) == list(range(layers))
    assert sorted(set(stage_of_layer.values())) == list(range(stages))
    assert list(stage_of_layer.values()) == sorted(stage_of_layer.values())


def test_unet_skip_tensors_cross_several_stages():
    """Acceptance 3: a valid assignment where skip connections skip stages."""
    m = get_model("unet")
    g = rhino.ingest(m.step, *m.example_args())
    b = find_gradient_boundary(g)
    a = assign_stages(g, b, 4, StageOptions(epsilon=0.3))
    assert check_assignment(g, b, a) == []
    skips = [c for c in a.crossings if c.kind == "activation" and max(c.dsts) - c.src >= 2]
    assert skips, [(c.name, c.src, c.dsts) for c in a.crossings]
    for c in skips:   # an encoder level's output, read by the decoder's concatenate
        readers = {g.ops[j].opcode for j in g.users[c.op] if a.stage_of[j] in c.dsts}
        assert "concatenate" in readers
    grads_back = [c for c in a.crossings if c.kind == "gradient" and c.src - min(c.dsts) >= 2]
    assert grads_back


def test_checker_catches_broken_assignments():
    g, b = _gpt(2)
    a = assign_stages(g, b, 2, StageOptions(epsilon=0.3))
    st = list(a.stage_of)
    first = next(i for i, r in enumerate(a.roles.role) if r == Role.FORWARD and st[i] == 0)
    reader = next(j for j in g.users[first] if a.roles.role[j] == Role.FORWARD)
    last = max(i for i, r in enumerate(a.roles.role) if r == Role.FORWARD)
    st[last] = 0
    st[first] = 1
    broken = dataclasses.replace(a, stage_of=tuple(st))
    errs = check_assignment(g, b, broken)
    assert any("forward edge" in e for e in errs) or st[reader] == 1
    assert any("crossings" in e for e in errs) and any("unit" in e for e in errs)
    free = next(i for i, r in enumerate(a.roles.role)
                if r == Role.FREE and g.ops[i].opcode != "parameter")
    st2 = list(a.stage_of)
    st2[free] = 0
    assert any("free op" in e for e in check_assignment(g, b, dataclasses.replace(
        a, stage_of=tuple(st2))))


def test_roles_and_granularities():
    g, b = _gpt(2)
    roles = classify_ops(g, b)
    assert roles.method == "autodiff-names"
    counts = {r: roles.role.count(r) for r in (Role.FREE, Role.FORWARD, Role.BACKWARD, Role.APPLY)}
    assert all(counts.values())
    seg = coarsen(g, roles, "segment", b.state_params)
    lay = coarsen(g, roles, "auto", b.state_params)
    per_op = coarsen(g, roles, "op", b.state_params)
    assert lay.granularity == "layer" and seg.granularity == "segment"
    assert per_op.problem.num_units > lay.problem.num_units
    assert any(gr.endswith("['layers'][1]") for gr in lay.groups)
    for c in (seg, lay, per_op):
        c.problem.topological_order()       # a DAG
        assert sorted(i for m in c.units for i in m) == sorted(
            i for i, r in enumerate(roles.role) if r in (Role.FORWARD, Role.BACKWARD))
    assert weight_group("params['layers'][3]['ln1']['scale']") == "params['layers'][3]"
    assert weight_group("params['ln_f']['bias']") == "params['ln_f']"
    assert weight_group("params['wte']") is None
    with pytest.raises(ValueError, match="granularity"):
        coarsen(g, roles, "layers")
