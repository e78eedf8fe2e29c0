"""LayerNorm and RMSNorm over the last dim, forward with an optional fused FP8 output, and backward.

Forward: ``y = (x - mean) * rstd * gamma + beta`` (LayerNorm) or ``y = x * rstd * gamma`` (RMSNorm) with
``rstd = 1 / sqrt(var + eps)`` (var = mean of (x - mean)^2, or mean of x^2 for RMSNorm) and gamma = weight, or
``1 + weight`` with ``zero_centered_gamma``. All math in fp32. When ``scale`` and ``fp8_dtype`` are given the kernel
also writes ``y_fp8 = saturate(y_fp32 * scale).to(fp8_dtype)`` (from the fp32 y, not the rounded y_hp), a new
``scale_inv = 1/scale`` and, if ``amax_out`` is given, ``atomic_max(amax_out, max|y_fp32|)`` (NaN counts as +inf).
Without an FP8 output, ``amax_out`` gets ``max|y_hp|`` of the values written in x.dtype (current scaling takes its
amax there, then casts those values: no separate read of y).

Residual connection (optional, TransformerLayer's pre-norm blocks): forward with ``residual`` normalises
``x + residual`` (rounded to x.dtype as torch's add, written to ``residual_out``); backward with ``dresidual`` adds
that gradient (the one reaching the sum through the residual path) to dx in fp32 before the one rounding.

Backward (xhat = (x - mean) * rstd, wdy = dy * gamma):
    LayerNorm: dx = rstd * (wdy - mean(xhat * wdy) * xhat - mean(wdy)),  RMSNorm: dx = rstd * (wdy - mean(xhat*wdy)*xhat)
    dgamma = sum_rows(dy * xhat), dbeta = sum_rows(dy)   (d/dweight is the same with zero_centered_gamma)
dgamma / dbeta are reduced in two deterministic stages (per-program partial sums in fp32 side by side in one buffer,
then one fixed-order sum over it).

Structure after the Triton tutorial 05-layer-norm (one program per group of rows, the whole row in registers;
two-stage dgamma/dbeta), rewritten: several rows per program for narrow rows, a strided row loop in backward
instead of locks, FP8 epilogue.

Shapes: x [..., N] contiguous (bf16/fp16/fp32) viewed as [M, N]; weight/bias [N]; mean/rstd [M] fp32.
N up to ``MAX_N`` = 32768 (the row lives in registers); larger N raises ValueError.
"""

from __future__ import annotations

import functools

import torch

from ._common import (
    _abs_max,
    _quantize,
    _round_to,
    _write_scale_inv,
    amax_reference,
    as_2d,
    atomic_max_reference,
    cdiv,
    check_hp,
    check_launchable,
    check_scalar_f32,
    fp8_cvt_mode,
    fp8_format,
    interpreting,
    launch,
    new_scale_inv,
    next_power_of_2,
    quantize_reference,
    scale_inv_reference,
    sum_partials,
    tl,
    triton,
)

__all__ = [
    "layernorm_fwd",
    "layernorm_fwd_reference",
    "layernorm_bwd",
    "layernorm_bwd_reference",
    "rmsnorm_fwd",
    "rmsnorm_fwd_reference",
    "rmsnorm_bwd",
    "rmsnorm_bwd_reference",
]

#: Widest row supported: the tutorial's 64 KB-per-row limit for 16-bit inputs.
MAX_N = 32768
#: Elements of one program's [BLOCK_M, BLOCK_N] tile: rows per program = max(1, NORM_TILE // BLOCK_N), so narrow
#: rows are batched (N = 1024 -> 4 rows) and rows >= 4096 get one program each. tools/norm_kernel_tiles.py@d6af129 on
#: H200 (8192 x 4096 bf16, FP8 output): 1 row per program at 4 / 8 / 16 warps 55 / 57 / 62 us, 2 rows 59-71, 4 rows 84.
NORM_TILE = 4096
#: Programs of the backward pass = min(row tiles, NORM_BWD_WAVES * SM count): each program loops over row tiles
#: and owns one row of the dgamma partial buffer. tools/norm_kernel_tiles.py@d6af129 on H200, 8192 x 4096 bf16:
#: 1 / 2 / 4 / 8 waves took 110 / 79 / 90 / 113 us.
NORM_BWD_WAVES = 2
#: Under TRITON_INTERPRET the per-program overhead dominates; cap the backward programs instead.
INTERPRET_BWD_PROGRAMS = 8


@functools.lru_cache(maxsize=None)
def _tile(n: int) -> tuple[int, int, int]:
    block_n = next_power_of_2(max(n, 1))
    block_m = max(1, min(64, NORM_TILE // block_n))
    num_warps = min(16, max(4, block_n // 1024))  # wider rows, more warps; N = 4096: 4 (NORM_TILE's tool)
    return block_m, block_n, num_warps


@triton.jit
def _normalize_rows(x_ptr, r_ptr, s_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rows, cols, rmask, cmask, offs, N, eps,
                    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    ZERO_CENTERED: tl.constexpr, CVT: tl.constexpr):
    """The forward normalisation of a tile of whole rows (``rows`` x ``cols``, ``offs`` their int64 offsets into the
    row-major ``[M, N]`` tensors; pointers as :func:`_norm_fwd_kernel`'s): loads x (+ the residual, rounded to x's
    dtype as torch's add, and stored to ``s_ptr``), stores mean (LayerNorm) and rstd, returns fp32 ``y`` (masked-off
    lanes: not zeroed). Shared by the per-tensor and the block-scaled norm kernels (``block_norm``), so both compute
    the same fp32 values."""
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = _round_to(x.to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32), x.dtype,
                      CVT)
        tl.store(s_ptr + offs, x, mask=mask)
    x = x.to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(mean_ptr + rows, mean, mask=rmask)
    var = tl.sum(xc * xc, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _norm_fwd_kernel(
    x_ptr,  # [M, N] input, row-major, high precision
    r_ptr,  # [M, N] residual in x's dtype; only if HAS_RESIDUAL
    s_ptr,  # [M, N] output x + residual in x's dtype (the normalised tensor); only if HAS_RESIDUAL
    w_ptr,  # [N] weight (gamma, or gamma - 1 if ZERO_CENTERED)
    b_ptr,  # [N] bias (beta); only if HAS_BIAS
    y_ptr,  # [M, N] high-precision output in x's dtype; only if WRITE_HP
    y8_ptr,  # [M, N] FP8 bits (uint8); only if WRITE_FP8
    scale_ptr,  # [1] fp32 FP8 scale; only if WRITE_FP8
    scale_inv_ptr,  # [1] fp32, receives 1/scale; only if WRITE_FP8
    amax_ptr,  # [1] fp32, atomic max of |y|; only if HAS_AMAX
    mean_ptr,  # [M] fp32 row means (LayerNorm only)
    rstd_ptr,  # [M] fp32 row 1/sqrt(var + eps)
    M,
    N,
    eps,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    WRITE_HP: tl.constexpr,
    WRITE_FP8: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    y = _normalize_rows(x_ptr, r_ptr, s_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, rows, cols, rmask, cmask, offs, N, eps,
                        IS_RMS, HAS_BIAS, HAS_RESIDUAL, ZERO_CENTERED, CVT)
    if WRITE_HP:
        yh = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, yh, mask=mask)
        if HAS_AMAX:
            if not WRITE_FP8:  # the amax of the values written (what a cast of them scales by)
                tl.atomic_max(amax_ptr, _abs_max(yh.to(tl.float32), mask))
    if WRITE_FP8:
        scale = tl.load(scale_ptr)
        tl.store(y8_ptr + offs, _quantize(y, scale, FP8_MAX, IS_E4M3, CVT), mask=mask)
        if HAS_AMAX:
            tl.atomic_max(amax_ptr, _abs_max(y, mask))
        if pid == 0:
            _write_scale_inv(scale, scale_inv_ptr)


@triton.jit
def _norm_bwd_kernel(
    dy_ptr,  # [M, N] upstream gradient, row-major
    x_ptr,  # [M, N] forward input
    w_ptr,  # [N] weight (gamma, or gamma - 1 if ZERO_CENTERED)
    mean_ptr,  # [M] fp32 row means from forward (LayerNorm only)
    rstd_ptr,  # [M] fp32 row rstd from forward
    dres_ptr,  # [M, N] gradient arriving at x from elsewhere (the residual branch), added to dx; only if HAS_DRES
    dx_ptr,  # [M, N] output gradient in x's dtype
    part_ptr,  # [num_programs, PART_N] fp32 partial sums, one row per program: dgamma in columns [0, N), dbeta in
    # [N, 2N) (LayerNorm only; PART_N = 2N, else N), so one reduction launch covers both
    M,
    N,
    PART_N,
    IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    HAS_DRES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_M
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, step):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :]
        c1 = tl.sum(xhat * wdy, axis=1) / N
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) / N
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_DRES:
            dx += tl.load(dres_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        if not IS_RMS:
            db_acc += dy
    tl.store(part_ptr + pid * PART_N + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    if not IS_RMS:
        tl.store(part_ptr + pid * PART_N + N + cols, tl.sum(db_acc, axis=0), mask=cmask)


def _check_vec(v, name, n, x, op):
    if v is None:
        return
    check_hp(v, name, op)
    if tuple(v.shape) != (n,):
        raise ValueError(f"{op}: {name} has shape {tuple(v.shape)}, expected ({n},) to match x's last dim")
    if v.device != x.device:
        raise ValueError(f"{op}: {name} is on {v.device} but x is on {x.device}")


def _check_like_x(t, name, x, op):
    check_hp(t, name, op)
    if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"{op}: {name} must match x (shape {tuple(x.shape)}, {x.dtype}, {x.device}); got "
                         f"{tuple(t.shape)}, {t.dtype}, {t.device}")


def _norm_fwd(x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, return_hp, is_rms, op,
              residual=None, residual_out=None):  # fmt: skip
    check_launchable(x, op)
    check_hp(x, "x", op)
    if (residual is None) != (residual_out is None):
        raise ValueError(f"{op}: give both residual and residual_out (receives x + residual), or neither")
    if residual is not None:
        _check_like_x(residual, "residual", x, op)
        _check_like_x(residual_out, "residual_out", x, op)
    n = x.shape[-1]
    if n > MAX_N:
        raise ValueError(f"{op}: last dim {n} > {MAX_N} is not supported by the fused kernel; use {op}_reference")
    _check_vec(weight, "weight", n, x, op)
    _check_vec(bias, "bias", n, x, op)
    if (scale is None) != (fp8_dtype is None):
        raise ValueError(f"{op}: give both scale and fp8_dtype for an FP8 output, or neither")
    write_fp8 = scale is not None
    if not write_fp8 and not return_hp:
        raise ValueError(f"{op}: return_hp=False without scale/fp8_dtype would produce no output")
    fp8_max, is_e4m3 = fp8_format(fp8_dtype, op) if write_fp8 else (448.0, True)
    check_scalar_f32(scale, "scale", x.device, op)
    check_scalar_f32(amax_out, "amax_out", x.device, op)

    x2 = as_2d(x)
    m = x2.shape[0]
    y = torch.empty_like(x) if return_hp else None
    y8 = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if write_fp8 else None
    scale_inv = new_scale_inv(x.device) if write_fp8 else None
    mean = None if is_rms else torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    block_m, block_n, num_warps = _tile(n)
    dummy = rstd
    launch(_norm_fwd_kernel, (max(1, cdiv(m, block_m)),),
        x2, residual if residual is not None else dummy, residual_out if residual_out is not None else dummy,
        weight, bias if bias is not None else dummy, y if y is not None else dummy,
        y8.view(torch.uint8) if y8 is not None else dummy, scale if write_fp8 else dummy,
        scale_inv if write_fp8 else dummy, amax_out if amax_out is not None else dummy,
        mean if mean is not None else dummy, rstd, m, n, eps,
        IS_RMS=is_rms, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        ZERO_CENTERED=zero_centered_gamma, WRITE_HP=return_hp,
        WRITE_FP8=write_fp8, HAS_AMAX=amax_out is not None, FP8_MAX=fp8_max, IS_E4M3=is_e4m3,
        CVT=fp8_cvt_mode(), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return y, y8, scale_inv, mean, rstd


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (looked up once: ``get_device_properties`` costs host time)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _norm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma, is_rms, op, dresidual=None):
    check_launchable(x, op)
    check_hp(x, "x", op)
    check_hp(dy, "dy", op)
    if dresidual is not None:
        _check_like_x(dresidual, "dresidual", x, op)
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy has shape {tuple(dy.shape)} but x has {tuple(x.shape)}")
    n = x.shape[-1]
    if n > MAX_N:
        raise ValueError(f"{op}: last dim {n} > {MAX_N} is not supported by the fused kernel; use {op}_reference")
    _check_vec(weight, "weight", n, x, op)
    x2 = as_2d(x)
    m = x2.shape[0]
    for name, t in (("rstd", rstd), ("mean", mean)):
        if t is None and (name == "rstd" or not is_rms):
            raise ValueError(f"{op}: {name} from the forward pass is required")
        if t is not None and (t.dtype != torch.float32 or t.numel() != m or not t.is_contiguous()):
            raise TypeError(f"{op}: {name} must be a contiguous fp32 tensor of {m} elements (one per row)")
    block_m, block_n, num_warps = _tile(n)
    tiles = cdiv(m, block_m)
    if interpreting() or not x.is_cuda:
        programs = min(tiles, INTERPRET_BWD_PROGRAMS)
    else:
        programs = min(tiles, NORM_BWD_WAVES * _sm_count(x.device.index))
    programs = max(programs, 1)
    dx = torch.empty_like(x)
    part_n = n if is_rms else 2 * n
    part = torch.empty((programs, part_n), dtype=torch.float32, device=x.device)
    launch(_norm_bwd_kernel, (programs,),
        dy, x2, weight, mean if mean is not None else rstd, rstd, dresidual if dresidual is not None else dx, dx,
        part, m, n, part_n, IS_RMS=is_rms, ZERO_CENTERED=zero_centered_gamma, HAS_DRES=dresidual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    if m == 0:
        part.zero_()
    sums = sum_partials(part, weight.dtype)  # [dgamma | dbeta]
    if is_rms:
        return dx, sums, None
    dgamma, dbeta = sums.split_with_sizes((n, n))  # one dispatched op (two slices: two)
    return dx, dgamma, dbeta


def layernorm_fwd(x, weight, bias, eps, *, zero_centered_gamma=False, scale=None, fp8_dtype=None, amax_out=None,
                  return_hp=True, residual=None, residual_out=None):  # fmt: skip
    """LayerNorm forward over the last dim.

    Args:
        x: [..., N] bf16/fp16/fp32 contiguous. weight, bias: [N] (bias may be None). eps: float.
        zero_centered_gamma: use ``1 + weight`` as gamma.
        scale, fp8_dtype: both or neither; with them also write the FP8 output (multiply by scale to enter FP8).
        amax_out: optional [1] fp32, receives atomic max of |y| (fp32 y), or of the written y_hp without
            scale/fp8_dtype (then return_hp=True).
        return_hp: also return y in x.dtype.
        residual, residual_out: both or neither, like x (shape, dtype, contiguous): the residual connection fused
            in front of the norm. ``residual_out`` receives ``x + residual`` rounded to x.dtype (as torch's add)
            and the norm (mean, rstd, y) is of that sum; it is the ``x`` to pass to the backward.
    Returns:
        ``(y_hp or None, y_fp8 or None, scale_inv or None, mean [M] fp32, rstd [M] fp32)``; y_* have x's shape.
    """
    return _norm_fwd(x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, return_hp, False,
                     "layernorm_fwd", residual, residual_out)  # fmt: skip


def rmsnorm_fwd(x, weight, eps, *, zero_centered_gamma=False, scale=None, fp8_dtype=None, amax_out=None,
                return_hp=True, residual=None, residual_out=None):  # fmt: skip
    """RMSNorm forward over the last dim; as ``layernorm_fwd`` without bias and mean.

    Returns ``(y_hp or None, y_fp8 or None, scale_inv or None, rstd [M] fp32)``.
    """
    y, y8, si, _, rstd = _norm_fwd(x, weight, None, eps, zero_centered_gamma, scale, fp8_dtype, amax_out,
                                   return_hp, True, "rmsnorm_fwd", residual, residual_out)  # fmt: skip
    return y, y8, si, rstd


def layernorm_bwd(dy, x, mean, rstd, weight, *, zero_centered_gamma=False, dresidual=None):
    """LayerNorm backward. dy, x: [..., N]; mean, rstd: [M] fp32 from forward; weight [N].

    ``dresidual`` (optional, like x): a gradient reaching the norm's input ``x`` by another path (the residual
    connection), added to dx in fp32 before the one rounding to x.dtype.

    Returns ``(dx in x.dtype with x's shape, dgamma [N] in weight.dtype, dbeta [N] in weight.dtype)``; dgamma and
    dbeta are accumulated in fp32 and reduced deterministically.
    """
    return _norm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma, False, "layernorm_bwd", dresidual)


def rmsnorm_bwd(dy, x, rstd, weight, *, zero_centered_gamma=False, dresidual=None):
    """RMSNorm backward (``dresidual`` as in ``layernorm_bwd``). Returns ``(dx in x.dtype, dgamma [N] in
    weight.dtype)``."""
    dx, dgamma, _ = _norm_bwd(dy, x, None, rstd, weight, zero_centered_gamma, True, "rmsnorm_bwd", dresidual)
    return dx, dgamma


# ----------------------------------------------------------------------------------------------------------------
# References (plain PyTorch, fp32 math, no Triton)
# ----------------------------------------------------------------------------------------------------------------
def _norm_fwd_reference(x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, return_hp, is_rms,
                        residual=None, residual_out=None):  # fmt: skip
    if residual is not None:
        x = torch.add(x, residual, out=residual_out)
    x2 = as_2d(x).float()
    gamma = weight.float() + 1.0 if zero_centered_gamma else weight.float()
    if is_rms:
        mean, xc = None, x2
    else:
        mean = x2.mean(dim=1)
        xc = x2 - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * rstd[:, None] * gamma
    if bias is not None:
        y = y + bias.float()
    y = y.reshape(x.shape)
    y_hp = y.to(x.dtype) if return_hp else None
    y8 = scale_inv = None
    if scale is not None:
        y8 = quantize_reference(y, scale, fp8_dtype)
        scale_inv = scale_inv_reference(scale)
        atomic_max_reference(amax_out, amax_reference(y))
    elif y_hp is not None:
        atomic_max_reference(amax_out, amax_reference(y_hp))
    return y_hp, y8, scale_inv, mean, rstd


def layernorm_fwd_reference(x, weight, bias, eps, *, zero_centered_gamma=False, scale=None, fp8_dtype=None,
                            amax_out=None, return_hp=True, residual=None, residual_out=None):  # fmt: skip
    """Plain-PyTorch ``layernorm_fwd``."""
    return _norm_fwd_reference(x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, return_hp,
                               False, residual, residual_out)  # fmt: skip


def rmsnorm_fwd_reference(x, weight, eps, *, zero_centered_gamma=False, scale=None, fp8_dtype=None, amax_out=None,
                          return_hp=True, residual=None, residual_out=None):  # fmt: skip
    """Plain-PyTorch ``rmsnorm_fwd``."""
    y, y8, si, _, rstd = _norm_fwd_reference(x, weight, None, eps, zero_centered_gamma, scale, fp8_dtype, amax_out,
                                             return_hp, True, residual, residual_out)  # fmt: skip
    return y, y8, si, rstd


def _norm_bwd_reference(dy, x, mean, rstd, weight, zero_centered_gamma, is_rms, dresidual=None):
    x2, dy2 = as_2d(x).float(), as_2d(dy).float()
    gamma = weight.float() + 1.0 if zero_centered_gamma else weight.float()
    xhat = (x2 if is_rms else x2 - mean[:, None]) * rstd[:, None]
    wdy = dy2 * gamma
    c1 = (xhat * wdy).mean(dim=1, keepdim=True)
    if is_rms:
        dx = (wdy - xhat * c1) * rstd[:, None]
    else:
        dx = (wdy - (xhat * c1 + wdy.mean(dim=1, keepdim=True))) * rstd[:, None]
    if dresidual is not None:
        dx = dx + as_2d(dresidual).float()
    dgamma = (dy2 * xhat).sum(0).to(weight.dtype)
    dbeta = None if is_rms else dy2.sum(0).to(weight.dtype)
    return dx.to(x.dtype).reshape(x.shape), dgamma, dbeta


def layernorm_bwd_reference(dy, x, mean, rstd, weight, *, zero_centered_gamma=False, dresidual=None):
    """Plain-PyTorch ``layernorm_bwd``."""
    return _norm_bwd_reference(dy, x, mean, rstd, weight, zero_centered_gamma, False, dresidual)


def rmsnorm_bwd_reference(dy, x, rstd, weight, *, zero_centered_gamma=False, dresidual=None):
    """Plain-PyTorch ``rmsnorm_bwd``."""
    dx, dgamma, _ = _norm_bwd_reference(dy, x, None, rstd, weight, zero_centered_gamma, True, dresidual)
    return dx, dgamma
