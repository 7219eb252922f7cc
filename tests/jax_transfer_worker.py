"""One process of a ``jax.distributed`` job for ``tests/test_jax_transfer.py``:
``python jax_transfer_worker.py PROCESS_ID COORDINATOR_PORT SCENARIO``. Process 0 runs stage 0
on 2 devices, process 1 stage 1 on 4; the receiver checks exact values and prints ``OK name``
per check (or ``FAIL name: why``)."""

import os
import sys
import threading
import time

PID, PORT, SCENARIO = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={2 if PID == 0 else 4}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=2, process_id=PID,
                           initialization_timeout=60)

from rhino.jaxpr.private import distributed_kv_client  # noqa: E402
from rhino.runtime.jax_transfer import JaxTransferTransport  # noqa: E402
from rhino.runtime.transport import ExecutorError, Failure  # noqa: E402


def report(name, ok, why=""):
    print(f"{'OK' if ok else 'FAIL'} {name}{'' if ok else ': ' + why}", flush=True)


def on(process, n):
    return [d for d in jax.devices() if d.process_index == process][:n]


def mesh(process, n, axes=("x",)):
    return Mesh(np.array(on(process, n)), axes)


SRC = mesh(0, 2)
# ref -> (value on stage 0 (numpy or a function making it), source spec, target sharding)
KEYS = jax.random.split(jax.random.key(7), 8)
CASES = {
    1: (np.arange(24, dtype=np.float32).reshape(8, 3), P("x"), NamedSharding(mesh(1, 2), P("x"))),
    2: (np.arange(24, dtype=np.float32).reshape(8, 3), P("x"),
        NamedSharding(mesh(1, 4), P("x", None))),
    3: (np.arange(24, dtype=np.int32).reshape(4, 6), P(None, "x"),
        NamedSharding(mesh(1, 4), P("x"))),
    4: (KEYS, P("x"), NamedSharding(mesh(1, 4), P("x"))),
    5: (np.linspace(-3, 3, 16).astype(jax.numpy.bfloat16), P("x"),
        NamedSharding(mesh(1, 2), P("x"))),
    6: (np.arange(8, dtype=np.float32), P(), NamedSharding(mesh(1, 4), P("x"))),
    7: (np.arange(32, dtype=np.float32).reshape(4, 8), P("x"),
        NamedSharding(Mesh(np.array(on(1, 4)).reshape(2, 2), ("a", "b")), P("b", "a"))),
}
EXPECTED_MODE = {1: "whole", 2: "pieces", 3: "pieces", 4: "pieces", 5: "whole", 6: "pieces",
                 7: "pieces"}


def target(stage, ref):
    if ref in CASES:
        return CASES[ref][2]
    return NamedSharding(mesh(stage, 2), P())


def host(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(jax.device_get(x))


def basics(t):
    if PID == 0:
        for ref, (value, spec, _) in CASES.items():
            t.send(0, 1, (0, ref, 0), jax.device_put(value, NamedSharding(SRC, spec)))
        # 1F1B: send a, send b (from a background thread), recv c
        a = jax.device_put(np.full((4, 2), 1.0, np.float32), NamedSharding(SRC, P("x")))
        b = jax.device_put(np.full((4, 2), 2.0, np.float32), NamedSharding(SRC, P("x")))
        th = threading.Thread(target=lambda: (t.send(0, 1, (0, 10, 0), a),
                                              t.send(0, 1, (0, 10, 1), b)))
        th.start()
        th.join(30)
        del a, b   # the transfer server keeps what it offers
        c = t.recv(0, 1, (0, 11, 0), timeout=30)
        report("1f1b-c", np.array_equal(host(c), np.full((4, 2), 3.0, np.float32)), str(c))
        return
    for ref, (value, spec, tgt) in CASES.items():
        got = t.recv(1, 0, (0, ref, 0), timeout=30)
        want = host(value) if not isinstance(value, np.ndarray) else value
        ok = (np.array_equal(host(got), want) and got.sharding == tgt
              and got.dtype == (value.dtype if ref != 4 else KEYS.dtype)
              and t.modes[(0, ref, 0)] == EXPECTED_MODE[ref])
        report(f"case{ref}", ok, f"{host(got)} {got.sharding} {t.modes.get((0, ref, 0))}")
    a = t.recv(1, 0, (0, 10, 0), timeout=30)
    cval = jax.device_put(np.full((4, 2), 3.0, np.float32), NamedSharding(mesh(1, 2), P("x")))
    t.send(1, 0, (0, 11, 0), cval)
    b = t.recv(1, 0, (0, 10, 1), timeout=30)
    report("1f1b-ab", float(host(a).max()) == 1.0 and float(host(b).min()) == 2.0,
           f"{host(a)} {host(b)}")
    t0 = time.monotonic()
    try:
        t.recv(1, 0, (0, 99, 3), timeout=1.0)
        report("timeout", False, "no error")
    except ExecutorError as e:
        report("timeout", e.failure == Failure.TIMEOUT and "v99@3" in str(e)
               and "stage 1" in str(e) and time.monotonic() - t0 < 5, str(e))
    out = []

    def waiter():
        try:
            t.recv(1, 0, (1, 98, 0), timeout=30)
        except ExecutorError as e:
            out.append(e)
    th = threading.Thread(target=waiter)
    t0 = time.monotonic()
    th.start()
    time.sleep(0.3)
    t.abort(1, "stop now")
    th.join(10)
    report("abort", bool(out) and out[0].failure == Failure.ABORTED and
           "stop now" in str(out[0]) and time.monotonic() - t0 < 3, repr(out))


def main():
    t = JaxTransferTransport({0: 0, 1: 1}, target=target)
    if SCENARIO == "basics":
        basics(t)
    else:
        raise SystemExit(f"unknown scenario {SCENARIO}")
    distributed_kv_client().wait_at_barrier("rhino-test-end", 60_000)
    print("DONE", flush=True)
    sys.stdout.flush()
    os._exit(0)   # skip jax.distributed's shutdown barrier (minutes when a peer is gone)


if __name__ == "__main__":
    main()
