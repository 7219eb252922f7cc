"""What a step that ran achieved: its measured time, examples and tokens per second, and
its MFU (model FLOPs ÷ (devices × peak FLOP/s × measured step), ``planner.utilization``),
as one line a training loop can log.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> plan = rhino.plan(lambda w, x: w - 0.1 * x.T @ (x @ w), jnp.ones((64, 64)),
    ...                   jnp.ones((128, 64)), mesh_shape=(2,))
    >>> print(throughput_line(plan, [1.0, 0.002, 0.004, 0.003], examples=128))  # doctest: +ELLIPSIS
    step 3.000 ms (median of 3 after the first): 42,667 examples/s; measured MFU ...
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Sequence

from rhino.errors import OptionsError


def steady_step_s(times: Sequence[float]) -> tuple[float, str]:
    """The median step time of ``times`` after the first (which compiles or warms up), or
    the one time there is; with how it was taken, for the line."""
    times = [float(t) for t in times]
    if not times or any(not t > 0 for t in times):
        raise OptionsError(f"step times: expected one or more positive seconds, found {times}")
    rest = times[1:] or times
    how = (f"median of {len(rest)} after the first" if len(times) > 1 else "one step")
    return statistics.median(rest), how


def throughput_line(plan: Any, times: Sequence[float], examples: int,
                    tokens: int | None = None) -> str:
    """One line: the steady step time of ``times`` (seconds per step, as measured around
    each call with the result ready), ``examples`` (and ``tokens``, for a sequence model)
    per second, and the measured MFU of ``plan``'s step (its model FLOPs, every device of
    its cluster, the peak of its first stage's cost model in the step's matmul dtype: on
    simulated CPU devices that peak is the planner's convention, not the host's)."""
    step_s, how = steady_step_s(times)
    u = dataclasses.replace(plan.utilization(), step_s=step_s, measured=True)
    rates = f"{examples / step_s:,.0f} examples/s"
    if tokens:
        rates += f", {tokens / step_s:,.0f} tokens/s"
    return f"step {1e3 * step_s:.3f} ms ({how}): {rates}; {u.line()}"


def batch_sizes(batch: Any) -> tuple[int, int | None]:
    """(examples, tokens) of a batch pytree: examples, the leading dimension of its first
    array; tokens, the size of an integer array of rank 2 under a ``tokens``, ``input_ids``
    or ``inputs`` key (a language model's batch), else None."""
    import jax
    import numpy as np

    leaves = [x for x in jax.tree_util.tree_leaves(batch) if np.ndim(x) >= 1]
    if not leaves:
        raise OptionsError("batch: expected an array with a leading batch dimension, found "
                           "none")
    examples = int(np.shape(leaves[0])[0])
    tokens = None
    if isinstance(batch, dict):
        for key in ("tokens", "input_ids", "inputs"):
            x = batch.get(key)
            if x is not None and np.ndim(x) == 2 and np.issubdtype(np.asarray(x).dtype,
                                                                    np.integer):
                tokens = int(np.size(x))
                break
    return examples, tokens
