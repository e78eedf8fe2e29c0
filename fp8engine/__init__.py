"""fp8engine: FP8 mixed-precision training for PyTorch transformers, pure Python (Triton + torch._scaled_mm).

Public API (TransformerEngine names): recipes, ``autocast``/``fp8_autocast``, ``Float8Tensor``/``quantize``,
the FP8 ``Linear`` and layers, FP8 primary weights ``fp8_model_init`` (``quantized_model_init``; their optimizer:
``fp8engine.training.master_weights.FP8MasterWeights``), ``convert_to_fp8``, the FP8 health report ``fp8_stats`` /
``fp8_stats_recording``; models in ``fp8engine.models``, tensor/sequence parallelism in
``fp8engine.parallel``, the Flax frontend in ``fp8engine.jax``.

The torch-side names load on first use (PEP 562), so ``import fp8engine.jax`` and ``fp8engine.recipe`` work
without torch installed. TransformerEngine spellings: ``fp8_autocast``, ``Float8CurrentScaling`` (= ``CurrentScaling``),
``checkpoint`` (:func:`fp8engine.parallel.random.te_checkpoint`).
"""
from importlib import import_module

from fp8engine.recipe import CurrentScaling, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format

__version__ = "0.1.0"

#: name -> the module that defines it, or ``(module, attribute)`` where the name is an alias of another attribute.
_LAZY = {
    "autocast": "fp8engine.fp8.autocast", "fp8_autocast": "fp8engine.fp8.autocast",
    "get_fp8_recipe": "fp8engine.fp8.autocast", "is_fp8_available": "fp8engine.fp8.available",
    "Float8Tensor": "fp8engine.fp8.float8_tensor", "quantize": "fp8engine.fp8.float8_tensor",
    "quantize_current": "fp8engine.fp8.float8_tensor", "update_amax_history": "fp8engine.fp8.scaling",
    "update_fp8_scale": "fp8engine.fp8.scaling", "ScalingState": "fp8engine.fp8.state",
    "fp8_gemm": "fp8engine.ops.gemm", "Linear": "fp8engine.modules.linear",
    "convert_to_fp8": "fp8engine.modules.convert", "ConversionReport": "fp8engine.modules.convert",
    "save_fp8_state": "fp8engine.modules.fp8_state_io", "load_fp8_state": "fp8engine.modules.fp8_state_io",
    "make_graphed_callables": "fp8engine.modules.graph",
    "LayerNorm": "fp8engine.modules.norm", "RMSNorm": "fp8engine.modules.norm",
    "LayerNormLinear": "fp8engine.modules.layernorm_linear", "LayerNormMLP": "fp8engine.modules.layernorm_mlp",
    "MultiheadAttention": "fp8engine.modules.attention", "TransformerLayer": "fp8engine.modules.transformer",
    "DotProductAttention": "fp8engine.modules.dot_product_attention",
    "fp8_model_init": "fp8engine.modules.fp8_init", "quantized_model_init": "fp8engine.modules.fp8_init",
    "checkpoint": ("fp8engine.parallel.random", "te_checkpoint"),
    "fp8_stats": "fp8engine.fp8.stats", "fp8_stats_recording": "fp8engine.fp8.stats",
    "format_fp8_stats": "fp8engine.fp8.stats", "FP8StatsRow": "fp8engine.fp8.stats",
}

__all__ = ["Format", "DelayedScaling", "CurrentScaling", "Float8CurrentScaling", "Float8BlockScaling", *_LAZY]


def __getattr__(name):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'fp8engine' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
