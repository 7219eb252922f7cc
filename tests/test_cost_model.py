"""The cost model (rhino.planner.cost_model) and the built-in figures per backend
(rhino.backends): JSON, validation, choice from the devices, and what it changes in plans."""

import dataclasses
import doctest
import json
import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

import rhino
from rhino import backends
from rhino.backends import (BACKENDS, backend_figures, cost_model_for_devices,
                            devices_per_host, figures_for_devices)
from rhino.cli import main
from rhino.cluster import Cluster, enumerate_splits
from rhino.errors import OptionsError
from rhino.models import get_model
from rhino.parallel_plan import Plan
from rhino.pipeline.api import make_cluster
from rhino.planner import cost_model as cost_module
from rhino.planner.cost_model import CostModel, compute_dtype, legacy_mesh
from rhino.planner.mesh import AbstractMesh
from rhino.planner.spmd_plan import SpmdPlan
from rhino.planner.strategies import generate_strategies

H100_KIND = "NVIDIA H100 80GB HBM3"


def fake_devices(n, platform="gpu", kind=H100_KIND, per_process=None):
    """``jax.Device``-like objects: platform, device_kind, process_index."""
    per = per_process or n
    return [SimpleNamespace(platform=platform, device_kind=kind, id=i, process_index=i // per,
                            slice_index=i // per) for i in range(n)]


def test_doctests():
    from rhino import cluster, planning
    from rhino.planner import api, build, collectives, mesh, spmd_plan, strategies, validate
    for mod in (cost_module, backends, mesh, collectives, strategies, build, validate, api,
                spmd_plan, planning, cluster):
        assert doctest.testmod(mod).failed == 0, mod.__name__


# ------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("cost", [
    CostModel.simulated_cpu(2),
    CostModel((1e-5, 2e-5), (1 / 450e9, 1 / 50e9), 494.5e12, {"bf16": 989.5e12, "f16": 989.5e12},
              80 * 10**9, True, False, "h100"),
    CostModel.uniform(1, memory_bytes=None),
])
def test_json_round_trip_is_exact_and_readable(cost):
    text = cost.to_json()
    assert CostModel.from_json(text) == cost
    d = json.loads(text)
    assert set(d) == {"backend", "alpha", "beta", "flops_per_s", "dtype_flops_per_s",
                      "memory_bytes", "native_reduce_scatter", "strided_moves_all_to_all"}
    assert isinstance(d["dtype_flops_per_s"], dict)
    assert hash(cost) == hash(CostModel.from_json(text))   # usable as a cache key


def test_from_dict_says_what_it_expected():
    good = CostModel.simulated_cpu(1).to_dict()
    with pytest.raises(OptionsError, match="found .*'gamma'"):
        CostModel.from_dict(dict(good, gamma=1))
    with pytest.raises(OptionsError, match="alpha, beta and flops_per_s required"):
        CostModel.from_dict({k: v for k, v in good.items() if k != "beta"})
    with pytest.raises(OptionsError, match="an object"):
        CostModel.from_dict([1, 2])


def test_simulated_cpu_figures_are_todays():
    cpu = CostModel.simulated_cpu(3)
    assert cpu.alpha == (1e-5,) * 3 and cpu.beta == (1 / 5e9,) * 3
    assert cpu.flops_per_s == 5e10 and cpu.dtype_flops_per_s == ()
    assert cpu.memory_bytes == 4 * 2**30 and not cpu.native_reduce_scatter
    assert cpu.strided_moves_all_to_all and cpu.backend == "cpu"
    assert all(cpu.flops_for(t) == 5e10 for t in ("f32", "bf16", "f16", "s32", None))
    for shape in [(8,), (2, 4), (2, 2, 2)]:
        assert BACKENDS["cpu"].cost_model(shape) == CostModel.simulated_cpu(len(shape))


def test_rate_per_dtype_and_with_flops():
    c = CostModel((0.0,), (0.0,), 1e12, {"bf16": 4e12})
    assert c.flops_for("bf16") == 4e12 and c.flops_for("f32") == c.flops_for("f64") == 1e12
    one = c.with_flops(2e12)
    assert one.flops_for("bf16") == one.flops_for("f32") == 2e12


def test_legacy_mesh_splits_an_old_mesh():
    old = {"shape": [2, 4], "axis_names": ["dp", "tp"], "alpha": [1e-5, 1e-6],
           "beta": [1e-9, 1e-10], "flops_per_s": 5e10, "memory_bytes": None,
           "native_reduce_scatter": False, "strided_moves_all_to_all": True}
    mesh, cost = legacy_mesh(old)
    assert mesh == AbstractMesh((2, 4), ("dp", "tp"))
    assert cost == CostModel((1e-5, 1e-6), (1e-9, 1e-10), 5e10, native_reduce_scatter=False)
    with pytest.raises(ValueError, match="'alpha'"):
        legacy_mesh({"shape": [2]})


# ------------------------------------------------------------------------------ figures
def test_h100_devices_get_h100_figures():
    devs = fake_devices(16, per_process=8)           # two hosts of 8 GPUs
    fig = figures_for_devices(devs)
    assert fig is BACKENDS["h100"] and fig.native_reduce_scatter
    assert devices_per_host(devs) == 8 and devices_per_host(devs[:8]) is None
    cost = cost_model_for_devices(devs, AbstractMesh((2, 8)))
    assert cost.backend == "h100"
    assert cost.beta == pytest.approx((1 / 50e9, 1 / 450e9))   # IB across hosts, NVLink within
    assert cost.alpha[0] > cost.alpha[1]
    assert cost.flops_for("bf16") == pytest.approx(989.5e12)
    assert cost.flops_for("f32") == pytest.approx(494.5e12)   # TF32: JAX's default precision
    assert cost.memory_bytes == 80 * 10**9
    one_host = cost_model_for_devices(devs[:8], (2, 4))
    assert one_host.beta == pytest.approx((1 / 450e9, 1 / 450e9))


@pytest.mark.parametrize("platform, kind, name", [
    ("cpu", "cpu", "cpu"), ("gpu", "NVIDIA H200", "h200"),
    ("gpu", "NVIDIA A100-SXM4-80GB", "a100"), ("tpu", "TPU v4", "tpu-v4"),
    ("tpu", "TPU v5 lite", "tpu-v5e"), ("tpu", "TPU v5p", "tpu-v5p"),
    ("cuda", H100_KIND, "h100")])
def test_device_kinds(platform, kind, name):
    assert figures_for_devices(fake_devices(2, platform, kind)).backend == name


def test_device_kind_variants_unknown_and_mixed():
    small = figures_for_devices(fake_devices(1, kind="NVIDIA A100-SXM4-40GB"))
    assert small.backend == "a100" and small.memory_bytes == 40 * 10**9
    with pytest.warns(UserWarning, match="no built-in figures .*'NVIDIA L4'"):
        odd = figures_for_devices(fake_devices(1, kind="NVIDIA L4"))
    assert odd.backend == "unknown-gpu" and odd.native_reduce_scatter
    assert odd.flops_per_s == BACKENDS["cpu"].flops_per_s
    with pytest.raises(OptionsError, match="one kind"):
        figures_for_devices(fake_devices(1) + fake_devices(1, kind="NVIDIA A100-SXM4-80GB"))
    with pytest.raises(OptionsError, match="at least one device"):
        figures_for_devices([])


def test_every_builtin_backend_is_named_and_sourced():
    for name, fig in BACKENDS.items():
        assert backend_figures(name.upper()) is fig and fig.backend == name and fig.source
        assert fig.flops_per_s > 0 and fig.beta_intra <= fig.beta_inter
        cost = fig.cost_model((2, 4))
        assert cost.backend == name and cost.ndim == 2
    assert backend_figures("v5e") is BACKENDS["tpu-v5e"]
    with pytest.raises(OptionsError, match="expected one of cpu, h100"):
        backend_figures("b200")


def test_real_devices_are_cpu():
    assert cost_model_for_devices(jax.devices(), (2, 4)) == CostModel.simulated_cpu(2)


# ------------------------------------------------------------------------------ planning
def test_op_dtype_sets_the_compute_rate():
    bf = jnp.bfloat16
    g = rhino.ingest(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32),
                     jnp.ones((64, 32), bf), jnp.ones((32, 32), bf))
    dot = next(op for op in g.ops if op.opcode == "dot")
    assert dot.shape.dtype == "f32" and compute_dtype(g, dot) == "bf16"
    with_roofline = backend_figures("h100").cost_model((4,))
    h100 = dataclasses.replace(with_roofline, roofline=None)     # FLOPs at the peak only
    ss = generate_strategies(g, AbstractMesh((4,)), h100)
    by = {s.label: s for s in ss.strategies[dot.id]}
    assert by["dot[R]"].compute_cost == dot.flops / h100.flops_for("bf16")
    assert by["dot[m0@x]"].compute_cost == dot.flops / (h100.flops_for("bf16") * 4)
    # With the H100's roofline this small dot is memory-bound: bf16 operands (2 B) and an
    # f32 result (4 B) at the achievable bandwidth, plus one kernel launch.
    ss = generate_strategies(g, AbstractMesh((4,)), with_roofline)
    by = {s.label: s for s in ss.strategies[dot.id]}
    roof = with_roofline.roofline
    nbytes = 64 * 32 * 2 + 32 * 32 * 2 + 64 * 32 * 4
    assert by["dot[R]"].compute_cost == pytest.approx(nbytes / roof.memory_bandwidth
                                                      + roof.launch_s)


@pytest.fixture(scope="module")
def gpt():
    m = get_model("gpt", layers=2, hidden=128, heads=4, seq=32, vocab=512)
    return rhino.ingest(m.step, *m.example_args())


def test_gpu_cost_model_changes_the_plan(gpt):
    cpu = rhino.plan(gpt, mesh_shape=(2, 4)).spmd
    gpu = rhino.plan(gpt, mesh_shape=(2, 4), backend="h100").spmd
    assert cpu.cost.backend == "cpu" and gpu.cost.backend == "h100"
    # The compute estimate falls with the devices' rates; the balance with α and β moves.
    # (This toy step on an H100 is kernel launches more than FLOPs: ~1000 kernels of a
    # few µs each and the program's dispatch, where the CPU figures count FLOPs only.)
    assert gpu.step_time_s < cpu.step_time_s / 2
    assert gpu.overhead_s == backend_figures("h100").roofline.program_s
    assert gpu.compute_s / gpu.step_time_s != pytest.approx(cpu.compute_s / cpu.step_time_s)
    # XLA:GPU reduce-scatters where XLA:CPU all-reduces and slices.
    assert "reduce-scatter" not in cpu.collective_summary()
    assert SpmdPlan.from_json(gpu.to_json()) == gpu
    assert "h100: α" in gpu.report()


def test_plan_cost_options_and_errors(gpt):
    base = rhino.plan(gpt, mesh_shape=(4,)).spmd
    fast = rhino.plan(gpt, mesh_shape=(4,), flops_per_s=1e12).spmd
    assert fast.cost.flops_per_s == 1e12 and fast.cost.alpha == base.cost.alpha
    assert fast.compute_s < base.compute_s / 2      # (the plan itself may change too)
    one = rhino.plan(gpt, mesh_shape=(1,), flops_per_s=1e12).spmd   # nothing to shard
    assert one.compute_s == pytest.approx(gpt.total_flops / 1e12, rel=1e-9)
    given = CostModel((1e-5,), (1e-9,), 1e11, backend="lab")
    # Priced as the lowering runs the plan (strided moves as gathers), as auto_parallel does.
    from rhino.front_door import runnable_cost
    assert rhino.plan(gpt, mesh=AbstractMesh((4,)), cost=given).spmd.cost == \
        runnable_cost(given)
    with pytest.raises(OptionsError, match="2 axes"):
        rhino.plan(gpt, mesh_shape=(2, 2), cost=given)
    with pytest.raises(OptionsError, match="found both"):
        rhino.plan(gpt, mesh_shape=(4,), cost=given, backend="h100")
    with pytest.raises(OptionsError, match="expected one of"):
        rhino.plan(gpt, mesh_shape=(4,), backend="gpu9000")


def test_cli_flops_and_backend(capsys):
    args = ["plan", "mlp:batch=64,hidden=128", "--mesh", "1", "--json", "--quiet"]
    assert main(args) == 0
    base = json.loads(capsys.readouterr().out)["stages"][0]
    assert main(args + ["--flops", "1e12"]) == 0
    fast = json.loads(capsys.readouterr().out)["stages"][0]
    assert fast["cost"]["flops_per_s"] == 1e12 and base["cost"]["flops_per_s"] == 5e10
    assert fast["estimate"]["compute_s"] == pytest.approx(
        base["estimate"]["compute_s"] * 5e10 / 1e12, rel=1e-9)
    args[3] = "4"
    assert main(args + ["--backend", "h100"]) == 0
    gpu = json.loads(capsys.readouterr().out)["stages"][0]
    assert gpu["cost"]["backend"] == "h100" and gpu["cost"]["native_reduce_scatter"]
    assert main(args + ["--flops", "-3"]) == 2     # a usage error: one line on stderr
    assert "FLOP/s per device" in capsys.readouterr().err


def test_older_plan_documents_still_read(gpt):
    p = rhino.plan(gpt, mesh_shape=(2, 2))
    d = json.loads(p.to_json())
    # Plan format 2: stage meshes carried the cost figures, SPMD plans were format 1.
    old = json.loads(json.dumps(d))
    old["format"] = 2
    for key in ("backend", "dtype_flops_per_s"):
        del old["cluster"][key]
    for s in old["stages"]:
        for part in (s, s["spmd"]):
            cost = part.pop("cost")
            del cost["backend"], cost["dtype_flops_per_s"]
            part["mesh"].update(cost)
        s["spmd"]["format"] = 1
    q = Plan.from_json(json.dumps(old))
    want = dataclasses.replace(p.spmd.cost, backend="custom")
    assert q.stages[0].cost == want and q.spmd.cost == want and q.spmd.mesh == p.spmd.mesh
    assert q.spmd.ops == p.spmd.ops and q.step_s == p.step_s
    # ... and a format-1 SPMD plan on its own.
    assert Plan.from_json(json.dumps(old["stages"][0]["spmd"])).spmd.cost == want


# ------------------------------------------------------------------------------ clusters
def test_cluster_stage_costs_come_from_its_figures():
    c = Cluster.parse("2x8", figures=backend_figures("h100"))
    assert c.backend == "h100" and c.flops_per_s == pytest.approx(494.5e12)
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    hybrid = next(s for s in enumerate_splits(c, 2) if s.stage_shape == (2, 8))
    cost = hybrid.stage_cost(c)
    assert cost.beta == pytest.approx((1 / 50e9, 1 / 450e9)) and cost.backend == "h100"
    assert cost.flops_for("bf16") == pytest.approx(989.5e12) and cost.native_reduce_scatter
    assert hybrid.stage_mesh(c) == AbstractMesh((2, 8))
    assert make_cluster("2x8", "h100", beta_inter=1e-9).beta_inter == 1e-9
    assert make_cluster("2x8", "h100", flops_per_s=1e12).dtype_flops_per_s == ()
    with pytest.raises(OptionsError, match="carries its figures"):
        make_cluster(c, "h100")
    # A cluster dict of format 2 (no rates, no backend) is a simulated-CPU cluster.
    old = {k: v for k, v in Cluster.parse("1x4").to_dict().items()
           if k not in ("backend", "dtype_flops_per_s")}
    assert Cluster.from_dict(old) == Cluster.parse("1x4")


def test_plan_pipeline_with_backend():
    m = get_model("mlp", batch=32, hidden=64, layers=2)
    p = rhino.plan(m.step, *m.example_args(), cluster="1x2", max_stages=1, backend="a100")
    a100 = backends.backend_figures("a100")
    assert p.num_stages == 1 and p.cluster.backend == "a100"
    assert p.spmd.cost.backend == "a100"
    assert p.spmd.cost.flops_per_s == pytest.approx(a100.flops_per_s)
    assert dict(p.spmd.cost.dtype_flops_per_s) == pytest.approx(dict(a100.dtype_flops_per_s))
    assert p.cluster.memory_bytes == a100.memory_bytes


# ------------------------------------------------------------------------------ auto_parallel
def _mlp_step():
    m = get_model("mlp", batch=32, hidden=64, layers=2)
    params, opt = m.init(jax.random.PRNGKey(0))
    return m, (params, opt, m.make_batch(jax.random.PRNGKey(1)))


def test_auto_parallel_plans_with_the_devices_cost_model():
    m, args = _mlp_step()
    plan = rhino.auto_parallel(m.step, mesh_shape=(2,)).plan_for(*args)
    assert plan.spmd.cost == dataclasses.replace(CostModel.simulated_cpu(1),
                                                 strided_moves_all_to_all=False)
    named = rhino.auto_parallel(m.step, mesh_shape=(2,), cost="h100").plan_for(*args)
    assert named.spmd.cost.backend == "h100" and not named.spmd.cost.strided_moves_all_to_all
    own = CostModel((1e-6,), (1e-10,), 1e13, backend="lab")
    mine = rhino.auto_parallel(m.step, mesh_shape=(2,), cost=own).plan_for(*args)
    assert mine.spmd.cost == dataclasses.replace(own, strided_moves_all_to_all=False)


def test_auto_parallel_cost_option_errors():
    own = CostModel.simulated_cpu(1)
    with pytest.raises(OptionsError, match="2 axes"):
        rhino.auto_parallel(lambda x: x, mesh_shape=(2, 2), cost=own)
    with pytest.raises(OptionsError, match="cluster"):
        rhino.auto_parallel(lambda x: x, cluster="1x2", cost=own)
    with pytest.raises(OptionsError, match="expected one of"):
        rhino.auto_parallel(lambda x: x, cost="h900")
    with pytest.raises(OptionsError, match="rhino.CostModel"):
        rhino.auto_parallel(lambda x: x, cost=3.0)
    with pytest.raises(OptionsError, match="carries its figures"):
        rhino.auto_parallel(lambda x: x, cluster=Cluster.parse("1x2"), cost="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rhino.auto_parallel(lambda x: x, cluster="1x2", cost="h100")   # named figures: fine


def test_min_split_flops_forbids_replicating_heavy_work():
    """Where compute is nearly free next to communication (GPU-like FLOP per byte), the
    cost model's optimum replicates all the work; ``min_split_flops`` removes the replicated
    choices of every op at least that heavy (planner, ``auto_parallel`` and CLI), and the
    plan still runs equal to jax.jit."""
    import numpy as np

    from rhino.planner.build import BuildOptions

    m = get_model("gpt")
    g = rhino.ingest(m.step, *m.example_args())
    free = rhino.plan(g, mesh_shape=(8,), flops_per_s=2e14).spmd
    split = rhino.plan(g, mesh_shape=(8,), flops_per_s=2e14,
                       build=BuildOptions(min_split_flops=1e6)).spmd
    heavy = [i for i, op in enumerate(g.ops) if op.flops >= 1e6]
    assert heavy and all(free.ops[i].strategy.endswith("[R]") for i in heavy
                         if free.ops[i].opcode == "dot")
    assert free.communication_s == 0.0
    assert not any(split.ops[i].strategy.endswith("[R]") for i in heavy), \
        [split.ops[i].strategy for i in heavy]
    assert split.communication_s > 0

    params, opt = m.init(jax.random.PRNGKey(0))
    batch = m.make_batch(jax.random.PRNGKey(1))
    want = jax.jit(m.step)(params, opt, batch)[-1]
    step = rhino.auto_parallel(m.step, mesh_shape=(8,), cost=CostModel.simulated_cpu(1)
                               .with_flops(2e14), min_split_flops=1e6)
    got = step(jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, opt), batch)[-1]
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    plan = step._last.plan.spmd
    assert plan.communication_s > 0

    with pytest.raises(rhino.OptionsError, match="min_split_flops"):
        rhino.auto_parallel(m.step, mesh_shape=(8,), min_split_flops=-1.0)
    with pytest.raises(rhino.OptionsError, match="min_split_flops"):
        BuildOptions(min_split_flops=float("inf"))
    assert main(["plan", "gpt", "--mesh", "8", "--flops", "2e14", "--min-split-flops", "1e6",
                 "--json", "--quiet"]) == 0
