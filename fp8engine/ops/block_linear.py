"""``block_linear``: a linear layer whose three GEMMs run in block-scaled FP8 (the ``Float8BlockScaling`` recipe).

    fprop: y  = x @ w.T      x 1 x 128 tiles along K (in_features), w 128 x 128 blocks
    dgrad: dx = dy @ w       dy 1 x 128 tiles along N (out_features), w^T: the same blocks, transposed
    wgrad: dw = dy.T @ x     dy^T and x^T re-tiled: 1 x 128 tiles along the token dim M
Every scale is computed just in time from its own tile's amax (no history, nothing recorded); each operand is cast
once, its transposed (re-tiled) copy written by the same kernel pass. The bias gradient is ``dy.sum(0)`` in fp32.
Forward tensors are cast to ``recipe.fp8_format.fwd``, gradients to ``.bwd`` (E4M3, or E5M2 with HYBRID).

Shapes: ``x`` ``[*, K]`` (e.g. ``[s, b, h]``), ``weight`` ``[N, K]``, ``bias`` ``[N]``; M = product of x's leading dims.
M, K and N must be multiples of 128 (the GEMMs' block; M because wgrad contracts over it). Dtypes: x and weight
bf16 or fp32 (the GEMM writes bf16 or fp32); y and dx in x's dtype, dw in weight's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8engine.fp8.block_tensor import BLOCK_128x128, TILE_1x128, quantize_block
from fp8engine.fp8.dtypes import fp8_dtype_of
from fp8engine.ops.block_gemm import block_gemm
from fp8engine.recipe import Float8BlockScaling

__all__ = ["block_linear", "BlockLinearFunction"]

_B = Float8BlockScaling.BLOCK_SIZE


class BlockLinearFunction(torch.autograd.Function):
    """fprop / dgrad / wgrad in block-scaled FP8 (module docstring). Use through :func:`block_linear`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fwd_dtype: torch.dtype,
                bwd_dtype: torch.dtype, power_2_scale: bool, use_kernel: Optional[bool], use_hw: Optional[bool]):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cast = dict(power_2_scale=power_2_scale, use_kernel=use_kernel)
        if need_wgrad:
            qx, qx_t = quantize_block(x2, fwd_dtype, TILE_1x128, transpose=True, **cast)
        else:
            qx, qx_t = quantize_block(x2, fwd_dtype, TILE_1x128, **cast), None
        if need_dgrad:
            qw, qw_t = quantize_block(weight, fwd_dtype, BLOCK_128x128, transpose=True, **cast)
        else:
            qw, qw_t = quantize_block(weight, fwd_dtype, BLOCK_128x128, **cast), None
        y = block_gemm(qx, qw, x.dtype, use_hw=use_hw)  # fprop
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.saved = (qx_t, qw_t)
        ctx.cfg = (bwd_dtype, power_2_scale, use_kernel, use_hw, x.shape, x.dtype, weight.dtype,
                   bias is not None and ctx.needs_input_grad[2])
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        qx_t, qw_t = ctx.saved
        bwd_dtype, power_2_scale, use_kernel, use_hw, x_shape, x_dtype, w_dtype, need_dbias = ctx.cfg
        dy2 = dy.reshape(-1, dy.shape[-1])
        if dy2.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dy2 = dy2.float()
        cast = dict(power_2_scale=power_2_scale, use_kernel=use_kernel)
        dx = dw = dbias = None
        if qx_t is not None:
            qdy, qdy_t = quantize_block(dy2, bwd_dtype, TILE_1x128, transpose=True, **cast)
            dw = block_gemm(qdy_t, qx_t, w_dtype, use_hw=use_hw)  # wgrad: [N, M] x [K, M] -> [N, K]
        else:
            qdy = quantize_block(dy2, bwd_dtype, TILE_1x128, **cast)
        if qw_t is not None:
            dx = block_gemm(qdy, qw_t, x_dtype, use_hw=use_hw).reshape(x_shape)  # dgrad: [M, N] x [K, N]
        if need_dbias:
            dbias = dy2.float().sum(0)
        ctx.saved = None
        return dx, dw, (dbias.to(w_dtype) if dbias is not None else None), None, None, None, None, None


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 recipe: Optional[Float8BlockScaling] = None, *, use_kernel: Optional[bool] = None,
                 use_hw: Optional[bool] = None) -> torch.Tensor:
    """``y = x @ weight.T + bias`` with all three GEMMs in block-scaled FP8 (module docstring).

    Args:
        x: ``[*, K]`` bf16 / fp32. weight: ``[N, K]`` bf16 / fp32. bias: ``[N]`` or None.
        recipe: a :class:`Float8BlockScaling` (default ``Float8BlockScaling()``: E4M3, power-of-two scales).
        use_kernel: Triton cast kernels (default: on CUDA) or the plain-PyTorch references (False).
        use_hw: see :func:`fp8engine.ops.block_gemm.block_gemm`.
    Returns:
        ``[*, N]`` in x's dtype.
    Raises:
        TypeError: ``recipe`` not a Float8BlockScaling; x / weight dtypes other than bf16 / fp32.
        ValueError: weight not 2-D, feature dims mismatch, or M, K, N not multiples of 128.
    """
    recipe = Float8BlockScaling() if recipe is None else recipe
    if not isinstance(recipe, Float8BlockScaling):
        raise TypeError(f"block_linear: recipe must be a Float8BlockScaling, got {type(recipe).__name__}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"block_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(want x [*, K], weight [N, K])")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"block_linear: {name} has dtype {t.dtype}; supported: bfloat16, float32")
    m = x.numel() // x.shape[-1]
    (n, k) = weight.shape
    if m % _B or k % _B or n % _B:
        raise ValueError(f"block_linear: tokens M = {m}, in_features K = {k}, out_features N = {n} must all be "
                         f"multiples of {_B} (the FP8 scaling block); pad the batch or the features")
    fmt = recipe.fp8_format
    return BlockLinearFunction.apply(x, weight, bias, fp8_dtype_of(fmt.fwd), fp8_dtype_of(fmt.bwd),
                                     recipe.power_2_scale, use_kernel, use_hw)
