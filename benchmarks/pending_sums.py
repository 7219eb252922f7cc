"""Pending sums carried through linear ops (issue 46, acceptance 1): the zoo planned with
``auto_parallel``'s SPMD build options, with and without ``partial_passthrough``, on 8
simulated CPU devices.

    python benchmarks/pending_sums.py                       # mlp, gpt, vgg19, unet, dnabert
    python benchmarks/pending_sums.py --models moe,wide_resnet --meshes "8;2,4"
    python benchmarks/pending_sums.py --plan-only --opt-level O2     # search times only

For each model, mesh and setting, the plan is made with ``rhino.plan`` (O3 unless
``--opt-level``) and run with ``auto_parallel(plan=...)``; one JSON line gives the
estimated step, the bytes per device the plan moves and the compiled program moves
(``count_collectives`` of its HLO), whether the two agree kind by kind, and the largest
difference from ``jax.jit``'s first step relative to the largest value of that leaf, and
the seconds ``rhino.plan`` took (tracing included; ``--plan-only``: plan and time only).
With ``--markdown`` a table follows, as in RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import rhino  # noqa: E402
from rhino.front_door import PlanRequest  # noqa: E402
from rhino.models import get_model  # noqa: E402
from rhino.runtime.executors.spmd import count_collectives, summarize  # noqa: E402


def _mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape) or int(np.prod(shape)) > 8:
        raise argparse.ArgumentTypeError(f"a mesh of at most 8 devices such as 8 or 2,4; "
                                         f"found {text!r}")
    return shape


def _rel_err(got, want) -> float:
    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if b.size:
            worst = max(worst, float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)))
    return worst


def measure(name: str, mesh: tuple[int, ...], passthrough: bool, opt_level: str,
            plan_only: bool = False) -> dict:
    m = get_model(name)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    build = dataclasses.replace(PlanRequest().build_options(pipeline=False),
                                partial_passthrough=passthrough)
    t0 = time.perf_counter()
    made = rhino.plan(m.step, params, opt, batch, mesh_shape=mesh, opt_level=opt_level,
                      build=build, progress=lambda _: None)
    seconds = round(time.perf_counter() - t0, 2)
    head = {"model": name, "mesh": list(mesh), "passthrough": passthrough,
            "opt_level": opt_level, "plan_s": seconds,
            "estimate_ms": round(made.spmd.step_time_s * 1e3, 4)}
    if plan_only:
        return head
    step = rhino.auto_parallel(m.step, plan=made, devices=jax.devices()[:int(np.prod(mesh))],
                               report=False, donate=False)
    compiled = summarize(count_collectives(step.compiled_text(params, opt, batch)))
    planned = made.spmd.collective_summary()
    err = _rel_err(step(params, opt, batch), jax.jit(m.step)(params, opt, batch))
    return {**head, "planned_bytes": sum(b for _, b in planned.values()),
            "compiled_bytes": sum(b for _, b in compiled.values()),
            "agree": compiled == planned, "rel_err_vs_jit": float(f"{err:.2g}")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,gpt,vgg19,unet,dnabert")
    ap.add_argument("--meshes", default="8;2,4", help="meshes separated by ';'")
    ap.add_argument("--opt-level", default="O3", choices=("O2", "O3"))
    ap.add_argument("--plan-only", action="store_true", help="plan and time only")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    meshes = [_mesh(t) for t in a.meshes.split(";")]
    rows = []
    for name in a.models.split(","):
        for mesh in meshes:
            for passthrough in (False, True):
                row = measure(name, mesh, passthrough, a.opt_level, a.plan_only)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.markdown and a.plan_only:
        print(f"| model | mesh | {a.opt_level} plan s, off | on | estimate ms, off | on |")
        print("|---|---|---:|---:|---:|---:|")
        for off, on in zip(rows[::2], rows[1::2]):
            print(f"| {off['model']} | {tuple(off['mesh'])} | {off['plan_s']} | {on['plan_s']} "
                  f"| {off['estimate_ms']} | {on['estimate_ms']} |")
    elif a.markdown:
        print("| model | mesh | estimate off ms | estimate on ms | on: planned / compiled B "
              "| agree off / on | rel. err. on |")
        print("|---|---|---:|---:|---:|---|---:|")
        for off, on in zip(rows[::2], rows[1::2]):
            print(f"| {off['model']} | {tuple(off['mesh'])} | {off['estimate_ms']} | "
                  f"{on['estimate_ms']} | {on['planned_bytes']:,} / {on['compiled_bytes']:,} "
                  f"| {'yes' if off['agree'] else 'no'} / {'yes' if on['agree'] else 'no'} | "
                  f"{on['rel_err_vs_jit']:g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
