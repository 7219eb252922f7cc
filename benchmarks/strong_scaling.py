"""Strong scaling of rhino.auto_parallel (issue 4, item 5; the Rhino paper's §7.3).

GPT-Medium shapes (hidden 1024, ffn 4096, 16 heads; fewer layers, smaller seq / vocab) with a
fixed global batch, planned and compiled by ``rhino.auto_parallel`` on 1-D meshes of 2, 4 and
8 simulated CPU devices (and 1 device as the reference). Per size: the plan's per-parameter
specs summarized by role (layer index folded; Adam's mu/nu shown apart from the weights),
what changed from the previous size, the bytes the plan predicts against the bytes counted in
the compiled HLO (``rhino.runtime.executors.spmd.count_collectives``), memory per device (the plan's
liveness estimate and ``compiled.memory_analysis()``: argument + output + temp − alias), the
estimated and the measured step time (median of ``--runs`` after two warm-up steps; simulated
devices share this machine's cores, so measured times do not scale and are indicative only),
and the first two losses against single-device ``jax.jit`` (rtol 1e-4).

    python benchmarks/strong_scaling.py --out benchmarks/out/strong_scaling.jsonl
    python benchmarks/strong_scaling.py --seq 128 --out benchmarks/out/strong_scaling_s128.jsonl
    python benchmarks/strong_scaling.py --table benchmarks/out/strong_scaling.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict

CONFIG = dict(preset="GPT-Medium", layers=2, seq=64, vocab=8192, batch=8)  # as spmd_vs_peers
SIZES = (1, 2, 4, 8)
RTOL = 1e-4


def role(path: str) -> str:
    """``opt_state[0].mu['layers'][1]['w1']`` -> ``adam['layers'][i]['w1']``."""
    r = re.sub(r"\[\d+\]", "[i]", path.replace("params", "", 1) if path.startswith("params")
               else path)
    r = re.sub(r"^opt_state\[i\]\.(mu|nu)", "adam", r)
    return r


def summarize_specs(plan) -> dict[str, str]:
    """Role -> spec(s) (joined with '/' when the layers differ)."""
    specs = defaultdict(set)
    for p in plan.params:
        specs[role(p.path)].add(p.spec.to_str(plan.mesh))
    return {k: "/".join(sorted(v)) for k, v in specs.items()}


def run_size(n: int, runs: int, out_path: str, seq: int) -> dict:
    import jax

    import rhino
    from rhino.models import get_model
    from rhino.runtime.executors.spmd import compiled_memory, count_collectives, summarize

    config = dict(CONFIG, seq=seq)
    model = get_model("gpt", **config)
    example = model.example_args()
    host = jax.device_get((*model.init(jax.random.PRNGKey(0)),
                           model.make_batch(jax.random.PRNGKey(1))))
    row: dict = {"devices": n, "config": config}
    t0 = time.perf_counter()
    if n == 1:
        call = jax.jit(model.step, donate_argnums=(0, 1))
        compiled = call.lower(*example).compile()
        in_sh = jax.tree.leaves(compiled.input_shardings[0])
        hlo = compiled.as_text()
    else:
        call = rhino.auto_parallel(model.step, devices=jax.devices()[:n], mesh_shape=(n,))
        entry = call._entry(example)
        compiled, plan = entry.run.compiled, entry.plan.spmd
        in_sh = entry.run.lowering.in_shardings
        hlo = call.compiled_text(*example)
        row.update(specs=summarize_specs(plan),
                   param_specs={p.path: p.spec.to_str(plan.mesh) for p in plan.params},
                   predicted_bytes=int(sum(c.bytes for c in plan.collectives)),
                   predicted={k: list(v) for k, v in plan.collective_summary().items()},
                   predicted_peak=plan.memory.peak, predicted_param_bytes=plan.memory.parameters,
                   estimated_step_s=plan.step_time_s, search_s=plan.search.total_s)
    row["compile_s"] = time.perf_counter() - t0
    colls = count_collectives(hlo)
    row["bytes"] = int(sum(c.bytes for c in colls))
    row["collectives"] = {k: list(v) for k, v in summarize(colls).items()}
    row["memory"] = compiled_memory(compiled)

    flat, tree = jax.tree_util.tree_flatten(host)
    args = jax.tree_util.tree_unflatten(tree, [jax.device_put(x, s) for x, s in zip(flat, in_sh)])
    state, batch = args[:2], args[2]
    losses, times = [], []
    for k in range(2 + runs):
        t = time.perf_counter()
        params, opt, loss = call(*state, batch)
        state = jax.block_until_ready((params, opt))
        loss = float(loss)
        if k < 2:
            losses.append(loss)
        else:
            times.append(time.perf_counter() - t)
    row["losses"] = losses
    row["step_s"] = statistics.median(times)
    row["step_s_all"] = times
    print(json.dumps(row), flush=True)
    with open(out_path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def _mib(b):
    return f"{b / 2**20:.1f}"


def tables(rows: list[dict]) -> str:
    rows = sorted(rows, key=lambda r: r["devices"])
    ref = next((r for r in rows if r["devices"] == 1), None)
    out = ["GPT " + ", ".join(f"{k}={v}" for k, v in rows[0]["config"].items()) + "; mesh (n,)",
           "",
           "| devices | collectives counted (count, MiB) | predicted MiB | counted MiB | "
           "counted ÷ predicted | predicted peak MiB | compiled peak MiB/device | "
           "state+batch MiB/device | est. step ms | measured step s | losses = 1 device |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        colls = ", ".join(f"{k} ×{c} ({_mib(b)})" for k, (c, b) in r["collectives"].items())
        if ref is not None and r is not ref:
            err = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
            ok = f"{'yes' if err <= RTOL else '**NO**'} ({err:.1e})"
        else:
            ok = "reference"
        pb = r.get("predicted_bytes")
        out.append(
            f"| {r['devices']} | {colls or 'none'} | {_mib(pb) if pb is not None else '—'} | "
            f"{_mib(r['bytes'])} | {r['bytes'] / pb if pb else float('nan'):.2f} | "
            f"{_mib(r['predicted_peak']) if 'predicted_peak' in r else '—'} | "
            f"{_mib(r['memory']['peak'])} | {_mib(r['memory']['argument'])} | "
            f"{1e3 * r['estimated_step_s'] if 'estimated_step_s' in r else float('nan'):.1f} | "
            f"{r['step_s']:.3f} | {ok} |")
    planned = [r for r in rows if "specs" in r]
    if planned:
        roles = list(dict.fromkeys(k for r in planned for k in r["specs"]))
        out.append("")
        out.append("Per-parameter specs by role (layer index folded to [i]; `adam...` = Adam "
                   "mu and nu; bold where the spec differs from the previous size):")
        out.append("")
        out.append("| role | " + " | ".join(f"{r['devices']} devices" for r in planned) + " |")
        out.append("|---|" + "---|" * len(planned))
        for k in roles:
            cells, prev = [], None
            for r in planned:
                s = r["specs"].get(k, "")
                cells.append(f"**{s}**" if prev is not None and s != prev else s)
                prev = s
            out.append(f"| `{k}` | " + " | ".join(cells) + " |")
        out.append("")
        for a, b in zip(planned, planned[1:]):
            changed = [p for p in b["param_specs"] if a["param_specs"].get(p) != b["param_specs"][p]]
            out.append(f"- {a['devices']} → {b['devices']} devices: {len(changed)} of "
                       f"{len(b['param_specs'])} parameter specs change"
                       + (": " + ", ".join(f"`{p}` {a['param_specs'][p]} → "
                                            f"{b['param_specs'][p]}" for p in changed[:12])
                          + (" ..." if len(changed) > 12 else "") if changed else ""))
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seq", type=int, default=CONFIG["seq"], help="sequence length")
    p.add_argument("--out", default="benchmarks/out/strong_scaling.jsonl")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--table")
    a = p.parse_args()
    if a.table:
        print(tables([json.loads(l) for l in open(a.table) if l.strip()]))
        return
    if a.one:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8")
        run_size(a.one, a.runs, a.out, a.seq)
        return
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    open(a.out, "w").close()
    for n in (int(s) for s in a.sizes.split(",")):  # a fresh process per size
        subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(n),
                        "--runs", str(a.runs), "--seq", str(a.seq), "--out", a.out],
                       check=False)
    print(tables([json.loads(l) for l in open(a.out) if l.strip()]))


if __name__ == "__main__":
    main()
