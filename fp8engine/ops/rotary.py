"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer"), forward and its gradient, on ``[s, b, n, d]``.

``t' = t cos + rotate_half(t) sin`` on the first ``r`` channels (``rotate_half(x1, x2) = (-x2, x1)``); the rest
pass through. A rotation: its gradient is the transpose, ``dt = g cos + rotate_half^T(g sin)`` with
``rotate_half^T(y1, y2) = (y2, -y1)``. :func:`fp8engine.modules.attention.apply_rotary_pos_emb` and the fused layer
step (:mod:`fp8engine.ops.layer`) both use these, so the two give the same bits.
"""
from __future__ import annotations

import torch

__all__ = ["rope_cos_sin", "rope_fwd", "rope_bwd", "qkv_views", "rotate_views", "unrotate_grads"]


def rope_cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the angles ``freqs [s, 1, 1, r]``, each in ``dtype``, contiguous (the layout the
    rotary kernels read, :mod:`fp8engine.kernels.rotary`).

    Kept on ``freqs`` itself per dtype (with its version counter: an in-place change of the angles recomputes them),
    so every layer a model passes the same angle tensor to (:class:`fp8engine.models.GPT` keeps one per sequence
    length) reuses them. Not under ``torch.compile`` (computed in the graph, where Inductor fuses them), nor for
    angles that require grad or were made under ``torch.inference_mode`` (no version counter)."""
    if torch.compiler.is_compiling() or freqs.requires_grad or freqs.is_inference():
        return _tables(freqs, dtype)
    kept = freqs.__dict__.setdefault("_fp8engine_rope_tables", {})
    hit = kept.get(dtype)
    if hit is None or hit[0] != freqs._version:
        hit = (freqs._version, *_tables(freqs, dtype))
        # tables made while a CUDA graph captures hold their values only once the graph replays: not kept
        if not (freqs.is_cuda and torch.cuda.is_current_stream_capturing()):
            kept[dtype] = hit
    return hit[1], hit[2]


def _tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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


def qkv_views(y: torch.Tensor, groups: int, heads_per_group: int, head_dim: int):
    """``y [s, b, C]`` -> ``(q [s, b, g, hpg, d], k [s, b, g, d], v [s, b, g, d])`` views."""
    grouped = y.view(*y.shape[:-1], groups, heads_per_group + 2, head_dim)
    return grouped[..., :heads_per_group, :], grouped[..., heads_per_group, :], grouped[..., heads_per_group + 1, :]


def rotate_views(y: torch.Tensor, split: tuple, cos: torch.Tensor, sin: torch.Tensor):
    """The plain-PyTorch rotation of q and k of ``y [s, b, C]`` (:func:`rope_fwd` on the
    grouped views): ``(q [s, b, g * hpg, d], k [s, b, g, d])``, new tensors; the bits of
    :func:`fp8engine.kernels.rotary.rope_qk`."""
    g, hpg, d = split
    q, k, _ = qkv_views(y, g, hpg, d)
    return rope_fwd(q.reshape(*y.shape[:2], g * hpg, d), cos, sin), rope_fwd(k, cos, sin)


def unrotate_grads(dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], rope: tuple):
    """The rotation's gradient (:func:`rope_bwd`) applied to ``dq [s, b, g, hpg, d]`` and
    ``dk [s, b, g, d]`` (None stays None): the gradients of q and k before the rotation."""
    if dq is not None:
        s, b, g, hpg, d = dq.shape
        dq = rope_bwd(dq.reshape(s, b, g * hpg, d), *rope).view(s, b, g, hpg, d)
    return dq, None if dk is None else rope_bwd(dk, *rope)
