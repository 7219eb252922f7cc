"""Runtime (task graph, schedules, executors, cross-mesh resharding), installed as
``rhino.runtime``. Only this package imports ray.

Not built yet: the runtime issue fills it. Nothing here pretends to run a plan.
"""
