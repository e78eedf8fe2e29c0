"""Rotary position embedding (RoPE) of q and k, read straight from the fused grouped QKV projection output.

Layout (``fp8engine.ops.qkv``, Megatron-LM / TransformerEngine interleaved QKV): the projection output ``qkv`` is
``[s, b, C]`` (or its ``[T, C]`` view, ``T = s * b``) with ``C = g * (hpg + 2) * d``, viewed as
``[s, b, g, hpg + 2, d]``: for every KV group its ``hpg`` query heads, its key head, its value head.
:func:`rope_qk` writes

    q [s, b, g * hpg, d]  (head ``gi * hpg + j`` = group gi's j-th query head),   k [s, b, g, d]       (contiguous)

with the first ``r`` channels of every head rotated and the rest copied (partial rotary), in one pass: what
``fp8engine.ops.rotary.rope_fwd`` (the plain-PyTorch reference) gives on the views of ``qkv`` -- bit for bit. The
reference computes in ``qkv``'s dtype, one rounded op at a time (``t cos``, ``rotate_half(t) sin``, their sum); the
kernel computes each product and the sum in fp32 (exact for 16-bit operands) and rounds each to that dtype
(``_round_to``), so the bits agree. Without FMA contraction (``enable_fp_fusion=False``) for fp32 inputs.

What it replaces per layer: the reference's 4 multiplies, 2 cats, 2 negations and 2 adds plus the copy of the
grouped q view (10 kernels, each a full pass over q or k); the kernel reads q and k once and writes them once.

The gradient of the rotation is fused into the QKV-gradient cast (``fp8engine.kernels.qkv_grad``, its ``cos``/
``sin`` arguments).

Layers: ``_rope_qk_kernel`` -> launcher :func:`rope_qk` (checks, grid); reference: ``fp8engine.ops.rotary``.
"""

from __future__ import annotations

import torch

from ._common import HP_DTYPES, _round_to, cdiv, check_launchable, fp8_cvt_mode, launch, next_power_of_2, tl, triton

__all__ = ["rope_qk", "check_rope_table"]

#: Elements one program rotates at most (heads x padded head dim): enough work per program, registers bounded.
_BLOCK_ELEMS = 4096


@triton.jit
def _rope_qk_kernel(
    qkv_ptr,  # [T, C] high precision, row-major: the grouped projection output
    cos_ptr,  # [s, R] cos of the angles, qkv's dtype, row-major
    sin_ptr,  # [s, R] sin of the angles, qkv's dtype, row-major
    q_ptr,  # [T, G * HPG, HEAD_DIM] out, qkv's dtype
    k_ptr,  # [T, G, HEAD_DIM] out, qkv's dtype
    B,  # batch size: row t is (s_idx, b_idx) = (t // B, t % B)
    C,
    G: tl.constexpr,
    HPG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    R: tl.constexpr,  # rotated channels per head (even, <= HEAD_DIM)
    CVT: tl.constexpr,  # 1 under the interpreter (bf16 rounding emulated, see _round_to)
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    s_idx = row // B
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # rotated heads: g x (hpg queries + 1 key)
    gi = heads // (HPG + 1)
    slot = heads % (HPG + 1)
    dd = tl.arange(0, BLOCK_D)
    mask = (heads < G * (HPG + 1))[:, None] & (dd < HEAD_DIM)[None, :]
    rot = (dd < R)[None, :]
    half: tl.constexpr = R // 2
    partner = tl.where(dd < half, dd + half, dd - half)  # rotate_half's source channel
    base = row * C + ((gi * (HPG + 2) + slot) * HEAD_DIM)[:, None]
    x = tl.load(qkv_ptr + base + dd[None, :], mask=mask, other=0.0)
    xp = tl.load(qkv_ptr + base + partner[None, :], mask=mask & rot, other=0.0)
    c = tl.load(cos_ptr + s_idx * R + dd, mask=dd < R, other=0.0)[None, :]
    sn = tl.load(sin_ptr + s_idx * R + dd, mask=dd < R, other=0.0)[None, :]
    # rotate_half(x) = (-x2, x1); each op rounded to x's dtype as the reference's separate ops are
    xf = x.to(tl.float32)
    rh = tl.where((dd < half)[None, :], -xp.to(tl.float32), xp.to(tl.float32))
    a = _round_to(xf * c.to(tl.float32), x.dtype, CVT).to(tl.float32)
    bb = _round_to(rh * sn.to(tl.float32), x.dtype, CVT).to(tl.float32)
    y = tl.where(rot, _round_to(a + bb, x.dtype, CVT), x)
    is_q = (slot < HPG)[:, None]
    q_off = row * (G * HPG * HEAD_DIM) + ((gi * HPG + slot) * HEAD_DIM)[:, None] + dd[None, :]
    k_off = row * (G * HEAD_DIM) + (gi * HEAD_DIM)[:, None] + dd[None, :]
    tl.store(q_ptr + q_off, y, mask=mask & is_q)
    tl.store(k_ptr + k_off, y, mask=mask & (slot == HPG)[:, None])


def check_rope_table(cos: torch.Tensor, sin: torch.Tensor, s: int, d: int, like: torch.Tensor, op: str) -> int:
    """Validate the angle tables ``cos, sin [s, 1, 1, r]`` (or ``[s, r]``), contiguous, in ``like``'s dtype and on its
    device, ``r`` even and ``<= d``; return ``r``. Raises ValueError / TypeError saying what to change."""
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != like.dtype or t.device != like.device:
            raise TypeError(f"{op}: {name} is {t.dtype} on {t.device}; expected {like.dtype} on {like.device} "
                            "(fp8engine.ops.rotary.rope_cos_sin(freqs, dtype))")
        if t.dim() not in (2, 4) or t.shape[0] != s or t.numel() != s * t.shape[-1] or not t.is_contiguous():
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}; expected contiguous [{s}, 1, 1, r] or "
                             f"[{s}, r] (one row per position)")
    r = cos.shape[-1]
    if sin.shape != cos.shape or r % 2 or r > d or r == 0:
        raise ValueError(f"{op}: cos {tuple(cos.shape)} / sin {tuple(sin.shape)}: the rotated width r={r} must be "
                         f"even, 0 < r <= head dim {d}, and the two shapes equal")
    return r


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, split: tuple[int, int, int],
            batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q and k from the grouped QKV output, one pass (module docstring).

    Args:
        qkv: ``[s, b, C]`` or ``[T, C]`` (``T = s * b``, rows in ``[s, b]`` order), contiguous, bf16/fp16/fp32.
        cos, sin: ``[s, 1, 1, r]`` (or ``[s, r]``) in qkv's dtype (``fp8engine.ops.rotary.rope_cos_sin``).
        split: ``(g, hpg, d)`` -- KV groups, query heads per group, head dim; ``C = g * (hpg + 2) * d``.
        batch: ``b``.
    Returns:
        ``q [s, b, g * hpg, d]`` and ``k [s, b, g, d]``, contiguous, in qkv's dtype; equal bit for bit to
        ``rope_fwd(q_view, cos, sin)`` and ``rope_fwd(k_view, cos, sin)`` of ``fp8engine.ops.rotary``.
    Raises:
        ValueError: shapes inconsistent, qkv not contiguous, not launchable (CPU without TRITON_INTERPRET=1).
        TypeError: unsupported dtype, or cos/sin not in qkv's dtype/device.
    """
    op = "rope_qk"
    check_launchable(qkv, op)
    g, hpg, d = split
    if qkv.dtype not in HP_DTYPES:
        raise TypeError(f"{op}: qkv has dtype {qkv.dtype}; supported: bfloat16, float16, float32")
    c = g * (hpg + 2) * d
    if batch <= 0 or qkv.shape[-1] != c or not qkv.is_contiguous() or qkv.numel() % (batch * c):
        raise ValueError(f"{op}: qkv {tuple(qkv.shape)} (contiguous: {qkv.is_contiguous()}) does not hold rows of "
                         f"C = g * (hpg + 2) * d = {c} for split {split}, batch {batch}")
    t = qkv.numel() // c
    s = t // batch
    r = check_rope_table(cos, sin, s, d, qkv, op)
    q = torch.empty((s, batch, g * hpg, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((s, batch, g, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q, k
    block_d = next_power_of_2(d)
    heads = g * (hpg + 1)
    block_h = min(next_power_of_2(heads), max(1, _BLOCK_ELEMS // block_d))
    launch(_rope_qk_kernel, (t, cdiv(heads, block_h)), qkv, cos, sin, q, k, batch, c,
           G=g, HPG=hpg, HEAD_DIM=d, R=r, CVT=fp8_cvt_mode(), BLOCK_H=block_h, BLOCK_D=block_d,
           num_warps=4, enable_fp_fusion=False)
    return q, k
