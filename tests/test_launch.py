"""Multi-controller jobs on one machine: ``python -m rhino.launch`` starting 2 processes × 4
simulated CPU devices, ``rhino.distributed_init`` and ``auto_parallel`` across processes.

Each job runs as a subprocess of the test (a process that joined a job cannot leave it);
the coordinator's and transfer sockets' ports are free ones the launcher picks. About 62 s
in the default suite; four more jobs (the GPT example as one SPMD program, whose path the
pipeline and the process-local rows jobs take too; an exception's prompt exit, a cluster's
SPMD-only search, the script's arguments and path) under ``-m slow``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from rhino import launch
from rhino.distributed import DistributedError, launch_environment

# The extended tier (Ray, several processes, the docs' commands, the slowest runs): run by
# .ci/run after the default suite (README, Tests: `-m "extended and not slow"`).
pytestmark = pytest.mark.extended

REPO = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "multicontroller_spmd.py"
JOB = REPO / "tests" / "multicontroller_job.py"


def _env() -> dict:
    return {k: v for k, v in os.environ.items()
            if k not in ("XLA_FLAGS",) and not k.startswith("RHINO_")}


def _launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rhino.launch", *args], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def _show(out: subprocess.CompletedProcess) -> str:
    return f"exit {out.returncode}\n--- stdout\n{out.stdout[-5000:]}\n--- stderr\n" \
           f"{out.stderr[-5000:]}"


@pytest.mark.slow
def test_the_example_matches_jax_jit_on_two_processes():
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(EXAMPLE))
    assert out.returncode == 0, _show(out)
    for p in (0, 1):
        assert f"[p{p}] process {p} of 2 (rhino.launch): 4 local devices, 8 in the job, " \
               f"CPU collectives gloo" in out.stdout, _show(out)
        assert re.search(rf"^\[p{p}\] process {p}: OK: 3 steps match jax.jit", out.stdout,
                         re.M), _show(out)
        assert f"[p{p}] process {p}: plan spmd on mesh (8,)" in out.stdout
        assert re.search(rf"^\[p{p}\] process {p}: measured step [\d.]+ ms .*examples/s, "
                         rf"[\d,]+ tokens/s; measured MFU [\d.]+ %", out.stdout, re.M), \
            out.stdout
    assert "MISMATCH" not in out.stdout
    assert "[Gloo]" not in out.stdout        # gloo's per-connection lines are left out


def test_plans_that_differ_are_refused_on_every_process_before_step_1():
    """Process 1 pins a weight's layout, so its plan differs: both processes raise
    PlanDivergenceError naming both hashes, and no step runs."""
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(JOB), "--pin-on", "1")
    assert out.returncode == 1, _show(out)
    for p in (0, 1):
        line = next((ln for ln in out.stderr.splitlines()
                     if ln.startswith(f"[p{p}] rhino.distributed.PlanDivergenceError: ")),
                    None)
        assert line is not None, _show(out)
        assert re.search(r"process 0: [0-9a-f]{16}, process 1: [0-9a-f]{16}", line), line
        assert f"this is process {p}" in line and "nothing has run" in line
    hashes = re.findall(r"process (\d): ([0-9a-f]{16})", out.stderr)
    assert len({h for _, h in hashes}) == 2
    assert "step 0 ran" not in out.stdout
    assert re.search(r"rhino\.launch: process [01] failed \(exit status 1\)", out.stderr)


def test_a_failing_process_stops_the_job_promptly_and_is_named():
    t0 = time.monotonic()
    out = _launch("--hosts", "2", "--devices-per-host", "1", str(JOB), "--fail-on", "1",
                  "--exit-code", "3")
    took = time.monotonic() - t0
    assert out.returncode == 3, _show(out)
    assert "rhino.launch: process 1 failed (exit status 3); stopped process 0" in out.stderr
    assert "[p1] process 1: failing on purpose" in out.stdout
    assert "not stopped" not in out.stdout        # process 0 was sleeping for 120 s
    assert took < 60, took


@pytest.mark.slow
def test_an_exception_ends_its_process_at_once():
    """Without ending the process at once, JAX's exit would wait at the job's shutdown
    barrier for the others and the launcher would see nothing until its timeout."""
    t0 = time.monotonic()
    out = _launch("--hosts", "2", "--timeout", "120", str(JOB), "--raise-on", "1")
    assert out.returncode == 1, _show(out)
    assert "[p1] RuntimeError: process 1: raising on purpose" in out.stderr
    assert "rhino.launch: process 1 failed (exit status 1)" in out.stderr
    assert time.monotonic() - t0 < 60


def test_process_local_rows_through_global_batch():
    """Each process passes only its own half of the batch (rhino.global_batch); the
    results are those of jax.jit on the whole batch."""
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(JOB), "--global-batch")
    assert out.returncode == 0, _show(out)
    assert "[p0] process 0: OK" in out.stdout and "[p1] process 1: OK" in out.stdout
    assert "[p0] joined: process 0 of 2 (rhino.launch)" in out.stdout
    for p in (0, 1):
        assert f"[p{p}] process {p}: results global: True, loss shape () replicated: True" \
            in out.stdout, _show(out)


def test_a_pipeline_runs_one_stage_per_process():
    """``--stages 2`` on 2 processes × 4 devices: each process runs the stage on its own
    devices (``runtime.executors.multicontroller``), values between them through JAX's transfer
    servers, the tied embedding passed between the processes each step; 3 GPT steps
    equal jax.jit on both processes (each checks its own stage's state and the loss).
    Joined without gloo (``cross_process_collectives=False``): a stage's collectives stay
    in its process, and nothing between the stages needs a cross-process collective."""
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(EXAMPLE), "--stages", "2",
                  "--no-cross-process-collectives")
    assert out.returncode == 0, _show(out)
    for p in (0, 1):
        assert f"[p{p}] process {p} of 2 (rhino.launch): 4 local devices, 8 in the job, " \
               f"CPU collectives None" in out.stdout, _show(out)
        assert f"[p{p}] process {p}: plan hybrid on 2 stages on meshes [(4,), (4,)]" \
            in out.stdout, _show(out)
        assert f"[p{p}] process {p}: OK: 3 steps match jax.jit" in out.stdout, _show(out)
        assert re.search(rf"^\[p{p}\] process {p}: measured step [\d.]+ ms .*tokens/s; "
                         rf"measured MFU [\d.]+ %", out.stdout, re.M), _show(out)


def test_a_failed_pipelined_step_costs_that_step_on_every_process():
    """Issue 47: a host callback raises on call 1 in stage 0's process. The step fails on
    every process, the one that finished its part too (a step counts only where every
    process finished it), naming the cause; each passes its arguments to the next call,
    and the run equals jax.jit over the calls that ran, on both processes (each checks its
    own stage's shards)."""
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(JOB), "--cluster", "2x4",
                  "--stages", "2", "--fail-call", "1")
    assert out.returncode == 0, _show(out)
    for p in (0, 1):
        for k in (0, 2, 3):
            got = re.search(rf"^\[p{p}\] process {p}: call {k}: ran: loss ([\d.]+) "
                            rf"\(jax.jit ([\d.]+)\)", out.stdout, re.M)
            assert got and np.isclose(float(got[1]), float(got[2]), rtol=1e-5), _show(out)
        assert f"[p{p}] process {p}: OK" in out.stdout, _show(out)
    assert re.search(r"\[p0\] process 0: call 1: failed: stage 0, A: (?s:.*)RuntimeError: "
                     r"the data check failed", out.stdout), _show(out)
    assert re.search(r"\[p1\] process 1: call 1: failed: step \d+ failed on another process "
                     # (the callback's error reaches the step through the apply program
                     # or, when its effects program is the first to see it, through that)
                     r"\(process 0: stage 0, A: (its host effects: )?JaxRuntimeError: "
                     r"INTERNAL: CpuCallback error "
                     r"calling callback: RuntimeError: the data check failed\); this process "
                     r"finished its part but keeps none of its results", out.stdout), _show(out)


def test_a_stalled_pipelined_step_costs_steps_not_the_run():
    """Issue 47: stage 0's host callback sleeps 8 s on call 1, past the step's 2 × 3 s. The
    step fails on both processes; the next call waits for the stalled stage to stop (or,
    past the grace, fails on both), and the calls run from the arguments the failed calls
    were given, equal to jax.jit over the calls that ran."""
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(JOB), "--cluster", "2x4",
                  "--stages", "2", "--fail-call", "1", "--stall-s", "8")
    assert out.returncode == 0, _show(out)
    for p in (0, 1):
        assert f"[p{p}] process {p}: call 0: ran" in out.stdout, _show(out)
        assert f"[p{p}] process {p}: call 1: failed" in out.stdout, _show(out)
        assert f"[p{p}] process {p}: call 4: ran" in out.stdout, _show(out)
        assert f"[p{p}] process {p}: OK" in out.stdout, _show(out)
    for k in range(5):    # every call ran on both processes or failed on both
        ran = [f"[p{p}] process {p}: call {k}: ran" in out.stdout for p in (0, 1)]
        assert ran[0] == ran[1], _show(out)
    assert re.search(r"\[p0\] process 0: call 1: failed: stage 0.*(did not finish within|"
                     r"not ready within)", out.stdout), _show(out)


def test_a_killed_process_ends_the_job_and_a_new_one_resumes_from_its_checkpoints(tmp_path):
    """Issue 47: a pipeline of one stage per process saves a checkpoint after every step
    (``rhino.CheckpointManager``, each process writing the shards it holds); process 1 dies
    at step 3 and the launcher stops the job. A new job resumes from the latest step (2,
    the manager keeping two) and its final state equals jax.jit over all 5 steps; plain
    orbax reads the checkpoints, keyed by the state's paths."""
    ck = str(tmp_path / "ck")
    args = ("--hosts", "2", "--devices-per-host", "4", str(JOB), "--cluster", "2x4",
            "--stages", "2", "--steps", "5", "--checkpoints", ck)
    out = _launch(*args, "--die-at", "3")
    assert out.returncode == 9, _show(out)
    assert "rhino.launch: process 1 failed (exit status 9); stopped process 0. What the job " \
           "held in memory (its training state) is gone with its processes: start the job " \
           "again to resume from its last checkpoint" in out.stderr, _show(out)
    assert "[p1] process 1: dying at step 3" in out.stdout, _show(out)
    out = _launch(*args)
    assert out.returncode == 0, _show(out)
    for p in (0, 1):
        assert f"[p{p}] process {p}: resumed from step 3 (steps kept: [2, 3])" in \
            out.stdout, _show(out)
        assert f"[p{p}] process {p}: step 4 ran" in out.stdout, _show(out)
        assert f"[p{p}] process {p}: OK" in out.stdout, _show(out)
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(ck) as mgr:
        assert mgr.all_steps() == [4, 5]
        tree = mgr.restore(5, args=ocp.args.StandardRestore())
    assert {k: v.shape for k, v in tree.items()} == {"w1": (64, 256), "w2": (256, 16)}


def test_zb_h1_runs_one_stage_per_process():
    """Issue 44: zb-h1 (each backward cut into B and W programs) under ``rhino.launch``,
    one stage per process: 3 GPT steps equal jax.jit on both processes."""
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(EXAMPLE), "--stages", "2",
                  "--schedule", "zb-h1", "--no-cross-process-collectives")
    assert out.returncode == 0, _show(out)
    for p in (0, 1):
        assert f"[p{p}] process {p}: OK: 3 steps match jax.jit" in out.stdout, _show(out)


def test_interleaved_1f1b_runs_a_device_group_per_process():
    """Issue 44: interleaved 1F1B under ``rhino.launch``: 2 processes × 4 devices, each
    process one device group running 2 of the GPT's 4 stages (values between its own
    stages stay in the process), 8 microbatches: 3 steps equal jax.jit on both."""
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(EXAMPLE), "--stages", "2",
                  "--virtual-stages", "2", "--schedule", "interleaved-1f1b", "--layers", "4",
                  "--microbatches", "8",
                  "--no-cross-process-collectives")
    assert out.returncode == 0, _show(out)
    for p in (0, 1):
        assert f"[p{p}] process {p}: plan hybrid on 4 stages on meshes [(4,), (4,), (4,), " \
               f"(4,)]" in out.stdout, _show(out)
        assert f"[p{p}] process {p}: OK: 3 steps match jax.jit" in out.stdout, _show(out)


def test_stages_without_trained_weights_and_results_of_several_stages_per_process():
    """Issue 43: 4 stages on 2 processes × 4 devices, the first two holding only frozen
    layers (their backward and apply tasks empty: no instruction runs them). Each process
    divides the loss (stage 3) by a count made on stage 0; on process 1 the count arrives
    on stage 2's devices, the loss is on stage 3's (before: "incompatible devices"; now
    both are uncommitted, as jax.jit's results). 3 steps equal jax.jit."""
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(JOB), "--frozen",
                  "--stages", "4")
    assert out.returncode == 0, _show(out)
    for p in (0, 1):
        assert f"[p{p}] process {p}: empty tasks ['A0', 'A1', 'B0', 'B1']" in out.stdout, \
            _show(out)
        assert f"[p{p}] process {p}: step 2 ran" in out.stdout, _show(out)
        assert f"[p{p}] process {p}: OK" in out.stdout, _show(out)
    assert "MISMATCH" not in out.stdout


@pytest.mark.slow
def test_host_callbacks_of_a_pipeline_job_run_once_per_step(tmp_path):
    """A 2-stage pipeline, one stage per process, whose step holds a ``jax.debug.callback``
    (on a per-example value's sum) and an ordered ``io_callback`` (on the loss): each runs
    once per step, not once per process, in process 0 (stage 0's; ``jax.jit`` of one
    program over the job's devices runs a callback in the process holding its first
    device), with the values of one-device ``jax.jit`` (which every process runs)."""
    path = tmp_path / "calls.txt"
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(JOB), "--stages", "2",
                  "--cluster", "2x4", "--effects", str(path), "--steps", "2")
    assert out.returncode == 0, _show(out)
    rows = [line.split() for line in path.read_text().splitlines()]
    mine = [r for r in rows if not r[0].startswith("ref-")]
    ref = [r for r in rows if r[0].startswith("ref-") and r[1] == "p0"]
    assert sorted(r[0] for r in mine) == ["loss"] * 2 + ["sum"] * 2, rows
    assert {r[1] for r in mine} == {"p0"}, rows
    assert len([r for r in rows if r[0].startswith("ref-")]) == 8, rows
    for tag in ("sum", "loss"):
        got = [float(r[2]) for r in mine if r[0] == tag]
        want = [float(r[2]) for r in ref if r[0] == "ref-" + tag]
        np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.slow
def test_a_cluster_in_a_job_is_planned_with_spmd_candidates_only():
    out = _launch("--hosts", "2", str(JOB), "--cluster", "2x1")
    assert out.returncode == 0, _show(out)
    assert "[p0] process 0: OK" in out.stdout and "[p1] process 1: OK" in out.stdout


def test_the_launcher_times_out(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(120)\n")
    t0 = time.monotonic()
    out = _launch("--hosts", "2", "--timeout", "5", str(script))
    assert out.returncode == 124, _show(out)
    assert "rhino.launch: timed out after 5 s; stopped processes 0, 1" in out.stderr
    assert "[p0] started" in out.stdout and "[p1] started" in out.stdout
    assert time.monotonic() - t0 < 40


@pytest.mark.slow
def test_the_script_sees_its_arguments_and_a_job_of_one(tmp_path):
    script = tmp_path / "one.py"
    (tmp_path / "helper_module.py").write_text("X = 7\n")     # beside the script
    script.write_text("import os, sys, rhino, helper_module\n"
                      "job = rhino.distributed_init()\n"
                      "print(sys.argv[1:], job.num_processes, job.how, __name__, "
                      "helper_module.X, os.path.basename(__file__))\n")
    out = _launch("--hosts", "1", str(script), "a", "--b")
    assert out.returncode == 0, _show(out)
    assert "[p0] ['a', '--b'] 1 rhino.launch __main__ 7 one.py" in out.stdout


@pytest.mark.parametrize("args,message", [
    (["--hosts", "0", "x.py"], "--hosts: expected a whole number >= 1, found 0"),
    (["--hosts", "2", "--devices-per-host", "0", "x.py"],
     "--devices-per-host: expected a whole number >= 1, found 0"),
    (["--hosts", "2", "--port", "70000", "x.py"], "--port: expected 1 to 65535"),
    (["--hosts", "2", "--timeout", "0", "x.py"], "--timeout: expected a positive number"),
    (["--hosts", "2", "no/such/script.py"], "script 'no/such/script.py': no such file"),
    (["script.py"], "the following arguments are required: --hosts"),
])
def test_bad_input_is_refused_with_a_message(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    with pytest.raises(SystemExit) as e:
        launch.main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_processes_simulating_hosts_keep_to_their_own_cores(tmp_path):
    """--pin-cpus auto (the default): each process keeps to an equal run of the machine's
    cores, set before it starts (so every thread of it); off: they share every core."""
    script = tmp_path / "cores.py"
    script.write_text("import os, sys, threading\n"
                      "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
                      "print('cores', sorted(os.sched_getaffinity(0)))\n")
    cores = sorted(os.sched_getaffinity(0))
    out = _launch("--hosts", "2", str(script), timeout=120)
    assert out.returncode == 0, _show(out)
    got = {line.split()[0]: line.split("cores", 1)[1].strip()
           for line in out.stdout.splitlines() if " cores " in line}
    if len(cores) >= 2:
        k = len(cores) // 2
        assert got == {"[p0]": str(cores[:k]), "[p1]": str(cores[k:2 * k])}, _show(out)
    else:
        assert got == {"[p0]": str(cores), "[p1]": str(cores)}, _show(out)
    out = _launch("--hosts", "2", "--pin-cpus", "off", str(script), timeout=120)
    assert out.returncode == 0, _show(out)
    assert out.stdout.count(f"cores {cores}") == 2, _show(out)
    assert launch.core_shares(2, None, {"JAX_PLATFORMS": "cuda"}) == [None, None]
    many = len(cores) + 1
    with pytest.raises(launch.ExecutorError, match=f"at least one core per process, found "
                                                   f"{len(cores)} cores"):
        launch.core_shares(many, True, {})
    assert launch.core_shares(many, None, {}) == [None] * many


def test_launch_environment_is_checked():
    ok = {"RHINO_COORDINATOR_ADDRESS": "127.0.0.1:5", "RHINO_NUM_PROCESSES": "2",
          "RHINO_PROCESS_ID": "1", "RHINO_TRANSFER_ADDRESS": "127.0.0.1:6"}
    assert launch_environment(ok)["transfer"] == "127.0.0.1:6"
    assert launch_environment({}) is None
    for change, message in [({"RHINO_COORDINATOR_ADDRESS": "nohost"}, "expected HOST:PORT"),
                            ({"RHINO_NUM_PROCESSES": "two"}, "RHINO_NUM_PROCESSES: expected"),
                            ({"RHINO_PROCESS_ID": "2"}, "0 <= process id < number")]:
        with pytest.raises(DistributedError, match=message):
            launch_environment({**ok, **change})


def test_distributed_init_after_jax_was_used_is_refused(tmp_path):
    code = ("import jax, rhino\njax.devices()\n"
            "try:\n    rhino.distributed_init()\n"
            "except rhino.DistributedError as e:\n    print('refused:', e)\n")
    env = {**_env(), "RHINO_COORDINATOR_ADDRESS": "127.0.0.1:1", "RHINO_NUM_PROCESSES": "2",
           "RHINO_PROCESS_ID": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: distributed_init: expected to run before JAX is used" in out.stdout


def test_a_job_weighs_the_mesh_of_hosts_by_devices_per_host():
    """In a multi-controller job the 1-D mesh over every device and the hosts × devices
    mesh are both weighed (with H100 figures the links between hosts are much slower)."""
    import jax
    import jax.numpy as jnp

    from rhino.backends import backend_figures
    from rhino.front_door import PlanRequest, plan_on_mesh, runnable_cost, trace_step

    def step(w, x):
        return w - 0.1 * (x.T @ (x @ w)), jnp.sum(x @ w)

    t = trace_step(step, (jax.ShapeDtypeStruct((512, 512), jnp.float32),
                          jax.ShapeDtypeStruct((256, 512), jnp.float32)))
    h100 = backend_figures("h100")
    mesh, _, _, why = plan_on_mesh(t.graph, PlanRequest(), None, 8,
                                   lambda m: runnable_cost(h100.cost_model(m, 4)), hosts=2)
    assert why is not None and "(8,)" in why and "(2, 4)" in why, why
    alone = plan_on_mesh(t.graph, PlanRequest(), None, 8,
                         lambda m: runnable_cost(h100.cost_model(m, 4)))
    assert alone[3] is None and alone[0].shape == (8,)


def test_one_program_over_processes_without_their_collectives_is_refused(monkeypatch):
    """A job joined with ``cross_process_collectives=False`` (no gloo on CPU) refuses a
    plan that is one SPMD program over its processes, naming the argument."""
    import jax

    from rhino import distributed

    monkeypatch.setitem(distributed._NO_CROSS_PROCESS_COLLECTIVES, "off", True)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(DistributedError, match=r"auto_parallel\(step\)'s SPMD plan: expected "
                       r"collectives between processes .* 2 processes, found .*"
                       r"cross_process_collectives=False"):
        distributed.check_cross_process_program("auto_parallel(step)'s SPMD plan")
    monkeypatch.setitem(distributed._NO_CROSS_PROCESS_COLLECTIVES, "off", False)
    distributed.check_cross_process_program("auto_parallel(step)'s SPMD plan")


def test_free_ports_are_below_the_range_of_outgoing_connections(tmp_path):
    """A port from the kernel's range for outgoing connections can be taken by any
    connection before the job binds it; the launcher's come from below it, and are free."""
    import socket

    from rhino import distributed

    low = distributed._ephemeral_low()
    ports = {launch.free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports), (low, sorted(ports))
    assert len(ports) > 1          # picked at random, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
    (tmp_path / "range").write_text("40000\t60999\n")
    assert distributed._ephemeral_low(str(tmp_path / "range")) == 40000
    assert distributed._ephemeral_low(str(tmp_path / "missing")) == 32768


def test_corpus_steps_one_after_another_in_one_job(tmp_path):
    """Issue 43, acceptance 5: corpus steps pipelined one after another in one job (2
    processes x 4 devices, one stage per process), each judged on every process's own
    shards against the float32 step (``tests/corpus_job.py``). Three faults this found:
    the second executor of a job read the first's layouts and aborts from the job's
    key-value store and hung; arguments jax placed by default (each process's own, on its
    first device) were sent as another process's array and crashed; ``cumprod``'s
    backward hands an empty value between the stages, whose transfer never arrived; and a
    value received in its sender's layout reached XLA's partitioner unconstrained, which
    failed on tridiagonal_solve and ended the process on select_and_gather_add; and a value
    sent both per microbatch and as its sum (class_sums_added in float32) had one layout
    name for both, so the sum was pulled in the microbatch's layout."""
    sys.path.insert(0, str(REPO / "tests"))
    import corpus_job

    job = str(REPO / "tests" / "corpus_job.py")
    out = _launch("--hosts", "2", "--devices-per-host", "4", job, "--out", str(tmp_path),
                  "--cases", "cumprod,select_and_gather_add,tridiagonal_solve,class_sums_added",
                  "--dtypes",
                  "float32,bfloat16", "--timeout", "60", timeout=400)
    assert out.returncode == 0, _show(out)
    parts = [json.loads((tmp_path / f"p{p}.json").read_text()) for p in (0, 1)]
    for runs in parts:
        assert [(r["case"], r["dtype"], r["outcome"]) for r in runs] == [
            ("cumprod", "float32", "exact"), ("cumprod", "bfloat16", "exact"),
            ("tridiagonal_solve", "float32", "exact"),
            ("select_and_gather_add", "float32", "exact"),
            ("class_sums_added", "float32", "exact"), ("class_sums_added", "bfloat16", "exact")
        ], runs
    assert corpus_job.covered(parts) == []
    # The processes held different parts: each judged something of its own.
    assert all(any(h for h in r["held"]) for runs in parts for r in runs)


def test_spmd_steps_take_every_kind_of_argument_users_have():
    """Issue 47, item 3: numpy arrays, process-local jax arrays (what ``model.init``
    returns on each process, or put on its first device, as a checkpoint restores) and global ``jax.Array``s, replicated or split over the job's
    devices, each fed to a new SPMD step: equal to jax.jit on both processes."""
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(JOB),
                  "--arg-kinds", "numpy,local,committed,global,split")
    assert out.returncode == 0, _show(out)
    for p in (0, 1):
        for kind in ("numpy", "local", "committed", "global", "split"):
            assert f"[p{p}] process {p}: {kind} arguments: OK" in out.stdout, _show(out)


def test_pipelined_steps_take_every_kind_of_argument_a_stage_can_hold():
    """The same kinds for a pipeline of one stage per process: a global array replicated
    over the processes is read from this process's copy (before: 'Cannot reshard an input
    that is not fully addressable'); one split over both processes, of which no process
    holds a whole weight, is refused naming what to pass instead."""
    out = _launch("--hosts", "2", "--devices-per-host", "4", str(JOB), "--cluster", "2x4",
                  "--stages", "2", "--arg-kinds", "numpy,local,committed,global,split")
    for p in (0, 1):
        for kind in ("numpy", "local", "committed", "global"):
            assert f"[p{p}] process {p}: {kind} arguments: OK" in out.stdout, _show(out)
    assert re.search(r"process \d: split arguments: refused: an argument float32\[\d+, \d+\]:"
                     r" a global jax.Array of which this process holds only some elements",
                     out.stdout), _show(out)
