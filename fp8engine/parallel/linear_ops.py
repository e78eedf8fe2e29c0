"""The tensor-parallel linear op: one ``autograd.Function`` around the three GEMMs, with its communication.

Per rank (tp = tensor-parallel size):

- column parallel, ``weight [N/tp, K]``: ``x`` is ``[s, b, K]`` (replicated) or, with sequence parallelism,
  ``[s/tp, b, K]``, all-gathered along dim 0 first (in FP8 when ``fp8_all_gather``).
  fprop ``y [s, b, N/tp] = x_total @ w.T (+ bias [N/tp])``; dgrad ``dx = dy @ w`` is a partial sum over the tp
  ranks: it is all-reduced (or reduce-scattered to ``[s/tp, b, K]`` with sequence parallelism) *asynchronously*
  while the wgrad GEMM ``dw = dy.T @ x_total`` runs; we wait after wgrad (Megatron's overlap). With sequence
  parallelism the input is not kept gathered: backward re-gathers it asynchronously behind the dgrad GEMM.
- row parallel, ``weight [N, K/tp]``: the op is a local linear (no communication); the module around it reduces
  the partial outputs with the mappings.

Under :func:`fp8engine.autocast` the GEMMs are FP8 (:func:`fp8engine.ops.gemm.fp8_gemm`, operands cast by
:meth:`fp8engine.fp8.quantizer.Quantizer.quantize`), otherwise plain matmuls in the input dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import LinearQuantizers
from fp8engine.ops.gemm import fp8_gemm, fp8_mm_accumulate
from fp8engine.ops.linear import accumulate_wgrad, main_grad_of
from fp8engine.parallel.fp8_comm import all_gather_dim0, all_gather_fp8_bytes, cast_and_all_gather_fp8
from fp8engine.parallel.utils import get_group_size, reduce_scatter_into

__all__ = ["TPLinearConfig", "tp_linear"]


@dataclass(frozen=True)
class TPLinearConfig:
    """How one tensor-parallel linear communicates.

    tp_group: the tensor-parallel process group (None: one rank, no communication).
    gather_input: all-gather the input along dim 0 in forward (column parallel + sequence parallel).
    dgrad_comm: ``None`` (row parallel), ``"all_reduce"`` (column parallel) or ``"reduce_scatter"`` (column
        parallel + sequence parallel) of the input gradient.
    fuse_wgrad: accumulate wgrad (fp32) into ``weight.main_grad`` instead of returning it.
    fp8_all_gather: under FP8 with ``gather_input``, gather FP8 bytes instead of high precision.
    """

    tp_group: object = None
    gather_input: bool = False
    dgrad_comm: Optional[str] = None
    fuse_wgrad: bool = False
    fp8_all_gather: bool = True

    def __post_init__(self) -> None:
        if self.dgrad_comm not in (None, "all_reduce", "reduce_scatter"):
            raise ValueError(f"dgrad_comm must be None, 'all_reduce' or 'reduce_scatter'; got {self.dgrad_comm!r}")


def start_dgrad_comm(dx_total: torch.Tensor, cfg: "TPLinearConfig") -> tuple[torch.Tensor, Optional[object]]:
    """Start the dgrad's tensor-parallel communication asynchronously, so the wgrad GEMM issued next overlaps it
    (Megatron-core's async dgrad all-reduce / reduce-scatter): ``cfg.dgrad_comm`` ``"all_reduce"`` sums
    ``dx_total [M, K]`` over ``cfg.tp_group`` in place, ``"reduce_scatter"`` sums and scatters it along dim 0 into a
    new ``[M / tp, K]``; None (or one rank) communicates nothing. Returns ``(dx, work)``: ``dx`` is valid after
    ``work.wait()`` (``work`` None when nothing was started)."""
    group = cfg.tp_group
    if cfg.dgrad_comm is None or get_group_size(group) == 1:
        return dx_total, None
    if cfg.dgrad_comm == "all_reduce":
        return dx_total, dist.all_reduce(dx_total, group=group, async_op=True)
    dx = dx_total.new_empty((dx_total.shape[0] // get_group_size(group), dx_total.shape[1]))
    return dx, reduce_scatter_into(dx, dx_total, group, async_op=True)


class _TPLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quantizers: Optional[LinearQuantizers], cfg: TPLinearConfig,
                w_fp8: Optional[Float8Tensor]):
        group = cfg.tp_group
        gather = cfg.gather_input and get_group_size(group) > 1
        x2d = x.reshape(-1, x.shape[-1])
        ctx.regather = None  # what backward must all-gather again: a high-precision or an FP8 shard
        ctx.x_total_fp8 = None
        if quantizers is None:
            x_total = all_gather_dim0(x2d, group)[0] if gather else x2d
            y = torch.nn.functional.linear(x_total, weight, bias)
            ctx.save_for_backward(x2d if gather else x_total, weight)
            ctx.regather = "hp" if gather else None
        else:
            if gather and cfg.fp8_all_gather:
                local, x_total_fp8 = cast_and_all_gather_fp8(x2d, quantizers.input, group)
                ctx.x_total_fp8, ctx.regather = local, "fp8"
            else:
                x_total = all_gather_dim0(x2d, group)[0] if gather else x2d
                x_total_fp8 = quantizers.input.quantize(x_total)
                ctx.x_total_fp8 = x_total_fp8
            y = fp8_gemm(x_total_fp8, w_fp8, x.dtype, bias=None if bias is None else bias.to(x.dtype),
                         use_fast_accum=True)
            ctx.save_for_backward(weight)
        ctx.quantizers, ctx.cfg, ctx.w_fp8 = quantizers, cfg, w_fp8
        ctx.has_bias = bias is not None
        ctx.x_local_shape = x.shape
        rows_total = y.shape[0]
        return y.reshape(*((rows_total // x2d.shape[0] * x.shape[0],) + tuple(x.shape[1:-1])), y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        cfg, quantizers, group = ctx.cfg, ctx.quantizers, ctx.cfg.tp_group
        weight = ctx.saved_tensors[-1]
        need_dx, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        need_dw = (ctx.needs_input_grad[1] or cfg.fuse_wgrad) and weight.requires_grad
        dy2d = dy.reshape(-1, dy.shape[-1])

        # Re-gather the sequence-parallel input for wgrad, overlapped with the dgrad GEMM.
        gather_work = None
        x_total = x_total_fp8 = None
        if need_dw:
            if ctx.regather == "hp":
                x_total, gather_work = all_gather_dim0(ctx.saved_tensors[0], group, async_op=True)
            elif ctx.regather == "fp8":
                x_total_fp8, gather_work = all_gather_fp8_bytes(ctx.x_total_fp8, group, async_op=True)
            elif quantizers is None:
                x_total = ctx.saved_tensors[0]
            else:
                x_total_fp8 = ctx.x_total_fp8

        dy_fp8 = quantizers.grad_output.quantize(dy2d) if quantizers is not None else None

        dx = dgrad_work = None
        if need_dx:  # dgrad: dx = dy @ w (a partial sum over tp ranks for column parallel)
            if quantizers is None:
                dx_total = dy2d @ weight
            else:
                dx_total = fp8_gemm(dy_fp8, ctx.w_fp8, dy.dtype, transpose_b=True)
            dx, dgrad_work = start_dgrad_comm(dx_total, cfg)

        dw = None
        if need_dw:  # wgrad: dw = dy.T @ x_total, overlapped with the dgrad communication
            if gather_work is not None:
                gather_work.wait()
            if quantizers is None:
                dw = dy2d.t() @ x_total
                if cfg.fuse_wgrad:
                    accumulate_wgrad(weight, dw.float())
                    dw = None
            elif cfg.fuse_wgrad:  # the GEMM accumulates into main_grad (cuBLASLt beta = 1 on CUDA)
                fp8_mm_accumulate(dy_fp8.transpose_2d(), dy_fp8.scale_inv, x_total_fp8.transpose_2d(),
                                  x_total_fp8.scale_inv, main_grad_of(weight), pad_inner=True)
            else:
                dw = fp8_gemm(dy_fp8, x_total_fp8, weight.dtype, transpose_a=True, transpose_b=True, pad_inner=True)
        db = dy2d.sum(0, dtype=torch.promote_types(dy.dtype, torch.float32)).to(weight.dtype) if need_db else None

        if dgrad_work is not None:
            dgrad_work.wait()
        if dx is not None:
            dx = dx.reshape(ctx.x_local_shape)
        ctx.x_total_fp8 = ctx.w_fp8 = None
        return dx, dw, db, None, None, None


def tp_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: TPLinearConfig, *,
              quantizers: Optional[LinearQuantizers] = None,
              w_fp8: Optional[Float8Tensor] = None) -> torch.Tensor:
    """``x_total @ weight.T + bias`` with the communication ``cfg`` describes (see the module docstring).

    Args:
        x: ``[s_local, *, K]`` (``s_local = s/tp`` when ``cfg.gather_input``), float32/bf16/fp16.
        weight: this rank's ``[N_local, K]`` shard. bias: ``[N_local]`` or None (added in the GEMM).
        cfg: a :class:`TPLinearConfig`.
        quantizers: the module's :class:`LinearQuantizers` under the active autocast; None runs in high
            precision.
        w_fp8: the weight already cast (cast here when None and ``quantizers`` is given).
    Returns:
        ``[s, *, N_local]`` in ``x.dtype`` (``s = tp * s_local`` when gathering).
    """
    if quantizers is not None and w_fp8 is None:
        w_fp8 = quantizers.weight.quantize(weight, transpose=torch.is_grad_enabled())
    return _TPLinear.apply(x, weight, bias, quantizers, cfg, w_fp8)
