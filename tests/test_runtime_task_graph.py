"""Task graph (Rhino §6.1): structure, topological order, critical path, schedule order.

The task graph is the pipeline benchmark's analysis (the critical path of measured tasks),
kept in ``benchmarks/task_graph.py``; the executors derive their instructions from the
schedule and the stage programs (``runtime.executors.local.instructions``)."""

import doctest
import pathlib
import sys

import networkx as nx
import pytest

from rhino.runtime.scheduling.schedules import SCHEDULE_NAMES, make_schedule, simulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import task_graph as tg  # noqa: E402  (benchmarks/task_graph.py: the benchmark's analysis)
from task_graph import (BoundaryTensor, TaskGraph, TaskGraphError,  # noqa: E402
                        build_task_graph)


def test_module_doctests():
    assert doctest.testmod(tg).failed == 0


def _nx(g: TaskGraph) -> nx.DiGraph:
    d = nx.DiGraph()
    d.add_nodes_from(n.id for n in g.nodes)
    d.add_edges_from(g.edges)
    return d


@pytest.mark.parametrize("p,m", [(1, 1), (1, 4), (2, 1), (2, 3), (3, 4), (4, 8)])
def test_structure_counts_and_order(p, m):
    g = build_task_graph(p, m)
    kinds = [n.kind for n in g.nodes]
    assert kinds.count("forward") == kinds.count("backward") == p * m
    assert kinds.count("accumulate") == (p * m if m > 1 else 0)
    assert kinds.count("apply") == p
    assert kinds.count("transfer_act") == kinds.count("transfer_grad") == (p - 1) * m
    assert kinds.count("source") == kinds.count("sink") == 1
    order = g.topological_order()
    pos = {k: i for i, k in enumerate(order)}
    assert all(pos[a] < pos[b] for a, b in g.edges)
    assert order[0] == "source" and order[-1] == "sink"
    d = _nx(g)
    assert nx.is_directed_acyclic_graph(d)
    assert set(nx.descendants(d, "source")) == set(d.nodes) - {"source"}


def test_pure_spmd_is_cg_then_ag():
    g = build_task_graph(1, 1)      # Rhino Fig. 6a: compute gradients, apply gradients
    assert [n.id for n in g.nodes] == ["source", "F(0,0)", "B(0,0)", "AG(0)", "sink"]


def test_local_accumulation_chain_with_microbatches():
    g = build_task_graph(1, 3)      # Rhino Fig. 6b
    e = set(g.edges)
    assert {("LA(0,0)", "LA(0,1)"), ("LA(0,1)", "LA(0,2)"), ("LA(0,2)", "AG(0)")} <= e
    assert all(("B(0,%d)" % j, "LA(0,%d)" % j) in e for j in range(3))


def test_boundary_tensors_bytes_skips_and_no_gradient():
    ts = [BoundaryTensor(0, 1, "h1", 100), BoundaryTensor(0, 1, "mask", 7, needs_gradient=False),
          BoundaryTensor(1, 2, "h2", 200), BoundaryTensor(0, 2, "skip", 50)]
    g = build_task_graph(3, 2, ts)
    ta = g.node("TA(0→1,1)")
    assert (ta.tensors, ta.nbytes, ta.stage, ta.peer_stage) == (("h1", "mask"), 107, 0, 1)
    assert g.node("TG(1→0,1)").tensors == ("h1",) and g.node("TG(1→0,1)").nbytes == 100
    assert g.node("TA(0→2,0)").nbytes == 50 and g.node("TG(2→0,0)").nbytes == 50
    assert ("TG(2→0,0)", "B(0,0)") in set(g.edges)
    with pytest.raises(TaskGraphError, match="expected 0 <= src < dst < 3"):
        build_task_graph(3, 1, [BoundaryTensor(2, 1)])


def test_stage_fed_by_nothing_starts_at_source():
    g = build_task_graph(2, 1, [])
    assert ("source", "F(1,0)") in set(g.edges)
    assert not [n for n in g.nodes if n.kind.startswith("transfer")]


def test_critical_path_hand_computed():
    g = build_task_graph(2, 1)
    dur = {"F(0,0)": 1.0, "F(1,0)": 1.0, "B(1,0)": 2.0, "B(0,0)": 2.0,
           "TA(0→1,0)": 0.5, "TG(1→0,0)": 0.5, "AG(0)": 0.25, "AG(1)": 0.25}
    cp = g.critical_path(dur)
    assert cp.length == 1 + 0.5 + 1 + 2 + 0.5 + 2 + 0.25
    assert cp.path == ("source", "F(0,0)", "TA(0→1,0)", "F(1,0)", "B(1,0)", "TG(1→0,0)",
                       "B(0,0)", "AG(0)", "sink")
    with pytest.raises(TaskGraphError, match="unknown"):
        g.critical_path({"F(9,9)": 1.0})
    with pytest.raises(TaskGraphError, match=">= 0"):
        g.critical_path({"F(0,0)": -1.0})


# The task graph is Rhino §6.1's, with one backward task per microbatch: the schedules
# whose backward is whole (zb-h1's B and W are checked in test_schedule_properties.py).
@pytest.mark.parametrize("name", [n for n in SCHEDULE_NAMES if n != "zb-h1"])
@pytest.mark.parametrize("p,m", [(2, 2), (3, 4), (4, 6)])
def test_scheduled_critical_path_equals_schedule_simulation(name, p, m):
    """Two independent computations of a static schedule's length agree, and both agree
    with networkx's longest path."""
    f, b, t, a = [1.0 + 0.25 * s for s in range(p)], [2.0] * p, 0.5, 0.125
    sched = make_schedule(name, p, m)
    g = build_task_graph(p, m).with_schedule(sched)

    def dur(n):
        return {"forward": f[n.stage] if n.stage is not None else 0, "backward": 2.0,
                "transfer_act": t, "transfer_grad": t, "apply": a}.get(n.kind, 0.0)
    cp = g.critical_path(dur)
    assert cp.length == pytest.approx(simulate(sched, f, b, transfer_s=t, apply_s=a).makespan)
    d = _nx(g)
    for n in g.nodes:
        d.nodes[n.id]["w"] = dur(n)
    for u, v in d.edges:
        d.edges[u, v]["w"] = d.nodes[v]["w"]
    assert cp.length == pytest.approx(nx.dag_longest_path_length(d, weight="w"))
    assert cp.length >= build_task_graph(p, m).critical_path(dur).length


def test_instructions_put_receives_before_and_sends_after():
    p, m = 3, 4
    g = build_task_graph(p, m)
    ins = g.instructions(make_schedule("1f1b", p, m))
    transfers = [n.id for n in g.nodes if n.kind.startswith("transfer")]
    every = [k for seq in ins.values() for k in seq]
    assert all(every.count(t) == 2 for t in transfers)
    compute = [n.id for n in g.nodes if n.kind in ("forward", "backward", "accumulate", "apply")]
    assert sorted(k for k in every if k in compute) == sorted(compute)
    for s, seq in ins.items():
        pos = {k: i for i, k in enumerate(seq)}
        for n in g.nodes:
            if n.kind == "transfer_act" and n.peer_stage == s:
                assert pos[n.id] < pos[f"F({s},{n.microbatch})"]
            if n.kind == "transfer_act" and n.stage == s:
                assert pos[n.id] > pos[f"F({s},{n.microbatch})"]
            if n.kind == "transfer_grad" and n.stage == s:
                assert pos[n.id] > pos[f"B({s},{n.microbatch})"]


def test_schedule_must_fit_and_cycles_are_caught():
    g = build_task_graph(2, 2)
    with pytest.raises(TaskGraphError, match="expected 2 stages × 2 microbatches, found 3 × 2"):
        g.with_schedule(make_schedule("1f1b", 3, 2))
    bad = TaskGraph(g.num_stages, g.num_microbatches, g.nodes, g.edges + (("sink", "source"),))
    with pytest.raises(TaskGraphError, match="expected a DAG, found a cycle"):
        bad.topological_order()
    bad = TaskGraph(g.num_stages, g.num_microbatches, g.nodes, g.edges + (("sink", "nope"),))
    with pytest.raises(TaskGraphError, match="known nodes"):
        bad.validate()


def test_json_round_trip():
    g = build_task_graph(3, 2, [BoundaryTensor(0, 1, "h", 64), BoundaryTensor(0, 2, "s", 8)])
    assert TaskGraph.from_json(g.to_json()) == g
