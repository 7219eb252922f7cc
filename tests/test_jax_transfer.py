"""``rhino.runtime.transfer.jax_transfer``: stage-to-stage values between the processes of one
``jax.distributed`` job, moved by JAX's transfer server. Each test runs a small job of two
local processes (``tests/jax_transfer_worker.py``) and checks what the receiver printed."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from rhino.runtime.transfer.jax_transfer import transfer_uuid

# The extended tier (Ray, several processes, the docs' commands, the slowest runs): run by
# .ci/run after the default suite (README, Tests: `-m "extended and not slow"`).
pytestmark = pytest.mark.extended

WORKER = pathlib.Path(__file__).with_name("jax_transfer_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(scenario: str, timeout: float = 120.0, **extra_env: str) -> list[str]:
    """Run the 2-process job; the lines both processes printed (fails on a hang)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | extra_env
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), scenario],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(2)]
    outs = []
    try:
        # Process 1 first: process 0 (the coordination service) exits when its stdin closes.
        for p in procs[::-1]:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    lines = [ln for out in outs for ln in out.splitlines()]
    text = "\n".join(ln for ln in lines if not ln.startswith(("I0000", "W0000", "WARNING")))
    assert all(p.returncode == 0 for p in procs), text[-4000:]
    assert sum(ln == "DONE" for ln in lines) == 2, text[-4000:]
    assert not [ln for ln in lines if ln.startswith("FAIL")], text[-4000:]
    return [ln for ln in lines if ln.startswith("OK ")]


def test_uuid_names_the_pair_and_key():
    a = transfer_uuid(0, 1, (3, 12, 0))
    assert a == transfer_uuid(0, 1, (3, 12, 0)) and 0 <= a < 2 ** 63
    assert len({a, transfer_uuid(1, 0, (3, 12, 0)), transfer_uuid(0, 1, (3, 12, 1)),
                transfer_uuid(0, 1, (4, 12, 0))}) == 4


def test_values_layouts_order_timeout_and_abort_between_two_processes(tmp_path):
    """Same layout (whole array), other mesh sizes and specs (pieces), meshes of one size
    (relayout), replicated sources, PRNG keys, bfloat16; 1F1B order (process 0: send a,
    send b on a thread, recv c; process 1: recv a, send c, recv b); a timeout naming the
    key; an abort waking a waiter, made in the same process and in the other one; a value
    whose program failed on the sender blames the sender. With ``RHINO_XFER_TRACE`` each
    process writes a line per transfer, with its times and how it was built. ``wait_taken``
    returns once the receiver acknowledged the value, and ends with a timeout naming the
    value or with the receiver's abort. With ``defer_relayout`` a relayout value comes in
    the sender's layout on the target's mesh."""
    ok = run_job("basics", RHINO_XFER_TRACE=str(tmp_path))
    want = {f"OK case{r}" for r in [*range(1, 9), 20, 21, 22]} | {
        f"OK deferred{r}" for r in (20, 21, 22)} | {
        "OK 1f1b-c", "OK 1f1b-ab", "OK timeout", "OK abort", "OK remote-abort",
        "OK failed-sender", "OK taken-waits", "OK taken-timeout", "OK taken-abort"}
    assert want <= set(ok), sorted(want - set(ok))
    traced = {p: [json.loads(ln) for ln in (tmp_path / f"xfer-{p}.jsonl").read_text()
                  .splitlines()] for p in (0, 1)}
    got = {(t["key"], t["mode"]) for t in traced[1] if t["what"] == "recv"}
    assert {("(0, 20, 0)", "relayout"), ("(0, 1, 0)", "whole"), ("(0, 2, 0)", "pieces")} <= got
    assert all(t["start"] <= t["arrived"] <= t["assembled"] <= t["done"]
               for t in traced[1] if t["what"] == "recv")
    assert any(t["what"] == "send" and t["key"] == "(0, 20, 0)" for t in traced[0])


@pytest.mark.slow
def test_two_stage_gpt_pipeline_one_stage_per_process_matches_jax_jit():
    """GPT in 2 stages × 2 devices, stage s in process s (each builds only its own
    StageWorker from the same plan), 1F1B over 2 microbatches, 3 steps: each stage's
    results (updated state, the loss) equal one-device ``jax.jit``'s (~28 s)."""
    ok = set(run_job("pipeline", timeout=240))
    want = {f"OK pipeline-step{n}-stage{s}" for n in range(3) for s in range(2)}
    want |= {f"OK pipeline-loss{n}" for n in range(3)}
    want |= {"OK pipeline-received-stage0", "OK pipeline-received-stage1"}
    assert want <= ok, sorted(want - ok)
