"""``fp8_model_init``: FP8 modules built inside it keep their GEMM weights as FP8 parameters ("FP8 primary weights",
TransformerEngine's ``fp8_model_init``; ``quantized_model_init`` in TE 2.x).

Each GEMM weight of a :class:`~fp8engine.modules.base.FP8Module` built in the region (``Linear.weight``,
``LayerNormLinear.weight``, ``LayerNormMLP.fc1_weight`` / ``fc2_weight``, so every GEMM of ``MultiheadAttention``,
``TransformerLayer`` and the GPT's layers) becomes, at the end of that module's ``__init__``:

- ``<name>``: an ``nn.Parameter`` ``[N, K]`` of dtype ``torch.float8_e4m3fn`` (``float8_e5m2`` under a recipe whose
  forward format is E5M2), ``requires_grad=True``: 1 byte per element;
- ``<name>_scale_inv``: a ``[1]`` float32 buffer; ``weight ≈ <name>.float() * <name>_scale_inv``. The bits are the
  current-scaling cast of the initial value (``scale = fp8_max / amax``, :func:`~fp8engine.fp8.float8_tensor
  .quantize_current`, the rule of :class:`~fp8engine.recipe.CurrentScaling`), and so after every optimizer step
  (:class:`fp8engine.training.master_weights.FP8MasterWeights`), under either recipe: the recipe given here only
  chooses the FP8 format. Both are in ``state_dict`` (FP8 bytes and scale_inv round-trip exactly).

The module then accumulates weight gradients into an fp32 ``<name>.main_grad`` (``fuse_wgrad_accumulation`` is
switched on: an FP8 parameter cannot hold a real gradient; Megatron/TE semantics), which the master-weight optimizer
allocates. Inside :func:`fp8engine.autocast` the GEMMs take the stored bytes as they are (no cast); outside, the
weight is dequantized to the activations' dtype, as TransformerEngine does. Block scaling cannot use them
(``ValueError`` at the forward).

Not converted: the tensor-parallel layers of :mod:`fp8engine.parallel` (``ColumnParallelLinear``, ...), embeddings
and norms (high precision, as in TE). Refused (``ValueError`` / ``TypeError`` at construction): ``LayerNormLinear``
with ``parameters_split`` (``MultiheadAttention(fuse_qkv_params=False)``) and ``Conv1DLinear``.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fp8engine.fp8.dtypes import FP8_DTYPES, fp8_dtype_of
from fp8engine.fp8.float8_tensor import quantize_current
from fp8engine.ops.linear import accumulate_wgrad
from fp8engine.recipe import CurrentScaling, DelayedScaling, Float8BlockScaling

__all__ = ["fp8_model_init", "quantized_model_init", "FP8InitConfig", "fp8_init_config", "FP8_PARAM_DTYPES",
           "get_high_precision_init_val", "clear_high_precision_init_val", "to_fp8_param", "quantize_weight_",
           "dequantize_weight"]

#: dtypes of FP8 primary weights
FP8_PARAM_DTYPES = tuple(FP8_DTYPES.values())


@dataclass(frozen=True)
class FP8InitConfig:
    """The active :func:`fp8_model_init` region: the weights' FP8 dtype and whether the initial high-precision
    values are kept (on CPU) for the optimizer's master copies."""

    fp8_dtype: torch.dtype
    preserve_high_precision_init_val: bool


_CONFIG: contextvars.ContextVar[Optional[FP8InitConfig]] = contextvars.ContextVar("fp8engine_fp8_model_init",
                                                                                  default=None)


def fp8_init_config() -> Optional[FP8InitConfig]:
    """The active :class:`FP8InitConfig`, or None outside an enabled :func:`fp8_model_init` region."""
    return _CONFIG.get()


@contextlib.contextmanager
def fp8_model_init(enabled: bool = True, recipe=None, preserve_high_precision_init_val: bool = False):
    """Build FP8 modules with FP8 primary weights (module docstring); TransformerEngine's signature.

    Args:
        enabled: False opens a region where modules get ordinary parameters (also inside an enabled one).
        recipe: :class:`~fp8engine.recipe.DelayedScaling` (default) or :class:`~fp8engine.recipe.CurrentScaling`;
            its forward format picks the weights' dtype (E4M3 under ``HYBRID``). Either recipe may run the model.
        preserve_high_precision_init_val: keep each weight's initial value (a CPU copy in the parameter's original
            dtype) for the master weights: ``param.get_high_precision_init_val()`` /
            ``param.clear_high_precision_init_val()`` as in TE, or :func:`get_high_precision_init_val`.
    Raises:
        TypeError: ``enabled`` / ``preserve_high_precision_init_val`` not bool, or ``recipe`` not a recipe.
        ValueError: ``recipe`` is :class:`~fp8engine.recipe.Float8BlockScaling` (block-scaled weights are not
            stored; use per-tensor scaling).
    """
    for what, value in (("enabled", enabled), ("preserve_high_precision_init_val", preserve_high_precision_init_val)):
        if not isinstance(value, bool):
            raise TypeError(f"fp8_model_init: {what} must be True or False, got {value!r}")
    if isinstance(recipe, Float8BlockScaling):
        raise ValueError("fp8_model_init stores per-tensor FP8 weights; Float8BlockScaling weights are not "
                         "supported: pass DelayedScaling or Float8CurrentScaling (or no recipe)")
    if recipe is not None and not isinstance(recipe, (DelayedScaling, CurrentScaling)):
        raise TypeError(f"fp8_model_init: recipe must be DelayedScaling or Float8CurrentScaling, got "
                        f"{type(recipe).__name__}")
    config = None
    if enabled:
        fmt = (recipe or DelayedScaling()).fp8_format
        config = FP8InitConfig(fp8_dtype_of(fmt.fwd), preserve_high_precision_init_val)
    token = _CONFIG.set(config)
    try:
        yield
    finally:
        _CONFIG.reset(token)


#: TransformerEngine 2.x's name of :func:`fp8_model_init`
quantized_model_init = fp8_model_init


class _InitValue:
    """The kept initial value of one FP8 parameter; its bound ``get`` / ``clear`` become the parameter's
    ``get_high_precision_init_val`` / ``clear_high_precision_init_val`` (TE's methods; bound to this holder, not to
    the parameter, so ``torch.save(model)`` can pickle them)."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def get(self) -> Optional[torch.Tensor]:
        return self.value

    def clear(self) -> None:
        self.value = None


def get_high_precision_init_val(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The initial high-precision value kept for ``param`` (CPU, the weight's original dtype and shape), or None
    (not kept, or cleared)."""
    getter = getattr(param, "get_high_precision_init_val", None)
    return None if getter is None else getter()


def clear_high_precision_init_val(param: torch.Tensor) -> None:
    """Free the kept initial value of ``param`` (no-op when none is kept)."""
    clear = getattr(param, "clear_high_precision_init_val", None)
    if clear is not None:
        clear()


@torch.no_grad()
def quantize_weight_(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Write ``value`` (``[N, K]`` float32/bf16/fp16) into ``module``'s FP8 weight ``name`` and its
    ``<name>_scale_inv``, in place, with the current-scaling scale ``fp8_max / max|value|`` (1.0 for an all-zero
    value). The optimizer's re-quantization after each step and ``load_state_dict`` of a high-precision weight."""
    weight, scale_inv = getattr(module, name), getattr(module, name + "_scale_inv")
    fp8 = quantize_current(value.detach().to(weight.device), weight.dtype)
    weight.copy_(fp8.data)
    scale_inv.copy_(fp8.scale_inv)


@torch.no_grad()
def to_fp8_param(module: nn.Module, name: str, config: FP8InitConfig) -> None:
    """Replace ``module``'s high-precision parameter ``name`` by its FP8 copy and register ``<name>_scale_inv``
    (module docstring); with ``config.preserve_high_precision_init_val`` the initial value is kept on CPU."""
    weight = getattr(module, name)
    fp8 = quantize_current(weight.detach(), config.fp8_dtype)
    param = nn.Parameter(fp8.data, requires_grad=weight.requires_grad)
    vars(param).update(vars(weight))  # marks the layers set (e.g. sequence_parallel)
    if config.preserve_high_precision_init_val:
        kept = _InitValue(weight.detach().to("cpu", copy=True))
        param.get_high_precision_init_val, param.clear_high_precision_init_val = kept.get, kept.clear
    setattr(module, name, param)
    module.register_buffer(name + "_scale_inv", fp8.scale_inv)


class _Dequantize(torch.autograd.Function):
    """``weight.float() * scale_inv`` in ``dtype``; backward adds the gradient (fp32) to ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, weight, scale_inv, dtype):
        ctx.save_for_backward(weight)
        return (weight.float() * scale_inv).to(dtype)

    @staticmethod
    def backward(ctx, dw):
        weight, = ctx.saved_tensors
        accumulate_wgrad(weight, dw.float())
        return None, None, None


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 primary weight ``[N, K]`` as a high-precision ``[N, K]`` tensor in ``dtype`` for the GEMMs outside FP8
    regions (TE dequantizes there too); its gradient is added to the fp32 ``weight.main_grad`` (``ValueError`` in
    backward when that is missing: :func:`fp8engine.ops.linear.main_grad_of`)."""
    return _Dequantize.apply(weight, scale_inv, dtype)
