"""What runs a step: the executors in this process and under ``rhino.launch``, and the
stage programs they run.

    stage_worker.py     StageWorker: one stage's mesh, programs and state, running its
                        instruction list once per step through a transport.
    local.py            LocalExecutor: one thread per stage over disjoint local devices.
    worker_spec.py      what one stage's worker is built from (programs, schedule, mesh).
    host_effects.py     host callbacks (jax.debug.print and the like) run in step order.
    spmd.py             SPMD execution facts: meshes, shardings checked, collectives.
    runs.py             a run's results handed from one call to the next (Handover).
    artifacts.py        stage programs exported (jax.export) for other processes to run.
    multicontroller.py  the executor of ``rhino.launch``: every process runs its stages.

May import: the base modules, ``rhino.runtime.scheduling``, ``rhino.runtime.transfer``,
``rhino.runtime.state``, and rhino's compiler side (``rhino.hlo_passes``, ``rhino.jaxpr``);
not ``rhino.runtime.ray``.
"""
