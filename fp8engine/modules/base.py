"""What every FP8 module shares: its scaling state, the per-forward FP8 set-up, FP8 weight caching, and FP8 primary
weights (:mod:`fp8engine.modules.fp8_init`)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fp8engine.fp8.autocast import get_fp8_context
from fp8engine.fp8.float8_tensor import Float8Tensor, quantize_current
from fp8engine.fp8.gathered_weight import GatheredFP8Weight
from fp8engine.fp8.quantizer import LinearQuantizers, Quantizer, get_quantizers
from fp8engine.fp8.state import ScalingState
from fp8engine.modules.fp8_init import FP8_PARAM_DTYPES, dequantize_weight, fp8_init_config, to_fp8_param
from fp8engine.ops.block_gemm import check_block_dims
from fp8engine.ops.gemm import check_gemm_dims
from fp8engine.ops.linear import linear_main_grad

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

    FP8 primary weights (:func:`fp8engine.fp8_model_init`): subclasses end ``__init__`` with
    :meth:`_init_fp8_weights` (their GEMM weights' names), which converts those weights inside the region.
    :meth:`fp8_weight` then wraps the stored bytes and :meth:`hp_linear` dequantizes them outside FP8 regions.
    """

    def __init__(self, roles: Sequence[str], gemm_dims: Sequence[tuple[int, int]], device=None):
        super().__init__()
        self.fp8_state = ScalingState(roles, device=device)
        self._gemm_dims = tuple(gemm_dims)
        self._fp8_dims_checked = False
        self._block_dims_checked = False
        self._weight_cache = FP8WeightCache()
        #: names of the GEMM weights (set by :meth:`_init_fp8_weights`)
        self._gemm_weight_names: tuple[str, ...] = ()
        #: FP8 primary weights as Float8Tensors: name -> (the tensors' versions and addresses, Float8Tensor)
        self._stored_fp8: dict = {}

    def _init_fp8_weights(self, names: Sequence[str]) -> None:
        """End of a subclass's ``__init__``: record its GEMM weights' names and, inside an enabled
        :func:`~fp8engine.modules.fp8_init.fp8_model_init`, turn each into an FP8 parameter with its
        ``<name>_scale_inv`` buffer and switch ``fuse_wgrad_accumulation`` on (:mod:`fp8engine.modules.fp8_init`)."""
        self._gemm_weight_names = tuple(names)
        config = fp8_init_config()
        if config is None:
            return
        for name in names:
            to_fp8_param(self, name, config)
        self.fuse_wgrad_accumulation = True

    def fp8_primary_weights(self) -> tuple[str, ...]:
        """Names of the GEMM weights held as FP8 parameters (built under ``fp8_model_init`` and not replaced since
        by a high-precision parameter, e.g. a tied one)."""
        return tuple(n for n in self._gemm_weight_names if getattr(self, n).dtype in FP8_PARAM_DTYPES)

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()`` ...), then drop the cached FP8 weights: they were
        cast from the weights as they were (old device, old dtype). A following ``is_first_microbatch=False`` call
        raises the weight cache's ValueError instead of using them; ``fp8_state`` keeps its float32 buffers
        (:meth:`ScalingState._apply <fp8engine.fp8.state.ScalingState._apply>`), and FP8 primary weights keep their
        FP8 dtype and their float32 ``scale_inv`` (moved to ``fn``'s device, never converted)."""
        keep = {id(t) for n in self.fp8_primary_weights() for t in (getattr(self, n), getattr(self, n + "_scale_inv"))}
        if keep:
            cast = fn

            def fn(t):
                new = cast(t)
                return new if id(t) not in keep or new.dtype == t.dtype else t.to(device=new.device)
        out = super()._apply(fn, recurse)
        self._weight_cache.clear()
        self._stored_fp8.clear()
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """``nn.Module``'s, with GEMM weights converted where the checkpoint and the module differ: a high-precision
        weight loaded into an FP8 primary weight is cast (current scaling: new bytes and ``scale_inv``); an FP8
        weight with its ``<name>_scale_inv`` loaded into a high-precision one is dequantized (the ``scale_inv``
        entry consumed; ``ValueError`` without it). FP8 into FP8 is a plain copy of bytes and ``scale_inv``."""
        for name in self._gemm_weight_names:
            key, param = prefix + name, getattr(self, name)
            value, scale_inv = state_dict.get(key), state_dict.get(key + "_scale_inv")
            if value is None or (value.dtype in FP8_PARAM_DTYPES) == (param.dtype in FP8_PARAM_DTYPES):
                continue
            if param.dtype in FP8_PARAM_DTYPES:
                fp8 = quantize_current(value, param.dtype)
                state_dict[key], state_dict[key + "_scale_inv"] = fp8.data, fp8.scale_inv
            elif scale_inv is not None:
                state_dict[key] = value.float() * scale_inv.float()
                del state_dict[key + "_scale_inv"]
            else:
                raise ValueError(f"{key!r} is an FP8 weight without its {key + '_scale_inv'!r}: its values cannot be "
                                 "recovered; load a checkpoint that has both")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def fp8_begin(self) -> Optional[tuple[LinearQuantizers, ...]]:
        """None outside FP8 regions, else the quantizers (class docstring). Checks the GEMM dims once per kind:
        ``ValueError`` naming the dim when one is not a multiple of 16 (of 128 under block scaling), or under block
        scaling when the module has FP8 primary weights (per-tensor scales)."""
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
            primary = self.fp8_primary_weights()
            if primary:
                raise ValueError(f"{type(self).__name__}.{primary[0]} is an FP8 primary weight (fp8_model_init) with "
                                 "a per-tensor scale; Float8BlockScaling cannot use it: run under DelayedScaling or "
                                 "Float8CurrentScaling")
            self._block_dims_checked = True
        return quantizers

    def _check_fp8_dims(self) -> None:
        for k, n in self._gemm_dims:
            check_gemm_dims(k, n, type(self).__name__)

    def fp8_weight(self, name: str, weight: torch.Tensor, quantizer: Quantizer,
                   is_first_microbatch: Optional[bool]) -> Float8Tensor:
        """``weight`` cast by ``quantizer`` (a GEMM's weight role), through the weight cache (``name`` its key): a
        :class:`Float8Tensor`, or under block scaling a ``Float8BlockTensor``. An FP8 primary weight is not cast:
        :meth:`_stored_fp8_weight`; nor is a weight FSDP2 all-gathered in FP8 (:class:`GatheredFP8Weight`: its bits
        as they came, its amax recorded unless ``is_first_microbatch`` is False)."""
        if isinstance(weight, GatheredFP8Weight):
            return weight.float8(quantizer, record_amax=is_first_microbatch is not False)
        if weight.dtype in FP8_PARAM_DTYPES:
            return self._stored_fp8_weight(name, weight, quantizer)
        # dgrad needs W^T whenever a backward may run (the input may require grad even if W does not).
        return self._weight_cache.get(name, weight, quantizer, is_first_microbatch,
                                      transpose=torch.is_grad_enabled())

    def _stored_fp8_weight(self, name: str, weight: torch.Tensor, quantizer: Quantizer) -> Float8Tensor:
        """The FP8 primary weight ``name`` ``[N, K]`` as a :class:`Float8Tensor` of its own bytes and
        ``<name>_scale_inv`` (logical dtype float32; the quantizer's backend for its transpose), built once per
        value: kept until either tensor changes (their version counters and addresses, and the backend, are the
        key), with the transpose dgrad makes. No amax is recorded for it.

        Raises:
            ValueError: when ``fuse_wgrad_accumulation`` was switched off (the wgrad has nowhere to go but
                ``main_grad``). (Block scaling, whose GEMMs need 128 x 128 block scales, is refused at
                :meth:`fp8_begin`.)
        """
        if not self.fuse_wgrad_accumulation:
            raise ValueError(f"{type(self).__name__}.{name} is an FP8 primary weight: its gradient goes to "
                             "weight.main_grad, so fuse_wgrad_accumulation must stay True")
        scale_inv, kernels = getattr(self, name + "_scale_inv"), quantizer.kernels  # (the transpose's backend)
        if torch.compiler.is_compiling():
            return Float8Tensor(weight.detach(), scale_inv, torch.float32, kernels=kernels)
        key = (weight._version, scale_inv._version, weight.data_ptr(), scale_inv.data_ptr(), kernels)
        hit = self._stored_fp8.get(name)
        if hit is None or hit[0] != key:
            hit = self._stored_fp8[name] = (key, Float8Tensor(weight.detach(), scale_inv, torch.float32,
                                                              kernels=kernels))
        return hit[1]

    def hp_linear(self, x: torch.Tensor, name: str, weight: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The high-precision GEMM outside FP8 regions, ``x [*, K] @ weight.T + bias`` -> ``[*, N]`` in ``x.dtype``:
        ``F.linear``; with ``fuse_wgrad_accumulation`` the weight gradient goes to ``weight.main_grad``; an FP8
        primary weight ``name`` is dequantized to ``x.dtype`` first (its gradient to ``main_grad``, TE's
        behaviour)."""
        if weight.dtype in FP8_PARAM_DTYPES:
            return F.linear(x, dequantize_weight(weight, getattr(self, name + "_scale_inv"), x.dtype), bias)
        if self.fuse_wgrad_accumulation and torch.is_grad_enabled():
            return linear_main_grad(x, weight, bias)
        return F.linear(x, weight, bias)
