"""Attention through PyTorch's fused SDPA kernels called directly, without an autograd graph of their own: the
fused FP8 layer step (:mod:`fp8engine.ops.layer`) keeps the forward's outputs and calls the backward kernel itself.

Why: ``torch.nn.functional.scaled_dot_product_attention`` inside a hand-written backward needs its own autograd
node, replayed with ``torch.autograd.grad`` (leaves to detach, a graph to record, an engine run per layer step),
where the backend ops cost one dispatch each (``python tools/layer_host_time.py --sections delayed``).

What runs: the backend ``torch._fused_sdp_choice`` picks for these inputs -- the choice SDPA itself makes, under the
same ``torch.nn.attention.sdpa_kernel`` / ``torch.backends.cuda`` settings -- and, for the backends below, the ATen
op SDPA calls for it, with the arguments SDPA's autograd formula (``derivatives.yaml``) passes to its backward, so the
same kernels run on the same tensors:

- cuDNN (CUDA): ``_scaled_dot_product_cudnn_attention`` / ``..._backward``;
- flash (CUDA): ``_scaled_dot_product_flash_attention`` / ``..._backward`` (head dim a multiple of 8: SDPA would pad
  it first);
- flash (CPU), float32 inputs: ``_scaled_dot_product_flash_attention_for_cpu`` / ``..._backward`` (its bf16 / fp16
  kernel raised ``pack_vnni2 is only supported when avx512 is supported`` on a host without AVX-512, torch 2.11).

Everything else -- the math or memory-efficient backends, dropout (its RNG draws stay SDPA's), grouped-query
``enable_gqa`` -- returns None from :func:`sdpa_fwd` and the caller records SDPA as an autograd node instead (no
explicit ``scale`` or mask: the fused layer step has neither). Numerics: SDPA's (same op, same arguments).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["sdpa_fwd", "sdpa_bwd"]

_aten = torch.ops.aten
_FLASH, _CUDNN = 1, 3  # torch.nn.attention.SDPBackend values, as _fused_sdp_choice returns them


def sdpa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, dropout_p: float = 0.0,
             enable_gqa: bool = False, grad: bool = True) -> Optional[tuple]:
    """Attention ``softmax(q k^T / sqrt(d) + causal mask) v`` by the fused backend SDPA would pick, or None where it
    is not one this module calls (module docstring).

    Args:
        q, k, v: ``[b, heads, s, d]`` (any strides SDPA takes), one dtype, on one device; no gradient tracking.
        is_causal: lower-triangular mask (SDPA's ``is_causal``). dropout_p, enable_gqa: SDPA's; any dropout or GQA
            returns None.
        grad: keep what the backward needs (the log-sum-exp); False for inference.
    Returns:
        ``(out [b, heads, s, d] in q's dtype, saved)`` where ``saved`` goes to :func:`sdpa_bwd`, or None.
    """
    if dropout_p != 0.0 or enable_gqa:
        return None
    backend = torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal)
    if q.is_cuda:
        if backend == _CUDNN:
            r = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, grad, 0.0, is_causal, False)
            return r[0], (_CUDNN, q, k, v, is_causal, r[:8]) if grad else None
        if backend == _FLASH and q.shape[-1] % 8 == 0:
            r = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False)
            return r[0], (_FLASH, q, k, v, is_causal, r[:8]) if grad else None
        return None
    if backend == _FLASH and q.device.type == "cpu" and q.dtype == torch.float32:
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)
        return out, (_FLASH, q, k, v, is_causal, (out, lse)) if grad else None
    return None


def sdpa_bwd(saved: tuple, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of a :func:`sdpa_fwd` call given the output's gradient ``dout [b, heads, s, d]``; the
    shapes of q, k, v. The backward op SDPA's autograd formula calls, with the forward's saved outputs."""
    backend, q, k, v, is_causal, r = saved
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = r
        if backend == _CUDNN:
            return _aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, is_causal)
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset)
    out, lse = r
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, is_causal)
