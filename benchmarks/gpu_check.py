"""rhino on the GPUs at hand, in one command (issue 32): everything that matters, as files.

    python benchmarks/gpu_check.py --out DIR [--quick] [--dry-run] [--batch N]
                                   [--steps NAME,...] [--budget-s S] [--fail-step NAME]

Steps, in this order; each is recorded with its outcome, its time and, where it failed,
the exception and the end of its traceback. A failure in one step does not stop the others
(a step that needs an earlier one's result says so and is skipped); a step that would
start after ``--budget-s`` is skipped, so the check ends in time:

  environment    jax / jaxlib / CUDA versions, the jax and NVIDIA packages, the devices
                 (kind, count, allocator memory), ``nvidia-smi``, ``XLA_*`` variables.
  calibration    what ``rhino.calibrate`` measures on the first device: matmul FLOP/s in
                 float32 (TF32 on GPU, JAX's default precision) and bfloat16, memory
                 bandwidth, launch latency; with several devices the all-reduce α and β
                 over all of them; each beside ``rhino.backends``' figure (measured ÷ figure);
                 and the device's whole roofline (``calibrate_roofline``: matmul and
                 convolution efficiency by size, bandwidth by size, launch per kernel,
                 cuDNN attention), for the cost_model step.
  batch          the largest power-of-two batch whose compiled ``jax.jit`` step needs at
                 most half the allocator's memory: fitted from the compiled memory at batch
                 1, then checked by compiling at that batch (``--batch`` gives it instead).
  single_device  the zoo GPT (GPT-Medium shapes: 24 layers, hidden 1024, 16 heads; vocab
                 50304, sequence 1024, bfloat16) for ``steps`` steps under ``jax.jit`` and
                 under ``rhino.auto_parallel`` on device 0 (``gpu_check_training``).
  cost_model     the cost model after calibration against measured one-device steps:
                 GPT-Medium, a bf16 Llama with cuDNN's fused attention and the UNet, each
                 priced by ``rhino.plan`` with the calibrated roofline and timed under
                 ``jax.jit`` (``gpu_check_cost``; target: within ±25 %).
  hlo            the step's HLO text as lowered for this backend (what the planner reads;
                 ``gpt_step.hlo``), XLA's optimized program (``gpt_step.compiled.hlo``)
                 and a causal-attention step with ``jax.nn.dot_product_attention`` (cuDNN on
                 GPU; ``attention_step.hlo``), with the custom-call targets each holds.
  plan           ``rhino plan FILE --mesh N`` (N = the devices, or 8 on one GPU; the
                 device's built-in figures) of both lowered files, as a subprocess on CPU:
                 ``rhino_plan_gpt.txt``, ``rhino_plan_attention.txt``.
  spmd           with several devices: the GPT at (batch × devices) on all of them,
                 ``jax.jit`` data parallel against rhino's SPMD plan.
  pipeline       with two or more: ``rhino.auto_parallel(step, cluster="1xK", stages=2)``
                 (local executor, K the largest even device count) against ``jax.jit``
                 data parallel on the same K devices.

Files in DIR: ``gpu_check.json`` (every figure; rewritten after each step, so a process
killed mid-way leaves the finished steps and ``"running"`` on the one it was in),
``gpu_check.md`` (a table to paste into ``benchmarks/RESULTS.md``) and the HLO and plan
files above. Exit status: 0 every step ok or skipped, 1 a step failed, 2 a usage error
(or no GPU without ``--dry-run``).

``--quick``: 6 layers and 10 steps (a smoke test of a new machine in about 2 minutes).
``--dry-run``: the same code on 4 simulated CPU devices at toy sizes (2 layers, hidden
64, sequence 32, 3 steps), so the multi-device steps run too; the default test suite runs
it (``tests/test_gpu_check.py``). ``--fail-step NAME`` makes that step raise at its start
(to check that a failure is recorded and the others go on). How to run it on a GPU
machine and what each figure means: ``docs/gpu_check.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_check_cost  # noqa: E402  (benchmarks/gpu_check_cost.py)
import gpu_check_report  # noqa: E402  (benchmarks/gpu_check_report.py)

STEP_NAMES = ("environment", "calibration", "batch", "single_device", "cost_model", "hlo",
              "plan", "spmd", "pipeline")
DRY_RUN_DEVICES = 4
GPT_MEDIUM = dict(preset="GPT-Medium", seq=1024, vocab=50304)
# The cost_model step's one-device steps (gpu_check_cost): the GPT (batch of the batch step),
# a bf16 Llama with cuDNN's fused attention (Llama-3.2-1B shapes, 2 layers), the UNet.
COST_MODELS = {
    "gpt": {"zoo": "gpt", "options": GPT_MEDIUM, "dtype": "bfloat16"},
    "llama": {"zoo": "llama", "options": dict(layers=2, hidden=2048, ffn=8192, heads=32,
                                              kv_heads=8, vocab=32000, seq=2048, batch=8,
                                              attention="cudnn")},
    "unet": {"zoo": "unet", "options": dict(batch=32, image=64, base_channels=64, depth=3)},
}


@dataclasses.dataclass(frozen=True)
class Mode:
    """The sizes of one kind of run.

    Attributes:
        name: ``full``, ``quick`` or ``dry-run``.
        model: zoo GPT options (the batch is fitted or given).
        dtype: parameters, optimizer state and activations.
        steps: training steps per run.
        batch_cap: the largest batch per device tried.
        memory_fraction: of the allocator's limit, what the jit step may need.
        matmul_n, reps: calibration matmul size and timed repetitions.
        bandwidth_bytes, latency_reps, collective_bytes: the other calibrations' sizes.
        plan_mesh: the mesh ``rhino plan`` plans the HLO file for on one device.
        plan_timeout_s, stage_timeout_s: the plan subprocess's and a pipeline wait's limit.
        budget_s: no step starts after this many seconds (one device);
        multi_device_s: added to it with several devices (two more comparisons).
        microbatches: of the pipeline.
        attention: (batch, seq, heads, head_dim) of the attention step.
        cost_models: the cost_model step's models (``gpu_check_cost``): name -> zoo name,
            options and parameter dtype.
    """

    name: str
    model: dict
    dtype: str
    steps: int
    batch_cap: int
    memory_fraction: float
    matmul_n: int
    reps: int
    bandwidth_bytes: int
    latency_reps: int
    collective_bytes: tuple[int, ...]
    plan_mesh: int
    plan_timeout_s: float
    stage_timeout_s: float
    budget_s: float
    multi_device_s: float
    microbatches: int
    attention: tuple[int, int, int, int]
    cost_models: dict = dataclasses.field(default_factory=lambda: dict(COST_MODELS))


FULL = Mode("full", GPT_MEDIUM, "bfloat16", 20, 64, 0.5, 8192, 10, 1 << 30, 200,
            (1 << 10, 1 << 20, 1 << 26), 8, 300.0, 300.0, 420.0, 300.0, 4, (4, 1024, 16, 64))
_QUICK_COSTS = {"gpt": dict(COST_MODELS["gpt"], options={**GPT_MEDIUM, "layers": 6}),
                "llama": COST_MODELS["llama"],
                "unet": dict(COST_MODELS["unet"], options=dict(batch=8, image=64,
                                                               base_channels=64, depth=3))}
_TOY_COSTS = {
    "gpt": {"zoo": "gpt", "options": dict(layers=2, hidden=64, heads=4, seq=32, vocab=256),
            "dtype": "bfloat16"},
    "llama": {"zoo": "llama", "options": dict(layers=2, hidden=64, ffn=128, heads=4,
                                              kv_heads=2, vocab=256, seq=32, batch=2,
                                              attention="cudnn")},
    "unet": {"zoo": "unet", "options": dict(batch=2, image=16, base_channels=8, depth=2)},
}
MODES = {
    "full": FULL,
    "quick": dataclasses.replace(FULL, name="quick", model={**GPT_MEDIUM, "layers": 6},
                                 steps=10, matmul_n=4096, bandwidth_bytes=1 << 28,
                                 plan_timeout_s=120.0, budget_s=240.0, multi_device_s=150.0,
                                 cost_models=_QUICK_COSTS),
    "dry-run": Mode("dry-run", dict(layers=2, hidden=64, heads=4, seq=32, vocab=256),
                    "bfloat16", 3, 4, 0.5, 256, 2, 1 << 22, 20, (1 << 10, 1 << 14), 4,
                    120.0, 60.0, 300.0, 0.0, 4, (2, 64, 4, 16), _TOY_COSTS),
}


class InjectedFailure(RuntimeError):
    """Raised by ``--fail-step`` at the start of the named step."""


class Skipped(Exception):
    """A step that cannot run here (too few devices, an earlier step's result missing)."""


class Check:
    """Runs the steps, keeps their records and rewrites the files after each.

    Attributes:
        out: the output folder; mode: the sizes; results: what ``gpu_check.json`` holds;
        shared: results steps pass on (the batch, the HLO file, the measured peak).
    """

    def __init__(self, out: str, mode: Mode, argv: list[str], fail_step: str | None,
                 budget_s: float | None):
        self.out, self.mode, self.fail_step, self.given_budget = out, mode, fail_step, budget_s
        self.started = time.perf_counter()
        self.shared: dict[str, Any] = {}
        self.results: dict[str, Any] = {
            "tool": "benchmarks/gpu_check.py",
            "command": " ".join(["python", "benchmarks/gpu_check.py", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": mode.name, "config": dataclasses.asdict(mode), "budget_s": None,
            "steps": {}, "wall_s": None, "failed": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def budget(self) -> float:
        """Seconds after which no step starts: ``--budget-s``, else the mode's, more with
        several devices."""
        if self.given_budget is not None:
            return self.given_budget
        several = len(self.shared.get("devices") or ()) > 1
        return self.mode.budget_s + (self.mode.multi_device_s if several else 0.0)

    def run(self, name: str, fn: Callable[["Check", dict], None]) -> dict:
        """Run one step, recording its outcome whatever happens."""
        rec: dict[str, Any] = {"status": "running"}
        self.results["steps"][name] = rec
        self.results["budget_s"] = self.budget()
        if self.elapsed() > self.budget():
            rec.update(status="skipped", reason=f"time budget spent: {self.elapsed():.0f} s "
                       f"> {self.budget():.0f} s (--budget-s)", seconds=0.0)
            self.write()
            return rec
        self.write()
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            if name == self.fail_step:
                raise InjectedFailure(f"--fail-step {name}: a failure injected to check "
                                      "that it is recorded and the other steps go on")
            fn(self, rec)
            rec["status"] = "ok"
        except Skipped as e:
            rec.update(status="skipped", reason=str(e))
        except Exception as e:  # noqa: BLE001 - every failure is a result to record
            rec.update(status="error", error=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc()[-4000:])
        except BaseException as e:  # interrupted or terminated: record, then stop
            rec.update(status="interrupted", error=f"{type(e).__name__}: {e}")
            raise
        finally:
            rec["seconds"] = time.perf_counter() - t
            self.results["wall_s"] = self.elapsed()
            self.write()
        print(f"gpu_check: {name} {rec['status']} ({rec['seconds']:.1f} s)"
              + (f": {rec.get('error') or rec.get('reason')}"
                 if rec["status"] != "ok" else ""), file=sys.stderr, flush=True)
        return rec

    def write(self) -> None:
        """Rewrite ``gpu_check.json`` and ``gpu_check.md`` (each replaced whole)."""
        self.results["failed"] = [k for k, r in self.results["steps"].items()
                                  if r.get("status") in ("error", "interrupted")]
        for name, text in (("gpu_check.json", json.dumps(self.results, indent=1,
                                                         default=_json_default)),
                           ("gpu_check.md", gpu_check_report.markdown(self.results))):
            path = os.path.join(self.out, name)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text + "\n")
            os.replace(path + ".tmp", path)

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)


def _json_default(x: Any) -> Any:
    """numpy scalars and other stragglers as plain values."""
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


# ----------------------------------------------------------------------------- steps
def step_environment(check: Check, rec: dict) -> None:
    """Versions, devices and memory."""
    import importlib.metadata as md

    import jax
    import jaxlib

    import rhino

    rec["python"] = platform.python_version()
    rec["platform"] = platform.platform()
    rec["host_cpus"] = os.cpu_count()
    rec["jax"], rec["jaxlib"], rec["rhino"] = jax.__version__, jaxlib.__version__, \
        rhino.__version__
    wanted = ("jax", "nvidia-", "highspy", "networkx", "optax", "numpy", "ml-dtypes")
    rec["packages"] = sorted(f"{d.metadata['Name']}=={d.version}" for d in md.distributions()
                             if str(d.metadata["Name"]).lower().startswith(wanted))
    rec["env"] = {k: v for k, v in os.environ.items()
                  if k.startswith(("XLA_", "JAX_", "CUDA_VISIBLE", "NCCL_", "TF_CPP"))}
    devices = jax.devices()
    d0 = devices[0]
    rec["backend"] = d0.platform
    try:
        import jax.extend.backend as jeb

        rec["backend_version"] = str(jeb.get_backend().platform_version)
    except Exception as e:  # noqa: BLE001 - informative only
        rec["backend_version"] = f"unavailable ({type(e).__name__}: {e})"
    rec["device_count"], rec["local_device_count"] = jax.device_count(), jax.local_device_count()
    rec["process_count"] = jax.process_count()
    rec["device_kind"] = d0.device_kind
    rec["device_kinds"] = sorted({d.device_kind for d in devices})
    stats = getattr(d0, "memory_stats", lambda: None)()
    rec["memory_stats"] = ({k: int(v) for k, v in stats.items() if isinstance(v, (int, float))}
                           if stats else None)
    rec["bytes_limit"] = int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
    rec["cuda"] = _cuda_versions(rec["backend_version"])
    rec["nvidia_smi"] = _nvidia_smi()
    try:
        rec["jax_environment_info"] = jax.print_environment_info(return_string=True)
    except Exception as e:  # noqa: BLE001 - informative only
        rec["jax_environment_info"] = f"unavailable ({type(e).__name__}: {e})"
    check.shared["devices"] = devices


def _cuda_versions(backend_version: str) -> dict:
    """CUDA / cuDNN versions from the backend and the NVIDIA wheels, where there are any."""
    import importlib.metadata as md

    out: dict[str, Any] = {"backend": backend_version}
    for dist in ("nvidia-cuda-runtime-cu12", "nvidia-cudnn-cu12", "nvidia-nccl-cu12",
                 "nvidia-cublas-cu12", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                 "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "jax-cuda13-plugin",
                 "jax-cuda13-pjrt"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    return out


def _nvidia_smi() -> dict | None:
    """``nvidia-smi``'s per-GPU name, driver, memory, clocks and power, and its CUDA line."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    fields = ("name,driver_version,memory.total,memory.used,clocks.max.sm,clocks.max.mem,"
              "power.limit,pstate,temperature.gpu")
    out: dict[str, Any] = {"query": fields}
    try:
        q = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        out["gpus"] = [ln.strip() for ln in q.stdout.splitlines() if ln.strip()]
        head = subprocess.run([exe], capture_output=True, text=True, timeout=30).stdout
        m = re.search(r"CUDA Version:\s*([\d.]+)", head)
        out["cuda_driver_api"] = m.group(1) if m else None
    except (OSError, subprocess.SubprocessError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _devices(check: Check) -> list:
    import jax

    return check.shared.get("devices") or jax.devices()


def _ratio(measured: float | None, figure: float | None) -> dict:
    ok = measured is not None and figure not in (None, 0)
    return {"measured": measured, "figure": figure,
            "ratio": measured / figure if ok else None}


def step_calibration(check: Check, rec: dict) -> None:
    """``rhino.calibrate``'s measurements beside ``rhino.backends``' figures."""
    from rhino import calibrate
    from rhino.backends import figures_for_devices

    m, devices = check.mode, _devices(check)
    d0 = devices[0]
    fig = figures_for_devices(devices)
    cost = fig.cost_model((len(devices),))
    rec["figures"] = {"backend": fig.backend, "source": fig.source}
    rec["matmul_n"] = m.matmul_n
    rec["matmul_f32_flops"] = _ratio(calibrate.measure_flops(d0, m.matmul_n, m.reps,
                                                             "float32"), cost.flops_for("f32"))
    bf16 = calibrate.measure_flops(d0, m.matmul_n, m.reps, "bfloat16")
    rec["matmul_bf16_flops"] = _ratio(bf16, cost.flops_for("bf16"))
    check.shared["measured_bf16_flops"] = bf16
    rec["memory_bandwidth_bytes_per_s"] = _ratio(calibrate.measure_memory_bandwidth(
        d0, m.bandwidth_bytes, m.reps), None)
    rec["memory_bandwidth_bytes_per_s"]["note"] = "rhino.backends has no bandwidth figure"
    rec["launch_latency_s"] = _ratio(calibrate.measure_launch_latency(d0, m.latency_reps),
                                     None)
    stats = getattr(d0, "memory_stats", lambda: None)()
    limit = int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
    rec["memory_bytes"] = _ratio(limit, fig.memory_bytes)
    rec["memory_bytes"]["note"] = ("the allocator's bytes_limit (XLA preallocates a fraction "
                                   "of the device: XLA_PYTHON_CLIENT_MEM_FRACTION)")
    gpu_check_cost.calibrate(check, rec)     # the roofline the cost_model step prices with
    if len(devices) < 2:
        rec["collectives"] = "one device: no all-reduce to time"
        return
    alpha, beta = calibrate.measure_axis((len(devices),), 0, devices,
                                         sizes=m.collective_bytes, reps=m.reps)
    rec["allreduce_alpha_s"] = _ratio(alpha, cost.alpha[0])
    rec["link_bytes_per_s"] = _ratio(1.0 / beta if beta > 0 else None,
                                     1.0 / cost.beta[0] if cost.beta[0] > 0 else None)
    rec["collective_bytes"] = list(m.collective_bytes)


def step_batch(check: Check, rec: dict) -> None:
    """The largest power-of-two batch whose jit step fits ``memory_fraction`` of memory."""
    import gpu_check_training as gt

    m, devices = check.mode, _devices(check)
    given = check.shared.get("given_batch")
    if given:
        rec.update(batch=given, how="given (--batch)")
        check.shared["batch"] = given
        return
    stats = getattr(devices[0], "memory_stats", lambda: None)()
    limit = int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
    if limit is None:
        from rhino.backends import figures_for_devices

        limit = figures_for_devices(devices[:1]).memory_bytes
        rec["limit_from"] = "rhino.backends figure (the device reports no bytes_limit)"
        if limit is None:
            raise RuntimeError("batch: no memory limit known (no bytes_limit, no built-in "
                               "figure); pass --batch N")
    else:
        rec["limit_from"] = "memory_stats()['bytes_limit']"
    target = int(m.memory_fraction * limit)
    rec.update(limit_bytes=limit, target_bytes=target, cap=m.batch_cap)
    tries: list[dict] = []

    def compile_at(batch: int) -> tuple[Any, int]:
        t = time.perf_counter()
        compiled = gt.compile_jit(gt.make_model(m.model, batch), m.dtype, devices[:1])
        mem = gt.compiled_memory(compiled)
        peak = mem["peak"] if mem else None
        tries.append({"batch": batch, "peak_bytes": peak,
                      "compile_s": time.perf_counter() - t})
        return compiled, peak

    one, peak1 = compile_at(1)
    rec["tries"] = tries
    if peak1 is None:
        rec.update(batch=1, how="the backend gives no memory analysis: batch 1")
        check.shared.update(batch=1, jit_compiled=(1, one))
        return
    arguments = gt.compiled_memory(one)["argument"]
    per_example = max(peak1 - arguments, 1)
    rec.update(peak_at_1=peak1, per_example_bytes=per_example)
    # Everything above the arguments at batch 1 is charged per example: an over-estimate
    # (it holds the gradients too), so the first guess errs small; the peak at that guess
    # gives the true slope, and one larger power of two is tried with it.
    batch = _pow2_floor(min(m.batch_cap, (target - arguments) // per_example))
    compiled, peak = (one, peak1) if batch == 1 else compile_at(batch)
    while peak > target and batch > 1:
        batch //= 2
        compiled, peak = (one, peak1) if batch == 1 else compile_at(batch)
    if peak <= target and 1 < batch < m.batch_cap:
        slope = max((peak - peak1) / (batch - 1), 1.0)
        bigger = _pow2_floor(min(m.batch_cap, 1 + (target - peak1) / slope))
        if bigger > batch:
            c2, p2 = compile_at(bigger)
            if p2 <= target:
                batch, compiled, peak = bigger, c2, p2
    rec.update(batch=batch, peak_bytes=peak, fits=peak <= target,
               how="fitted on compiled jit programs (memory_analysis)")
    check.shared.update(batch=batch, jit_compiled=(batch, compiled))


def _pow2_floor(x: float) -> int:
    """The largest power of two at most ``x`` (1 for anything below 2)."""
    return 1 << int(math.log2(x)) if x >= 2 else 1


def _batch(check: Check) -> int:
    """The batch per device: ``--batch``, else the batch step's, else 1 (noted)."""
    b = check.shared.get("given_batch") or check.shared.get("batch")
    if b is None:
        b = 1
        check.shared["batch"] = b
        check.shared["batch_note"] = "no batch from the batch step (failed or not run): batch 1"
    return b


def _peaks(check: Check) -> tuple[float | None, float | None]:
    from rhino.backends import figures_for_devices

    fig = figures_for_devices(_devices(check)[:1])
    return fig.cost_model((1,)).flops_for("bf16"), check.shared.get("measured_bf16_flops")


def step_single(check: Check, rec: dict) -> None:
    """jit against rhino on one device."""
    import gpu_check_training as gt

    m, devices = check.mode, _devices(check)
    batch = _batch(check)
    if "batch_note" in check.shared:
        rec["note"] = check.shared["batch_note"]
    fitted = check.shared.get("jit_compiled")
    compiled = fitted[1] if fitted and fitted[0] == batch else None
    peak, measured = _peaks(check)
    gt.compare(rec, gt.make_model(m.model, batch), m.dtype, devices[:1], devices[:1],
               m.steps, peak, measured, jit_compiled=compiled)
    if (rec.get("jit") or {}).get("step_s"):
        check.shared["single_jit"] = (batch, rec["jit"]["step_s"])


def step_spmd(check: Check, rec: dict) -> None:
    """jit data parallel against rhino's SPMD plan on every device."""
    import gpu_check_training as gt

    m, devices = check.mode, _devices(check)
    if len(devices) < 2:
        raise Skipped(f"one device: SPMD needs at least 2, found {len(devices)}")
    batch = _batch(check) * len(devices)
    peak, measured = _peaks(check)
    gt.compare(rec, gt.make_model(m.model, batch), m.dtype, devices, devices, m.steps, peak,
               measured)
    check.shared["dp_reference"] = ((batch, len(devices)), rec["jit"])


def step_pipeline(check: Check, rec: dict) -> None:
    """A 2-stage pipeline (local executor) against jit data parallel on the same devices."""
    import gpu_check_training as gt

    m, devices = check.mode, _devices(check)
    k = 2 * (len(devices) // 2)
    if k < 2:
        raise Skipped(f"one device: a 2-stage pipeline needs at least 2, found {len(devices)}")
    devices = devices[:k]
    unit = math.lcm(k, m.microbatches)
    batch = _batch(check) * k
    if batch % unit:
        batch = unit * max(1, math.ceil(_batch(check) * (k // 2) / unit))
    rec["cluster"] = f"1x{k}"
    # The spmd step's jax.jit run is this reference when it had the same batch and devices.
    key, ref = check.shared.get("dp_reference", (None, None))
    reference = dict(ref, shared_with="spmd") if key == (batch, k) else None
    peak, measured = _peaks(check)
    gt.compare(rec, gt.make_model(m.model, batch), m.dtype, devices, devices, m.steps, peak,
               measured, reference=reference, cluster=f"1x{k}", stages=2,
               num_microbatches=m.microbatches, timeout=m.stage_timeout_s)


def _custom_calls(text: str) -> dict[str, int]:
    """custom-call target -> count in HLO text."""
    found: dict[str, int] = {}
    for t in re.findall(r'custom_call_target="([^"]+)"', text):
        found[t] = found.get(t, 0) + 1
    return dict(sorted(found.items()))


def _write(check: Check, name: str, text: str) -> dict:
    with open(check.path(name), "w", encoding="utf-8") as f:
        f.write(text)
    return {"file": name, "bytes": len(text.encode()), "lines": text.count("\n"),
            "custom_calls": _custom_calls(text)}


def attention_step(heads: int, head_dim: int, implementation: str):
    """A training step of one causal self-attention layer through
    ``jax.nn.dot_product_attention`` (``implementation`` ``cudnn`` or ``xla``)."""
    import jax
    import jax.numpy as jnp

    def step(w, x):
        def loss(w):
            b, t, _ = x.shape
            qkv = (x @ w).reshape(b, t, 3, heads, head_dim)
            out = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                               is_causal=True, implementation=implementation)
            return jnp.mean(jnp.square(out.astype(jnp.float32)))

        value, grad = jax.value_and_grad(loss)(w)
        return w - 1e-3 * grad, value

    return step


def _hlo_text(lowered: Any) -> str:
    """HLO text with source lines (``debug_info``) where this jax can, else without."""
    try:
        return lowered.as_text(dialect="hlo", debug_info=True)
    except TypeError:
        return lowered.as_text(dialect="hlo")


def step_hlo(check: Check, rec: dict) -> None:
    """The HLO files for the planner's tests."""
    import jax

    import gpu_check_training as gt

    m, devices = check.mode, _devices(check)
    model = gt.make_model(m.model, _batch(check))
    abstract = gt.abstract_state(model, m.dtype)
    lowered = jax.jit(model.step).lower(*abstract)
    rec["gpt"] = _write(check, "gpt_step.hlo", _hlo_text(lowered))
    check.shared["gpt_hlo"] = check.path("gpt_step.hlo")
    batch, compiled = check.shared.get("jit_compiled", (None, None))
    if batch != model.config.batch:
        compiled = gt.compile_jit(model, m.dtype, devices[:1])
    rec["gpt_compiled"] = _write(check, "gpt_step.compiled.hlo", compiled.as_text())
    b, t, h, d = m.attention
    w = jax.ShapeDtypeStruct((h * d, 3 * h * d), m.dtype)
    x = jax.ShapeDtypeStruct((b, t, h * d), m.dtype)
    impl = "cudnn" if devices[0].platform == "gpu" else "xla"
    att: dict[str, Any] = {"implementation": impl, "shape": list(m.attention)}
    try:
        low = jax.jit(attention_step(h, d, impl)).lower(w, x)
    except Exception as e:  # noqa: BLE001 - cuDNN refuses some shapes; record, use XLA's
        att["error"] = f"{type(e).__name__}: {e}"
        att["implementation"] = "xla"
        low = jax.jit(attention_step(h, d, "xla")).lower(w, x)
    att.update(_write(check, "attention_step.hlo", _hlo_text(low)))
    rec["attention"] = att
    check.shared["attention_hlo"] = check.path("attention_step.hlo")


def step_plan(check: Check, rec: dict) -> None:
    """``rhino plan`` of the lowered HLO files, in a subprocess on CPU."""
    from rhino.backends import backend_names, figures_for_devices

    devices = _devices(check)
    files = [(k, check.shared.get(f"{k}_hlo")) for k in ("gpt", "attention")]
    if not any(p for _, p in files):
        raise Skipped("no HLO file: the hlo step did not write one")
    mesh = len(devices) if len(devices) > 1 else check.mode.plan_mesh
    backend = figures_for_devices(devices).backend
    rec["mesh"] = mesh
    rec["backend"] = backend if backend in backend_names() else None
    failed = []
    for key, path in files:
        if not path:
            rec[key] = {"status": "skipped", "reason": "no HLO file"}
            continue
        cmd = [sys.executable, "-m", "rhino.cli", "plan", os.path.abspath(path), "--mesh", str(mesh),
               "--quiet", "--time-limit", str(int(check.mode.plan_timeout_s))]
        if rec["backend"]:
            cmd += ["--backend", rec["backend"]]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        t = time.perf_counter()
        try:
            # Not in the caller's folder: run from a checkout, ``-m`` would put its
            # ``rhino/`` (which lacks ``hlo_passes``, mapped in only by installing) first.
            p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                               cwd=os.path.dirname(os.path.abspath(path)),
                               timeout=check.mode.plan_timeout_s + 60)
            out = {"returncode": p.returncode, "stderr_tail": p.stderr[-2000:]}
            text = p.stdout
        except subprocess.TimeoutExpired as e:
            out = {"returncode": None, "error": f"timed out after {e.timeout:.0f} s"}
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out["seconds"] = time.perf_counter() - t
        out["command"] = " ".join(["rhino plan", os.path.basename(path), *cmd[5:]])
        name = f"rhino_plan_{key}.txt"
        with open(check.path(name), "w", encoding="utf-8") as f:
            f.write(text)
        out.update(file=name, report_head=text.splitlines()[:12])
        rec[key] = out
        if out["returncode"] != 0:
            last = out.get("error") or (out["stderr_tail"].strip().splitlines() or [""])[-1]
            failed.append(f"{key}: exit {out['returncode']}: {last}")
    if failed:
        raise RuntimeError("rhino plan failed for " + "; ".join(failed))


STEPS: dict[str, Callable[[Check, dict], None]] = {
    "environment": step_environment, "calibration": step_calibration, "batch": step_batch,
    "single_device": step_single, "cost_model": gpu_check_cost.step_cost_model,
    "hlo": step_hlo, "plan": step_plan, "spmd": step_spmd, "pipeline": step_pipeline}


# ----------------------------------------------------------------------------- main
def _steps(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in names if s not in STEP_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected step names from {', '.join(STEP_NAMES)}, "
                                         f"found {text!r}")
    return names


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}")
    return v


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the files (created)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--quick", action="store_true", help="6 layers, 10 steps")
    how.add_argument("--dry-run", action="store_true",
                     help=f"toy sizes on {DRY_RUN_DEVICES} simulated CPU devices")
    p.add_argument("--batch", type=_positive_int, help="batch per device (default: fitted)")
    p.add_argument("--steps", type=_steps, default=STEP_NAMES,
                   help=f"the steps to run, comma separated (default: {','.join(STEP_NAMES)})")
    p.add_argument("--budget-s", type=float, help="start no step after this many seconds "
                   "(default: 420 full, 240 quick, 300 dry run; with several devices 300 "
                   "more full, 150 more quick)")
    p.add_argument("--fail-step", choices=STEP_NAMES,
                   help="make this step raise at its start (checks the failure path)")
    a = p.parse_args(argv)
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        p.error(f"--out: expected a folder, found the file {a.out!r}")
    return a


def _simulated_cpu_devices(n: int) -> None:
    """Ask XLA for ``n`` simulated CPU devices (before jax is imported), compiled without
    LLVM's optimizations: the dry run compiles about twenty toy programs, and this takes a
    third off their compile time (what the programs compute is the same)."""
    flags = re.sub(r"--xla_(force_host_platform_device_count|backend_optimization_level)=\S+",
                   "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count={n} "
                               "--xla_backend_optimization_level=0").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM (a job's time limit) as SystemExit, so the step it cuts is recorded."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    mode = MODES["dry-run" if a.dry_run else "quick" if a.quick else "full"]
    if a.dry_run:
        _simulated_cpu_devices(DRY_RUN_DEVICES)
    os.makedirs(a.out, exist_ok=True)
    check = Check(a.out, mode, argv, a.fail_step, a.budget_s)
    check.shared["given_batch"] = a.batch
    for name in STEP_NAMES:
        if name not in a.steps:
            continue
        rec = check.run(name, STEPS[name])
        if name == "environment" and rec["status"] == "ok" and not a.dry_run \
                and rec["backend"] == "cpu":
            check.results["error"] = ("no GPU: jax's devices are CPUs (install a CUDA jax, "
                                      "see docs/gpu_check.md); --dry-run checks the script "
                                      "on CPU")
            check.write()
            print(f"gpu_check: error: {check.results['error']}", file=sys.stderr)
            return 2
    check.results["wall_s"] = check.elapsed()
    check.write()
    print(f"gpu_check: wrote {check.path('gpu_check.json')} and "
          f"{check.path('gpu_check.md')} in {check.elapsed():.1f} s", file=sys.stderr)
    return 1 if check.results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
