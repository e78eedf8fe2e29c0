"""How an op casts its operands under the active recipe: delayed scaling (scale from the module's
:class:`ScalingState`, amax recorded into its history) or current scaling (scale from this tensor's amax)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fp8engine.fp8.autocast import FP8Context
from fp8engine.fp8.dtypes import fp8_dtype_of
from fp8engine.fp8.float8_tensor import Float8Tensor, quantize, quantize_current
from fp8engine.fp8.state import ScalingState
from fp8engine.recipe import DelayedScaling

__all__ = ["FP8Plan", "begin_fp8", "cast_operand"]


@dataclass(frozen=True)
class FP8Plan:
    """What one FP8 forward/backward needs to know of its region, fixed at forward time.

    fwd_dtype: FP8 dtype of forward operands (input, weight). bwd_dtype: FP8 dtype of gradients.
    delayed: True for :class:`DelayedScaling`. record_amax: False during activation-checkpoint recompute.
    """

    fwd_dtype: torch.dtype
    bwd_dtype: torch.dtype
    delayed: bool
    record_amax: bool


def begin_fp8(state: ScalingState, ctx: FP8Context) -> FP8Plan:
    """Prepare ``state`` for a cast under ``ctx`` (history length, registration) and return the plan."""
    recipe = ctx.recipe
    delayed = isinstance(recipe, DelayedScaling)
    if delayed:
        if state.amax_history.shape[1] != recipe.amax_history_len:
            state.resize_history(recipe.amax_history_len)
        ctx.register(state)
    fmt = recipe.fp8_format
    return FP8Plan(fp8_dtype_of(fmt.fwd), fp8_dtype_of(fmt.bwd), delayed, ctx.record_amax)


def cast_operand(x: torch.Tensor, state: ScalingState, row: int, plan: FP8Plan, *, grad: bool = False,
                 transpose: bool = False, amax: Optional[torch.Tensor] = None) -> Float8Tensor:
    """Cast ``x`` for the GEMM operand kept in ``state`` row ``row``.

    Delayed scaling uses ``state.scale[row]`` and max-accumulates ``|x|``'s amax into
    ``state.amax_history[row, 0]`` (always for gradients, for forward tensors unless recomputing). Current
    scaling computes the scale from ``x`` itself (or from ``amax`` when given, e.g. reduced across ranks).
    """
    fp8_dtype = plan.bwd_dtype if grad else plan.fwd_dtype
    if not plan.delayed:
        return quantize_current(x, fp8_dtype, transpose=transpose, amax=amax)
    amax_out = state.amax_history[row, 0:1] if (grad or plan.record_amax) else None
    return quantize(x, fp8_dtype, state.scale[row:row + 1], amax_out=amax_out, transpose=transpose)
