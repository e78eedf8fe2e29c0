"""LayerNorm / RMSNorm writing the next GEMM's block-scaled FP8 input (``Float8BlockScaling``), as one autograd node.

:func:`block_norm_cast` runs :func:`fp8engine.kernels.block_norm.norm_fwd_1x128`: one pass normalises ``x`` (``+
residual``) and writes the 1 x 128-tiled FP8 copy with its ``[M, K/128]`` scales, a second writes the re-tiled
transpose for the wgrad GEMM; the token rows are zero-padded to a multiple of 128, the layout
:class:`~fp8engine.ops.block_linear.BlockLinearFunction` and :func:`~fp8engine.ops.block_mlp.block_fp8_mlp` take as
``x_q``. The high-precision output is written only when asked for (``return_layernorm_output``); otherwise the
returned ``y`` is a gradient carrier (one element broadcast to y's shape, never read), as in the per-tensor
:func:`fp8engine.ops.norm_linear.norm_cast`. Backward: the norm backward kernels of :mod:`fp8engine.kernels.norm`
(the forward's mean / rstd have their layout), with the residual branch's gradient added inside.

Kernel path only (CUDA, or any device inside ``kernels_forced()``): elsewhere the modules keep the unfused reference
path (the norm, then the block GEMM op's cast). Formulas and rounding: :mod:`fp8engine.kernels.block_norm` (the
cast reads the fp32 normalised values: for fp32 inputs the same bits as the unfused path, for bf16 one rounding
fewer).
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8engine.fp8.block_quantizer import BlockQuantizer
from fp8engine.fp8.block_tensor import TILE_1x128, Float8BlockTensor
from fp8engine.ops.norm_linear import _same_dtype

__all__ = ["block_norm_cast"]


class _BlockNormCast(torch.autograd.Function):
    """``y, q, q_t, s = norm(x [+ residual])`` with the 1 x 128 FP8 copy ``q`` (and ``q_t``); backward takes
    ``dy`` for ``y`` (where the FP8 copy's consumer routes its gradient) and ``ds`` for the normalised tensor
    ``s``, added to dx inside the norm backward kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, zero_centered_gamma, quantizer, transpose, return_hp, residual):
        from fp8engine.kernels.block_norm import norm_fwd_1x128

        x = x.contiguous()
        res = {}
        if residual is not None:
            res = dict(residual=residual.contiguous(), residual_out=torch.empty_like(x))
        y, data, sinv, data_t, sinv_t, mean, rstd = norm_fwd_1x128(
            x, weight, None if rms else bias, eps, quantizer.fp8_dtype, rms=rms,
            zero_centered_gamma=zero_centered_gamma, power_2_scale=quantizer.power_2_scale, transpose=transpose,
            pad_rows=True, return_hp=return_hp, **res)
        s = res.get("residual_out", x)
        if y is None:  # gradient carrier only: one element broadcast to y's shape, no [M, N] write
            y = s.new_empty(()).expand(s.shape)
        q = Float8BlockTensor(data, sinv, TILE_1x128, x.dtype)
        q_t = Float8BlockTensor(data_t, sinv_t, TILE_1x128, x.dtype) if transpose else None
        ctx.set_materialize_grads(False)  # an unused s gets no zero-filled gradient
        ctx.save_for_backward(s, weight, mean, rstd)
        ctx.rms, ctx.zero_centered_gamma, ctx.has_residual = rms, zero_centered_gamma, residual is not None
        return y, q, q_t, s

    @staticmethod
    def backward(ctx, dy, _q, _q_t, ds):
        from fp8engine.kernels import norm as kn

        s, weight, mean, rstd = ctx.saved_tensors
        dy = torch.zeros_like(s) if dy is None else dy.contiguous()
        dres = None if ds is None else ds.contiguous()
        kw = dict(zero_centered_gamma=ctx.zero_centered_gamma, dresidual=dres)
        if ctx.rms:
            (dx, dw), db = kn.rmsnorm_bwd(dy, s, rstd, weight, **kw), None
        else:
            dx, dw, db = kn.layernorm_bwd(dy, s, mean, rstd, weight, **kw)
        return dx, dw, db, None, None, None, None, None, None, (dx if ctx.has_residual else None)


def block_norm_cast(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, *, rms: bool,
                    zero_centered_gamma: bool, quantizer: BlockQuantizer, transpose: bool, return_hp: bool = False,
                    residual: Optional[torch.Tensor] = None) -> tuple:
    """Normalise ``x``'s last dim (``+ residual``) and write it as the next GEMM's 1 x 128-tiled FP8 input.

    Args:
        x: ``[..., K]`` bf16 / fp32 (the block GEMMs' dtypes), K a multiple of 128. weight, bias: ``[K]`` (bias
            None for RMSNorm). eps: added to the variance.
        rms, zero_centered_gamma: RMSNorm instead of LayerNorm; gamma = ``1 + weight``.
        quantizer: the GEMM's input :class:`~fp8engine.fp8.block_quantizer.BlockQuantizer` (FP8 format,
            power-of-two scales).
        transpose: also the re-tiled transpose (the wgrad operand); pass ``torch.is_grad_enabled()``.
        return_hp: also write the high-precision ``y`` (else ``y`` is a gradient carrier whose values must not be
            read).
        residual: None or like x: normalise ``s = x + residual`` (the add in the kernel). A residual of another
            dtype is promoted with x as :func:`fp8engine.ops.norm_linear.norm` does.
    Returns:
        ``(y [..., K] in x's dtype, x_q, s)``: ``x_q = (q, q_t or None)`` of
        :class:`~fp8engine.fp8.block_tensor.Float8BlockTensor` (``q`` ``[M_pad, K]``, ``q_t`` ``[K, M_pad]``,
        ``M_pad`` = M rounded up to 128, padding rows zero), for ``block_fp8_linear(..., x_q=x_q)``; ``s`` the
        normalised tensor, whose gradient is added inside this node's backward.
    Raises:
        ValueError / TypeError: the kernel launcher's (:func:`fp8engine.kernels.block_norm.norm_fwd_1x128`).
    """
    x, residual = _same_dtype(x, residual)
    y, q, q_t, s = _BlockNormCast.apply(x, weight, bias, eps, rms, zero_centered_gamma, quantizer, transpose,
                                        return_hp, residual)
    return y, (q, q_t), s
