"""``convert_to_fp8``: swap ``torch.nn.Linear`` layers of an existing model for :class:`fp8engine.Linear`."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from fp8engine.modules.linear import Linear

__all__ = ["convert_to_fp8"]


def convert_to_fp8(module: nn.Module, module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None
                   ) -> list[str]:
    """Replace every ``torch.nn.Linear`` in ``module`` (in place) by an :class:`fp8engine.Linear` sharing its
    weight and bias parameters (same device, dtype, values and ``requires_grad``).

    Args:
        module: the model; a bare ``nn.Linear`` cannot be swapped in place (wrap it in a container).
        module_filter_fn: ``fn(linear, fqn) -> bool``; only layers for which it returns True are swapped.
    Returns:
        The fully qualified names of the ``nn.Linear`` layers left alone because their dims are not multiples of
        16 (FP8 GEMMs cannot take them). Layers rejected by ``module_filter_fn`` are not listed.
    Raises:
        TypeError: ``module`` is itself an ``nn.Linear``.
    """
    if isinstance(module, nn.Linear):
        raise TypeError("convert_to_fp8 swaps children in place; wrap a bare nn.Linear in a container "
                        "(e.g. nn.Sequential) or build fp8engine.Linear directly")
    skipped: list[str] = []
    for fqn, child in list(module.named_modules()):
        for name, sub in list(child.named_children()):
            if type(sub) is not nn.Linear:
                continue
            sub_fqn = f"{fqn}.{name}" if fqn else name
            if module_filter_fn is not None and not module_filter_fn(sub, sub_fqn):
                continue
            if sub.in_features % 16 or sub.out_features % 16:
                skipped.append(sub_fqn)
                continue
            new = Linear(sub.in_features, sub.out_features, bias=sub.bias is not None, params_dtype=sub.weight.dtype,
                         device=torch.device("meta"))
            new.weight = sub.weight
            new.bias = sub.bias
            new.fp8_state = new.fp8_state.__class__(new.fp8_state.roles, device=sub.weight.device)
            new.train(sub.training)
            setattr(child, name, new)
    return skipped
