"""Amax reduction across ranks for delayed scaling: one collective for every FP8 tensor of a step."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_reduce_current_amax", "all_reduce_amax"]


def all_reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """MAX all-reduce of an amax tensor in place across ``group`` (no-op for a None or 1-rank group)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


@torch.no_grad()
def all_reduce_current_amax(amax_histories: Sequence[torch.Tensor], group) -> None:
    """MAX-reduce column 0 (the current step) of every ``[n_i, L]`` history across ``group``, in place,
    batched into a single ``all_reduce``."""
    if group is None or dist.get_world_size(group) == 1:
        return
    current = torch.cat([h[:, 0] for h in amax_histories])
    dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)
    for h, part in zip(amax_histories, current.split([h.shape[0] for h in amax_histories])):
        h[:, 0].copy_(part)
