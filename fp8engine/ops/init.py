"""Weight initialisation shared by the single-process modules and the tensor-parallel layers.

Both draw the full (unsharded) weight from the current RNG and, when sharded, keep their slice (Megatron's
``_initialize_affine_weight_cpu``), so a TP shard equals the slice of the same layer built unsharded with the seed.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

__all__ = ["default_init", "init_linear_params"]


def default_init(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """``torch.nn.Linear``'s initialisation, in place: Kaiming-uniform (a=sqrt(5)) weight ``[N, K]`` and a
    U(+-1/sqrt(K)) bias."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


@torch.no_grad()
def init_linear_params(out_features: int, in_features: int, bias: bool, init_method: Optional[Callable],
                       dtype: torch.dtype = torch.float32, device=None
                       ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The unsharded ``(weight [N, K], bias [N] or None)``: ``init_method(weight)`` and a zero bias (Megatron), or
    by default :func:`default_init`; drawn from the current RNG of ``device`` (CPU when None)."""
    weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
    b = torch.empty(out_features, dtype=dtype, device=device) if bias else None
    if init_method is None:
        default_init(weight, b)
    else:
        init_method(weight)
        if b is not None:
            b.zero_()
    return weight, b
