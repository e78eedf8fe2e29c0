"""The block-scaled FP8 GEMM: ``out = a @ b.T`` for :class:`~fp8engine.fp8.block_tensor.Float8BlockTensor` operands.

Two paths with the same math, ``out[m, n] = sum_k (a.data[m, k] * a_scale_inv[m, k // 128]) *
(b.data[n, k] * b_scale_inv[block of (n, k)])`` rounded once to ``out_dtype``:
  * CUDA sm_90 with ``torch.nn.functional.scaled_mm`` (torch >= 2.10), both operands E4M3: cuBLASLt's block-wise
    scaled GEMM, ``scaled_mm(a, b^T, scale_a, ScalingType.BlockWise1x128, scale_b, BlockWise1x128 or
    BlockWise128x128, output_dtype=...)``. It accumulates in fp32 and applies each 128-wide K block's scales to the
    partial sums (DeepSeek-V3's promotion), so it differs from the emulation by fp32 summation rounding. The scale
    layouts it takes (``torch._scaled_mm`` refuses them; torch 2.13's ``sample_inputs_scaled_mm_v2`` in
    ``common_methods_invocations.py``): 1 x 128 scales of an ``[M, K]`` operand as ``[M, K/128]`` with strides
    ``(1, M)`` (our stored layout); 128 x 128 scales of an ``[N, K]`` operand as the ``[N/128, round_up(K/128, 4)]``
    row-major buffer passed transposed (``_scaled_block1x128_block128x128``). torch dispatches these recipes only
    for ``float8_e4m3fn`` operands (``check_deepseek_recipe``, ``aten/src/ATen/cuda/CUDAScaledBlas.cpp``), so E5M2
    gradients (the HYBRID format) take the emulation, also on the GPU (correct, much slower).
  * elsewhere: an emulation that dequantizes both operands per block in float64 (exact) and multiplies in float64
    (products of FP8 values with power-of-two scales are exact; the sum to ~2**-50 relative), rounded once.

Bias: ``block_gemm(..., bias=b)`` adds ``b [N]`` to a bf16 output inside the GEMM (cuBLASLt's epilogue: the fp32 sum
plus the bias rounded once; the emulation adds it in float64 before its rounding) instead of a separate broadcast
add over ``[M, N]``. An fp32 output gets the bias added after the GEMM (``out + bias`` in fp32), on both paths.

Shapes: ``a`` ``[M, K]`` with 1 x 128 tiles; ``b`` ``[N, K]`` with 1 x 128 tiles (wgrad: ``dy^T`` x ``x^T`` re-tiled
along the token dim) or 128 x 128 blocks (fprop / dgrad: the weight or its transpose). K and, for 128 x 128 ``b``,
N must be multiples of 128 (the hardware's block granularity; no padding is done: the casts pad the token rows,
see :mod:`fp8engine.fp8.block_tensor`, and the GEMMs below drop the padded rows of their outputs).

The GEMMs of a linear layer on :class:`~fp8engine.fp8.block_tensor.Float8BlockTensor` operands are attached to that
type here (as :mod:`fp8engine.ops.linear` attaches the per-tensor ones to ``Float8Tensor``), so the ops call them on
whichever FP8 tensor a quantizer returned:
  * ``x.fprop(w, out_dtype, bias)``: ``y = x @ w.T + bias`` ``[x.rows, N]``;
  * ``dy.dgrad(w_t, out_dtype)``: ``dx = dy @ w`` ``[dy.rows, K]`` (``w_t = w.t_operand()``);
  * ``dy.wgrad(x_t, out_dtype)``: ``dw = dy.T @ x`` ``[N, K]`` (``x_t = x.t_operand()``, re-tiled along the
    tokens, as dy's), and ``dy.wgrad_into(x_t, out)``: the same added to the fp32 ``out`` (``main_grad``).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from fp8engine.fp8.block_tensor import BLOCK_128x128, TILE_1x128, Float8BlockTensor

__all__ = ["block_gemm", "block_gemm_emulated", "hw_block_gemm_available", "check_block_dims"]

_B = TILE_1x128[1]
_OUT_DTYPES = (torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def _hw_on(device_index: int) -> bool:
    F = torch.nn.functional
    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return False
    # torch's _check_deepseek_support: Hopper (major 9) and cuBLASLt >= 12.9
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device_index)[0] == 9 and cuda >= (12, 9)


def hw_block_gemm_available(device: torch.device, *fp8_dtypes: torch.dtype) -> bool:
    """True when ``device`` is a CUDA sm_90 GPU, torch was built with CUDA >= 12.9 and has
    ``torch.nn.functional.scaled_mm`` (cached per device), and every dtype in ``fp8_dtypes`` (the operands', if
    given) is ``torch.float8_e4m3fn``."""
    device = torch.device(device)
    if device.type != "cuda" or any(d != torch.float8_e4m3fn for d in fp8_dtypes):
        return False
    return _hw_on(device.index if device.index is not None else torch.cuda.current_device())


def _check(a: Float8BlockTensor, b: Float8BlockTensor, out_dtype: torch.dtype) -> None:
    if not isinstance(a, Float8BlockTensor) or not isinstance(b, Float8BlockTensor):
        raise TypeError("block_gemm: a and b must be Float8BlockTensor (fp8engine.fp8.block_tensor.quantize_block)")
    if a.block != TILE_1x128:
        raise ValueError(f"block_gemm: a must have 1 x 128 tiles, got {a.block}")
    (m, k), (n, k2) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"block_gemm: a is [{m}, {k}] and b is [{n}, {k2}]; their last dims (K) must match")
    if k % _B:
        raise ValueError(f"block_gemm: K = {k} must be a multiple of {_B} (the scaling block); pad the features")
    if b.block == BLOCK_128x128 and n % _B:
        raise ValueError(f"block_gemm: N = {n} must be a multiple of {_B} for a 128 x 128-blocked b")
    if a.data.device != b.data.device:
        raise ValueError(f"block_gemm: a is on {a.data.device}, b on {b.data.device}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"block_gemm: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


def block_gemm_emulated(a: Float8BlockTensor, b: Float8BlockTensor,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ b.T`` ``[M, N]`` by per-block dequantization in float64 and a float64 matmul, rounded to ``out_dtype``."""
    return block_gemm(a, b, out_dtype, use_hw=False)


def _scaled_mm(a: Float8BlockTensor, b: Float8BlockTensor, out_dtype: torch.dtype,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    F = torch.nn.functional
    st = F.ScalingType
    scale_a = a.scale_inv
    if scale_a.stride(0) != 1:  # not M-major (built by hand): the GEMM wants strides (1, M)
        scale_a = scale_a.t().contiguous().t()
    if b.block == TILE_1x128:
        scale_b, recipe_b = b.scale_inv, st.BlockWise1x128
        if scale_b.stride(0) != 1:
            scale_b = scale_b.t().contiguous().t()
    else:
        nb, kb = b.scale_inv.shape
        kb4 = -(-kb // 4) * 4
        if kb4 == kb and b.scale_inv.is_contiguous():
            buf = b.scale_inv
        else:
            buf = torch.zeros((nb, kb4), dtype=torch.float32, device=b.scale_inv.device)
            buf[:, :kb] = b.scale_inv
        scale_b, recipe_b = buf.t(), st.BlockWise128x128
    return F.scaled_mm(a.data, b.data.t(), scale_a, st.BlockWise1x128, scale_b, recipe_b, bias=bias,
                       output_dtype=out_dtype)


def block_gemm(a: Float8BlockTensor, b: Float8BlockTensor, out_dtype: torch.dtype = torch.bfloat16, *,
               bias: Optional[torch.Tensor] = None, use_hw: Optional[bool] = None) -> torch.Tensor:
    """``a @ b.T (+ bias)``: ``[M, K]`` (1 x 128 tiles) x ``[N, K]`` (1 x 128 or 128 x 128) -> ``[M, N]`` in
    ``out_dtype``.

    Args:
        a, b: :class:`Float8BlockTensor` operands, both K-last (``b`` is the weight ``[N, K]`` in fprop).
        out_dtype: ``torch.bfloat16`` or ``torch.float32``.
        bias: optional ``[N]`` (any float dtype; brought to ``out_dtype``), added to every row: in the GEMM's
            epilogue for a bf16 output, after it for fp32 (module docstring).
        use_hw: force (True) or forbid (False) the cuBLASLt path; default: :func:`hw_block_gemm_available` for
            this device and the operands' dtypes.
    Raises:
        TypeError: operands not Float8BlockTensor, or another ``out_dtype``. ValueError: ``a`` not 1 x 128, K
        mismatch, K (or N for a 128 x 128 ``b``) not a multiple of 128, operands on different devices, a bias
        not shaped ``[N]``.
        RuntimeError: ``use_hw=True`` where the hardware path is not available (device, torch, E5M2 operand).
    """
    _check(a, b, out_dtype)
    if bias is not None:
        if tuple(bias.shape) != (b.shape[0],):
            raise ValueError(f"block_gemm: bias must be [N] = [{b.shape[0]}], got {tuple(bias.shape)}")
        bias = bias.to(out_dtype)
    in_epilogue = bias is not None and out_dtype == torch.bfloat16
    hw = hw_block_gemm_available(a.data.device, a.fp8_dtype, b.fp8_dtype)
    if use_hw and not hw:
        raise RuntimeError("block_gemm(use_hw=True) needs a CUDA sm_90 GPU, torch.nn.functional.scaled_mm "
                           f"(torch >= 2.10) and E4M3 operands; have {a.data.device}, torch {torch.__version__}, "
                           f"{a.fp8_dtype} x {b.fp8_dtype}")
    if hw and use_hw is not False:
        out = _scaled_mm(a, b, out_dtype, bias if in_epilogue else None)
    else:
        out = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
        out = (out + bias.double() if in_epilogue else out).to(out_dtype)
    return out + bias if bias is not None and not in_epilogue else out


def check_block_dims(gemm_dims, what: str) -> None:
    """Raise ``ValueError`` unless every GEMM ``(in_features K, out_features N)`` in ``gemm_dims`` has both dims a
    multiple of 128, as the ``Float8BlockScaling`` GEMMs need (``what``: the module, for the message; a module with
    several GEMMs, e.g. LayerNormMLP's fc1 and fc2, gets the GEMM's position named too)."""
    for i, (k, n) in enumerate(gemm_dims):
        gemm = f" (GEMM {i + 1} of {len(gemm_dims)})" if len(gemm_dims) > 1 else ""
        for name, dim in (("in_features", k), ("out_features", n)):
            if dim % _B:
                raise ValueError(
                    f"{what}: {name}={dim}{gemm} is not a multiple of {_B}, which the Float8BlockScaling recipe's "
                    f"block GEMMs require (1 x {_B} and {_B} x {_B} scaling blocks); pad it to {-(-dim // _B) * _B}, "
                    "or use DelayedScaling / CurrentScaling (multiples of 16) for this model")


def _fprop(a: Float8BlockTensor, b: Float8BlockTensor, out_dtype: torch.dtype,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fprop ``x.fprop(w)`` and dgrad ``dy.dgrad(w_t)``: :func:`block_gemm` without ``a``'s padded rows."""
    out = block_gemm(a, b, out_dtype, bias=bias)
    return out if out.shape[0] == a.rows else out[:a.rows]


def _wgrad(dy: Float8BlockTensor, x_t: Float8BlockTensor, out_dtype: torch.dtype) -> torch.Tensor:
    return block_gemm(dy.t_operand(), x_t, out_dtype)


def _wgrad_into(dy: Float8BlockTensor, x_t: Float8BlockTensor, out: torch.Tensor) -> None:
    out.add_(block_gemm(dy.t_operand(), x_t, torch.float32))


# the block-scaled GEMMs of a linear layer (module docstring)
Float8BlockTensor.fprop = Float8BlockTensor.dgrad = _fprop
Float8BlockTensor.wgrad, Float8BlockTensor.wgrad_into = _wgrad, _wgrad_into
