"""``fp8_autocast`` for JAX: the active recipe lives in a jit-keyed context, not on a class.

TransformerEngine/JAX kept the recipe in class attributes of ``FP8Helper`` (global mutable state). Here the
active :class:`Fp8Context` (enabled flag, :class:`~fp8engine.recipe.DelayedScaling`, :class:`MeshResource`) is
held in a ``jax.make_user_context`` context: it is read at **trace time**, and because its value is part of
``jax.jit``'s cache key, a function jitted under one recipe is re-traced (not silently reused) under another.
On JAX versions without ``jax.make_user_context`` a ``contextvars.ContextVar`` is used instead, and jitted
functions must then be re-created when the recipe changes (nothing keys the cache).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Iterator, Optional, Tuple

import jax

from fp8engine.recipe import DelayedScaling
from fp8engine.jax.sharding import MeshResource

__all__ = [
    "Fp8Context",
    "fp8_autocast",
    "get_fp8_context",
    "get_delayed_scaling",
    "is_fp8_available",
    "fp8_support",
]

#: The JAX path supports these amax reductions (the callable form of the recipe is torch-only).
SUPPORTED_AMAX_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class Fp8Context:
    """What ``fp8_autocast`` sets: hashable, so it can key ``jax.jit``'s cache.

    Attributes:
        enabled: FP8 GEMMs on (``True``) or the modules run their high-precision path (``False``).
        recipe: the :class:`~fp8engine.recipe.DelayedScaling` in force (``DelayedScaling()`` by default).
        mesh_resource: mesh axis names for dp/tp (``MeshResource()``: no parallelism).
    """

    enabled: bool = False
    recipe: DelayedScaling = field(default_factory=DelayedScaling)
    mesh_resource: MeshResource = field(default_factory=MeshResource)


_DEFAULT = Fp8Context()

if hasattr(jax, "make_user_context"):
    # Created once at import: JAX documents that creating user contexts is not thread-safe, using them is.
    _CONTEXT = jax.make_user_context(default_value=_DEFAULT)

    def get_fp8_context() -> Fp8Context:
        """The :class:`Fp8Context` of the innermost ``fp8_autocast`` (the default one outside any)."""
        return _CONTEXT.value

    @contextlib.contextmanager
    def _enter(ctx: Fp8Context) -> Iterator[None]:
        with _CONTEXT(ctx):
            yield

else:  # pragma: no cover - older JAX
    _CONTEXT_VAR: contextvars.ContextVar = contextvars.ContextVar("fp8engine_jax_fp8_context", default=_DEFAULT)

    def get_fp8_context() -> Fp8Context:
        """The :class:`Fp8Context` of the innermost ``fp8_autocast`` (the default one outside any)."""
        return _CONTEXT_VAR.get()

    @contextlib.contextmanager
    def _enter(ctx: Fp8Context) -> Iterator[None]:
        token = _CONTEXT_VAR.set(ctx)
        try:
            yield
        finally:
            _CONTEXT_VAR.reset(token)


def _check_recipe(recipe) -> DelayedScaling:
    if recipe is None:
        return DelayedScaling()
    if not isinstance(recipe, DelayedScaling):
        raise ValueError(
            f"the JAX frontend supports DelayedScaling recipes only; got {type(recipe).__name__}. "
            "Use fp8engine.recipe.DelayedScaling(...)"
        )
    if callable(recipe.amax_compute_algo) or recipe.amax_compute_algo not in SUPPORTED_AMAX_ALGOS:
        raise ValueError(
            f"the JAX frontend supports DelayedScaling.amax_compute_algo in {SUPPORTED_AMAX_ALGOS} only; "
            f"got {recipe.amax_compute_algo!r}"
        )
    if not recipe.reduce_amax:
        raise ValueError(
            "the JAX frontend supports DelayedScaling.reduce_amax=True only (amaxes are always reduced across "
            "the mesh); set reduce_amax=True"
        )
    return recipe


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = False,
    fp8_recipe: Optional[DelayedScaling] = None,
    mesh_resource: Optional[MeshResource] = None,
) -> Iterator[None]:
    """Run fp8engine.jax modules in FP8 (``enabled=True``) with ``fp8_recipe`` inside this block.

    Same signature and default as TransformerEngine/JAX's ``fp8_autocast`` (disabled by default). The
    context is read when a function is *traced*; jitted functions are keyed on it (see module docstring).

    Args:
        enabled: turn FP8 GEMMs on.
        fp8_recipe: a :class:`~fp8engine.recipe.DelayedScaling`; ``None`` means ``DelayedScaling()``.
        mesh_resource: mesh axis names for dp/tp; ``None`` means ``MeshResource()`` (no parallelism).

    Raises:
        ValueError: the recipe is not ``DelayedScaling``, its ``amax_compute_algo`` is not ``"max"`` or
            ``"most_recent"``, or ``reduce_amax`` is False; ``mesh_resource`` is not a ``MeshResource``;
            ``enabled`` and :func:`is_fp8_available` says no (the message carries the reason).
    """
    recipe = _check_recipe(fp8_recipe)
    mesh_resource = MeshResource() if mesh_resource is None else mesh_resource
    if not isinstance(mesh_resource, MeshResource):
        raise ValueError(f"mesh_resource must be a fp8engine.jax.MeshResource; got {mesh_resource!r}")
    if enabled:
        ok, reason = is_fp8_available()
        if not ok:
            raise ValueError(f"fp8_autocast(enabled=True) cannot run here: {reason}")
    with _enter(Fp8Context(bool(enabled), recipe, mesh_resource)):
        yield


def get_delayed_scaling() -> DelayedScaling:
    """The recipe of the innermost ``fp8_autocast`` (``DelayedScaling()`` outside any)."""
    return get_fp8_context().recipe


_NO_FP8_REASON = "Device compute capability 8.9 or higher required for FP8 execution."
_CPU_REASON = "FP8 is emulated on CPU: casts round to FP8, GEMMs run in higher precision."


def fp8_support(
    platform: str,
    compute_capability: Optional[Tuple[int, int]],
    cuda_version: Optional[Tuple[int, int]],
) -> Tuple[bool, str]:
    """The availability rule, from facts (same rule as the torch frontend).

    ``platform`` is JAX's (``"cpu"``, ``"gpu"``/``"cuda"``, ...); ``compute_capability`` ``(major, minor)``;
    ``cuda_version`` ``(major, minor)`` of the CUDA runtime (``None`` when unknown). Rules: CPU -> emulated
    (True); CC >= 9.0 -> True; CC 8.9 -> True only with CUDA >= 12.1; CC < 8.9 -> False.
    """
    if platform == "cpu":
        return True, _CPU_REASON
    if platform not in ("gpu", "cuda") or compute_capability is None:
        return False, f"FP8 execution needs an NVIDIA GPU (compute capability >= 8.9) or CPU; got {platform!r}"
    major, minor = compute_capability
    if compute_capability >= (9, 0):
        return True, f"compute capability {major}.{minor} supports FP8."
    if compute_capability < (8, 9):
        return False, _NO_FP8_REASON
    if cuda_version is None or cuda_version < (12, 1):
        return False, f"compute capability 8.9 needs CUDA 12.1 or newer for FP8; found CUDA {cuda_version}."
    return True, f"compute capability 8.9 with CUDA {cuda_version[0]}.{cuda_version[1]} supports FP8."


def _cuda_runtime_version() -> Optional[Tuple[int, int]]:
    try:
        from jax._src.lib import cuda_versions  # private; present on CUDA builds of jaxlib

        v = int(cuda_versions.cuda_runtime_get_version())  # e.g. 12040
        return v // 1000, (v % 1000) // 10
    except Exception:  # noqa: BLE001 - unknown build: treat the version as unknown
        return None


def is_fp8_available() -> Tuple[bool, str]:
    """``(available, reason)`` for the first local JAX device; see :func:`fp8_support` for the rule.

    Computed on every call (cheap; no cached global).
    """
    device = jax.local_devices()[0]
    cc = None
    raw = getattr(device, "compute_capability", None)
    if isinstance(raw, str) and raw.replace(".", "", 1).isdigit():
        major, _, minor = raw.partition(".")
        cc = (int(major), int(minor or 0))
    cuda = _cuda_runtime_version() if cc is not None else None
    return fp8_support(device.platform, cc, cuda)
