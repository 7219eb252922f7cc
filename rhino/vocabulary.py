"""rhino's vocabulary: one enum per kind of name that crosses modules.

Every enum is a ``str`` enum: members compare equal to their value, print as it and are
written to JSON as it, so plans and reports keep their plain strings, and ``Kind(text)``
turns text back into a member (raising ``ValueError`` on anything else).

=================  ===========================================================================
``SolverStatus``   how a solve ended (``rhino.milp``)
``Role``           an op's part of a training step: free / forward / backward / apply
``TaskKind``       a pipeline task: forward ``F``, backward ``B``, apply-gradients ``A``
``PlanKind``       what a plan runs: ``spmd`` (one stage), ``pipeline``, ``hybrid``
``ScheduleKind``   the static pipeline schedule: ``1f1b``, ``gpipe``, ``eager-1f1b``, ``zb-h1``,
                   ``interleaved-1f1b``
                   (``auto``: the planner's choice)
``ExecutorKind``   where a step runs: ``local`` (this process) or ``ray`` (actors)
``TransportKind``  how values move between stage meshes
``Accumulate``     how batch-dependent values combine over microbatches
=================  ===========================================================================

Example:
    >>> TaskKind("B").long, Role.FORWARD == "fwd", str(PlanKind.HYBRID)
    ('backward', True, 'hybrid')
"""

from __future__ import annotations

import enum

from rhino.errors import OptionsError


class _Text(str, enum.Enum):
    """A str enum that prints as its value."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object, what: str) -> "_Text":
        """``value`` as a member, or ``OptionsError`` naming ``what``, the allowed values
        and what was found."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise OptionsError(f"{what}: expected one of {allowed}, found {value!r}") from None


class SolverStatus(_Text):
    """How a solve ended."""

    OPTIMAL = "optimal"            # proven optimal (within the relative gap)
    TIME_LIMIT = "time_limit"      # stopped by a limit; the best incumbent, if any
    INFEASIBLE = "infeasible"      # no assignment satisfies the constraints
    HEURISTIC = "heuristic"        # a heuristic's answer, with no optimality proof
    BRUTE_FORCE = "brute_force"    # exhaustive enumeration (tiny problems, tests)
    GIVEN = "given"                # supplied by the user, not searched


class Role(_Text):
    """An op's part of a training step (Rhino §6.1)."""

    FREE = "free"          # depends on no batch argument: recomputed wherever it is read
    FORWARD = "fwd"        # compute-gradients, forward half
    BACKWARD = "bwd"       # compute-gradients, backward half
    APPLY = "ag"           # apply-gradients (the optimizer update), once per step

    @property
    def rank(self) -> int:
        """Program order of the parts: forward < backward < apply (free: -1)."""
        return {Role.FREE: -1, Role.FORWARD: 0, Role.BACKWARD: 1, Role.APPLY: 2}[self]

    @property
    def task(self) -> "TaskKind | None":
        """The pipeline task that runs ops of this role (None for free ops)."""
        return {Role.FORWARD: TaskKind.FORWARD, Role.BACKWARD: TaskKind.BACKWARD,
                Role.APPLY: TaskKind.APPLY}.get(self)


class TaskKind(_Text):
    """A pipeline task (Rhino §6.1): per microbatch ``F`` and ``B``, once per step ``A``."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHTS = "W"           # a split backward's weight gradients (zb-h1)
    APPLY = "A"

    @property
    def long(self) -> str:
        return {"F": "forward", "B": "backward", "W": "weight gradients",
                "A": "apply"}[self.value]


class PlanKind(_Text):
    SPMD = "spmd"
    PIPELINE = "pipeline"
    HYBRID = "hybrid"


class ScheduleKind(_Text):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    EAGER_ONE_F_ONE_B = "eager-1f1b"
    ZB_H1 = "zb-h1"         # zero bubble: backward cut into B and W (hlo_passes.backward_split)
    INTERLEAVED = "interleaved-1f1b"   # virtual stages: a device group runs several stages
    AUTO = "auto"           # the planner's choice (rhino.pipeline.schedule_choice); no plan
                            # records it: a plan's schedule is one of the others

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as two tasks, B and W."""
        return self is ScheduleKind.ZB_H1


class ExecutorKind(_Text):
    LOCAL = "local"        # one process: the SPMD program called directly, or one thread
    RAY = "ray"            # per stage over disjoint local devices; Ray: one actor per stage


class TransportKind(_Text):
    DEVICE_PUT = "device_put"      # XLA's copy onto the receiver's sharding (one process)
    BROADCAST = "broadcast"        # 004's cross-mesh resharding, broadcast unit tasks
    SEND_RECV = "send_recv"        # 004's unit tasks as point-to-point sends
    JAX = "jax"                    # Ray: JAX's transfer server, device to device, one job

    @property
    def executor(self) -> "ExecutorKind":
        """The executor this transport belongs to."""
        return ExecutorKind.RAY if self is TransportKind.JAX else ExecutorKind.LOCAL


REMOVED_TRANSPORTS = ("object_store", "direct")
"""The Ray executor's former transports (a put and an actor call per value; rhino's own TCP
channels), removed after measurement (``benchmarks/RESULTS.md``): values between stages on
Ray move by JAX's transfers."""


def removed_transport(name: object) -> str:
    """Why ``name`` is no transport any more, to end an error message; "" for other names.

    >>> removed_transport("direct")[:60]
    ": the Ray executor's 'object_store' and 'direct' transports "
    >>> removed_transport("pigeon")
    ''
    """
    if name not in REMOVED_TRANSPORTS:
        return ""
    return (": the Ray executor's 'object_store' and 'direct' transports were removed; values "
            "between stages on Ray move by JAX's transfers (transport='jax', the default)")


class Accumulate(_Text):
    MEAN = "mean"          # the step's loss is a mean over the batch
    SUM = "sum"            # the step sums over the batch
