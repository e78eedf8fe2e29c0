"""``fp8engine.Linear``: ``torch.nn.Linear`` whose GEMMs run in FP8 inside ``autocast``."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fp8engine.modules.base import FP8Module
from fp8engine.ops.block_linear import block_fp8_linear
from fp8engine.ops.init import default_init
from fp8engine.ops.linear import LINEAR_ROLES, fp8_linear, linear_main_grad

__all__ = ["Linear", "default_init", "autocast_input"]


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast to ``torch.autocast``'s dtype when autocast is on for its device and ``x`` is another floating
    dtype (e.g. an fp32 norm output in a ``transformers`` model under ``torch.autocast(dtype=torch.bfloat16)``),
    as ``torch.nn.functional.linear`` would; else ``x`` itself."""
    device_type = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(device_type):
        return x
    dtype = torch.get_autocast_dtype(device_type)
    return x if x.dtype == dtype else x.to(dtype)


class Linear(FP8Module):
    """``y = x @ weight.T + bias``, in FP8 inside :func:`fp8engine.autocast`.

    Outside autocast it is ``torch.nn.functional.linear``, bit for bit. Inside, fprop/dgrad/wgrad run as FP8
    GEMMs, the scaling state (``fp8_state``: amax history and scale of input, weight, grad_output) lives in
    buffers, so ``state_dict`` round-trips it. Under ``Float8BlockScaling`` the three GEMMs are block-scaled
    (:func:`fp8engine.ops.block_linear.block_fp8_linear`: input and gradient 1 x 128 tiles, weight 128 x 128
    blocks, scales just in time; the ``fp8_state`` buffers are not used).

    Args:
        in_features, out_features: ``K`` and ``N``; FP8 needs both to be multiples of 16, of 128 under
            ``Float8BlockScaling`` (``ValueError`` at the first FP8 forward otherwise).
        bias: add a learnable ``[N]`` bias.
        params_dtype: dtype of weight and bias (default ``torch.get_default_dtype()``).
        device: where to allocate parameters and state.
        init_method: ``fn(weight)`` initialising the ``[N, K]`` weight in place (bias then zeroed, as in
            Megatron); default ``torch.nn.Linear``'s initialisation.
        fuse_wgrad_accumulation: weight gradients are added to an fp32 ``weight.main_grad`` that the user
            allocates; ``weight.grad`` stays None. Under FP8 on CUDA the wgrad GEMM accumulates into
            ``main_grad`` itself (cuBLASLt, beta = 1; ``fp8engine.ops.gemm.fp8_mm_accumulate``).
    Shapes: input ``[*, K]`` -> output ``[*, N]`` in the input's dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, params_dtype=None, device=None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None, fuse_wgrad_accumulation: bool = False):
        super().__init__(LINEAR_ROLES, [(in_features, out_features)], device=device)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear needs positive in_features/out_features, got {in_features}, {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        with torch.no_grad():
            if init_method is None:
                default_init(self.weight, self.bias)
            else:
                init_method(self.weight)
                if self.bias is not None:
                    self.bias.zero_()

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``x``: ``[*, in_features]``; ``is_first_microbatch``: FP8 weight caching (see :class:`FP8WeightCache`)."""
        return self._linear(x, self.bias, self.fp8_begin(), is_first_microbatch)

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor], quantizers, is_first_microbatch: Optional[bool],
                comm=None):
        """The GEMM with a given bias under ``quantizers`` (:meth:`fp8_begin`'s result). ``comm``: the per-tensor
        FP8 op's tensor-parallel communication (a :class:`~fp8engine.ops.comm.LinearComm`; ignored by the
        high-precision and block-scaled paths, whose callers communicate around them)."""
        if quantizers is None:
            if self.fuse_wgrad_accumulation and torch.is_grad_enabled():
                return linear_main_grad(x, self.weight, bias)
            return F.linear(x, self.weight, bias)
        x = autocast_input(x)
        q = quantizers[0]
        w_fp8 = self.fp8_weight("weight", self.weight, q.weight, is_first_microbatch)
        if q.input.is_block:
            return block_fp8_linear(x, self.weight, bias, q, w_q=w_fp8, fuse_wgrad=self.fuse_wgrad_accumulation)
        return fp8_linear(x, self.weight, bias, q, w_fp8=w_fp8, fuse_wgrad=self.fuse_wgrad_accumulation, comm=comm)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
