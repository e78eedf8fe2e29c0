"""The tensor-parallel linear op under ``Float8BlockScaling``: the communication of a
:class:`~fp8engine.parallel.linear_ops.TPLinearComm` around :mod:`fp8engine.ops.block_linear`'s three block-scaled
GEMMs (the per-tensor-scaled op is :func:`fp8engine.ops.linear.linear`, with the same communication).

Per rank (tp = tensor-parallel size):

- column parallel, ``weight [N/tp, K]``: ``x`` is ``[s, b, K]`` (replicated) or, with sequence parallelism,
  ``[s/tp, b, K]``, all-gathered along dim 0 first. fprop ``y [s, b, N/tp] = x_total @ w.T (+ bias)``; dgrad
  ``dx = dy @ w`` is a partial sum, all-reduced (or reduce-scattered to ``[s/tp, b, K]``) asynchronously while the
  wgrad GEMM ``dw = dy.T @ x_total`` runs (Megatron's overlap).
- row parallel, ``weight [N, K/tp]``: fprop's partial output is all-reduced (reduce-scattered to ``[s/tp, b, N]``
  with sequence parallelism, whose backward all-gathers the output gradient), then the bias is added.

Sharding and block scales: ``N/tp`` (column) and ``K/tp`` (row) must be multiples of 128, so a shard boundary is a
block boundary and every rank's 1 x 128 tiles and 128 x 128 blocks are exactly the unsharded layer's: the sharded
GEMMs see the same FP8 operands as the unsharded ones; only the summation of partial results differs.

FP8 all-gather with block scales (``fp8_all_gather``, sequence parallel), the scales travel with the data:
  * fprop operand: each rank casts its shard ``[m, K]`` (``m = s/tp * b`` tokens) to 1 x 128 tiles along K, one
    scale per row per 128 columns; rows are independent, so gathering the FP8 rows and their scale rows gives
    exactly the cast of the gathered tensor (bit for bit, half of bf16's bytes plus 1/32 for the scales);
  * wgrad operand ``x_total^T`` re-tiled along the token dim: each rank's transposed shard ``[K, m]`` has tiles of
    128 tokens; with ``m`` a multiple of 128 no tile straddles two ranks, so gathering the shards' columns (and
    their scale columns) gives exactly the re-tiled cast of ``x_total^T``. Backward gathers it asynchronously
    behind the dgrad GEMM, as the per-tensor path re-gathers its FP8 shard.
  Where ``m`` is not a multiple of 128 the op gathers in high precision and casts the total (same result, bf16's
  bytes). Token counts that are not multiples of 128 are zero-padded as in ``ops/block_linear.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fp8engine.fp8.block_tensor import Float8BlockTensor
from fp8engine.fp8.quantizer import LinearQuantizers
from fp8engine.ops.backward import backward_keeps_graph
from fp8engine.ops.block_gemm import block_gemm
from fp8engine.ops.block_linear import BLOCK_DTYPES
from fp8engine.ops.linear import main_grad_of
from fp8engine.parallel.fp8_comm import all_gather_dim0
from fp8engine.parallel.linear_ops import TPLinearComm
from fp8engine.parallel.utils import get_group_size
from fp8engine.recipe import Float8BlockScaling

__all__ = ["tp_block_linear", "all_gather_block_rows", "all_gather_block_cols"]

_B = Float8BlockScaling.BLOCK_SIZE


def all_gather_block_rows(local: Float8BlockTensor, group) -> Float8BlockTensor:
    """All-gather a 1 x 128-tiled ``[m, K]`` shard along its rows: ``[size * m, K]`` in rank order, ``scale_inv``
    ``[size * m, K/128]`` in the M-major layout (strides ``(1, size * m)``). Two collectives (FP8 bytes, fp32
    scales); the result is exactly the cast of the gathered high-precision tensor (module docstring)."""
    data, _ = all_gather_dim0(local.data.view(torch.uint8), group)
    scales, _ = all_gather_dim0(local.scale_inv.contiguous(), group)  # [m, K/128] row-major shards, stacked
    return Float8BlockTensor(data.view(local.data.dtype), scales.t().contiguous().t(), local.block, local.dtype)


def all_gather_block_cols(local_t: Float8BlockTensor, group, async_op: bool = False):
    """Gather a 1 x 128-tiled ``[K, m]`` transposed shard (tiles along its m tokens, ``m`` a multiple of 128) along
    its columns. Returns ``finish``: ``finish()`` waits for the collectives (started asynchronously with
    ``async_op``) and returns the ``[K, size * m]`` tensor with ``scale_inv`` ``[K, size * m / 128]`` (strides
    ``(1, K)``), exactly the re-tiled cast of the gathered tensor's transpose."""
    size = get_group_size(group)
    k, m = local_t.data.shape
    # data: [size * K, m] gathered, then [K, size * m] (one copy); scales: the [m/128, K] storage of the shard's
    # (1, K)-strided [K, m/128] scale_inv stacks along dim 0 into the total's [size * m/128, K] storage directly
    raw, w1 = all_gather_dim0(local_t.data.view(torch.uint8), group, async_op=async_op)
    scales, w2 = all_gather_dim0(local_t.scale_inv.t(), group, async_op=async_op)

    def finish() -> Float8BlockTensor:
        for work in (w1, w2):
            if work is not None:
                work.wait()
        data = raw.view(size, k, m).permute(1, 0, 2).reshape(k, size * m).view(local_t.data.dtype)
        return Float8BlockTensor(data, scales.t(), local_t.block, local_t.dtype)

    return finish


class _TPBlockLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quantizers: LinearQuantizers, comm: TPLinearComm, fuse_wgrad: bool):
        group = comm.tp_group
        gather = comm.gathers_input
        x2d = x.reshape(-1, x.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or fuse_wgrad
        ctx.x_t_local = ctx.x_t = None
        if gather and comm.fp8_all_gather and x2d.shape[0] % _B == 0:
            qx_local, ctx.x_t_local = quantizers.input.quantize(x2d, transpose=need_dw)
            qx, pad = all_gather_block_rows(qx_local, group), 0
        else:
            x_total = all_gather_dim0(x2d, group)[0] if gather else x2d
            pad = -x_total.shape[0] % _B
            qx, ctx.x_t = quantizers.input.quantize(F.pad(x_total, (0, 0, 0, pad)) if pad else x_total,
                                                    transpose=need_dw)
        qw, qw_t = quantizers.weight.quantize(weight, transpose=need_dx)
        # fprop; column parallel adds the bias in the GEMM, row parallel after summing the ranks' partial outputs
        in_gemm = not comm.reduces_output
        y = block_gemm(qx, qw, x.dtype, bias=bias if in_gemm else None)
        if pad:
            y = y[:y.shape[0] - pad]
        y = comm.reduce_output(y)
        if bias is not None and not in_gemm:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(weight)
        ctx.w_t, ctx.quantizers, ctx.comm, ctx.fuse_wgrad, ctx.pad = qw_t, quantizers, comm, fuse_wgrad, pad
        ctx.x_local_shape, ctx.x_dtype = x.shape, x.dtype
        rows_total = y.shape[0]
        return y.reshape(*((rows_total * x.shape[0] // x2d.shape[0],) + tuple(x.shape[1:-1])), y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        comm, group, pad = ctx.comm, ctx.comm.tp_group, ctx.pad
        need_dx, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        need_dw = ctx.x_t is not None or ctx.x_t_local is not None
        dy2d = dy.reshape(-1, dy.shape[-1])
        if dy2d.dtype not in BLOCK_DTYPES:
            dy2d = dy2d.float()
        # the bias gradient: this rank's rows (row parallel adds the bias after the reduction)
        db = dy2d.sum(0, dtype=torch.float32).to(weight.dtype) if need_db else None
        dy2d = comm.gather_output_grad(dy2d)
        finish = None
        if need_dw and ctx.x_t_local is not None:  # re-gather x^T's FP8 shards behind the dgrad GEMM
            finish = all_gather_block_cols(ctx.x_t_local, group, async_op=True)
        qdy, qdy_t = (None, None)
        if need_dx or need_dw:
            qdy, qdy_t = ctx.quantizers.grad_output.quantize(F.pad(dy2d, (0, 0, 0, pad)) if pad else dy2d,
                                                             transpose=need_dw)
        dx = dgrad_work = None
        if need_dx:  # dgrad: dx = dy @ w (a partial sum over tp ranks for column parallel)
            dx_total = block_gemm(qdy, ctx.w_t, ctx.x_dtype)
            if pad:
                dx_total = dx_total[:dx_total.shape[0] - pad].contiguous()
            dx, dgrad_work = comm.start_dgrad_comm(dx_total)
        dw = None
        if need_dw:  # wgrad: dw = dy.T @ x_total, overlapped with the dgrad communication
            x_t = ctx.x_t if finish is None else finish()
            if ctx.fuse_wgrad:
                main_grad_of(weight).add_(block_gemm(qdy_t, x_t, torch.float32))
            else:
                dw = block_gemm(qdy_t, x_t, weight.dtype)
        if dgrad_work is not None:
            dgrad_work.wait()
        if dx is not None:
            dx = dx.reshape(ctx.x_local_shape)
        if not backward_keeps_graph("a tensor-parallel block-scaled FP8 linear"):
            ctx.x_t = ctx.x_t_local = ctx.w_t = None
        return dx, dw, db, None, None, None


def tp_block_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], comm: TPLinearComm,
                    quantizers: LinearQuantizers, fuse_wgrad: bool = False) -> torch.Tensor:
    """The tensor-parallel linear with block-scaled FP8 GEMMs (module docstring).

    Args:
        x: ``[s_local, *, K]`` bf16 / fp32 (``s_local = s/tp`` when ``comm.gathers_input``).
        weight: this rank's shard, bf16 / fp32 (``[N/tp, K]`` column, ``[N, K/tp]`` row parallel); its dims
            multiples of 128 (the layer checks them at its first forward). bias: ``[N_local]`` or None.
        comm: the layer's :class:`TPLinearComm`. quantizers: its :class:`LinearQuantizers` of ``BlockQuantizer``.
        fuse_wgrad: accumulate wgrad (fp32) into ``weight.main_grad``; ``weight.grad`` stays None.
    Returns:
        column: ``[s, *, N/tp]`` (``s = tp * s_local`` when gathering); row: ``[s, *, N]`` (``[s/tp, *, N]``
        with sequence parallelism); in x's dtype.
    Raises:
        TypeError: x or weight neither bf16 nor fp32.
    """
    if x.dtype not in BLOCK_DTYPES or weight.dtype not in BLOCK_DTYPES:
        raise TypeError(f"Float8BlockScaling: x is {x.dtype} and the weight {weight.dtype}; the block-scaled GEMMs "
                        "take bfloat16 or float32")
    return _TPBlockLinear.apply(x, weight, bias, quantizers, comm, fuse_wgrad)
