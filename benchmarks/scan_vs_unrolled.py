"""GPT written with ``lax.scan`` over stacked layers against the same GPT unrolled
(issue 15, acceptance 1): what ``auto_parallel`` plans and compiles for each.

For each configuration (layers, hidden, mesh, remat) both forms are planned with O2 on 8
simulated CPU devices and compiled; a row gives the plan's collective bytes per step, the
compiled per-device peak (XLA's ``memory_analysis``), the estimated step time and the
parameter bytes per device the plan holds, for the unrolled step, the scanned step
(unrolled by ``hlo_passes.unroll``), and the scanned step with its loop kept opaque
(``UNROLL_LIMIT = 0``: the behaviour before). Each configuration runs in its own process.

    python benchmarks/scan_vs_unrolled.py --out benchmarks/out/scan_vs_unrolled.jsonl
    python benchmarks/scan_vs_unrolled.py --table benchmarks/out/scan_vs_unrolled.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = [(3, 256, "8", False), (4, 256, "8", False), (6, 256, "8", False),
           (4, 512, "8", False), (4, 256, "2,4", False), (3, 256, "8", True),
           (6, 256, "8", True)]


def one(layers: int, hidden: int, mesh: str, remat: bool) -> list[dict]:
    import jax

    import rhino
    from rhino.hlo_passes import unroll
    from rhino.models import get_model

    rows = []
    for form in ("unrolled", "scan", "scan, loop kept"):
        unroll.UNROLL_LIMIT = 0 if form == "scan, loop kept" else 128
        m = get_model("gpt", layers=layers, hidden=hidden, heads=8, seq=64, batch=8,
                      scan=form != "unrolled", remat=remat)
        params, opt = m.init(jax.random.PRNGKey(0))
        batch = m.make_batch(jax.random.PRNGKey(1))
        step = rhino.auto_parallel(m.step, mesh_shape=tuple(int(x) for x in mesh.split(",")))
        plan = step.plan_for(params, opt, batch).spmd
        rows.append(dict(layers=layers, hidden=hidden, mesh=mesh, remat=remat, form=form,
                         bytes=sum(c.bytes for c in plan.collectives),
                         peak=step.memory_for(params, opt, batch)["peak"],
                         step_ms=1e3 * plan.step_time_s, params=plan.memory.parameters))
    return rows


def table(rows: list[dict]) -> str:
    out = ["| layers | hidden | mesh | remat | bytes unrolled | bytes scan | ratio | "
           "peak unrolled MB | peak scan MB | ratio | peak loop kept MB | est. step ms "
           "unrolled / scan |", "|" + "---:|" * 12]
    key = lambda r: (r["layers"], r["hidden"], r["mesh"], r["remat"])  # noqa: E731
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), {})[r["form"]] = r
    for (layers, hidden, mesh, remat), g in groups.items():
        u, s, loop = g["unrolled"], g["scan"], g["scan, loop kept"]
        out.append(f"| {layers} | {hidden} | ({mesh}) | {'yes' if remat else 'no'} | "
                   f"{u['bytes']:,} | {s['bytes']:,} | {s['bytes'] / u['bytes']:.3f} | "
                   f"{u['peak'] / 1e6:.2f} | {s['peak'] / 1e6:.2f} | "
                   f"{s['peak'] / u['peak']:.3f} | {loop['peak'] / 1e6:.2f} | "
                   f"{u['step_ms']:.2f} / {s['step_ms']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON lines to write")
    ap.add_argument("--table", help="print the table of a JSON lines file")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.table:
        print(table([json.loads(x) for x in open(a.table)]))
        return
    if a.one:
        layers, hidden, mesh, remat = json.loads(a.one)
        for r in one(layers, hidden, mesh, remat):
            print("ROW " + json.dumps(r), flush=True)
        return
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    rows = []
    for cfg in CONFIGS:
        res = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)], env=env,
                             capture_output=True, text=True, timeout=1800)
        if res.returncode:
            raise SystemExit(f"{cfg}: exited {res.returncode}\n{res.stderr[-3000:]}")
        got = [json.loads(x[4:]) for x in res.stdout.splitlines() if x.startswith("ROW ")]
        rows += got
        print(f"{cfg}: " + ", ".join(f"{r['form']} {r['bytes']:,} B {r['peak'] / 1e6:.2f} MB"
                                      for r in got), flush=True)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))


if __name__ == "__main__":
    main()
