"""Planning real LLMs (issue 31, acceptance 3): Llama-3-8B on ``--cluster 2x8`` and
Llama-3-70B on ``8x8``, H100 figures, sequence 4096, abstract (ShapeDtypeStruct arguments,
no devices). Each run plans the step twice under the same cost model:

* **rhino**: ``rhino.plan(step, ..., cluster=..., backend="h100")``, the whole search (SPMD,
  pipeline and hybrid candidates), timed, with the process's peak memory;
* **expert**: the published recipe written by hand: tensor parallel over the 8 GPUs of a
  host (Megatron: the Q/K/V, gate and up projections split by columns, the output and down
  projections by rows, the embedding and the output head by vocabulary) and a pipeline
  across hosts with 1F1B (one stage per host, layers split evenly), as pins
  (``PipelineOptions.annotations``), ``weight_stages`` and ``num_stages``.

The step is ``rhino.models.llama`` with ``attention="fused"`` (one fused call per attention
with cuDNN's sharding rule, as the step runs on GPUs) and, with ``--remat``, a
``jax.checkpoint`` per layer; bf16 weights, AdamW with float32 moments. The global batch is
``--batch`` sequences in ``--microbatches`` microbatches.

    python benchmarks/plan_llm.py --model 8b --limit 900
    python benchmarks/plan_llm.py --model 70b --limit 900
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

MODELS = {"8b": ("Llama-3-8B", "2x8"), "70b": ("Llama-3-70B", "8x8")}
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")


def expert_options(params, hosts: int, layers: int):
    """Megatron TP over a host's 8 devices (axis ``x`` of the stage mesh) x PP over hosts."""
    from rhino.pipeline.search import PipelineOptions

    pins = {"params['embed']": "S[x]·R", "params['lm_head']": "R·S[x]"}
    stages = {"params['embed']": 0, "params['norm']": hosts - 1,
              "params['lm_head']": hosts - 1}
    for i in range(layers):
        for w in COLUMN:
            pins[f"params['layers'][{i}]['{w}']"] = "R·S[x]"
        for w in ROW:
            pins[f"params['layers'][{i}]['{w}']"] = "S[x]·R"
        stages[f"params['layers'][{i}]"] = i * hosts // layers
    return pins, stages, PipelineOptions


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
    graph = rhino.ingest(m.step, *args)
    progress(f"ingested {preset} ({layers} layers, batch {a.batch} x {a.seq}): "
             f"{len(graph.ops)} ops, {graph.total_flops / 1e15:.1f} PFLOP per step")
    t_search = time.time()
    plan = rhino.plan(graph, cluster=cluster, backend="h100", microbatches=a.microbatches,
                      progress=progress)
    search_s = time.time() - t_search
    self_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    kids_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"rhino search {search_s:.1f} s; peak RSS {self_gib:.2f} GiB (planner), "
          f"{kids_gib:.2f} GiB (largest worker)")
    print(plan.report())
    def summary(p) -> dict:
        w = p.winner
        return {"kind": str(p.kind.value), "stages": p.num_stages,
                "stage_mesh": list(p.stages[0].mesh.shape), "step_s": p.step_s,
                "memory_gib": w.memory / 2**30, "compute_s": w.compute_s,
                "communication_s": w.communication_s, "transfer_s": w.transfer_s,
                "bubble_s": w.bubble_s, "apply_s": w.apply_s}

    row = {"model": preset, "layers": layers, "cluster": cluster, "batch": a.batch,
           "seq": a.seq, "microbatches": a.microbatches, "remat": a.remat,
           "ops": len(graph.ops), "search_s": search_s, "rss_gib": self_gib,
           "worker_rss_gib": kids_gib, "rhino": summary(plan)}
    if not a.skip_expert:
        from rhino.pipeline.api import plan_pipeline

        hosts = int(cluster.split("x")[0])
        pins, stages, PipelineOptions = expert_options(args[0], hosts, layers)
        opts = PipelineOptions(num_microbatches=a.microbatches, num_stages=hosts,
                               weight_stages=stages, annotations=pins, two_d=False,
                               kinds=("pipeline", "hybrid"))
        progress(f"expert configuration: TP 8 in a host x PP {hosts} across hosts, 1F1B")
        expert = plan_pipeline(graph, cluster=cluster, backend="h100", options=opts,
                               progress=progress)
        print(expert.report())
        row.update(expert=summary(expert), ratio=plan.step_s / expert.step_s)
        print(f"rhino {1e3 * plan.step_s:.1f} ms vs expert {1e3 * expert.step_s:.1f} ms "
              f"({plan.step_s / expert.step_s:.3f}x)")
    print(json.dumps(row))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
