"""``Float8Tensor``: FP8 bits together with the scale-inverse that dequantizes them, and ``quantize``.

The scale-inverse belongs to the data: it is computed by the op that writes the FP8 bits, into a tensor of its
own, so later changes to a recipe's ``scale`` buffer (even in place) never change how an existing
``Float8Tensor`` dequantizes. A plain container (not a ``torch.Tensor`` subclass): no ``__torch_dispatch__``
overhead in eager mode, a simple object for ``torch.compile``.

Its GEMMs (``fprop``, ``dgrad``, ``wgrad``, ``wgrad_into``) are attached by :mod:`fp8engine.ops.linear`; the
block-scaled :class:`~fp8engine.fp8.block_tensor.Float8BlockTensor` has the same methods
(:mod:`fp8engine.ops.block_gemm`), so an op runs whichever FP8 tensor its quantizer returned.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Optional

import torch

from fp8engine.fp8.dtypes import FP8_DTYPES, HIGH_PRECISION_DTYPES, fp8_max_of

__all__ = ["Float8Tensor", "quantize", "quantize_current", "current_scale", "use_kernels", "kernels_forced"]


class Float8Tensor:
    """FP8 data with its ``scale_inv``: ``x ≈ data.float() * scale_inv``.

    Attributes:
        data: FP8 tensor (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``), any shape ``[*, N]``, row-major.
        scale_inv: 1-element float32 tensor, ``1 / scale`` at the time the bits were written.
        dtype: the logical high-precision dtype (what ``dequantize()`` returns by default).
        data_t: optional transposed copy ``[N, M]`` of ``data`` viewed as 2-D ``[M, N]`` (for the GEMMs that
            need the other layout: dgrad needs ``W^T``, wgrad needs ``X^T`` and ``dY^T``), or None.
        kernels: the backend of this tensor's transpose and GEMMs, set by the op that wrote it from its quantizer's
            (:attr:`fp8engine.fp8.quantizer.Quantizer.kernels`): True runs the Triton transpose and the cuBLASLt
            GEMM calls, False ``torch`` ops (``torch._scaled_mm``).
    """

    __slots__ = ("data", "scale_inv", "dtype", "_data_t", "kernels")

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                 data_t: Optional[torch.Tensor] = None, kernels: bool = False):
        if data.dtype not in FP8_DTYPES.values():
            raise TypeError(f"Float8Tensor data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
        self.data, self.scale_inv, self.dtype = data, scale_inv, dtype
        self._data_t, self.kernels = data_t, kernels

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def transpose_2d(self) -> torch.Tensor:
        """FP8 bits of the 2-D transpose ``[N, M]`` (made once, then kept)."""
        if self._data_t is None:
            if self.kernels:
                from fp8engine.kernels.cast import transpose_fp8

                self._data_t = transpose_fp8(self.data.contiguous())
                return self._data_t
            import fp8engine.fp8.cast_ops as cast_ops

            if cast_ops.compiled_kernel_ops(self.data):  # traced by torch.compile on CUDA: the kernel as an op
                self._data_t = cast_ops.transpose_fp8(self.data)
            else:
                self._data_t = self.data.reshape(-1, self.data.shape[-1]).t().contiguous()
        return self._data_t

    def t_operand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the dgrad / wgrad GEMMs take for this tensor's transpose: ``(transpose_2d(), scale_inv)``."""
        return (self.transpose_2d() if self._data_t is None else self._data_t), self.scale_inv

    #: (a per-tensor FP8 tensor can always make its transpose; a 1 x 128 block-scaled one cannot)
    lacks_transpose = False

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """High-precision copy ``data * scale_inv`` in ``dtype`` (default: the logical dtype)."""
        return (self.data.float() * self.scale_inv).to(dtype or self.dtype)

    def __repr__(self) -> str:
        return (f"Float8Tensor(shape={tuple(self.data.shape)}, fp8_dtype={self.fp8_dtype}, dtype={self.dtype}, "
                f"scale_inv={self.scale_inv.item() if self.scale_inv.numel() == 1 else self.scale_inv})")


def _check_input(x: torch.Tensor, fp8_dtype: torch.dtype) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"quantize takes float32, bfloat16 or float16 input, got {x.dtype}")
    if fp8_dtype not in FP8_DTYPES.values():
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")


@functools.lru_cache(maxsize=None)
def _kernels_on(device: torch.device) -> bool:
    from fp8engine.kernels import kernels_available

    return kernels_available(device)


#: Set by :func:`kernels_forced` (tests): run the Triton kernels on CPU tensors too (under TRITON_INTERPRET=1).
_FORCE_KERNELS: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8engine_force_kernels", default=False)


def use_kernels(x: torch.Tensor) -> bool:
    """The one backend predicate of the package: True when an op on ``x`` runs the Triton kernels (and cuBLASLt
    where it applies), False when it runs the plain-PyTorch reference. True for a CUDA tensor whose device can run
    the kernels (``kernels_available``, cached per device), and for any tensor inside :func:`kernels_forced`; False
    under ``torch.compile`` (Dynamo does not trace into the Triton launchers or the ctypes cuBLASLt calls). Asked
    once where a call enters (:func:`~fp8engine.fp8.quantizer.get_quantizers`, whose quantizers carry it as
    ``kernels``; else :func:`~fp8engine.fp8.quantizer.call_kernels`)."""
    if torch.compiler.is_compiling():
        return False
    if x.is_cuda:
        return _kernels_on(x.device)
    return _FORCE_KERNELS.get()


@contextlib.contextmanager
def kernels_forced(on: bool = True):
    """Within the block, :func:`use_kernels` is True for CPU tensors too (``on=False`` restores the default inside
    an outer forced block). Tests use it to run the kernel code paths on CPU under ``TRITON_INTERPRET=1``."""
    token = _FORCE_KERNELS.set(bool(on))
    try:
        yield
    finally:
        _FORCE_KERNELS.reset(token)


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, scale: torch.Tensor, *,
             amax_out: Optional[torch.Tensor] = None, transpose: bool = False) -> Float8Tensor:
    """Cast ``x`` to FP8 with a given per-tensor ``scale``: ``data = saturate(x * scale)``, rounded to nearest even.

    Args:
        x: ``[*, N]`` float32/bfloat16/float16.
        fp8_dtype: ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344).
        scale: 1-element float32 tensor; multiply by it to go into the FP8 range.
        amax_out: optional 1-element float32 tensor (e.g. ``amax_history[row, 0:1]``); ``max(|x|)`` is
            max-accumulated into it (a NaN in ``x`` records NaN, which the scale update then ignores).
        transpose: also produce the transposed FP8 copy (``Float8Tensor.data_t``, ``[N, M]``).
    Returns:
        A :class:`Float8Tensor` whose ``scale_inv`` is a new tensor ``1 / scale``.
    Raises:
        TypeError: ``x`` is not a high-precision float tensor or ``fp8_dtype`` is not an FP8 dtype.
    """
    _check_input(x, fp8_dtype)
    scale = scale.reshape(1).float()
    if use_kernels(x):
        from fp8engine.kernels.cast import cast_to_fp8

        data, data_t, scale_inv = cast_to_fp8(x.contiguous(), scale, fp8_dtype, amax_out, transpose=transpose)
        return Float8Tensor(data, scale_inv, x.dtype, data_t, kernels=True)
    return quantize_torch(x, fp8_dtype, scale, amax_out, transpose)


def quantize_torch(x: torch.Tensor, fp8_dtype: torch.dtype, scale: torch.Tensor,
                   amax_out: Optional[torch.Tensor] = None, transpose: bool = False) -> Float8Tensor:
    """The plain-PyTorch path of :func:`quantize` (no checks, no dispatch; ``scale`` a ``[1]`` float32 tensor):
    the reference the cast kernels are tested against and the CPU backend."""
    x = x.detach()
    if amax_out is not None:  # the 0-dim amax in x.dtype is promoted (exactly) to float32 by maximum
        torch.maximum(amax_out, x.abs().amax(), out=amax_out)
    fp8_max = fp8_max_of(fp8_dtype)
    # x (bf16/fp16/fp32) times the [1] float32 scale computes in float32: the same product as x.float() * scale
    data = torch.mul(x, scale).clamp_(-fp8_max, fp8_max).to(fp8_dtype)
    out = Float8Tensor(data, scale.reciprocal(), x.dtype)
    if transpose:
        out.transpose_2d()
    return out


def current_scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Current-scaling scale ``fp8_max / amax`` as a float32 tensor ``[n]`` for ``n`` amaxes (``[1]`` for one; 1.0
    where an amax is 0 or not finite), rounded as torch rounds ``fp8_max / amax``: the reciprocal of the amax times
    fp8_max (the cast kernels' ``scale_from_amax`` path computes the same on the device)."""
    amax = amax.float().reshape(-1)
    ok = (amax > 0) & (amax < float("inf"))
    return torch.where(ok, torch.reciprocal(torch.where(ok, amax, 1.0)) * fp8_max_of(fp8_dtype), 1.0)


def quantize_current(x: torch.Tensor, fp8_dtype: torch.dtype, *, transpose: bool = False,
                     amax: Optional[torch.Tensor] = None) -> Float8Tensor:
    """Current (just-in-time) scaling: ``scale = fp8_max / max(|x|)`` of this very tensor, then :func:`quantize`.

    ``amax`` may be given when it was computed (and, for sharded tensors, reduced across ranks) already.
    """
    _check_input(x, fp8_dtype)
    if amax is None:
        amax = x.detach().abs().amax().float()
    return quantize(x, fp8_dtype, current_scale(amax, fp8_dtype), transpose=transpose)
