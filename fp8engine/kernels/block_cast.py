"""Block-scaled FP8 casts: 1 x 128 tiles (activations, gradients) and 128 x 128 blocks (weights), scales computed
just in time from each tile's own amax (the ``Float8BlockScaling`` recipe; DeepSeek-V3, arXiv:2412.19437 §3.3).

Per tile / block (``BLOCK`` = 128):
    amax  = max |x| over the tile (a NaN counts as +inf; partial edge tiles reduce over the elements that exist)
    scale = fp8_max / amax, IEEE fp32 division, clamped to the largest finite fp32; 1 where amax is 0 or not finite
    scale = 2**floor(log2(scale)) if power_2_scale (exponent bits kept, mantissa cleared: exact)
    data  = saturate(x.float() * scale).to(fp8), nearest even;  scale_inv = 1 / scale (IEEE division)
Multiply by ``scale`` to go into the FP8 range; ``scale_inv`` dequantizes: ``x ~= data * scale_inv`` per tile.

Inputs ``x``: bf16 / fp16 / fp32, contiguous, any leading shape viewed as ``[M, K]`` (K the last dim). Outputs and
their layouts (the ones ``torch.nn.functional.scaled_mm``'s block-wise recipes take, see ``ops/block_gemm.py``):
  * ``cast_1x128``: ``data`` [M, K] (x's shape); ``scale_inv`` fp32 of logical shape ``[M, ceil(K/128)]``, stored
    M-major ("outer-dim-major"): a ``[ceil(K/128), M]`` contiguous buffer seen through ``.t()``, strides ``(1, M)``.
    With ``transpose=True`` also the RE-TILED transpose: ``data_t`` [K, M] whose 1 x 128 tiles run along M (scale
    per column of x per 128 rows, from the high-precision x; the tiles of ``data`` do not transpose), and
    ``scale_inv_t`` of logical shape ``[K, ceil(M/128)]``, strides ``(1, K)``.
  * ``cast_128x128``: ``data`` [M, K]; ``scale_inv`` ``[ceil(M/128), ceil(K/128)]`` fp32, row-major. 128 x 128
    blocks DO transpose: with ``transpose=True``, ``data_t`` [K, M] is the byte transpose and ``scale_inv_t`` =
    ``scale_inv.t()`` (contiguous).
Dims need not be multiples of 128 here (edge tiles are partial); the GEMMs require them (``ops/block_gemm.py``).

``cast_1x128_dbias`` (a gradient's cast) also returns the bias gradient ``dy.sum(0)`` from the same pass (per-tile
fp32 column sums, then a fixed-order sum over the tiles), in place of a separate reduction over the high-precision
gradient.

Layers: ``@triton.jit`` kernel ``_block_cast_kernel`` -> launchers ``cast_1x128`` / ``cast_1x128_dbias`` /
``cast_128x128`` (checks, grid) and the plain-PyTorch ``*_reference`` functions, same signatures, same bits (the
bias gradient: the same fp32 sums in another order).
"""

from __future__ import annotations

import torch

from ._common import (
    FP8_FORMATS,
    _masked_abs,
    _quantize,
    as_2d,
    cdiv,
    check_hp,
    check_launchable,
    fp8_cvt_mode,
    fp8_format,
    launch,
    sum_partials,
    tl,
    triton,
)

__all__ = ["BLOCK", "cast_1x128", "cast_1x128_reference", "cast_1x128_dbias", "cast_1x128_dbias_reference",
           "cast_128x128", "cast_128x128_reference", "block_scale_reference"]

#: Tile length of 1 x 128 tiles and side of 128 x 128 blocks (Float8BlockScaling.BLOCK_SIZE; the sm_90 block-wise
#: GEMM's granularity). Each program handles one 128 x 128 tile of x: its rows give 128 1 x 128 scales, its columns
#: (the tile re-read transposed) the re-tiled transposed scales, the whole tile one 128 x 128 scale.
BLOCK = 128
#: Warps per 128 x 128 tile program: 8 (256 threads, 64 fp32 values of the tile per thread): the fused norm and
#: activation kernels. The plain cast's launch picks from ``_CAST_WARPS``.
BLOCK_WARPS = 8
#: (mode, transpose) -> warps of the plain block cast. Timing probes on one H100 (torch 2.11, Triton 3.6, 2026-11-24
#: and -26; not kept in the repository), bf16 in, E4M3 out, 20 calls each (warps 4 / 8 / 16): 1 x 128 without the
#: transpose of (8192, 16384) 0.207 / 0.183 / 0.147 ms; with the tile re-read transposed for the transposed copy
#: (_store_1x128_t): 1 x 128 re-tiled of (8192, 12288) 0.317 / 0.272 / 0.287 ms, 128 x 128 of (16384, 4096) 0.198 /
#: 0.209 / 0.150 ms (0.173 ms at 16 warps transposing the register tile).
_CAST_WARPS = {(1, True): 8, (1, False): 16, (2, True): 16, (2, False): 16}
#: Largest finite fp32: the scale's clamp where fp8_max / amax overflows (amax a tiny subnormal).
_F32_MAX = 3.4028234663852886e38
_MODE_1X128, _MODE_128X128 = 1, 2


@triton.jit
def _block_scale(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """Scale(s) from amax(es), as in the module docstring (IEEE division, clamp, optional power of two)."""
    ok = (amax > 0.0) & (amax < float("inf"))
    s = tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, tl.where(ok, amax, 1.0))
    s = tl.minimum(s, 3.4028234663852886e38)  # _F32_MAX
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(ok, s, 1.0)


@triton.jit
def _store_1x128_rows(
    y,  # fp32 [BLOCK, BLOCK] tile of an [M, K] matrix: rows offs_m, columns offs_k (one 1 x 128 tile per row)
    a,  # |y| with NaN as +inf and masked-off lanes 0 (_masked_abs): what each tile's amax reduces
    offs_m,
    offs_k,
    kb,  # index of this tile column (offs_k // BLOCK)
    M,
    K,
    out_ptr,  # [M, K] FP8 bits (uint8), row-major
    sinv_ptr,  # [cdiv(K, 128), M] fp32: M-major storage of the [M, K/128] scale_inv
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    POW2: tl.constexpr,
):
    """Quantize the tile's rows with one scale each (its 1 x 128 tiles) and store the bits and scale inverses."""
    rows = offs_m.to(tl.int64)
    cols = offs_k.to(tl.int64)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    s_row = _block_scale(tl.max(a, axis=1), FP8_MAX, POW2)  # [BLOCK]: one scale per row of this tile
    b = _quantize(y, s_row[:, None], FP8_MAX, IS_E4M3, CVT)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], b, mask=mask)
    sinv_row = tl.math.div_rn(tl.zeros_like(s_row) + 1.0, s_row)
    tl.store(sinv_ptr + kb.to(tl.int64) * M + rows, sinv_row, mask=offs_m < M)  # column kb, M-major


@triton.jit
def _store_1x128_t(
    y,  # fp32 [BLOCK, BLOCK] tile of y [M, K]: as loaded, y^T (rows offs_k, columns offs_m) if TRANSPOSED, else y
    a,  # |y| as in _store_1x128_rows
    offs_m,
    offs_k,
    mb,  # index of the tile row of y (offs_m // BLOCK)
    M,
    K,
    out_t_ptr,  # [K, M] FP8 bits (uint8) of the re-tiled transpose, row-major
    sinv_t_ptr,  # [cdiv(M, 128), K] fp32: K-major storage of the [K, M/128] scale_inv_t
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    POW2: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """Re-tile: one scale per column of y over its 128 rows (a 1 x 128 tile of y^T along M); store y^T's bits and
    scales. TRANSPOSED: the caller loaded (or computed) the tile transposed -- from global memory, where it is an L2
    hit after the row-major pass --, one scale per row of it. Else the row-major register tile: a column reduction,
    and the quantized tile transposed through shared memory. A timing probe on the H100 (Triton 3.6, E4M3,
    2026-11-26; not kept in the repository): the 1 x 128 + transpose cast of bf16 (8192, 12288) took 0.272 ms
    transposed-loaded against 0.345 ms from the register tile (same bytes); the activation backward keeps the
    register tile (two inputs to re-read: 0.91 against 0.74 ms at (8192, 16384) GELU)."""
    rows = offs_m.to(tl.int64)
    cols = offs_k.to(tl.int64)
    if TRANSPOSED:
        s_col = _block_scale(tl.max(a, axis=1), FP8_MAX, POW2)
        bt = _quantize(y, s_col[:, None], FP8_MAX, IS_E4M3, CVT)
    else:
        s_col = _block_scale(tl.max(a, axis=0), FP8_MAX, POW2)
        bt = tl.trans(_quantize(y, s_col[None, :], FP8_MAX, IS_E4M3, CVT))
    mask_t = (offs_k[:, None] < K) & (offs_m[None, :] < M)
    tl.store(out_t_ptr + cols[:, None] * M + rows[None, :], bt, mask=mask_t)
    tl.store(sinv_t_ptr + mb.to(tl.int64) * K + cols, tl.math.div_rn(tl.zeros_like(s_col) + 1.0, s_col),
             mask=offs_k < K)


@triton.jit
def _store_tile_1x128(y, offs_m, offs_n, pid_m, kb, M, M_OUT, NC, out_ptr, sinv_ptr, out_t_ptr, sinv_t_ptr,
                      FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, CVT: tl.constexpr, POW2: tl.constexpr,
                      WRITE_T: tl.constexpr):
    """Zero the padding rows (>= M) of the fp32 tile ``y`` (rows offs_m, columns offs_n of an [M_OUT, NC] matrix,
    tile column ``kb``) and store it 1 x 128-tiled; with WRITE_T also its re-tiled transpose from this register
    tile (:func:`_store_1x128_t` untransposed: the activation backward and the QKV-gradient gather, where
    recomputing the tile transposed costs more)."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < NC)
    y = tl.where(mask, y, 0.0)
    a = _masked_abs(y, mask)
    _store_1x128_rows(y, a, offs_m, offs_n, kb, M_OUT, NC, out_ptr, sinv_ptr, FP8_MAX, IS_E4M3, CVT, POW2)
    if WRITE_T:
        _store_1x128_t(y, a, offs_m, offs_n, pid_m, M_OUT, NC, out_t_ptr, sinv_t_ptr, FP8_MAX, IS_E4M3, CVT, POW2,
                       False)


@triton.jit
def _block_cast_kernel(
    x_ptr,  # [M, K] input, high precision, row-major
    out_ptr,  # [M, K] FP8 bits (uint8)
    sinv_ptr,  # MODE 1: [cdiv(K,128), M] fp32 (M-major storage of the [M, K/128] scale_inv);
    #            MODE 2: [cdiv(M,128), cdiv(K,128)] fp32 row-major
    out_t_ptr,  # [K, M] FP8 bits (uint8) of the (re-tiled in MODE 1) transpose; only if WRITE_T
    sinv_t_ptr,  # MODE 1 and WRITE_T: [cdiv(M,128), K] fp32 (K-major storage of the [K, M/128] scale_inv_t)
    dbias_part_ptr,  # MODE 1 and HAS_DBIAS: [cdiv(M,128), K] fp32 column sums of each 128-row tile of x
    M,
    K,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    POW2: tl.constexpr,
    MODE: tl.constexpr,  # 1: 1 x 128 tiles along K; 2: 128 x 128 blocks
    WRITE_T: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DBIAS: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
    rows = offs_m.to(tl.int64)
    cols = offs_k.to(tl.int64)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = _masked_abs(x, mask)
    if MODE == 1:
        _store_1x128_rows(x, a, offs_m, offs_k, pid_k, M, K, out_ptr, sinv_ptr, FP8_MAX, IS_E4M3, CVT, POW2)
        if HAS_DBIAS:  # the bias gradient's first stage (masked lanes loaded as 0)
            tl.store(dbias_part_ptr + pid_m.to(tl.int64) * K + cols, tl.sum(x, axis=0), mask=offs_k < K)
        if WRITE_T:  # the same tile read again, transposed (see _store_1x128_t)
            mask_t = (offs_k[:, None] < K) & (offs_m[None, :] < M)
            xt = tl.load(x_ptr + rows[None, :] * K + cols[:, None], mask=mask_t, other=0.0).to(tl.float32)
            _store_1x128_t(xt, _masked_abs(xt, mask_t), offs_m, offs_k, pid_m, M, K, out_t_ptr, sinv_t_ptr, FP8_MAX,
                           IS_E4M3, CVT, POW2, True)
    else:
        s = _block_scale(tl.max(tl.max(a, axis=1), axis=0), FP8_MAX, POW2)
        b = _quantize(x, s, FP8_MAX, IS_E4M3, CVT)
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], b, mask=mask)
        if WRITE_T:  # the same tile re-read transposed and quantized with the block's scale (see _store_1x128_t)
            mask_t = (offs_k[:, None] < K) & (offs_m[None, :] < M)
            xt = tl.load(x_ptr + rows[None, :] * K + cols[:, None], mask=mask_t, other=0.0).to(tl.float32)
            tl.store(out_t_ptr + cols[:, None] * M + rows[None, :], _quantize(xt, s, FP8_MAX, IS_E4M3, CVT),
                     mask=mask_t)
        tl.store(sinv_ptr + pid_m.to(tl.int64) * tl.cdiv(K, BLOCK) + pid_k, tl.math.div_rn(1.0, s))


def _check(x: torch.Tensor, fp8_dtype: torch.dtype, op: str) -> tuple[float, bool]:
    check_launchable(x, op)
    check_hp(x, "x", op)
    return fp8_format(fp8_dtype, op)


def _launch(x: torch.Tensor, fp8_dtype: torch.dtype, power_2_scale: bool, transpose: bool, mode: int, op: str,
            dbias: bool = False):
    fp8_max, is_e4m3 = _check(x, fp8_dtype, op)
    x2 = as_2d(x)
    m, k = x2.shape
    mb, kb = cdiv(m, BLOCK), cdiv(k, BLOCK)
    dev = x.device
    data = torch.empty(x.shape, dtype=fp8_dtype, device=dev)
    if mode == _MODE_1X128:
        sinv_buf = torch.empty((kb, m), dtype=torch.float32, device=dev)
    else:
        sinv_buf = torch.empty((mb, kb), dtype=torch.float32, device=dev)
    data_t = torch.empty((k, m), dtype=fp8_dtype, device=dev) if transpose else None
    sinv_t_buf = torch.empty((mb, k), dtype=torch.float32, device=dev) if transpose and mode == _MODE_1X128 else None
    parts = torch.empty((mb, k), dtype=torch.float32, device=dev) if dbias else None
    if m and k:
        u8 = data.view(torch.uint8)
        launch(_block_cast_kernel, (mb, kb),
            x2, u8, sinv_buf, data_t.view(torch.uint8) if transpose else u8,
            sinv_t_buf if sinv_t_buf is not None else sinv_buf, parts if dbias else sinv_buf, m, k,
            FP8_MAX=fp8_max, IS_E4M3=is_e4m3, CVT=fp8_cvt_mode(tiled_transpose=True), POW2=bool(power_2_scale),
            MODE=mode, WRITE_T=transpose, BLOCK=BLOCK, HAS_DBIAS=dbias,
            num_warps=_CAST_WARPS[mode, bool(transpose)])
    if mode == _MODE_1X128:
        out = (data, sinv_buf.t(), data_t, (sinv_t_buf.t() if transpose else None))
        if dbias:  # m = 0: no tile summed; zeros
            out += (sum_partials(parts, x.dtype) if m else torch.zeros(k, dtype=x.dtype, device=dev),)
        return out
    return data, sinv_buf, data_t, (sinv_buf.t().contiguous() if transpose else None)


def cast_1x128(x: torch.Tensor, fp8_dtype: torch.dtype, *, power_2_scale: bool = True, transpose: bool = False):
    """Cast ``x`` ([*, K] viewed as [M, K]) to FP8 with one scale per row per 128 columns (1 x 128 tiles).

    Returns:
        ``(data, scale_inv, data_t, scale_inv_t)``: ``data`` FP8 of x's shape; ``scale_inv`` fp32
        ``[M, ceil(K/128)]`` with strides ``(1, M)``; with ``transpose``: ``data_t`` ``[K, M]`` FP8 re-tiled along
        M and ``scale_inv_t`` fp32 ``[K, ceil(M/128)]`` with strides ``(1, K)``; else both None.
    Raises:
        TypeError: x not bf16/fp16/fp32, or fp8_dtype not an FP8 dtype. ValueError: x non-contiguous or 0-d, or
        not launchable on its device (use :func:`cast_1x128_reference`). RuntimeError: Triton missing.
    """
    return _launch(x, fp8_dtype, power_2_scale, transpose, _MODE_1X128, "cast_1x128")


def cast_1x128_dbias(x: torch.Tensor, fp8_dtype: torch.dtype, *, power_2_scale: bool = True,
                     transpose: bool = True):
    """:func:`cast_1x128` of a gradient ``dy`` ([*, N] viewed as [M, N]) that also returns its bias gradient, the
    column sums ``dy.sum(0)``, from the same pass: each program sums its 128 x 128 tile's columns in fp32 into a
    ``[ceil(M/128), N]`` buffer, reduced over the tiles by :func:`~fp8engine.kernels._common.sum_partials` (fixed
    order, no atomics: deterministic) and rounded once to x's dtype. Saves the separate ``dy.sum(0)`` pass over the
    high-precision gradient.

    Returns:
        ``(data, scale_inv, data_t, scale_inv_t, dbias)``: the four outputs of :func:`cast_1x128` and ``dbias [N]``
        in x's dtype (fp32 sums; they differ from ``dy.sum(0, dtype=torch.float32)`` only in summation order).
    Raises:
        as :func:`cast_1x128`.
    """
    return _launch(x, fp8_dtype, power_2_scale, transpose, _MODE_1X128, "cast_1x128_dbias", dbias=True)


def cast_128x128(x: torch.Tensor, fp8_dtype: torch.dtype, *, power_2_scale: bool = True, transpose: bool = False):
    """Cast ``x`` ([*, K] viewed as [M, K]; a weight [N, K]) to FP8 with one scale per 128 x 128 block.

    Returns:
        ``(data, scale_inv, data_t, scale_inv_t)``: ``data`` FP8 of x's shape; ``scale_inv`` fp32
        ``[ceil(M/128), ceil(K/128)]`` row-major; with ``transpose``: ``data_t`` ``[K, M]`` (the byte transpose)
        and ``scale_inv_t = scale_inv.t()`` contiguous; else both None.
    Raises:
        as :func:`cast_1x128`.
    """
    return _launch(x, fp8_dtype, power_2_scale, transpose, _MODE_128X128, "cast_128x128")


# ----------------------------------------------------------------------------------------------------------------
# Plain-PyTorch references
# ----------------------------------------------------------------------------------------------------------------
def block_scale_reference(amax: torch.Tensor, fp8_dtype: torch.dtype, power_2_scale: bool) -> torch.Tensor:
    """fp32 scales from fp32 amaxes (any shape), the kernels' rule (module docstring)."""
    fp8_max = FP8_FORMATS[fp8_dtype][0]
    amax = amax.float()
    ok = (amax > 0) & torch.isfinite(amax)
    s = torch.full_like(amax, fp8_max) / torch.where(ok, amax, torch.ones_like(amax))
    s = torch.clamp(s, max=_F32_MAX)
    if power_2_scale:
        s = (s.view(torch.int32) & 0x7F800000).view(torch.float32)
    return torch.where(ok, s, torch.ones_like(s))


def _tile_amax(x2: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[ceil(M/rows), ceil(K/cols)] amax of each rows x cols tile of x2 (zero padding, NaN as +inf)."""
    m, k = x2.shape
    mb, kb = -(-m // rows), -(-k // cols)
    a = x2.float().abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
    a = torch.nn.functional.pad(a, (0, kb * cols - k, 0, mb * rows - m))
    return a.reshape(mb, rows, kb, cols).amax(dim=(1, 3))


def _quantize_tiles(x2: torch.Tensor, scale: torch.Tensor, rows: int, cols: int, fp8_dtype) -> torch.Tensor:
    """saturate(x * scale of its tile).to(fp8); ``scale`` [ceil(M/rows), ceil(K/cols)]."""
    m, k = x2.shape
    fp8_max = FP8_FORMATS[fp8_dtype][0]
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:m, :k]
    return torch.clamp(x2.float() * full, -fp8_max, fp8_max).to(fp8_dtype)


def _reference(x: torch.Tensor, fp8_dtype, power_2_scale: bool, transpose: bool, rows: int):
    if fp8_dtype not in FP8_FORMATS:
        raise TypeError(f"fp8_dtype {fp8_dtype} not supported; use torch.float8_e4m3fn or torch.float8_e5m2")
    x2 = as_2d(x)
    m, k = x2.shape
    scale = block_scale_reference(_tile_amax(x2, rows, BLOCK), fp8_dtype, power_2_scale)
    data = _quantize_tiles(x2, scale, rows, BLOCK, fp8_dtype).reshape(x.shape)
    sinv = torch.reciprocal(scale)
    if not transpose:
        return data, (sinv.t().contiguous().t() if rows == 1 else sinv), None, None
    if rows == 1:
        xt = x2.t()
        scale_t = block_scale_reference(_tile_amax(xt, 1, BLOCK), fp8_dtype, power_2_scale)
        data_t = _quantize_tiles(xt, scale_t, 1, BLOCK, fp8_dtype).contiguous()
        return data, sinv.t().contiguous().t(), data_t, torch.reciprocal(scale_t).t().contiguous().t()
    return data, sinv, data.reshape(m, k).t().contiguous(), sinv.t().contiguous()


def cast_1x128_reference(x: torch.Tensor, fp8_dtype: torch.dtype, *, power_2_scale: bool = True,
                         transpose: bool = False):
    """Plain-PyTorch :func:`cast_1x128` (same outputs, bits and scale layouts)."""
    return _reference(x, fp8_dtype, power_2_scale, transpose, 1)


def cast_1x128_dbias_reference(x: torch.Tensor, fp8_dtype: torch.dtype, *, power_2_scale: bool = True,
                               transpose: bool = True):
    """Plain-PyTorch :func:`cast_1x128_dbias`: :func:`cast_1x128_reference` and ``x.sum(0)`` in fp32 rounded to x's
    dtype (another summation order than the kernel's)."""
    x2 = as_2d(x)
    return (*_reference(x, fp8_dtype, power_2_scale, transpose, 1), x2.sum(0, dtype=torch.float32).to(x.dtype))


def cast_128x128_reference(x: torch.Tensor, fp8_dtype: torch.dtype, *, power_2_scale: bool = True,
                           transpose: bool = False):
    """Plain-PyTorch :func:`cast_128x128` (same outputs, bits and scale layouts)."""
    return _reference(x, fp8_dtype, power_2_scale, transpose, BLOCK)
