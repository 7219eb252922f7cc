"""Micro-benchmark of the SPMD solvers: O2 (three-level merging) vs O3 (whole-graph ILP).

The real problems (GPT training steps) come from ``rhino.planner.build``; this module makes
*synthetic* ones that mimic them: a forward stack of transformer layers (layernorm, q/k/v,
softmax attention, projection, residual, MLP), the mirrored backward stack, and an optimizer
update per weight. Weights and saved activations create skip edges from forward layer k to
backward layer k. Every op's choices are sharding specs (replicated, sharded on a dim with a
stride, partial) on a 1-D mesh of 8 or a 2x4 mesh; unary cost = compute at that sharding,
edge cost = alpha-beta resharding cost between the producer's output spec and the spec the
consumer's strategy needs for that operand (so consistent choices are cheap). All layers have
identical cost data, as in a real model. Cones, pivots and segments follow the paper and
``rhino.hlo_passes.analyses``: cone roots are multi-input ops (plus pivots and sinks), members
extend each root through single-input producers; pivots are the ops on the residual backbone
and its matmuls; segments are cut at the pivots' earliest start times (unit op times).

``--source gpt`` instead benchmarks the real problems: GPT training steps built by
``rhino.planner.build`` (ingest + strategies + resharding costs) for simulated CPU meshes.

Run::

    python benchmarks/solver_micro.py --layers 4 12 36 72 --mesh 1d --o3-limit 600
    python benchmarks/solver_micro.py --source gpt --layers 4 12 36 72 --mesh 2d
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import time
import warnings
from typing import Sequence

import numpy as np

from rhino.planner.hierarchical import Partition, solve_o2, solve_o3
from rhino.planner.problem import Edge, ShardingProblem
from rhino.planner.solvers import SolverTimeLimitWarning

# ---- specs -------------------------------------------------------------------------------
_DIMS = ("S0", "S1", "S2")
_MAPS = {
    "id": {},
    "swap12": {"S1": "S2", "S2": "S1"},
    # y[B,F] = x[B,H] W[H,F]; consumer spec S0 = batch, S1 = F, P = contracting H sharded.
    "mm_x": {"S1": "R", "P": "S1", "S2": "S2"},
    "mm_w": {"S0": "R", "S1": "S1", "P": "S0", "S2": "R"},
    "reduce2": {"S2": "R", "P": "S2"},
}


def _resh1(src: str, dst: str, n: int, size: float, beta: float) -> float:
    """1-D resharding cost of ``size`` units from spec ``src`` to ``dst`` on an axis of n."""
    if src == dst:
        return 0.0
    alpha = 0.02
    frac = (n - 1) / n
    s_base, d_base = src.split("/")[0], dst.split("/")[0]
    if d_base == "P":
        return 0.0 if s_base == "R" else alpha + beta * frac * size
    if s_base == "R":
        return 0.005 * size
    if s_base == "P":
        return alpha + beta * (2 if d_base == "R" else 1) * frac * size
    if d_base == "R":
        return alpha + beta * frac * size
    return alpha + beta * 0.3 * size  # dim or stride change: all-to-all


class _Gen:
    """Accumulates nodes and edges of a synthetic training step."""

    def __init__(self, mesh: str, rng_seed: int):
        self.axes = ((8, 1.0),) if mesh == "1d" else ((2, 3.0), (4, 1.0))
        self.seed = rng_seed
        self.rng = np.random.default_rng(rng_seed)
        self.names: list[str] = []
        self.specs: list[list[tuple[str, ...]]] = []
        self.flops: list[float] = []
        self.noise: list[np.ndarray] = []
        self._edge_cache: dict[tuple, np.ndarray] = {}
        self.preds: list[list[int]] = []
        self.edges: list[tuple[int, int, str, float]] = []
        self.pivots: list[int] = []
        self.pad = 1

    def reseed(self) -> None:
        """Same random stream for every layer: identical layers, as in a real model."""
        self.rng = np.random.default_rng(self.seed)

    def _spec_set(self, partial: bool, strides: int) -> list[tuple[str, ...]]:
        base = ["R"] + [f"{d}/{s}" for d in _DIMS for s in range(strides)
                        if s == 0 or self.rng.random() < 0.5] + (["P"] if partial else [])
        per_axis = [b for b in base if b == "R" or self.rng.random() < 0.85]
        combos = [c for c in itertools.product(per_axis, repeat=len(self.axes))
                  if len(self.axes) == 1 or c[0] == "R" or c[0] == "P"
                  or c[0].split("/")[0] != c[1].split("/")[0]]
        if len(combos) > 30:
            keep = self.rng.choice(len(combos) - 1, 29, replace=False) + 1
            combos = [combos[0]] + [combos[k] for k in sorted(keep)]
        return combos

    def node(self, name: str, inputs: Sequence[tuple[int, str]], flops: float,
             partial: bool = False, strides: int = 2, size: float = 1.0) -> int:
        i = len(self.names)
        self.names.append(name)
        self.specs.append(self._spec_set(partial, strides))
        self.noise.append(self.rng.random(len(self.specs[-1])))
        self.flops.append(flops)
        self.preds.append([u for u, _ in inputs])
        for u, kind in inputs:
            self.edges.append((u, i, kind, size))
        return i

    def chain(self, x: int, name: str, length: int | None = None) -> int:
        """Single-input elementwise/reshape ops (cone members)."""
        n = int(self.rng.integers(0, 2 * self.pad + 1)) if length is None else length
        prev = x
        for k in range(n):
            r = self.rng.random()
            if r < 0.6:
                ins = [(x, "id")]
            elif r < 0.7:
                ins = [(x, "swap12")]
            elif r < 0.85:  # binary op with a broadcast constant
                ins = [(x, "id"), (self.node(f"{name}.c{k}", [], 0.0, strides=1, size=0.01),
                                   "id")]
            else:  # binary op reusing an earlier value (x * sigmoid(x), x - mean(x))
                ins = [(x, "id"), (prev, "id")] if prev != x else [(x, "id")]
            prev, x = x, self.node(f"{name}.ew{k}", ins, 0.05)
        return x

    def param(self, name: str) -> int:
        return self.node(name, [], 0.0, strides=1, size=0.5)

    def matmul(self, name: str, x: int, w: int, pivot: bool = False) -> int:
        y = self.node(name, [(self.chain(x, name + ".x"), "mm_x"),
                             (self.chain(w, name + ".w", 0), "mm_w")], 4.0, partial=True)
        if pivot:
            self.pivots.append(y)
        return y

    def ew2(self, name: str, a: int, b: int, pivot: bool = False, kb: str = "id") -> int:
        y = self.node(name, [(self.chain(a, name + ".a"), "id"), (b, kb)], 0.1)
        if pivot:
            self.pivots.append(y)
        return y

    # ---- the problem ----------------------------------------------------------------------
    def cost_vectors(self) -> list[np.ndarray]:
        out = []
        for specs, fl, noise in zip(self.specs, self.flops, self.noise):
            c = []
            for sp in specs:
                div = np.prod([n for (n, _), s in zip(self.axes, sp) if s != "R"])
                c.append(fl / div + (0.01 * fl if "P" in sp else 0.0))
            out.append(np.array(c) * (1.0 + 0.05 * noise))
        return out

    def edge_matrix(self, u: int, v: int, kind: str, size: float) -> np.ndarray:
        key = (tuple(self.specs[u]), tuple(self.specs[v]), kind, size)
        if key in self._edge_cache:
            return self._edge_cache[key]
        mp = _MAPS[kind]
        m = np.empty((len(self.specs[u]), len(self.specs[v])))
        for b, sv in enumerate(self.specs[v]):
            need = tuple(mp.get(s.split("/")[0], s) for s in sv)
            for a, su in enumerate(self.specs[u]):
                m[a, b] = sum(_resh1(x, y, n, size, beta)
                              for x, y, (n, beta) in zip(su, need, self.axes))
        self._edge_cache[key] = m
        return m


def _layer_fwd(g: _Gen, h: int, l: int, saved: dict) -> int:
    p = f"L{l}."
    ln1 = g.ew2(p + "ln1", h, g.param(p + "g1"), pivot=True)
    wq, wk, wv, wo = (g.param(p + w) for w in ("wq", "wk", "wv", "wo"))
    q, k, v = (g.matmul(p + n, ln1, w) for n, w in (("q", wq), ("k", wk), ("v", wv)))
    s = g.matmul(p + "s", g.chain(q, p + "qt", 1), k)
    mx = g.node(p + "max", [(s, "reduce2")], 0.05)
    e = g.chain(g.ew2(p + "sub", s, mx), p + "exp", 1)
    sm = g.ew2(p + "sm", e, g.node(p + "sum", [(e, "reduce2")], 0.05))
    o = g.matmul(p + "o", sm, v)
    proj = g.matmul(p + "proj", o, wo, pivot=True)
    h2 = g.ew2(p + "res1", proj, h, pivot=True)
    ln2 = g.ew2(p + "ln2", h2, g.param(p + "g2"), pivot=True)
    w1, w2 = g.param(p + "w1"), g.param(p + "w2")
    f1 = g.matmul(p + "f1", ln2, w1, pivot=True)
    act = g.chain(f1, p + "gelu", 2)
    f2 = g.matmul(p + "f2", act, w2, pivot=True)
    h3 = g.ew2(p + "res2", f2, h2, pivot=True)
    saved[l] = dict(h=h, ln1=ln1, q=q, k=k, v=v, sm=sm, o=o, h2=h2, ln2=ln2, f1=f1, act=act,
                    wq=wq, wk=wk, wv=wv, wo=wo, w1=w1, w2=w2)
    return h3


def _update(g: _Gen, name: str, w: int, dw: int) -> None:
    m, v = g.param(name + ".m"), g.param(name + ".v")
    g.node(name + ".adam", [(w, "id"), (g.chain(dw, name + ".g", 1), "id"), (m, "id"),
                            (v, "id")], 0.2, size=0.5)


def _layer_bwd(g: _Gen, dh3: int, l: int, saved: dict) -> int:
    p, sv = f"L{l}.b.", saved[l]
    dact = g.matmul(p + "dact", dh3, sv["w2"], pivot=True)
    _update(g, p + "w2", sv["w2"], g.matmul(p + "dw2", sv["act"], dh3))
    dpre = g.ew2(p + "dgelu", dact, sv["f1"])
    dln2 = g.matmul(p + "dln2", dpre, sv["w1"], pivot=True)
    _update(g, p + "w1", sv["w1"], g.matmul(p + "dw1", sv["ln2"], dpre))
    dh2 = g.ew2(p + "dres1", g.ew2(p + "lnb2", dln2, sv["h2"]), dh3, pivot=True)
    do = g.matmul(p + "do", dh2, sv["wo"], pivot=True)
    _update(g, p + "wo", sv["wo"], g.matmul(p + "dwo", sv["o"], dh2))
    dsm = g.matmul(p + "dsm", do, sv["v"])
    dv = g.matmul(p + "dv", sv["sm"], do)
    dsub = g.ew2(p + "dsoft", dsm, sv["sm"], pivot=True)
    dq = g.matmul(p + "dq", dsub, sv["k"])
    dk = g.matmul(p + "dk", dsub, sv["q"])
    grads = []
    for n, d in (("q", dq), ("k", dk), ("v", dv)):
        grads.append(g.matmul(p + "dx" + n, d, sv["w" + n]))
        _update(g, p + "w" + n, sv["w" + n], g.matmul(p + "dw" + n, sv["ln1"], d))
    dln1 = g.ew2(p + "dsum", g.ew2(p + "dsum0", grads[0], grads[1]), grads[2], pivot=True)
    return g.ew2(p + "dres0", g.ew2(p + "lnb1", dln1, sv["h"]), dh2, pivot=True)


def _cones(n: int, preds: list[list[int]], forced_roots: set[int]) -> list[int]:
    succs: list[list[int]] = [[] for _ in range(n)]
    for v, ps in enumerate(preds):
        for u in ps:
            succs[u].append(v)
    roots = {v for v in range(n) if len(preds[v]) >= 2 or not succs[v]} | forced_roots
    cone = [-1] * n
    for r in sorted(roots):
        cone[r] = r
        stack = list(preds[r])
        while stack:
            u = stack.pop()
            if u in roots or cone[u] != -1:
                continue
            cone[u] = r
            stack.extend(preds[u])
    return cone


def _segments(n: int, preds: list[list[int]], pivots: list[int]) -> tuple[list[int], list[int]]:
    """Segments as ``rhino.hlo_passes.analyses.find_segments`` cuts them: unit-time earliest /
    latest start; an op that feeds a pivot goes by its latest time, others by their earliest;
    segment = number of pivots that start at or before that time."""
    succs: list[list[int]] = [[] for _ in range(n)]
    for v, ps in enumerate(preds):
        for u in ps:
            succs[u].append(v)
    earliest = [0] * n
    for v in range(n):  # nodes are created in topological order
        earliest[v] = max((earliest[u] + 1 for u in preds[v]), default=0)
    length = max(earliest)
    latest = [length] * n
    for v in reversed(range(n)):
        latest[v] = min((latest[w] - 1 for w in succs[v]), default=length)
    pset = set(pivots)
    feeds = [False] * n
    for v in reversed(range(n)):
        feeds[v] = any(w in pset or feeds[w] for w in succs[v])
    order = sorted(pivots, key=lambda p: (earliest[p], p))
    times = [earliest[p] for p in order]
    seg = [-1 if v in pset else bisect.bisect_right(times, latest[v] if feeds[v]
                                                     else earliest[v]) for v in range(n)]
    return seg, order


def make_gpt_like(n_layers: int, *, mesh: str = "1d", seed: int = 0,
                  pad: int = 1) -> tuple[ShardingProblem, Partition]:
    """A synthetic GPT training step as a ``ShardingProblem`` with its O2 ``Partition``.

    Args:
        n_layers: transformer layers (forward and backward each).
        mesh: ``"1d"`` (8 devices, ~4-8 choices per op) or ``"2d"`` (2x4, ~7-30 choices).
        seed: seed of the per-layer random stream (all layers share it).
        pad: mean length of elementwise chains in front of ops (sets ops per layer; 4 gives
            ~470 ops per layer like the real GPT step).
    """
    g = _Gen(mesh, seed)
    g.pad = pad
    tok = g.node("tokens", [], 0.0, strides=1)
    emb = g.param("embed")
    h = g.ew2("embed.gather", emb, tok, pivot=True)
    saved: dict = {}
    for l in range(n_layers):
        g.reseed()
        h = _layer_fwd(g, h, l, saved)
    logits = g.matmul("logits", h, emb, pivot=True)
    dlog = g.chain(g.node("xent", [(logits, "reduce2")], 0.1), "dxent", 2)
    dh = g.matmul("dh_final", dlog, emb, pivot=True)
    _update(g, "embed", emb, g.matmul("dembed", h, dlog))
    for l in reversed(range(n_layers)):
        g.reseed()
        dh = _layer_bwd(g, dh, l, saved)
    g.node("dtable", [(dh, "id"), (tok, "id")], 0.1)
    costs = g.cost_vectors()
    edges = tuple(Edge(u, v, g.edge_matrix(u, v, kind, size)) for u, v, kind, size in g.edges)
    labels = tuple(tuple("x".join(s) for s in specs) for specs in g.specs)
    problem = ShardingProblem(tuple(g.names), labels, tuple(costs), edges)
    n = problem.num_nodes
    cone = _cones(n, g.preds, set(g.pivots))
    segment_of, pivots = _segments(n, g.preds, g.pivots)
    return problem, Partition(tuple(cone), tuple(segment_of), tuple(pivots))


def make_gpt_step(n_layers: int, *, mesh: str = "1d") -> tuple[ShardingProblem, Partition]:
    """The real problem: a GPT training step (``rhino.models`` "gpt" preset with
    ``n_layers``) ingested and built by ``rhino.planner.build`` for a simulated CPU mesh of 8
    (``"1d"``) or 2x4 (``"2d"``)."""
    import jax

    from rhino.hlo_passes import ingest
    from rhino.models import get_model
    from rhino.planner.build import build_problem
    from rhino.planner.cost_model import CostModel
    from rhino.planner.mesh import AbstractMesh

    model = get_model("gpt", layers=n_layers)
    graph = ingest(jax.jit(model.step), *model.example_args())
    shape = (8,) if mesh == "1d" else (2, 4)
    built = build_problem(graph, AbstractMesh(shape), CostModel.simulated_cpu(len(shape)))
    return built.problem, built.partition


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="synthetic", choices=["synthetic", "gpt"],
                    help="synthetic generator, or real GPT steps from rhino.planner.build")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12, 36, 72])
    ap.add_argument("--mesh", default="1d", choices=["1d", "2d"])
    ap.add_argument("--pad", type=int, default=8, help="synthetic: elementwise chain length")
    ap.add_argument("--o2-limit", type=float, default=60.0)
    ap.add_argument("--o3-limit", type=float, default=600.0)
    ap.add_argument("--no-o3", action="store_true")
    args = ap.parse_args(argv)
    print(f"source={args.source} mesh={args.mesh}"
          + (f" pad={args.pad}" if args.source == "synthetic" else ""))
    print(f"{'layers':>6} {'nodes':>7} {'edges':>7} {'ch/node':>7} {'O2 s':>7} {'O2 obj':>11} "
          f"{'O3 s':>7} {'O3 obj':>11} {'O3 status':>10} {'O2/O3 obj':>9} {'speedup':>7}")
    for n_layers in args.layers:
        t = time.perf_counter()
        if args.source == "gpt":
            prob, part = make_gpt_step(n_layers, mesh=args.mesh)
        else:
            prob, part = make_gpt_like(n_layers, mesh=args.mesh, pad=args.pad)
        t_build = time.perf_counter() - t
        ch = np.mean([prob.num_choices(i) for i in range(prob.num_nodes)])
        o2 = solve_o2(prob, part, time_limit=args.o2_limit)
        row = (f"{n_layers:>6} {prob.num_nodes:>7} {len(prob.edges):>7} {ch:>7.1f} "
               f"{o2.seconds:>7.2f} {o2.objective:>11.5g}")
        if not args.no_o3:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SolverTimeLimitWarning)
                o3 = solve_o3(prob, time_limit=args.o3_limit)
            row += (f" {o3.seconds:>7.2f} {o3.objective:>11.5g} {o3.status:>10} "
                    f"{o2.objective / o3.objective:>9.4f} {o3.seconds / o2.seconds:>7.1f}")
        print(row + f"   (build {t_build:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
