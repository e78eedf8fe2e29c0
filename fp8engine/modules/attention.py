"""``MultiheadAttention`` (self-attention with GQA, rotary embeddings, FP8 projections, tensor parallelism) and
``RotaryEmbedding``.

QKV projection: a :class:`LayerNormLinear` (column-parallel under TP). Its fused weight is laid out per KV group,
``[G, H/G + 2, d, h]`` rows = for every group its ``H/G`` query heads, then its key head, then its value head
(Megatron-LM / TransformerEngine's interleaved layout), so a contiguous slice of rows is a whole set of groups
and tensor parallelism splits it without reordering. Attention itself runs in the activations' precision
(bf16/fp32) through ``torch.nn.functional.scaled_dot_product_attention``. The output projection is row-parallel
under TP. Under ``Float8BlockScaling`` both projections are block-scaled (norm, QKV split and its gradient assembly
in high precision: :class:`LayerNormLinear`); ``hidden_size`` and the per-rank QKV width must be multiples of 128.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fp8engine.fp8.autocast import get_fp8_context
from fp8engine.modules.layernorm_linear import (LayerNormLinear, check_choice, check_divisible, exit_row_parallel,
                                                master_weight, no_init, shard, tp_comm, tp_size_rank)
from fp8engine.modules.linear import Linear
from fp8engine.ops.norm_linear import NORMALIZATIONS
from fp8engine.ops.rotary import rope_cos_sin, rope_fwd

__all__ = ["MultiheadAttention", "RotaryEmbedding", "apply_rotary_pos_emb", "AttentionConfig", "ATTN_MASK_TYPES"]

#: ``"causal"``: token i attends to tokens <= i. ``"padding"``: a boolean mask ``[b, 1, 1, s]`` is passed to
#: forward, True = masked out (TransformerEngine's convention). ``"no_mask"``: full attention.
ATTN_MASK_TYPES = ("causal", "padding", "no_mask")


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
    ``H/tp`` query heads and ``G/tp`` groups.
    """

    hidden_size: int
    num_attention_heads: int
    num_gqa_groups: int
    attn_mask_type: str = "causal"
    tp_size: int = 1

    def __post_init__(self) -> None:
        h, n, g = self.hidden_size, self.num_attention_heads, self.num_gqa_groups
        if n <= 0 or h % n:
            raise ValueError(f"num_attention_heads={n} must be positive and divide hidden_size={h}")
        if g <= 0 or n % g:
            raise ValueError(f"num_gqa_groups={g} must be positive and divide num_attention_heads={n}")
        check_choice("attn_mask_type", self.attn_mask_type, ATTN_MASK_TYPES, "MultiheadAttention")
        check_divisible("num_attention_heads", n, self.tp_size, "MultiheadAttention")
        check_divisible("num_gqa_groups", g, self.tp_size, "MultiheadAttention")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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


class _RowParallelLinear(Linear):
    """``Linear`` with input features split over ``tp_group``: partial GEMM, then all-reduce (or reduce-scatter
    along the sequence), then the bias. Under per-tensor FP8 the reduction runs inside the linear op (its
    :class:`~fp8engine.parallel.linear_ops.TPLinearComm`); otherwise through the region mappings."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp_group, sequence_parallel: bool, **kw):
        super().__init__(in_local, out_features, bias=False, **kw)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self._comm = tp_comm(tp_group, "row", sequence_parallel)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=self.weight.dtype, device=self.weight.device))
            self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        quantizers = self.fp8_begin()
        if quantizers is not None and not quantizers[0].input.is_block:
            return self._linear(x, self.bias, quantizers, is_first_microbatch, comm=self._comm)
        y = self._linear(x, None, quantizers, is_first_microbatch)
        return exit_row_parallel(y, self.bias, self.tp_group, self.sequence_parallel)


class MultiheadAttention(nn.Module):
    """Self-attention: (norm +) QKV projection, rotary embedding, scaled dot-product attention, output projection.

    Args:
        hidden_size: ``h``; num_attention_heads: ``H`` (divides h; head dim ``d = h/H``).
        num_gqa_groups: ``G`` key/value heads (grouped-query attention; default ``H`` = multi-head attention).
        attn_mask_type: ``"causal"``, ``"padding"`` (forward then needs ``attention_mask``: bool ``[b, 1, 1, s]``,
            True = masked out; a query row whose keys are all masked gives NaN) or ``"no_mask"``.
        attention_dropout: dropout on the attention probabilities (training mode only).
        layernorm_epsilon, normalization, zero_centered_gamma: the input norm (``input_layernorm=True``).
        fuse_qkv_params: one QKV weight ``layernorm_qkv.weight`` (grouped layout, see the module docstring);
            False: ``query_weight``/``key_weight``/``value_weight``. The same seed gives the same layer either way.
        bias, params_dtype, device, init_method (QKV), output_layer_init_method (proj), fuse_wgrad_accumulation:
            as :class:`LayerNormLinear`.
        tp_group, set_parallel_mode: tensor parallel over ``tp_group`` (``H/tp`` heads and ``G/tp`` groups per
            rank). sequence_parallel: input/output are sequence shards ``[s/tp, b, h]``.
    Raises:
        ValueError: heads not dividing hidden, groups not dividing heads, tp size not dividing heads/groups, an
            unknown mask type or normalization.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, num_gqa_groups: Optional[int] = None,
                 attn_mask_type: str = "causal", attention_dropout: float = 0.1, layernorm_epsilon: float = 1e-5,
                 normalization: str = "LayerNorm", input_layernorm: bool = True, fuse_qkv_params: bool = True,
                 bias: bool = True, params_dtype=None, device=None, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, sequence_parallel: bool = False, set_parallel_mode: bool = False,
                 zero_centered_gamma: bool = False, rng_tracker=None):
        super().__init__()
        check_choice("normalization", normalization, NORMALIZATIONS, type(self).__name__)
        self.rng_tracker = rng_tracker
        tp_size, rank = tp_size_rank(tp_group if set_parallel_mode else None)
        cfg = AttentionConfig(hidden_size, num_attention_heads, num_gqa_groups or num_attention_heads,
                              attn_mask_type, tp_size)
        self.config, self.attention_dropout, self.fuse_qkv_params = cfg, attention_dropout, fuse_qkv_params
        group = tp_group if tp_size > 1 else None
        d, n, g = cfg.head_dim, cfg.num_attention_heads, cfg.num_gqa_groups
        split = None if fuse_qkv_params else {"query_": n * d, "key_": g * d, "value_": g * d}
        qkv = LayerNormLinear(hidden_size, (n + 2 * g) * d, bias=bias,
                              normalization=normalization if input_layernorm else None, eps=layernorm_epsilon,
                              zero_centered_gamma=zero_centered_gamma, params_dtype=params_dtype, device=device,
                              init_method=init_method, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                              tp_group=group, parallel_mode="column" if group is not None else None,
                              sequence_parallel=sequence_parallel, parameters_split=split,
                              row_order=None if fuse_qkv_params else _unfused_row_order(cfg))
        self._input_layernorm = input_layernorm
        if input_layernorm:
            self.layernorm_qkv = qkv
        else:
            self.qkv = qkv
        w, b = master_weight(hidden_size, n * d, bias, output_layer_init_method or init_method)
        common = dict(params_dtype=params_dtype, device=device, init_method=no_init,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        if group is None:
            self.proj = Linear(n * d, hidden_size, bias=bias, **common)
        else:
            self.proj = _RowParallelLinear(cfg.local_heads * d, hidden_size, bias, group,
                                           sequence_parallel, **common)
        with torch.no_grad():
            self.proj.weight.copy_(shard(w, 1, [n * d], rank, tp_size))
            if bias:
                self.proj.bias.copy_(b)
        self._is_causal = attn_mask_type == "causal"
        self._padding = attn_mask_type == "padding"

    def _project(self, hidden_states: torch.Tensor, **kw):
        """The QKV projection's output and the tensor its input norm normalised (``hidden_states`` as the norm saw
        it: a gradient into it is added inside that norm's backward; without an input norm, ``hidden_states``)."""
        if self._input_layernorm:
            return self.layernorm_qkv(hidden_states, return_norm_input=True, **kw)
        return self.qkv(hidden_states, **kw), hidden_states

    def _qkv(self, hidden_states: torch.Tensor, is_first_microbatch: Optional[bool],
             rope: Optional[torch.Tensor] = None):
        """``q [s, b, H_local, d]``, ``k, v [s, b, G_local, d]`` (views, no copy), and the normalised input (see
        :meth:`_project`). ``rope``: rotary angles, applied inside the fused QKV op (only with ``fuse_qkv_params``;
        q and k are then new tensors)."""
        cfg = self.config
        hl, gl, d = cfg.local_heads, cfg.local_groups, cfg.head_dim
        if self.fuse_qkv_params:
            (q, k, v), s_in = self._project(hidden_states, is_first_microbatch=is_first_microbatch,
                                            qkv_split=(gl, hl // gl, d), qkv_rope=rope)
            return q.reshape(*q.shape[:2], hl, d), k, v, s_in
        mixed, s_in = self._project(hidden_states, is_first_microbatch=is_first_microbatch)
        s, b = mixed.shape[:2]
        q, k, v = mixed.split([hl * d, gl * d, gl * d], dim=-1)
        return q.view(s, b, hl, d), k.view(s, b, gl, d), v.view(s, b, gl, d), s_in

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None, *, return_norm_input: bool = False):
        """``hidden_states``: ``[s, b, h]`` (``[s/tp, b, h]`` sequence parallel) -> same shape.

        ``attention_mask``: bool ``[b, 1, 1, s]``, True = masked out; only with ``attn_mask_type="padding"``.
        ``rotary_pos_emb``: angles ``[s, 1, 1, r]`` (from :class:`RotaryEmbedding`), applied to q and k.
        ``is_first_microbatch``: FP8 weight caching (see :class:`fp8engine.modules.base.FP8WeightCache`).
        ``return_norm_input``: return ``(out, hidden_states')`` where ``hidden_states'`` is ``hidden_states`` as
        seen by the input norm: use it for the residual connection and its gradient is added inside that norm's
        backward (no separate gradient add; TransformerLayer does this).
        """
        if self._padding:
            if attention_mask is None:
                raise ValueError("attn_mask_type='padding' needs attention_mask (bool [b, 1, 1, s], True = masked)")
            attn_mask = ~attention_mask
        elif attention_mask is not None:
            raise ValueError("attention_mask is only used with attn_mask_type='padding'; pass None or change "
                             "attn_mask_type")
        else:
            attn_mask = None
        # rotary inside the fused QKV op (one kernel from the projection output, its gradient in the QKV-gradient
        # cast; under torch.compile the same kernels as opaque ops in FP8, fp8engine.ops.kernel_ops); a compiled
        # high-precision model leaves the plain-PyTorch rotation to Inductor, which fuses it with its neighbours
        in_op = (rotary_pos_emb is not None and self.fuse_qkv_params
                 and (not torch.compiler.is_compiling() or get_fp8_context() is not None))
        q, k, v, s_in = self._qkv(hidden_states, is_first_microbatch, rotary_pos_emb if in_op else None)
        if rotary_pos_emb is not None and not in_op:
            q, k = apply_rotary_pos_emb(q, rotary_pos_emb), apply_rotary_pos_emb(k, rotary_pos_emb)
        cfg = self.config
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        dropout_p = self.attention_dropout if self.training else 0.0
        fork = self.rng_tracker.fork() if self.rng_tracker is not None and dropout_p > 0 else contextlib.nullcontext()
        with fork:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                 is_causal=self._is_causal,
                                                 enable_gqa=cfg.local_groups != cfg.local_heads)
        s, b = ctx.shape[2], ctx.shape[0]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, cfg.local_heads * cfg.head_dim)
        out = self.proj(ctx, is_first_microbatch=is_first_microbatch)
        return (out, s_in) if return_norm_input else out

    def extra_repr(self) -> str:
        c = self.config
        return (f"heads={c.num_attention_heads}, gqa_groups={c.num_gqa_groups}, mask={c.attn_mask_type}, "
                f"tp_size={c.tp_size}")
