"""The cast kernels as ``torch.library`` custom ops, for :class:`~fp8engine.fp8.quantizer.Quantizer` casts traced by
``torch.compile`` (the other kernel ops, and why: :mod:`fp8engine.ops.kernel_ops`, which re-exports these).

:func:`cast_fp8` and :func:`cast_transpose_dbias_fp8` run :mod:`fp8engine.kernels.cast` on CUDA and its
plain-PyTorch references elsewhere, with the same bits; they declare the amax slot they max-accumulate into
(``mutates_args``, optional) and have fake implementations, so AOTAutograd functionalizes the mutation. Outputs a
call does not produce are empty ``[0]`` tensors (a custom op returns tensors, never aliases of its inputs).
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from fp8engine.fp8.library import kernel_op

__all__ = ["cast_fp8", "cast_transpose_dbias_fp8", "transpose_fp8", "compiled_kernel_ops"]

_TRITON = importlib.util.find_spec("triton") is not None


def compiled_kernel_ops(x: torch.Tensor) -> bool:
    """True when code traced by ``torch.compile`` should call the custom ops of this module for ``x``: while
    compiling, for a CUDA tensor, with Triton installed."""
    return torch.compiler.is_compiling() and x.is_cuda and _TRITON


def _cast_launchers(device: torch.device):
    from fp8engine.kernels import cast as kc

    if device.type == "cuda":
        return kc.cast_to_fp8, kc.cast_transpose_dbias, kc.transpose_fp8
    return kc.cast_to_fp8_reference, kc.cast_transpose_dbias_reference, kc.transpose_fp8_reference


def _scale_inv_like(scale: torch.Tensor) -> torch.Tensor:
    """The fake (meta) ``scale_inv [1]`` of a cast op: float32 whatever ``scale``'s dtype, as the kernels write it
    (current scaling passes its amax in x's dtype as the scale operand, ``Quantizer._kernel_args``)."""
    return scale.new_empty((1,), dtype=torch.float32)


def _none_as_empty(t: Optional[torch.Tensor], like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return like.new_empty((0,), dtype=dtype or like.dtype) if t is None else t


@kernel_op("cast_fp8", mutates_args=("amax",))
def cast_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, amax: Optional[torch.Tensor],
             transpose: bool, scale_from_amax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` cast to FP8 (:func:`fp8engine.kernels.cast.cast_to_fp8`): ``(data, data_t, scale_inv)``.

    Args:
        x: ``[*, N]`` bf16 / fp16 / fp32, contiguous.
        scale: ``[1]`` float32: the scale (delayed scaling), or with ``scale_from_amax`` the amax the kernel derives
            ``fp8_max / amax`` from on the device (current scaling; 1.0 where it is 0 or not finite).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        amax: ``[1]`` float32 max-accumulated with ``max |x|`` in place, or None (nothing recorded).
        transpose: also write the ``[N, M]`` transposed copy.
    Returns:
        ``data`` like ``x`` in ``fp8_dtype``; ``data_t [N, M]`` (``[0]`` without ``transpose``); ``scale_inv [1]``
        float32. Errors are the launcher's."""
    data, data_t, scale_inv = _cast_launchers(x.device)[0](x, scale, fp8_dtype, amax, transpose=transpose,
                                                             scale_from_amax=scale_from_amax)
    return data, _none_as_empty(data_t, data), scale_inv


@cast_fp8.register_fake
def _(x, scale, fp8_dtype, amax, transpose, scale_from_amax):
    n = x.shape[-1] if x.dim() else 1
    rows = x.numel() // n if n else 0
    data_t = x.new_empty((n, rows) if transpose else (0,), dtype=fp8_dtype)
    return x.new_empty(x.shape, dtype=fp8_dtype), data_t, _scale_inv_like(scale)


@kernel_op("cast_transpose_dbias_fp8", mutates_args=("amax",))
def cast_transpose_dbias_fp8(dy: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                             amax: Optional[torch.Tensor], scale_from_amax: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gradient ``dy [M, N]`` cast to FP8 in both layouts with its column sums
    (:func:`fp8engine.kernels.cast.cast_transpose_dbias`): ``(data [M, N], data_t [N, M], scale_inv [1],
    dbias [N] in dy.dtype)``; ``scale``, ``amax``, ``scale_from_amax`` as :func:`cast_fp8`."""
    return _cast_launchers(dy.device)[1](dy, scale, fp8_dtype, amax, scale_from_amax=scale_from_amax)


@cast_transpose_dbias_fp8.register_fake
def _(dy, scale, fp8_dtype, amax, scale_from_amax):
    n = dy.shape[-1]
    rows = dy.numel() // n if n else 0
    return (dy.new_empty(dy.shape, dtype=fp8_dtype), dy.new_empty((n, rows), dtype=fp8_dtype),
            _scale_inv_like(scale), dy.new_empty((n,)))


@kernel_op("transpose_fp8")
def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """The ``[N, M]`` transpose of FP8 ``data [*, N]`` (leading dims flattened into ``M``), contiguous
    (:func:`fp8engine.kernels.cast.transpose_fp8`), for :meth:`~fp8engine.fp8.float8_tensor.Float8Tensor.transpose_2d`
    in a ``torch.compile`` trace on CUDA (faster than Inductor's transpose: 0.61 against 0.90 ms per gpt2-124m step,
    H100, ``python tools/step_profile.py --model gpt2-124m --mode fp8-delayed-compile --kernels``). Errors are the
    launcher's."""
    return _cast_launchers(data.device)[2](data.contiguous())


@transpose_fp8.register_fake
def _(data):
    n = data.shape[-1] if data.dim() else 1
    rows = data.numel() // n if n else 0
    return data.new_empty((n, rows))
