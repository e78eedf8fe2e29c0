"""``autocast`` / ``fp8_autocast``: the FP8 region, held in a ``contextvars.ContextVar`` (no global state).

Modules that cast to FP8 inside the region register their :class:`ScalingState` with the active context. When
the outermost-or-own region exits normally, all registered states get one delayed-scaling update (amaxes
reduced across ``amax_group`` in one collective first, when the recipe asks). Gradients' amaxes are recorded
during ``backward`` (after the region exited) and are consumed by the next region's update, so every scale in
use comes from past amaxes: delayed scaling, as in TransformerEngine.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from fp8engine.recipe import CurrentScaling, DelayedScaling, Float8BlockScaling

__all__ = ["autocast", "fp8_autocast", "get_fp8_recipe", "get_fp8_context", "FP8Context", "recompute_context"]


@dataclass
class FP8Context:
    """The active FP8 region: its recipe, the amax reduction group, and the scaling states used inside it.

    ``record_amax`` is False while activation checkpointing recomputes a forward, so amaxes are not counted twice.
    """

    recipe: object
    amax_group: object = None
    record_amax: bool = True
    states: dict = field(default_factory=dict)
    _recorders: list = field(default_factory=list, repr=False)

    def register(self, state) -> None:
        self.states[id(state)] = state
        for rec in self._recorders:
            rec[id(state)] = state

    @contextlib.contextmanager
    def recording(self):
        """Yield a dict that collects the states registered inside the ``with`` block (activation
        checkpointing uses it to know whose scales to pin for the recompute)."""
        rec: dict = {}
        self._recorders.append(rec)
        try:
            yield rec
        finally:
            self._recorders.remove(rec)


_FP8_CONTEXT: contextvars.ContextVar[Optional[FP8Context]] = contextvars.ContextVar("fp8engine_fp8_context",
                                                                                     default=None)


#: The active context again, for ``torch.compile``: Dynamo cannot read a ``ContextVar`` (graph break) but reads and
#: guards an attribute of a ``threading.local``, so a compiled module sees the region's context and re-traces when
#: the recipe (or FP8 on/off) changes. Attribute ``ctx``, set and restored with the ``ContextVar`` (the source of
#: truth in eager code; a context entered in another asyncio task of the same thread is not mirrored, so do not
#: compile inside tasks that interleave FP8 regions). A plain ``threading.local`` with no class-level default:
#: Dynamo special-cases exactly that type (a subclass's class attribute is resolved through the class by some
#: Dynamo versions).
_COMPILE_MIRROR = threading.local()


@contextlib.contextmanager
def _set_context(ctx: Optional[FP8Context]):
    token = _FP8_CONTEXT.set(ctx)
    mirror = ctx
    if ctx is not None and _interned(ctx.recipe) is not ctx.recipe:
        # same region (the states dict and recorders are shared), recipe interned for Dynamo's identity guard
        mirror = dataclasses.replace(ctx, recipe=_interned(ctx.recipe))
    outer = getattr(_COMPILE_MIRROR, "ctx", None)
    _COMPILE_MIRROR.ctx = mirror
    try:
        yield
    finally:
        _COMPILE_MIRROR.ctx = outer
        _FP8_CONTEXT.reset(token)


@functools.lru_cache(maxsize=64)
def _interned(recipe):
    """The first-seen recipe equal to ``recipe`` (recipes are frozen dataclasses). Compiled code guards the recipe
    object's identity, so a loop building ``DelayedScaling()`` anew each step would otherwise re-trace each step.
    Only the compile mirror holds it: eager code sees the user's own recipe object."""
    return recipe


def get_fp8_context() -> Optional[FP8Context]:
    """The active :class:`FP8Context`, or None outside an enabled FP8 region."""
    if torch.compiler.is_compiling():
        return getattr(_COMPILE_MIRROR, "ctx", None)
    return _FP8_CONTEXT.get()


def get_fp8_recipe():
    """The active recipe (:class:`DelayedScaling`, :class:`CurrentScaling` or :class:`Float8BlockScaling`), or None
    outside FP8 regions."""
    ctx = get_fp8_context()
    return None if ctx is None else ctx.recipe


def _one_group(name: str, group, alias: str, alias_group):
    """``group`` or its alias (TransformerEngine's ``amax_reduction_group``); ``TypeError`` if both are given and
    differ."""
    if alias_group is None:
        return group
    if group is not None and group is not alias_group:
        raise TypeError(f"{name} and {alias} are the same argument (the amax reduction group) and were given "
                        f"different groups; pass only one of them")
    return alias_group


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe=None, amax_group=None, *, amax_reduction_group=None):
    """Run the enclosed forward passes in FP8 with ``recipe`` (default ``DelayedScaling()``).

    Args:
        enabled: False opens a region where FP8 is off (inside an enabled one too); nesting restores the outer.
        recipe: :class:`fp8engine.recipe.DelayedScaling`, :class:`fp8engine.recipe.CurrentScaling` or
            :class:`fp8engine.recipe.Float8BlockScaling` (block-scaled GEMMs; the modules' GEMM dims must then be
            multiples of 128, checked at their first forward).
        amax_group: a ``torch.distributed`` process group across which amaxes are MAX-reduced before the scale
            update (``DelayedScaling.reduce_amax``); usually the data-parallel (or dp x tp) group.
        amax_reduction_group: keyword only; TransformerEngine 2.x's name of ``amax_group`` (``te.autocast(...,
            amax_reduction_group=...)``). Give one of the two.
    Raises:
        TypeError: ``recipe`` is not one of the recipes above, or ``amax_group`` and ``amax_reduction_group`` are
            different groups.
    """
    amax_group = _one_group("amax_group", amax_group, "amax_reduction_group", amax_reduction_group)
    if recipe is None:
        recipe = DelayedScaling()
    if not isinstance(recipe, (DelayedScaling, CurrentScaling, Float8BlockScaling)):
        raise TypeError("recipe must be fp8engine.recipe.DelayedScaling, CurrentScaling or Float8BlockScaling, "
                        f"got {type(recipe).__name__}")
    ctx = FP8Context(recipe, amax_group) if enabled else None
    with _set_context(ctx):
        yield ctx
    if ctx is not None and isinstance(recipe, DelayedScaling) and ctx.states:
        from fp8engine.fp8.state import reduce_and_update

        reduce_and_update(ctx.states.values(), recipe, amax_group)


def fp8_autocast(enabled: bool = True, fp8_recipe=None, fp8_group=None, *, amax_reduction_group=None):
    """TransformerEngine's spelling of :func:`autocast`: ``fp8_autocast(enabled, fp8_recipe, fp8_group)``;
    ``fp8_group`` (TransformerEngine 1.x) and ``amax_reduction_group`` (2.x) both name :func:`autocast`'s
    ``amax_group``. Raises :func:`autocast`'s errors, and ``TypeError`` when the two groups given differ."""
    group = _one_group("fp8_group", fp8_group, "amax_reduction_group", amax_reduction_group)
    return autocast(enabled=enabled, recipe=fp8_recipe, amax_group=group)


@contextlib.contextmanager
def recompute_context(ctx: Optional[FP8Context]):
    """Re-enter ``ctx``'s recipe for an activation-checkpoint recompute: same scales, amaxes not recorded,
    no scale update at exit."""
    with _set_context(None if ctx is None else FP8Context(ctx.recipe, ctx.amax_group, record_amax=False)):
        yield
