"""The roofline cost model (issue 45): kernels fused as XLA fuses them
(``hlo_passes.fusion``), priced as max(FLOPs ÷ achievable FLOP/s, bytes ÷ bandwidth) +
launch (``planner.op_cost``), each figure checked against a cost derived by hand; and the
estimated MFU every plan report states (``planner.utilization``)."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import pytest

import rhino
from rhino.errors import OptionsError
from rhino.hlo_passes.fusion import fusion_kernels, matmul_square_flops
from rhino.planner.cost_model import CostModel
from rhino.planner.op_cost import OpTimes, model_flops
from rhino.planner.roofline import Roofline, interpolate

DATA = pathlib.Path(__file__).parent / "data"
MiB = 2**20


def cost_of(roof: Roofline, peak: float = 1e12, **rates) -> CostModel:
    return CostModel((0.0,), (0.0,), peak, rates, roofline=roof)


def test_an_elementwise_chain_reads_its_input_and_writes_its_output_once():
    # tanh(x * 2 + 1) on 1 MiB: one kernel, 1 MiB read + 1 MiB written, whatever the chain's
    # length; memory-bound at 1 GB/s, plus one launch.
    g = rhino.ingest(lambda x: jnp.tanh(x * 2.0 + 1.0), jnp.ones((1024, 256)))
    (k,) = fusion_kernels(g)
    assert k.kind == "vector" and k.bytes == 2 * MiB and k.transcendentals == 1024 * 256
    assert {g.ops[m].opcode for m in k.members} == {"tanh", "add", "multiply", "broadcast"}
    roof = Roofline(1e9, 1e12, launch_s=1e-6)
    times = OpTimes(g, cost_of(roof))
    assert times.total() == pytest.approx(2 * MiB / 1e9 + 1e-6)
    # The kernel's time is shared among its ops and sums back to it; the launch is its
    # root's.
    assert sum(times.seconds(i) for i in range(len(g.ops))) == pytest.approx(times.total())
    assert times.op_costs[k.root].launches == 1
    # Split over 4 devices each moves a quarter; the launch is not divided.
    assert times.total(share=4) == pytest.approx(2 * MiB / 4 / 1e9 + 1e-6)


def test_compute_bound_vector_kernels_and_transcendentals():
    g = rhino.ingest(lambda x: jnp.tanh(x * 2.0 + 1.0), jnp.ones((1024, 256)))
    n = 1024 * 256
    # HLO counts 4 FLOPs per element (multiply, add, tanh and the 1-FLOP ops' broadcasts
    # are free); a slow vector unit makes the kernel compute-bound.
    flops = sum(op.flops for op in g.ops)
    assert flops == 3 * n
    slow = Roofline(1e12, 1e6)
    assert OpTimes(g, cost_of(slow)).total() == pytest.approx(3 * n / 1e6)
    # Transcendentals at their own rate come on top of the FLOPs.
    trans = Roofline(1e12, 1e6, transcendentals_per_s=1e5)
    assert OpTimes(g, cost_of(trans)).total() == pytest.approx(3 * n / 1e6 + n / 1e5)


def test_a_matmul_at_its_size_efficiency_or_its_bytes():
    g = rhino.ingest(lambda x, w: x @ w, jnp.ones((512, 256)), jnp.ones((256, 128)))
    (k,) = fusion_kernels(g)
    f = 2.0 * 512 * 256 * 128
    b = (512 * 256 + 256 * 128 + 512 * 128) * 4
    assert (k.kind, k.flops, k.bytes) == ("matmul", f, b)
    side = 3 / (1 / 512 + 1 / 128 + 1 / 256)                  # M, N, K
    assert k.square_flops == pytest.approx(2 * side ** 3)
    curve = ((1e6, 0.2), (1e9, 0.8))
    roof = Roofline(1e12, 1e12, {"f32": curve})
    eff = interpolate(curve, k.square_flops)
    assert 0.2 < eff < 0.8
    assert OpTimes(g, cost_of(roof, peak=1e11)).total() == pytest.approx(f / (1e11 * eff))
    # Memory-bound when bandwidth is scarce.
    narrow = Roofline(1e6, 1e12, {"f32": curve})
    assert OpTimes(g, cost_of(narrow, peak=1e11)).total() == pytest.approx(b / 1e6)
    # Split 4 ways: a quarter of the work at the efficiency of a quarter of the size.
    times = OpTimes(g, cost_of(roof, peak=1e11))
    quarter = f / 4 / (1e11 * interpolate(curve, k.square_flops / 4))
    assert times.seconds(k.root, 4) == pytest.approx(quarter)
    assert times.seconds(k.root, 4) > times.seconds(k.root) / 4   # smaller, less efficient


def test_a_bf16_matmul_runs_at_the_bf16_rate_and_efficiency():
    x = jnp.ones((256, 256), jnp.bfloat16)
    g = rhino.ingest(lambda a, b: a @ b, x, x)
    roof = Roofline(1e15, 1e12, {"f32": ((1e6, 1.0),), "bf16": ((1e6, 0.5),)})
    f = 2.0 * 256 ** 3
    assert OpTimes(g, cost_of(roof, 1e11, bf16=4e11)).total() == pytest.approx(f / 2e11)


def test_a_value_read_by_two_kernels_is_recomputed_when_cheap_and_written_when_not():
    n = 1 << 16
    x = jnp.ones((n,))

    def cheap(x):
        y = x * 2.0
        return jnp.sum(y), y + 1.0

    def dear(x):
        e = jnp.exp(x)
        return jnp.sum(e), e * 3.0

    ks = fusion_kernels(rhino.ingest(cheap, x))
    # y is recomputed in both: the sum reads x (writes 4 B), the add reads x, writes out.
    assert sorted(k.bytes for k in ks) == [4 * n + 4, 8 * n]
    ks = fusion_kernels(rhino.ingest(dear, x))
    # On CPU exp is written once (4n read + 4n written) and read by both.
    assert sorted(k.bytes for k in ks) == [4 * n + 4, 8 * n, 8 * n]
    # XLA:GPU recomputes it too.
    ks = fusion_kernels(rhino.ingest(dear, x), "gpu")
    assert sorted(k.bytes for k in ks) == [4 * n + 4, 8 * n]


def test_gpu_rules_fuse_a_softmax_into_one_kernel():
    x = jnp.ones((64, 1024))
    g = rhino.ingest(lambda x: jax.nn.softmax(x, axis=-1), x)
    total = 64 * 1024 * 4
    # On GPU (Triton's softmax fusion) the row max, exp, row sum and division are one
    # kernel: x read once, the result written once.
    (k,) = fusion_kernels(g, "gpu")
    assert k.bytes == 2 * total and g.ops[k.root].opcode == "divide"
    assert sum(g.ops[m].opcode == "reduce" for m in k.members) == 2
    # On CPU the reductions end kernels and exp is written for its two readers.
    cpu = fusion_kernels(g, "cpu")
    assert len(cpu) == 4 and sum(k.bytes for k in cpu) > 3 * total


def test_transposes_read_only_by_a_matmul_are_folded_into_it():
    g = rhino.ingest(lambda a, b: a.T @ b, jnp.ones((256, 128)), jnp.ones((256, 64)))
    ks = fusion_kernels(g)
    assert [k.kind for k in ks] == ["matmul"]
    assert ks[0].bytes == (256 * 128 + 256 * 64 + 128 * 64) * 4


def test_cudnn_attention_is_priced_as_the_fused_kernel_runs():
    g = rhino.ingest(str(DATA / "h200_cudnn_attention_step.hlo"))
    att = [k for k in fusion_kernels(g, "gpu") if k.kind == "attention"]
    assert len(att) == 2                      # forward and backward calls
    roof = Roofline(1e12, 1e13, attention_efficiency=0.5, fusion="gpu")
    cost = cost_of(roof, 5e14, bf16=1e15)
    times = OpTimes(g, cost)
    for k in att:
        op = g.ops[k.root]
        # Its matmul FLOPs at half the bf16 peak, or its operands and results (no
        # workspace, no scores) at the bandwidth: no [T, S] score matrix in memory.
        want = max(op.flops / (1e15 * 0.5), k.bytes / 1e12)
        assert times.seconds(k.root) == pytest.approx(want)
        ins = sum(g.ops[o].shape.nbytes for o in dict.fromkeys(op.operands))
        assert k.bytes < 2 * ins + 4 * sum(t.nbytes for t in [g.ops[o].shape for o in
                                                                op.operands])


def test_without_a_roofline_an_op_costs_its_flops_at_its_dtype_rate():
    g = rhino.ingest(lambda x, w: jnp.tanh(x @ w), jnp.ones((64, 32)), jnp.ones((32, 16)))
    cost = CostModel((0.0,), (0.0,), 1e9)
    times = OpTimes(g, cost)
    assert times.kernels == []
    for op in g.ops:
        assert times.seconds(op.id, 2) == pytest.approx(op.flops / 2e9)
    assert model_flops(g) == 2 * 64 * 32 * 16


def test_square_size_of_a_skinny_product():
    g = rhino.ingest(lambda a, b: a @ b, jnp.ones((512, 512)), jnp.ones((512, 16)))
    side = 3 / (1 / 512 + 1 / 16 + 1 / 512)
    assert matmul_square_flops(g, g.ops[2]) == pytest.approx(2 * side ** 3)


def test_roofline_figures_are_checked_and_round_trip():
    r = Roofline(2e12, 5e13, {"bf16": [(1e9, 0.3), (1e12, 0.7)]}, 0.5, 2e-6, 7e-5,
                 (("intra", "all-reduce", 8, 1e-5, 1e-10),), "gpu", 1e9,
                 ((1e6, 4e12), (1e9, 2e12)),
                 collective_curves=(("intra", "all-reduce", 8, ((1e6, 1e-3), (4e6, 5e-3))),),
                 source="test")
    assert Roofline.from_dict(r.to_dict()) == r
    cost = cost_of(r)
    assert CostModel.from_json(cost.to_json()) == cost
    assert r.bandwidth_for(1e6) == 4e12 and r.bandwidth_for(1e10) == 2e12
    with pytest.raises(OptionsError, match="memory_bandwidth: expected a finite number > 0"):
        Roofline(0, 1e12)
    with pytest.raises(OptionsError, match="fusion: expected one of"):
        Roofline(1e9, 1e9, fusion="tpu")
    with pytest.raises(OptionsError, match="collectives: expected"):
        Roofline(1e9, 1e9, collectives=(("intra", "all-reduce", 1, 0.0, 0.0),))
    with pytest.raises(OptionsError, match="efficiency"):
        Roofline(1e9, 1e9, {"f32": [(1e9, 2.0)]})
    with pytest.raises(OptionsError, match="collective_curves: expected"):
        Roofline(1e9, 1e9, collective_curves=(("intra", "all-reduce", 8, ((1e6, -1.0),)),))


# ------------------------------------------------------------------------------ MFU
def test_the_plan_report_states_the_estimated_mfu():
    from rhino.models import get_model

    m = get_model("mlp", batch=256, hidden=256, layers=2)
    roof = Roofline(1e10, 1e10, {"f32": ((1e3, 0.6),)}, launch_s=1e-6, program_s=1e-5)
    cost = CostModel.uniform(1, flops_per_s=1e11, roofline=roof, backend="test")
    plan = rhino.plan(m.step, *m.example_args(), mesh_shape=(4,), cost=cost)
    spmd = plan.spmd
    u = spmd.utilization()
    assert u.model_flops == model_flops(rhino.ingest(m.step, *m.example_args()))
    assert u.mfu == pytest.approx(u.model_flops / (4 * 1e11 * plan.step_s))
    assert spmd.overhead_s == 1e-5 and plan.step_s == pytest.approx(
        spmd.compute_s + spmd.communication_s + 1e-5)
    # The roofline's matmul ceiling bounds any consistent estimate.
    assert u.ceiling == 0.6 and 0 < u.mfu <= 0.6 and not u.optimistic
    line = next(x for x in plan.report().splitlines() if "utilization" in x)
    assert f"estimated MFU {100 * u.mfu:.1f} %" in line and "WARNING" not in line


def test_a_datasheet_only_estimate_above_a_bare_matmul_is_flagged():
    from rhino.backends import BACKENDS
    from rhino.models import get_model

    m = get_model("mlp", batch=1024, hidden=1024, layers=2)
    h100 = BACKENDS["h100"].cost_model((1,))
    flat = CostModel(h100.alpha, h100.beta, h100.flops_per_s, h100.dtype_flops_per_s,
                     backend="h100")                        # FLOPs at the datasheet peak
    plan = rhino.plan(m.step, *m.example_args(), mesh_shape=(1,), cost=flat)
    u = plan.utilization()
    assert u.ceiling == pytest.approx(0.78)    # the H200's measured TF32 fraction
    assert u.mfu > u.ceiling and u.optimistic
    assert "WARNING: above the 78.0 % a bare f32 matmul reaches" in plan.report()
    # With the backend's own roofline the same step is priced below the ceiling.
    real = rhino.plan(m.step, *m.example_args(), mesh_shape=(1,), cost=h100)
    assert not real.utilization().optimistic and real.step_s > plan.step_s


def test_rhino_plan_gpt_mesh_8_states_the_estimated_mfu(capsys):
    from rhino.cli import main

    assert main(["plan", "gpt", "--mesh", "8", "--quiet"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  utilization"))
    assert "estimated MFU " in line and "model FLOP ÷ (8 devices ×" in line
    # A cluster's report (the controller's lines) states it too, for the chosen plan.
    assert main(["plan", "mlp:batch=32,hidden=64,layers=2", "--cluster", "1x2",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "utilization       estimated MFU" in out and "(2 devices ×" in out
