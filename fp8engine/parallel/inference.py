"""Inference tensor-parallel linears with a sequence-sharded residual stream and the fused
reduce-scatter + residual add + RMSNorm + all-gather between them (Megatron-core ``inference_layers.py``'s
data flow, on plain NCCL/gloo collectives: no symmetric memory, NVLink multicast stays off).

Per rank, ``t`` tokens, tp ranks: the residual stream is ``[t/tp, h]``; an
:class:`InferenceLayerNormColumnParallelLinear` normalises its shard and all-gathers ``[t, h]`` before its GEMM; an
:class:`InferenceRowParallelLinear` reduce-scatters its partial ``[t, h]`` output to ``[t/tp, h]``.
:func:`reduce_scatter_residual_rmsnorm_all_gather` fuses the row layer's exit with the next layer's norm and gather:
one reduce-scatter, the residual add and RMSNorm on the ``1/tp`` shard, one all-gather. ``t`` must be divisible by
tp (pad the batch). High precision only (no FP8).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from fp8engine.fp8.quantizer import call_kernels
from fp8engine.ops.norm_linear import norm
from fp8engine.parallel.fp8_comm import all_gather_dim0
from fp8engine.parallel.layers import _shard_linear
from fp8engine.parallel.utils import ensure_divisibility, get_group_rank, get_group_size, reduce_scatter_dim0

__all__ = ["rms_norm", "reduce_scatter_residual_rmsnorm_all_gather", "InferenceLayerNormColumnParallelLinear",
           "InferenceRowParallelLinear"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dim, in ``x.dtype``: the package's one RMSNorm
    (:func:`fp8engine.ops.norm_linear.norm`: ``F.rms_norm``'s kernel on CPU, the Triton norm kernel on CUDA)."""
    return norm(x, weight, None, eps, rms=True, kernels=call_kernels(x))


def _reduce_scatter_dim0(partial: torch.Tensor, group) -> torch.Tensor:
    size = get_group_size(group)
    if size == 1:
        return partial
    return reduce_scatter_dim0(partial, group)[0]


@torch.no_grad()
def reduce_scatter_residual_rmsnorm_all_gather(partial: torch.Tensor, residual: torch.Tensor,
                                               norm_weight: torch.Tensor, eps: float, group):
    """``r = reduce_scatter(partial) + residual``; returns ``(all_gather(rms_norm(r)), r)``.

    Args:
        partial: ``[t, h]`` this rank's partial sum (a row-parallel GEMM output). residual: ``[t/tp, h]``.
        norm_weight: ``[h]`` the next layer's RMSNorm weight. eps: its epsilon.
    Returns:
        ``(normed [t, h], residual_out [t/tp, h])``.
    """
    r = _reduce_scatter_dim0(partial, group) + residual
    normed = rms_norm(r, norm_weight, eps)
    return (all_gather_dim0(normed, group)[0] if get_group_size(group) > 1 else normed), r


class InferenceLayerNormColumnParallelLinear(nn.Module):
    """RMSNorm then column-parallel linear: ``[t/tp, K]`` residual shard -> ``[t, N/tp]``.

    Weights as :class:`fp8engine.parallel.ColumnParallelLinear` (this rank's rows of the unsharded ``[N, K]``)
    plus ``layer_norm_weight [K]`` (ones). ``forward(x, input_is_normed_and_gathered=True)`` skips the norm and the
    gather when the previous row layer fused them.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = False, eps: float = 1e-5,
                 init_method: Optional[Callable] = None, params_dtype=None, device=None):
        super().__init__()
        ensure_divisibility(output_size, get_group_size(tp_group), "output_size")
        self.tp_group, self.eps = tp_group, eps
        dtype = params_dtype or torch.get_default_dtype()
        self.layer_norm_weight = nn.Parameter(torch.ones(input_size, dtype=dtype, device=device))
        self.weight, self.bias = _shard_linear(output_size, input_size, bias, init_method, dtype, device, tp_group, 0)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, input_is_normed_and_gathered: bool = False):
        """Returns ``(output [t, N/tp], None)``."""
        if not input_is_normed_and_gathered:
            x = rms_norm(x, self.layer_norm_weight, self.eps)
            if get_group_size(self.tp_group) > 1:
                x = all_gather_dim0(x, self.tp_group)[0]
        return torch.nn.functional.linear(x, self.weight, self.bias), None


class InferenceRowParallelLinear(nn.Module):
    """Row-parallel linear for inference: ``[t, K/tp]`` -> reduce-scattered ``[t/tp, N]``.

    ``forward(x, residual, next_norm_weight, eps)`` with a residual shard ``[t/tp, N]`` and the next layer's
    RMSNorm weight returns ``(normed [t, N], residual_out [t/tp, N])`` through
    :func:`reduce_scatter_residual_rmsnorm_all_gather`; without them ``(output [t/tp, N], None)``.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = False,
                 init_method: Optional[Callable] = None, params_dtype=None, device=None):
        super().__init__()
        ensure_divisibility(input_size, get_group_size(tp_group), "input_size")
        self.tp_group = tp_group
        self.weight, self.bias = _shard_linear(output_size, input_size, bias, init_method, params_dtype, device,
                                               tp_group, 1)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                next_norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-5):
        partial = x @ self.weight.t()
        if self.bias is not None:  # added once: by tp rank 0 before the reduction
            partial = partial + self.bias * (get_group_rank(self.tp_group) == 0)
        if residual is not None and next_norm_weight is not None:
            return reduce_scatter_residual_rmsnorm_all_gather(partial, residual, next_norm_weight, eps,
                                                              self.tp_group)
        out = _reduce_scatter_dim0(partial, self.tp_group)
        return (out if residual is None else out + residual), None
