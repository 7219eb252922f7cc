"""Planning real LLMs (issue 31, acceptance 3; issue 45, acceptance 4): Llama-3-8B on
``--cluster 2x8`` and Llama-3-70B on ``8x8``, H100 figures (datasheet peaks and the
achievable roofline of ``rhino.backends``), sequence 4096, abstract (ShapeDtypeStruct
arguments, no devices). Each run plans the step twice under the same cost model:

* **rhino**: ``rhino.plan(m.step, *args, cluster=..., backend="h100")`` — the front door a
  user calls, so the step is traced and its microbatch analysis decides which pipelines can
  run — the whole search (SPMD, pipeline and hybrid candidates), timed, with the process's
  peak memory (measured before the expert row is priced);
* **expert**: the published recipe (``RECIPES``: NeMo's performance recipes) written as
  pins (``PipelineOptions.annotations``), ``weight_stages``, ``num_stages`` and the stage
  mesh (``stage_shapes``), priced by the same model. What rhino cannot express is replaced
  by the nearest plan it can, and said (``Recipe.not_expressible``): context parallelism
  (CP: each attention's sequence split over devices that exchange keys and values in a
  ring; rhino's attention is one fused call whose sharding rule keeps the sequence whole,
  so the CP devices become data parallel) and virtual pipeline stages (interleaved 1F1B:
  rhino runs one stage per mesh under 1F1B, GPipe or eager 1F1B, so the stages are plain
  1F1B), and a one-stage recipe's gradient accumulation (rhino's one-stage plans run the
  whole batch at once, whose activations do not fit: two 1F1B stages microbatch instead).
  NeMo's distributed optimizer (the Adam moments split over the data-parallel
  devices) is expressible and pinned.

Every row prints the plan's estimated MFU (``Plan.utilization``: matmul FLOPs ÷ (devices
× bf16 peak × step)) and whether it exceeds what a bare matmul reaches.

The step is ``rhino.models.llama`` with ``attention="fused"`` (one fused call per attention
with cuDNN's sharding rule, as the step runs on GPUs) and, with ``--remat``, a
``jax.checkpoint`` per layer; bf16 weights, AdamW with float32 moments. The global batch is
``--batch`` sequences in ``--microbatches`` microbatches.

    python benchmarks/plan_llm.py --model 8b --limit 900
    python benchmarks/plan_llm.py --model 70b --limit 900
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import resource
import sys
import time

MODELS = {"8b": ("Llama-3-8B", "2x8"), "70b": ("Llama-3-70B", "8x8")}
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A published parallel configuration: tensor, pipeline, context parallel and virtual
    stages (data parallel: the devices left), with the distributed optimizer."""

    source: str
    tp: int
    pp: int
    cp: int
    vp: int | None = None
    pp_rhino: int | None = None

    @property
    def stages(self) -> int:
        """The pipeline stages rhino runs the recipe with."""
        return self.pp_rhino or self.pp

    def not_expressible(self) -> list[str]:
        """What rhino cannot express of the recipe, and what it pins instead."""
        out = []
        if self.stages != self.pp:
            out.append(f"PP={self.pp} with gradient accumulation over micro-batches (rhino's "
                       f"one-stage plans run the whole batch at once; the global batch's "
                       f"activations do not fit), so PP={self.stages}, whose 1F1B "
                       f"microbatches accumulate the gradients")
        if self.cp > 1:
            out.append(f"CP={self.cp} (context parallel: ring attention over the sequence; "
                       f"rhino's fused attention keeps each sequence whole, so the CP "
                       f"devices run as data parallel)")
        if self.vp:
            out.append(f"virtual stages ({self.vp} per device, interleaved 1F1B; rhino runs "
                       f"one stage per mesh, so plain 1F1B over {self.pp} stages)")
        return out


# NeMo (Megatron-Bridge) performance recipes, bf16 pretraining on H100 (DESIGN.md's anchors).
RECIPES = {
    "8b": Recipe("NeMo Llama-3-8B pretraining on 8 H100: TP=1, PP=1, CP=2 (DP=4), "
                 "distributed optimizer", tp=1, pp=1, cp=2, pp_rhino=2),
    "70b": Recipe("NeMo Llama-3-70B pretraining on 64 H100: TP=4, PP=4, CP=2 (DP=2), "
                  "5 virtual stages, GBS 256, distributed optimizer", tp=4, pp=4, cp=2, vp=5),
}


def _leaves(step, args) -> list[tuple[str, str, str, tuple]]:
    """``(argument, its first key, full path, shape)`` of every leaf of ``args``."""
    import jax

    out = []
    for name, tree in zip(inspect.signature(step).parameters, args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            key = jax.tree_util.keystr(path)
            out.append((name, key, f"{name}{key}", tuple(leaf.shape)))
    return out


def _tp_spec(key: str, rank: int) -> tuple:
    """Megatron's split of one weight (or its moment) over the tensor axis ``y``."""
    leaf = key.rsplit("[", 1)[-1].strip("]'\"")
    if rank == 2 and leaf in COLUMN:
        return (None, "y")                     # column split: heads, FFN
    if rank == 2 and leaf in ROW:
        return ("y", None)                     # row split
    if leaf == "embed":
        return ("y", None)                     # vocabulary-parallel embedding
    if leaf == "lm_head":
        return (None, "y")                     # vocabulary-parallel output head
    return (None,) * rank


def expert_options(recipe: Recipe, step, args, cluster: str, layers: int, microbatches: int):
    """The recipe as pipeline options over ``cluster`` (module docstring): stage meshes
    (DP·CP, TP) — 1-D ``(DP·CP,)`` without TP — pins for the weights (Megatron), the Adam
    moments (also split over the data-parallel axis ``x``: the distributed optimizer) and
    the batch (over ``x``), layers evenly over the ``pp`` stages."""
    from rhino.pipeline.search import PipelineOptions

    hosts, per = (int(x) for x in cluster.split("x"))
    devices = hosts * per
    pp = recipe.stages
    dp = devices // (recipe.tp * pp)
    tp = recipe.tp > 1
    shape = (dp, recipe.tp) if tp else (dp,)
    pins: dict = {}
    for name, key, path, dims in _leaves(step, args):
        rank = len(dims)
        spec = list(_tp_spec(key, rank)) if tp and name != "batch" else [None] * rank
        if name == "batch":
            spec = ["x"] + [None] * (rank - 1)
        elif ".mu[" in key or ".nu[" in key:       # distributed optimizer: over x too
            free = [d for d in range(rank) if spec[d] is None and dims[d] % dp == 0]
            if free:
                spec[max(free, key=lambda d: dims[d])] = "x"
        pins[path] = tuple(spec)
    stages = None
    if pp > 1:
        stages = {"params['embed']": 0, "params['norm']": pp - 1, "params['lm_head']": pp - 1}
        for i in range(layers):
            stages[f"params['layers'][{i}]"] = i * pp // layers
    from jax.sharding import PartitionSpec as P

    opts = PipelineOptions(num_microbatches=microbatches, num_stages=pp,
                           weight_stages=stages, two_d=tp, stage_shapes=(shape,),
                           kinds=("hybrid",) if pp > 1 else ("spmd",),
                           annotations={k: P(*v) for k, v in pins.items()})
    return opts, shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quick run)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--remat", action="store_true", help="jax.checkpoint per layer")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds before giving up")
    ap.add_argument("--skip-expert", action="store_true")
    ap.add_argument("--json", metavar="FILE", help="append the result row to FILE")
    a = ap.parse_args()
    import rhino
    from plan_at_scale import timed_progress     # this folder: run as a script
    from rhino.models import get_model

    preset, cluster = MODELS[a.model]
    progress = timed_progress(a.limit)
    over = {} if a.layers is None else {"layers": a.layers}
    m = get_model("llama", preset=preset, seq=a.seq, batch=a.batch, attention="fused",
                  remat=a.remat, **over)
    layers = m.config.layers
    args = m.example_args()
    progress(f"planning {preset} ({layers} layers, batch {a.batch} x {a.seq}) from its step "
             f"function, as a user calls rhino.plan (the microbatch analysis included)")
    t_search = time.time()
    plan = rhino.plan(m.step, *args, cluster=cluster, backend="h100",
                      microbatches=a.microbatches, progress=progress)
    search_s = time.time() - t_search
    self_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    kids_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"rhino search {search_s:.1f} s; peak RSS {self_gib:.2f} GiB (planner), "
          f"{kids_gib:.2f} GiB (largest worker)")
    print(plan.report())
    def summary(p) -> dict:
        w, u = p.winner, p.utilization()
        return {"kind": str(p.kind.value), "stages": p.num_stages,
                "stage_mesh": list(p.stages[0].mesh.shape), "step_s": p.step_s,
                "memory_gib": w.memory / 2**30, "compute_s": w.compute_s,
                "communication_s": w.communication_s, "transfer_s": w.transfer_s,
                "bubble_s": w.bubble_s, "apply_s": w.apply_s, "mfu": u.mfu,
                "mfu_ceiling": u.ceiling, "mfu_optimistic": u.optimistic}

    row = {"model": preset, "layers": layers, "cluster": cluster, "batch": a.batch,
           "seq": a.seq, "microbatches": a.microbatches, "remat": a.remat,
           "search_s": search_s, "rss_gib": self_gib,
           "worker_rss_gib": kids_gib, "rhino": summary(plan)}
    print(f"rhino: {plan.utilization().line()}")
    if not a.skip_expert:
        from rhino.pipeline.api import plan_pipeline

        # The recipe's pins (stage meshes, weight stages) are planner options rhino.plan
        # does not take: the expert is priced on the ingested graph by the same model.
        graph = rhino.ingest(m.step, *args)
        recipe = RECIPES[a.model]
        opts, shape = expert_options(recipe, m.step, args, cluster, layers, a.microbatches)
        gaps = recipe.not_expressible()
        progress(f"expert: {recipe.source}; as pins on {cluster}: {recipe.stages} stage(s) × "
                 f"mesh {shape}" + ("; not expressible: " + "; ".join(gaps) if gaps else ""))
        expert = plan_pipeline(graph, cluster=cluster, backend="h100", options=opts,
                               progress=progress)
        print(expert.report())
        row.update(expert=summary(expert), ratio=plan.step_s / expert.step_s,
                   expert_recipe=recipe.source, expert_mesh=list(shape),
                   expert_not_expressible=gaps)
        print(f"expert: {expert.utilization().line()}")
        print(f"rhino {1e3 * plan.step_s:.1f} ms (MFU {100 * plan.utilization().mfu:.1f} %) "
              f"vs expert {1e3 * expert.step_s:.1f} ms (MFU "
              f"{100 * expert.utilization().mfu:.1f} %): {plan.step_s / expert.step_s:.3f}x")
    print(json.dumps(row))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
