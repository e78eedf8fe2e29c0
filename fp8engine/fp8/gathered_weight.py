"""``GatheredFP8Weight``: an unsharded weight that arrived as FP8 bytes (FSDP2's FP8 all-gather,
:mod:`fp8engine.parallel.fsdp_fp8`), used by the GEMMs as it is: torchao's ``Float8TrainingTensor`` as FSDP2's
unsharded parameter, on fp8engine's scaling state.

A ``torch.Tensor`` of the parameter's logical shape ``[N, K]`` and dtype (FSDP2's ``param_dtype``, e.g. bf16)
holding the gathered FP8 bits, their ``scale_inv`` and the whole weight's ``amax`` (the MAX of the shards' amaxes,
gathered with the bytes). :meth:`FP8Module.fp8_weight <fp8engine.modules.base.FP8Module.fp8_weight>` turns it into a
:class:`~fp8engine.fp8.float8_tensor.Float8Tensor` of the same bits (no re-cast) and, under delayed scaling,
max-accumulates ``amax`` into the weight's amax-history slot, as its own cast would have. Every other op sees the
dequantized weight. Gradients are plain tensors of the logical dtype (FSDP2 reduce-scatters them as for any
parameter).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fp8engine.fp8.float8_tensor import Float8Tensor

__all__ = ["GatheredFP8Weight"]

aten = torch.ops.aten


class GatheredFP8Weight(torch.Tensor):
    """FP8 bits + ``scale_inv`` + whole-weight ``amax`` standing in for a high-precision weight (module docstring).

    Args:
        data: ``[N, K]`` ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, contiguous.
        scale_inv: ``[1]`` float32 on ``data``'s device.
        amax: ``[1]`` float32, ``max |w|`` of the high-precision weight whose cast ``data`` is.
        dtype: the logical (high-precision) dtype.
        kernels: dequantize with the Triton kernel (True) or the plain-PyTorch reference.
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype,
                kernels: bool):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device,
                                                   requires_grad=False)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype,
                 kernels: bool):
        self._data, self._scale_inv, self._amax, self._kernels = data, scale_inv, amax, kernels

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"GatheredFP8Weight(shape={tuple(self.shape)}, fp8_dtype={self._data.dtype}, dtype={self.dtype})"

    def refill(self, scale_inv: torch.Tensor, amax: torch.Tensor) -> None:
        """New ``scale_inv`` and ``amax`` for bits FSDP2 wrote again into ``data``'s storage (a later all-gather);
        FP8 tensors made from the earlier ones keep theirs."""
        self._scale_inv, self._amax = scale_inv, amax

    def dequantize(self) -> torch.Tensor:
        """``data * scale_inv`` in fp32, rounded once into the logical dtype: ``[N, K]``, a new tensor."""
        from fp8engine.kernels.cast import dequantize_fp8, dequantize_fp8_reference

        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return (dequantize_fp8 if self._kernels else dequantize_fp8_reference)(self._data, self._scale_inv, out)

    def float8(self, quantizer, record_amax: bool) -> Float8Tensor:
        """The bits as the GEMM operand of ``quantizer``'s weight role, and (``record_amax`` and a delayed-scaling
        quantizer) the weight's amax max-accumulated into the role's history slot.

        Raises:
            ValueError: ``quantizer`` is block-scaled, or its FP8 format is not the gathered one.
        """
        if quantizer.is_block or quantizer.fp8_dtype != self._data.dtype:
            raise ValueError(f"an FP8-all-gathered weight ({self._data.dtype}, per-tensor scale) cannot be the "
                             f"operand of a {'block-scaled' if quantizer.is_block else str(quantizer.fp8_dtype)} "
                             "weight role; gather it in bf16 (shard_model(..., fp8_all_gather=False))")
        if record_amax and quantizer.amax is not None:
            torch.maximum(quantizer.amax, self._amax, out=quantizer.amax)
        return Float8Tensor(self._data, self._scale_inv, self.dtype, kernels=quantizer.kernels)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        t = args[0] if args else None
        if isinstance(t, cls) and (func is aten.detach.default or _is_identity_view(func, t, args[1:], kwargs)):
            # nn.Parameter(...) detaches; FSDP2 views its unsharded tensor in the parameter's shape: the same bits
            return cls(t._data, t._scale_inv, t._amax, t.dtype, t._kernels)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs or {}))
        return func(*args, **kwargs)


def _is_identity_view(func, t: torch.Tensor, rest: tuple, kwargs) -> bool:
    """Whether ``func(t, *rest)`` is ``t`` itself: ``as_strided`` to its own contiguous shape at offset 0, or
    ``view`` to its own shape."""
    if kwargs:
        return False
    if func is aten.as_strided.default:
        size, stride, offset = (list(rest) + [0])[:3]
        return (tuple(size) == tuple(t.shape) and tuple(stride) == tuple(t._data.stride())
                and (offset or 0) == 0)
    return func is aten.view.default and tuple(rest[0]) == tuple(t.shape)
