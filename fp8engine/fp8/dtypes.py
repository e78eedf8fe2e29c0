"""FP8 encodings as torch dtypes, and the maxima that go with them."""
from __future__ import annotations

import torch

from fp8engine.recipe import FP8_MAX

__all__ = ["FP8_DTYPES", "fp8_dtype_of", "fp8_max_of", "HIGH_PRECISION_DTYPES"]

#: Encoding name (as used by :class:`fp8engine.recipe.Format`) -> torch dtype. E4M3 is the "fn" variant
#: (finite, no inf, max 448) used by cuBLASLt and TransformerEngine.
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

#: Inputs an FP8 cast accepts.
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_dtype_of(encoding: str) -> torch.dtype:
    """``"e4m3"`` -> ``torch.float8_e4m3fn``, ``"e5m2"`` -> ``torch.float8_e5m2``."""
    try:
        return FP8_DTYPES[encoding]
    except KeyError:
        raise ValueError(f"unknown FP8 encoding {encoding!r}; use 'e4m3' or 'e5m2'") from None


def fp8_max_of(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 torch dtype (448 for E4M3, 57344 for E5M2)."""
    for name, dt in FP8_DTYPES.items():
        if dt == dtype:
            return FP8_MAX[name]
    raise TypeError(f"{dtype} is not an FP8 dtype; use torch.float8_e4m3fn or torch.float8_e5m2")
