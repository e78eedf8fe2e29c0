"""Activations (GELU-tanh, ReLU, SwiGLU) forward with an optional fused FP8 output, and backward fused with the
FP8 cast-transpose of the gradient and the bias gradient.

Formulas (fp32 math):
    gelu(x)   = 0.5 x (1 + tanh(k (x + c x^3))) = x * sigmoid(2 k (x + c x^3)),  k = sqrt(2/pi), c = 0.044715
                (torch.nn.functional.gelu(approximate="tanh"));  gelu'(x) = s + 2 x s (1 - s) k (1 + 3 c x^2),
                s = sigmoid(2 k (x + c x^3)). The sigmoid form avoids the cancellation in 1 + tanh(u) for x << 0:
                torch's fp32 F.gelu has an absolute error ~6e-8 there (100 % relative for x < -5), which shows up
                in FP8 with large scales; kernel and reference here use the sigmoid form (tests compare both to a
                float64 F.gelu).
    relu(x)   = x if not x < 0 else 0 (NaN and -0 pass, as torch.relu);  relu'(x) = [x > 0]
    swiglu(x) = silu(g) * u for x = [g | u] of shape [M, 2N] (g = x[:, :N] is the gate), output [M, N];
                dg = dy u sig(g) (1 + g (1 - sig(g))),  du = dy silu(g);  dx = [dg | du] of shape [M, 2N]

Forward ``*_fwd(x, *, scale=None, fp8_dtype=None, amax_out=None, return_hp=False)`` returns
``(y_hp in x.dtype or None, y_fp8 or None, scale_inv or None)``; y_fp8 = saturate(y_fp32 * scale) (multiply by scale
to enter the FP8 range), scale_inv a new [1] fp32 = 1/scale, amax_out gets atomic max of |y_fp32| (NaN -> +inf).
Without scale, return_hp must be True, and amax_out gets the max of |y| as written in x's dtype: current scaling
takes its amax there instead of in a separate read of y (the cast then scales exactly the values it reads).

Backward ``*_bwd_cast_transpose(dy, x, scale, fp8_dtype, amax_out=None)`` returns
``(dx, dx_t, scale_inv, dbias)``: with a scale, dx is FP8 (x's shape), dx_t its [NC, M] FP8 transpose (NC = N, or 2N
for SwiGLU), scale_inv new [1] fp32, amax_out updated with max|dx_fp32|; with ``scale=None`` (high-precision variant)
dx is in dy.dtype and dx_t, scale_inv are None, and amax_out gets max|dx| as written in dy.dtype. dbias [NC] = column sums of the fp32 dx, cast to dy.dtype
(deterministic two-stage reduction). dy and x must have the same dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._common import (
    _abs_max,
    _abs_max_flat,
    _quantize,
    _store_tile,
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
    launch,
    new_scale_inv,
    quantize_reference,
    scale_inv_reference,
    sum_partials,
    tl,
    triton,
)

__all__ = [
    "gelu_fwd",
    "relu_fwd",
    "swiglu_fwd",
    "gelu_bwd_cast_transpose",
    "relu_bwd_cast_transpose",
    "swiglu_bwd_cast_transpose",
    "gelu_fwd_reference",
    "relu_fwd_reference",
    "swiglu_fwd_reference",
    "gelu_bwd_cast_transpose_reference",
    "relu_bwd_cast_transpose_reference",
    "swiglu_bwd_cast_transpose_reference",
]

_GELU, _RELU, _SWIGLU = 0, 1, 2
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715
#: Forward of GELU / ReLU: a flat elementwise kernel, FWD_BLOCK elements per program (the cast kernel's block,
#: cast.CAST_BLOCK). SwiGLU reads two halves of a row, so it runs on FWD_BLOCK_M x FWD_BLOCK_N output tiles.
FWD_BLOCK = 8192
FWD_BLOCK_M = 16
FWD_BLOCK_N = 256
#: Backward tile: the cast-transpose tile of cast.py (64 x 64, 4 warps).
BWD_BLOCK_M = 64
BWD_BLOCK_N = 64


@triton.jit
def _sigmoid(x):
    """1 / (1 + exp(-x)) with the fast division (``tl.fdiv``, not IEEE-rounded: an ulp or two in fp32, inside
    the tests' tolerance for transcendental math) instead of tl.sigmoid's IEEE division, a longer instruction
    sequence. Its share of the kernels' time was not measured apart."""
    return tl.fdiv(1.0, 1.0 + tl.exp(-x))


@triton.jit
def _gelu_tanh(x):
    return x * _sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))


@triton.jit
def _act_fwd_tile(x_ptr, r, c, mask, N, ACT: tl.constexpr):
    """The activation of the inputs at rows ``r`` (int64) and columns ``c`` of x, fp32; ``r`` / ``c`` broadcast to
    the tile's shape, ``[:, None]`` / ``[None, :]`` for the row-major tile or the other way round for its
    transpose (same values, element for element)."""
    if ACT == 2:
        g = tl.load(x_ptr + r * (2 * N) + c, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + r * (2 * N) + N + c, mask=mask, other=0.0).to(tl.float32)
        y = g * _sigmoid(g) * u
    else:
        x = tl.load(x_ptr + r * N + c, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            y = _gelu_tanh(x)
        else:
            y = tl.where(x < 0.0, 0.0, x)
    return y


@triton.jit
def _act_bwd_tile(dy_ptr, x_ptr, r, c, mask, N, ACT: tl.constexpr):
    """``(dx, du)`` at rows ``r``, columns ``c`` (as :func:`_act_fwd_tile`), fp32: GELU / ReLU ``dx`` (``du`` =
    ``dx``, unused), SwiGLU the gate and up gradients."""
    dy = tl.load(dy_ptr + r * N + c, mask=mask, other=0.0).to(tl.float32)
    if ACT == 2:
        g = tl.load(x_ptr + r * (2 * N) + c, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + r * (2 * N) + N + c, mask=mask, other=0.0).to(tl.float32)
        sig = _sigmoid(g)
        dx = dy * u * sig * (1.0 + g * (1.0 - sig))
        du = dy * g * sig
    else:
        x = tl.load(x_ptr + r * N + c, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            s = _sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))
            dx = dy * (s + 2.0 * x * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x))
        else:
            dx = tl.where(x > 0.0, dy, 0.0)
        du = dx
    return dx, du


@triton.jit
def _act_fwd_flat_kernel(
    x_ptr,  # [n] input, high precision, contiguous
    y_ptr,  # [n] high-precision output in x's dtype; only if WRITE_HP
    y8_ptr,  # [n] FP8 bits (uint8); only if WRITE_FP8
    scale_ptr,  # [1] fp32 FP8 scale; only if WRITE_FP8
    scale_inv_ptr,  # [1] fp32, receives 1/scale; only if WRITE_FP8
    amax_ptr,  # [1] fp32, atomic max of |y|; only if HAS_AMAX
    n,
    ACT: tl.constexpr,  # _GELU or _RELU
    WRITE_HP: tl.constexpr,
    WRITE_FP8: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        y = _gelu_tanh(x)
    else:
        y = tl.where(x < 0.0, 0.0, x)
    if WRITE_HP:
        yh = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, yh, mask=mask)
        if HAS_AMAX:
            if not WRITE_FP8:  # the amax of the values written (what a cast of them scales by)
                tl.atomic_max(amax_ptr, _abs_max_flat(yh.to(tl.float32), mask))
    if WRITE_FP8:
        scale = tl.load(scale_ptr)
        tl.store(y8_ptr + offs, _quantize(y, scale, FP8_MAX, IS_E4M3, CVT), mask=mask)
        if HAS_AMAX:
            tl.atomic_max(amax_ptr, _abs_max_flat(y, mask))  # NaN counts as +inf
        if pid == 0:
            _write_scale_inv(scale, scale_inv_ptr)


@triton.jit
def _swiglu_fwd_kernel(
    x_ptr,  # [M, 2N] input = [gate | up], row-major, high precision
    y_ptr,  # [M, N] high-precision output in x's dtype; only if WRITE_HP
    y8_ptr,  # [M, N] FP8 bits (uint8); only if WRITE_FP8
    scale_ptr,  # [1] fp32 FP8 scale; only if WRITE_FP8
    scale_inv_ptr,  # [1] fp32, receives 1/scale; only if WRITE_FP8
    amax_ptr,  # [1] fp32, atomic max of |y|; only if HAS_AMAX
    M,
    N,
    WRITE_HP: tl.constexpr,
    WRITE_FP8: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    rows = offs_m[:, None].to(tl.int64)
    y = _act_fwd_tile(x_ptr, rows, offs_n[None, :], mask, N, 2)
    if WRITE_HP:
        yh = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows * N + offs_n[None, :], yh, mask=mask)
        if HAS_AMAX:
            if not WRITE_FP8:  # the amax of the values written (what a cast of them scales by)
                tl.atomic_max(amax_ptr, _abs_max(yh.to(tl.float32), mask))
    if WRITE_FP8:
        scale = tl.load(scale_ptr)
        tl.store(y8_ptr + rows * N + offs_n[None, :], _quantize(y, scale, FP8_MAX, IS_E4M3, CVT), mask=mask)
        if HAS_AMAX:
            tl.atomic_max(amax_ptr, _abs_max(y, mask))
        if (pid_m == 0) & (pid_n == 0):
            _write_scale_inv(scale, scale_inv_ptr)


@triton.jit
def _act_bwd_kernel(
    dy_ptr,  # [M, N] gradient of the activation output, row-major
    x_ptr,  # [M, NC] forward input (pre-activation; [gate | up] for SwiGLU), NC = N or 2N
    dx_ptr,  # [M, NC] output: FP8 bits (uint8) if IS_FP8, else dy's dtype
    dx_t_ptr,  # [NC, M] FP8 bits (uint8) of dx transposed; only if IS_FP8
    scale_ptr,  # [1] fp32 FP8 scale; only if IS_FP8
    scale_inv_ptr,  # [1] fp32, receives 1/scale; only if IS_FP8
    amax_ptr,  # [1] fp32, atomic max of |dx|; only if HAS_AMAX
    dbias_part_ptr,  # [cdiv(M, BLOCK_M), NC] fp32 column sums of dx per row tile
    M,
    N,
    ACT: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    dx, du = _act_bwd_tile(dy_ptr, x_ptr, offs_m[:, None].to(tl.int64), offs_n[None, :], mask, N, ACT)
    scale = 1.0
    if IS_FP8:
        scale = tl.load(scale_ptr)
    if ACT == 2:  # SwiGLU: dx = [dg | du] (dx holds the gate's gradient), row length 2N
        part = dbias_part_ptr + pid_m.to(tl.int64) * (2 * N)
        _store_tile(dx, offs_m, offs_n, M, 2 * N, N, dx_ptr, dx_t_ptr, scale, FP8_MAX, IS_E4M3, CVT,
                    IS_FP8, IS_FP8)  # fmt: skip
        _store_tile(du, offs_m, offs_n + N, M, 2 * N, 2 * N, dx_ptr, dx_t_ptr, scale, FP8_MAX, IS_E4M3, CVT,
                    IS_FP8, IS_FP8)  # fmt: skip
        tl.store(part + offs_n, tl.sum(dx, axis=0), mask=offs_n < N)
        tl.store(part + N + offs_n, tl.sum(du, axis=0), mask=offs_n < N)
        if HAS_AMAX:
            if IS_FP8:
                tl.atomic_max(amax_ptr, tl.maximum(_abs_max(dx, mask), _abs_max(du, mask)))
            else:  # the amax of the values written in dx's dtype (what a cast of them scales by)
                dg_w = dx.to(dx_ptr.dtype.element_ty).to(tl.float32)
                du_w = du.to(dx_ptr.dtype.element_ty).to(tl.float32)
                tl.atomic_max(amax_ptr, tl.maximum(_abs_max(dg_w, mask), _abs_max(du_w, mask)))
    else:
        part = dbias_part_ptr + pid_m.to(tl.int64) * N
        _store_tile(dx, offs_m, offs_n, M, N, N, dx_ptr, dx_t_ptr, scale, FP8_MAX, IS_E4M3, CVT,
                    IS_FP8, IS_FP8)  # fmt: skip
        tl.store(part + offs_n, tl.sum(dx, axis=0), mask=offs_n < N)
        if HAS_AMAX:
            if IS_FP8:
                tl.atomic_max(amax_ptr, _abs_max(dx, mask))
            else:  # the amax of the values written in dx's dtype (what a cast of them scales by)
                tl.atomic_max(amax_ptr, _abs_max(dx.to(dx_ptr.dtype.element_ty).to(tl.float32), mask))
    if IS_FP8:
        if (pid_m == 0) & (pid_n == 0):
            _write_scale_inv(scale, scale_inv_ptr)


def _check_fp8_args(x, scale, fp8_dtype, amax_out, op, scale_required):
    if scale_required and (scale is None) != (fp8_dtype is None):
        raise ValueError(f"{op}: give both scale and fp8_dtype for an FP8 output, or neither")
    check_scalar_f32(scale, "scale", x.device, op)
    check_scalar_f32(amax_out, "amax_out", x.device, op)
    return fp8_format(fp8_dtype, op) if scale is not None else (448.0, True)


def _act_fwd(x, act, scale, fp8_dtype, amax_out, return_hp, op):
    check_launchable(x, op)
    check_hp(x, "x", op)
    fp8_max, is_e4m3 = _check_fp8_args(x, scale, fp8_dtype, amax_out, op, True)
    write_fp8 = scale is not None
    if not write_fp8 and not return_hp:
        raise ValueError(f"{op}: without scale/fp8_dtype pass return_hp=True, or there is no output")
    nc = x.shape[-1]
    if act == _SWIGLU and nc % 2:
        raise ValueError(f"{op}: SwiGLU needs an even last dim ([gate | up]), got {nc}")
    n = nc // 2 if act == _SWIGLU else nc
    out_shape = (*x.shape[:-1], n)
    y = torch.empty(out_shape, dtype=x.dtype, device=x.device) if return_hp else None
    y8 = torch.empty(out_shape, dtype=fp8_dtype, device=x.device) if write_fp8 else None
    scale_inv = new_scale_inv(x.device) if write_fp8 else None
    dummy = scale_inv if write_fp8 else y
    ptrs = (x, y if y is not None else dummy, y8.view(torch.uint8) if y8 is not None else dummy,
            scale if write_fp8 else dummy, scale_inv if write_fp8 else dummy,
            amax_out if amax_out is not None else dummy)
    flags = dict(WRITE_HP=return_hp, WRITE_FP8=write_fp8, HAS_AMAX=amax_out is not None, FP8_MAX=fp8_max,
                 IS_E4M3=is_e4m3, CVT=fp8_cvt_mode())
    if act == _SWIGLU:
        m = as_2d(x).shape[0]
        grid = (max(1, cdiv(m, FWD_BLOCK_M)), max(1, cdiv(n, FWD_BLOCK_N)))
        launch(_swiglu_fwd_kernel, grid, *ptrs, m, n, BLOCK_M=FWD_BLOCK_M, BLOCK_N=FWD_BLOCK_N, **flags)
    else:
        numel = x.numel()
        launch(_act_fwd_flat_kernel, (max(1, cdiv(numel, FWD_BLOCK)),), *ptrs, numel, ACT=act,
               BLOCK=FWD_BLOCK, **flags)
    return y, y8, scale_inv


def _act_bwd(dy, x, act, scale, fp8_dtype, amax_out, op):
    check_launchable(x, op)
    check_hp(x, "x", op)
    check_hp(dy, "dy", op)
    if dy.dtype != x.dtype:
        raise TypeError(f"{op}: dy ({dy.dtype}) and x ({x.dtype}) must have the same dtype")
    nc = x.shape[-1]
    n = nc // 2 if act == _SWIGLU else nc
    if (act == _SWIGLU and nc % 2) or tuple(dy.shape) != (*x.shape[:-1], n):
        want = "x [..., 2N] and dy [..., N]" if act == _SWIGLU else "dy and x of the same shape"
        raise ValueError(f"{op}: need {want}; got dy {tuple(dy.shape)}, x {tuple(x.shape)}")
    if scale is not None and fp8_dtype is None:
        raise ValueError(f"{op}: scale given without fp8_dtype")
    fp8_max, is_e4m3 = _check_fp8_args(x, scale, fp8_dtype, amax_out, op, False)
    is_fp8 = scale is not None
    m = as_2d(x).shape[0]
    dx = torch.empty(x.shape, dtype=fp8_dtype if is_fp8 else dy.dtype, device=x.device)
    dx_t = torch.empty((nc, m), dtype=fp8_dtype, device=x.device) if is_fp8 else None
    scale_inv = new_scale_inv(x.device) if is_fp8 else None
    grid_m = max(1, cdiv(m, BWD_BLOCK_M))
    parts = torch.empty((grid_m, nc), dtype=torch.float32, device=x.device)
    grid = (grid_m, max(1, cdiv(n, BWD_BLOCK_N)))
    launch(_act_bwd_kernel, grid,
        dy, x, dx.view(torch.uint8) if is_fp8 else dx, dx_t.view(torch.uint8) if is_fp8 else dx,
        scale if is_fp8 else parts, scale_inv if is_fp8 else parts, amax_out if amax_out is not None else parts,
        parts, m, n,
        ACT=act, IS_FP8=is_fp8, HAS_AMAX=amax_out is not None, FP8_MAX=fp8_max, IS_E4M3=is_e4m3,
        CVT=fp8_cvt_mode(tiled_transpose=True), BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, num_warps=4,
    )  # fmt: skip
    dbias = sum_partials(parts if m else parts[:0], dy.dtype)  # m = 0: one program, no rows summed
    return dx, dx_t, scale_inv, dbias


def gelu_fwd(x, *, scale=None, fp8_dtype=None, amax_out=None, return_hp=False):
    """GELU (tanh approximation). See the module docstring for arguments and returns."""
    return _act_fwd(x, _GELU, scale, fp8_dtype, amax_out, return_hp, "gelu_fwd")


def relu_fwd(x, *, scale=None, fp8_dtype=None, amax_out=None, return_hp=False):
    """ReLU. See the module docstring for arguments and returns."""
    return _act_fwd(x, _RELU, scale, fp8_dtype, amax_out, return_hp, "relu_fwd")


def swiglu_fwd(x, *, scale=None, fp8_dtype=None, amax_out=None, return_hp=False):
    """SwiGLU on x [..., 2N] = [gate | up] -> [..., N]. See the module docstring."""
    return _act_fwd(x, _SWIGLU, scale, fp8_dtype, amax_out, return_hp, "swiglu_fwd")


def gelu_bwd_cast_transpose(dy, x, scale, fp8_dtype, amax_out=None):
    """dx = dy * gelu'(x), cast-transposed to FP8 with dbias (or high precision when scale is None)."""
    return _act_bwd(dy, x, _GELU, scale, fp8_dtype, amax_out, "gelu_bwd_cast_transpose")


def relu_bwd_cast_transpose(dy, x, scale, fp8_dtype, amax_out=None):
    """dx = dy * [x > 0], cast-transposed to FP8 with dbias (or high precision when scale is None)."""
    return _act_bwd(dy, x, _RELU, scale, fp8_dtype, amax_out, "relu_bwd_cast_transpose")


def swiglu_bwd_cast_transpose(dy, x, scale, fp8_dtype, amax_out=None):
    """dx [..., 2N] = [dgate | dup] for SwiGLU, cast-transposed to FP8 ([2N, M]) with dbias [2N]."""
    return _act_bwd(dy, x, _SWIGLU, scale, fp8_dtype, amax_out, "swiglu_bwd_cast_transpose")


# ----------------------------------------------------------------------------------------------------------------
# References (plain PyTorch, fp32 math, no Triton)
# ----------------------------------------------------------------------------------------------------------------
def _act_fwd_math(x, act):
    xf = x.float()
    if act == _GELU:  # = F.gelu(xf, approximate="tanh") without its 1 + tanh cancellation for x << 0
        return xf * torch.sigmoid(2.0 * _K * (xf + _C * xf**3))
    if act == _RELU:
        return torch.relu(xf)
    n = x.shape[-1] // 2
    return F.silu(xf[..., :n]) * xf[..., n:]


def _act_bwd_math(dy, x, act):
    dyf, xf = dy.float(), x.float()
    if act == _GELU:
        sg = torch.sigmoid(2.0 * _K * (xf + _C * xf**3))  # 0.5 (1 + tanh(u)) = sigmoid(2u)
        return dyf * (sg + 2.0 * xf * sg * (1.0 - sg) * _K * (1.0 + 3.0 * _C * xf * xf))
    if act == _RELU:
        return torch.where(xf > 0, dyf, torch.zeros_like(dyf))
    n = x.shape[-1] // 2
    g, u = xf[..., :n], xf[..., n:]
    sig = torch.sigmoid(g)
    return torch.cat([dyf * u * sig * (1.0 + g * (1.0 - sig)), dyf * g * sig], dim=-1)


def _act_fwd_reference(x, act, scale, fp8_dtype, amax_out, return_hp):
    y = _act_fwd_math(x, act)
    y8 = scale_inv = None
    if scale is not None:
        y8 = quantize_reference(y, scale, fp8_dtype)
        scale_inv = scale_inv_reference(scale)
        atomic_max_reference(amax_out, amax_reference(y))
    elif return_hp:
        atomic_max_reference(amax_out, amax_reference(y.to(x.dtype)))
    return (y.to(x.dtype) if return_hp else None), y8, scale_inv


def _act_bwd_reference(dy, x, act, scale, fp8_dtype, amax_out):
    dx = _act_bwd_math(dy, x, act)
    dbias = as_2d(dx).sum(0).to(dy.dtype)
    if scale is None:
        atomic_max_reference(amax_out, amax_reference(dx.to(dy.dtype)))
        return dx.to(dy.dtype), None, None, dbias
    dx8 = quantize_reference(dx, scale, fp8_dtype)
    dx8_t = as_2d(dx8.view(torch.uint8)).t().contiguous().view(fp8_dtype)
    atomic_max_reference(amax_out, amax_reference(dx))
    return dx8, dx8_t, scale_inv_reference(scale), dbias


def gelu_fwd_reference(x, *, scale=None, fp8_dtype=None, amax_out=None, return_hp=False):
    """Plain-PyTorch ``gelu_fwd``."""
    return _act_fwd_reference(x, _GELU, scale, fp8_dtype, amax_out, return_hp)


def relu_fwd_reference(x, *, scale=None, fp8_dtype=None, amax_out=None, return_hp=False):
    """Plain-PyTorch ``relu_fwd``."""
    return _act_fwd_reference(x, _RELU, scale, fp8_dtype, amax_out, return_hp)


def swiglu_fwd_reference(x, *, scale=None, fp8_dtype=None, amax_out=None, return_hp=False):
    """Plain-PyTorch ``swiglu_fwd``."""
    return _act_fwd_reference(x, _SWIGLU, scale, fp8_dtype, amax_out, return_hp)


def gelu_bwd_cast_transpose_reference(dy, x, scale, fp8_dtype, amax_out=None):
    """Plain-PyTorch ``gelu_bwd_cast_transpose``."""
    return _act_bwd_reference(dy, x, _GELU, scale, fp8_dtype, amax_out)


def relu_bwd_cast_transpose_reference(dy, x, scale, fp8_dtype, amax_out=None):
    """Plain-PyTorch ``relu_bwd_cast_transpose``."""
    return _act_bwd_reference(dy, x, _RELU, scale, fp8_dtype, amax_out)


def swiglu_bwd_cast_transpose_reference(dy, x, scale, fp8_dtype, amax_out=None):
    """Plain-PyTorch ``swiglu_bwd_cast_transpose``."""
    return _act_bwd_reference(dy, x, _SWIGLU, scale, fp8_dtype, amax_out)
