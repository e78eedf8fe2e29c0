"""What every FP8 module shares: its scaling state, the per-forward FP8 set-up, and FP8 weight caching."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from fp8engine.fp8.autocast import get_fp8_context
from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import LinearQuantizers, Quantizer, get_quantizers
from fp8engine.fp8.state import ScalingState
from fp8engine.ops.block_gemm import check_block_dims
from fp8engine.ops.gemm import check_gemm_dims

__all__ = ["FP8Module", "FP8WeightCache", "FP8_INPUT_DTYPES", "check_fp8_input"]


#: Input dtypes of the FP8 GEMMs (any floating dtype when ``torch.autocast`` casts it first:
#: :func:`fp8engine.modules.linear.autocast_input`).
FP8_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_fp8_input(x: torch.Tensor, owner: str) -> None:
    """``TypeError`` unless ``x`` may enter an FP8 GEMM: its dtype one of :data:`FP8_INPUT_DTYPES`, or floating
    under ``torch.autocast`` (which casts it). Callers test ``x.dtype not in FP8_INPUT_DTYPES`` first (the hot path
    pays one tuple lookup)."""
    if x.dtype in FP8_INPUT_DTYPES or (x.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
        return
    raise TypeError(f"{owner}: the FP8 GEMM takes float32, bfloat16 or float16 input, got {x.dtype}; cast the input "
                    "(e.g. x.float()) -- an integer tensor would come back as integer garbage")


class FP8WeightCache:
    """FP8 copies of weights for gradient accumulation (``is_first_microbatch``, TransformerEngine's semantics).

    ``None``: cast every call, cache nothing. ``True``: cast and keep. ``False``: reuse what the first
    micro-batch kept (no cast, no amax recorded).
    """

    def __init__(self):
        self._cache: dict[str, Float8Tensor] = {}

    def get(self, name: str, weight: torch.Tensor, quantizer: Quantizer, is_first_microbatch: Optional[bool],
            transpose: bool) -> Float8Tensor:
        if is_first_microbatch is False:
            cached = self._cache.get(name)
            if cached is None:
                raise ValueError(f"is_first_microbatch=False but no FP8 copy of {name!r} is cached; pass "
                                 "is_first_microbatch=True on the first micro-batch of the step")
            return cached
        w_fp8 = quantizer.quantize(weight, transpose=transpose)
        if is_first_microbatch:
            self._cache[name] = w_fp8
        else:
            self._cache.pop(name, None)
        return w_fp8

    def discard(self, name: str) -> None:
        """Drop the copy of ``name`` (what :meth:`get` does when it casts with ``is_first_microbatch=None``)."""
        self._cache.pop(name, None)

    def clear(self) -> None:
        self._cache.clear()


class FP8Module(nn.Module):
    """Base of modules with FP8 GEMMs: owns ``fp8_state`` (a :class:`ScalingState`) and the weight cache.

    Subclasses call :meth:`fp8_begin` at the top of ``forward``; it returns None outside FP8 regions, else one
    :class:`LinearQuantizers` per GEMM (``roles`` holds ``input, weight, grad_output`` per GEMM, in the order of
    ``gemm_dims``). Under :class:`~fp8engine.recipe.Float8BlockScaling` its entries are
    :class:`~fp8engine.fp8.block_quantizer.BlockQuantizer` objects, which the same ops run (their FP8 tensors carry
    the block-scaled GEMMs): the subclasses do not ask which recipe is active.
    """

    def __init__(self, roles: Sequence[str], gemm_dims: Sequence[tuple[int, int]], device=None):
        super().__init__()
        self.fp8_state = ScalingState(roles, device=device)
        self._gemm_dims = tuple(gemm_dims)
        self._fp8_dims_checked = False
        self._block_dims_checked = False
        self._weight_cache = FP8WeightCache()

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()`` ...), then drop the cached FP8 weights: they were
        cast from the weights as they were (old device, old dtype). A following ``is_first_microbatch=False`` call
        raises the weight cache's ValueError instead of using them; ``fp8_state`` keeps its float32 buffers
        (:meth:`ScalingState._apply <fp8engine.fp8.state.ScalingState._apply>`)."""
        out = super()._apply(fn, recurse)
        self._weight_cache.clear()
        return out

    def fp8_begin(self) -> Optional[tuple[LinearQuantizers, ...]]:
        """None outside FP8 regions, else the quantizers (class docstring). Checks the GEMM dims once per kind:
        ``ValueError`` naming the dim when one is not a multiple of 16 (of 128 under block scaling)."""
        ctx = get_fp8_context()
        if ctx is None:
            return None
        if torch.compiler.is_compiling():
            # at trace time, without the flag: reading it would guard on it, and its flip re-trace the model once
            self._check_fp8_dims()
        elif not self._fp8_dims_checked:
            self._check_fp8_dims()
            self._fp8_dims_checked = True
        quantizers = get_quantizers(self.fp8_state, ctx)
        if quantizers[0].input.is_block and not self._block_dims_checked:
            check_block_dims(self._gemm_dims, type(self).__name__)
            self._block_dims_checked = True
        return quantizers

    def _check_fp8_dims(self) -> None:
        for k, n in self._gemm_dims:
            check_gemm_dims(k, n, type(self).__name__)

    def fp8_weight(self, name: str, weight: torch.Tensor, quantizer: Quantizer,
                   is_first_microbatch: Optional[bool]) -> Float8Tensor:
        """``weight`` cast by ``quantizer`` (a GEMM's weight role), through the weight cache (``name`` its key): a
        :class:`Float8Tensor`, or under block scaling a ``Float8BlockTensor``."""
        # dgrad needs W^T whenever a backward may run (the input may require grad even if W does not).
        return self._weight_cache.get(name, weight, quantizer, is_first_microbatch,
                                      transpose=torch.is_grad_enabled())
