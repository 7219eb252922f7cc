"""One-axis plans on a multi-axis mesh: the seed that keeps a 2-D plan no slower than 1-D.

A (2, 4) mesh can run every plan of the (8) mesh of the same devices: split over ``x`` and
``y`` together (``S[x,y]``) wherever the (8) plan splits over its one axis, and leave sums
pending over both as one group (``P(sum@x+y)``), reduced by one collective. With the cost
model's group α and β (those of the slowest axis, ``CostModel.group_alpha``) such a plan
costs on (2, 4) exactly what it costs on (8). Those choices are in the 2-D problem, but
O2 is a heuristic over a problem five times larger, and measured 2-13% slower than its
own (8) plan on four of the seven zoo models (issue 31).

So after O2 has searched a mesh with two or more axes longer than 1, ``fold_fallback``
solves the problem restricted to the *folded* choices (``folded_choices``: every spec of
the strategy splits one dimension over all those axes in mesh order, leaves a sum pending
over all of them as one group, or uses none of them), which is the one-axis problem with
its choices in the one-axis order, and keeps it where it is cheaper, so the 2-D plan is
never estimated slower than the plan O2 makes on one axis. (Handing it to O2 as a seed
instead did worse: on GPT it beat the chain's candidates before refinement and so took
the block and window moves that, from the chain's candidate, found a better plan.) A node
without folded choices (a pinned 2-D spec) keeps all of its choices.

Example:
    >>> import jax.numpy as jnp, rhino
    >>> from rhino.planner.build import build_problem
    >>> from rhino.planner.cost_model import CostModel
    >>> from rhino.planner.mesh import AbstractMesh
    >>> g = rhino.ingest(lambda x, w: jnp.tanh(x @ w), jnp.ones((16, 8)), jnp.ones((8, 8)))
    >>> built = build_problem(g, AbstractMesh((2, 2)), CostModel.simulated_cpu(2))
    >>> keep = folded_choices(built)
    >>> sorted({built.strategies[2][j].label for j in keep[2]})
    ['dot[R]', 'dot[k0@xy]', 'dot[m0@xy]', 'dot[n0@xy]']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rhino.planner.problem import ShardingProblem, Solution
from rhino.planner.spec import ShardingSpec


def _folded(spec: Any, active: tuple[int, ...]) -> bool:
    """Whether ``spec`` uses the ``active`` axes as one: all on one dimension in mesh
    order, all pending as one group, or none of them (a tuple spec: each element)."""
    if isinstance(spec, tuple):
        return all(_folded(x, active) for x in spec)
    if not isinstance(spec, ShardingSpec):
        return True
    used = spec.used_axes
    if not used:
        return True
    if set(used) != set(active):
        return False
    if spec.partial:
        return spec.partial_groups == (active,)
    return any(d.axes == active for d in spec.dims)


def folded_choices(built: Any) -> list[list[int]] | None:
    """Per node, the indices of its folded choices (module docstring), or all of them
    where it has none; None when the mesh has fewer than two axes longer than 1."""
    mesh = built.mesh
    active = tuple(a for a in range(mesh.ndim) if mesh.shape[a] > 1)
    if len(active) < 2:
        return None
    out = []
    for strats in built.strategies:
        keep = [j for j, s in enumerate(strats)
                if _folded(s.out_spec, active) and all(_folded(x, active) for x in s.in_specs)]
        out.append(keep or list(range(len(strats))))
    return out


def fold_fallback(built: Any, problem: ShardingProblem, found: Solution,
                  solve: Callable[[ShardingProblem], Solution]) -> Solution:
    """``found`` (a solution of ``problem``, a cost variant of ``built.problem``), or the
    folded problem's solution by ``solve`` where that is cheaper; ``found`` itself on a
    one-axis mesh.
    """
    keep = folded_choices(built)
    if keep is None:
        return found
    sol = solve(problem.restricted(keep))
    choice = tuple(k[c] for k, c in zip(keep, sol.choice))
    obj = problem.objective(choice)
    if not obj < problem.objective(found.choice):
        return found
    return dataclasses.replace(found, choice=choice, objective=obj,
                               seconds=found.seconds + sol.seconds)
