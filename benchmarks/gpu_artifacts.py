"""Stage programs exported on a machine without a GPU, run from their artifacts on a GPU
(issue 30, acceptance 6), against ``jax.jit`` on the same GPU.

    python benchmarks/gpu_artifacts.py --out DIR [--steps 5] [--precision highest] [--dry-run]

Three processes, as a cluster would have them:

  export     ``JAX_PLATFORMS=cpu`` (a driver with no GPU): plans the zoo GPT as a 2-stage
             pipeline (``cluster="1x2"``, 4 microbatches, 1F1B), and ``save_stages`` lowers
             every stage program for ``cuda``; saves the arguments and batches (``.npz``).
  run        on the GPU: imports rhino, jax and numpy only (never the model's code),
             ``SavedPipeline`` compiles the artifacts (both stages on the one GPU when
             there is one) and trains ``steps`` steps, results fed back as state.
  reference  on the GPU: ``jax.jit`` of the same step, same batches.

Writes ``DIR/gpu_artifacts.json``: per step both losses, the trained state's difference
(per leaf ``|a - b| / |b|`` in the 2-norm, its largest; and the largest element), the
steady-state step times (median) and the artifacts' sizes. Exit status 1 if a loss differs
by more than 1e-4 (relative) or a state leaf by more than 1e-3 (relative norm). An element
of Adam's state whose gradient is near eps moves by up to lr per step on a different
summation order, so the largest element difference is reported, not checked.
``--precision``: ``JAX_DEFAULT_MATMUL_PRECISION`` for all three processes (on GPU the
default is TF32). ``--dry-run``: everything on CPU, toy sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GPT = dict(layers=4, hidden=256, heads=4, seq=128, vocab=1024, batch=16)
TOY = dict(layers=2, hidden=64, heads=2, seq=16, vocab=256, batch=8)


def _model(cfg):
    from rhino.models import get_model

    return get_model("gpt", **cfg)


def export(out: str, steps: int, cfg: dict, platform: str) -> dict:
    import jax
    import numpy as np

    import rhino

    m = _model(cfg)
    params, opt = m.init(jax.random.PRNGKey(0))
    batches = [m.make_batch(jax.random.PRNGKey(10 + i)) for i in range(steps)]
    state = jax.tree_util.tree_leaves((params, opt))
    t0 = time.perf_counter()
    with rhino.auto_parallel(m.step, cluster="1x2", stages=2, num_microbatches=4,
                             report=False) as step:
        step.plan_for(params, opt, batches[0])
        path = step.save_stages(out, params, opt, batches[0], platform=platform)
    np.savez(os.path.join(out, "state.npz"), *[np.asarray(x) for x in state])
    for i, b in enumerate(batches):
        np.savez(os.path.join(out, f"batch{i}.npz"),
                 *[np.asarray(x) for x in jax.tree_util.tree_leaves(b)])
    return {"export_s": round(time.perf_counter() - t0, 2), "file": path,
            "bytes": os.path.getsize(path), "state_leaves": len(state)}


def _load(path):
    import numpy as np

    got = np.load(path)
    return [got[f"arr_{i}"] for i in range(len(got.files))]


def run(out: str, steps: int) -> dict:
    """Rhino, jax, numpy only: the stage programs from their artifacts."""
    import jax
    import numpy as np

    from rhino.runtime.executors.artifacts import SavedPipeline, load

    arts = load(out)
    dev = jax.local_devices()
    need = sum(int(np.prod(a.mesh_shape)) for a in arts)
    per = None if len(dev) >= need else [dev[:int(np.prod(a.mesh_shape))] for a in arts]
    state = _load(os.path.join(out, "state.npz"))
    losses, times = [], []
    t0 = time.perf_counter()
    with SavedPipeline(arts, devices=per) as pipe:
        built = time.perf_counter() - t0
        for i in range(steps):
            batch = _load(os.path.join(out, f"batch{i}.npz"))
            t = time.perf_counter()
            res = pipe(*state, *batch)
            jax.block_until_ready(res)
            times.append(time.perf_counter() - t)
            state, loss = list(res[:len(state)]), res[-1]
            losses.append(float(loss))
    np.savez(os.path.join(out, "run_state.npz"), *[np.asarray(x) for x in state])
    return {"losses": losses, "step_s": times, "build_s": round(built, 3),
            "devices": [str(d) for d in dev], "platform": arts[0].platform,
            "stage_devices": "shared" if per else "own",
            "artifact_bytes": [a.nbytes for a in arts],
            "modules_of_the_model_imported": sorted(m for m in sys.modules
                                                     if m.startswith("rhino.models"))}


def reference(out: str, steps: int, cfg: dict) -> dict:
    import jax
    import numpy as np

    m = _model(cfg)
    params, opt = m.init(jax.random.PRNGKey(0))
    step = jax.jit(m.step)
    losses, times = [], []
    for i in range(steps):
        batch = m.make_batch(jax.random.PRNGKey(10 + i))
        t = time.perf_counter()
        params, opt, loss = step(params, opt, batch)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    np.savez(os.path.join(out, "ref_state.npz"),
             *[np.asarray(x) for x in jax.tree_util.tree_leaves((params, opt))])
    return {"losses": losses, "step_s": times, "device": str(jax.devices()[0])}


def _child(role: str, a, env_extra: dict) -> dict:
    env = dict(os.environ, **env_extra)
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--out", a.out,
           "--steps", str(a.steps)] + (["--dry-run"] if a.dry_run else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{role} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(xs):
    xs = sorted(xs[1:] or xs)          # the first step compiles
    return xs[len(xs) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--precision", default=None, choices=("default", "high", "highest"))
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--role", choices=("export", "run", "reference"), default=None)
    a = ap.parse_args(argv)
    cfg = TOY if a.dry_run else GPT
    os.makedirs(a.out, exist_ok=True)
    if a.role == "export":
        print(json.dumps(export(a.out, a.steps, cfg, "cpu" if a.dry_run else "cuda")))
        return 0
    if a.role == "run":
        print(json.dumps(run(a.out, a.steps)))
        return 0
    if a.role == "reference":
        print(json.dumps(reference(a.out, a.steps, cfg)))
        return 0
    import numpy as np

    cpu2 = {"JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    gpu = cpu2 if a.dry_run else {}
    if a.precision:
        cpu2 = dict(cpu2, JAX_DEFAULT_MATMUL_PRECISION=a.precision)
        gpu = dict(gpu, JAX_DEFAULT_MATMUL_PRECISION=a.precision)
    res = {"config": cfg, "steps": a.steps, "precision": a.precision or "default"}
    res["export"] = _child("export", a, cpu2)
    res["run"] = _child("run", a, gpu)
    res["reference"] = _child("reference", a, gpu)
    mine, ref = _load(os.path.join(a.out, "run_state.npz")), \
        _load(os.path.join(a.out, "ref_state.npz"))
    res["max_state_diff"] = float(max(np.max(np.abs(x.astype(np.float64) - y))
                                      for x, y in zip(mine, ref)))
    res["max_state_rel_norm_diff"] = float(max(
        np.linalg.norm((x.astype(np.float64) - y).ravel())
        / max(np.linalg.norm(y.astype(np.float64).ravel()), 1e-30)
        for x, y in zip(mine, ref)))
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(res["run"]["losses"],
                                                          res["reference"]["losses"])]
    res["max_loss_rel_diff"] = max(rel)
    res["median_step_s"] = {"artifacts": _median(res["run"]["step_s"]),
                            "jax_jit": _median(res["reference"]["step_s"])}
    res["ok"] = bool(max(rel) <= 1e-4 and res["max_state_rel_norm_diff"] <= 1e-3
                     and not res["run"]["modules_of_the_model_imported"])
    with open(os.path.join(a.out, "gpu_artifacts.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("precision", "max_loss_rel_diff",
                                          "max_state_rel_norm_diff", "max_state_diff",
                                          "median_step_s", "ok")}))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
