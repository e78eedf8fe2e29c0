"""The fused Triton kernels as ``torch.library`` custom ops, for code under ``torch.compile``.

Eager code calls the kernels' Python launchers directly (:func:`fp8engine.fp8.float8_tensor.use_kernels`). Dynamo
cannot trace those launchers, so under ``torch.compile`` the ops take their plain-PyTorch path and Inductor
generates the kernels. For the activations that costs time: on the H100 the compiled FP8 layer spent 3.6 ms per step
in Inductor's cast, GELU and amax kernels where eager mode spends 1.5 ms in ours
(``tools/compile_kernel_profile.py``, docs/benchmarks.md). The ops below are opaque to Inductor: the compiled graph
calls our kernels (CUDA) or their plain-PyTorch references (any other device), with the same bits.

Each op declares what it mutates (``mutates_args``: the amax slot it max-accumulates into, a view of
``ScalingState.amax_history`` in a compiled forward or of ``grad_amax`` in a compiled backward) and has a fake
implementation giving the output shapes and dtypes, so AOTAutograd functionalizes the mutation as it does the
reference path's. Only delayed scaling uses them (the scale is known before the kernel runs).
"""
from __future__ import annotations

import importlib.util

import torch

__all__ = ["act_fwd_fp8", "act_bwd_fp8", "ACT_KINDS", "compiled_kernel_ops"]

#: Activations with fused kernels, and the names of their launchers in fp8engine.kernels.activation:
#: (forward, backward + cast-transpose + dbias); the references are the same names + ``_reference``.
ACT_KINDS = {"gelu": ("gelu_fwd", "gelu_bwd_cast_transpose"), "relu": ("relu_fwd", "relu_bwd_cast_transpose"),
             "swiglu": ("swiglu_fwd", "swiglu_bwd_cast_transpose")}

_TRITON = importlib.util.find_spec("triton") is not None


def compiled_kernel_ops(x: torch.Tensor) -> bool:
    """True when code traced by ``torch.compile`` should call the custom ops of this module for ``x``: while
    compiling, for a CUDA tensor, with Triton installed."""
    return torch.compiler.is_compiling() and x.is_cuda and _TRITON


def _launcher(kind: str, which: int, device: torch.device):
    from fp8engine.kernels import activation as ka

    if kind not in ACT_KINDS:
        raise ValueError(f"activation must be one of {sorted(ACT_KINDS)}, got {kind!r}")
    name = ACT_KINDS[kind][which]
    return getattr(ka, name if device.type == "cuda" else name + "_reference")


def _act_out_shape(h: torch.Tensor, kind: str) -> tuple:
    n = h.shape[-1] // 2 if kind == "swiglu" else h.shape[-1]
    return (*h.shape[:-1], n)


@torch.library.custom_op("fp8engine::act_fwd_fp8", mutates_args=("amax",))
def act_fwd_fp8(h: torch.Tensor, kind: str, scale: torch.Tensor, fp8_dtype: torch.dtype,
                amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``act(h)`` written in FP8: ``(y8, scale_inv)``.

    Args:
        h: ``[*, D]`` bf16 / fp16 / fp32, contiguous (SwiGLU: ``D = 2 N``, ``[gate | up]``).
        kind: ``"gelu"`` (tanh approximation), ``"relu"`` or ``"swiglu"``.
        scale: ``[1]`` float32 FP8 scale (delayed scaling's, for this role).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        amax: ``[1]`` float32, max-accumulated with ``max |act(h)|`` in place.
    Returns:
        ``y8 [*, D']`` in ``fp8_dtype`` (``D' = N`` for SwiGLU, else ``D``) and ``scale_inv [1]`` float32 (``1 / scale``).
    Errors are the launcher's (:mod:`fp8engine.kernels.activation`)."""
    _, y8, scale_inv = _launcher(kind, 0, h.device)(h, scale=scale, fp8_dtype=fp8_dtype, amax_out=amax)
    return y8, scale_inv


@act_fwd_fp8.register_fake
def _(h, kind, scale, fp8_dtype, amax):
    return h.new_empty(_act_out_shape(h, kind), dtype=fp8_dtype), scale.new_empty((1,))


@torch.library.custom_op("fp8engine::act_bwd_fp8", mutates_args=("amax",))
def act_bwd_fp8(da: torch.Tensor, h: torch.Tensor, kind: str, scale: torch.Tensor, fp8_dtype: torch.dtype,
                amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dh = da * act'(h)`` cast to FP8 with its transpose and column sums: ``(dh8, dh8_t, scale_inv, dbias)``.

    Args:
        da: ``[*, D']`` gradient of the activation output, ``h``'s dtype, contiguous.
        h: ``[*, D]`` the activation's input, contiguous.
        kind, scale, fp8_dtype: as :func:`act_fwd_fp8` (the backward role's scale and format).
        amax: ``[1]`` float32, max-accumulated with ``max |dh|`` in place.
    Returns:
        ``dh8 [*, D]`` and ``dh8_t [D, M]`` (``M`` = rows of ``h``) in ``fp8_dtype``, ``scale_inv [1]`` float32,
        ``dbias [D]`` in ``da``'s dtype (fp32-accumulated column sums of ``dh``)."""
    dh8, dh8_t, scale_inv, dbias = _launcher(kind, 1, h.device)(da, h, scale, fp8_dtype, amax)
    return dh8, dh8_t, scale_inv, dbias


@act_bwd_fp8.register_fake
def _(da, h, kind, scale, fp8_dtype, amax):
    rows = h.numel() // h.shape[-1] if h.shape[-1] else 0
    return (h.new_empty(h.shape, dtype=fp8_dtype), h.new_empty((h.shape[-1], rows), dtype=fp8_dtype),
            scale.new_empty((1,)), da.new_empty((h.shape[-1],)))
