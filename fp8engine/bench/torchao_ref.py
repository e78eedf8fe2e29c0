"""torchao.float8 as a peer in the benchmarks (optional: rows say "unavailable" when it is not installed)."""
from __future__ import annotations

import copy

import torch

__all__ = ["torchao_float8", "torchao_available"]


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401

        return True
    except Exception:  # torchao missing, or built for another torch
        return False


def torchao_float8(module: torch.nn.Module, *, compile: bool = False) -> torch.nn.Module:
    """A deep copy of ``module`` with its ``nn.Linear`` layers converted by torchao (tensorwise dynamic
    scaling, torchao's default recipe), optionally wrapped in ``torch.compile``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = convert_to_float8_training(copy.deepcopy(module), config=Float8LinearConfig())
    return torch.compile(model) if compile else model
