"""What keeps the user's training state and data: checkpoints, host data, initialization on
the stage devices, and handles to state held by other processes.

    checkpoint.py    plain orbax checkpoints keyed by pytree paths, written atomically,
                     numbered steps (CheckpointManager); reads orbax and Flax ones.
    checkpoint_parts.py  the shards Ray stage actors write, read back; the first format.
    host_data.py     data made on the host that holds it (HostRequest, host_data).
    sharded_init.py  state created on its stage's devices, equal to a one-device init.
    remote_array.py  RemoteArray handles to values held by Ray actors, fetch, PackedKey.

May import: the base modules (``rhino.runtime.failures``, ``rhino.runtime.threads``) and
``rhino.errors``; nothing of the other runtime subpackages.
"""
