"""Triton kernels of fp8engine (cast, norm, activation, scaling update; block casts and the norm / activation fused
with them), each beside a plain-PyTorch reference.

Import the families directly (``from fp8engine.kernels.cast import cast_to_fp8``); this package only exposes
``kernels_available``, which the ops layer uses to dispatch: Triton on CUDA, the ``*_reference`` functions elsewhere.
Importing this package, and calling any reference, does not need Triton.

Under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (slowly; used by the tests). The variable must be
set before the kernel modules are imported, since ``triton.jit`` reads it when the kernels are defined.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["kernels_available"]


def kernels_available(device: torch.device | str) -> bool:
    """True when the Triton kernels can run on ``device``: CUDA with Triton importable, or any device with Triton
    importable under ``TRITON_INTERPRET=1`` (the interpreter; CPU tensors). False otherwise."""
    if importlib.util.find_spec("triton") is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_available()
