"""The delayed-scaling rule, exactly as TransformerEngine's, as pure functions on tensors.

Source: TransformerEngine ``transformer_engine/pytorch/fp8.py`` (``_default_get_amax``,
``_default_sf_compute``, amax history roll) and "FP8 Formats for Deep Learning" (Micikevicius et al., 2022).
Order of one update: compute the new scale from the history *as it is* (index 0 holds the current step's
amax), then roll the history.
"""
from __future__ import annotations

from typing import Callable, Union

import torch

__all__ = ["update_amax_history", "update_fp8_scale", "compute_amax", "scale_from_amax"]


def update_amax_history(amax_history: torch.Tensor) -> torch.Tensor:
    """Roll an amax history one step: ``roll(h, -1, dim=-1)`` then ``h[..., 0] = 0``.

    Args:
        amax_history: ``[..., L]`` float32, index 0 holding the current step's amax.
    Returns:
        A new ``[..., L]`` tensor: old ``h[..., i+1]`` at ``i``, old ``h[..., 0]`` at ``L-1``, and 0 at index 0
        (ready to record the next step's amax).
    """
    rolled = torch.roll(amax_history, shifts=-1, dims=-1)
    rolled[..., 0] = 0.0
    return rolled


def compute_amax(amax_history: torch.Tensor, amax_compute_algo: Union[str, Callable] = "max") -> torch.Tensor:
    """Reduce a history ``[..., L]`` to amaxes ``[...]``: ``"max"`` over L, ``"most_recent"`` = index 0,
    or a callable ``history -> amax``."""
    if amax_compute_algo == "max":
        return amax_history.amax(dim=-1)
    if amax_compute_algo == "most_recent":
        return amax_history[..., 0].clone()
    if callable(amax_compute_algo):
        return amax_compute_algo(amax_history)
    raise ValueError(f"amax_compute_algo must be 'max', 'most_recent' or a callable; got {amax_compute_algo!r}")


def scale_from_amax(amax: torch.Tensor, fp8_max, scale: torch.Tensor, margin: float = 0) -> torch.Tensor:
    """``sf = (fp8_max / amax) / 2**margin``; where amax <= 0 or amax is inf/NaN the previous ``scale`` is kept."""
    amax = amax.float()
    # A true float32 division (a Python-scalar numerator would make torch compute reciprocal(amax) * fp8_max,
    # which rounds differently).
    fp8_max = torch.as_tensor(fp8_max, dtype=torch.float32, device=amax.device)
    sf = torch.div(fp8_max, amax) / (2.0**margin)
    keep = ~torch.isfinite(amax) | (amax <= 0) | ~torch.isfinite(sf)
    return torch.where(keep, scale, sf)


def update_fp8_scale(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_max,
    *,
    margin: float = 0,
    amax_compute_algo: Union[str, Callable] = "max",
) -> tuple[torch.Tensor, torch.Tensor]:
    """New ``(scale, scale_inv)`` from an amax history (TransformerEngine delayed scaling).

    Args:
        amax_history: ``[..., L]`` float32, index 0 = current step.
        scale: ``[...]`` float32, the scales in use (kept where the amax is unusable).
        fp8_max: float or ``[...]`` tensor, 448 for E4M3 and 57344 for E5M2.
        margin: power-of-two head-room (>= 0).
        amax_compute_algo: ``"max"``, ``"most_recent"`` or a callable ``history -> amax``.
    Returns:
        ``(scale, scale_inv)``, both ``[...]`` float32, ``scale_inv = 1 / scale``. Multiply by ``scale`` to go
        from the high-precision range into the FP8 range.
    """
    amax = compute_amax(amax_history, amax_compute_algo)
    new_scale = scale_from_amax(amax, fp8_max, scale, margin)
    return new_scale, new_scale.reciprocal()
