"""Uneven splits (issue 46, acceptance 2): GPT with GPT-2's vocabulary of 50257 on 8
simulated CPU devices, planned and run with and without splits its shards do not divide.

    python benchmarks/uneven.py --uneven on  --steps 20     # the default SPMD plan
    python benchmarks/uneven.py --uneven off --steps 20     # even splits only (before)
    python benchmarks/uneven.py --vocab 50304 --steps 20    # the vocabulary padded by hand

Each run plans with ``auto_parallel``'s build options (``--uneven off`` takes ``uneven``
out of them) through ``rhino.plan``, runs the plan with ``auto_parallel(plan=...)``, checks the compiled program's collectives against the plan's and the first
step against ``jax.jit``, then times ``--steps`` steps after two warm-up steps and prints
one JSON line: the estimate, the planned and compiled collective bytes per device, the
embedding's spec and the median step time. Time whole runs with ``farm-bench`` for
RESULTS.md; the step median is the figure that compares plans.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import rhino  # noqa: E402
from rhino.front_door import PlanRequest  # noqa: E402
from rhino.models import get_model  # noqa: E402
from rhino.runtime.executors.spmd import count_collectives, summarize  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--uneven", choices=("on", "off"), default="on")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--opt-level", default="O2", choices=("O2", "O3"))
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps: expected at least 1, found {a.steps}")
    m = get_model("gpt", layers=a.layers, hidden=a.hidden, vocab=a.vocab)
    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    build = dataclasses.replace(PlanRequest(opt_level=a.opt_level).build_options(False),
                                uneven=a.uneven == "on")
    t0 = time.perf_counter()
    made = rhino.plan(m.step, params, opt, batch, mesh_shape=(8,), opt_level=a.opt_level,
                      build=build, progress=lambda _: None)
    step = rhino.auto_parallel(m.step, plan=made, report=False)
    plan = step.plan_for(params, opt, batch).spmd
    compiled = summarize(count_collectives(step.compiled_text(params, opt, batch)))
    planned = plan.collective_summary()
    ready_s = time.perf_counter() - t0

    want = jax.jit(m.step)(params, opt, batch)
    p, o = jax.tree.map(jnp.copy, (params, opt))
    p, o, loss = step(p, o, batch)
    # Adam moves an element whose gradient is ~0 by up to a learning rate whichever way
    # another summation order rounds it: parameters agree to rtol 1e-4 + atol lr.
    lr = m.config.learning_rate
    ok = abs(float(loss) - float(want[2])) <= 1e-5 * abs(float(want[2])) and all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=lr)
        for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(want[0])))
    p, o, loss = step(p, o, batch)
    jax.block_until_ready(loss)
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        p, o, loss = step(p, o, batch)
        jax.block_until_ready((p, o, loss))
        times.append(time.perf_counter() - t)
    out = {
        "vocab": a.vocab, "hidden": a.hidden, "layers": a.layers, "uneven": a.uneven,
        "opt_level": a.opt_level,
        "wte_spec": plan.param_spec("params['wte']").to_str(plan.mesh),
        "estimate_ms": round(plan.step_time_s * 1e3, 3),
        "communication_ms": round(plan.communication_s * 1e3, 3),
        "planned_bytes": sum(b for _, b in planned.values()),
        "compiled_bytes": sum(b for _, b in compiled.values()),
        "planned": planned, "compiled": compiled,
        "plan_and_compile_s": round(ready_s, 2),
        "step_ms_median": round(statistics.median(times) * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2), "step_ms_max": round(max(times) * 1e3, 2),
        "matches_jit": ok,
    }
    print(json.dumps(out))
    return 0 if ok and compiled == planned else 1


if __name__ == "__main__":
    sys.exit(main())
