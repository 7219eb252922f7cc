"""``gpu_check.md``: the results of ``benchmarks/gpu_check.py`` as tables to paste into
``benchmarks/RESULTS.md``. Works on partial results (a step that failed or never ran
shows as such), since the file is rewritten after every step.

Example:
    >>> print(markdown({"mode": "dry-run", "steps": {}}).splitlines()[0])
    ## GPU check: ? × ?, dry-run (date ?)
"""

from __future__ import annotations

from typing import Any


def _get(d: Any, *keys: Any) -> Any:
    """``d[k0][k1]...``, None where any level is missing."""
    for k in keys:
        if isinstance(d, dict) and k in d:
            d = d[k]
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return None
    return d


def _si(x: float | None, unit: str) -> str:
    """A number with an SI prefix (``1.23 T`` + unit); ``—`` for None."""
    if x is None:
        return "—"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""),
                          (1e-3, "m"), (1e-6, "µ"), (1e-9, "n")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _bytes(x: float | None) -> str:
    if x is None:
        return "—"
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{int(x)} B"


def _f(x: float | None, fmt: str = ".3f", scale: float = 1.0) -> str:
    return "—" if x is None else format(x * scale, fmt)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _one_line(text: Any, width: int = 160) -> str:
    s = " ".join(str(text).split()).replace("|", "\\|")
    return s if len(s) <= width else s[:width - 1] + "…"


def _header(r: dict) -> list[str]:
    env = _get(r, "steps", "environment") or {}
    count, kind = env.get("device_count", "?"), env.get("device_kind", "?")
    date = (r.get("date") or "date ?")[:10] if r.get("date") else "date ?"
    cuda = env.get("cuda") or {}
    smi = env.get("nvidia_smi") or {}
    lines = [f"## GPU check: {count} × {kind}, {r.get('mode', '?')} ({date})", ""]
    parts = [f"Command: `{r.get('command', '?')}` ({r.get('date', '?')}; wall "
             f"{_f(r.get('wall_s'), '.0f')} s)."]
    if env:
        parts.append(f"Machine: {count} × {kind} ({env.get('backend')}, "
                     f"{cuda.get('backend', '?')}), allocator limit "
                     f"{_bytes(env.get('bytes_limit'))} per device, {env.get('host_cpus')} "
                     f"host CPUs; jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, rhino "
                     f"{env.get('rhino')}, Python {env.get('python')}"
                     + (f", CUDA (driver API) {smi.get('cuda_driver_api')}"
                        if smi.get("cuda_driver_api") else "")
                     + (f", driver/GPU: {_one_line('; '.join(smi.get('gpus', [])[:1]))}"
                        if smi.get("gpus") else "") + ".")
    if r.get("mode") == "dry-run":
        parts.append("**Dry run**: toy sizes on simulated CPU devices; no figure here is a "
                     "GPU's.")
    if r.get("error"):
        parts.append(f"**Stopped**: {r['error']}")
    return lines + [" ".join(parts), ""]


def _steps_table(r: dict) -> list[str]:
    out = ["| step | outcome | seconds | note |", "|---|---|---:|---|"]
    for name, rec in (r.get("steps") or {}).items():
        note = rec.get("error") or rec.get("reason") or rec.get("note") or ""
        out.append(f"| {name} | {rec.get('status', '?')} | {_f(rec.get('seconds'), '.1f')} "
                   f"| {_one_line(note)} |")
    return out + [""]


CALIBRATION_ROWS = (
    # (key, label, formatter)
    ("matmul_f32_flops", "matmul float32 (TF32 on GPU)", lambda x: _si(x, "FLOP/s")),
    ("matmul_bf16_flops", "matmul bfloat16", lambda x: _si(x, "FLOP/s")),
    ("memory_bandwidth_bytes_per_s", "memory bandwidth (x + 1)", lambda x: _si(x, "B/s")),
    ("launch_latency_s", "launch latency (one-element program)", lambda x: _si(x, "s")),
    ("memory_bytes", "device memory (allocator limit)", _bytes),
    ("allreduce_alpha_s", "all-reduce latency α (all devices)", lambda x: _si(x, "s")),
    ("link_bytes_per_s", "all-reduce bandwidth 1/β (all devices)", lambda x: _si(x, "B/s")),
)


def _calibration_table(r: dict) -> list[str]:
    cal = _get(r, "steps", "calibration") or {}
    if cal.get("status") != "ok" and not any(k in cal for k, _, _ in CALIBRATION_ROWS):
        return []
    backend = _get(cal, "figures", "backend") or "?"
    out = [f"| figure | measured | rhino.backends `{backend}` | measured ÷ figure |",
           "|---|---:|---:|---:|"]
    for key, label, fmt in CALIBRATION_ROWS:
        row = cal.get(key)
        if not isinstance(row, dict):
            continue
        out.append(f"| {label} | {fmt(row.get('measured'))} | {fmt(row.get('figure'))} | "
                   f"{_f(row.get('ratio'), '.2f')} |")
    return out + [""]


RUNS = (("single_device", "1 device"), ("spmd", "SPMD, all devices"),
        ("pipeline", "pipeline, 2 stages"))


def _training_table(r: dict) -> list[str]:
    rows = []
    for key, label in RUNS:
        rec = _get(r, "steps", key) or {}
        if "jit" not in rec:
            continue
        jit, rh, loss = rec.get("jit") or {}, rec.get("rhino") or {}, rec.get("loss") or {}
        est = _get(rh, "plan", "estimated_peak_bytes") or []
        equal = ("—" if not loss else
                 f"{'yes' if loss.get('equal') else '**no**'} "
                 f"({loss.get('max_rel_diff', 0):.1e})")
        model = rec.get("model") or {}
        rows.append(
            f"| {label} | {rec.get('cluster') or jit.get('devices', '?')} | "
            f"{model.get('batch', '?')} × {model.get('seq', '?')} | "
            f"{_si(rec.get('parameters'), '')} | {_f(jit.get('step_s'), '.2f', 1e3)} | "
            f"{_f(rh.get('step_s'), '.2f', 1e3)} | {_f(rec.get('step_time_ratio'), '.3f')} | "
            f"{_pct(jit.get('mfu'))} | {_pct(rh.get('mfu'))} | {equal} | "
            f"{_bytes(_get(jit, 'compiled_memory', 'peak'))} | "
            f"{_bytes(_get(rh, 'compiled_memory', 'peak'))} | "
            f"{' + '.join(_bytes(e) for e in est) or '—'} | "
            f"{_f(rh.get('compiled_over_estimated_memory'), '.2f')} | "
            f"{_f(_get(rh, 'plan', 'estimated_step_s'), '.2f', 1e3)} | "
            f"{_f(rh.get('plan_and_compile_s'), '.1f')} |")
    if not rows:
        return []
    return ["| run | devices | batch × seq | params | jit step ms | rhino step ms | "
            "rhino ÷ jit | jit MFU | rhino MFU | losses equal (max rel. diff) | jit compiled "
            "peak | rhino compiled peak | planner estimate | compiled ÷ estimate | est. step "
            "ms | rhino plan + compile s |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
            *rows, ""]


def _files_table(r: dict) -> list[str]:
    hlo = _get(r, "steps", "hlo") or {}
    plan = _get(r, "steps", "plan") or {}
    rows = []
    for key, rec in (("gpt", hlo.get("gpt")), ("gpt_compiled", hlo.get("gpt_compiled")),
                     ("attention", hlo.get("attention"))):
        if not isinstance(rec, dict) or "file" not in rec:
            continue
        calls = ", ".join(f"`{k}` ×{v}" for k, v in (rec.get("custom_calls") or {}).items())
        p = plan.get(key) if isinstance(plan.get(key), dict) else None
        planned = ("—" if p is None else f"exit {p.get('returncode')} in "
                   f"{_f(p.get('seconds'), '.1f')} s (`{p.get('file')}`)")
        rows.append(f"| `{rec['file']}` | {rec.get('lines')} | {calls or 'none'} | "
                    f"{planned} |")
    if not rows:
        return []
    mesh = f" (mesh {plan.get('mesh')}, figures {plan.get('backend') or 'cpu'})" \
        if plan.get("mesh") else ""
    return [f"| file | lines | custom calls | `rhino plan`{mesh} |", "|---|---:|---|---|",
            *rows, ""]


def markdown(results: dict) -> str:
    """The whole ``gpu_check.md``."""
    import gpu_check_cost

    return "\n".join([*_header(results), *_steps_table(results),
                      *_calibration_table(results), *_training_table(results),
                      *gpu_check_cost.markdown(results),
                      *_files_table(results)]).rstrip() + "\n"
