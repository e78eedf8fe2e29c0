"""``ColumnParallelLinear`` and ``RowParallelLinear`` (Megatron-core ``tensor_parallel/layers.py``), FP8-aware.

Both return ``(output, output_bias)`` as Megatron does: ``output_bias`` is the bias when ``skip_bias_add=True``
(then not added), else None. Inside :func:`fp8engine.autocast` their GEMMs run in FP8 with a per-module
:class:`~fp8engine.fp8.state.ScalingState` (rows ``input, weight, grad_output``), registered with the region like
every FP8 module's, so ``autocast(amax_group=dp_group)`` reduces their amaxes across data-parallel ranks in the
region's single collective. Under ``Float8BlockScaling`` the same op runs the GEMMs block-scaled (scales just in
time, nothing recorded); the per-rank shard dims must then be multiples of 128.

Both run the package's one linear op, :func:`fp8engine.ops.linear.linear` (FP8 inside autocast, plain matmuls
outside), with their :class:`~fp8engine.parallel.linear_ops.TPLinearComm`: the sequence-parallel all-gather of the
column layer's input (FP8 bytes under FP8), its dgrad all-reduce / reduce-scatter overlapped with the wgrad GEMM,
and the row layer's output reduction happen inside that op, as in ``LayerNormLinear`` / ``LayerNormMLP``.

Initialisation: the full ``[N, K]`` weight (and ``[N]`` bias) is drawn exactly as ``fp8engine.Linear(K, N)`` would
draw it from the current RNG state, then this rank keeps its slice, so the shards of a layer equal the slices of
the same layer built unsharded with the same seed (Megatron's ``_initialize_affine_weight_cpu``).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8engine.fp8.autocast import get_fp8_context
from fp8engine.fp8.quantizer import LinearQuantizers, get_quantizers
from fp8engine.fp8.state import ScalingState
from fp8engine.ops.block_gemm import check_block_dims
from fp8engine.ops.gemm import check_gemm_dims
from fp8engine.ops.linear import LINEAR_ROLES, linear
from fp8engine.parallel.linear_ops import TPLinearComm
from fp8engine.parallel.mappings import (gather_from_tensor_model_parallel_region,
                                         scatter_to_tensor_model_parallel_region)
from fp8engine.ops.init import init_linear_params
from fp8engine.parallel.utils import divide, get_group_rank, get_group_size
from fp8engine.parallel.fsdp import local_tensor

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "init_full_linear", "all_reduce_sequence_parallel_grads"]


#: ``init_full_linear(out_features, in_features, bias, init_method, dtype, device)``: the unsharded
#: ``(weight [N, K], bias [N] or None)`` exactly as ``fp8engine.Linear`` initialises them, from the current RNG.
init_full_linear = init_linear_params


def _shard_linear(output_size: int, input_size: int, bias: bool, init_method: Optional[Callable], params_dtype,
                  device, tp_group, dim: int):
    """This rank's ``(weight, bias or None)`` Parameters: the weight of :func:`init_full_linear` split along
    ``dim``, 0 (rows, and the bias with them) or 1 (columns; the bias whole)."""
    dtype = params_dtype or torch.get_default_dtype()
    w, b = init_full_linear(output_size, input_size, bias, init_method, dtype, device)
    part = w.shape[dim] // get_group_size(tp_group)
    index = slice(get_group_rank(tp_group) * part, (get_group_rank(tp_group) + 1) * part)
    if dim == 0:  # clones: the rows are views that would keep the whole tensors alive
        return nn.Parameter(w[index].clone()), (nn.Parameter(b[index].clone()) if bias else None)
    return nn.Parameter(w[:, index].contiguous()), (nn.Parameter(b.clone()) if bias else None)


class _TPLinearBase(nn.Module):
    """Scaling state and per-forward FP8 set-up shared by the two layers."""

    def __init__(self, in_local: int, out_local: int, tp_group, device):
        super().__init__()
        self.tp_group = tp_group
        self.fp8_state = ScalingState(LINEAR_ROLES, device=device)
        self._gemm_dims = (in_local, out_local)
        self._fp8_dims_checked = False
        self._block_dims_checked = False

    def _fp8_begin(self) -> Optional[LinearQuantizers]:
        ctx = get_fp8_context()
        if ctx is None:
            return None
        if torch.compiler.is_compiling():  # at trace time, unguarded (as FP8Module.fp8_begin)
            check_gemm_dims(*self._gemm_dims, what=f"{type(self).__name__} (per-rank shard)")
        elif not self._fp8_dims_checked:
            check_gemm_dims(*self._gemm_dims, what=f"{type(self).__name__} (per-rank shard)")
            self._fp8_dims_checked = True
        quantizers = get_quantizers(self.fp8_state, ctx)[0]
        if quantizers.input.is_block and not self._block_dims_checked:
            check_block_dims([self._gemm_dims], f"{type(self).__name__} (per-rank shard)")
            self._block_dims_checked = True
        return quantizers


class ColumnParallelLinear(_TPLinearBase):
    """``Y = X A + b`` with ``A`` split by columns: rank ``r`` holds ``weight [N/tp, K]`` (rows
    ``r*N/tp : (r+1)*N/tp`` of the unsharded ``[N, K]``) and ``bias [N/tp]``.

    Args:
        input_size, output_size: ``K`` and ``N``; ``N`` must be divisible by the tp size. FP8 needs ``K`` and
            ``N/tp`` to be multiples of 16.
        tp_group: the tensor-parallel process group (None: one rank).
        bias: learnable bias. gather_output: all-gather the output to ``[*, N]`` (not with sequence parallel).
        sequence_parallel: the input is a sequence shard ``[s/tp, b, K]``, all-gathered along dim 0.
        skip_bias_add: return the bias instead of adding it (for a later fusion).
        gradient_accumulation_fusion: add wgrad (fp32) into ``weight.main_grad``; ``weight.grad`` stays None.
        init_method: ``fn(weight)`` for the unsharded weight (bias zeroed); default ``torch.nn.Linear``'s init.
        params_dtype, device: of parameters and scaling state.
        fp8_all_gather: under FP8 with sequence parallel, all-gather FP8 bytes (half of bf16's traffic,
            bit-identical result, see :mod:`fp8engine.parallel.fp8_comm`) instead of high precision.
    Shapes (per rank): input ``[s, b, K]`` (``[s/tp, b, K]`` with sequence parallel) -> output ``[s, b, N/tp]``
        (``[s, b, N]`` with ``gather_output``).
    Raises:
        ValueError: ``N`` not divisible by the tp size, or ``gather_output`` with ``sequence_parallel``.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, skip_bias_add: bool = False,
                 gradient_accumulation_fusion: bool = False, init_method: Optional[Callable] = None,
                 params_dtype=None, device=None, fp8_all_gather: bool = True):
        out_local = divide(output_size, get_group_size(tp_group), "ColumnParallelLinear output_size")
        super().__init__(input_size, out_local, tp_group, device)
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be used with sequence_parallel=True")
        self.input_size, self.output_size, self.output_size_per_partition = input_size, output_size, out_local
        self.gather_output, self.sequence_parallel, self.skip_bias_add = gather_output, sequence_parallel, skip_bias_add
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.fp8_all_gather = fp8_all_gather
        self.weight, self.bias = _shard_linear(output_size, input_size, bias, init_method, params_dtype, device,
                                               tp_group, 0)
        for p in (self.weight, self.bias):
            if p is not None:  # Megatron's markers, read by checkpoint/optimizer code
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        self._comm = TPLinearComm(tp_group, "column", sequence_parallel, fp8_all_gather)

    def forward(self, input_: torch.Tensor):
        """Returns ``(output, output_bias)``; see the class docstring for shapes."""
        quantizers = self._fp8_begin()
        out = linear(input_, self.weight, None if self.skip_bias_add else self.bias, quantizers, comm=self._comm,
                     fuse_wgrad=self.gradient_accumulation_fusion)
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size} "
                f"(per rank {self.output_size_per_partition}), bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}")


class RowParallelLinear(_TPLinearBase):
    """``Y = X A + b`` with ``A`` split by rows: rank ``r`` holds ``weight [N, K/tp]`` (columns
    ``r*K/tp : (r+1)*K/tp`` of the unsharded ``[N, K]``) and the full ``bias [N]``, added once after the
    reduction.

    Args:
        input_size, output_size: ``K`` (divisible by the tp size) and ``N``. FP8 needs ``K/tp`` and ``N`` to be
            multiples of 16.
        tp_group: the tensor-parallel process group (None: one rank).
        input_is_parallel: the input is already split ``[*, K/tp]`` (else it is split here).
        sequence_parallel: reduce-scatter the output along dim 0 to ``[s/tp, b, N]`` instead of all-reducing;
            needs ``input_is_parallel``. The bias then gets partial gradients: its ``sequence_parallel``
            attribute is True, and :func:`all_reduce_sequence_parallel_grads` sums them over the tp group.
        skip_bias_add, gradient_accumulation_fusion, init_method, params_dtype, device: as in
            :class:`ColumnParallelLinear`.
    Shapes (per rank): input ``[s, b, K/tp]`` (or ``[s, b, K]`` unless ``input_is_parallel``) -> output
        ``[s, b, N]`` (``[s/tp, b, N]`` with sequence parallel).
    Raises:
        ValueError: ``K`` not divisible by the tp size, or ``sequence_parallel`` without ``input_is_parallel``.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 input_is_parallel: bool = False, sequence_parallel: bool = False, skip_bias_add: bool = False,
                 gradient_accumulation_fusion: bool = False, init_method: Optional[Callable] = None,
                 params_dtype=None, device=None):
        in_local = divide(input_size, get_group_size(tp_group), "RowParallelLinear input_size")
        super().__init__(in_local, output_size, tp_group, device)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.input_size, self.output_size, self.input_size_per_partition = input_size, output_size, in_local
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.skip_bias_add, self.gradient_accumulation_fusion = skip_bias_add, gradient_accumulation_fusion
        self.weight, self.bias = _shard_linear(output_size, input_size, bias, init_method, params_dtype, device,
                                               tp_group, 1)
        self.weight.tensor_model_parallel, self.weight.partition_dim, self.weight.partition_stride = True, 1, 1
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel
        self._comm = TPLinearComm(tp_group, "row", sequence_parallel)

    def forward(self, input_: torch.Tensor):
        """Returns ``(output, output_bias)``; see the class docstring for shapes."""
        quantizers = self._fp8_begin()
        x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        # the op sums the partial outputs over the ranks (reduce-scatter with sequence parallel), then adds the bias
        out = linear(x, self.weight, None if self.skip_bias_add else self.bias, quantizers, comm=self._comm,
                     fuse_wgrad=self.gradient_accumulation_fusion)
        return out, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size} (per rank {self.input_size_per_partition}), "
                f"output_size={self.output_size}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")


@torch.no_grad()
def all_reduce_sequence_parallel_grads(module: nn.Module, tp_group) -> None:
    """SUM the gradients of parameters marked ``sequence_parallel=True`` (replicated parameters applied to
    sequence shards: norms, the row-parallel bias) across ``tp_group``, in one collective (Megatron's
    ``_allreduce_layernorm_grads``). Uses ``main_grad`` where a parameter has one, else ``grad``."""
    if get_group_size(tp_group) == 1:
        return
    grads = []
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.requires_grad:
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads.append(local_tensor(g))  # under FSDP: this rank's shard (the same one on every tp rank)
    if not grads:
        return
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads], torch.float32)  # fp32 at least
    flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
