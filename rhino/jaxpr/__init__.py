"""Everything rhino does with JAX's internals and jaxprs, in one package.

A JAX upgrade that changes a private function, a primitive's name or an equation's
parameters breaks here and nowhere else (``tests/test_architecture.py`` checks that no other
module imports ``jax._src``, ``jax.core`` or ``jax.extend.core``, or spells a primitive's
name; ``tests/test_jaxpr_private.py`` has a canary per internal)::

    private.py      the private API: source lines, name stacks, binding, parameter layouts
                    that changed between releases (``scan_parts``), the StableHLO bridge
    primitives.py   the table of primitive names and what rhino knows of each
    interpret.py    the one interpreter: leaf_equations / flatten (static walks) and
                    Interpreter (re-binding evaluation) that annotation, scan unrolling,
                    stage programs and their analyses share
    factors.py      sharding rules of primitives with the microbatches as a time axis
    microbatch.py   microbatches as a sharding of the batch over time: per value, whether
                    it is computed per step or per microbatch, and how (its data in
                    layouts.py, its per-equation rules in mb_rules.py, control flow and
                    custom calls in bodies.py, evaluation per microbatch in mb_eval.py)
    keys.py         which arguments are PRNG keys (typed, or raw key data by its use)
"""
