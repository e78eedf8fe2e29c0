"""Amax reduction across ranks for delayed scaling: one collective for every FP8 tensor of a step.

The one place where ``fp8/`` talks to ``torch.distributed``: the scale update (:func:`fp8engine.fp8.state.
reduce_and_update`) needs the MAX of every rank's amaxes, over a process group the caller passes in (usually the
data-parallel or dp x tp group given to ``autocast(amax_group=...)``).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_reduce_current_amax"]


@torch.no_grad()
def all_reduce_current_amax(amax_histories: Sequence[torch.Tensor], group) -> None:
    """MAX-reduce column 0 (the current step) of every ``[n_i, L]`` float32 history across ``group``, in place,
    batched into a single ``all_reduce``. No-op for ``group`` None or a 1-rank group."""
    if group is None or dist.get_world_size(group) == 1:
        return
    current = torch.cat([h[:, 0] for h in amax_histories])
    dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)
    for h, part in zip(amax_histories, current.split([h.shape[0] for h in amax_histories])):
        h[:, 0].copy_(part)
