"""LayerNorm / RMSNorm forward fused with the 1 x 128 block cast (the ``Float8BlockScaling`` recipe's activations).

Math: as :mod:`fp8engine.kernels.norm` (``y = (x - mean) * rstd * gamma + beta`` or ``y = x * rstd * gamma``, gamma =
weight or ``1 + weight`` with ``zero_centered_gamma``, all in fp32; the optional residual add ``s = x + residual``
rounded to x's dtype first, written to ``residual_out``). The fp32 ``y`` is then cast as
:func:`fp8engine.kernels.block_cast.cast_1x128` casts its input: one scale per row per 128 columns from that tile's
amax (``scale = fp8_max / amax``, power of two with ``power_2_scale``), ``data = saturate(y * scale).to(fp8)``,
``scale_inv = 1 / scale``; with ``transpose`` also the re-tiled transpose (``data_t [K, M]``, one scale per column
of y per 128 rows) that the wgrad GEMM ``dw = dy^T @ y`` takes.

Rounding, and what equals the unfused path (norm kernel writing ``y`` in x's dtype, then ``cast_1x128``): the cast
reads the fp32 ``y``, not ``y`` rounded to x's dtype, as the per-tensor norm kernel's FP8 output does (one rounding
instead of two). For fp32 inputs the intermediate is the same fp32 value in both paths, so the FP8 bits and scales
equal the unfused path's exactly (``tests/kernels/test_block_norm.py``); for bf16 / fp16 inputs they differ where
the bf16 rounding of y moved a value across an FP8 rounding midpoint or a tile's amax across a power of two (tests
compare both to float64).

Two kernels (launches), chosen because the norm needs whole rows and the re-tiled transpose needs 128-row columns:
  1. ``_block_norm_rows_kernel``: whole rows per program (the norm kernel's tiling, ``norm._tile``: same fp32
     reductions, so the same mean / rstd / y): writes ``mean``, ``rstd``, ``residual_out``, the optional
     high-precision ``y`` and the row-wise FP8 ``data`` + ``scale_inv`` (the row's 1 x 128 tiles reduced in
     registers). Without ``transpose`` (inference, no wgrad) this is the only launch.
  2. ``_block_norm_t_kernel`` (``transpose``): one 128 x 128 tile per program recomputes ``y`` from the normalised
     input ``s``, the stored ``mean`` / ``rstd`` and gamma / beta (the same fp32 operations, so the same values)
     and writes the re-tiled ``data_t`` + ``scale_inv_t``.
Traffic per element (bf16 x, transpose): reads x twice (the second mostly from L2), writes 2 FP8 bytes: ~6 bytes
against ~8 unfused (x read, y written, y read, 2 FP8 bytes). Fusing the transpose into kernel 1 would need 128 whole
rows per program (128 x N fp32 in registers) or a second pass over the row anyway.

Row padding: with ``pad_rows`` the FP8 outputs have ``M_out = ceil(M / 128) * 128`` rows, rows ``M..M_out-1`` zero
(data 0, scale_inv 1; no contribution to the transposed tiles' amaxes): the layout of a
:class:`~fp8engine.fp8.block_tensor.Float8BlockTensor` (its input's token rows zero-padded), so the wgrad GEMM's
contraction dim is a multiple of 128. (A zero input row would not do: LayerNorm maps it to beta.)

Shapes: x ``[..., N]`` contiguous bf16 / fp16 / fp32 viewed as ``[M, N]``; N a multiple of 128 (the block GEMMs'
granularity; ValueError otherwise) and at most ``norm.MAX_N``; weight / bias ``[N]``.
Layers: kernels -> launcher :func:`norm_fwd_1x128` -> ``BlockQuantizer.cast_norm``
(``fp8engine/fp8/block_quantizer.py``), used by ``fp8engine/ops/norm_linear.py``; plain-PyTorch
:func:`norm_fwd_1x128_reference` beside it (same outputs; bits equal up to the fp32 reductions' order).
"""

from __future__ import annotations

import torch

from ._common import (
    _masked_abs,
    _quantize,
    as_2d,
    cdiv,
    check_hp,
    check_launchable,
    fp8_cvt_mode,
    fp8_format,
    launch,
    tl,
    triton,
)
from .block_cast import (
    BLOCK,
    BLOCK_WARPS,
    _block_scale,
    _store_1x128_t,
    cast_1x128_reference,
)
from .norm import MAX_N, _normalize_rows, _tile

__all__ = ["norm_fwd_1x128", "norm_fwd_1x128_reference"]


@triton.jit
def _block_norm_rows_kernel(
    x_ptr,  # [M, N] input, row-major, high precision
    r_ptr,  # [M, N] residual in x's dtype; only if HAS_RESIDUAL
    s_ptr,  # [M, N] output x + residual in x's dtype (the normalised tensor); only if HAS_RESIDUAL
    w_ptr,  # [N] weight (gamma, or gamma - 1 if ZERO_CENTERED)
    b_ptr,  # [N] bias (beta); only if HAS_BIAS
    y_ptr,  # [M, N] high-precision output in x's dtype; only if WRITE_HP
    y8_ptr,  # [M_OUT, N] FP8 bits (uint8), rows >= M zero
    sinv_ptr,  # [N / 128, M_OUT] fp32: M-major storage of the [M_OUT, N/128] scale_inv
    mean_ptr,  # [M] fp32 row means (LayerNorm only)
    rstd_ptr,  # [M] fp32 row 1/sqrt(var + eps)
    M,
    M_OUT,
    N,
    eps,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    WRITE_HP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE: tl.constexpr,  # 128: the 1 x 128 tile length
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    # ---- the norm: norm._norm_fwd_kernel's device function (same tiling), so the same fp32 values
    y = _normalize_rows(x_ptr, r_ptr, s_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rows, cols, rmask, cmask, offs, N, eps,
                        IS_RMS, HAS_BIAS, HAS_RESIDUAL, ZERO_CENTERED, CVT)
    if WRITE_HP:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    # ---- the 1 x 128 cast of the fp32 y: padding rows (>= M) are zero, as the op's zero-padded input rows
    y = tl.where(mask, y, 0.0)
    omask = (rows < M_OUT)[:, None] & cmask[None, :]
    NT: tl.constexpr = BLOCK_N // TILE
    a3 = tl.reshape(_masked_abs(y, omask), [BLOCK_M, NT, TILE])
    s3 = _block_scale(tl.max(a3, axis=2), FP8_MAX, POW2)  # [BLOCK_M, NT]: one scale per 1 x 128 tile
    b = tl.reshape(_quantize(tl.reshape(y, [BLOCK_M, NT, TILE]), s3[:, :, None], FP8_MAX, IS_E4M3, CVT),
                   [BLOCK_M, BLOCK_N])
    tl.store(y8_ptr + offs, b, mask=omask)
    tiles = tl.arange(0, NT)
    sinv = tl.math.div_rn(tl.zeros_like(s3) + 1.0, s3)
    tl.store(sinv_ptr + tiles[None, :].to(tl.int64) * M_OUT + rows[:, None], sinv,
             mask=(rows < M_OUT)[:, None] & (tiles < N // TILE)[None, :])


@triton.jit
def _block_norm_t_kernel(
    s_ptr,  # [M, N] the normalised input (x, or x + residual as kernel 1 wrote it), row-major
    w_ptr,  # [N] weight (gamma, or gamma - 1 if ZERO_CENTERED)
    b_ptr,  # [N] bias (beta); only if HAS_BIAS
    mean_ptr,  # [M] fp32 row means from kernel 1 (LayerNorm only)
    rstd_ptr,  # [M] fp32 row rstd from kernel 1
    y8t_ptr,  # [N, M_OUT] FP8 bits (uint8) of the re-tiled transpose
    sinv_t_ptr,  # [M_OUT / 128, N] fp32: N-major storage of the [N, M_OUT/128] scale_inv_t
    M,
    M_OUT,
    N,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    rmask = offs_m < M
    cmask = offs_n < N
    # the tile read transposed ([n, m]: rows offs_n, columns offs_m), so each 1 x 128 tile of y^T is a row of it
    # (see block_cast._store_1x128_t); the values are the rows kernel's, element for element
    mask = cmask[:, None] & rmask[None, :]
    x = tl.load(s_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + offs_m, mask=rmask, other=0.0)
    if IS_RMS:
        xc = x
    else:
        mean = tl.load(mean_ptr + offs_m, mask=rmask, other=0.0)
        xc = tl.where(mask, x - mean[None, :], 0.0)
    w = tl.load(w_ptr + offs_n, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = xc * rstd[None, :] * w[:, None]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs_n, mask=cmask, other=0.0).to(tl.float32)[:, None]
    y = tl.where(mask, y, 0.0)
    _store_1x128_t(y, _masked_abs(y, mask), offs_m, offs_n, pid_m, M_OUT, N, y8t_ptr, sinv_t_ptr, FP8_MAX, IS_E4M3,
                   CVT, POW2, True)


def _check_vec(v, name, n, x, op):
    if v is None:
        return
    check_hp(v, name, op)
    if tuple(v.shape) != (n,) or v.device != x.device:
        raise ValueError(f"{op}: {name} must be [{n}] on {x.device} (x's last dim and device); got "
                         f"{tuple(v.shape)} on {v.device}")


def _check(x, weight, bias, residual, residual_out, fp8_dtype, op):
    check_launchable(x, op)
    check_hp(x, "x", op)
    fp8_max, is_e4m3 = fp8_format(fp8_dtype, op)
    n = x.shape[-1]
    if n % BLOCK or n > MAX_N:
        raise ValueError(f"{op}: last dim {n} must be a multiple of {BLOCK} (the 1 x {BLOCK} tiles of the block "
                         f"GEMMs) and at most {MAX_N}; use {op}_reference, or the norm then "
                         "block_cast.cast_1x128")
    _check_vec(weight, "weight", n, x, op)
    _check_vec(bias, "bias", n, x, op)
    if (residual is None) != (residual_out is None):
        raise ValueError(f"{op}: give both residual and residual_out (receives x + residual), or neither")
    for name, t in (("residual", residual), ("residual_out", residual_out)):
        if t is not None:
            check_hp(t, name, op)
            if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
                raise ValueError(f"{op}: {name} must match x (shape {tuple(x.shape)}, {x.dtype}, {x.device})")
    return fp8_max, is_e4m3


def _rows_out(m: int, pad_rows: bool) -> int:
    return -(-m // BLOCK) * BLOCK if pad_rows else m


def norm_fwd_1x128(x, weight, bias, eps, fp8_dtype, *, rms=False, zero_centered_gamma=False, power_2_scale=True,
                   transpose=False, pad_rows=False, return_hp=False, residual=None, residual_out=None):
    """LayerNorm (``rms=False``) or RMSNorm of ``x``'s last dim, written as 1 x 128-tiled FP8 (module docstring).

    Args:
        x: ``[..., N]`` bf16 / fp16 / fp32, contiguous; N a multiple of 128, at most ``norm.MAX_N``.
        weight: ``[N]``; bias: ``[N]`` or None (RMSNorm: ignored, pass None). eps: added to the variance.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        zero_centered_gamma: gamma = ``1 + weight``. power_2_scale: power-of-two block scales.
        transpose: also write the re-tiled transpose for the wgrad GEMM (second launch).
        pad_rows: FP8 outputs padded with zero rows to a multiple of 128 rows (module docstring).
        return_hp: also write ``y`` in x's dtype (e.g. ``return_layernorm_output``).
        residual, residual_out: both or neither, like x: normalise ``s = x + residual`` (rounded to x's dtype),
            written to ``residual_out`` (the ``x`` of the backward).
    Returns:
        ``(y_hp or None, data, scale_inv, data_t or None, scale_inv_t or None, mean or None, rstd)``: ``y_hp`` like
        x; ``data`` FP8 ``[M_out, N]`` (``M_out`` = M, or M rounded up to 128 with ``pad_rows``); ``scale_inv``
        fp32 ``[M_out, N/128]`` with strides ``(1, M_out)``; ``data_t`` ``[N, M_out]``; ``scale_inv_t`` fp32
        ``[N, ceil(M_out/128)]`` with strides ``(1, N)``; ``mean`` (LayerNorm) / ``rstd`` ``[M]`` fp32 (the
        layouts :func:`fp8engine.kernels.norm.layernorm_bwd` / ``rmsnorm_bwd`` take).
    Raises:
        TypeError: dtypes (x, weight, bias not bf16 / fp16 / fp32; fp8_dtype not FP8). ValueError: N not a
        multiple of 128 or too wide, mismatched shapes / devices, non-contiguous inputs, a device the kernels do
        not run on (use :func:`norm_fwd_1x128_reference`). RuntimeError: Triton missing.
    """
    op = "norm_fwd_1x128"
    fp8_max, is_e4m3 = _check(x, weight, None if rms else bias, residual, residual_out, fp8_dtype, op)
    x2 = as_2d(x)
    m, n = x2.shape
    m_out = _rows_out(m, pad_rows)
    dev = x.device
    y = torch.empty_like(x) if return_hp else None
    data = torch.empty((m_out, n), dtype=fp8_dtype, device=dev)
    sinv_buf = torch.empty((n // BLOCK, m_out), dtype=torch.float32, device=dev)
    mean = None if rms else torch.empty(m, dtype=torch.float32, device=dev)
    rstd = torch.empty(m, dtype=torch.float32, device=dev)
    has_bias = bias is not None and not rms
    block_m, block_n, num_warps = _tile(n)
    dummy = rstd
    if m_out and n:
        launch(_block_norm_rows_kernel, (cdiv(m_out, block_m),),
            x2, residual if residual is not None else dummy, residual_out if residual_out is not None else dummy,
            weight, bias if has_bias else dummy, y if y is not None else dummy, data.view(torch.uint8), sinv_buf,
            mean if mean is not None else dummy, rstd, m, m_out, n, eps,
            IS_RMS=rms, HAS_BIAS=has_bias, HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered_gamma,
            WRITE_HP=return_hp, FP8_MAX=fp8_max, IS_E4M3=is_e4m3, CVT=fp8_cvt_mode(), POW2=bool(power_2_scale),
            BLOCK_M=block_m, BLOCK_N=block_n, TILE=BLOCK, num_warps=num_warps)
    data_t = sinv_t = None
    if transpose:
        mb = cdiv(m_out, BLOCK)
        data_t = torch.empty((n, m_out), dtype=fp8_dtype, device=dev)
        sinv_t_buf = torch.empty((mb, n), dtype=torch.float32, device=dev)
        if m_out and n:
            launch(_block_norm_t_kernel, (mb, n // BLOCK),
                residual_out if residual_out is not None else x2, weight, bias if has_bias else dummy,
                mean if mean is not None else dummy, rstd, data_t.view(torch.uint8), sinv_t_buf, m, m_out, n,
                IS_RMS=rms, HAS_BIAS=has_bias, ZERO_CENTERED=zero_centered_gamma, FP8_MAX=fp8_max,
                IS_E4M3=is_e4m3, CVT=fp8_cvt_mode(tiled_transpose=True), POW2=bool(power_2_scale), BLOCK=BLOCK,
                num_warps=BLOCK_WARPS)
        sinv_t = sinv_t_buf.t()
    return y, data, sinv_buf.t(), data_t, sinv_t, mean, rstd


# ----------------------------------------------------------------------------------------------------------------
# Plain-PyTorch reference
# ----------------------------------------------------------------------------------------------------------------
def norm_fwd_1x128_reference(x, weight, bias, eps, fp8_dtype, *, rms=False, zero_centered_gamma=False,
                             power_2_scale=True, transpose=False, pad_rows=False, return_hp=False, residual=None,
                             residual_out=None):
    """Plain-PyTorch :func:`norm_fwd_1x128`: the fp32 norm (``norm._norm_fwd_reference``'s math), then
    :func:`~fp8engine.kernels.block_cast.cast_1x128_reference` of the fp32 ``y`` (zero rows appended with
    ``pad_rows``). Same outputs and layouts; the bits equal the kernel's where the fp32 mean / variance do (the
    reductions run in another order: an ulp can flip an FP8 rounding or, rarely, a tile's power-of-two scale)."""
    if residual is not None:
        x = torch.add(x, residual, out=residual_out)
    x2 = as_2d(x).float()
    m, n = x2.shape
    gamma = weight.float() + 1.0 if zero_centered_gamma else weight.float()
    mean = None if rms else x2.mean(dim=1)
    xc = x2 if rms else x2 - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * rstd[:, None] * gamma
    if bias is not None and not rms:
        y = y + bias.float()
    y_hp = y.to(x.dtype).reshape(x.shape) if return_hp else None
    y = torch.nn.functional.pad(y, (0, 0, 0, _rows_out(m, pad_rows) - m))
    data, sinv, data_t, sinv_t = cast_1x128_reference(y, fp8_dtype, power_2_scale=power_2_scale,
                                                      transpose=transpose)
    return y_hp, data, sinv, data_t, sinv_t, mean, rstd
