"""FP8 gradient of the fused, grouped QKV projection output, written straight from the attention gradients.

Layout (``fp8engine.ops.qkv``, Megatron-LM / TransformerEngine interleaved QKV): the projection output ``mixed`` is ``[s, b, C]`` with
``C = g * (hpg + 2) * d``, viewed as ``[s, b, g, hpg + 2, d]``: for every KV group ``gi`` its ``hpg`` query heads,
then its key head, then its value head. The attention backward returns

    dq [s, b, g, hpg, d],   dk [s, b, g, d],   dv [s, b, g, d]      (bf16 / fp16 / fp32, one dtype, ANY strides)

and the gradient of ``mixed`` is, as a ``[T, C]`` matrix with ``T = s * b`` (row ``r`` = ``(r // b, r % b)``, the
row-major flattening of ``[s, b]``; column ``c`` = ``(gi, slot, dd)`` of ``[g, hpg + 2, d]``)

    grad[r, c] = dq[s, b, gi, slot, dd]   if slot <  hpg
               = dk[s, b, gi, dd]         if slot == hpg
               = dv[s, b, gi, dd]         if slot == hpg + 1

``qkv_grad_cast_transpose_dbias`` returns exactly what ``cast.cast_transpose_dbias(grad, scale, fp8_dtype,
amax_out)`` returns on that assembled buffer -- ``data = saturate(grad.float() * scale).to(fp8_dtype)`` [T, C],
``data_t`` its [C, T] transpose, a new ``scale_inv = 1 / scale`` [1] fp32, ``dbias`` [C] in dq.dtype (column sums in
fp32) -- but gathers dq/dk/dv in the tile loads instead of first copying them into the buffer. That saves the copy
pass and the [T, C] high-precision buffer: per element (bf16) the copy + cast-transpose moves 2 B read + 2 B written
+ 2 B read again + 2 B of FP8 written (data, data_t); the fused kernel moves 2 B read + 2 B written.

Scale direction: multiply by ``scale`` to go from the high-precision range into the FP8 range; ``scale_inv``
dequantizes (``grad ~= data.float() * scale_inv``). saturate clamps to +-448 (E4M3) / +-57344 (E5M2); NaN stays NaN;
rounding is nearest-even, bit-identical to torch (see ``_common``). ``amax_out`` (optional [1] fp32) receives
``atomic_max(amax_out, max|grad|)``; a NaN counts as +inf.

Bit-identity with ``cast_transpose_dbias``: same tile (``cast.TILE_M`` x ``cast.TILE_N``), same per-tile fp32
column sums into a ``[cdiv(T, TILE_M), C]`` partial buffer reduced by ``sum_partials``, and the hardware FP8
conversion under the same condition as ``cast._hw_cvt_ok`` (16-bit inputs on full tiles), the inline-PTX one
otherwise (``_common.fp8_cvt_mode``).
Tested bit-exact under TRITON_INTERPRET=1 (tests/kernels/test_qkv_grad_kernel.py). On a GPU two things are not yet
verified for this kernel: the in-tile fp32 summation order of ``tl.sum`` follows the register layout the compiler
picks, which the gathered loads may change (dbias could then differ from cast_transpose_dbias in its last bit), and
the hardware conversion path (cast.py verified it bit-exact only inside its own kernel).

Block scaling (``Float8BlockScaling``): ``qkv_grad_1x128`` gathers the same tiles (``_gather_qkv_grad``, shared by
both kernels) and writes them 1 x 128-tiled with the re-tiled transpose and the bias partials, as
``block_cast.cast_1x128_dbias`` does on the assembled buffer with its rows zero-padded to a multiple of 128: the same
bits and scales without the three copies into that buffer (tested bit-exact against the reference under
TRITON_INTERPRET=1 and on the GPU).

Layers: ``_qkv_grad_cast_transpose_kernel`` / ``_qkv_grad_1x128_kernel`` -> launchers
``qkv_grad_cast_transpose_dbias`` / ``qkv_grad_1x128`` (checks, grid); the plain-PyTorch ``*_reference`` functions
and ``assemble_qkv_grad`` (the [s, b, C] buffer, for the non-kernel path; a None gradient is zero there).
"""

from __future__ import annotations

import torch

from ._common import (
    HP_DTYPES,
    _abs_max,
    _round_to,
    _store_tile,
    _write_scale_inv,
    cdiv,
    check_launchable,
    check_scalar_f32,
    fp8_cvt_mode,
    fp8_format,
    launch,
    new_scale_inv,
    sum_partials,
    tl,
    triton,
)
from .block_cast import BLOCK, BLOCK_WARPS, _store_tile_1x128, cast_1x128_reference
from .cast import TILE_M, TILE_N, TILE_WARPS, _hw_cvt_ok, cast_transpose_dbias, cast_transpose_dbias_reference
from .rotary import check_rope_table

__all__ = [
    "assemble_qkv_grad",
    "qkv_grad_1x128",
    "qkv_grad_1x128_reference",
    "qkv_grad_cast_transpose_dbias",
    "qkv_grad_cast_transpose_dbias_reference",
]


@triton.jit
def _gather_qkv_grad(
    dq_ptr, dk_ptr, dv_ptr,  # as in _qkv_grad_cast_transpose_kernel
    offs_m,  # [BLOCK_M] rows of the [T, C] gradient (row r = (r // B, r % B))
    offs_n,  # [BLOCK_N] columns
    mask,  # [BLOCK_M, BLOCK_N] the in-range elements (others load as 0)
    B,
    sq_s, sq_b, sq_g, sq_h, sq_d, sk_s, sk_b, sk_g, sk_d, sv_s, sv_b, sv_g, sv_d,
    cos_ptr, sin_ptr,
    HPG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CVT: tl.constexpr,
    R: tl.constexpr,
):  # fmt: skip
    """The ``[BLOCK_M, BLOCK_N]`` tile of the assembled gradient (module docstring), gathered from dq, dk, dv (with
    the rotation's gradient where ``R`` > 0), in dq's dtype; masked-off elements 0."""
    # row -> (s_idx, b_idx); column -> (gi, slot, dd) of [g, HPG + 2, HEAD_DIM]; offsets in int64
    s_idx = (offs_m // B).to(tl.int64)
    b_idx = (offs_m % B).to(tl.int64)
    gi = (offs_n // ((HPG + 2) * HEAD_DIM)).to(tl.int64)
    slot = (offs_n // HEAD_DIM) % (HPG + 2)
    dd = (offs_n % HEAD_DIM).to(tl.int64)
    is_q = (slot < HPG)[None, :]
    is_k = (slot == HPG)[None, :]
    is_v = (slot == HPG + 1)[None, :]
    q_off = (s_idx * sq_s + b_idx * sq_b)[:, None] + (gi * sq_g + slot.to(tl.int64) * sq_h + dd * sq_d)[None, :]
    k_off = (s_idx * sk_s + b_idx * sk_b)[:, None] + (gi * sk_g + dd * sk_d)[None, :]
    v_off = (s_idx * sv_s + b_idx * sv_b)[:, None] + (gi * sv_g + dd * sv_d)[None, :]
    xq = tl.load(dq_ptr + q_off, mask=mask & is_q, other=0.0)
    xk = tl.load(dk_ptr + k_off, mask=mask & is_k, other=0.0)
    xv = tl.load(dv_ptr + v_off, mask=mask & is_v, other=0.0)
    if R > 0:
        # rotary backward (fp8engine.ops.rotary.rope_bwd): d = g cos + (y2, -y1), (y1, y2) = halves of g sin; each
        # op rounded to dq's dtype as the reference's separate ops are. The partner channel feeds rotate_half^T.
        half: tl.constexpr = R // 2
        rot = ((dd < R) & (slot <= HPG))[None, :]
        pd = tl.where(dd < half, dd + half, dd - half)
        qp_off = (s_idx * sq_s + b_idx * sq_b)[:, None] + (gi * sq_g + slot.to(tl.int64) * sq_h + pd * sq_d)[None, :]
        kp_off = (s_idx * sk_s + b_idx * sk_b)[:, None] + (gi * sk_g + pd * sk_d)[None, :]
        gp = tl.where(is_q, tl.load(dq_ptr + qp_off, mask=mask & is_q & rot, other=0.0),
                      tl.load(dk_ptr + kp_off, mask=mask & is_k & rot, other=0.0)).to(tl.float32)
        g_cur = tl.where(is_q, xq, xk)
        c = tl.load(cos_ptr + s_idx[:, None] * R + dd[None, :], mask=mask & rot, other=0.0).to(tl.float32)
        sp = tl.load(sin_ptr + s_idx[:, None] * R + pd[None, :], mask=mask & rot, other=0.0).to(tl.float32)
        a = _round_to(g_cur.to(tl.float32) * c, g_cur.dtype, CVT).to(tl.float32)
        y = _round_to(gp * sp, g_cur.dtype, CVT).to(tl.float32)
        new = _round_to(a + tl.where((dd < half)[None, :], y, -y), g_cur.dtype, CVT)
        xq = tl.where(rot & is_q, new, xq)
        xk = tl.where(rot & is_k, new, xk)
    # select, not add: xq + xk + xv would turn a -0.0 into +0.0 (a different FP8 code)
    return tl.where(is_q, xq, tl.where(is_k, xk, xv))


@triton.jit
def _qkv_grad_cast_transpose_kernel(
    dq_ptr,  # [s, b, g, HPG, HEAD_DIM] query-head gradients, high precision, strides sq_* (any layout)
    dk_ptr,  # [s, b, g, HEAD_DIM] key-head gradients, dq's dtype, strides sk_* (any layout)
    dv_ptr,  # [s, b, g, HEAD_DIM] value-head gradients, dq's dtype, strides sv_* (any layout)
    out_ptr,  # [T, C] FP8 bits (uint8), row-major: the assembled gradient
    out_t_ptr,  # [C, T] FP8 bits (uint8), row-major: its transpose
    scale_ptr,  # [1] fp32 scale
    scale_inv_ptr,  # [1] fp32, receives 1 / scale (program (0, 0))
    amax_ptr,  # [1] fp32, atomic_max of max|grad| (only if HAS_AMAX)
    dbias_part_ptr,  # [cdiv(T, BLOCK_M), C] fp32 column sums of each row tile
    T,
    C,
    B,  # batch size b: row r is (s_idx, b_idx) = (r // B, r % B)
    sq_s, sq_b, sq_g, sq_h, sq_d,  # dq's strides in elements (s, b, g, head in group, d)
    sk_s, sk_b, sk_g, sk_d,  # dk's strides in elements (s, b, g, d)
    sv_s, sv_b, sv_g, sv_d,  # dv's strides in elements (s, b, g, d)
    cos_ptr,  # [s, R] cos of the rotary angles, dq's dtype (only if R > 0)
    sin_ptr,  # [s, R] sin of the rotary angles, dq's dtype (only if R > 0)
    HPG: tl.constexpr,  # query heads per KV group (constexpr: the column div/mod become multiplies)
    HEAD_DIM: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    R: tl.constexpr,  # rotary width: the first R channels of every q and k head get the rotation's gradient (0: none)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < T) & (offs_n[None, :] < C)
    x = _gather_qkv_grad(dq_ptr, dk_ptr, dv_ptr, offs_m, offs_n, mask, B, sq_s, sq_b, sq_g, sq_h, sq_d, sk_s,
                         sk_b, sk_g, sk_d, sv_s, sv_b, sv_g, sv_d, cos_ptr, sin_ptr, HPG, HEAD_DIM, CVT, R
                         ).to(tl.float32)
    scale = tl.load(scale_ptr)
    _store_tile(x, offs_m, offs_n, T, C, C, out_ptr, out_t_ptr, scale, FP8_MAX, IS_E4M3, CVT, True, True)
    if HAS_AMAX:
        tl.atomic_max(amax_ptr, _abs_max(x, mask))
    tl.store(dbias_part_ptr + pid_m.to(tl.int64) * C + offs_n, tl.sum(x, axis=0), mask=offs_n < C)
    if (pid_m == 0) & (pid_n == 0):
        _write_scale_inv(scale, scale_inv_ptr)


@triton.jit
def _qkv_grad_1x128_kernel(
    dq_ptr, dk_ptr, dv_ptr,  # as in _qkv_grad_cast_transpose_kernel
    out_ptr,  # [T_OUT, C] FP8 bits (uint8), 1 x 128 tiles along C
    sinv_ptr,  # [C / 128, T_OUT] fp32: T-major storage of the [T_OUT, C/128] scale_inv
    out_t_ptr,  # [C, T_OUT] FP8 bits (uint8) of the re-tiled transpose (1 x 128 tiles along T); only if WRITE_T
    sinv_t_ptr,  # [T_OUT / 128, C] fp32: C-major storage of the [C, T_OUT/128] scale_inv_t; only if WRITE_T
    dbias_part_ptr,  # [T_OUT / 128, C] fp32 column sums of each 128-row tile; only if HAS_DBIAS
    T,
    T_OUT,  # T rounded up to a multiple of 128: rows T.. are zero padding (block_linear's padded token rows)
    C,
    B,
    sq_s, sq_b, sq_g, sq_h, sq_d, sk_s, sk_b, sk_g, sk_d, sv_s, sv_b, sv_g, sv_d,
    cos_ptr, sin_ptr,
    HPG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    POW2: tl.constexpr,
    R: tl.constexpr,
    WRITE_T: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One 128 x 128 tile of the block-scaled gradient: gathered as the per-tensor kernel gathers it, then written
    as ``block_cast``'s 1 x 128 cast with the re-tiled transpose (from the register tile) and the bias partials."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_m[:, None] < T) & (offs_n[None, :] < C)
    x = _gather_qkv_grad(dq_ptr, dk_ptr, dv_ptr, offs_m, offs_n, mask, B, sq_s, sq_b, sq_g, sq_h, sq_d, sk_s,
                         sk_b, sk_g, sk_d, sv_s, sv_b, sv_g, sv_d, cos_ptr, sin_ptr, HPG, HEAD_DIM, CVT, R
                         ).to(tl.float32)
    # padding rows (>= T) are 0: amax 0, scale 1, zero bits (as the cast of padded rows)
    _store_tile_1x128(x, offs_m, offs_n, pid_m, pid_n, T, T_OUT, C, out_ptr, sinv_ptr, out_t_ptr, sinv_t_ptr, FP8_MAX,
                      IS_E4M3, CVT, POW2, WRITE_T)
    if HAS_DBIAS:
        tl.store(dbias_part_ptr + pid_m.to(tl.int64) * C + offs_n, tl.sum(x, axis=0), mask=offs_n < C)


# ----------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------
def _qkv_dims(dq, dk, dv, op, heads_per_group=None):
    """Validate dq [s, b, g, hpg, d] and dk, dv [s, b, g, d] (any of them may be None) -> (s, b, g, hpg, d).

    Raises ValueError (no tensor, wrong rank, inconsistent shapes, unknown hpg, devices differ) or TypeError
    (dtypes differ).
    """
    given = [(n, t) for n, t in (("dq", dq), ("dk", dk), ("dv", dv)) if t is not None]
    if not given:
        raise ValueError(f"{op}: dq, dk and dv are all None; there is no gradient to assemble")
    first_name, first = given[0]
    for name, t in given[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype} but {first_name} has {first.dtype}; dq, dk and dv "
                            "must share one dtype")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}")
    shapes = ", ".join(f"{n} {None if t is None else tuple(t.shape)}" for n, t in (("dq", dq), ("dk", dk), ("dv", dv)))
    if (dq is not None and dq.dim() != 5) or any(t is not None and t.dim() != 4 for t in (dk, dv)):
        raise ValueError(f"{op}: expected dq [s, b, g, heads_per_group, d] and dk, dv [s, b, g, d]; got {shapes}")
    kv = [tuple(dq.shape[:3]) + tuple(dq.shape[4:])] if dq is not None else []
    kv += [tuple(t.shape) for t in (dk, dv) if t is not None]
    if any(k != kv[0] for k in kv):
        raise ValueError(f"{op}: inconsistent shapes {shapes}; dq [s, b, g, hpg, d] and dk, dv [s, b, g, d] must "
                         "agree on s, b, g, d")
    if dq is not None:
        if heads_per_group is not None and heads_per_group != dq.shape[3]:
            raise ValueError(f"{op}: heads_per_group={heads_per_group} but dq has shape {tuple(dq.shape)}")
        heads_per_group = dq.shape[3]
    elif heads_per_group is None:
        raise ValueError(f"{op}: dq is None, so heads_per_group must be given")
    s, b, g, d = kv[0]
    return s, b, g, heads_per_group, d


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def _check_gather(dq, dk, dv, fp8_dtype, cos, sin, op: str, cast: str):
    """The checks both gathering launchers share: ``((s, b, g, hpg, d), rotary width r, (fp8_max, is_e4m3))``.
    Raises ValueError (a None gradient -- ``cast`` names the cast to use on the assembled buffer --, shapes,
    devices, one angle table without the other, not launchable) or TypeError (dtypes, fp8_dtype)."""
    if dq is None or dk is None or dv is None:
        raise ValueError(f"{op}: dq, dk and dv are all required; for a missing (zero) gradient use "
                         f"assemble_qkv_grad and {cast}")
    check_launchable(dq, op)
    s, b, g, hpg, d = _qkv_dims(dq, dk, dv, op)
    if dq.dtype not in HP_DTYPES:
        raise TypeError(f"{op}: dq, dk, dv have dtype {dq.dtype}; supported: bfloat16, float16, float32")
    fmt = fp8_format(fp8_dtype, op)
    if (cos is None) != (sin is None):
        raise ValueError(f"{op}: give both cos and sin (the rotary angle tables) or neither")
    r = 0 if cos is None else check_rope_table(cos, sin, s, d, dq, op)
    return (s, b, g, hpg, d), r, fmt


def qkv_grad_cast_transpose_dbias(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_out: torch.Tensor | None = None,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast-transpose the fused grouped-QKV gradient to FP8 with its bias gradient, reading dq/dk/dv in place.

    Args:
        dq: [s, b, g, hpg, d] query gradients; dk, dv: [s, b, g, d]. One dtype (bf16/fp16/fp32), one device, any
            strides (e.g. SDPA's [b, heads, s, d] gradients permuted to [s, b, ...]); all three required.
        scale: [1] or [] fp32 on their device; ``data = saturate(grad * scale)``.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        amax_out: optional [1] fp32; receives ``max(amax_out, max|grad|)`` (atomic; NaN -> +inf).
        cos, sin: optional rotary angle tables ``[s, 1, 1, r]`` in dq's dtype (``fp8engine.ops.rotary.rope_cos_sin``):
            dq and dk are the gradients of the ROTATED q and k, and the rotation's gradient is applied in the
            gather -- the result is then that of ``rope_bwd(dq), rope_bwd(dk)`` (``fp8engine.ops.rotary``) cast as
            below, bit for bit.

    Returns:
        ``(data, data_t, scale_inv, dbias)`` = ``cast_transpose_dbias(assemble_qkv_grad(dq, dk, dv).reshape(T, C),
        ...)``, bit for bit: data [T, C] fp8_dtype (T = s*b, C = g*(hpg+2)*d), data_t [C, T] fp8_dtype, scale_inv a
        new [1] fp32 = 1/scale, dbias [C] in dq.dtype (fp32 column sums per 64-row tile, then a deterministic pass).

    Raises:
        ValueError: a gradient is None, shapes inconsistent, devices differ, or not launchable on the device.
        TypeError: dtypes differ or are unsupported; scale / amax_out not a 1-element fp32 tensor; bad fp8_dtype.
    """
    op = "qkv_grad_cast_transpose_dbias"
    (s, b, g, hpg, d), r, (fp8_max, is_e4m3) = _check_gather(dq, dk, dv, fp8_dtype, cos, sin, op,
                                                            "cast_transpose_dbias")
    check_scalar_f32(scale, "scale", dq.device, op)
    check_scalar_f32(amax_out, "amax_out", dq.device, op)
    t, c = s * b, g * (hpg + 2) * d
    if c == 0:
        raise ValueError(f"{op}: the gradient has no columns (g={g}, d={d}); nothing to cast")
    if t == 0:  # nothing to gather: the cast kernel's empty-input behaviour (scale_inv, zero dbias)
        empty = torch.empty((t, c), dtype=dq.dtype, device=dq.device)
        return cast_transpose_dbias(empty, scale, fp8_dtype, amax_out)
    data = torch.empty((t, c), dtype=fp8_dtype, device=dq.device)
    data_t = torch.empty((c, t), dtype=fp8_dtype, device=dq.device)
    scale_inv = new_scale_inv(dq.device)
    grid = (cdiv(t, TILE_M), cdiv(c, TILE_N))
    parts = torch.empty((grid[0], c), dtype=torch.float32, device=dq.device)
    hw_ok = _hw_cvt_ok(t, c, dq.dtype)  # the decision cast_transpose_dbias makes for the assembled [T, C] buffer
    launch(_qkv_grad_cast_transpose_kernel, grid,
        dq, dk, dv, data.view(torch.uint8), data_t.view(torch.uint8), scale, scale_inv,
        amax_out if amax_out is not None else scale_inv, parts, t, c, b,
        *dq.stride(), *dk.stride(), *dv.stride(), scale if cos is None else cos, scale if sin is None else sin,
        HPG=hpg, HEAD_DIM=d, FP8_MAX=fp8_max, IS_E4M3=is_e4m3, CVT=fp8_cvt_mode(tiled_transpose=not hw_ok),
        HAS_AMAX=amax_out is not None, R=r, BLOCK_M=TILE_M, BLOCK_N=TILE_N, num_warps=TILE_WARPS,
        **({"enable_fp_fusion": False} if r else {}),  # fp32: no FMA contraction of the rotation (reference's bits)
    )  # fmt: skip
    return data, data_t, scale_inv, sum_partials(parts, dq.dtype)


def qkv_grad_1x128(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    power_2_scale: bool = True,
    transpose: bool = True,
    dbias: bool = True,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> tuple:
    """The fused grouped-QKV gradient cast block-scaled (the ``Float8BlockScaling`` recipe), reading dq/dk/dv in place:
    what ``block_cast.cast_1x128_dbias`` returns on the assembled ``[T, C]`` buffer with its token rows zero-padded to
    a multiple of 128 (a :class:`~fp8engine.fp8.block_tensor.Float8BlockTensor`'s padding), in one pass without
    that buffer.

    Args:
        dq, dk, dv, cos, sin: as :func:`qkv_grad_cast_transpose_dbias` (any strides; the rotation's gradient applied
            in the gather when the angle tables are given).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2. power_2_scale: power-of-two tile scales.
        transpose: also write the re-tiled transpose (the wgrad operand). dbias: also return the column sums.
    Returns:
        ``(data, scale_inv, data_t, scale_inv_t, dbias)``: ``data`` ``[T_out, C]`` FP8 (``T_out`` = T rounded up to
        128), ``scale_inv`` fp32 ``[T_out, C/128]`` strides ``(1, T_out)``; ``data_t`` ``[C, T_out]`` and
        ``scale_inv_t`` fp32 ``[C, T_out/128]`` strides ``(1, C)`` (None without ``transpose``); ``dbias [C]`` in dq's
        dtype (fp32 column sums per 128-row tile, then a fixed-order sum; None without ``dbias``). The FP8 bits and
        scales equal ``cast_1x128``'s on the assembled, padded buffer.
    Raises:
        as :func:`qkv_grad_cast_transpose_dbias`; ValueError also when C is not a multiple of 128.
    """
    op = "qkv_grad_1x128"
    (s, b, g, hpg, d), r, (fp8_max, is_e4m3) = _check_gather(dq, dk, dv, fp8_dtype, cos, sin, op,
                                                            "block_cast.cast_1x128")
    t, c = s * b, g * (hpg + 2) * d
    if c % BLOCK:
        raise ValueError(f"{op}: the gradient has C = {c} columns, not a multiple of {BLOCK} (the block GEMMs' tile)")
    t_out = cdiv(t, BLOCK) * BLOCK
    mb, dev = t_out // BLOCK, dq.device
    data = torch.empty((t_out, c), dtype=fp8_dtype, device=dev)
    sinv = torch.empty((c // BLOCK, t_out), dtype=torch.float32, device=dev)
    data_t = torch.empty((c, t_out), dtype=fp8_dtype, device=dev) if transpose else None
    sinv_t = torch.empty((mb, c), dtype=torch.float32, device=dev) if transpose else None
    parts = torch.empty((mb, c), dtype=torch.float32, device=dev) if dbias else None
    if t_out and c:
        u8 = data.view(torch.uint8)
        launch(_qkv_grad_1x128_kernel, (mb, c // BLOCK),
            dq, dk, dv, u8, sinv, data_t.view(torch.uint8) if transpose else u8, sinv_t if transpose else sinv,
            parts if dbias else sinv, t, t_out, c, b, *dq.stride(), *dk.stride(), *dv.stride(),
            sinv if cos is None else cos, sinv if sin is None else sin,
            HPG=hpg, HEAD_DIM=d, FP8_MAX=fp8_max, IS_E4M3=is_e4m3, CVT=fp8_cvt_mode(tiled_transpose=True),
            POW2=bool(power_2_scale), R=r, WRITE_T=transpose, HAS_DBIAS=dbias, BLOCK=BLOCK, num_warps=BLOCK_WARPS,
            **({"enable_fp_fusion": False} if r else {}),  # fp32: no FMA contraction of the rotation (reference's bits)
        )  # fmt: skip
    db = None
    if dbias:
        db = sum_partials(parts, dq.dtype) if t_out else torch.zeros(c, dtype=dq.dtype, device=dev)
    return data, sinv.t(), data_t, (sinv_t.t() if transpose else None), db


def qkv_grad_1x128_reference(dq, dk, dv, fp8_dtype, *, power_2_scale=True, transpose=True, dbias=True):
    """Plain-PyTorch :func:`qkv_grad_1x128` without angle tables: the assembled buffer with its rows zero-padded to a
    multiple of 128, ``block_cast.cast_1x128_reference`` and the fp32 column sums (another summation order than the
    kernel's). With angle tables the kernel equals this function on ``fp8engine.ops.rotary.rope_bwd`` of dq and dk
    (``ops.rotary.unrotate_grads``; the kernels layer does not import ops)."""
    grad = assemble_qkv_grad(dq, dk, dv)
    grad = grad.reshape(-1, grad.shape[-1])
    pad = -grad.shape[0] % BLOCK
    data, sinv, data_t, sinv_t = cast_1x128_reference(torch.nn.functional.pad(grad, (0, 0, 0, pad)), fp8_dtype,
                                                      power_2_scale=power_2_scale, transpose=transpose)
    db = grad.sum(0, dtype=torch.float32).to(grad.dtype) if dbias else None
    return data, sinv, data_t, sinv_t, db


# ----------------------------------------------------------------------------------------------------------------
# References (plain PyTorch, no Triton)
# ----------------------------------------------------------------------------------------------------------------
def assemble_qkv_grad(
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    *,
    heads_per_group: int | None = None,
) -> torch.Tensor:
    """The gradient of the fused projection output, ``[s, b, C]`` contiguous in dq/dk/dv's dtype (plain torch).

    ``C = g * (hpg + 2) * d`` in the grouped layout of the module docstring. A None gradient is zero;
    ``heads_per_group`` is only needed (and otherwise checked) when dq is None. Raises as the launcher's shape,
    dtype and device checks.
    """
    s, b, g, hpg, d = _qkv_dims(dq, dk, dv, "assemble_qkv_grad", heads_per_group)
    like = next(t for t in (dq, dk, dv) if t is not None)
    grad = torch.empty((s, b, g, hpg + 2, d), dtype=like.dtype, device=like.device)
    for part, src in ((grad[:, :, :, :hpg], dq), (grad[:, :, :, hpg], dk), (grad[:, :, :, hpg + 1], dv)):
        if src is None:
            part.zero_()
        else:
            part.copy_(src)
    return grad.view(s, b, g * (hpg + 2) * d)


def qkv_grad_cast_transpose_dbias_reference(dq, dk, dv, scale, fp8_dtype, amax_out=None):
    """Plain-PyTorch :func:`qkv_grad_cast_transpose_dbias`: assemble the buffer, then
    ``cast_transpose_dbias_reference`` on its [T, C] view."""
    grad = assemble_qkv_grad(dq, dk, dv)
    s, b, c = grad.shape
    return cast_transpose_dbias_reference(grad.reshape(s * b, c), scale, fp8_dtype, amax_out)
