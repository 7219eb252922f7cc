"""JAX's transfer server between two processes, and the receiving side's assembly (issue 30).

Two figures the ``jax`` transport (``runtime.transfer.jax_transfer``) is built on:

1. **Latency of one value between two processes** of a ``jax.distributed`` job on this
   machine (CPU, gloo, 4 devices each), through ``jax.experimental.transfer``: the sender
   computes a value, waits for it, offers it (``await_pull``) and, in ``busy`` modes, starts
   its next computation at once; the receiver asks for it (``pull``) either before the offer
   (``early``: what ``JaxTransferTransport.expect`` does) or after it (``late``). Latency =
   arrival (every pulled array ready) minus the later of offer and request.

2. **Assembly on the receiving process**: a [2048, 256] float32 value sharded ``P("x")`` over
   4 devices of one stage, wanted replicated (``P()``) on 4 devices of the next (the tied
   embedding's gradient of the pipeline benchmark). The general plan
   (``process_resharding.assemble``: pieces copied on and written into each tile) against
   ``relayout`` (the source's tiles as they are, one compiled program gathers them).

    python benchmarks/transfer_latency.py [--values 30] [--size-mib 1]

Prints a table; the processes are started by this script (``--role`` is internal).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MODES = ("early idle", "early busy", "late idle", "late busy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _role(pid: int, port: int, mode: str, n: int, size_mib: float) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    import jax.numpy as jnp
    from jax.experimental import transfer

    from rhino.jaxpr.private import distributed_kv_client

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=60)
    kv = distributed_kv_client()
    dev = jax.local_devices()[0]
    srv = transfer.start_transfer_server(dev.client, "127.0.0.1:0", ["127.0.0.1:0"])
    kv.key_value_set(f"addr/{pid}", srv.address())
    rows = max(1, int(size_mib * 2**20 / 4 / 1024))
    shape = (rows, 1024)

    @jax.jit
    def work(x):      # ~10-30 ms on one CPU device: the sender's next task
        w = jnp.full((x.shape[1], x.shape[1]), 1e-3, x.dtype)
        for _ in range(8):
            x = jnp.tanh(x @ w)
        return x

    x = jax.device_put(jnp.ones(shape, jnp.float32), dev)
    work(x).block_until_ready()
    late, busy = mode.startswith("late"), mode.endswith("busy")
    kv.wait_at_barrier("ready", 60000)
    if pid == 0:
        for i in range(n):
            y = work(x + i).block_until_ready()
            kv.key_value_set(f"offered/{i}", repr(time.time()))
            srv.await_pull(i, [y])
            if busy:
                work(y).block_until_ready()
            else:
                time.sleep(0.03)
        kv.wait_at_barrier("done", 120000)
        return
    conn = srv.connect(kv.blocking_key_value_get("addr/0", 60000))
    spec = [jax.ShapeDtypeStruct(shape, jnp.float32,
                                 sharding=jax.sharding.SingleDeviceSharding(dev))]
    pulls = {} if late else {i: conn.pull(i, spec) for i in range(n)}
    lat = []
    for i in range(n):
        offered = float(kv.blocking_key_value_get(f"offered/{i}", 60000))
        asked = offered
        if late:
            asked = time.time()
            pulls[i] = conn.pull(i, spec)
        a = pulls[i][0]
        while not a.is_ready():
            time.sleep(0.0002)
        lat.append((time.time() - max(offered, asked)) * 1e3)
    print("RESULT " + json.dumps({"mode": mode, "ms": lat}), flush=True)
    kv.wait_at_barrier("done", 120000)


def _latency(mode: str, n: int, size_mib: float) -> list[float]:
    port = _free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--role"]
    procs = [subprocess.Popen(cmd + [str(p), str(port), mode, str(n), str(size_mib)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for p in (0, 1)]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            raise SystemExit(f"transfer_latency: mode {mode!r} did not finish in 300 s")
        out.append(text)
    for line in out[1].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["ms"]
    raise SystemExit(f"transfer_latency: mode {mode!r}: expected a RESULT line from the "
                     f"receiver, found:\n{out[1][-2000:]}")


def _assembly(repeats: int) -> dict[str, list[float]]:
    """Milliseconds to build the replicated value on 4 devices from the 4 tiles, both ways
    (in one process: 8 devices, the 'receiving' 4 of them hold the pulled tiles)."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from rhino.runtime.transfer import process_resharding as pr
    devs = jax.devices()
    src = NamedSharding(Mesh(np.array(devs[:4]), ("x",)), P("x"))
    dst = NamedSharding(Mesh(np.array(devs[4:]), ("x",)), P())
    value = np.arange(2048 * 256, dtype=np.float32).reshape(2048, 256)
    x = jax.device_put(value, src)
    out: dict[str, list[float]] = {"pieces (general plan)": [], "relayout": []}
    plan = pr.process_plan(src, dst, value.shape, 4,
                           host_of=lambda d: 0 if d.id < 4 else 1)   # pretended processes
    short = pr.relayout(src, dst, value.shape)
    for k in range(repeats + 1):
        sent = pr.offers(plan, x, 0)
        got = {0: [jax.device_put(a, dev) for a, (_, dev) in
                   zip(sent[1], pr.wanted(plan, dst, np.float32, 1)[0])]}
        jax.block_until_ready(got)
        t = time.perf_counter()
        y = pr.assemble(plan, dst, got, 1, np.float32).block_until_ready()
        if k:
            out["pieces (general plan)"].append((time.perf_counter() - t) * 1e3)
        assert np.array_equal(np.asarray(y), value)
        sent = pr.relayout_offers(short, x, 0)
        got = {0: [jax.device_put(a, dev) for a, (_, dev) in
                   zip(sent[0], pr.relayout_wanted(short, src, value.shape, 0)[0])]}
        jax.block_until_ready(got)
        t = time.perf_counter()
        y = pr.relayout_assemble(short, dst, value.shape, got).block_until_ready()
        if k:
            out["relayout"].append((time.perf_counter() - t) * 1e3)
        assert np.array_equal(np.asarray(y), value)
    return out


def _row(name: str, ms: list[float]) -> str:
    return (f"| {name} | {statistics.median(ms):.2f} | {min(ms):.2f} | {max(ms):.2f} | "
            f"{len(ms)} |")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--role":
        _role(int(argv[1]), int(argv[2]), argv[3], int(argv[4]), float(argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=30, help="values per mode")
    ap.add_argument("--size-mib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=20, help="assembly repeats")
    args = ap.parse_args(argv)
    print(f"1. one {args.size_mib:g} MiB float32 value between two processes (JAX transfer "
          f"server, CPU), ms from the later of offer and request to arrival")
    print("| mode | median | min | max | values |\n|---|---:|---:|---:|---:|")
    for mode in MODES:
        print(_row(mode, _latency(mode, args.values, args.size_mib)), flush=True)
    print("\n2. receiving side: [2048, 256] float32, P('x') on 4 devices -> P() on 4 others, "
          "ms to build the target array from the pulled tiles")
    print("| assembly | median | min | max | repeats |\n|---|---:|---:|---:|---:|")
    for name, ms in _assembly(args.repeats).items():
        print(_row(name, ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
