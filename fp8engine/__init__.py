"""fp8engine: FP8 mixed-precision training for PyTorch transformers, pure Python (Triton + torch._scaled_mm).

Public API (TransformerEngine names): recipes, ``autocast``/``fp8_autocast``, ``Float8Tensor``/``quantize``,
the FP8 ``Linear`` and ``convert_to_fp8``; layers and models live in ``fp8engine.modules`` / ``fp8engine.models``,
tensor/sequence parallelism in ``fp8engine.parallel``.
"""
from fp8engine.fp8 import (Float8Tensor, ScalingState, autocast, fp8_autocast, get_fp8_recipe, is_fp8_available,
                           quantize, quantize_current, update_amax_history, update_fp8_scale)
from fp8engine.modules.convert import convert_to_fp8
from fp8engine.modules.linear import Linear
from fp8engine.ops.gemm import fp8_gemm
from fp8engine.recipe import CurrentScaling, DelayedScaling, Format

__version__ = "0.1.0"

__all__ = ["Format", "DelayedScaling", "CurrentScaling", "autocast", "fp8_autocast", "get_fp8_recipe",
           "is_fp8_available", "Float8Tensor", "quantize", "quantize_current", "update_amax_history",
           "update_fp8_scale", "ScalingState", "fp8_gemm", "Linear", "convert_to_fp8"]
