"""Can this device run FP8 GEMMs?"""
from __future__ import annotations

import functools
from typing import Union

import torch

__all__ = ["is_fp8_available"]


@functools.lru_cache(maxsize=None)
def _cpu_scaled_mm_works() -> bool:
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def is_fp8_available(return_reason: bool = False, *, device=None) -> Union[bool, tuple[bool, str]]:
    """Whether FP8 GEMMs run on ``device`` (default: the current CUDA device if any, else the CPU), with
    TransformerEngine 2.x's signature and rules: compute capability >= 9.0 (Hopper) -> True; 8.9 (Ada) -> True only
    with CUDA >= 12.1; below 8.9 -> False. CPU -> True when ``torch._scaled_mm`` runs there (FP8 emulated).

    Args:
        return_reason: False: return the bool alone. True: return ``(available, reason)``.
        device: keyword only; a ``torch.device`` or a string such as ``"cuda:1"``.
    Returns:
        ``available``, or ``(available, reason)`` with ``return_reason``; ``reason`` says why not, or how FP8 runs
        (TransformerEngine gives ``""`` when available).
    Raises:
        TypeError: ``return_reason`` is not a bool (e.g. a device passed positionally); pass ``device=`` instead.
    """
    if not isinstance(return_reason, bool):
        raise TypeError(f"is_fp8_available(return_reason: bool = False, *, device=None): got return_reason="
                        f"{return_reason!r}; pass the device as a keyword, is_fp8_available(device=...)")
    available, reason = _availability(device)
    return (available, reason) if return_reason else available


def _availability(device) -> tuple[bool, str]:
    """``(available, reason)`` for ``device`` (:func:`is_fp8_available`'s rules)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        if _cpu_scaled_mm_works():
            return True, "FP8 is emulated on CPU by torch._scaled_mm (correct numerics, no speed-up)."
        return False, f"torch {torch.__version__} cannot run torch._scaled_mm on CPU; upgrade to torch >= 2.11."
    if device.type != "cuda":
        return False, f"FP8 needs a CUDA GPU or the CPU; got device type {device.type!r}."
    if not torch.cuda.is_available():
        return False, "CUDA is not available: no GPU visible or torch is a CPU build."
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (9, 0):
        return True, f"compute capability {major}.{minor} supports FP8."
    if (major, minor) == (8, 9):
        cuda = torch.version.cuda or "0.0"
        if tuple(int(p) for p in cuda.split(".")[:2]) >= (12, 1):
            return True, f"compute capability 8.9 with CUDA {cuda} supports FP8."
        return False, f"compute capability 8.9 needs CUDA 12.1 or newer for FP8; this torch has CUDA {cuda}."
    return False, "Device compute capability 8.9 or higher required for FP8 execution."

