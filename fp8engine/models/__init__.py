"""Models built from fp8engine modules."""
from fp8engine.models.gpt import FP8_ALIGN, GPT, GPT_CONFIGS, GPTConfig

__all__ = ["GPT", "GPTConfig", "GPT_CONFIGS", "FP8_ALIGN"]
