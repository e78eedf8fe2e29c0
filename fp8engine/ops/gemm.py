"""FP8 GEMM through ``torch._scaled_mm`` (CPU, compiled code) or, in eager CUDA code, the same cuBLASLt call made
directly (:func:`fp8engine.kernels.cublaslt.gemm`, planned once per configuration: less host time).

``fp8_gemm(a, b)`` computes ``a @ b.T`` (the "TN" form every Linear GEMM reduces to):
- fprop  ``y  = x  @ w.T``:  a = x  ``[M, K]``,    b = w   ``[N, K]``
- dgrad  ``dx = dy @ w``:    a = dy ``[M, N]``,    b = w^T ``[K, N]``
- wgrad  ``dw = dy.T @ x``:  a = dy^T ``[N, M]``,  b = x^T ``[K, M]``
``_scaled_mm`` wants its first operand row-major and its second column-major; ``b.t()`` of a row-major ``b`` is
exactly that, so no copy is made here. Both inner and output dims must be multiples of 16 for cuBLASLt.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.kernels import cublaslt

__all__ = ["fp8_gemm", "fp8_fprop", "fp8_gemm_bias_gelu", "fp8_mm", "fp8_mm_accumulate", "check_gemm_dims"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_ALIGN = 16  # cuBLASLt FP8 requires K and N to be multiples of 16 (torch._scaled_mm checks it on CUDA)
#: Eager CUDA GEMMs call cuBLASLt directly; ``FP8ENGINE_CUBLASLT_GEMM=0`` (read at import) calls torch._scaled_mm.
CUBLASLT_GEMM = os.environ.get("FP8ENGINE_CUBLASLT_GEMM", "1") != "0"


def check_gemm_dims(in_features: int, out_features: int, what: str = "Linear") -> None:
    """Raise ``ValueError`` when a layer's dims cannot run as FP8 GEMMs (each must be a multiple of 16)."""
    for name, dim in (("in_features", in_features), ("out_features", out_features)):
        if dim % _ALIGN:
            raise ValueError(
                f"{what}: {name}={dim} is not a multiple of 16, which FP8 GEMMs (torch._scaled_mm) require; "
                f"pad it to {-(-dim // _ALIGN) * _ALIGN} or keep this layer in high precision "
                f"(convert_to_fp8 leaves such layers alone)")


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    rem = t.shape[-1] % multiple
    if rem == 0:
        return t
    # FP8 dtypes have no pad kernel everywhere: pad the raw bytes (0x00 is +0.0 in both encodings).
    return F.pad(t.view(torch.uint8), (0, multiple - rem)).view(t.dtype)


def fp8_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
           out_dtype: torch.dtype, *, bias: Optional[torch.Tensor] = None, use_fast_accum: bool = False,
           pad_inner: bool = False, kernels: bool = False) -> torch.Tensor:
    """``(a * a_scale_inv) @ (b * b_scale_inv).T`` in FP8 tensor cores, result in ``out_dtype``.

    Args:
        a: ``[M, K]`` FP8, row-major. b: ``[N, K]`` FP8, row-major. At most one of them may be E5M2.
        a_scale_inv, b_scale_inv: 1-element float32 dequantization factors.
        out_dtype: float32, bfloat16 or float16.
        bias: optional ``[N]``, added in the GEMM epilogue when its dtype is ``out_dtype`` (bf16/fp16), else after.
        use_fast_accum: cuBLASLt fast accumulation (TransformerEngine uses it for fprop only).
        pad_inner: zero-pad K up to a multiple of 16 (used for wgrad, where K is the token count).
        kernels: the operands' backend (``Float8Tensor.kernels``): True calls cuBLASLt directly on CUDA (unless
            :data:`CUBLASLT_GEMM` is off), False ``torch._scaled_mm``.
    Raises:
        TypeError: non-FP8 operands, or E5M2 x E5M2.
        ValueError: K or N not a multiple of 16 (and ``pad_inner`` not set for K).
    """
    if a.dtype not in _FP8 or b.dtype not in _FP8:
        raise TypeError(f"fp8_mm operands must be FP8, got {a.dtype} and {b.dtype}")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise TypeError("E5M2 x E5M2 GEMMs are not supported by cuBLASLt; quantize one operand to E4M3")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_mm needs a [M, K] and b [N, K]; got {tuple(a.shape)} and {tuple(b.shape)}")
    if pad_inner and a.shape[1] % _ALIGN:
        a, b = _pad_last(a, _ALIGN), _pad_last(b, _ALIGN)
    k, n = a.shape[1], b.shape[0]
    if k % _ALIGN:
        raise ValueError(f"FP8 GEMM inner dim K={k} is not a multiple of 16; pad the feature dim to a multiple of 16")
    if n % _ALIGN:
        raise ValueError(f"FP8 GEMM output dim N={n} is not a multiple of 16; pad the feature dim to a multiple of 16")
    fused_bias = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
    out = None
    if kernels and CUBLASLT_GEMM and a.is_cuda:
        out = cublaslt.gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias if fused_bias else None, use_fast_accum)
    if out is None:  # CPU, compiled code, or a configuration the direct call declined
        # 1-element scales go in as they are: _scaled_mm takes numel() == 1 as tensor-wise scaling (a reshape to
        # 0-d would be one more dispatched op per GEMM on the host's hot path)
        out = torch._scaled_mm(a, b.t(), scale_a=a_scale_inv, scale_b=b_scale_inv,
                               bias=bias if fused_bias else None, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    if bias is not None and not fused_bias:
        out = out + bias.to(out_dtype)
    return out


def fp8_mm_accumulate(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                      out: torch.Tensor, *, pad_inner: bool = False, kernels: bool = False) -> None:
    """``out += (a * a_scale_inv) @ (b * b_scale_inv).T`` into a float32 ``out [M, N]`` (``fuse_wgrad_accumulation``).

    With ``kernels`` on CUDA the GEMM accumulates into ``out`` itself (cuBLASLt with beta = 1,
    :mod:`fp8engine.kernels.cublaslt`); otherwise, or when ``out`` is not contiguous or an operand is not 16-byte
    aligned (cuBLASLt's FP8 kernels refuse it: status 15), :func:`fp8_mm` into float32 plus ``out.add_``: the same
    fp32 GEMM result added (``tests/ops/test_gemm_accumulate.py``). Traced by ``torch.compile`` on CUDA, the custom
    op :func:`~fp8engine.ops.gemm_ops.mm_accumulate_fp8` runs this function instead
    (:func:`fp8engine.ops.linear.fp8_wgrad_accumulate` picks it).
    Operands and errors as :func:`fp8_mm` (``a [M, K]``, ``b [N, K]`` FP8); also ``TypeError`` when ``out`` is not
    float32 and ``ValueError`` when it is not shaped ``[M, N]``.
    """
    if out.dtype != torch.float32:
        raise TypeError(f"fp8_mm_accumulate accumulates into float32, got out of dtype {out.dtype}")
    if tuple(out.shape) != (a.shape[0], b.shape[0]):
        raise ValueError(f"fp8_mm_accumulate: out must be [M, N] = {(a.shape[0], b.shape[0])}, got {tuple(out.shape)}")
    if kernels and out.is_cuda and out.is_contiguous() and cublaslt.available():
        if pad_inner and a.shape[1] % _ALIGN:
            a, b = _pad_last(a, _ALIGN), _pad_last(b, _ALIGN)
        a, b = a.contiguous(), b.contiguous()
        if all(t.data_ptr() % 16 == 0 for t in (a, b, out)):  # cuBLASLt checks dtypes and shapes
            cublaslt.scaled_mm_accumulate(a, a_scale_inv, b, b_scale_inv, out)
            return
    out.add_(fp8_mm(a, a_scale_inv, b, b_scale_inv, torch.float32, pad_inner=pad_inner, kernels=kernels))


def fp8_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype, *, bias=None, use_fast_accum=False,
             transpose_a: bool = False, transpose_b: bool = False, pad_inner: bool = False) -> torch.Tensor:
    """:func:`fp8_mm` on :class:`Float8Tensor` operands viewed as 2-D; ``transpose_a``/``transpose_b`` take their
    transposed FP8 copies (``Float8Tensor.transpose_2d``); the backend is ``a``'s (``Float8Tensor.kernels``)."""
    a_data = a.transpose_2d() if transpose_a else _as_2d(a.data)
    b_data = b.transpose_2d() if transpose_b else _as_2d(b.data)
    return fp8_mm(a_data, a.scale_inv, b_data, b.scale_inv, out_dtype, bias=bias, use_fast_accum=use_fast_accum,
                  pad_inner=pad_inner, kernels=a.kernels)


def fp8_fprop(x: Float8Tensor, w: Float8Tensor, out_dtype: torch.dtype,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A linear layer's fprop ``y = x @ w.T + bias`` (``[M, N]`` in ``out_dtype``): the bias brought to
    ``out_dtype`` (added in the GEMM epilogue for bf16/fp16, see :func:`fp8_mm`) and cuBLASLt's fast accumulation,
    as TransformerEngine runs fprop (dgrad and wgrad accumulate exactly)."""
    if bias is not None and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    return fp8_gemm(x, w, out_dtype, bias=bias, use_fast_accum=True)


def fp8_gemm_bias_gelu(a: Float8Tensor, b: Float8Tensor, bias: torch.Tensor, out_dtype: torch.dtype,
                       scale: torch.Tensor, fp8_dtype: torch.dtype, amax_out: Optional[torch.Tensor]
                       ) -> Optional[tuple[torch.Tensor, Float8Tensor]]:
    """fc1 fprop and GELU in one cuBLASLt GEMM (``GELU_AUX_BIAS`` epilogue, fast accumulation, as fprop):
    ``h = a @ b.T + bias`` and ``gelu_tanh(h)`` written in FP8 with ``scale`` (delayed scaling), ``amax_out``
    max-accumulated with ``max |gelu(h)|``. Returns ``(h [M, N] in out_dtype, gelu(h) as Float8Tensor [M, N])``,
    or None where this path cannot run -- CPU, no cuBLASLt, M = 0, ``out_dtype`` not bf16/fp16, a non-contiguous or
    not 16-byte aligned operand, dims not multiples of 16, or a GPU whose cuBLASLt has no such kernel -- and the
    caller runs :func:`fp8_gemm` plus the activation kernel instead. Under ``torch.compile`` it runs inside the
    custom op :func:`~fp8engine.ops.gemm_ops.gemm_bias_gelu_fp8`, which takes that fallback itself.

    Numerics: cuBLASLt applies GELU to the fp32 ``h`` (the unfused path to ``h`` rounded to ``out_dtype``), so about
    2 % of the FP8 bytes differ by one step (H200, ``tools/gelu_epilogue_variants.py@d6af129``); ``h`` is the same.
    ``scale_inv`` is ``1 / scale`` (IEEE division, as the cast kernels write it).
    Args: a ``[M, K]`` / b ``[N, K]`` Float8Tensors (data viewed as 2-D); bias ``[N]``; scale / amax_out
    1-element float32 (``amax_out`` None: amax not recorded).
    """
    a2, b2 = _as_2d(a.data), _as_2d(b.data)
    if not (a2.is_cuda and a2.shape[0] and out_dtype in (torch.bfloat16, torch.float16)
            and cublaslt.available()):
        return None
    bias = bias.to(out_dtype)
    if (a2.shape[1] % _ALIGN or b2.shape[0] % _ALIGN or not (a2.is_contiguous() and b2.is_contiguous()
                                                              and bias.is_contiguous())
            or any(t.data_ptr() % 16 for t in (a2, b2, bias, a.scale_inv, b.scale_inv))):
        return None
    # cuBLASLt reads scalars and vectors through 16-byte aligned pointers only (else status 15, NOT_SUPPORTED): the
    # state's scale row (a view 4 bytes into a shared buffer) is copied when it is not aligned
    out_scale = scale if scale.data_ptr() % 16 == 0 else scale.clone()
    m, n = a2.shape[0], b2.shape[0]
    h = torch.empty(m, n, dtype=out_dtype, device=a2.device)
    y = torch.empty(m, n, dtype=fp8_dtype, device=a2.device)
    amax = torch.empty(1, dtype=torch.float32, device=a2.device)  # cuBLASLt overwrites its amax
    try:
        cublaslt.scaled_mm_bias_gelu(a2, a.scale_inv, b2, b.scale_inv, bias, y, h, out_scale, amax)
    except cublaslt.CublasLtUnsupported:
        return None
    if amax_out is not None:
        torch.maximum(amax_out, amax, out=amax_out)  # a NaN amax stays NaN: the scale update keeps the old scale
    return h, Float8Tensor(y, torch.reciprocal(scale), out_dtype, kernels=True)
