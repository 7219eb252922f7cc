"""A Ray head node on this machine, for trying rhino's Ray executor and ``ray job submit``.

``ray start --head`` with its documented fixed ports breaks silently when a second Ray runs
on the machine, and ``ray stop`` stops *every* Ray process of the user. This starts a head
that binds its dashboard to 127.0.0.1, takes free ports, keeps its files in its own
temporary folder, runs in its own process group, and is stopped by that group alone::

    eval "$(python -m rhino.runtime.ray.local_head start --num-cpus 4)"
    ray job submit --address "$RAY_DASHBOARD" --working-dir . -- python examples/pipeline_ray.py
    python -m rhino.runtime.ray.local_head stop

``start`` prints ``export`` lines for a shell: ``RAY_ADDRESS`` (the GCS, ``host:port``, which
``rhino.init()`` and ``ray.init()`` join), ``RAY_DASHBOARD`` (the Jobs API URL),
``RAY_HEAD_PGID`` and ``RAY_HEAD_DIR`` (what ``stop`` needs). Token authentication is off
(``RAY_AUTH_MODE=disabled``): for a trusted, single-user machine only. The GCS itself listens
on every interface (Ray has no option to keep it on loopback); on a shared network, start it
inside a network namespace (``docs/ray.md`` shows how) or behind a firewall.

Example:
    >>> head = start_head(num_cpus=2)                      # doctest: +SKIP
    >>> head.address, head.dashboard                       # doctest: +SKIP
    ('127.0.0.1:40123', 'http://127.0.0.1:40125')
    >>> head.stop()                                        # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from rhino.errors import RhinoError


class LocalRayError(RhinoError):
    """The head did not start (the message carries the end of ``ray start``'s log)."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclasses.dataclass(frozen=True)
class LocalHead:
    """A running head: GCS ``address``, Jobs API ``dashboard`` URL, process group, folder."""

    address: str
    dashboard: str
    pgid: int
    folder: str

    def env(self) -> dict[str, str]:
        return {"RAY_ADDRESS": self.address, "RAY_DASHBOARD": self.dashboard,
                "RAY_HEAD_PGID": str(self.pgid), "RAY_HEAD_DIR": self.folder,
                "RAY_AUTH_MODE": "disabled"}

    def stop(self, timeout: float = 15.0) -> None:
        stop_head(self.pgid, self.folder, timeout)


def start_head(num_cpus: int | None = None, timeout: float = 90.0) -> LocalHead:
    """Start a head node (see the module docstring); wait until its Jobs API answers.

    Raises:
        LocalRayError: ``ray`` is not installed, or the head did not answer within
            ``timeout`` seconds (its processes are stopped again).
    """
    ray = shutil.which("ray")
    if ray is None:
        raise LocalRayError("expected the `ray` command (pip install 'ray[default]'), found "
                            "none on PATH")
    gcs, dash, agent, agent_grpc, client, metrics, env_agent = free_ports(7)
    folder = tempfile.mkdtemp(prefix="rr", dir="/tmp")   # short: Ray's socket paths < 108
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    cmd = [ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--port", str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
           "--include-dashboard=true", "--dashboard-agent-listen-port", str(agent),
           "--dashboard-agent-grpc-port", str(agent_grpc),
           "--ray-client-server-port", str(client), "--metrics-export-port", str(metrics),
           "--runtime-env-agent-port", str(env_agent), "--temp-dir", folder,
           "--disable-usage-stats"]
    if num_cpus is not None:
        cmd += ["--num-cpus", str(int(num_cpus))]
    log_path = os.path.join(folder, "ray_start.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    head = LocalHead(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", proc.pid, folder)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{head.dashboard}/api/version", timeout=2) as r:
                if r.status == 200:
                    return head
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            why = (f"exited with {proc.returncode}" if proc.poll() is not None
                   else f"did not answer within {timeout:g} s")
            stop_head(proc.pid, folder)
            raise LocalRayError(f"ray start --head {why}; its log ends:\n{tail}")
        time.sleep(0.5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_head(pgid: int, folder: str | None = None, timeout: float = 15.0) -> None:
    """Stop the head's process group (SIGTERM, then SIGKILL) and remove its folder."""
    for sig, wait in ((signal.SIGTERM, timeout / 3), (signal.SIGKILL, 2 * timeout / 3)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait
        while time.monotonic() < end and _group_alive(pgid):
            try:
                os.waitpid(pgid, os.WNOHANG)     # reap it if it is our child
            except ChildProcessError:
                pass
            time.sleep(0.2)
        if not _group_alive(pgid):
            break
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rhino.runtime.ray.local_head",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    st = sub.add_parser("start", help="start a head; print `export` lines for a shell")
    st.add_argument("--num-cpus", type=int, help="CPUs the head offers (default: all)")
    st.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for it")
    sp = sub.add_parser("stop", help="stop the head named by $RAY_HEAD_PGID / $RAY_HEAD_DIR")
    sp.add_argument("--pgid", type=int, default=None)
    sp.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    try:
        if a.command == "start":
            head = start_head(a.num_cpus, a.timeout)
            for k, v in head.env().items():
                print(f"export {k}={shlex.quote(v)}")
            return 0
        pgid = a.pgid if a.pgid is not None else os.environ.get("RAY_HEAD_PGID")
        if pgid is None:
            raise LocalRayError("stop: expected --pgid or $RAY_HEAD_PGID (printed by start), "
                                "found neither")
        stop_head(int(pgid), a.dir or os.environ.get("RAY_HEAD_DIR"))
        return 0
    except RhinoError as e:
        print(f"local_head: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
