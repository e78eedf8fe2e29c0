"""Small helpers around process groups and tensor splitting (Megatron-core ``tensor_parallel/utils.py``).

Process groups are always arguments. ``group=None`` means "no parallelism" here (size 1, rank 0): every helper
and mapping is then the identity, so model code can run unsharded without torch.distributed initialised.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["get_group_size", "get_group_rank", "divide", "ensure_divisibility", "split_tensor_along_last_dim",
           "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor", "VocabUtility", "all_reduce",
           "all_gather_dim0", "reduce_scatter_dim0", "all_to_all_single"]

# torch 2.13 renamed the "into tensor" collectives (the old names warn); torch 2.11 on the GPUs has only the old.
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def get_group_size(group) -> int:
    """Number of ranks in ``group``; 1 for None."""
    return 1 if group is None else dist.get_world_size(group)


def get_group_rank(group) -> int:
    """This process's rank inside ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def ensure_divisibility(numerator: int, denominator: int, what: str = "value") -> None:
    """Raise ``ValueError`` naming both numbers unless ``denominator`` divides ``numerator``."""
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """``numerator // denominator``, raising ``ValueError`` when it does not divide exactly."""
    ensure_divisibility(numerator, denominator, what)
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> List[torch.Tensor]:
    """Split ``[*, D]`` into ``num_partitions`` views ``[*, D / num_partitions]`` (contiguous copies on request).

    Raises:
        ValueError: ``D`` is not divisible by ``num_partitions``.
    """
    last = divide(tensor.shape[-1], num_partitions, "last dim")
    chunks = torch.split(tensor, last, dim=-1)
    return [c.contiguous() for c in chunks] if contiguous_split_chunks else list(chunks)


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, group, new_buffer: bool = False) -> torch.Tensor:
    """This rank's 1/size slice of ``tensor`` flattened to 1-D: elements ``rank * n : (rank + 1) * n`` of
    ``tensor.reshape(-1)``, ``n = numel / size`` (Megatron-core's ``split_tensor_into_1d_equal_chunks``).

    Args:
        tensor: any shape and dtype.
        group: the process group to split over (None: one rank, the whole tensor).
        new_buffer: return a copy in fresh storage of ``n`` elements (so ``tensor``'s storage can be freed);
            otherwise a view of ``tensor``'s storage (of a flattened copy when ``tensor`` is not contiguous).
    Returns:
        ``[n]``, ``tensor``'s dtype and device.
    Raises:
        ValueError: ``numel`` is not divisible by the group size (Megatron floors and loses the remainder).
    """
    part = divide(tensor.numel(), get_group_size(group), "numel")
    start = get_group_rank(group) * part
    chunk = tensor.reshape(-1)[start:start + part]
    return chunk.clone() if new_buffer else chunk


def gather_split_1d_tensor(tensor: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`split_tensor_into_1d_equal_chunks`: all-gather the 1-D chunks ``[n]`` into ``[size * n]``."""
    size = get_group_size(group)
    flat = tensor.reshape(-1)
    if size == 1:
        return flat.clone()
    return all_gather_dim0(flat, group)[0]


class VocabUtility:
    """The vocabulary slice ``[first, last)`` (last exclusive) that tensor-parallel rank ``rank`` of
    ``world_size`` holds: ``first = rank * per_partition``, ``last = first + per_partition`` (Megatron-core's
    ``tensor_parallel.utils.VocabUtility``). Used by :class:`~fp8engine.parallel.VocabParallelEmbedding` and
    :func:`~fp8engine.parallel.vocab_parallel_cross_entropy`."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Tuple[int, int]:
        """``(rank * per_partition_vocab_size, (rank + 1) * per_partition_vocab_size)``.

        Raises:
            ValueError: ``per_partition_vocab_size < 0``, ``world_size < 1`` or ``rank`` outside
                ``[0, world_size)``.
        """
        if per_partition_vocab_size < 0:
            raise ValueError(f"per_partition_vocab_size must be >= 0, got {per_partition_vocab_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, got rank={rank}, "
                             f"world_size={world_size}")
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
        """The range of rank ``rank`` when ``global_vocab_size`` is split evenly over ``world_size`` ranks.

        Raises:
            ValueError: ``global_vocab_size`` not divisible by ``world_size`` (pad the vocabulary to a multiple
                of it), or the errors of :meth:`vocab_range_from_per_partition_vocab_size`.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        per_partition = divide(global_vocab_size, world_size, "global_vocab_size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


# ---------------------------------------------------------------------------------------------------------------
# The collectives of the model's forward and backward. Each returns a new tensor (or the input, reduced in place,
# where the docstring says so) and, with ``async_op``, a handle whose ``wait()`` makes it valid. Under
# ``torch.compile`` they issue the functional collectives (what DTensor traces to), whose new results Dynamo tracks:
# the in-place ``torch.distributed`` calls traced by torch 2.11's Dynamo lost the gradient of what flowed through
# them (a compiled vocab-parallel embedding got a zero weight gradient). Eager mode keeps the in-place calls into
# preallocated outputs (no extra copy, async handles for overlap).

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _Done:
    """The handle of a functional collective: its result waits for the data on first use."""

    def wait(self) -> None:
        return None


def all_reduce(x: torch.Tensor, group, op: str = "sum", async_op: bool = False):
    """All-reduce ``x`` (any shape) over ``group`` with ``op`` (``"sum"`` or ``"max"``).

    Eager mode reduces ``x`` in place (it must be contiguous; pass a copy to keep the input); under
    ``torch.compile`` the result is a new tensor. Use the returned tensor in both cases. Returns ``(result, work)``;
    ``work`` is None unless ``async_op`` (then ``result`` is valid after ``work.wait()``). Raises ValueError for
    another ``op``."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduction op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, op, group), (_Done() if async_op else None)
    work = dist.all_reduce(x, op=_REDUCE_OPS[op], group=group, async_op=async_op)
    return x, work


def all_gather_dim0(x: torch.Tensor, group, async_op: bool = False):
    """All-gather ``[n, ...]`` shards into ``[size * n, ...]`` (rank order) as a new tensor. Returns
    ``(out, work)``; ``work`` is None unless ``async_op`` (then ``out`` is valid after ``work.wait()``)."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor(x, 0, group), (_Done() if async_op else None)
    out = x.new_empty((get_group_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    work = _all_gather_base(out, x, group=group, async_op=async_op)
    return out, (work if async_op else None)


def reduce_scatter_dim0(x: torch.Tensor, group, async_op: bool = False):
    """SUM-reduce ``[size * n, ...]`` over ``group`` and keep this rank's ``[n, ...]`` slice of dim 0, as a new
    tensor. Returns ``(out, work)`` as :func:`all_gather_dim0`. Raises ValueError when ``size`` does not divide
    dim 0."""
    x = x.contiguous()
    rows = divide(x.shape[0], get_group_size(group), "first dim")
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(x, "sum", 0, group), (_Done() if async_op else None)
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    work = _reduce_scatter_base(out, x, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return out, (work if async_op else None)


def all_to_all_single(x: torch.Tensor, group, output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None) -> torch.Tensor:
    """``torch.distributed.all_to_all_single`` along dim 0 into a new tensor (equal splits when the sizes are None;
    the output has ``sum(output_split_sizes)`` rows)."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.all_to_all_single(x, output_split_sizes, input_split_sizes, group)
    rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                           group=group)
    return out
