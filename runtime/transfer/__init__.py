"""What moves values: between stages, between meshes, between processes.

    transport.py           the Transport protocol, LocalTransport and StepTransport.
    placement.py           a value onto a sharding (place) or whole onto this host.
    load_balance.py        004 §3: the host-level model of cross-mesh traffic and the
                           sender balancers.
    resharding.py          004's cross-mesh resharding plans (send/recv, all-gather,
                           broadcast) and their execution between meshes of one process.
    cross_mesh.py          004's resharding as the local executor's stage-to-stage transport.
    process_resharding.py  a resharding plan cut into what each process sends and receives.
    jax_transfer.py        values between the processes of one jax.distributed job through
                           JAX's transfer server.

May import: the base modules (``rhino.runtime.failures``, ``rhino.runtime.threads``),
``rhino.errors`` and ``rhino.jaxpr``; nothing of the other runtime subpackages.
"""
