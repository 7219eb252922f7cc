"""``python -m rhino.launch``: a multi-controller job on one machine, for trying one.

On a cluster, SLURM (``srun``) or Kubernetes starts the same script once per host and every
process joins the job with ``rhino.distributed_init()``. This starts ``--hosts N`` local
processes of a script the same way, each simulating a host of ``--devices-per-host`` CPU
devices::

    python -m rhino.launch --hosts 2 --devices-per-host 4 train.py --steps 3

    launcher ─┬─ process 0: XLA_FLAGS=--xla_force_host_platform_device_count=4
              │             RHINO_COORDINATOR_ADDRESS=127.0.0.1:PORT  RHINO_NUM_PROCESSES=2
              │             RHINO_PROCESS_ID=0  RHINO_TRANSFER_ADDRESS=127.0.0.1:PORT0
              └─ process 1: ... RHINO_PROCESS_ID=1 ...
       every line of their output, prefixed ``[p0]`` / ``[p1]`` (stdout to stdout, stderr to
       stderr; gloo's per-connection lines left out unless ``$RHINO_SHOW_GLOO`` is set)

As hosts do not share cores, processes simulating hosts on CPU keep to equal runs of this
machine's cores (``--pin-cpus auto``, the default, as the Ray executor's actors do; ``off``
lets them share every core, ``on`` makes too few cores an error).

It waits for all of them (``--timeout``). When one fails, it stops the others and exits with
the failed process's status, naming it; on timeout it stops them all and exits with 124.
``JAX_PLATFORMS`` is set to ``cpu`` unless already set.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from rhino.distributed import (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID,
                               ENV_TRANSFER_ADDRESS, EXIT_GRACE_S)
from rhino.distributed import free_port as distributed_free_port
from rhino.runtime.transfer.transport import ExecutorError

DEFAULT_TIMEOUT_S = 1800.0
"""How long the launcher waits for the processes (seconds) unless ``--timeout`` says."""
STOP_GRACE_S = 2.0
"""After SIGTERM, how long a process has to end before SIGKILL (JAX catches SIGTERM in a
job, as a preemption notice, and goes on)."""
REPORT_GRACE_S = 1.5
"""After a process failed, how long the others may take to end on their own (and say why:
processes that see the same error, e.g. plans that differ, all report it) before they are
stopped."""
LOST = ("What the job held in memory (its training state) is gone with its processes: "
        "start the job again to resume from its last checkpoint (rhino.CheckpointManager, "
        "rhino.restore_checkpoint)")
"""Said when a job ends early: what was lost and how to resume."""
CHILD_CODE = "import sys; from rhino.launch import run_script; run_script(sys.argv[1:])"
"""How each process is started: ``python -c CHILD_CODE script args`` (``run_script``)."""
GLOO_CHATTER = re.compile(rb"\[Gloo\] Rank \d|peer ranks\. Expected number of connected")
"""What gloo prints for every process of a job at every connection (left out; its threads
write at once, so the pieces of two such lines may share a line)."""
COUNT_FLAG = "--xla_force_host_platform_device_count"

USAGE_EXAMPLE = """\
example:
  python -m rhino.launch --hosts 2 --devices-per-host 4 examples/multicontroller_spmd.py"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rhino.launch",
        description="Start N local processes of a script as one multi-controller JAX job "
                    "(each calls rhino.distributed_init()), stream their output prefixed "
                    "by process id, and stop them all when one fails.",
        epilog=USAGE_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, required=True, metavar="N",
                   help="processes to start (simulated hosts), N >= 1")
    p.add_argument("--devices-per-host", type=int, default=1, metavar="D",
                   help="CPU devices each process simulates (default 1)")
    p.add_argument("--port", type=int, default=None, metavar="P",
                   help="the coordinator's port (default: a free one)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for the processes (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--pin-cpus", default="auto", choices=["auto", "on", "off"],
                   help="processes simulating CPU hosts keep to their own cores: auto (where "
                        "there is at least one core per process), on (an error otherwise), "
                        "off (they share every core)")
    p.add_argument("script", help="the Python script every process runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on now (``distributed.free_port``)."""
    return distributed_free_port("127.0.0.1")


def child_environment(base: dict, process_id: int, hosts: int, devices: int,
                      coordinator: str, transfer: str) -> dict:
    """The environment of process ``process_id``: ``base`` with the device count in
    ``XLA_FLAGS`` (replacing one given), ``JAX_PLATFORMS=cpu`` unless set, and the job's
    variables.

    >>> env = child_environment({"XLA_FLAGS": "--xla_dump_to=/tmp/d "
    ...                          "--xla_force_host_platform_device_count=8"}, 1, 2, 4,
    ...                         "127.0.0.1:9", "127.0.0.1:10")
    >>> env["XLA_FLAGS"], env["RHINO_PROCESS_ID"], env["RHINO_NUM_PROCESSES"]
    ('--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4', '1', '2')
    """
    env = dict(base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{COUNT_FLAG}={devices}"])
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(hosts)
    env[ENV_PROCESS_ID] = str(process_id)
    env[ENV_TRANSFER_ADDRESS] = transfer
    return env


def _pump(src: IO[bytes], dst: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    """Copy ``src``'s lines to ``dst``, each prefixed, until ``src`` ends."""
    show_gloo = bool(os.environ.get("RHINO_SHOW_GLOO"))
    for line in iter(src.readline, b""):
        if not show_gloo and GLOO_CHATTER.search(line):
            continue
        with lock:
            dst.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            dst.flush()
    src.close()


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every process still running (its whole process group), SIGKILL after
    ``STOP_GRACE_S``."""
    live = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < end and any(p.poll() is None for p in live):
            time.sleep(0.05)
        live = [p for p in live if p.poll() is None]
        if not live:
            return


def _processes(ids: Sequence[int]) -> str:
    """``process 1`` / ``processes 0, 2``."""
    return f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"


def _status(code: int) -> str:
    return (f"killed by signal {-code}" if code < 0 else f"exit status {code}")


def core_shares(hosts: int, pin: bool | None, env: dict) -> list[tuple[int, ...] | None]:
    """Per process, the cores it keeps to (None: every core): equal runs of this
    process's cores where the processes simulate CPU hosts (``JAX_PLATFORMS`` cpu, the
    launcher's default) and ``pin`` is not False (``runtime.ray.cluster.share_cores``).

    Raises:
        ExecutorError: ``pin=True`` and fewer cores than processes.
    """
    from rhino.runtime.ray.cluster import share_cores, usable_cores

    cores = usable_cores()
    if pin is False or not cores:
        return [None] * hosts
    simulated = env.get("JAX_PLATFORMS", "cpu") == "cpu"
    if pin and simulated and hosts > 1 and len(cores) < hosts:
        raise ExecutorError(f"expected at least one core per process, found {len(cores)} "
                            f"cores ({', '.join(map(str, cores))}) for {hosts} processes")
    return share_cores([("this machine", cores)] * hosts, [simulated] * hosts, pin,
                       [f"process {i}" for i in range(hosts)])


def launch(script: str, args: Sequence[str], hosts: int, devices_per_host: int = 1,
           port: int | None = None, timeout: float = DEFAULT_TIMEOUT_S,
           python: str = sys.executable, pin_cpus: bool | None = None) -> int:
    """Run ``hosts`` processes of ``script`` as one job; return the exit status (0: all
    succeeded; a failed process's status; 124: timed out). Messages go to stderr.
    ``pin_cpus``: see ``core_shares`` (None: where there are enough cores)."""
    say = lambda msg: print(f"rhino.launch: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    coordinator = f"127.0.0.1:{port or free_port()}"
    shares = core_shares(hosts, pin_cpus, os.environ)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    out, err = sys.stdout.buffer, sys.stderr.buffer
    sys.stdout.flush()
    try:
        for i in range(hosts):
            env = child_environment(dict(os.environ), i, hosts, devices_per_host,
                                    coordinator, f"127.0.0.1:{free_port()}")
            cores = shares[i]        # set before the interpreter starts: every thread keeps
            p = subprocess.Popen([python, "-c", CHILD_CODE, script, *args], env=env,
                                 stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True,
                                 preexec_fn=None if cores is None else
                                 functools.partial(os.sched_setaffinity, 0, cores))
            procs.append(p)
            for src, dst in ((p.stdout, out), (p.stderr, err)):
                t = threading.Thread(target=_pump, args=(src, dst, f"[p{i}] ".encode(), lock),
                                     daemon=True)
                t.start()
                pumps.append(t)
        end = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                first = failed[0]
                grace = time.monotonic() + REPORT_GRACE_S
                while time.monotonic() < grace and any(p.poll() is None for p in procs):
                    time.sleep(0.05)
                running = [i for i, p in enumerate(procs) if p.poll() is None]
                also = [i for i, p in enumerate(procs) if i != first and p.poll() not in
                        (None, 0)]
                _stop(procs)
                _drain(pumps)
                say(f"process {first} failed ({_status(codes[first])})"
                    + (f"; {_processes(also)} failed too" if also else "")
                    + (f"; stopped {_processes(running)}" if running else "")
                    + ". " + LOST)
                c = codes[first]
                return c if c > 0 else 128 - c
            if all(c == 0 for c in codes):
                _drain(pumps)
                return 0
            if time.monotonic() > end:
                running = [i for i, c in enumerate(codes) if c is None]
                _stop(procs)
                _drain(pumps)
                say(f"timed out after {timeout:g} s; stopped {_processes(running)}. "
                    + LOST)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        _drain(pumps)
        say("interrupted; stopped every process")
        return 130
    finally:
        _stop(procs)


def run_script(argv: Sequence[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with arguments ``argv[1:]``, as ``python script``
    would, in a process of a job. A failure (an exception, a non-zero ``sys.exit``) ends
    the process at once with its status, after its traceback is printed and the output
    flushed: JAX's exit would otherwise wait at the job's shutdown barrier for the other
    processes (up to 5 minutes), and the launcher would not see the failure."""
    import runpy
    import traceback

    script = argv[0]
    sys.argv = list(argv)
    here = os.path.dirname(os.path.abspath(script))   # what `python script` puts first
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path[0] = here
    else:
        sys.path.insert(0, here)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        if os.environ.get(ENV_PROCESS_ID) == "0":
            time.sleep(EXIT_GRACE_S)    # the coordinator: let the others report first
        os._exit(code)


def _drain(pumps: Sequence[threading.Thread], within_s: float = 5.0) -> None:
    end = time.monotonic() + within_s
    for t in pumps:
        t.join(max(0.0, end - time.monotonic()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    if a.hosts < 1:
        parser.error(f"--hosts: expected a whole number >= 1, found {a.hosts}")
    if a.devices_per_host < 1:
        parser.error(f"--devices-per-host: expected a whole number >= 1, found "
                     f"{a.devices_per_host}")
    if a.port is not None and not 0 < a.port < 65536:
        parser.error(f"--port: expected 1 to 65535, found {a.port}")
    if not a.timeout > 0:
        parser.error(f"--timeout: expected a positive number of seconds, found {a.timeout:g}")
    if not os.path.isfile(a.script):
        parser.error(f"script {a.script!r}: no such file")
    pin = {"auto": None, "on": True, "off": False}[a.pin_cpus]
    if pin:
        try:
            core_shares(a.hosts, pin, os.environ)
        except ExecutorError as e:
            parser.error(f"--pin-cpus on: {e}")
    return launch(a.script, a.args, a.hosts, a.devices_per_host, a.port, a.timeout,
                  pin_cpus=pin)


if __name__ == "__main__":
    sys.exit(main())
