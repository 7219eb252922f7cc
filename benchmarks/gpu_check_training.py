"""The training comparisons of ``benchmarks/gpu_check.py``: the zoo GPT under ``jax.jit``
and under ``rhino.auto_parallel`` on the same devices, in the same process.

Each comparison starts both from the same host copy of the initial state (bf16 on GPU:
parameters and Adam moments alike), feeds both the same batches, and records per run the
losses, the per-step wall times (each step blocked on its outputs; the first step, which
may still warm caches, is left out of the median), tokens per second, model FLOPs
utilization (6·N·tokens/s ÷ the peak of all devices used, N = every parameter, embeddings
included) and memory (the compiled program's ``memory_analysis()``, rhino's planner
estimate, and what the device allocator saw where it says). The comparison fills a dict as
it goes, so a failure half-way (rhino's plan, an out-of-memory) leaves the figures measured
before it in the record.

Three comparisons, as ``gpu_check`` steps:

* ``compare_single``: one device; ``jax.jit(step, donate_argnums=(0, 1))`` against
  ``rhino.auto_parallel(step, devices=[d])``.
* ``compare_spmd``: every device; ``jax.jit`` data parallel (state replicated, batch split
  over a 1-D mesh) against ``rhino.auto_parallel(step, devices=all)`` (rhino's own plan).
* ``compare_pipeline``: an even number of devices; the same data-parallel ``jax.jit``
  against ``rhino.auto_parallel(step, cluster="1xK", stages=2)`` on the local executor.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np


def loss_tolerance(dtype: str) -> float:
    """The relative loss difference accepted as equal: rounding of a different reduction
    order (another partition, microbatch sums) in ``dtype``'s precision."""
    return 2e-2 if dtype == "bfloat16" else 1e-4


def make_model(model_options: dict, batch: int):
    """The zoo GPT at ``model_options`` and ``batch`` sequences."""
    from rhino.models import get_model

    return get_model("gpt", **model_options, batch=int(batch))


def host_state(model, dtype: str, seed: int = 0) -> tuple[Any, Any]:
    """``(params, opt_state)`` on the host (numpy), parameters cast to ``dtype`` and the
    Adam state made for them (so its moments are ``dtype`` too)."""
    import jax
    import jax.numpy as jnp

    def init(key):
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)),
                              model.config.init_params(key))
        return params, model.optimizer().init(params)

    return jax.device_get(jax.jit(init)(jax.random.PRNGKey(seed)))


def abstract_state(model, dtype: str) -> tuple[Any, Any, Any]:
    """``(params, opt_state, batch)`` as ``ShapeDtypeStruct``s (nothing allocated)."""
    import jax
    import jax.numpy as jnp

    def init(key):
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)),
                              model.config.init_params(key))
        return params, model.optimizer().init(params)

    params, opt = jax.eval_shape(init, jax.random.PRNGKey(0))
    batch = jax.eval_shape(model.make_batch, jax.random.PRNGKey(1))
    return params, opt, batch


def host_batches(model, count: int) -> list[dict]:
    """``count`` different synthetic batches on the host."""
    import jax

    make = jax.jit(model.make_batch)
    return [jax.device_get(make(jax.random.PRNGKey(100 + i))) for i in range(count)]


def param_count(params: Any) -> int:
    """Elements of every parameter leaf."""
    import jax

    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def compiled_memory(compiled: Any) -> dict | None:
    """Per-device bytes of a compiled program (``rhino.runtime.executors.spmd.compiled_memory``)."""
    from rhino.runtime.executors.spmd import compiled_memory as cm

    return cm(compiled)


def device_memory(devices: Sequence[Any]) -> dict | None:
    """The allocator's figures of the first device (``memory_stats()``; None on CPU)."""
    stats = getattr(devices[0], "memory_stats", lambda: None)()
    if not stats:
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "largest_alloc_size")
    return {k: int(stats[k]) for k in keys if k in stats}


def collectives_of(text: Callable[[], str]) -> dict:
    """kind -> [count, bytes] of the collectives in a compiled program's text (``text()``);
    where rhino's HLO parser cannot read it, ``{"error": ...}`` instead (a finding about
    the parser, not a failed comparison)."""
    from rhino.runtime.executors.spmd import count_collectives, summarize

    try:
        return {k: list(v) for k, v in summarize(count_collectives(text())).items()}
    except Exception as e:  # noqa: BLE001 - recorded beside the other figures
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def xla_flops(compiled: Any) -> float | None:
    """FLOPs per call by XLA's cost analysis, where the backend gives one."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    return float(ca["flops"]) if ca and "flops" in ca else None


def train(call: Callable, state: tuple, batches: Sequence[Any],
          place: Callable[[Any], Any]) -> dict:
    """Run ``call(params, opt_state, batch)`` over ``batches``, feeding the state back.

    Returns:
        ``losses`` (floats), ``step_times_s``, ``first_step_s`` (with whatever the first
        call still compiles: a pipeline's stage programs) and ``step_s`` (the median of
        every step after the first; the only step when there is one).
    """
    import jax

    params, opt = state
    placed = [place(b) for b in batches]
    jax.block_until_ready(placed)
    losses, times = [], []
    for b in placed:
        t = time.perf_counter()
        params, opt, loss = call(params, opt, b)
        jax.block_until_ready((params, opt, loss))
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    timed = times[1:] or times
    return {"losses": losses, "step_times_s": times, "first_step_s": times[0],
            "step_s": statistics.median(timed)}


def throughput(rec: dict, n_params: int, tokens: int, devices: int,
               peak: float | None, measured_peak: float | None) -> None:
    """Add tokens/s and model FLOPs utilization (6·N·tokens/s ÷ peak × devices) to a run."""
    s = rec["step_s"]
    rec["tokens_per_s"] = tokens / s
    model_flops = 6.0 * n_params * tokens / s
    rec["model_flops_per_s"] = model_flops
    rec["mfu"] = model_flops / (peak * devices) if peak else None
    rec["mfu_of_measured_matmul_peak"] = (model_flops / (measured_peak * devices)
                                          if measured_peak else None)


def compare_losses(a: Sequence[float], b: Sequence[float], dtype: str) -> dict:
    """How far two loss curves are apart, and whether they are equal within tolerance."""
    if len(a) != len(b) or not a:
        raise ValueError(f"loss curves: expected two of the same non-zero length, found "
                         f"{len(a)} and {len(b)}")
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = np.abs(x - y)
    rel = diff / np.maximum(np.abs(y), 1e-12)
    tol = loss_tolerance(dtype)
    return {"max_abs_diff": float(diff.max()), "max_rel_diff": float(rel.max()),
            "first_step_rel_diff": float(rel[0]), "identical": bool((diff == 0).all()),
            "tolerance": tol, "equal": bool(rel.max() <= tol),
            "finite": bool(np.isfinite(x).all() and np.isfinite(y).all())}


def _leaves(tree: Any) -> int:
    import jax

    return len(jax.tree.leaves(tree))


def _placer(shardings: Sequence[Any] | None, first_batch_leaf: int) -> Callable:
    """Place a batch with the given flat shardings (its slice of a step's arguments)."""
    import jax

    def place(batch):
        if shardings is None:
            return batch
        flat, tree = jax.tree_util.tree_flatten(batch)
        sh = shardings[first_batch_leaf:first_batch_leaf + len(flat)]
        return jax.tree_util.tree_unflatten(tree, [jax.device_put(x, s)
                                                   for x, s in zip(flat, sh)])
    return place


def _rhino_batch_shardings(step, args: tuple) -> tuple[Sequence[Any] | None, str]:
    """The planned shardings of a directly run rhino program's inputs (as
    ``benchmarks/overhead.py`` reads them), so batches are placed before the timed calls;
    None (host batches, moved inside the call) for stage programs."""
    run = step._entry(args).run
    lowering = getattr(run, "lowering", None)
    shardings = getattr(lowering, "in_shardings", None)
    if getattr(run, "compiled", None) is None or shardings is None:
        return None, "host (moved by the executor each step)"
    return list(shardings), "planned input shardings"


def _jit_shardings(devices: Sequence[Any]) -> tuple[Any, Any]:
    """(replicated, split along dimension 0) over a 1-D mesh of ``devices``."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(list(devices)), ("x",))
    return NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))


def compile_jit(model, dtype: str, devices: Sequence[Any]) -> Any:
    """``jax.jit`` of the step compiled for ``devices``: state replicated, the batch split
    over a 1-D mesh (data parallel; on one device, plain ``jax.jit``), the state donated."""
    import jax

    rep, split = _jit_shardings(devices)
    fn = jax.jit(model.step, in_shardings=(rep, rep, split), out_shardings=(rep, rep, rep),
                 donate_argnums=(0, 1))
    return fn.lower(*abstract_state(model, dtype)).compile()


def run_jit(rec: dict, model, dtype: str, host: tuple, batches: list, devices: Sequence,
            compiled: Any = None) -> None:
    """Train with ``compile_jit``'s program (compiled here unless given). Fills ``rec`` as
    it goes."""
    import jax

    rep, split = _jit_shardings(devices)
    rec["devices"] = len(devices)
    if compiled is None:
        t = time.perf_counter()
        compiled = compile_jit(model, dtype, devices)
        rec["compile_s"] = time.perf_counter() - t
    else:
        rec["compile_s"] = None        # compiled when the batch was fitted
    rec["compiled_memory"] = compiled_memory(compiled)
    try:
        rec["xla_flops_per_step"] = xla_flops(compiled)
    except Exception as e:  # noqa: BLE001 - a figure some backends lack
        rec["xla_flops_per_step"] = None
        rec["xla_flops_error"] = f"{type(e).__name__}: {e}"
    if len(devices) > 1:
        rec["collectives"] = collectives_of(compiled.as_text)
    state = jax.device_put(host, rep)
    rec.update(train(compiled, state, batches, lambda b: jax.device_put(b, split)))
    rec["device_memory"] = device_memory(devices)


def run_rhino(rec: dict, model, host: tuple, batches: list, devices: Sequence,
              **options: Any) -> None:
    """``rhino.auto_parallel(step, devices=..., **options)``: plan and compile (timed),
    then train. Fills ``rec`` as it goes."""
    import rhino

    step = rhino.auto_parallel(model.step, devices=list(devices), **options)
    try:
        args = (host[0], host[1], batches[0])
        t = time.perf_counter()
        plan = step.plan_for(*args)
        rec["plan_and_compile_s"] = time.perf_counter() - t
        rec["plan"] = {"kind": plan.kind, "stages": plan.num_stages,
                       "stage_meshes": [list(s.mesh.shape) for s in plan.stages],
                       "estimated_step_s": plan.step_s,
                       "estimated_peak_bytes": [int(s.memory.total) for s in plan.stages]}
        if plan.kind == "spmd":
            sp = plan.spmd
            rec["plan"]["sharded_parameters"] = sum(not p.spec.is_replicated
                                                    for p in sp.params)
            rec["plan"]["parameters"] = len(sp.params)
        rec["compiled_memory"] = step.memory_for(*args)
        if rec["compiled_memory"] and len(devices) > 1:
            rec["collectives"] = collectives_of(lambda: step.compiled_text(*args))
        shardings, how = _rhino_batch_shardings(step, args)
        rec["batch_placement"] = how
        rec.update(train(step, host, batches, _placer(shardings, _leaves(host))))
        if plan.num_stages > 1:
            rec["executor_last_step_s"] = step.last_step_s
        rec["device_memory"] = device_memory(devices)
    finally:
        step.close()
    est = rec["plan"]["estimated_peak_bytes"]
    if rec.get("compiled_memory") and len(est) == 1 and est[0]:
        rec["compiled_over_estimated_memory"] = rec["compiled_memory"]["peak"] / est[0]
    if rec["plan"]["estimated_step_s"]:
        rec["measured_over_estimated_step"] = rec["step_s"] / rec["plan"]["estimated_step_s"]


def compare(rec: dict, model, dtype: str, devices: Sequence, ref_devices: Sequence,
            steps: int, peak: float | None, measured_peak: float | None,
            jit_compiled: Any = None, reference: dict | None = None,
            **rhino_options: Any) -> None:
    """One comparison: ``jax.jit`` on ``ref_devices`` against rhino on ``devices``.

    Args:
        jit_compiled: ``compile_jit``'s program for this model and ``ref_devices``, where
            one was compiled already.
        reference: a ``jax.jit`` run of this same model, batches and ``ref_devices`` made
            by an earlier comparison (its ``rec["jit"]``), used instead of running again.
        **rhino_options: ``rhino.auto_parallel``'s options beside ``devices``.
    """
    import gc

    cfg = model.config
    rec["model"] = {"batch": cfg.batch, "seq": cfg.seq, "layers": cfg.layers,
                    "hidden": cfg.hidden, "heads": cfg.heads, "vocab": cfg.vocab,
                    "dtype": dtype}
    host = host_state(model, dtype)
    batches = host_batches(model, steps)
    n_params = param_count(host[0])
    tokens = cfg.batch * cfg.seq
    rec.update(parameters=n_params, tokens_per_step=tokens, steps=steps)
    if reference is not None:
        rec["jit"] = jit = dict(reference)
    else:
        rec["jit"] = jit = {}
        run_jit(jit, model, dtype, host, batches, ref_devices, jit_compiled)
        throughput(jit, n_params, tokens, len(ref_devices), peak, measured_peak)
    gc.collect()
    rec["rhino"] = rh = {}
    run_rhino(rh, model, host, batches, devices, **rhino_options)
    throughput(rh, n_params, tokens, len(devices), peak, measured_peak)
    rec["loss"] = compare_losses(rh["losses"], jit["losses"], dtype)
    rec["step_time_ratio"] = rh["step_s"] / jit["step_s"]
    gc.collect()
