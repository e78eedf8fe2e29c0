"""Mesh axis naming for the JAX frontend, and the amax reduction across the mesh.

A :class:`MeshResource` names which axes of a ``jax.sharding.Mesh`` carry data parallelism (``dp``) and
tensor parallelism (``tp``). Modules refer to those *roles* (``"dp"``, ``"tp"``) and the active
``MeshResource`` (set by :func:`fp8engine.jax.fp8_autocast`) maps them to mesh axis names, so model code never
hard-codes mesh axis names.

Amax reduction: under ``jax.jit`` with sharded arrays (GSPMD), ``jnp.max(jnp.abs(x))`` already is the global
amax (XLA inserts the all-reduce). Inside ``shard_map`` each device sees only its shard, so the amax must be
reduced with ``lax.pmax`` over the bound mesh axes: :func:`reduce_amax` does that for every role axis that is
bound in the current trace, and nothing otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import jax
from jax import lax
from jax.sharding import PartitionSpec

__all__ = ["MeshResource", "ROLES", "resolve_spec", "bound_axes", "reduce_amax"]

#: The parallelism roles a module may name in its ``*_axes`` arguments.
ROLES = ("dp", "tp")


@dataclass(frozen=True)
class MeshResource:
    """Names of the mesh axes used for data (``dp_resource``) and tensor (``tp_resource``) parallelism.

    ``None`` means that kind of parallelism is not used. Example: ``MeshResource("data", "model")`` for
    ``Mesh(devices.reshape(2, 2), ("data", "model"))``.

    Raises:
        ValueError: a name is not ``None`` or a non-empty string, or both roles name the same axis.
    """

    dp_resource: Optional[str] = None
    tp_resource: Optional[str] = None

    def __post_init__(self) -> None:
        for field in ("dp_resource", "tp_resource"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"MeshResource.{field} must be None or a mesh axis name (str); got {value!r}")
        if self.dp_resource is not None and self.dp_resource == self.tp_resource:
            raise ValueError(
                f"MeshResource.dp_resource and tp_resource must be different mesh axes; both are "
                f"{self.dp_resource!r}"
            )

    def axis(self, role: Optional[str]) -> Optional[str]:
        """Mesh axis name for ``role`` (``"dp"``, ``"tp"`` or ``None``); ``None`` when the role is unused."""
        if role is None:
            return None
        if role not in ROLES:
            raise ValueError(f"unknown parallelism role {role!r}; use one of {ROLES} or None")
        return self.dp_resource if role == "dp" else self.tp_resource

    @property
    def axes(self) -> tuple:
        """The mesh axis names in use, dp first."""
        return tuple(a for a in (self.dp_resource, self.tp_resource) if a is not None)


def resolve_spec(roles: Sequence[Optional[str]], mesh_resource: MeshResource) -> Optional[PartitionSpec]:
    """``PartitionSpec`` of mesh axis names for per-dimension ``roles``; ``None`` when nothing is sharded.

    Example: roles ``(None, "tp")`` with ``MeshResource(tp_resource="model")`` gives ``P(None, "model")``.
    """
    names = tuple(mesh_resource.axis(r) for r in roles)
    if all(n is None for n in names):
        return None
    return PartitionSpec(*names)


def _is_bound(axis_name: str) -> bool:
    """Whether ``axis_name`` is a named axis of the current trace (inside ``shard_map``/``pmap``)."""
    try:
        lax.axis_size(axis_name)
    except (NameError, KeyError, ValueError):
        return False
    return True


def bound_axes(mesh_resource: MeshResource) -> tuple:
    """The axes of ``mesh_resource`` that are bound in the current trace (empty outside ``shard_map``)."""
    return tuple(a for a in mesh_resource.axes if _is_bound(a))


def reduce_amax(amax: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Global amax: ``lax.pmax`` of a per-shard ``amax`` (float32 scalar) over the named ``axes``.

    ``axes`` are mesh axis names bound in the current trace (see :func:`bound_axes`); with none, ``amax`` is
    returned as is. Max is exact and order-independent, so every device ends with the same bits as the
    unsharded computation.
    """
    axes = tuple(axes)
    if not axes:
        return amax
    return lax.pmax(amax, axes)
