"""Running a step on a Ray cluster. The only part of rhino that imports ray, and only inside
functions, so ``import rhino`` never needs it.

    cluster.py     ``rhino.init``: reaching a Ray cluster; import_ray; cores per actor.
    actor.py       StageActor: one host of one stage mesh, one process of a jax.distributed
                   job; results kept on the actor.
    executor.py    the Ray executor (the driver): actors per host, values between stages by
                   JAX's transfers, state on the actors as RemoteArray handles; a failed
                   step costs the step, a dead actor names the state lost with it.
    arguments.py   the driver's side of a step's arguments: per actor, what is sent, kept,
                   pulled from another stage or made there (host_data).
    errors.py      Ray's failures named as a stage's failure.
    local_head.py  a local Ray head on free ports, stopped by its own process group.

May import every other part of the runtime; no other part of the runtime imports it (rhino's
front door and ``rhino.launch`` do).
"""
