"""Analyses on hand-built graphs with known answers, and against brute force on random DAGs."""

import random

import networkx as nx
import pytest

from rhino.hlo_passes.analyses import analyze, find_cones, liveness, schedule_bounds

from handmade import make_graph, names

# Two matmuls in a chain with a side branch that has slack:
#   x, w1 -> d1 = dot -> t = tanh -> d2 = dot(t, w2) -> out = add(d2, s)
#   side: s = negate(x)  (short branch, not on the critical path)
CHAIN = [
    ("x", "parameter", []), ("w1", "parameter", []),
    ("d1", "dot", ["x", "w1"]), ("t", "tanh", ["d1"]),
    ("w2", "parameter", []), ("d2", "dot", ["t", "w2"]),
    ("s", "negate", ["x"]), ("out", "add", ["d2", "s"]),
]


def test_chain_backbone_critical_cones_segments():
    g = make_graph(CHAIN)
    a = analyze(g)
    #            x  w1 d1 t  w2 d2 s  out
    assert a.earliest == [0, 0, 1, 2, 0, 3, 1, 4]
    assert a.latest == [0, 0, 1, 2, 2, 3, 3, 4]
    assert a.length == 4
    assert names(g, a.backbone) == ["x", "w1", "d1", "t", "d2", "out"]
    assert names(g, a.critical) == ["d1", "d2"]
    # Cone roots: ops with >= 2 distinct inputs (d1, d2, out).
    assert {g.ops[c.root].name: names(g, c.members) for c in a.cones} == {
        "d1": ["x", "w1", "d1"], "d2": ["t", "w2", "d2"], "out": ["s", "out"]}
    # Segments: before d1 | between d1 and d2 | after d2. s feeds no critical node, so it is
    # placed as early as it can run (time 1, just after d1).
    assert [names(g, s) for s in a.segments] == [["x", "w1"], ["t", "w2", "s"], ["out"]]
    assert a.segment_of[g.op_by_name("d1").id] == -1


def test_parallel_dot_branch_is_not_critical():
    # A long branch of two dots and a short branch of one dot meet at an add.
    g = make_graph([
        ("x", "parameter", []), ("w", "parameter", []),
        ("a1", "dot", ["x", "w"]), ("a2", "dot", ["a1", "w"]), ("a3", "tanh", ["a2"]),
        ("b1", "dot", ["x", "w"]),
        ("y", "add", ["a3", "b1"]),
    ])
    a = analyze(g)
    assert names(g, a.critical) == ["a1", "a2"]
    assert "b1" not in names(g, a.backbone)
    # b1 feeds no critical node: placed as early as it can run, right after a1.
    assert a.segment_of[g.op_by_name("b1").id] == 1


def test_parameters_sit_next_to_their_first_use():
    # A deep chain of dots; w3 is used only by the third dot.
    spec = [("x", "parameter", []), ("w1", "parameter", []), ("d1", "dot", ["x", "w1"]),
            ("w2", "parameter", []), ("d2", "dot", ["d1", "w2"]),
            ("w3", "parameter", []), ("d3", "dot", ["d2", "w3"])]
    g = make_graph(spec)
    a = analyze(g)
    assert [a.segment_of[g.op_by_name(w).id] for w in ("w1", "w2", "w3")] == [0, 1, 2]


def test_cone_invariants_on_fanout():
    # x fans out to three single-input ops; e and l meet at m; n hangs alone at the end.
    g = make_graph([("x", "parameter", []), ("e", "exponential", ["x"]), ("l", "log", ["x"]),
                    ("m", "multiply", ["e", "l"]), ("n", "negate", ["x"])])
    cone_of, cones = find_cones(g)
    assert {g.ops[c.root].name: names(g, c.members) for c in cones} == {
        "m": ["x", "e", "l", "m"], "n": ["n"]}


def test_liveness_by_hand():
    g = make_graph([("p", "parameter", []), ("a", "negate", ["p"]), ("b", "negate", ["a"]),
                    ("c", "add", ["a", "b"])], nbytes={"p": 40, "a": 8, "b": 4, "c": 400})
    live, peak, at = liveness(g)
    # p lives until its last use (a); a until c; b until c; c is the output.
    assert live == [40, 48, 12, 412]
    assert (peak, at) == (412, 3)


def _random_dag(rng: random.Random, n: int):
    spec = []
    for i in range(n):
        k = 0 if i < 2 else rng.choice([0, 1, 1, 2, 2, 3])
        preds = rng.sample(range(i), min(k, i)) if i else []
        opcode = "parameter" if not preds else rng.choice(["dot", "add", "tanh", "dot"])
        if opcode == "tanh" and len(preds) > 1:
            opcode = "add"
        spec.append((f"n{i}", opcode, [f"n{p}" for p in sorted(preds)]))
    return spec


@pytest.mark.parametrize("seed", range(25))
def test_backbone_matches_longest_paths_brute_force(seed):
    rng = random.Random(seed)
    g = make_graph(_random_dag(rng, rng.randint(3, 40)))
    earliest, latest, length = schedule_bounds(g)
    G = nx.DiGraph()
    G.add_nodes_from(range(len(g.ops)))
    G.add_edges_from((o, op.id) for op in g.ops for o in op.operands)
    longest = nx.dag_longest_path_length(G)
    assert length == longest
    for v in G:
        into = nx.dag_longest_path_length(G.subgraph(nx.ancestors(G, v) | {v}))
        out = nx.dag_longest_path_length(G.subgraph(nx.descendants(G, v) | {v}))
        assert earliest[v] == into
        assert (earliest[v] == latest[v]) == (into + out == longest)
    a = analyze(g)
    # Cones: every non-root member has at most one distinct input; roots have >= 2 or no users.
    for cone in a.cones:
        for m in cone.members:
            if m != cone.root:
                assert len(set(g.ops[m].operands)) <= 1
        assert len(set(g.ops[cone.root].operands)) >= 2 or not g.users[cone.root]
    assert sorted(m for c in a.cones for m in c.members) == list(range(len(g.ops)))
    # Segments partition the non-critical ops; critical nodes are ordered by time.
    seg_members = sorted(m for s in a.segments for m in s)
    assert seg_members == sorted(set(range(len(g.ops))) - set(a.critical))
    assert [a.earliest[c] for c in a.critical] == sorted(a.earliest[c] for c in a.critical)
