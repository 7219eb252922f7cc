"""Cross-mesh resharding: the 9 multi-device cases of 004's Table 2.

Two parts, side by side per case:

* **Simulated** (host-level model, ``rhino.runtime.transfer.load_balance``) at the paper's size: a
  (1024, 1024, 512) float32 tensor (2 GiB), 10 Gbit/s NIC per host, 100 GB/s inside a host
  (004 §5's p3.8xlarge cluster). Cross-host bytes and completion time for send/recv and
  send/recv + local all-gather (the paper's "Alpa" baseline), both with the greedy balancer
  the paper gives its baselines, and for broadcast with every balancer.
* **Executed** on this machine: the tensor scaled down 4× per dim to (256, 256, 128) float32
  (32 MiB), moved with ``jax.device_put`` between 8 simulated CPU devices; the meshes are as
  listed, rows of a mesh are its "hosts", and logical device ``d`` runs on jax device
  ``d % 8`` (cases 6, 7 and 8 need more than 8 logical devices). Every destination
  device's tile is checked against numpy; wall time is the median of 5 runs after a warm-up.
  Every copy is a real copy (``may_alias=False``), also when two logical devices share a
  jax device.
* **On Ray actors** (``--ray``): every host is a Ray actor holding its devices' tiles
  (``benchmarks/ray_resharding.py``); jobs move through the object store in the plan's
  order from the balancer's senders: broadcast puts each slice once and every receiving
  host fetches that one object and copies it to its devices; send/recv puts one object per
  destination device. The tensor is scaled down 8× per dim to (128, 128, 64) float32
  (4 MiB). Cross-host bytes are counted on the receiving actors (objects put by another
  simulated host); wall time is the median of ``--repeats`` runs after a warm-up; every
  destination tile is fetched back and compared with numpy. All actors share this
  machine: object-store times say nothing about a network.

Run::

    python benchmarks/cross_mesh_resharding.py [--dfs-budget 2.0] [--repeats 5] [--ray]
        [--skip-jax]

Asserts: broadcast never moves more cross-host bytes than send/recv; ``best`` is never worse
than any single balancer; every destination tile is right; broadcast(best) is ≥ 3× faster
than send/recv in the simulator on cases 3 and 9; on actors, counted cross-host bytes equal
the plan's and broadcast's are never more than send/recv's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from rhino.runtime.transfer.load_balance import Topology  # noqa: E402
from rhino.runtime.transfer.resharding import (DeviceMesh, distribute, execute,  # noqa: E402
                                      expected_tiles, plan_resharding)

# case: (send spec, recv spec, send mesh, recv mesh) — 004 Table 2 (case 5's "S_0RR" = S^0RR)
CASES = {
    1: ("S^0RR", "S^0RR", (2, 4), (2, 4)),
    2: ("RRR", "S^0RR", (2, 4), (2, 4)),
    3: ("RS^0R", "S^0RR", (2, 4), (2, 4)),
    4: ("RS^01R", "S^01RR", (2, 4), (2, 4)),
    5: ("S^1RR", "S^0RR", (2, 4), (2, 4)),
    6: ("S^0RR", "S^0RR", (2, 4), (3, 4)),
    7: ("S^1RR", "RRR", (1, 4), (2, 4)),
    8: ("RRR", "RRR", (2, 3), (3, 2)),
    9: ("RS^0R", "RRS^0", (2, 4), (2, 4)),
}
PAPER_SHAPE = (1024, 1024, 512)
RUN_SHAPE = (256, 256, 128)
RAY_SHAPE = (128, 128, 64)
BALANCERS = ("naive", "greedy", "randomized_greedy", "dfs", "best")


def meshes(case: int) -> tuple[DeviceMesh, DeviceMesh]:
    _, _, sm, dm = CASES[case]
    a = DeviceMesh.grid(sm)
    b = DeviceMesh.grid(dm, first_device=a.devices[-1] + 1, first_host=a.hosts[-1] + 1)
    return a, b


def simulate_case(case: int, topo: Topology, budget: float) -> dict:
    ss, ds, _, _ = CASES[case]
    a, b = meshes(case)
    out = {}
    for strat in ("send_recv", "allgather"):
        p = plan_resharding(PAPER_SHAPE, 4, a, ss, b, ds, strategy=strat, balancer="greedy",
                            topology=topo)
        out[strat] = (p.cross_host_bytes, p.simulated_s)
    for bal in BALANCERS:
        p = plan_resharding(PAPER_SHAPE, 4, a, ss, b, ds, strategy="broadcast", balancer=bal,
                            topology=topo, time_budget_s=budget)
        out[bal] = (p.cross_host_bytes, p.simulated_s, p.assignment.complete)
        out["tasks"] = len(p.tasks)
    return out


def execute_case(case: int, repeats: int) -> dict:
    ss, ds, _, _ = CASES[case]
    a, b = meshes(case)
    data = np.random.default_rng(case).standard_normal(RUN_SHAPE, dtype=np.float32)
    src = distribute(data, a, ss)
    want = expected_tiles(data, b, ds)
    out = {}
    for strat in ("send_recv", "allgather", "broadcast"):
        plan = plan_resharding(RUN_SHAPE, 4, a, ss, b, ds, strategy=strat, balancer="greedy")
        execute(plan, src)  # warm-up: compiles the slicing / assembly ops
        times = []
        for _ in range(repeats):
            ex = execute(plan, src)
            times.append(ex.seconds)
        for d, v in want.items():
            got = np.asarray(ex.pieces[d])
            assert np.array_equal(got, v), f"case {case} {strat}: device {d} holds wrong data"
        out[strat] = (ex.cross_host_bytes, statistics.median(times), ex.num_copies)
    return out


def ray_case(case: int, repeats: int, hosts, topo: Topology) -> dict:
    """Send/recv (greedy, as the baselines) and broadcast (best) on host actors."""
    from ray_resharding import check_tiles, execute_on_actors

    ss, ds, _, _ = CASES[case]
    a, b = meshes(case)
    data = np.random.default_rng(case).standard_normal(RAY_SHAPE, dtype=np.float32)
    src, want = expected_tiles(data, a, ss), expected_tiles(data, b, ds)
    out = {}
    for strat, bal in (("send_recv", "greedy"), ("broadcast", "best")):
        plan = plan_resharding(RAY_SHAPE, 4, a, ss, b, ds, strategy=strat, balancer=bal,
                               topology=topo)
        label = f"case {case}, {strat}"
        times = []
        for k in range(repeats + 1):   # the first run is a warm-up
            ex = execute_on_actors(plan, src, hosts, label=label)
            check_tiles(ex, want, label)   # every destination device, every run
            assert ex.cross_host_bytes == plan.cross_host_bytes, (label, ex.cross_host_bytes,
                                                                  plan.cross_host_bytes)
            if k:
                times.append(ex.seconds)
        out[strat] = (ex.cross_host_bytes, statistics.median(times), ex.puts, ex.fetches,
                      plan.simulated_s)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dfs-budget", type=float, default=2.0, help="DFS time budget, s")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ray", action="store_true", help="also run every case on Ray actors")
    ap.add_argument("--skip-jax", action="store_true", help="skip the jax.device_put part")
    args = ap.parse_args(argv)
    topo = Topology()
    gib = 2.0 ** 30

    print("### Simulated, (1024, 1024, 512) float32, 10 Gbit/s NIC, 100 GB/s intra-host\n")
    print("| case | send → recv | meshes | unit tasks | cross-host GiB s/r · ag · bc "
          "| s/r greedy s | ag greedy s | bc naive s | bc greedy s | bc rand-greedy s "
          "| bc DFS s | bc best s | s/r ÷ best | ag ÷ best |")
    print("|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sims = {}
    for case, (ss, ds, sm, dm) in CASES.items():
        r = sims[case] = simulate_case(case, topo, args.dfs_budget)
        sr_b, sr_t = r["send_recv"]
        ag_b, ag_t = r["allgather"]
        bc_b = r["best"][0]
        assert bc_b <= sr_b, f"case {case}: broadcast moves more cross-host bytes than s/r"
        assert all(r["best"][1] <= r[b][1] + 1e-12 for b in BALANCERS), case
        dfs = f"{r['dfs'][1]:.3f}" + ("" if r["dfs"][2] else "†")
        print(f"| {case} | {ss} → {ds} | {sm} → {dm} | {r['tasks']} | {sr_b / gib:.1f} · "
              f"{ag_b / gib:.1f} · {bc_b / gib:.1f} | {sr_t:.3f} | {ag_t:.3f} | "
              f"{r['naive'][1]:.3f} | {r['greedy'][1]:.3f} | {r['randomized_greedy'][1]:.3f} "
              f"| {dfs} | {r['best'][1]:.3f} | {sr_t / r['best'][1]:.2f}× | "
              f"{ag_t / r['best'][1]:.2f}× |")
    for case in (3, 9):
        ratio = sims[case]["send_recv"][1] / sims[case]["best"][1]
        assert ratio >= 3.0, f"case {case}: broadcast only {ratio:.2f}× faster than send/recv"
    if any(not r["dfs"][2] for r in sims.values()):
        print("\n† DFS stopped at its time budget (best schedule found so far).")
    print()
    if not args.skip_jax:
        execute_table(args.repeats)
    if args.ray:
        ray_table(args.repeats, topo)
    return 0


def execute_table(repeats: int) -> None:
    mib = 2.0 ** 20
    print(f"### Executed on jax CPU devices, {RUN_SHAPE} float32 "
          f"({np.prod(RUN_SHAPE) * 4 / mib:.0f} MiB), greedy balancer\n")
    print("| case | cross-host MiB s/r · ag · bc | copies s/r · ag · bc | s/r ms | ag ms "
          "| bc ms | s/r ÷ bc | data |")
    print("|---:|---|---|---:|---:|---:|---:|---|")
    for case in CASES:
        r = execute_case(case, repeats)
        (sb, st, sc), (ab, at, ac), (bb, bt, bcn) = r["send_recv"], r["allgather"], r["broadcast"]
        assert bb <= sb, f"case {case}: broadcast moved more cross-host bytes than s/r"
        print(f"| {case} | {sb / mib:.0f} · {ab / mib:.0f} · {bb / mib:.0f} | {sc} · {ac} · "
              f"{bcn} | {st * 1e3:.1f} | {at * 1e3:.1f} | {bt * 1e3:.1f} | {st / bt:.2f}× "
              f"| all tiles equal |")
    print()


def ray_table(repeats: int, topo: Topology) -> None:
    import ray

    from rhino.runtime.ray.executor import init
    from ray_resharding import HostActors

    mib = 2.0 ** 20
    init(num_cpus=4, log_to_driver=False)
    try:
        with HostActors(5, timeout=120.0) as hosts:
            print(f"### On Ray actors (one per host), {RAY_SHAPE} float32 "
                  f"({np.prod(RAY_SHAPE) * 4 / 2 ** 20:.0f} MiB); s/r greedy, bc best\n")
            print("| case | cross-host MiB s/r · bc (counted on actors = plan) "
                  "| objects put s/r · bc | fetched s/r · bc | s/r ms | bc ms | s/r ÷ bc "
                  "| simulated s/r ÷ bc (same plans) | data |")
            print("|---:|---|---|---|---:|---:|---:|---:|---|")
            for case in CASES:
                r = ray_case(case, repeats, hosts, topo)
                (sb, st, sp, sf, ss), (bb, bt, bp, bf, bs) = r["send_recv"], r["broadcast"]
                assert bb <= sb, f"case {case}: broadcast moved more cross-host bytes than s/r"
                print(f"| {case} | {sb / mib:.0f} · {bb / mib:.0f} | {sp} · {bp} | {sf} · {bf} "
                      f"| {st * 1e3:.1f} | {bt * 1e3:.1f} | {st / bt:.2f}× | {ss / bs:.2f}× "
                      f"| all tiles equal |")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
