"""The cost model on the GPU at hand (``benchmarks/gpu_check.py``'s ``cost_model`` step,
issue 45): predicted against measured one-device steps, after calibration.

The ``calibration`` step measures the device's roofline (``rhino.calibrate
.calibrate_roofline`` on the first device: matmul efficiency by size in bf16 and float32
(TF32), convolutions, memory bandwidth by size, kernel launch and program dispatch, cuDNN
attention's efficiency) and this step prices each model's one-device step with it
(``rhino.plan(graph, mesh_shape=(1,), cost=<calibrated>)``: the planner's own estimate,
``Plan.step_s``), then times the step under ``jax.jit`` (median of the mode's steps after
two warm-up steps; rhino runs the same program on one device). Models (``Mode.cost_models``):

* ``gpt``: the zoo GPT of the ``single_device`` step (GPT-Medium, bf16), whose measured
  ``jax.jit`` step is reused when it ran at the same batch;
* ``llama``: a bf16 Llama whose attention is cuDNN's fused flash attention
  (``attention="cudnn"``: the ``__cudnn$fmha*`` calls that rhino prices as the kernel runs;
  on the CPU dry run, which has no cuDNN, ``attention="fused"``: rhino's
  ``custom_partitioning`` call, priced as its body runs);
* ``unet``: the zoo UNet (convolutions, float32: TF32 on GPU).

Each record: the estimate and its parts by kernel kind (matmul, convolution, attention,
fused elementwise/reductions, launches, dispatch), the measurement, ``ratio`` (estimate ÷
measured) and ``within`` (|ratio − 1| ≤ ``TOLERANCE``), the estimated MFU, and the plan
report's MFU line.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

TOLERANCE = 0.25


def calibrate(check: Any, rec: dict) -> None:
    """The device's roofline for the ``calibration`` step's record (``rec["roofline"]``) and
    for the ``cost_model`` step (``check.shared["roofline"]``)."""
    from rhino.calibrate import CalibrationSizes, calibrate_roofline

    devices = check.shared.get("devices")
    d0 = devices[0] if devices else None
    if d0 is None:
        import jax
        d0 = jax.devices()[0]
    platform = str(d0.platform).lower()
    sizes = (CalibrationSizes.quick() if check.mode.name == "dry-run" else
             CalibrationSizes.for_platform(platform))
    t = time.perf_counter()
    roof, peaks = calibrate_roofline([d0], sizes)
    rec["roofline"] = roof.to_dict()
    rec["roofline_peaks"] = peaks
    rec["roofline_summary"] = roof.summary()
    rec["roofline_s"] = time.perf_counter() - t
    check.shared["roofline"] = (roof, peaks)


def _kernel_parts(graph: Any, cost: Any) -> dict:
    """Seconds of the one-device step's kernels by kind, launches and dispatch."""
    from rhino.planner.op_cost import OpTimes, kernel_seconds

    times = OpTimes(graph, cost)
    parts: dict[str, float] = {}
    for k in times.kernels:
        size = k.bytes if k.kind == "vector" else k.square_flops
        parts[k.kind] = parts.get(k.kind, 0.0) + kernel_seconds(
            k.kind, k.flops, k.bytes, k.dtype, cost, k.transcendentals, size)
    parts["launches"] = times.launch_seconds()
    parts["kernels"] = float(len(times.kernels))
    parts["dispatch"] = cost.program_seconds()
    return parts


def _model(spec: dict):
    from rhino.models import get_model

    return get_model(spec["zoo"], **spec["options"])


def _state(model, spec: dict, dtype: str | None) -> tuple:
    """Host ``(params, opt_state, batch)``: parameters cast to ``dtype`` (the GPT's, as the
    single_device step runs it) or the zoo's own initialization."""
    import jax

    import gpu_check_training as gt

    if dtype:
        params, opt = gt.host_state(model, dtype)
    else:
        params, opt = jax.device_get(model.init(jax.random.PRNGKey(0)))
    batch = jax.device_get(model.make_batch(jax.random.PRNGKey(1)))
    return params, opt, batch


def _abstract(model, dtype: str | None) -> tuple:
    import jax

    import gpu_check_training as gt

    if dtype:
        return gt.abstract_state(model, dtype)
    return jax.eval_shape(lambda: (*model.init(jax.random.PRNGKey(0)),
                                   model.make_batch(jax.random.PRNGKey(1))))


def measure_jit(model, host: tuple, device: Any, steps: int) -> dict:
    """Median seconds of ``jax.jit(step)`` on ``device`` over ``steps`` steps after two
    warm-up steps, the state fed back."""
    import jax

    call = jax.jit(model.step, donate_argnums=(0, 1))
    params, opt, batch = jax.device_put(host, device)
    t = time.perf_counter()
    params, opt, loss = call(params, opt, batch)
    jax.block_until_ready(loss)
    compile_s = time.perf_counter() - t
    params, opt, loss = call(params, opt, batch)
    jax.block_until_ready(loss)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        params, opt, loss = call(params, opt, batch)
        jax.block_until_ready((params, opt, loss))
        times.append(time.perf_counter() - t)
    return {"step_s": statistics.median(times), "step_times_s": times,
            "first_step_s": compile_s, "loss": float(loss)}


def step_cost_model(check: Any, rec: dict) -> None:
    """Predicted against measured one-device steps (module docstring)."""
    import jax

    import rhino
    from rhino.backends import figures_for_devices
    from rhino.calibrate import cost_model_from_roofline

    devices = check.shared.get("devices") or jax.devices()
    d0 = devices[0]
    if "roofline" not in check.shared:
        calibrate(check, rec)
        rec["calibrated_here"] = "the calibration step did not leave a roofline"
    roof, peaks = check.shared["roofline"]
    fig = figures_for_devices([d0])
    cost = cost_model_from_roofline(roof, peaks, (1,), f"calibrated-{fig.backend}", fig,
                                    memory_bytes=fig.memory_bytes)
    rec["cost_model"] = cost.to_dict()
    rec["tolerance"] = TOLERANCE
    models: dict[str, dict] = {}
    rec["models"] = models
    gpu = str(d0.platform).lower() != "cpu"
    for name, spec in check.mode.cost_models.items():
        row: dict[str, Any] = {}
        models[name] = row
        check.write()
        try:
            spec = dict(spec)
            opts = dict(spec["options"])
            if name == "gpt":
                opts["batch"] = check.shared.get("given_batch") or check.shared.get(
                    "batch") or opts.get("batch", 1)
            if spec["zoo"] == "llama" and not gpu:
                opts["attention"] = "fused"       # no cuDNN on CPU: rhino's fused call
            spec["options"] = opts
            row["model"] = {"zoo": spec["zoo"], **opts, "dtype": spec.get("dtype")}
            model = _model(spec)
            dtype = spec.get("dtype")
            t = time.perf_counter()
            graph = rhino.ingest(model.step, *_abstract(model, dtype))
            plan = rhino.plan(graph, mesh_shape=(1,), cost=cost)
            row["plan_s"] = time.perf_counter() - t
            row["estimate_s"] = plan.step_s
            row["parts_s"] = _kernel_parts(graph, cost)
            row["custom_calls"] = sorted({str(op.attrs.get("custom_call_target"))
                                          for op in graph.ops if op.opcode == "custom-call"})
            util = plan.utilization()
            row["mfu_estimated"] = util.mfu
            row["mfu_line"] = util.line()
            reuse = check.shared.get("single_jit")
            if name == "gpt" and reuse and reuse[0] == opts["batch"]:
                row["measured_s"] = reuse[1]
                row["measured_from"] = "single_device step (jax.jit)"
            else:
                got = measure_jit(model, _state(model, spec, dtype), d0, check.mode.steps)
                row["measured_s"] = got["step_s"]
                row["step_times_s"] = got["step_times_s"]
                row["measured_from"] = f"jax.jit, median of {check.mode.steps} steps"
            row["ratio"] = row["estimate_s"] / row["measured_s"]
            row["within"] = abs(row["ratio"] - 1) <= TOLERANCE
        except Exception as e:  # noqa: BLE001 - one model's failure is its row's
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    failed = [k for k, r in models.items() if "error" in r]
    if failed:
        raise RuntimeError("cost_model: " + "; ".join(f"{k}: {models[k]['error'][:300]}"
                                                      for k in failed))


def markdown(results: dict) -> list[str]:
    """The ``cost_model`` step as a table (empty when it did not run)."""
    from gpu_check_report import _f, _get, _one_line, _pct

    rec = _get(results, "steps", "cost_model") or {}
    models = rec.get("models") or {}
    if not models:
        return []
    out = ["| one-device step | estimated ms | measured ms | estimate ÷ measured | within "
           f"±{100 * TOLERANCE:.0f} % | est. MFU | matmul / conv / attention / fused / "
           "launches + dispatch ms |", "|---|---:|---:|---:|---|---:|---|"]
    for name, row in models.items():
        m = row.get("model") or {}
        label = f"{name} ({m.get('zoo', '?')}, batch {m.get('batch', '?')}" + \
            (f", {m['attention']} attention" if m.get("attention") else "") + ")"
        if "error" in row:
            out.append(f"| {label} | — | — | — | error: {_one_line(row['error'], 100)} | — "
                       f"| — |")
            continue
        p = row.get("parts_s") or {}
        parts = " / ".join(_f(p.get(k, 0.0), ".1f", 1e3) for k in
                           ("matmul", "conv", "attention", "vector")) + \
            f" / {_f(p.get('launches', 0.0) + p.get('dispatch', 0.0), '.1f', 1e3)}"
        out.append(f"| {label} | {_f(row.get('estimate_s'), '.2f', 1e3)} | "
                   f"{_f(row.get('measured_s'), '.2f', 1e3)} | {_f(row.get('ratio'), '.2f')} "
                   f"| {'yes' if row.get('within') else '**no**'} | "
                   f"{_pct(row.get('mfu_estimated'))} | {parts} |")
    summary = _get(results, "steps", "calibration", "roofline_summary")
    if summary:
        out += ["", f"Calibrated roofline: {_one_line(summary, 400)}."]
    return out + [""]
