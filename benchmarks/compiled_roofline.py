"""The roofline of XLA's own compiled program against rhino's fusion model (issue 45).

Given XLA's optimized HLO of a one-device step (``gpu_check``'s ``gpt_step.compiled.hlo``)
and the HLO rhino plans (``gpt_step.hlo``), both priced with the same achievable figures:

* **compiled**: every kernel of the compiled program's entry computation (each fusion,
  library call — cuBLAS, cuDNN — copy, ...) at ``max(FLOPs / (peak × efficiency), bytes /
  bandwidth)``, its bytes its operands' and results' (workspaces left out), its FLOPs the
  dots inside it (a library matmul's from its dimension numbers), plus a launch each: what
  the roofline says of the program XLA actually runs;
* **rhino**: the planner's own estimate of the step before fusion (``planner.op_cost``:
  ``hlo_passes.fusion``'s model of how XLA fuses it), with the same figures.

Printed per kind of kernel: how many, FLOPs, bytes; then both totals. Their agreement with
each other checks the fusion model; their agreement with the measured step checks the
figures.

    python benchmarks/compiled_roofline.py COMPILED.hlo PLANNED.hlo --backend h200
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def _bytes(shape) -> int:
    from rhino.hlo_passes.graph import flatten_shape

    return sum(t.nbytes for t in flatten_shape(shape)
               if not (t.dtype in ("s8", "u8") and len(t.dims) == 1))


def _dot_flops(module, comp_name: str) -> float:
    """FLOPs of the dots in a fused computation (and the fusions it calls)."""
    comp = module.computations[comp_name.lstrip("%")]
    by = comp.by_name()
    total = 0.0
    for ins in comp.instrs:
        if ins.opcode == "dot":
            lhs = by[ins.operands[0]].shape
            k = 1
            for d in re.findall(r"\d+", ins.attrs.get("lhs_contracting_dims", "")):
                k *= lhs.dims[int(d)]
            total += 2.0 * ins.shape.numel * k
        elif ins.opcode == "fusion":
            total += _dot_flops(module, ins.attrs["calls"])
    return total


def compiled_kernels(text: str) -> list[tuple[str, float, float, str]]:
    """``(kind, FLOPs, bytes, dtype)`` of every kernel of a compiled program's entry."""
    from rhino.hlo_passes import hlo_text as ht
    from rhino.hlo_passes.graph import flatten_shape

    module = ht.parse_hlo_text(text, "<compiled>")
    entry = module.computations[module.entry_name]
    by = entry.by_name()
    out = []
    for ins in entry.instrs:
        if ins.opcode in ("parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
            continue
        nbytes = _bytes(ins.shape) + sum(_bytes(by[o].shape)
                                         for o in dict.fromkeys(ins.operands))
        dtype = flatten_shape(by[ins.operands[0]].shape)[0].dtype if ins.operands else "f32"
        flops, kind = 0.0, ins.opcode
        if ins.opcode == "custom-call":
            cfg = ins.attrs.get("backend_config", "")
            m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', cfg)
            if m:
                lhs = by[ins.operands[0]].shape
                k = 1
                for d in re.findall(r"\d+", m.group(1)):
                    k *= lhs.dims[int(d)]
                flops, kind = 2.0 * flatten_shape(ins.shape)[0].numel * k, "library matmul"
        elif ins.opcode == "fusion":
            flops = _dot_flops(module, ins.attrs["calls"])
            kind = f"fusion {ins.attrs.get('kind', '')}" + (" (matmul)" if flops else "")
        out.append((kind, flops, float(nbytes), dtype))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("compiled", help="XLA's optimized HLO text of the step")
    ap.add_argument("planned", nargs="?", help="the HLO rhino plans (optional)")
    ap.add_argument("--backend", default="h200", help="rhino.backends figures")
    a = ap.parse_args(argv)
    import rhino
    from rhino.backends import backend_figures
    from rhino.planner.op_cost import OpTimes

    cost = backend_figures(a.backend).cost_model((1,))
    roof = cost.roofline
    with open(a.compiled) as f:
        kernels = compiled_kernels(f.read())
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    total = 0.0
    for kind, flops, nbytes, dtype in kernels:
        row = agg[kind]
        row[0] += 1
        row[1] += flops
        row[2] += nbytes
        eff = roof.matmul_efficiency_for(dtype, flops) if flops else 1.0
        total += max(flops / (cost.flops_for(dtype) * eff) if flops else 0.0,
                     nbytes / roof.memory_bandwidth)
    print(f"figures: {cost.summary()}")
    for kind, (n, flops, nbytes) in sorted(agg.items()):
        print(f"  {kind:<24} {int(n):5d} kernels  {flops / 1e12:8.3f} TFLOP  "
              f"{nbytes / 1e9:8.2f} GB")
    launches = len(kernels) * roof.launch_s
    print(f"compiled program: {len(kernels)} kernels, roofline {1e3 * total:.1f} ms + "
          f"launches {1e3 * launches:.1f} ms + dispatch {1e6 * roof.program_s:.0f} µs = "
          f"{1e3 * (total + launches + roof.program_s):.1f} ms")
    if a.planned:
        graph = rhino.ingest(a.planned)
        times = OpTimes(graph, cost)
        by: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for k in times.kernels:
            row = by[k.kind]
            row[0] += 1
            row[1] += k.flops
            row[2] += k.bytes
        for kind, (n, flops, nbytes) in sorted(by.items()):
            print(f"  rhino {kind:<18} {int(n):5d} kernels  {flops / 1e12:8.3f} TFLOP  "
                  f"{nbytes / 1e9:8.2f} GB")
        print(f"rhino's fusion model: {len(times.kernels)} kernels, estimate "
              f"{1e3 * (times.total() + roof.program_s):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
