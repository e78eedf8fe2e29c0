"""FP8 cast kernels: cast, cast-transpose, cast-transpose + bias gradient, amax.

Direction of the scale: ``data = saturate(x.float() * scale).to(fp8_dtype)`` -- multiply by ``scale`` to go into
the FP8 range; the returned ``scale_inv = 1 / scale`` (a NEW [1] fp32 tensor written by the same kernel as the bits)
dequantizes: ``x ~= data.float() * scale_inv``. saturate clamps to +-448 (E4M3) / +-57344 (E5M2); NaN stays NaN;
rounding is nearest-even, bit-identical to torch (see ``_common``).

Inputs: bf16 / fp16 / fp32, contiguous, any leading shape; viewed as [M, N] with N the last dim.
``scale``: 1-element fp32 tensor on the input's device. ``amax_out``: optional 1-element fp32 tensor (e.g. the view
``history[row, 0:1]``) that receives ``atomic_max(amax_out, max(|x|))`` -- a larger existing value is kept; a NaN in
x counts as +inf.

Layers: ``@triton.jit`` kernels -> launchers ``cast_to_fp8`` / ``cast_transpose_dbias`` / ``compute_amax`` (checks,
2-D view, grid) and the plain-PyTorch ``*_reference`` functions with the same signatures and outputs.
"""

from __future__ import annotations

import torch

from ._common import (
    CVT_EMULATE,
    _abs_max,
    _abs_max_flat,
    _quantize,
    _round_to,
    _scale_from_amax,
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
    scale_from_amax_reference,
    scale_inv_reference,
    sum_partials,
    tl,
    triton,
)

__all__ = [
    "cast_to_fp8",
    "cast_to_fp8_reference",
    "cast_transpose_dbias",
    "cast_transpose_dbias_reference",
    "compute_amax",
    "compute_amax_reference",
    "dequantize_fp8",
    "dequantize_fp8_reference",
    "transpose_fp8",
    "transpose_fp8_reference",
]

#: Elements per program of the flat cast / amax kernel. 8192 is the block of the ANCHORS.md measurement
#: (bf16 -> e4m3, 32768 x 4096, 3.62 TB/s on H200); num_warps left at Triton's default.
CAST_BLOCK = 8192
#: Tile of the cast-transpose kernels (rows x cols). Chosen by tools/cast_transpose_tiles.py@d6af129 on H200 (Triton
#: 3.6, bf16 -> e4m3, 32768x4096, 8192x16384, 8192x4096; tiles 32..128 x 64..256, 4 or 8 warps): 64 x 128 with 4 warps
#: was fastest at every shape (3.0-3.6 TB/s with the hardware conversion, vs 2.3-2.6 for 64 x 64).
TILE_M = 64
TILE_N = 128
TILE_WARPS = 4


def _hw_cvt_ok(m: int, n: int, dtype: torch.dtype) -> bool:
    """Whether the tiled kernel may use Triton's FP8 conversion for an ``[m, n]`` input of ``dtype``: 16-bit
    inputs on full tiles, the case tools/cast_transpose_tiles.py@d6af129 verified bit-exact on H200 (both copies, all
    tile shapes swept). fp32 inputs (wrong bytes there with every tile shape) and partial tiles take the inline-PTX
    conversion (see fp8_cvt_mode)."""
    return dtype in (torch.bfloat16, torch.float16) and m % TILE_M == 0 and n % TILE_N == 0


@triton.jit
def _cast_kernel(
    x_ptr,  # [n] input, high precision, contiguous
    out_ptr,  # [n] FP8 bits as uint8 (unused if not WRITE_OUT)
    scale_ptr,  # [1] fp32 scale, or the amax to derive it from if SCALE_FROM_AMAX (unused if not WRITE_OUT)
    scale_inv_ptr,  # [1] fp32, receives 1 / scale (program 0)
    amax_ptr,  # [1] fp32, receives atomic_max of max|x| (only if HAS_AMAX)
    n,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr = False,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_AMAX:
        tl.atomic_max(amax_ptr, _abs_max_flat(x, mask))  # NaN counts as +inf
    if WRITE_OUT:
        scale = tl.load(scale_ptr).to(tl.float32)  # (an amax may be in x's dtype)
        if SCALE_FROM_AMAX:
            scale = _scale_from_amax(scale, FP8_MAX)
        tl.store(out_ptr + offs, _quantize(x, scale, FP8_MAX, IS_E4M3, CVT), mask=mask)
        if pid == 0:
            _write_scale_inv(scale, scale_inv_ptr)


@triton.jit
def _cast_transpose_kernel(
    x_ptr,  # [M, N] input, high precision, row-major
    out_ptr,  # [M, N] FP8 bits (uint8)
    out_t_ptr,  # [N, M] FP8 bits (uint8) of the transpose
    scale_ptr,  # [1] fp32 scale, or the amax to derive it from if SCALE_FROM_AMAX
    scale_inv_ptr,  # [1] fp32, receives 1 / scale (program (0, 0))
    amax_ptr,  # [1] fp32, atomic_max of max|x| (only if HAS_AMAX)
    dbias_part_ptr,  # [cdiv(M, BLOCK_M), N] fp32 column sums of each row tile (only if HAS_DBIAS)
    M,
    N,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float32)  # (an amax may be in x's dtype)
    if SCALE_FROM_AMAX:
        scale = _scale_from_amax(scale, FP8_MAX)
    _store_tile(x, offs_m, offs_n, M, N, N, out_ptr, out_t_ptr, scale, FP8_MAX, IS_E4M3, CVT, True, True)
    if HAS_AMAX:
        tl.atomic_max(amax_ptr, _abs_max(x, mask))
    if HAS_DBIAS:
        tl.store(dbias_part_ptr + pid_m.to(tl.int64) * N + offs_n, tl.sum(x, axis=0), mask=offs_n < N)
    if (pid_m == 0) & (pid_n == 0):
        _write_scale_inv(scale, scale_inv_ptr)


#: Tile of the FP8 byte transpose: 64 x 128 bytes per program, the cast-transpose tile (4 warps).
BYTE_TILE_M = 64
BYTE_TILE_N = 128


@triton.jit
def _transpose_bytes_kernel(
    x_ptr,  # [M, N] uint8 (FP8 bits), row-major
    out_ptr,  # [N, M] uint8, row-major: the transpose
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, cols = offs_m.to(tl.int64), offs_n.to(tl.int64)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tile = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0)
    mask_t = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tl.store(out_ptr + cols[:, None] * M + rows[None, :], tl.trans(tile), mask=mask_t)


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """``[M, N]`` FP8 (any leading dims flattened into M) -> its ``[N, M]`` transpose, contiguous, same dtype.

    A tiled byte copy (1 B read + 1 B written per element): the transposed layout dgrad/wgrad need, for FP8 data
    written by a kernel that produced only the row-major copy (norm, activation). torch's strided
    ``.t().contiguous()`` of a uint8 tensor runs several times slower on H200.

    Raises:
        TypeError: ``data`` is not FP8. ValueError: non-contiguous, or not launchable on its device.
    """
    check_launchable(data, "transpose_fp8")
    if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"transpose_fp8: data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
    if not data.is_contiguous():
        raise ValueError("transpose_fp8: data must be contiguous; call .contiguous() first")
    x2 = as_2d(data)
    m, n = x2.shape
    out = torch.empty((n, m), dtype=data.dtype, device=data.device)
    grid = (max(1, cdiv(m, BYTE_TILE_M)), max(1, cdiv(n, BYTE_TILE_N)))
    launch(_transpose_bytes_kernel, grid, x2.view(torch.uint8), out.view(torch.uint8), m, n, BLOCK_M=BYTE_TILE_M,
           BLOCK_N=BYTE_TILE_N, num_warps=4)
    return out


def transpose_fp8_reference(data: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch :func:`transpose_fp8`."""
    return data.reshape(-1, data.shape[-1]).t().contiguous()


def _check_cast_args(x, scale, fp8_dtype, amax_out, op, scale_from_amax=False):
    check_launchable(x, op)
    check_hp(x, "x", op)
    # with scale_from_amax, an amax of x may be in x's dtype (exact: a value of x)
    check_scalar_f32(scale, "scale", x.device, op, also=x.dtype if scale_from_amax else None)
    check_scalar_f32(amax_out, "amax_out", x.device, op)
    return fp8_format(fp8_dtype, op)


def _launch_cast_transpose(x2, scale, fp8_dtype, amax_out, fp8_max, is_e4m3, dbias_dtype, data, op,
                           scale_from_amax=False):
    m, n = x2.shape
    data_t = torch.empty((n, m), dtype=fp8_dtype, device=x2.device)
    scale_inv = new_scale_inv(x2.device)
    grid_m, grid_n = max(1, cdiv(m, TILE_M)), max(1, cdiv(n, TILE_N))
    parts = torch.empty((grid_m, n), dtype=torch.float32, device=x2.device) if dbias_dtype is not None else None
    launch(_cast_transpose_kernel, (grid_m, grid_n),
        x2, data.view(torch.uint8), data_t.view(torch.uint8), scale, scale_inv,
        amax_out if amax_out is not None else scale_inv, parts if parts is not None else scale_inv, m, n,
        FP8_MAX=fp8_max, IS_E4M3=is_e4m3, CVT=fp8_cvt_mode(tiled_transpose=not _hw_cvt_ok(m, n, x2.dtype)),
        HAS_AMAX=amax_out is not None, HAS_DBIAS=parts is not None, BLOCK_M=TILE_M, BLOCK_N=TILE_N, num_warps=TILE_WARPS,
        SCALE_FROM_AMAX=scale_from_amax,
    )  # fmt: skip
    # m = 0: one program summed no rows (a slice per call only then: it costs a few host us)
    dbias = sum_partials(parts if m else parts[:0], dbias_dtype) if parts is not None else None
    return data_t, scale_inv, dbias


def cast_to_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_out: torch.Tensor | None = None,
    *,
    transpose: bool = False,
    scale_from_amax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Cast ``x`` to FP8 in one pass, optionally also writing the transposed copy and updating an amax.

    Args:
        x: bf16/fp16/fp32, contiguous, shape [..., N] (treated as [M, N]).
        scale: [1] or [] fp32 on x's device; ``data = saturate(x * scale)`` (with ``scale_from_amax`` it may also
            be in x's dtype: an amax of x is a value of x, exact in its dtype, and saves the conversion op).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        amax_out: optional [1] fp32; receives ``max(amax_out, max|x|)`` (atomic; NaN in x -> +inf).
        transpose: also write ``data_t`` = the [N, M] transpose (tiled cast-transpose kernel).
        scale_from_amax: ``scale`` holds an amax (current scaling, e.g. from :func:`compute_amax`); the kernel
            derives the scale from it on the device: ``fp8_max / amax`` (IEEE reciprocal times fp8_max), 1.0 where
            the amax is 0 or not finite (:func:`scale_from_amax_reference`). Saves the launches of computing the
            scale with torch ops between the amax pass and the cast.

    Returns:
        ``(data, data_t, scale_inv)``: data has x's shape and dtype fp8_dtype; data_t is [N, M] or None;
        scale_inv is a new [1] fp32 tensor holding 1/scale.

    Raises:
        ValueError for a non-contiguous x, a CPU tensor without TRITON_INTERPRET=1, or a device mismatch;
        TypeError for unsupported dtypes or a scale/amax_out that is not a 1-element fp32 tensor (an amax in x's
        dtype allowed with ``scale_from_amax``).
    """
    fp8_max, is_e4m3 = _check_cast_args(x, scale, fp8_dtype, amax_out, "cast_to_fp8", scale_from_amax)
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    if transpose:
        data_t, scale_inv, _ = _launch_cast_transpose(
            as_2d(x), scale, fp8_dtype, amax_out, fp8_max, is_e4m3, None, data, "cast_to_fp8", scale_from_amax
        )
        return data, data_t, scale_inv
    scale_inv = new_scale_inv(x.device)
    n = x.numel()
    launch(_cast_kernel, (max(1, cdiv(n, CAST_BLOCK)),),
        x, data.view(torch.uint8), scale, scale_inv, amax_out if amax_out is not None else scale_inv, n,
        FP8_MAX=fp8_max, IS_E4M3=is_e4m3, CVT=fp8_cvt_mode(), WRITE_OUT=True,
        HAS_AMAX=amax_out is not None, BLOCK=CAST_BLOCK, SCALE_FROM_AMAX=scale_from_amax,
    )  # fmt: skip
    return data, None, scale_inv


def cast_transpose_dbias(
    grad: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_out: torch.Tensor | None = None,
    *,
    scale_from_amax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast-transpose a gradient to FP8 and fuse the bias gradient (column sums).

    Args: as ``cast_to_fp8`` (grad is [..., N]; ``scale_from_amax`` too).
    Returns:
        ``(data, data_t, scale_inv, dbias)``: data like grad in fp8_dtype, data_t [N, M], scale_inv new [1] fp32,
        dbias [N] in grad.dtype = column sums of grad accumulated in fp32 (per 64-row tile, then a second
        deterministic pass over the tiles; no float atomics).
    """
    fp8_max, is_e4m3 = _check_cast_args(grad, scale, fp8_dtype, amax_out, "cast_transpose_dbias",
                                         scale_from_amax)
    data = torch.empty(grad.shape, dtype=fp8_dtype, device=grad.device)
    data_t, scale_inv, dbias = _launch_cast_transpose(
        as_2d(grad), scale, fp8_dtype, amax_out, fp8_max, is_e4m3, grad.dtype, data, "cast_transpose_dbias",
        scale_from_amax,
    )
    return data, data_t, scale_inv, dbias


def compute_amax(x: torch.Tensor, amax_out: torch.Tensor) -> None:
    """One pass ``amax_out = max(amax_out, max|x|)`` (atomic; NaN in x counts as +inf). Returns None."""
    check_launchable(x, "compute_amax")
    check_hp(x, "x", "compute_amax")
    if amax_out is None:
        raise ValueError("compute_amax: amax_out is required (a 1-element fp32 tensor)")
    check_scalar_f32(amax_out, "amax_out", x.device, "compute_amax")
    n = x.numel()
    launch(_cast_kernel, (max(1, cdiv(n, CAST_BLOCK)),),
        x, amax_out, amax_out, amax_out, amax_out, n, FP8_MAX=448.0, IS_E4M3=True, CVT=CVT_EMULATE,
        WRITE_OUT=False, HAS_AMAX=True, BLOCK=CAST_BLOCK,
    )  # fmt: skip


@triton.jit
def _dequantize_kernel(q_ptr, scale_inv_ptr, out_ptr, n, IS_E4M3: tl.constexpr, MANT: tl.constexpr,
                       BIAS: tl.constexpr, SUBNORMAL: tl.constexpr, CVT: tl.constexpr, BLOCK: tl.constexpr):
    """``out = q * scale_inv``: ``q`` FP8 bits (uint8) decoded exactly to fp32 with integer ops (``MANT`` mantissa
    bits, exponent bias ``BIAS``, ``SUBNORMAL`` = 2^(1 - BIAS - MANT)); the product in fp32, rounded to nearest even
    into out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    exp_max = (1 << (7 - MANT)) - 1
    e = (b >> MANT) & exp_max
    m = b & ((1 << MANT) - 1)
    bits = ((e + (127 - BIAS)) << 23) | (m << (23 - MANT))  # a normal number's fp32 bits
    if IS_E4M3:  # E4M3FN: no infinities; S.1111.111 is NaN
        bits = tl.where((e == exp_max) & (m == 7), 0x7FC00000, bits)
    else:  # E5M2: S.11111.00 is inf, S.11111.xx NaN
        bits = tl.where(e == exp_max, tl.where(m == 0, 0x7F800000, 0x7FC00000), bits)
    v = tl.where(e == 0, m.to(tl.float32) * SUBNORMAL, bits.to(tl.float32, bitcast=True))
    v = tl.where((b & 0x80) != 0, -v, v)
    out = v * tl.load(scale_inv_ptr)
    tl.store(out_ptr + offs, _round_to(out, out_ptr.dtype.element_ty, CVT), mask=mask)


def dequantize_fp8(data: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = data.float() * scale_inv`` rounded once into ``out``'s dtype, in one pass (read 1 byte, write 2 or 4
    per element: torch has no vectorised FP8 conversion and promotes no FP8 operand, so its version takes two
    slower passes).

    Args:
        data: contiguous FP8 tensor (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``), any shape.
        scale_inv: ``[1]`` fp32 on data's device.
        out: contiguous bf16 / fp16 / fp32 tensor with ``data.numel()`` elements, written in place and returned.
    Raises:
        ValueError / TypeError as the cast kernels (non-contiguous tensors, CPU without TRITON_INTERPRET=1, dtypes).
    """
    _, is_e4m3 = fp8_format(data.dtype, "dequantize_fp8")
    check_launchable(data, "dequantize_fp8")
    check_hp(out, "out", "dequantize_fp8")
    check_scalar_f32(scale_inv, "scale_inv", data.device, "dequantize_fp8")
    if not (data.is_contiguous() and out.is_contiguous()) or out.numel() != data.numel():
        raise ValueError(f"dequantize_fp8: data and out must be contiguous with as many elements; got "
                         f"{tuple(data.shape)} and {tuple(out.shape)}")
    n = data.numel()
    mant, bias = (3, 7) if is_e4m3 else (2, 15)
    launch(_dequantize_kernel, (max(1, cdiv(n, CAST_BLOCK)),), data.view(torch.uint8), scale_inv, out, n,
           IS_E4M3=is_e4m3, MANT=mant, BIAS=bias, SUBNORMAL=2.0 ** (1 - bias - mant), CVT=fp8_cvt_mode(),
           BLOCK=CAST_BLOCK)
    return out


def dequantize_fp8_reference(data: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch ``dequantize_fp8``."""
    return out.copy_((data.float() * scale_inv.float().reshape(())).view(out.shape))


# ----------------------------------------------------------------------------------------------------------------
# References (plain PyTorch, no Triton)
# ----------------------------------------------------------------------------------------------------------------
def cast_to_fp8_reference(x, scale, fp8_dtype, amax_out=None, *, transpose=False, scale_from_amax=False):
    """Plain-PyTorch ``cast_to_fp8``: same outputs, same in-place amax update."""
    fp8_max, _ = fp8_format(fp8_dtype, "cast_to_fp8_reference")
    if scale_from_amax:
        scale = scale_from_amax_reference(scale, fp8_max)
    data = quantize_reference(x, scale, fp8_dtype)
    atomic_max_reference(amax_out, amax_reference(x))
    data_t = as_2d(data.view(torch.uint8)).t().contiguous().view(fp8_dtype) if transpose else None
    return data, data_t, scale_inv_reference(scale)


def cast_transpose_dbias_reference(grad, scale, fp8_dtype, amax_out=None, *, scale_from_amax=False):
    """Plain-PyTorch ``cast_transpose_dbias``."""
    data, data_t, scale_inv = cast_to_fp8_reference(grad, scale, fp8_dtype, amax_out, transpose=True,
                                                    scale_from_amax=scale_from_amax)
    dbias = as_2d(grad).float().sum(0).to(grad.dtype)
    return data, data_t, scale_inv, dbias


def compute_amax_reference(x, amax_out):
    """Plain-PyTorch ``compute_amax``."""
    atomic_max_reference(amax_out, amax_reference(x))
