"""Small helpers around process groups and tensor splitting (Megatron-core ``tensor_parallel/utils.py``).

Process groups are always arguments. ``group=None`` means "no parallelism" here (size 1, rank 0): every helper
and mapping is then the identity, so model code can run unsharded without torch.distributed initialised.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ["get_group_size", "get_group_rank", "divide", "ensure_divisibility", "split_tensor_along_last_dim",
           "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor", "all_gather_into", "reduce_scatter_into"]

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


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/size slice of ``tensor`` flattened to 1-D (``numel`` must divide by the group size).

    Returns a view of ``tensor``'s storage (flattened) of ``numel / size`` elements.
    """
    size = get_group_size(group)
    flat = tensor.reshape(-1)
    part = divide(flat.numel(), size, "numel")
    start = get_group_rank(group) * part
    return flat[start:start + part]


def gather_split_1d_tensor(tensor: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`split_tensor_into_1d_equal_chunks`: all-gather the 1-D chunks ``[n]`` into ``[size * n]``."""
    size = get_group_size(group)
    flat = tensor.reshape(-1)
    if size == 1:
        return flat.clone()
    out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
    _all_gather_base(out, flat.contiguous(), group=group)
    return out


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """``all_gather_into_tensor`` along dim 0 (``out`` is ``[size * n, ...]``); returns the work handle when
    ``async_op``."""
    return _all_gather_base(out, inp.contiguous(), group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False,
                        op: Optional[dist.ReduceOp] = None):
    """SUM ``reduce_scatter_tensor`` along dim 0 (``inp`` is ``[size * n, ...]``, ``out`` ``[n, ...]``)."""
    return _reduce_scatter_base(out, inp.contiguous(), op=op or dist.ReduceOp.SUM, group=group, async_op=async_op)
