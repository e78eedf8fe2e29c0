"""``broadcast_data`` (Megatron-core ``tensor_parallel/data.py``): tp rank 0 loads a batch, the others receive it."""
from __future__ import annotations

from typing import Dict, Sequence

import torch
import torch.distributed as dist

from fp8engine.parallel.utils import get_group_rank, get_group_size

__all__ = ["broadcast_data"]

_MAX_DIMS = 8  # sizes travel as a fixed [len(keys), 8] int64 block (Megatron's _MAX_DATA_DIM)


def broadcast_data(keys: Sequence[str], data: Dict[str, torch.Tensor], datatype: torch.dtype, *,
                   tp_group) -> Dict[str, torch.Tensor]:
    """Broadcast ``data[key]`` for every key from tp rank 0 to the tp group, in two collectives (sizes, then
    one flat buffer of ``datatype``).

    Args:
        keys: the tensors to send, in order. data: on tp rank 0, ``key -> tensor`` (each at most 8-D, cast to
            ``datatype``); ignored on the other ranks (may be None).
        datatype: dtype of every tensor (e.g. ``torch.int64`` for token ids).
        tp_group: the tensor-parallel group (None: ``data`` is returned as is, cast).
    Returns:
        ``key -> tensor`` on every rank, on the communication device (CUDA for NCCL, CPU for gloo).
    Raises:
        ValueError: on tp rank 0, a key is missing, a tensor has more than 8 dims or the wrong dtype.
    """
    if get_group_size(tp_group) == 1:
        return {k: data[k].to(datatype) for k in keys}
    nccl = dist.get_backend(tp_group) == "nccl"  # NCCL communicates CUDA tensors
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    src, is_src = dist.get_global_rank(tp_group, 0), get_group_rank(tp_group) == 0
    sizes = torch.zeros(len(keys), _MAX_DIMS, dtype=torch.int64, device=device)
    if is_src:
        for i, k in enumerate(keys):
            if k not in data:
                raise ValueError(f"broadcast_data: key {k!r} missing from data (has {sorted(data)})")
            t = data[k]
            if t.dim() > _MAX_DIMS:
                raise ValueError(f"broadcast_data: {k!r} has {t.dim()} dims; at most {_MAX_DIMS} are supported")
            if t.dtype != datatype:
                raise ValueError(f"broadcast_data: {k!r} has dtype {t.dtype}, expected {datatype}")
            sizes[i, :t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            sizes[i, t.dim():] = -1
    dist.broadcast(sizes, src=src, group=tp_group)
    shapes = [tuple(int(d) for d in row if d >= 0) for row in sizes.tolist()]
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if is_src:
        flat = torch.cat([data[k].reshape(-1).to(device) for k in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src=src, group=tp_group)
    return {k: part.view(shape) for k, part, shape in zip(keys, flat.split(numels), shapes)}
