"""MLP activations (GELU-tanh, ReLU, SwiGLU) fused with the 1 x 128 block cast (the ``Float8BlockScaling`` recipe):
the forward writes fc2's FP8 input, the backward fc1's FP8 gradient (with fc1's bias gradient).

Math: as :mod:`fp8engine.kernels.activation` (same Triton functions: ``gelu`` in its sigmoid form, ``relu``,
``swiglu`` on ``x = [gate | up]``; the backward formulas of ``_act_bwd_kernel``), all in fp32. The fp32 result is
cast as :func:`fp8engine.kernels.block_cast.cast_1x128` casts its input: one scale per row per 128 columns
(``scale = fp8_max / amax`` of the tile, power of two with ``power_2_scale``; ``scale_inv = 1 / scale``), and with
``transpose`` the re-tiled transpose (``[K, M]``, one scale per column per 128 rows) for the wgrad GEMM.

Rounding, and what equals the unfused path (the per-tensor activation kernel writing its result in x's dtype, then
``cast_1x128``): the cast reads the fp32 result, not the result rounded to x's dtype (one rounding instead of two,
as the per-tensor kernels' FP8 outputs). For fp32 inputs the FP8 bits and scales equal the unfused path's exactly;
for bf16 / fp16 they can differ where that rounding moved a value across an FP8 rounding midpoint or a tile's amax
across a power of two (``tests/kernels/test_block_activation.py`` compares both to float64). ``dbias`` is the fp32
column sum of the fp32 gradient (per 128-row tile, then one fixed-order sum: deterministic), rounded once to dy's
dtype, as the per-tensor backward kernel's (which sums per 64-row tile: the same value up to fp32 summation order).

One kernel per pass, one 128 x 128 output tile per program (SwiGLU's backward: the gate and the up tile of the same
rows / columns), which writes both the tile's row scales and its column scales: x (and dy) are read from HBM once
(the forward's transposed copy re-reads its tile transposed, from L2: see ``block_cast._store_1x128_t``; the
backward transposes its register tile), only FP8 is written. Unfused, the activation wrote and the cast read the
``[M, F]`` (backward ``[M, D]``) intermediate.

Row padding (``pad_rows``): the FP8 outputs get ``M_out = ceil(M / 128) * 128`` rows, rows ``M..`` zero (data 0,
scale_inv 1), the layout of a :class:`~fp8engine.fp8.block_tensor.Float8BlockTensor` (token rows zero-padded), so
the wgrad GEMM's contraction dim is a multiple of 128.

Shapes: forward ``x [..., D]`` -> ``[M, F]`` (``F = D``, SwiGLU ``F = D / 2``); backward ``dy [..., F]``, ``x [..., D]``
-> ``[M, D]`` (SwiGLU ``[dgate | dup]``); contiguous, one dtype (bf16 / fp16 / fp32); F a multiple of 128
(ValueError otherwise).
Layers: kernels -> launchers :func:`act_fwd_1x128`, :func:`act_bwd_1x128` -> ``BlockQuantizer.cast_act`` /
``cast_act_grad`` (``fp8engine/fp8/block_quantizer.py``), used by ``fp8engine/ops/mlp.py``; plain-PyTorch
references beside them (bits equal the kernels' up to the transcendental functions' last ulp).
"""

from __future__ import annotations

import torch

from ._common import (_masked_abs, as_2d, cdiv, check_hp, check_launchable, fp8_cvt_mode, fp8_format, launch,
                      sum_partials, tl, triton)
from .activation import _GELU, _RELU, _SWIGLU, _act_bwd_math, _act_bwd_tile, _act_fwd_math, _act_fwd_tile
from .block_cast import BLOCK, BLOCK_WARPS, _store_1x128_t, _store_tile_1x128, cast_1x128_reference

__all__ = ["act_fwd_1x128", "act_bwd_1x128", "act_fwd_1x128_reference", "act_bwd_1x128_reference", "KINDS"]

#: The activations by name (the modules' ``activation`` argument) -> the kernels' ``ACT`` constexpr.
KINDS = {"gelu": _GELU, "relu": _RELU, "swiglu": _SWIGLU}


@triton.jit
def _store_t_1x128(yt, offs_m, offs_n, pid_m, M, M_OUT, NC, out_t_ptr, sinv_t_ptr, FP8_MAX: tl.constexpr,
                   IS_E4M3: tl.constexpr, CVT: tl.constexpr, POW2: tl.constexpr):
    """The re-tiled transpose from ``yt``, the same tile computed from its inputs loaded transposed (rows offs_n,
    columns offs_m; see ``block_cast._store_1x128_t``), padding rows of y (columns of yt >= M) zeroed."""
    mask_t = (offs_n[:, None] < NC) & (offs_m[None, :] < M)
    yt = tl.where(mask_t, yt, 0.0)
    _store_1x128_t(yt, _masked_abs(yt, mask_t), offs_m, offs_n, pid_m, M_OUT, NC, out_t_ptr, sinv_t_ptr, FP8_MAX,
                   IS_E4M3, CVT, POW2, True)


@triton.jit
def _block_act_fwd_kernel(
    x_ptr,  # [M, D] input (SwiGLU: [gate | up], D = 2N), row-major, high precision
    y8_ptr,  # [M_OUT, N] FP8 bits (uint8)
    sinv_ptr,  # [N / 128, M_OUT] fp32: M-major storage of the [M_OUT, N/128] scale_inv
    y8t_ptr,  # [N, M_OUT] FP8 bits (uint8) of the re-tiled transpose; only if WRITE_T
    sinv_t_ptr,  # [cdiv(M_OUT, 128), N] fp32: N-major storage of the [N, M_OUT/128] scale_inv_t; only if WRITE_T
    M,
    M_OUT,
    N,
    ACT: tl.constexpr,  # _GELU, _RELU or _SWIGLU
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    POW2: tl.constexpr,
    WRITE_T: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y = _act_fwd_tile(x_ptr, offs_m[:, None].to(tl.int64), offs_n[None, :], mask, N, ACT)
    _store_tile_1x128(y, offs_m, offs_n, pid_m, pid_n, M, M_OUT, N, y8_ptr, sinv_ptr, y8t_ptr, sinv_t_ptr, FP8_MAX,
                      IS_E4M3, CVT, POW2, False)
    if WRITE_T:  # the tile again from x read transposed (an L2 hit), for the re-tiled transpose (faster than the
        # register tile's transpose: block_cast._store_1x128_t)
        mask_t = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        yt = _act_fwd_tile(x_ptr, offs_m[None, :].to(tl.int64), offs_n[:, None], mask_t, N, ACT)
        _store_t_1x128(yt, offs_m, offs_n, pid_m, M, M_OUT, N, y8t_ptr, sinv_t_ptr, FP8_MAX, IS_E4M3, CVT, POW2)


@triton.jit
def _block_act_bwd_kernel(
    dy_ptr,  # [M, N] gradient of the activation output, row-major
    x_ptr,  # [M, NC] forward input (pre-activation; [gate | up] for SwiGLU), NC = N or 2N
    dx8_ptr,  # [M_OUT, NC] FP8 bits (uint8)
    sinv_ptr,  # [NC / 128, M_OUT] fp32: M-major storage of the [M_OUT, NC/128] scale_inv
    dx8t_ptr,  # [NC, M_OUT] FP8 bits (uint8) of the re-tiled transpose; only if WRITE_T
    sinv_t_ptr,  # [cdiv(M_OUT, 128), NC] fp32: NC-major storage of [NC, M_OUT/128]; only if WRITE_T
    dbias_part_ptr,  # [cdiv(M_OUT, 128), NC] fp32 column sums of dx per row tile; only if HAS_DBIAS
    M,
    M_OUT,
    N,
    ACT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    POW2: tl.constexpr,
    WRITE_T: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    dx, du = _act_bwd_tile(dy_ptr, x_ptr, offs_m[:, None].to(tl.int64), offs_n[None, :], mask, N, ACT)
    if ACT == 2:  # SwiGLU: dx = [dg | du], rows of 2N; dg's tile is tile column pid_n, du's N/128 + pid_n
        nc = 2 * N
    else:
        nc = N
    _store_tile_1x128(dx, offs_m, offs_n, pid_m, pid_n, M, M_OUT, nc, dx8_ptr, sinv_ptr, dx8t_ptr, sinv_t_ptr,
                      FP8_MAX, IS_E4M3, CVT, POW2, WRITE_T)
    if ACT == 2:
        _store_tile_1x128(du, offs_m, offs_n + N, pid_m, pid_n + N // BLOCK, M, M_OUT, nc, dx8_ptr, sinv_ptr,
                          dx8t_ptr, sinv_t_ptr, FP8_MAX, IS_E4M3, CVT, POW2, WRITE_T)
    if HAS_DBIAS:
        part = dbias_part_ptr + pid_m.to(tl.int64) * nc
        tl.store(part + offs_n, tl.sum(tl.where(mask, dx, 0.0), axis=0), mask=offs_n < N)
        if ACT == 2:
            tl.store(part + N + offs_n, tl.sum(tl.where(mask, du, 0.0), axis=0), mask=offs_n < N)


def _kind(kind: str, op: str) -> int:
    if kind not in KINDS:
        raise ValueError(f"{op}: activation must be one of {sorted(KINDS)}, got {kind!r}")
    return KINDS[kind]


def _width(x: torch.Tensor, act: int, op: str) -> int:
    """N, the activation output's width, checked to be a multiple of 128."""
    d = x.shape[-1]
    n = d // 2 if act == _SWIGLU else d
    if (act == _SWIGLU and d % 2) or n % BLOCK:
        what = "half the last dim ([gate | up])" if act == _SWIGLU else "the last dim"
        raise ValueError(f"{op}: {what} is {d / 2 if act == _SWIGLU else d}, not a multiple of {BLOCK} (the 1 x "
                         f"{BLOCK} tiles of the block GEMMs); use {op}_reference, or the activation then "
                         "block_cast.cast_1x128")
    return n


def _rows_out(m: int, pad_rows: bool) -> int:
    return -(-m // BLOCK) * BLOCK if pad_rows else m


def _outputs(m_out: int, nc: int, fp8_dtype, transpose: bool, device):
    data = torch.empty((m_out, nc), dtype=fp8_dtype, device=device)
    sinv_buf = torch.empty((nc // BLOCK, m_out), dtype=torch.float32, device=device)
    mb = cdiv(m_out, BLOCK)
    data_t = torch.empty((nc, m_out), dtype=fp8_dtype, device=device) if transpose else None
    sinv_t_buf = torch.empty((mb, nc), dtype=torch.float32, device=device) if transpose else None
    return data, sinv_buf, data_t, sinv_t_buf


def act_fwd_1x128(x, kind, fp8_dtype, *, power_2_scale=True, transpose=False, pad_rows=False):
    """``act(x)`` written as 1 x 128-tiled FP8 (module docstring): fc2's input under ``Float8BlockScaling``.

    Args:
        x: ``[..., D]`` bf16 / fp16 / fp32, contiguous (SwiGLU: ``D = 2N``, ``[gate | up]``).
        kind: ``"gelu"`` (tanh approximation), ``"relu"`` or ``"swiglu"``.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``. power_2_scale: power-of-two block scales.
        transpose: also the re-tiled transpose (fc2's wgrad operand). pad_rows: zero rows up to a multiple of 128.
    Returns:
        ``(data, scale_inv, data_t or None, scale_inv_t or None)``: ``data`` FP8 ``[M_out, N]`` (``M_out`` = M, or
        rounded up to 128 with ``pad_rows``), ``scale_inv`` fp32 ``[M_out, N/128]`` strides ``(1, M_out)``;
        ``data_t`` ``[N, M_out]``, ``scale_inv_t`` fp32 ``[N, ceil(M_out/128)]`` strides ``(1, N)``.
    Raises:
        TypeError: x not bf16 / fp16 / fp32, fp8_dtype not FP8. ValueError: unknown kind, N not a multiple of 128,
        x non-contiguous, or a device the kernels do not run on (use :func:`act_fwd_1x128_reference`).
        RuntimeError: Triton missing.
    """
    op = "act_fwd_1x128"
    act = _kind(kind, op)
    check_launchable(x, op)
    check_hp(x, "x", op)
    fp8_max, is_e4m3 = fp8_format(fp8_dtype, op)
    n = _width(x, act, op)
    m = as_2d(x).shape[0]
    m_out = _rows_out(m, pad_rows)
    data, sinv_buf, data_t, sinv_t_buf = _outputs(m_out, n, fp8_dtype, transpose, x.device)
    if m_out:
        u8 = data.view(torch.uint8)
        launch(_block_act_fwd_kernel, (cdiv(m_out, BLOCK), n // BLOCK),
            x, u8, sinv_buf, data_t.view(torch.uint8) if transpose else u8,
            sinv_t_buf if transpose else sinv_buf, m, m_out, n,
            ACT=act, FP8_MAX=fp8_max, IS_E4M3=is_e4m3, CVT=fp8_cvt_mode(tiled_transpose=True),
            POW2=bool(power_2_scale), WRITE_T=transpose, BLOCK=BLOCK, num_warps=BLOCK_WARPS)
    return data, sinv_buf.t(), data_t, (sinv_t_buf.t() if transpose else None)


def act_bwd_1x128(dy, x, kind, fp8_dtype, *, power_2_scale=True, transpose=True, pad_rows=False, dbias=True):
    """``dx = dy * act'(x)`` written as 1 x 128-tiled FP8 (fc1's gradient under ``Float8BlockScaling``), with its
    re-tiled transpose (fc1's wgrad operand) and fc1's bias gradient.

    Args:
        dy: ``[..., N]`` gradient of the activation output; x: ``[..., D]`` its input (``D = N``, SwiGLU ``2N``);
            same dtype (bf16 / fp16 / fp32), contiguous; N a multiple of 128.
        kind, fp8_dtype, power_2_scale, pad_rows: as :func:`act_fwd_1x128`. transpose: write the re-tiled transpose.
        dbias: also return the column sums of dx.
    Returns:
        ``(data, scale_inv, data_t or None, scale_inv_t or None, dbias or None)``: FP8 ``data [M_out, D]`` and the
        layouts of :func:`act_fwd_1x128` with ``D`` columns; ``dbias [D]`` in dy's dtype (fp32 sums of the fp32
        dx, deterministic).
    Raises:
        as :func:`act_fwd_1x128`; ValueError also when dy's and x's shapes do not match, TypeError when dtypes
        differ.
    """
    op = "act_bwd_1x128"
    act = _kind(kind, op)
    check_launchable(x, op)
    check_hp(x, "x", op)
    check_hp(dy, "dy", op)
    if dy.dtype != x.dtype:
        raise TypeError(f"{op}: dy ({dy.dtype}) and x ({x.dtype}) must have the same dtype")
    fp8_max, is_e4m3 = fp8_format(fp8_dtype, op)
    n = _width(x, act, op)
    if tuple(dy.shape) != (*x.shape[:-1], n):
        raise ValueError(f"{op}: dy {tuple(dy.shape)} does not match x {tuple(x.shape)} (want dy [..., {n}])")
    nc = x.shape[-1]
    m = as_2d(x).shape[0]
    m_out = _rows_out(m, pad_rows)
    data, sinv_buf, data_t, sinv_t_buf = _outputs(m_out, nc, fp8_dtype, transpose, x.device)
    grid_m = cdiv(m_out, BLOCK)
    parts = torch.empty((grid_m, nc), dtype=torch.float32, device=x.device) if dbias else sinv_buf
    if m_out:
        u8 = data.view(torch.uint8)
        launch(_block_act_bwd_kernel, (grid_m, n // BLOCK),
            dy, x, u8, sinv_buf, data_t.view(torch.uint8) if transpose else u8,
            sinv_t_buf if transpose else sinv_buf, parts, m, m_out, n,
            ACT=act, FP8_MAX=fp8_max, IS_E4M3=is_e4m3, CVT=fp8_cvt_mode(tiled_transpose=True),
            POW2=bool(power_2_scale), WRITE_T=transpose, HAS_DBIAS=dbias, BLOCK=BLOCK, num_warps=BLOCK_WARPS)
    db = None
    if dbias:
        db = sum_partials(parts, dy.dtype) if m_out else torch.zeros(nc, dtype=dy.dtype, device=x.device)
    return data, sinv_buf.t(), data_t, (sinv_t_buf.t() if transpose else None), db


# ----------------------------------------------------------------------------------------------------------------
# Plain-PyTorch references (the math of kernels.activation's references, then cast_1x128_reference)
# ----------------------------------------------------------------------------------------------------------------
def _pad(y2: torch.Tensor, pad_rows: bool) -> torch.Tensor:
    m = y2.shape[0]
    return torch.nn.functional.pad(y2, (0, 0, 0, _rows_out(m, pad_rows) - m))


def act_fwd_1x128_reference(x, kind, fp8_dtype, *, power_2_scale=True, transpose=False, pad_rows=False):
    """Plain-PyTorch :func:`act_fwd_1x128` (same outputs and layouts)."""
    act = _kind(kind, "act_fwd_1x128_reference")
    y = as_2d(_act_fwd_math(x, act))
    return cast_1x128_reference(_pad(y, pad_rows), fp8_dtype, power_2_scale=power_2_scale, transpose=transpose)


def act_bwd_1x128_reference(dy, x, kind, fp8_dtype, *, power_2_scale=True, transpose=True, pad_rows=False,
                            dbias=True):
    """Plain-PyTorch :func:`act_bwd_1x128` (same outputs and layouts; dbias summed in another fp32 order)."""
    act = _kind(kind, "act_bwd_1x128_reference")
    dx = as_2d(_act_bwd_math(dy, x, act))
    out = cast_1x128_reference(_pad(dx, pad_rows), fp8_dtype, power_2_scale=power_2_scale, transpose=transpose)
    return (*out, dx.sum(0).to(dy.dtype) if dbias else None)
