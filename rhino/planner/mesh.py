"""The abstract device mesh the planner plans for: axis names and sizes, nothing else.

The planner is pure: it never sees real devices. An ``AbstractMesh`` is the logical mesh
(e.g. ``(2, 4)`` = 2 hosts × 4 devices, axes ``x`` and ``y``), as ``jax.sharding.AbstractMesh``
is for jax. What a collective over an axis costs, how fast a device computes and how much
memory it has are the business of the cost model (``rhino.planner.cost_model.CostModel``),
which the planner takes next to the mesh.

Example:
    >>> mesh = AbstractMesh((2, 4))
    >>> mesh.axis_names, mesh.num_devices
    (('x', 'y'), 8)
    >>> AbstractMesh.from_json(mesh.to_json()) == mesh
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Sequence

_DEFAULT_NAMES = "xyzuvw"
MAX_DEVICES = 2 ** 20
"""The most devices a mesh or cluster may have: a plan lists every device of each stage
(``StagePlan.devices``), so planning for more would allocate in proportion to a count no
machine has; larger sizes are refused before anything is planned."""


def check_device_total(what: str, n: int) -> None:
    """Refuse ``n`` devices above ``MAX_DEVICES``, naming ``what`` (the option as given).

    >>> check_device_total("mesh shape (1000000000,)", 10 ** 9)
    Traceback (most recent call last):
    ...
    rhino.errors.OptionsError: mesh shape (1000000000,): expected at most 1048576 devices (a plan lists each device), found 1000000000
    """
    if n > MAX_DEVICES:
        from rhino.errors import OptionsError

        raise OptionsError(f"{what}: expected at most {MAX_DEVICES} devices (a plan lists "
                           f"each device), found {n}")
_KEYS = ("shape", "axis_names")


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """``x, y, z, u, v, w`` then ``a6, a7, ...`` for the first ``ndim`` axes."""
    return tuple(_DEFAULT_NAMES[i] if i < len(_DEFAULT_NAMES) else f"a{i}" for i in range(ndim))


@dataclasses.dataclass(frozen=True)
class AbstractMesh:
    """A logical device mesh: the size and name of each axis.

    Attributes:
        shape: number of devices along each mesh axis, e.g. ``(2, 4)``.
        axis_names: one name per axis; defaults to ``("x", "y", ...)``.

    Raises:
        ValueError: on empty or non-positive sizes, or names that are not one distinct name
            per axis.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape: expected a non-empty tuple of positive sizes, "
                             f"found {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        check_device_total(f"mesh shape {shape}", math.prod(shape))
        names = tuple(self.axis_names) or default_axis_names(len(shape))
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise ValueError(f"mesh axis_names: expected {len(shape)} distinct names, found "
                             f"{names!r}")
        object.__setattr__(self, "axis_names", names)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_name(self, axis: int) -> str:
        return self.axis_names[axis]

    def axis_index(self, name: str) -> int:
        """Index of the axis called ``name``."""
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise ValueError(f"mesh has no axis named {name!r}; axes are "
                             f"{self.axis_names!r}") from None

    def group_size(self, axes: Sequence[int]) -> int:
        """Number of devices in a group spanning ``axes``."""
        return math.prod(self.shape[a] for a in axes)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AbstractMesh":
        """The mesh of ``to_dict``.

        Raises:
            ValueError: a key missing, or keys other than ``shape`` and ``axis_names`` (a
                mesh of a plan written before the cost model was separate carries its α, β,
                FLOP/s and memory: read it with ``cost_model.legacy_mesh``).
        """
        extra = sorted(set(d) - set(_KEYS))
        if extra:
            raise ValueError(f"mesh JSON: expected the keys {list(_KEYS)}, found also {extra} "
                             f"(cost figures belong to a CostModel; an older plan's mesh is "
                             f"read with rhino.planner.cost_model.legacy_mesh)")
        if "shape" not in d:
            raise ValueError(f"mesh JSON: expected key 'shape', found keys {sorted(d)}")
        return cls(tuple(d["shape"]), tuple(d.get("axis_names", ())))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "AbstractMesh":
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape)) + ")"


def from_jax_mesh(mesh: Any) -> tuple[AbstractMesh, tuple | None]:
    """A JAX mesh as the planner's: (``AbstractMesh`` with its axis names and sizes, its
    devices in the mesh's row-major order, or None for an abstract one). Takes a
    ``jax.sharding.Mesh`` (``jax.make_mesh``), a ``jax.sharding.AbstractMesh`` or an
    ``AbstractMesh`` (returned as it is).

    Raises:
        TypeError: anything else, naming what was found.

    Example:
        >>> import jax
        >>> m, devices = from_jax_mesh(jax.sharding.Mesh(jax.devices()[:1], ("data",)))
        >>> m, len(devices)
        (AbstractMesh(shape=(1,), axis_names=('data',)), 1)
    """
    if isinstance(mesh, AbstractMesh):
        return mesh, None
    import jax

    if isinstance(mesh, jax.sharding.Mesh):
        return (AbstractMesh(tuple(mesh.devices.shape), tuple(mesh.axis_names)),
                tuple(mesh.devices.flat))
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return AbstractMesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names)), None
    raise TypeError(f"mesh: expected a rhino.AbstractMesh, a jax.sharding.Mesh "
                    f"(jax.make_mesh) or a jax.sharding.AbstractMesh, found "
                    f"{type(mesh).__name__}")
