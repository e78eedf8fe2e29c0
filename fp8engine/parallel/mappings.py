"""Communication mappings between tensor-/sequence-parallel regions, each an autograd function with its backward
(Megatron-core ``tensor_parallel/mappings.py``, same names and semantics; the group is always an argument).

Notation, per rank of a group of size ``tp``: ``[s, b, h]`` is a full tensor, ``[s/tp, b, h]`` a sequence shard
(dim 0), ``[s, b, h/tp]`` a hidden shard (last dim). ``group=None`` means one rank: every mapping is then the
identity (a tensor passed through unchanged), so model code runs unsharded without ``torch.distributed``.

Each mapping's backward is the conjugate collective of its forward (identity / all-reduce, split / all-gather,
all-gather / reduce-scatter, all-to-all / the inverse all-to-all); each function's docstring names the pair.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from fp8engine.parallel.utils import (all_gather_dim0, all_reduce, all_to_all_single, divide, get_group_rank,
                                      get_group_size, reduce_scatter_dim0)

__all__ = ["copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
           "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "all_gather_last_dim_from_tensor_parallel_region",
           "reduce_scatter_last_dim_to_tensor_parallel_region", "all_to_all", "all_to_all_sp2hp",
           "all_to_all_hp2sp"]


# ---------------------------------------------------------------------------------------------------------------
# Plain (non-autograd) collectives. Each returns a new tensor; inputs are never modified in place (the same
# gradient tensor may feed several autograd branches).

def _contiguous(t: torch.Tensor) -> torch.Tensor:
    # not ``t.contiguous()`` on a contiguous ``t``: that alias, returned from an autograd function's forward, gave the
    # input a zero gradient under torch 2.11's torch.compile
    return t if t.is_contiguous() else t.contiguous()


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    if get_group_size(group) == 1:
        return x
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group)[0]


def _split_along_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = get_group_size(group)
    if size == 1:
        return x
    part = divide(x.shape[-1], size, "last dim")
    return _contiguous(x.narrow(-1, get_group_rank(group) * part, part))


def _split_along_first_dim(x: torch.Tensor, group, split_sizes: Optional[List[int]] = None) -> torch.Tensor:
    size = get_group_size(group)
    if size == 1:
        return x
    rank = get_group_rank(group)
    if split_sizes is None:
        part = divide(x.shape[0], size, "first dim")
        return _contiguous(x.narrow(0, rank * part, part))
    return _contiguous(x.narrow(0, sum(split_sizes[:rank]), split_sizes[rank]))


def _gather_along_first_dim(x: torch.Tensor, group, output_split_sizes: Optional[List[int]] = None) -> torch.Tensor:
    size = get_group_size(group)
    if size == 1:
        return x
    if output_split_sizes is None:
        return all_gather_dim0(x, group)[0]
    # uneven shards: an all-to-all that sends the whole shard to every rank (gloo has no uneven all-gather)
    return all_to_all_single(x.repeat((size,) + (1,) * (x.dim() - 1)), group, list(output_split_sizes),
                             [x.shape[0]] * size)


def _gather_along_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = get_group_size(group)
    if size == 1:
        return x
    stacked = _gather_along_first_dim(x, group)  # [size * d0, ..., d/size], rank-major
    return torch.cat(stacked.chunk(size, dim=0), dim=-1)  # contiguous (see _contiguous)


def _reduce_scatter_along_first_dim(x: torch.Tensor, group,
                                    input_split_sizes: Optional[List[int]] = None) -> torch.Tensor:
    size = get_group_size(group)
    if size == 1:
        return x
    if input_split_sizes is None:
        return reduce_scatter_dim0(x, group)[0]
    rank = get_group_rank(group)
    # uneven slices: all-to-all them, then sum what came back in rank order (gloo has no reduce-scatter)
    parts = all_to_all_single(x, group, [input_split_sizes[rank]] * size, list(input_split_sizes))
    return parts.reshape((size, input_split_sizes[rank]) + tuple(x.shape[1:])).sum(0)


def _reduce_scatter_along_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = get_group_size(group)
    if size == 1:
        return x
    stacked = torch.cat(x.chunk(size, dim=-1), dim=0)  # the last-dim chunks, rank-major along dim 0
    return _reduce_scatter_along_first_dim(stacked, group)


# ---------------------------------------------------------------------------------------------------------------
# Autograd functions.

class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _reduce(dy, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x, group) if get_group_size(group) > 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def _conjugate(name: str, fwd, bwd) -> type:
    """An autograd.Function running ``fwd(x, group)`` in forward and ``bwd(dy, group)`` in backward (the pair of
    collectives Megatron's mappings pair up); a view of ``x`` on a group of one."""

    def forward(ctx, x, group):
        ctx.group = group
        return fwd(x, group) if get_group_size(group) > 1 else x.view_as(x)

    def backward(ctx, dy):
        return bwd(dy, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                    "backward": staticmethod(backward), "__module__": __name__})


_ScatterToModelParallelRegion = _conjugate("_ScatterToModelParallelRegion", _split_along_last_dim,
                                           _gather_along_last_dim)
_GatherFromModelParallelRegion = _conjugate("_GatherFromModelParallelRegion", _gather_along_last_dim,
                                            _split_along_last_dim)
_ScatterToSequenceParallelRegion = _conjugate("_ScatterToSequenceParallelRegion", _split_along_first_dim,
                                              _gather_along_first_dim)
_AllGatherLastDim = _conjugate("_AllGatherLastDim", _gather_along_last_dim, _reduce_scatter_along_last_dim)
_ReduceScatterLastDim = _conjugate("_ReduceScatterLastDim", _reduce_scatter_along_last_dim, _gather_along_last_dim)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad, output_split_sizes):
        ctx.group, ctx.tp_grad, ctx.split_sizes = group, tensor_parallel_output_grad, output_split_sizes
        return _gather_along_first_dim(x, group, output_split_sizes) if get_group_size(group) > 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        scatter = _reduce_scatter_along_first_dim if ctx.tp_grad else _split_along_first_dim
        return scatter(dy, ctx.group, ctx.split_sizes), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, input_split_sizes):
        ctx.group, ctx.split_sizes = group, input_split_sizes
        return _reduce_scatter_along_first_dim(x, group, input_split_sizes) if get_group_size(group) > 1 \
            else x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _gather_along_first_dim(dy, ctx.group, ctx.split_sizes), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, output_split_sizes, input_split_sizes):
        ctx.group, ctx.out_splits, ctx.in_splits = group, output_split_sizes, input_split_sizes
        return all_to_all_single(x, group, output_split_sizes, input_split_sizes) if get_group_size(group) > 1 \
            else x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        if get_group_size(ctx.group) > 1:  # the inverse exchange: splits swapped
            dy = all_to_all_single(dy, ctx.group, ctx.in_splits, ctx.out_splits)
        return None, dy, None, None


# ---------------------------------------------------------------------------------------------------------------
# Public functions (Megatron's names and argument order).

def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: identity (each rank holds the full ``[*, h]``). Backward: all-reduce (SUM) of the gradient."""
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-reduce (SUM) of the partial ``[*, h]`` results. Backward: identity."""
    return _ReduceFromModelParallelRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's slice ``[*, h/tp]`` of ``[*, h]``. Backward: all-gather the last dim."""
    return _ScatterToModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather ``[*, h/tp]`` into ``[*, h]`` (rank order). Backward: keep this rank's slice."""
    return _GatherFromModelParallelRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's sequence shard ``[s/tp, ...]`` of ``[s, ...]``. Backward: all-gather dim 0."""
    return _ScatterToSequenceParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_: torch.Tensor, group, tensor_parallel_output_grad: bool = True,
                                         output_split_sizes: Optional[List[int]] = None) -> torch.Tensor:
    """Forward: all-gather sequence shards ``[s/tp, ...]`` into ``[s, ...]``.

    Backward: reduce-scatter along dim 0 when the consumer is tensor parallel (each rank holds a partial
    gradient of the full tensor, ``tensor_parallel_output_grad=True``), else keep this rank's shard.
    ``output_split_sizes`` (one per rank) allows uneven shards.
    """
    return _GatherFromSequenceParallelRegion.apply(input_, group, tensor_parallel_output_grad, output_split_sizes)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group,
                                               input_split_sizes: Optional[List[int]] = None) -> torch.Tensor:
    """Forward: reduce-scatter (SUM) ``[s, ...]`` partial results into ``[s/tp, ...]``. Backward: all-gather dim 0."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group, input_split_sizes)


def all_gather_last_dim_from_tensor_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather ``[*, h/tp]`` into ``[*, h]``. Backward: reduce-scatter (SUM) along the last dim."""
    return _AllGatherLastDim.apply(input_, group)


def reduce_scatter_last_dim_to_tensor_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: reduce-scatter (SUM) ``[*, h]`` into ``[*, h/tp]``. Backward: all-gather along the last dim."""
    return _ReduceScatterLastDim.apply(input_, group)


def all_to_all(group, input_: torch.Tensor, output_split_sizes: Optional[List[int]] = None,
               input_split_sizes: Optional[List[int]] = None) -> torch.Tensor:
    """All-to-all along dim 0 (Megatron's argument order: group first). Rows ``input_split_sizes[j]`` go to rank
    ``j``; ``output_split_sizes[j]`` rows arrive from rank ``j`` (equal splits when None). Backward: the inverse
    all-to-all."""
    return _AllToAll.apply(group, input_, output_split_sizes, input_split_sizes)


def all_to_all_sp2hp(input_: torch.Tensor, group) -> torch.Tensor:
    """Sequence-parallel to hidden-parallel: ``[s/tp, ..., h]`` -> ``[s, h/tp]`` (leading dims flattened)."""
    size = get_group_size(group)
    x = input_.reshape(-1, input_.shape[-1])
    if size == 1:
        return x
    chunks = torch.split(x, divide(x.shape[-1], size, "hidden"), dim=1)
    return all_to_all(group, torch.cat(chunks, dim=0))


def all_to_all_hp2sp(input_: torch.Tensor, group) -> torch.Tensor:
    """Hidden-parallel to sequence-parallel: ``[s, ..., h/tp]`` -> ``[s/tp, h]`` (leading dims flattened)."""
    size = get_group_size(group)
    x = input_.reshape(-1, input_.shape[-1])
    if size == 1:
        return x
    exchanged = all_to_all(group, x)
    chunks = torch.split(exchanged, divide(exchanged.shape[0], size, "tokens"), dim=0)
    return torch.cat(chunks, dim=-1)
