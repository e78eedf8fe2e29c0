"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer"), forward and its gradient, on ``[s, b, n, d]``.

``t' = t cos + rotate_half(t) sin`` on the first ``r`` channels (``rotate_half(x1, x2) = (-x2, x1)``); the rest
pass through. A rotation: its gradient is the transpose, ``dt = g cos + rotate_half^T(g sin)`` with
``rotate_half^T(y1, y2) = (y2, -y1)``. :func:`fp8engine.modules.attention.apply_rotary_pos_emb` and the fused layer
step (:mod:`fp8engine.ops.layer`) both use these, so the two give the same bits.
"""
from __future__ import annotations

import torch

__all__ = ["rope_cos_sin", "rope_fwd", "rope_bwd"]


def rope_cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the angles ``freqs [s, 1, 1, r]``, each in ``dtype``, contiguous (the layout the
    rotary kernels read, :mod:`fp8engine.kernels.rotary`)."""
    return freqs.cos().to(dtype).contiguous(), freqs.sin().to(dtype).contiguous()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_fwd(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``r = cos.shape[-1]`` channels of ``t [s, b, n, d]`` (``cos``, ``sin``: ``[s, 1, 1, r]`` in
    ``t.dtype``, :func:`rope_cos_sin`). Result in ``t.dtype``."""
    r = cos.shape[-1]
    rot, rest = (t, None) if r == t.shape[-1] else (t[..., :r], t[..., r:])
    out = rot * cos + _rotate_half(rot) * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)


def rope_bwd(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`rope_fwd`'s input given ``g``, the gradient of its output (module docstring)."""
    r = cos.shape[-1]
    rot = g if r == g.shape[-1] else g[..., :r]
    g1, g2 = (rot * sin).chunk(2, dim=-1)
    d = rot * cos + torch.cat((g2, -g1), dim=-1)
    return d if r == g.shape[-1] else torch.cat((d, g[..., r:]), dim=-1)
