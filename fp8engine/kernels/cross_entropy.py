"""Cross-entropy over one chunk of logits, for the fused LM-head loss (:mod:`fp8engine.ops.lm_head`).

Per logit row ``z [V]`` (16-bit or fp32, the LM-head GEMM's output) and its target ``t``:

- :func:`ce_row_stats` (one read of ``z``): ``m = max_v z``, ``s = sum_v exp(z - m)`` (online: a running max and a
  rescaled running sum per lane, Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018) and the
  target logit ``p = z[t - vocab_start]`` (0 where the target is not in this vocabulary shard), all fp32;
- :func:`ce_grad_` (one read, one write, in place over ``z``): ``dz = (exp(z - m) / s - [v == t]) * row_scale``
  in ``z``'s dtype, the logits gradient of ``row_scale * (log s + m - p)`` (softmax minus one-hot).

Between them the caller forms ``loss = log s + m - p`` and, vocabulary-parallel, all-reduces ``m`` (max) and
``s`` (rescaled to the global max) and ``p`` (sum) over the shards (Megatron-core's ``vocab_parallel_cross_entropy``
in log-sum-exp form). The plain-PyTorch chain these replace (an fp32 copy of ``z``, max, subtract, exp, sum,
divide, scatter of the one-hot, scale, cast back) makes ~9 passes over ``[c, V]`` fp32 temporaries, ~54 bytes of
traffic per logit at bf16; these two kernels move 6 (Liger-Kernel's cross-entropy kernel does the same two passes
in one launch).

Layers: ``_ce_stats_kernel`` -> :func:`ce_row_stats`, ``_ce_grad_kernel`` -> :func:`ce_grad_`; references:
:func:`ce_row_stats_reference`, :func:`ce_grad_reference` (the same arithmetic in plain PyTorch, fp32).
"""

from __future__ import annotations

import torch

from ._common import _round_to, check_hp, check_launchable, fp8_cvt_mode, launch, next_power_of_2, tl, triton

__all__ = ["ce_row_stats", "ce_grad_", "ce_row_stats_reference", "ce_grad_reference"]

#: Logits one program reads per loop iteration (a power of two; rows are looped over in blocks of this).
_BLOCK = 4096


@triton.jit
def _ce_stats_kernel(
    z_ptr,  # [R, V] logits (row-major, row stride V)
    t_ptr,  # [R] int64 targets (global vocabulary ids, or any id outside [vocab_start, vocab_start + V))
    m_ptr,  # [R] fp32 out: row max
    s_ptr,  # [R] fp32 out: sum of exp(z - max)
    p_ptr,  # [R] fp32 out: the target's logit, 0 where the target is not in this shard
    V,
    vocab_start,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * V
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -3.0e38, tl.float32)  # a finite "-inf": exp(-3e38 - m) is 0, and no inf - inf NaN
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    row_max = tl.max(m, axis=0)
    row_sum = tl.sum(s * tl.exp(m - row_max), axis=0)
    t = tl.load(t_ptr + row) - vocab_start
    inside = (t >= 0) & (t < V)
    p = tl.load(base + tl.where(inside, t, 0)).to(tl.float32)
    tl.store(m_ptr + row, row_max)
    tl.store(s_ptr + row, row_sum)
    tl.store(p_ptr + row, tl.where(inside, p, 0.0))


@triton.jit
def _ce_grad_kernel(
    z_ptr,  # [R, V] logits in, their gradient out (same dtype)
    t_ptr,  # [R] int64 targets
    m_ptr,  # [R] fp32 row max (global over the shards)
    s_ptr,  # [R] fp32 sum of exp(z - m) (global)
    scale_ptr,  # [R] fp32 row scale (0 for an ignored row)
    V,
    vocab_start,
    CVT: tl.constexpr,  # 1 under the interpreter (bf16 rounding emulated, see _round_to)
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * V
    cols = tl.arange(0, BLOCK)
    m = tl.load(m_ptr + row)
    inv_s = 1.0 / tl.load(s_ptr + row)
    scale = tl.load(scale_ptr + row)
    t = tl.load(t_ptr + row) - vocab_start
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - m) * inv_s
        p = tl.where(idx == t, p - 1.0, p)
        tl.store(base + idx, _round_to(p * scale, z_ptr.dtype.element_ty, CVT), mask=mask)


def _check(z: torch.Tensor, target: torch.Tensor, op: str) -> None:
    check_launchable(z, op)
    check_hp(z, "z", op)
    if z.dim() != 2 or target.shape != z.shape[:1] or target.dtype != torch.int64:
        raise ValueError(f"{op}: needs z [R, V] and int64 target [R]; got {tuple(z.shape)}, "
                         f"{tuple(target.shape)} {target.dtype}")


def _block(v: int) -> int:
    return min(_BLOCK, next_power_of_2(v))


def ce_row_stats(z: torch.Tensor, target: torch.Tensor, vocab_start: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, s, p)``, each ``[R]`` fp32: the row max of ``z [R, V]`` (contiguous bf16/fp16/fp32), the sum of
    ``exp(z - m)`` and the target logit ``z[r, target[r] - vocab_start]`` (0 where that is outside ``[0, V)``).

    Raises:
        ValueError: shapes (``z`` not 2-D, ``target`` not ``[R]`` int64), a non-contiguous ``z`` or a device
            that cannot run the kernel (CPU without ``TRITON_INTERPRET=1``). TypeError: ``z``'s dtype.
    """
    _check(z, target, "ce_row_stats")
    r, v = z.shape
    m, s, p = (torch.empty(r, dtype=torch.float32, device=z.device) for _ in range(3))
    if r:
        launch(_ce_stats_kernel, (r,), z, target, m, s, p, v, vocab_start, BLOCK=_block(v), num_warps=8)
    return m, s, p


def ce_grad_(z: torch.Tensor, target: torch.Tensor, m: torch.Tensor, s: torch.Tensor, row_scale: torch.Tensor,
             vocab_start: int = 0) -> torch.Tensor:
    """Overwrite ``z [R, V]`` with ``(exp(z - m) / s - onehot(target - vocab_start)) * row_scale`` (rows
    broadcast; ``m``, ``s``, ``row_scale`` ``[R]`` fp32), computed in fp32, stored in ``z``'s dtype. Returns ``z``.

    Raises:
        as :func:`ce_row_stats`; ValueError for ``m``/``s``/``row_scale`` not contiguous ``[R]`` fp32.
    """
    _check(z, target, "ce_grad_")
    for name, t in (("m", m), ("s", s), ("row_scale", row_scale)):
        if t.shape != z.shape[:1] or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"ce_grad_: {name} must be contiguous [R] float32; got {tuple(t.shape)} {t.dtype}")
    r, v = z.shape
    if r:
        launch(_ce_grad_kernel, (r,), z, target, m, s, row_scale, v, vocab_start, CVT=fp8_cvt_mode(),
               BLOCK=_block(v), num_warps=8)
    return z


def ce_row_stats_reference(z: torch.Tensor, target: torch.Tensor, vocab_start: int = 0
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain PyTorch :func:`ce_row_stats` (fp32; float64 for float64 ``z``)."""
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    m = zf.amax(dim=-1)
    s = (zf - m.unsqueeze(-1)).exp().sum(dim=-1)
    local = target - vocab_start
    inside = (local >= 0) & (local < z.shape[-1])
    p = torch.gather(zf, -1, local.masked_fill(~inside, 0).unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    return m, s, p


def ce_grad_reference(z: torch.Tensor, target: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                      row_scale: torch.Tensor, vocab_start: int = 0) -> torch.Tensor:
    """Plain PyTorch :func:`ce_grad_`: a new tensor of ``z``'s dtype (``z`` is not written)."""
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    prob = (zf - m.unsqueeze(-1)).exp() / s.unsqueeze(-1)
    local = target - vocab_start
    inside = (local >= 0) & (local < z.shape[-1])
    prob.scatter_add_(-1, local.masked_fill(~inside, 0).unsqueeze(-1), -inside.to(prob.dtype).unsqueeze(-1))
    return (prob * row_scale.unsqueeze(-1)).to(z.dtype)
