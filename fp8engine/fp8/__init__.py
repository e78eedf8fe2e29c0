"""Torch FP8 core: dtypes, the scaling rule, per-module scaling state, autocast, Float8Tensor and the FP8 stats."""
from fp8engine.fp8.autocast import autocast, fp8_autocast, get_fp8_context, get_fp8_recipe
from fp8engine.fp8.available import is_fp8_available
from fp8engine.fp8.float8_tensor import Float8Tensor, quantize, quantize_current
from fp8engine.fp8.scaling import update_amax_history, update_fp8_scale
from fp8engine.fp8.state import ScalingState, reduce_and_update
from fp8engine.fp8.stats import FP8StatsRow, format_fp8_stats, fp8_stats, fp8_stats_recording

__all__ = ["autocast", "fp8_autocast", "get_fp8_context", "get_fp8_recipe", "is_fp8_available", "Float8Tensor",
           "quantize", "quantize_current", "update_amax_history", "update_fp8_scale", "ScalingState",
           "reduce_and_update", "fp8_stats", "fp8_stats_recording", "format_fp8_stats", "FP8StatsRow"]
