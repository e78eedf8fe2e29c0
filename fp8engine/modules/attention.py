"""``MultiheadAttention`` (self-attention with GQA, rotary embeddings, FP8 projections, tensor parallelism) and
``RotaryEmbedding``.

QKV projection: a :class:`LayerNormLinear` (column-parallel under TP). Its fused weight is laid out per KV group,
``[G, H/G + 2, d, h]`` rows = for every group its ``H/G`` query heads, then its key head, then its value head
(Megatron-LM / TransformerEngine's interleaved layout), so a contiguous slice of rows is a whole set of groups
and tensor parallelism splits it without reordering. Attention itself runs in the activations' precision
(bf16/fp32) through :func:`fp8engine.modules.dot_product_attention.attention` (PyTorch's
``scaled_dot_product_attention``; the mask types and their conventions are that module's). The output projection is
a row-parallel :class:`Linear` under TP. Under ``Float8BlockScaling`` both projections are block-scaled (norm, QKV
split and its gradient assembly in high precision: :class:`LayerNormLinear`); ``hidden_size`` and the per-rank QKV
width must be multiples of 128.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from fp8engine.fp8.autocast import get_fp8_context
from fp8engine.modules.dot_product_attention import ATTN_MASK_TYPES, attention, attn_mask_type_of
from fp8engine.modules.layernorm_linear import (LayerNormLinear, check_choice, check_divisible, master_weight,
                                                tp_size_rank)
from fp8engine.modules.linear import Linear
from fp8engine.ops.norm_linear import NORMALIZATIONS
from fp8engine.ops.rotary import rope_cos_sin, rope_fwd

__all__ = ["MultiheadAttention", "RotaryEmbedding", "apply_rotary_pos_emb", "AttentionConfig", "ATTN_MASK_TYPES"]

class RotaryEmbedding(nn.Module):
    """Rotary position embedding angles (RoFormer, Su et al. 2021; TransformerEngine's ``RotaryPositionEmbedding``).

    ``forward(max_seq_len, offset=0)`` returns angles ``[s, 1, 1, dim]`` float32: position ``p`` times
    ``inv_freq = base^(-2i/dim)``, the ``dim/2`` frequencies repeated twice (``cat(freqs, freqs)``), as
    :func:`apply_rotary_pos_emb` expects. ``dim`` (even) may be smaller than the head dim (partial rotary).
    """

    def __init__(self, dim: int, base: float = 10000.0, device=None):
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be a positive even number, got {dim}")
        self.dim = dim
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        pos = torch.arange(offset, offset + max_seq_len, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1).reshape(max_seq_len, 1, 1, self.dim)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate ``t [s, b, n, d]`` by angles ``freqs [s, 1, 1, r]`` (r <= d; the first r channels rotate):
    ``t * cos + rotate_half(t) * sin``, rotate_half(x1, x2) = (-x2, x1). Result in ``t.dtype``
    (:func:`fp8engine.ops.rotary.rope_fwd`)."""
    return rope_fwd(t, *rope_cos_sin(freqs, t.dtype))


@dataclass(frozen=True)
class AttentionConfig:
    """Head layout of one attention layer, validated (``ValueError`` naming what to change).

    ``num_gqa_groups`` (``G``) key/value heads, each shared by ``H/G`` query heads; ``tp_size`` ranks each hold
    ``H/tp`` query heads and ``G/tp`` groups. ``kv_channels``: the head dim ``d`` (None: ``hidden_size / H``, which
    ``H`` must then divide).
    """

    hidden_size: int
    num_attention_heads: int
    num_gqa_groups: int
    attn_mask_type: str = "causal"
    tp_size: int = 1
    kv_channels: Optional[int] = None

    def __post_init__(self) -> None:
        h, n, g = self.hidden_size, self.num_attention_heads, self.num_gqa_groups
        if self.kv_channels is None and (n <= 0 or h % n):
            raise ValueError(f"num_attention_heads={n} must be positive and divide hidden_size={h} "
                             "(or give kv_channels, the head dim)")
        if self.kv_channels is not None and (n <= 0 or self.kv_channels <= 0):
            raise ValueError(f"num_attention_heads={n} and kv_channels={self.kv_channels} must be positive")
        if g <= 0 or n % g:
            raise ValueError(f"num_gqa_groups={g} must be positive and divide num_attention_heads={n}")
        check_choice("attn_mask_type", self.attn_mask_type, ATTN_MASK_TYPES, "MultiheadAttention")
        check_divisible("num_attention_heads", n, self.tp_size, "MultiheadAttention")
        check_divisible("num_gqa_groups", g, self.tp_size, "MultiheadAttention")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads if self.kv_channels is None else self.kv_channels

    @property
    def local_heads(self) -> int:
        return self.num_attention_heads // self.tp_size

    @property
    def local_groups(self) -> int:
        return self.num_gqa_groups // self.tp_size


def _unfused_row_order(cfg: AttentionConfig) -> torch.Tensor:
    """Row indices taking the grouped fused QKV layout to ``[q heads | k heads | v heads]``."""
    q_per = cfg.num_attention_heads // cfg.num_gqa_groups
    idx = torch.arange((cfg.num_attention_heads + 2 * cfg.num_gqa_groups) * cfg.head_dim)
    idx = idx.view(cfg.num_gqa_groups, q_per + 2, cfg.head_dim)
    return torch.cat([idx[:, :q_per].reshape(-1), idx[:, q_per].reshape(-1), idx[:, q_per + 1].reshape(-1)])


class MultiheadAttention(nn.Module):
    """Self-attention: (norm +) QKV projection, rotary embedding, scaled dot-product attention, output projection.

    Args:
        hidden_size: ``h``; num_attention_heads: ``H``.
        num_gqa_groups: ``G`` key/value heads (grouped-query attention; default ``H`` = multi-head attention).
        kv_channels: head dim ``d`` (TransformerEngine's name); default ``h / H`` (``H`` must then divide ``h``).
            The QKV projection has ``(H + 2G) d`` outputs and the output projection ``H d`` inputs.
        attn_mask_type: the default mask type, one of
            :data:`~fp8engine.modules.dot_product_attention.ATTN_MASK_TYPES` (``"causal"``, ``"padding"``,
            ``"no_mask"``, ``"padding_causal"``, ``"arbitrary"``; conventions in
            :mod:`fp8engine.modules.dot_product_attention`: a padding mask is bool ``[b, 1, 1, s]``, True = masked
            out, and the attention output at padded positions is zero); forward may override it.
        attention_dropout: dropout on the attention probabilities (training mode only).
        layernorm_epsilon, normalization, zero_centered_gamma: the input norm (``input_layernorm=True``).
        return_layernorm_output: forward also returns the input norm's output (TE's argument; needs the input
            norm).
        layer_number: accepted for TE compatibility and stored; it changes nothing (see
            :class:`~fp8engine.modules.dot_product_attention.DotProductAttention`).
        fuse_qkv_params: one QKV weight ``layernorm_qkv.weight`` (grouped layout, see the module docstring);
            False: ``query_weight``/``key_weight``/``value_weight``. The same seed gives the same layer either way.
        bias, params_dtype, device, init_method (QKV), output_layer_init_method (proj), fuse_wgrad_accumulation:
            as :class:`LayerNormLinear`.
        tp_group, set_parallel_mode: tensor parallel over ``tp_group`` (``H/tp`` heads and ``G/tp`` groups per
            rank). sequence_parallel: input/output are sequence shards ``[s/tp, b, h]``.
    Raises:
        ValueError: heads not dividing hidden (without kv_channels), groups not dividing heads, tp size not dividing
            heads/groups, an unknown mask type or normalization, return_layernorm_output without an input norm.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, num_gqa_groups: Optional[int] = None,
                 attn_mask_type: str = "causal", attention_dropout: float = 0.1, layernorm_epsilon: float = 1e-5,
                 normalization: str = "LayerNorm", input_layernorm: bool = True, fuse_qkv_params: bool = True,
                 bias: bool = True, params_dtype=None, device=None, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, sequence_parallel: bool = False, set_parallel_mode: bool = False,
                 zero_centered_gamma: bool = False, rng_tracker=None, kv_channels: Optional[int] = None,
                 return_layernorm_output: bool = False, layer_number: Optional[int] = None):
        super().__init__()
        name = type(self).__name__
        check_choice("normalization", normalization, NORMALIZATIONS, name)
        if return_layernorm_output and not input_layernorm:
            raise ValueError(f"{name}: return_layernorm_output=True needs input_layernorm=True")
        self.rng_tracker, self.layer_number = rng_tracker, layer_number
        tp_size, _ = tp_size_rank(tp_group if set_parallel_mode else None)
        cfg = AttentionConfig(hidden_size, num_attention_heads, num_gqa_groups or num_attention_heads,
                              attn_mask_type_of(attn_mask_type, name), tp_size, kv_channels)
        self.config, self.attention_dropout, self.fuse_qkv_params = cfg, attention_dropout, fuse_qkv_params
        group = tp_group if tp_size > 1 else None
        d, n, g = cfg.head_dim, cfg.num_attention_heads, cfg.num_gqa_groups
        split = None if fuse_qkv_params else {"query_": n * d, "key_": g * d, "value_": g * d}
        qkv = LayerNormLinear(hidden_size, (n + 2 * g) * d, bias=bias,
                              normalization=normalization if input_layernorm else None, eps=layernorm_epsilon,
                              return_layernorm_output=return_layernorm_output,
                              zero_centered_gamma=zero_centered_gamma, params_dtype=params_dtype, device=device,
                              init_method=init_method, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                              tp_group=group, parallel_mode="column" if group is not None else None,
                              sequence_parallel=sequence_parallel, parameters_split=split,
                              row_order=None if fuse_qkv_params else _unfused_row_order(cfg))
        self._input_layernorm, self.return_layernorm_output = input_layernorm, return_layernorm_output
        if input_layernorm:
            self.layernorm_qkv = qkv
        else:
            self.qkv = qkv
        w, b = master_weight(hidden_size, n * d, bias, output_layer_init_method or init_method, device)
        # row parallel under TP: [h, H d / tp] per rank, the bias added after the reduction (Linear's parallel_mode);
        # the weight is set by the init method (Linear shards it), before fp8_model_init may turn it into FP8
        self.proj = Linear(n * d, hidden_size, bias=bias, params_dtype=params_dtype, device=device,
                           init_method=lambda weight: weight.copy_(w),
                           fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                           parallel_mode="row" if group is not None else None, tp_group=group,
                           sequence_parallel=sequence_parallel)
        if bias:
            with torch.no_grad():
                self.proj.bias.copy_(b)

    def _project(self, hidden_states: torch.Tensor, **kw):
        """``(qkv, ln, s)``: the QKV projection's output, the input norm's output (None unless
        ``return_layernorm_output``) and the tensor the input norm normalised (``hidden_states`` as the norm saw it:
        a gradient into it is added inside that norm's backward; without an input norm, ``hidden_states``)."""
        if not self._input_layernorm:
            return self.qkv(hidden_states, **kw), None, hidden_states
        if self.return_layernorm_output:
            return self.layernorm_qkv(hidden_states, return_norm_input=True, **kw)
        y, s = self.layernorm_qkv(hidden_states, return_norm_input=True, **kw)
        return y, None, s

    def _qkv(self, hidden_states: torch.Tensor, is_first_microbatch: Optional[bool],
             rope: Optional[torch.Tensor] = None):
        """``q [s, b, H_local, d]``, ``k, v [s, b, G_local, d]`` (views, no copy), then the input norm's output and
        the normalised input (see :meth:`_project`). ``rope``: rotary angles, applied inside the fused QKV op (only
        with ``fuse_qkv_params``; q and k are then new tensors)."""
        cfg = self.config
        hl, gl, d = cfg.local_heads, cfg.local_groups, cfg.head_dim
        if self.fuse_qkv_params:
            (q, k, v), ln, s_in = self._project(hidden_states, is_first_microbatch=is_first_microbatch,
                                                qkv_split=(gl, hl // gl, d), qkv_rope=rope)
            return q.reshape(*q.shape[:2], hl, d), k, v, ln, s_in
        mixed, ln, s_in = self._project(hidden_states, is_first_microbatch=is_first_microbatch)
        s, b = mixed.shape[:2]
        q, k, v = mixed.split([hl * d, gl * d, gl * d], dim=-1)
        return q.view(s, b, hl, d), k.view(s, b, gl, d), v.view(s, b, gl, d), ln, s_in

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None, *, attn_mask_type: Optional[str] = None,
                checkpoint_core_attention: bool = False, return_norm_input: bool = False):
        """``hidden_states``: ``[s, b, h]`` (``[s/tp, b, h]`` sequence parallel) -> same shape.

        ``attention_mask``: bool, True = masked out (``[b, 1, 1, s]`` for the padding types); only with the padding
        types and ``"arbitrary"``. ``attn_mask_type``: this call's mask type (default: the constructor's).
        ``rotary_pos_emb``: angles ``[s, 1, 1, r]`` (from :class:`RotaryEmbedding`), applied to q and k.
        ``is_first_microbatch``: FP8 weight caching (see :class:`fp8engine.modules.base.FP8WeightCache`).
        ``checkpoint_core_attention``: recompute the attention (not the projections) in backward.
        Returns ``out``, then the input norm's output with ``return_layernorm_output``, then, with
        ``return_norm_input``, ``hidden_states`` as seen by the input norm: use it for the residual connection and
        its gradient is added inside that norm's backward (no separate gradient add; TransformerLayer does this).
        """
        mask_type = (self.config.attn_mask_type if attn_mask_type is None
                     else attn_mask_type_of(attn_mask_type, "MultiheadAttention"))
        # rotary inside the fused QKV op (one kernel from the projection output, its gradient in the QKV-gradient
        # cast; under torch.compile the same kernels as opaque ops in FP8, fp8engine.ops.kernel_ops); a compiled
        # high-precision model leaves the plain-PyTorch rotation to Inductor, which fuses it with its neighbours
        in_op = (rotary_pos_emb is not None and self.fuse_qkv_params
                 and (not torch.compiler.is_compiling() or get_fp8_context() is not None))
        q, k, v, ln, s_in = self._qkv(hidden_states, is_first_microbatch, rotary_pos_emb if in_op else None)
        if rotary_pos_emb is not None and not in_op:
            q, k = apply_rotary_pos_emb(q, rotary_pos_emb), apply_rotary_pos_emb(k, rotary_pos_emb)
        cfg = self.config
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        args = (mask_type, attention_mask, self.attention_dropout if self.training else 0.0, None, self.rng_tracker)
        if checkpoint_core_attention:
            from fp8engine.parallel.random import checkpoint

            ctx = checkpoint(lambda q_, k_, v_: attention(q_, k_, v_, *args), False, q, k, v,
                             rng_tracker=self.rng_tracker)
        else:
            ctx = attention(q, k, v, *args)
        s, b = ctx.shape[2], ctx.shape[0]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, cfg.local_heads * cfg.head_dim)
        out = self.proj(ctx, is_first_microbatch=is_first_microbatch)
        result = (out, ln) if self.return_layernorm_output else (out,)
        if return_norm_input:
            result += (s_in,)
        return result if len(result) > 1 else out

    def extra_repr(self) -> str:
        c = self.config
        return (f"heads={c.num_attention_heads}, gqa_groups={c.num_gqa_groups}, mask={c.attn_mask_type}, "
                f"tp_size={c.tp_size}")
