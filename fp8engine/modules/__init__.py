"""nn.Modules users touch: FP8 ``Linear``, norms, ``LayerNormLinear``, ``LayerNormMLP``, ``DotProductAttention``,
``MultiheadAttention``, ``TransformerLayer`` (TransformerEngine's names and arguments), and ``convert_to_fp8``."""
from fp8engine.modules.attention import MultiheadAttention, RotaryEmbedding, apply_rotary_pos_emb
from fp8engine.modules.conv1d import Conv1DLinear
from fp8engine.modules.convert import ConversionReport, convert_to_fp8
from fp8engine.modules.dot_product_attention import DotProductAttention
from fp8engine.modules.fp8_state_io import load_fp8_state, save_fp8_state
from fp8engine.modules.layernorm_linear import LayerNormLinear
from fp8engine.modules.layernorm_mlp import LayerNormMLP
from fp8engine.modules.linear import Linear
from fp8engine.modules.norm import LayerNorm, RMSNorm
from fp8engine.modules.transformer import TransformerLayer

__all__ = ["Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP", "DotProductAttention", "MultiheadAttention",
           "RotaryEmbedding", "apply_rotary_pos_emb", "TransformerLayer", "convert_to_fp8",
           "ConversionReport", "Conv1DLinear", "save_fp8_state", "load_fp8_state"]
