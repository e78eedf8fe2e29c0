"""How an op casts its operands under the active recipe: delayed scaling (scale from the module's
:class:`ScalingState`, amax recorded into its history) or current scaling (scale from this tensor's amax).

Two implementations, chosen per tensor by :func:`use_kernels`: the Triton kernels of ``fp8engine.kernels.cast``
on CUDA (one pass per cast; the gradient cast also writes the transpose and the bias gradient), the plain-PyTorch
path elsewhere. Both give the same FP8 bits for the same scale; the bias gradient differs only in summation order.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from fp8engine.fp8.autocast import FP8Context
from fp8engine.fp8.dtypes import fp8_dtype_of
from fp8engine.fp8.library import grad_amax_slot
from fp8engine.fp8.float8_tensor import Float8Tensor, current_scale, quantize, quantize_current, use_kernels
from fp8engine.fp8.state import ScalingState
from fp8engine.recipe import DelayedScaling

__all__ = ["FP8Plan", "begin_fp8", "cast_operand", "cast_grad", "use_kernels", "kernel_scale"]


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
    return _plan(recipe.fp8_format, delayed, ctx.record_amax)


@functools.lru_cache(maxsize=None)
def _plan(fmt, delayed: bool, record_amax: bool) -> FP8Plan:
    """The few distinct plans, built once (``begin_fp8`` runs in every FP8 forward)."""
    return FP8Plan(fp8_dtype_of(fmt.fwd), fp8_dtype_of(fmt.bwd), delayed, record_amax)


def kernel_scale(x: torch.Tensor, state: ScalingState, row: int, plan: FP8Plan, fp8_dtype: torch.dtype, *,
                 grad: bool, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(scale [1] fp32, amax_out [1] fp32 or None)`` for a cast kernel writing ``x`` for ``state`` row ``row``.

    Delayed scaling: ``state.scale[row]`` and the view ``state.amax_history[row, 0:1]`` the kernel max-accumulates
    into (always for gradients; for forward tensors unless recomputing). Current scaling: ``fp8_max / amax(x)``
    with ``amax`` from the ``compute_amax`` kernel (one read of ``x``) unless given; nothing recorded.
    """
    if plan.delayed:
        amax_out = state.amax_history[row, 0:1] if (grad or plan.record_amax) else None
        return state.scale[row:row + 1], amax_out
    if amax is None:
        from fp8engine.kernels.cast import compute_amax

        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        compute_amax(x, amax)
    return current_scale(amax, fp8_dtype), None


def _cast_kernel(x: torch.Tensor, state: ScalingState, row: int, plan: FP8Plan, fp8_dtype: torch.dtype, *,
                 grad: bool, transpose: bool, dbias: bool, amax: Optional[torch.Tensor] = None
                 ) -> tuple[Float8Tensor, Optional[torch.Tensor]]:
    from fp8engine.kernels import cast as kc

    x = x.contiguous()
    scale, amax_out = kernel_scale(x, state, row, plan, fp8_dtype, grad=grad, amax=amax)
    if dbias:
        data, data_t, scale_inv, db = kc.cast_transpose_dbias(x, scale, fp8_dtype, amax_out)
        return Float8Tensor(data, scale_inv, x.dtype, data_t), db
    data, data_t, scale_inv = kc.cast_to_fp8(x, scale, fp8_dtype, amax_out, transpose=transpose)
    return Float8Tensor(data, scale_inv, x.dtype, data_t), None


def cast_operand(x: torch.Tensor, state: ScalingState, row: int, plan: FP8Plan, *, grad: bool = False,
                 transpose: bool = False, amax: Optional[torch.Tensor] = None) -> Float8Tensor:
    """Cast ``x`` for the GEMM operand kept in ``state`` row ``row``.

    Delayed scaling uses ``state.scale[row]`` and max-accumulates ``|x|``'s amax into
    ``state.amax_history[row, 0]`` (always for gradients, for forward tensors unless recomputing). Current
    scaling computes the scale from ``x`` itself (or from ``amax`` when given, e.g. reduced across ranks).
    With kernels (:func:`use_kernels`) that is one ``compute_amax`` pass plus one cast (-transpose) pass.
    """
    fp8_dtype = plan.bwd_dtype if grad else plan.fwd_dtype
    if use_kernels(x):
        return _cast_kernel(x, state, row, plan, fp8_dtype, grad=grad, transpose=transpose, dbias=False,
                            amax=amax)[0]
    if not plan.delayed:
        return quantize_current(x, fp8_dtype, transpose=transpose, amax=amax)
    if grad:  # torch.compile: a slot of its own (fp8engine.fp8.library); eager: amax_history[row, 0:1]
        amax_out = grad_amax_slot(state, row)
    else:
        amax_out = state.amax_history[row, 0:1] if plan.record_amax else None
    return quantize(x, fp8_dtype, state.scale[row:row + 1], amax_out=amax_out, transpose=transpose)


def cast_grad(dy: torch.Tensor, state: ScalingState, row: int, plan: FP8Plan, *, transpose: bool,
              dbias: bool) -> tuple[Float8Tensor, Optional[torch.Tensor]]:
    """Cast the gradient ``dy [M, N]`` (``plan.bwd_dtype``, ``state`` row ``row``, amax always recorded under
    delayed scaling) and, with ``dbias``, return its column sums: ``(dy_fp8, dbias [N] in dy.dtype or None)``.

    Kernels: ``cast_transpose_dbias`` (one pass writing both layouts and the fp32-accumulated column sums) when
    ``dbias``, else ``cast_to_fp8``; under current scaling a ``compute_amax`` pass comes first. Torch path:
    :func:`cast_operand` then ``dy.sum(0, dtype=float32).to(dy.dtype)``. ``transpose``: also keep ``dy``'s
    transposed FP8 copy (for wgrad); the fused dbias kernel always writes it.
    """
    if use_kernels(dy):
        return _cast_kernel(dy, state, row, plan, plan.bwd_dtype, grad=True, transpose=transpose, dbias=dbias)
    dy_fp8 = cast_operand(dy, state, row, plan, grad=True, transpose=transpose)
    return dy_fp8, (dy.sum(0, dtype=torch.float32).to(dy.dtype) if dbias else None)
