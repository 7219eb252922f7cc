"""Plan quality (issue 31, acceptance 4), on the simulated-CPU cost model:

* ``zoo``: each zoo model's estimated step on (8) and on (2, 4) (O2, the zoo's default
  configuration), the bytes the plans move, and the search time: a (2, 4) mesh can run every
  (8) plan as ``S[x,y]``, so its plan should never be estimated slower;
* ``clip``: a small Flax NNX transformer trained with AdamW, with and without
  ``optax.clip_by_global_norm(1.0)``, planned as ``auto_parallel`` plans (no partial
  pass-through, interior strided values only) on (8): how many state tensors and bytes the
  plan shards (O2 and O3);
* ``pins`` (issue 46, acceptance 1): each zoo model on (8) and (2, 4), the free search's
  estimated step (O3 and O2, the user's path) against O3 with each expert plan pinned
  (``peers.expert_annotations``: data parallel, ZeRO-3, Megatron, expert parallel, DP x TP
  both ways): the pinned step over the free one, which should never be below 1.

    python benchmarks/plan_quality.py zoo --out benchmarks/out/plan_quality.jsonl
    python benchmarks/plan_quality.py clip --out benchmarks/out/plan_quality.jsonl
    python benchmarks/plan_quality.py pins --out benchmarks/out/plan_quality.jsonl
    python benchmarks/plan_quality.py table benchmarks/out/plan_quality.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ZOO = ("mlp", "gpt", "moe", "vgg19", "wide_resnet", "unet", "dnabert")


def nnx_transformer(clip: bool, layers: int = 4, d: int = 64, heads: int = 4,
                    vocab: int = 256, seq: int = 32, batch: int = 8):
    """``(step, args)``: a pre-LN NNX transformer LM, AdamW (clipped by the global norm
    when ``clip``); the step returns ``(params, rest, opt_state, loss)``."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
            self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, x):
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.ln = nnx.LayerNorm(d, rngs=rngs)
            self.head = nnx.Linear(d, vocab, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln(x))

    graphdef, params, rest = nnx.split(LM(nnx.Rngs(0)), nnx.Param, ...)
    tx = optax.adamw(1e-3)
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(1.0), tx)

    def loss_of(params, rest, batch):
        logits = nnx.merge(graphdef, params, rest)(batch["tokens"])
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return xent.mean()

    def step(params, rest, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_of)(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    t = jax.random.randint(jax.random.key(1), (batch, seq), 0, vocab)
    return step, (params, rest, tx.init(params), {"tokens": t, "labels": jnp.roll(t, -1, 1)})


def sharded_state(plan) -> tuple[int, int, int]:
    """(state tensors sharded, bytes sharded, bytes of all state) of an SPMD plan."""
    st = [p for p in plan.params if p.path.startswith(("params", "opt_state"))]
    sh = [p for p in st if not p.spec.is_replicated]
    return len(sh), sum(p.global_bytes for p in sh), sum(p.global_bytes for p in st)


def zoo_rows():
    import rhino
    from rhino.models import get_model

    for name in ZOO:
        m = get_model(name)
        g = rhino.ingest(m.step, *m.example_args())
        row = {"bench": "zoo", "model": name, "ops": len(g.ops)}
        for mesh in ((8,), (2, 4)):
            t = time.perf_counter()
            p = rhino.plan(g, mesh_shape=mesh).spmd
            key = "x".join(map(str, mesh))
            row[f"{key}_ms"] = 1e3 * p.step_time_s
            row[f"{key}_mib"] = sum(c.bytes for c in p.collectives) / 2**20
            row[f"{key}_s"] = time.perf_counter() - t
        yield row


def clip_rows():
    import dataclasses

    import rhino
    from rhino.planner.build import BuildOptions
    from rhino.planner.cost_model import CostModel

    cost = dataclasses.replace(CostModel.simulated_cpu(1), strided_moves_all_to_all=False)
    build = BuildOptions(strided_interior_only=True, partial_passthrough=False)
    for clip in (False, True):
        step, args = nnx_transformer(clip)
        g = rhino.ingest(step, *args)
        for level in ("O2", "O3"):
            t = time.perf_counter()
            p = rhino.plan(g, mesh_shape=(8,), cost=cost, build=build, opt_level=level).spmd
            n, b, total = sharded_state(p)
            yield {"bench": "clip", "clip": clip, "level": level, "ms": 1e3 * p.step_time_s,
                   "sharded": n, "state": sum(1 for q in p.params
                                              if q.path.startswith(("params", "opt_state"))),
                   "sharded_bytes": b, "state_bytes": total, "s": time.perf_counter() - t}


def pins_rows():
    import sys

    import rhino
    from rhino.models import get_model

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import peers

    for name in ZOO:
        m = get_model(name)
        g = rhino.ingest(m.step, *m.example_args())
        for mesh in ((8,), (2, 4)):
            row = {"bench": "pins", "model": name, "mesh": list(mesh)}
            for level in ("O3", "O2"):
                t = time.perf_counter()
                row[f"free_{level}_ms"] = 1e3 * rhino.plan(g, mesh_shape=mesh,
                                                           opt_level=level).spmd.step_time_s
                row[f"free_{level}_s"] = time.perf_counter() - t
            row["pinned_ms"] = {
                k: 1e3 * rhino.plan(g, mesh_shape=mesh, opt_level="O3",
                                    annotations=v).spmd.step_time_s
                for k, v in peers.expert_annotations(g, name, mesh).items()}
            yield row


def table(path: str) -> None:
    rows = [json.loads(x) for x in open(path) if x.strip()]
    print("| model | ops | (8) ms | (2,4) ms | (2,4)/(8) | (8) MiB | (2,4) MiB | (8) s | (2,4) s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in (r for r in rows if r["bench"] == "zoo"):
        print(f"| {r['model']} | {r['ops']} | {r['8_ms']:.4f} | {r['2x4_ms']:.4f} | "
              f"{r['2x4_ms'] / r['8_ms']:.4f} | {r['8_mib']:.3f} | {r['2x4_mib']:.3f} | "
              f"{r['8_s']:.1f} | {r['2x4_s']:.1f} |")
    print()
    print("| clip | level | est. step ms | state tensors sharded | state bytes sharded | s |")
    print("|---|---|---:|---:|---:|---:|")
    for r in (r for r in rows if r["bench"] == "clip"):
        print(f"| {r['clip']} | {r['level']} | {r['ms']:.4f} | {r['sharded']}/{r['state']} | "
              f"{r['sharded_bytes']}/{r['state_bytes']} | {r['s']:.1f} |")
    print()
    print("| model | mesh | free O3 ms | free O2 ms | expert plans pinned (O3): pinned / free O3 "
          "| least ratio |")
    print("|---|---|---:|---:|---|---:|")
    for r in (r for r in rows if r["bench"] == "pins"):
        ratios = {k: v / r["free_O3_ms"] for k, v in r["pinned_ms"].items()}
        least = min(ratios.values()) if ratios else float("nan")
        shown = ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
        print(f"| {r['model']} | {tuple(r['mesh'])} | {r['free_O3_ms']:.4f} | "
              f"{r['free_O2_ms']:.4f} | {shown} | {least:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("zoo", "clip", "pins", "table"))
    ap.add_argument("path", nargs="?", help="for table: the JSON-lines file")
    ap.add_argument("--out", default="benchmarks/out/plan_quality.jsonl")
    a = ap.parse_args()
    if a.what == "table":
        table(a.path or a.out)
        return
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    rows = {"zoo": zoo_rows, "clip": clip_rows, "pins": pins_rows}[a.what]()
    for row in rows:
        print(json.dumps(row), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
