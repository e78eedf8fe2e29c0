"""The FP8 linear op: one ``autograd.Function`` around the three GEMMs.

- fprop: ``y  = x  @ w.T``   (E4M3 x E4M3 under HYBRID, fast accumulation)
- dgrad: ``dx = dy @ w``     (E5M2 grad x E4M3 weight)
- wgrad: ``dw = dy.T @ x``   (E5M2 grad x E4M3 input)

Operands are cast by the GEMM's :class:`~fp8engine.fp8.quantizer.LinearQuantizers`. Backward casts ``dy`` once with
``Quantizer.quantize_dbias`` (on CUDA the ``cast_transpose_dbias`` kernel:
both FP8 layouts and the bias gradient in one pass) and runs the two GEMMs in :func:`dgrad_wgrad`, which the fused
MLP op (``fp8engine.ops.mlp``) shares.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import LinearQuantizers, Quantizer
from fp8engine.ops.gemm import fp8_gemm, fp8_mm, fp8_mm_accumulate

__all__ = ["fp8_linear", "LINEAR_ROLES", "main_grad_of", "accumulate_wgrad", "linear_main_grad", "dgrad_wgrad",
           "linear_backward"]

#: Rows of a Linear's :class:`ScalingState`.
LINEAR_ROLES = ("input", "weight", "grad_output")


def main_grad_of(weight: torch.Parameter) -> torch.Tensor:
    """The fp32 ``weight.main_grad`` the user allocated for ``fuse_wgrad_accumulation``.

    Raises ValueError when ``main_grad`` is missing, not float32, or not shaped like the weight."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise ValueError("fuse_wgrad_accumulation=True needs weight.main_grad (an fp32 tensor shaped like the "
                         "weight) to be allocated before backward")
    if main_grad.dtype != torch.float32 or main_grad.shape != weight.shape:
        raise ValueError(f"weight.main_grad must be float32 with the weight's shape {tuple(weight.shape)}, got "
                         f"{main_grad.dtype} {tuple(main_grad.shape)}")
    return main_grad


def accumulate_wgrad(weight: torch.Parameter, dw: torch.Tensor) -> None:
    """Add a computed ``dw`` into ``weight.main_grad`` (the high-precision paths; FP8 wgrads accumulate inside
    the GEMM with :func:`fp8engine.ops.gemm.fp8_mm_accumulate`). Errors as :func:`main_grad_of`."""
    main_grad_of(weight).add_(dw)


class _HighPrecisionMainGrad(torch.autograd.Function):
    """High-precision linear whose wgrad goes into ``weight.main_grad`` (``fuse_wgrad_accumulation``)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2d, x2d = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        accumulate_wgrad(weight, (dy2d.t() @ x2d).float())
        db = dy2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dy @ weight, None, db


def linear_main_grad(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """High-precision ``F.linear`` whose weight gradient is added to ``weight.main_grad`` (``weight.grad`` stays
    None): the path ``fuse_wgrad_accumulation`` takes outside FP8 regions."""
    return _HighPrecisionMainGrad.apply(x, weight, bias)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, x_fp8: Float8Tensor, w_fp8: Float8Tensor, grad_quantizer: Quantizer,
                fuse_wgrad: bool):
        y = fp8_gemm(x_fp8, w_fp8, x.dtype, bias=None if bias is None else bias.to(x.dtype), use_fast_accum=True)
        ctx.save_for_backward(weight)
        # Backward needs only the transposed layouts (dgrad: W^T, wgrad: X^T); keep those, not the row-major bits.
        needs_dw = ctx.needs_input_grad[1] or fuse_wgrad
        ctx.x_t = (x_fp8.transpose_2d(), x_fp8.scale_inv) if needs_dw else None
        ctx.w_t = (w_fp8.transpose_2d(), w_fp8.scale_inv) if ctx.needs_input_grad[0] else None
        ctx.grad_quantizer, ctx.fuse_wgrad = grad_quantizer, fuse_wgrad
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        dy2d = dy.reshape(-1, dy.shape[-1])
        need_dw = ctx.needs_input_grad[1] or ctx.fuse_wgrad
        dy_fp8, db = ctx.grad_quantizer.quantize_dbias(dy2d, transpose=need_dw, dbias=ctx.needs_input_grad[2])
        return linear_backward(ctx, dy_fp8, db)


def linear_backward(ctx, dy_fp8: Float8Tensor, db: Optional[torch.Tensor]) -> tuple:
    """dgrad + wgrad of an ``_FP8Linear`` node given its output gradient already in FP8 (``dy_fp8 [M, N]``) and
    its bias gradient ``db`` (or None); returns the node's input gradients ``(dx, dw, db, None x 4)``."""
    (weight,) = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.fuse_wgrad
    dx, dw = dgrad_wgrad(dy_fp8, ctx.w_t if need_dx else None, ctx.x_t if need_dw else None, weight,
                         ctx.fuse_wgrad)
    ctx.x_t = ctx.w_t = None
    if dx is not None:
        dx = dx.reshape(ctx.x_shape)
    if db is not None:
        db = db.to(weight.dtype)
    return dx, dw, db, None, None, None, None


def dgrad_wgrad(dy_fp8: Float8Tensor, w_t: Optional[tuple], x_t: Optional[tuple], weight: torch.Tensor,
                fuse_wgrad: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The two backward GEMMs of a linear layer given its FP8 output gradient ``dy_fp8 [M, N]``.

    - dgrad ``dx = dy @ w`` ``[M, K]`` in ``dy_fp8.dtype``, when ``w_t = (W^T data [K, N], scale_inv)`` is given;
    - wgrad ``dw = dy.T @ x`` ``[N, K]`` (token dim zero-padded to a multiple of 16), when
      ``x_t = (X^T data [K, M], scale_inv)`` is given: in ``weight.dtype``, or with ``fuse_wgrad`` in fp32 added
      accumulated into ``weight.main_grad`` by the GEMM itself (:func:`fp8_mm_accumulate`: cuBLASLt with beta = 1
      on CUDA), then returned as None.
    Returns ``(dx or None, dw or None)``.
    """
    dx = dw = None
    if w_t is not None:
        dx = fp8_mm(dy_fp8.data, dy_fp8.scale_inv, w_t[0], w_t[1], dy_fp8.dtype)
    if x_t is not None:
        if fuse_wgrad:
            fp8_mm_accumulate(dy_fp8.transpose_2d(), dy_fp8.scale_inv, x_t[0], x_t[1], main_grad_of(weight),
                              pad_inner=True)
        else:
            dw = fp8_mm(dy_fp8.transpose_2d(), dy_fp8.scale_inv, x_t[0], x_t[1], weight.dtype, pad_inner=True)
    return dx, dw


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], quantizers: LinearQuantizers,
               *, w_fp8: Optional[Float8Tensor] = None, fuse_wgrad: bool = False,
               x_fp8: Optional[Float8Tensor] = None) -> torch.Tensor:
    """FP8 ``x @ weight.T + bias`` with gradients.

    Args:
        x: ``[*, K]`` high precision; output ``[*, N]`` in ``x.dtype``.
        weight: ``[N, K]``. bias: ``[N]`` or None. K and N multiples of 16.
        quantizers: the GEMM's :class:`LinearQuantizers` (``FP8Module.fp8_begin()``).
        w_fp8: an already cast weight (FP8 weight caching across micro-batches); cast now when None.
        x_fp8: an already cast input (e.g. written by a fused norm kernel); cast now when None.
        fuse_wgrad: accumulate wgrad into ``weight.main_grad`` (fp32); ``weight.grad`` stays None.
    """
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if x_fp8 is None:
        x_fp8 = quantizers.input.quantize(x.reshape(-1, x.shape[-1]), transpose=needs_grad)
    if w_fp8 is None:
        w_fp8 = quantizers.weight.quantize(weight, transpose=needs_grad)
    return _FP8Linear.apply(x, weight, bias, x_fp8, w_fp8, quantizers.grad_output, fuse_wgrad)
