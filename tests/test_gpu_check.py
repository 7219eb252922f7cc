"""``benchmarks/gpu_check.py`` (issue 32): its dry run, as the default suite runs it, writes
every figure the GPU run writes; a failing step is recorded and the others go on; usage
mistakes and a machine without a GPU end it with status 2."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_check  # noqa: E402  (benchmarks/gpu_check.py)
import gpu_check_report  # noqa: E402
import gpu_check_training  # noqa: E402

# The extended tier (Ray, several processes, the docs' commands, the slowest runs): run by
# .ci/run after the default suite (README, Tests: `-m "extended and not slow"`).
pytestmark = pytest.mark.extended

STEPS = ("environment", "calibration", "batch", "single_device", "cost_model", "hlo", "plan",
         "spmd", "pipeline")
TOP = {"tool", "command", "date", "mode", "config", "budget_s", "steps", "wall_s", "failed"}
# Every step's fields when it succeeds (besides status and seconds).
FIELDS = {
    "environment": {"python", "platform", "jax", "jaxlib", "rhino", "packages", "env",
                    "backend", "backend_version", "device_count", "local_device_count",
                    "process_count", "device_kind", "device_kinds", "memory_stats",
                    "bytes_limit", "cuda", "nvidia_smi", "jax_environment_info"},
    "calibration": {"figures", "matmul_n", "matmul_f32_flops", "matmul_bf16_flops",
                    "memory_bandwidth_bytes_per_s", "launch_latency_s", "memory_bytes",
                    "allreduce_alpha_s", "link_bytes_per_s", "collective_bytes", "roofline",
                    "roofline_peaks", "roofline_summary", "roofline_s"},
    "cost_model": {"cost_model", "tolerance", "models"},
    "batch": {"batch", "how", "limit_bytes", "target_bytes", "cap", "peak_at_1",
              "per_example_bytes", "tries", "limit_from", "peak_bytes", "fits"},
    "hlo": {"gpt", "gpt_compiled", "attention"},
    "plan": {"mesh", "backend", "gpt", "attention"},
}
RUN_FIELDS = {"model", "parameters", "tokens_per_step", "steps", "jit", "rhino", "loss",
              "step_time_ratio"}
TRAIN_FIELDS = {"losses", "step_times_s", "first_step_s", "step_s", "device_memory",
                "tokens_per_s", "model_flops_per_s", "mfu", "mfu_of_measured_matmul_peak"}
JIT_FIELDS = TRAIN_FIELDS | {"devices", "compile_s", "compiled_memory", "xla_flops_per_step"}
RHINO_FIELDS = TRAIN_FIELDS | {"plan_and_compile_s", "plan", "compiled_memory",
                               "batch_placement", "measured_over_estimated_step"}
LOSS_FIELDS = {"max_abs_diff", "max_rel_diff", "first_step_rel_diff", "identical",
               "tolerance", "equal", "finite"}


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _run("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out, json.loads((out / "gpu_check.json").read_text())


def test_dry_run_records_every_field(dry_run):
    out, r = dry_run
    assert TOP <= set(r), TOP - set(r)
    assert r["mode"] == "dry-run" and r["failed"] == [] and r["wall_s"] > 0
    assert tuple(r["steps"]) == STEPS
    for name, rec in r["steps"].items():
        assert rec["status"] == "ok", (name, rec.get("error"), rec.get("traceback"))
        assert rec["seconds"] >= 0
        want = FIELDS.get(name, RUN_FIELDS)
        assert want <= set(rec), (name, want - set(rec))
    env = r["steps"]["environment"]
    assert env["backend"] == "cpu" and env["device_count"] == gpu_check.DRY_RUN_DEVICES


def test_dry_run_figures_are_measured(dry_run):
    _, r = dry_run
    cal = r["steps"]["calibration"]
    for key in ("matmul_f32_flops", "matmul_bf16_flops", "allreduce_alpha_s"):
        row = cal[key]
        assert row["measured"] >= 0 and row["figure"] > 0
        assert row["ratio"] == pytest.approx(row["measured"] / row["figure"])
    assert cal["memory_bandwidth_bytes_per_s"]["measured"] > 1e6
    assert 0 < cal["launch_latency_s"]["measured"] < 1
    batch = r["steps"]["batch"]
    assert batch["batch"] >= 1 and batch["batch"] & (batch["batch"] - 1) == 0
    assert batch["tries"][-1]["peak_bytes"] <= batch["target_bytes"]
    for name in ("single_device", "spmd", "pipeline"):
        rec = r["steps"][name]
        jit, rh = rec["jit"], rec["rhino"]
        assert JIT_FIELDS <= set(jit), (name, JIT_FIELDS - set(jit))
        assert RHINO_FIELDS <= set(rh), (name, RHINO_FIELDS - set(rh))
        assert LOSS_FIELDS <= set(rec["loss"])
        assert len(jit["losses"]) == len(rh["losses"]) == rec["steps"]
        assert rec["loss"]["equal"] and rec["loss"]["finite"], (name, rec["loss"])
        assert rec["step_time_ratio"] == pytest.approx(rh["step_s"] / jit["step_s"])
        tokens = rec["model"]["batch"] * rec["model"]["seq"]
        assert rh["mfu"] == pytest.approx(6 * rec["parameters"] * tokens / rh["step_s"]
                                          / (r["steps"]["calibration"]["matmul_bf16_flops"]
                                             ["figure"] * rh_devices(rec)))
        assert rh["plan"]["estimated_peak_bytes"] and rh["plan"]["estimated_step_s"] > 0
    single = r["steps"]["single_device"]
    assert single["rhino"]["compiled_memory"]["peak"] > 0
    assert single["rhino"]["compiled_over_estimated_memory"] == pytest.approx(
        single["rhino"]["compiled_memory"]["peak"]
        / single["rhino"]["plan"]["estimated_peak_bytes"][0])
    assert r["steps"]["spmd"]["rhino"]["plan"]["stage_meshes"] == [[4]]
    pipe = r["steps"]["pipeline"]
    assert pipe["cluster"] == "1x4" and pipe["rhino"]["plan"]["stages"] == 2


COST_FIELDS = {"model", "plan_s", "estimate_s", "parts_s", "custom_calls", "mfu_estimated",
               "mfu_line", "measured_s", "measured_from", "ratio", "within"}


def test_dry_run_prices_three_one_device_steps_with_the_calibration(dry_run):
    """The cost_model step: GPT, a bf16 Llama with the fused attention call and the UNet,
    each estimated by rhino.plan with the calibrated roofline and measured under jit."""
    out, r = dry_run
    from rhino.planner.roofline import Roofline

    roof = Roofline.from_dict(r["steps"]["calibration"]["roofline"])
    rec = r["steps"]["cost_model"]
    assert rec["cost_model"]["roofline"] == roof.to_dict()
    assert set(rec["models"]) == {"gpt", "llama", "unet"}
    for name, row in rec["models"].items():
        assert COST_FIELDS <= set(row), (name, COST_FIELDS - set(row))
        assert row["estimate_s"] > 0 and row["measured_s"] > 0
        assert row["ratio"] == pytest.approx(row["estimate_s"] / row["measured_s"])
        assert row["within"] == (abs(row["ratio"] - 1) <= rec["tolerance"])
        assert row["mfu_line"].startswith("estimated MFU ")
    assert rec["models"]["gpt"]["measured_from"].startswith("single_device step")
    assert "CustomSPMDPartitioning" in rec["models"]["llama"]["custom_calls"]
    assert rec["models"]["llama"]["model"]["attention"] == "fused"
    assert rec["models"]["unet"]["parts_s"]["conv"] > 0
    md = (out / "gpu_check.md").read_text()
    assert "| one-device step | estimated ms |" in md and "| llama (llama, batch 2" in md


def rh_devices(rec: dict) -> int:
    return sum(math.prod(m) for m in rec["rhino"]["plan"]["stage_meshes"])


def test_dry_run_writes_the_hlo_plans_and_table(dry_run):
    out, r = dry_run
    for name in ("gpt_step.hlo", "gpt_step.compiled.hlo", "attention_step.hlo",
                 "rhino_plan_gpt.txt", "rhino_plan_attention.txt"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "gpt_step.hlo").read_text().startswith("HloModule")
    plan = r["steps"]["plan"]
    assert plan["gpt"]["returncode"] == 0 and plan["attention"]["returncode"] == 0
    assert "mesh              Mesh(x=4)" in (out / "rhino_plan_gpt.txt").read_text()
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("## GPU check: 4 × cpu, dry-run")
    for row in ("| single_device | ok |", "| matmul bfloat16 |", "| 1 device | 1 |",
                "| SPMD, all devices | 4 |", "| pipeline, 2 stages | 1x4 |",
                "| `gpt_step.hlo` |"):
        assert row in md, row


def test_a_failing_step_is_recorded_and_the_others_go_on(tmp_path):
    proc = _run("--dry-run", "--out", str(tmp_path), "--steps",
                "environment,calibration,plan", "--fail-step", "calibration", timeout=300)
    assert proc.returncode == 1, proc.stderr[-4000:]
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    cal = r["steps"]["calibration"]
    assert cal["status"] == "error" and cal["error"].startswith("InjectedFailure: --fail-step")
    assert "Traceback" in cal["traceback"]
    assert r["steps"]["environment"]["status"] == "ok"
    assert r["steps"]["plan"] == {"status": "skipped", "seconds": pytest.approx(
        r["steps"]["plan"]["seconds"]), "reason": "no HLO file: the hlo step did not write one"}
    assert r["failed"] == ["calibration"]
    assert "| calibration | error |" in (tmp_path / "gpu_check.md").read_text()


def test_without_a_gpu_and_without_dry_run_it_stops(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps",
                           "environment"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 2
    assert "no GPU" in proc.stderr
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["error"].startswith("no GPU") and r["steps"]["environment"]["backend"] == "cpu"


@pytest.mark.parametrize("args,message", [
    (["--out", "X", "--steps", "environment,warp"], "expected step names from environment"),
    (["--out", "X", "--batch", "0"], "expected a positive integer, found '0'"),
    (["--out", "X", "--quick", "--dry-run"], "not allowed with argument"),
    (["--out", "X", "--fail-step", "nope"], "invalid choice: 'nope'"),
])
def test_usage_mistakes_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_out_must_be_a_folder(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", str(f)])
    assert "--out: expected a folder, found the file" in capsys.readouterr().err


def test_loss_comparison():
    same = gpu_check_training.compare_losses([2.0, 1.5], [2.0, 1.5], "bfloat16")
    assert same["identical"] and same["equal"] and same["max_rel_diff"] == 0
    near = gpu_check_training.compare_losses([2.0, 1.51], [2.0, 1.5], "bfloat16")
    assert near["equal"] and not near["identical"]
    assert near["max_rel_diff"] == pytest.approx(0.01 / 1.5)
    far = gpu_check_training.compare_losses([2.0, 1.51], [2.0, 1.5], "float32")
    assert not far["equal"]
    nan = gpu_check_training.compare_losses([float("nan")], [1.0], "float32")
    assert not nan["finite"]
    with pytest.raises(ValueError, match="same non-zero length, found 1 and 2"):
        gpu_check_training.compare_losses([1.0], [1.0, 2.0], "float32")


def test_report_of_partial_results():
    r = {"mode": "full", "command": "python benchmarks/gpu_check.py --out o", "steps": {
        "environment": {"status": "ok", "seconds": 1.0, "device_count": 8,
                        "device_kind": "NVIDIA H100 80GB HBM3"},
        "calibration": {"status": "error", "seconds": 0.5, "error": "XlaRuntimeError: | oom"},
        "single_device": {"status": "error", "seconds": 3.0, "model": {"batch": 8, "seq": 1024},
                          "jit": {"devices": 1, "step_s": 0.25}},
        "hlo": {"status": "running"}}}
    md = gpu_check_report.markdown(r)
    assert md.startswith("## GPU check: 8 × NVIDIA H100 80GB HBM3, full")
    assert "| calibration | error | 0.5 | XlaRuntimeError: \\| oom |" in md
    assert "| hlo | running | — |  |" in md
    assert "| 1 device | 1 | 8 × 1024 | — | 250.00 | — | — |" in md


def test_the_runner_records_partial_results_skips_past_the_budget_and_stops_when_told(
        tmp_path):
    mode = gpu_check.MODES["dry-run"]
    check = gpu_check.Check(str(tmp_path), mode, ["--out", str(tmp_path)], None, 1e9)

    def half_way(check, rec):
        rec["measured"] = 1.5
        raise MemoryError("out of memory at step 2")

    rec = check.run("single_device", half_way)
    assert rec["status"] == "error" and rec["measured"] == 1.5
    assert rec["error"] == "MemoryError: out of memory at step 2"

    def interrupted(check, rec):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        check.run("spmd", interrupted)
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["steps"]["spmd"]["status"] == "interrupted"
    assert r["failed"] == ["single_device", "spmd"]

    late = gpu_check.Check(str(tmp_path), mode, [], None, 0.0)
    ran = []
    rec = late.run("environment", lambda c, r: ran.append(1))
    assert not ran and rec["status"] == "skipped" and "time budget spent" in rec["reason"]
    assert late.budget() == 0.0
    several = gpu_check.Check(str(tmp_path), gpu_check.MODES["full"], [], None, None)
    several.shared["devices"] = [object(), object()]
    assert several.budget() == gpu_check.FULL.budget_s + gpu_check.FULL.multi_device_s
