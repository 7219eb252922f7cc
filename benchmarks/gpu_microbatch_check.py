"""A pipelined step's microbatch programs on one GPU, where cuDNN's fused attention exists
(issue 43: custom calls cut by their batch factor). The zoo Llama in bfloat16 with
``attention="cudnn"`` (``jax.nn.dot_product_attention``'s cuDNN implementation: its
``dot_product_attention_*_wrapper`` primitives, GPU only) and with ``"fused"`` (rhino's
``custom_partitioning`` kernel) is split as ``rhino.auto_parallel`` splits it (one stage,
``m`` microbatches) and its stage programs run one after the other on the device
(``tests/stage_runner.py``), against ``jax.jit`` of the step and gradient accumulation.

    python benchmarks/gpu_microbatch_check.py --out DIR [--dry-run] [--steps N]

Writes ``DIR/gpu_microbatch_check.json``. ``--dry-run``: CPU, XLA and fused attention (cuDNN
does not trace without a GPU). Exit status 1 if a variant is refused or off by more than
the rounding jit and gradient accumulation show between themselves (x4, plus 1e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _worst(a, b) -> float:
    import jax
    import jax.numpy as jnp

    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def check(attention: str, steps: int, m: int = 4) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from rhino.hlo_passes.lower import refuse_couplings
    from rhino.models import get_model
    from stage_runner import run_split, split_like_auto_parallel

    model = get_model("llama", layers=2, hidden=128, ffn=256, heads=4, kv_heads=2,
                      vocab=512, seq=128, batch=8, attention=attention)
    params, opt = model.init(jax.random.key(0))
    tx = model.optimizer()

    def accumulated(p, o, b):
        n = jax.tree.leaves(b)[0].shape[0] // m
        parts = [jax.value_and_grad(model.loss)(p, jax.tree.map(lambda a: a[j * n:(j + 1) * n], b))
                 for j in range(m)]
        g = jax.tree.map(lambda *t: sum(x.astype(jnp.float32) for x in t) / m,
                         *[g for _, g in parts])
        u, o = tx.update(jax.tree.map(lambda a, q: a.astype(q.dtype), g, p), o, p)
        return optax.apply_updates(p, u), o, sum(x for x, _ in parts) / m

    t0 = time.time()
    batch = model.make_batch(jax.random.key(1))
    sp = split_like_auto_parallel(model.step, (params, opt, batch), m=m)
    refuse_couplings(sp.layout, m)
    prims = sorted({fe.eqn.primitive.name for fe in sp.flat.eqns
                    if "attention" in fe.eqn.primitive.name or
                    fe.eqn.primitive.name == "custom_partitioning"})
    whole, ref = jax.jit(model.step), jax.jit(accumulated)
    s_w = s_r = s_p = (params, opt)
    rows = []
    for k in range(steps):
        b = model.make_batch(jax.random.key(100 + k))      # the split is of the shapes
        flat_out = run_split(sp, jax.tree.leaves((*s_p, b)))
        out = jax.tree.unflatten(jax.tree.structure(whole.eval_shape(*s_p, b)), flat_out)
        *s_w, l_w = whole(*s_w, b)
        *s_r, l_r = ref(*s_r, b)
        *s_p, l_p = out
        rows.append(dict(step=k, loss_jit=float(l_w), loss_accumulated=float(l_r),
                         loss_pipelined=float(l_p), params_pipelined_vs_accumulated=_worst(
                             s_p[0], s_r[0]), params_jit_vs_accumulated=_worst(s_w[0], s_r[0])))
    noise = max(r["params_jit_vs_accumulated"] for r in rows)
    off = max(r["params_pipelined_vs_accumulated"] for r in rows)
    loss_off = max(abs(r["loss_pipelined"] - r["loss_accumulated"]) for r in rows)
    loss_noise = max(abs(r["loss_jit"] - r["loss_accumulated"]) for r in rows)
    ok = off <= 4 * noise + 1e-3 and loss_off <= 4 * loss_noise + 1e-3
    return dict(attention=attention, primitives=prims, steps=rows, ok=ok,
                seconds=round(time.time() - t0, 1), devices=str(jax.devices()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    variants = ("xla", "fused") if a.dry_run else ("cudnn", "fused")
    results = []
    for att in variants:
        try:
            r = check(att, a.steps)
        except Exception as e:            # recorded: a refusal or a failure is a finding
            r = dict(attention=att, ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "steps"}), flush=True)
    with open(os.path.join(a.out, "gpu_microbatch_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
