"""The two cuBLASLt GEMMs as ``torch.library`` custom ops, for code under ``torch.compile``.

Eager mode calls cuBLASLt through ``ctypes`` (:mod:`fp8engine.kernels.cublaslt`) for the two GEMMs
``torch._scaled_mm`` cannot express: fc1 fprop with the ``GELU_AUX_BIAS`` epilogue writing fc2's FP8 input
(:func:`fp8engine.ops.gemm.fp8_gemm_bias_gelu`) and the wgrad accumulating into fp32 ``main_grad`` (beta = 1,
:func:`fp8engine.ops.gemm.fp8_mm_accumulate`). Dynamo cannot trace a ctypes call, so without these ops a compiled
step would run the unfused GEMM + a separate GELU + cast + amax pass, and the wgrad into a fresh fp32 tensor plus
``main_grad.add_``. The ops are opaque to Inductor: the compiled graph calls what eager mode calls.

- :func:`gemm_bias_gelu_fp8`: ``(h, gelu(h) in FP8, scale_inv)``, the amax max-accumulated into a declared-mutated
  ``amax`` (the delayed-scaling history slot :meth:`~fp8engine.fp8.quantizer.Quantizer.compiled_views` gives, as
  :func:`~fp8engine.ops.kernel_ops.act_fwd_fp8`).
- :func:`mm_accumulate_fp8`: ``out += a @ b.T`` in place (``mutates_args=("out",)``).

CUDA: eager mode's code, including its fallbacks where cuBLASLt cannot run (:func:`~fp8engine.ops.gemm.fp8_mm` with
the bias, then the Triton GELU kernel writing FP8, bits as documented there; ``_scaled_mm`` into fp32 plus
``out.add_``). Any other device: the plain-PyTorch compositions eager CPU mode runs, with the same bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fp8engine.fp8.float8_tensor import Float8Tensor, quantize_torch
from fp8engine.fp8.cast_ops import _scale_inv_like
from fp8engine.fp8.library import kernel_op
from fp8engine.ops import gemm

__all__ = ["gemm_bias_gelu_fp8", "mm_accumulate_fp8", "compiled_gemm_ops"]


def compiled_gemm_ops(x: torch.Tensor) -> bool:
    """True when code traced by ``torch.compile`` should call the GEMM ops of this module for ``x``: while
    compiling, for a CUDA tensor (the op itself falls back where cuBLASLt cannot run)."""
    return torch.compiler.is_compiling() and x.is_cuda


@kernel_op("gemm_bias_gelu_fp8", mutates_args=("amax",))
def gemm_bias_gelu_fp8(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                       bias: torch.Tensor, out_dtype: torch.dtype, scale: torch.Tensor, fp8_dtype: torch.dtype,
                       amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fc1 fprop with GELU: ``h = a @ b.T + bias`` and ``gelu_tanh(h)`` written in FP8 with ``scale``:
    ``(h, y8, scale_inv)``.

    Args:
        a: ``[M, K]`` FP8 (fc1's input), b: ``[N, K]`` FP8 (W1), row-major; a_scale_inv, b_scale_inv: ``[1]``
            float32 dequantization factors. bias: ``[N]``, cast to ``out_dtype``.
        out_dtype: ``h``'s dtype (bfloat16 / float16 for the epilogue; float32 takes the fallback).
        scale: ``[1]`` float32 delayed-scaling scale of fc2's input (multiply to go into the FP8 range).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        amax: ``[1]`` float32, max-accumulated with ``max |gelu(h)|`` in place.
    Returns:
        ``h [M, N]`` in ``out_dtype``, ``y8 [M, N]`` in ``fp8_dtype``, ``scale_inv [1]`` float32 (``1 / scale``).
    Errors are :func:`~fp8engine.ops.gemm.fp8_mm`'s (dtypes, K / N not multiples of 16)."""
    if not a.is_cuda:
        return _gemm_bias_gelu_reference(a, a_scale_inv, b, b_scale_inv, bias, out_dtype, scale, fp8_dtype, amax)
    from fp8engine.kernels.activation import gelu_fwd

    fused = gemm.fp8_gemm_bias_gelu(Float8Tensor(a, a_scale_inv, out_dtype, kernels=True),
                                    Float8Tensor(b, b_scale_inv, out_dtype, kernels=True),
                                    bias, out_dtype, scale, fp8_dtype, amax)  # eager mode's cuBLASLt epilogue
    if fused is not None:
        h, y = fused
        return h, y.data, y.scale_inv
    # eager mode's fallback: _scaled_mm with the bias, then the activation kernel writes FP8 directly
    h = gemm.fp8_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=bias.to(out_dtype), use_fast_accum=True,
                    kernels=True)
    _, y8, scale_inv = gelu_fwd(h, scale=scale, fp8_dtype=fp8_dtype, amax_out=amax)
    return h, y8, scale_inv


def _gemm_bias_gelu_reference(a, a_scale_inv, b, b_scale_inv, bias, out_dtype, scale, fp8_dtype, amax):
    """:func:`gemm_bias_gelu_fp8` in plain PyTorch (eager CPU mode's composition, same bits): :func:`fp8_mm` with
    the bias, ``F.gelu`` (tanh) of the rounded ``h``, the torch FP8 cast recording the amax."""
    h = gemm.fp8_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=bias.to(out_dtype), use_fast_accum=True)
    y = quantize_torch(F.gelu(h, approximate="tanh"), fp8_dtype, scale.reshape(1).float(), amax)
    return h, y.data, y.scale_inv


@gemm_bias_gelu_fp8.register_fake
def _(a, a_scale_inv, b, b_scale_inv, bias, out_dtype, scale, fp8_dtype, amax):
    m, n = a.shape[0], b.shape[0]
    return a.new_empty((m, n), dtype=out_dtype), a.new_empty((m, n), dtype=fp8_dtype), _scale_inv_like(scale)


@kernel_op("mm_accumulate_fp8", mutates_args=("out",))
def mm_accumulate_fp8(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                      out: torch.Tensor, pad_inner: bool) -> None:
    """``out += (a * a_scale_inv) @ (b * b_scale_inv).T`` in place, ``out [M, N]`` float32 (``main_grad``): on CUDA
    :func:`~fp8engine.ops.gemm.fp8_mm_accumulate` (cuBLASLt with beta = 1, or its ``_scaled_mm`` + ``add_``
    fallback), elsewhere ``out.add_`` of :func:`~fp8engine.ops.gemm.fp8_mm` in fp32. Operands, ``pad_inner`` and
    errors as :func:`~fp8engine.ops.gemm.fp8_mm_accumulate`."""
    if out.is_cuda:
        gemm.fp8_mm_accumulate(a, a_scale_inv, b, b_scale_inv, out, pad_inner=pad_inner, kernels=True)
    else:
        _mm_accumulate_reference(a, a_scale_inv, b, b_scale_inv, out, pad_inner)


def _mm_accumulate_reference(a, a_scale_inv, b, b_scale_inv, out, pad_inner):
    """:func:`mm_accumulate_fp8` in plain PyTorch: ``out.add_`` of :func:`fp8_mm` in fp32 (eager CPU mode's)."""
    out.add_(gemm.fp8_mm(a, a_scale_inv, b, b_scale_inv, torch.float32, pad_inner=pad_inner))


@mm_accumulate_fp8.register_fake
def _(a, a_scale_inv, b, b_scale_inv, out, pad_inner):
    return None
