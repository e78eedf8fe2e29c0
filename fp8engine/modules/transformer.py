"""``TransformerLayer``: a pre-norm GPT block, ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``, every
GEMM in FP8 inside :func:`fp8engine.autocast` (TransformerEngine's ``TransformerLayer`` subset). Every recipe runs,
``Float8BlockScaling`` too (per-rank GEMM dims multiples of 128; on CUDA the norms and the MLP activation write
the block-scaled FP8 operands themselves, see the sublayers)."""
from __future__ import annotations

import contextlib

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fp8engine.fp8.autocast import get_fp8_context
from fp8engine.modules.attention import MultiheadAttention
from fp8engine.modules.layernorm_mlp import LayerNormMLP
from fp8engine.ops.layer import LayerPlan, fused_layer

__all__ = ["TransformerLayer"]


class TransformerLayer(nn.Module):
    """Pre-LN transformer block on ``[s, b, h]``:

    ``x = x + dropout(self_attention(x))`` (the attention's own input norm), then
    ``x = x + dropout(layernorm_mlp(x))`` (the MLP's own input norm).

    Args:
        hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups: ``h``, ``F``, ``H``, ``G``.
        layernorm_epsilon, normalization (``"LayerNorm"``/``"RMSNorm"``), zero_centered_gamma: both norms.
        hidden_dropout: dropout on each branch before the residual add. attention_dropout: on attention probs.
        self_attn_mask_type: ``"causal"``, ``"padding"`` or ``"no_mask"`` (see :class:`MultiheadAttention`).
        activation: ``"gelu"``, ``"relu"`` or ``"swiglu"``.
        params_dtype, device, init_method, output_layer_init_method (proj and fc2), fuse_qkv_params,
            fuse_wgrad_accumulation, bias: passed to the sublayers.
        set_parallel_mode, tp_group, sequence_parallel: tensor (and sequence) parallelism over ``tp_group``; with
            sequence parallelism the input and output are ``[s/tp, b, h]`` and dropout + residual run on the shard.
        rng_tracker: object with ``fork()`` (:class:`fp8engine.parallel.RNGStatesTracker` after
            ``model_parallel_manual_seed``): attention dropout, and hidden dropout under sequence parallelism, draw
            from its per-tensor-parallel-rank state. None: the default generator.
        fused: under per-tensor FP8 (delayed or current scaling) run the whole layer step as one autograd node
            (:mod:`fp8engine.ops.layer`: the same kernels and GEMMs, a fraction of the host time) where it applies
            (no tensor parallelism, fused QKV weight, no padding mask, not traced by
            ``torch.compile``; otherwise the sublayers run one by one, as with ``fused=False``).
    Raises:
        ValueError: an invalid combination (heads/hidden, groups/heads, tp size vs heads/groups/ffn, unknown
            activation/normalization/mask type), naming what to change.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5, hidden_dropout: float = 0.1,
                 attention_dropout: float = 0.1, self_attn_mask_type: str = "causal",
                 normalization: str = "LayerNorm", activation: str = "gelu", params_dtype=None, device=None,
                 init_method: Optional[Callable] = None, output_layer_init_method: Optional[Callable] = None,
                 fuse_qkv_params: bool = True, fuse_wgrad_accumulation: bool = False,
                 zero_centered_gamma: bool = False, bias: bool = True, set_parallel_mode: bool = False,
                 tp_group=None, sequence_parallel: bool = False, rng_tracker=None, fused: bool = True):
        super().__init__()
        if not 0.0 <= hidden_dropout < 1.0:
            raise ValueError(f"hidden_dropout must be in [0, 1), got {hidden_dropout}")
        common = dict(normalization=normalization, bias=bias, zero_centered_gamma=zero_centered_gamma,
                      params_dtype=params_dtype, device=device, init_method=init_method,
                      output_layer_init_method=output_layer_init_method,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group,
                      sequence_parallel=sequence_parallel, set_parallel_mode=set_parallel_mode)
        self.self_attention = MultiheadAttention(hidden_size, num_attention_heads, num_gqa_groups,
                                                 attn_mask_type=self_attn_mask_type,
                                                 attention_dropout=attention_dropout,
                                                 layernorm_epsilon=layernorm_epsilon,
                                                 fuse_qkv_params=fuse_qkv_params, rng_tracker=rng_tracker,
                                                 **common)
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, activation=activation, eps=layernorm_epsilon,
                                          **common)
        self.hidden_dropout = hidden_dropout
        # With sequence parallelism each rank holds a different slice of the sequence: its hidden-dropout mask
        # comes from the tracker's per-rank state (as in Megatron), not from the default generator shared by all.
        self._sp_rng = rng_tracker if sequence_parallel and set_parallel_mode else None
        self.fused = fused

    def _dropout(self, branch: torch.Tensor) -> torch.Tensor:
        if self.training and self.hidden_dropout > 0:
            with self._sp_rng.fork() if self._sp_rng is not None else contextlib.nullcontext():
                branch = F.dropout(branch, self.hidden_dropout, training=True)
        return branch

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``hidden_states``: ``[s, b, h]`` (``[s/tp, b, h]`` sequence parallel) -> same shape and dtype.

        ``attention_mask``: bool ``[b, 1, 1, s]`` (True = masked out) for ``self_attn_mask_type="padding"``.
        ``rotary_pos_emb``: ``[s, 1, 1, r]`` angles from :class:`fp8engine.modules.RotaryEmbedding` (full ``s``).
        ``is_first_microbatch``: FP8 weight caching across micro-batches (None: cast every call).
        """
        if self.fused and attention_mask is None:
            plan = self._fused_plan(hidden_states, rotary_pos_emb, is_first_microbatch)
            if plan is not None:
                return fused_layer(hidden_states, plan[0], plan[1])
        # The first residual add runs inside the MLP's norm kernel (it normalises hidden_states + attn and returns
        # the sum x); the gradients reaching hidden_states and x through the residual path are added inside the
        # two norms' backward kernels (return_norm_input), so only the last add is a separate kernel.
        attn, hidden_in = self.self_attention(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb,
                                              is_first_microbatch=is_first_microbatch, return_norm_input=True)
        mlp_out, x = self.layernorm_mlp(self._dropout(attn), is_first_microbatch=is_first_microbatch,
                                        residual=hidden_in, return_norm_input=True)
        return x + self._dropout(mlp_out)

    def _fused_plan(self, x: torch.Tensor, rope: Optional[torch.Tensor], is_first_microbatch: Optional[bool]):
        """``(params, LayerPlan)`` for :func:`fp8engine.ops.layer.fused_layer`, or None where the fused step does
        not apply (see ``fused`` in the class docstring; the composed sublayers then run)."""
        attn, mlp = self.self_attention, self.layernorm_mlp
        if (get_fp8_context() is None or torch.compiler.is_compiling() or x.dim() != 3
                or not attn.fuse_qkv_params
                or not attn._input_layernorm or attn._padding or attn.config.tp_size > 1 or mlp.tp_group is not None
                or not mlp.fused or mlp.return_layernorm_output):
            return None
        lq, proj = attn.layernorm_qkv, attn.proj
        if (lq.return_layernorm_output or lq.tp_group is not None
                or not lq.fuse_wgrad_accumulation == proj.fuse_wgrad_accumulation == mlp.fuse_wgrad_accumulation):
            return None
        if torch.is_autocast_enabled(x.device.type) and x.dtype != torch.get_autocast_dtype(x.device.type):
            return None  # the composed sublayers cast between dtypes as autocast does
        qa, qp, qm = lq.fp8_begin(), proj.fp8_begin(), mlp.fp8_begin()
        if qa[0].input.is_block:
            return None
        cfg = attn.config
        hl, gl, d = cfg.local_heads, cfg.local_groups, cfg.head_dim
        w_qkv, b_qkv = lq._weight_bias()
        if is_first_microbatch is None and torch.is_grad_enabled():
            # nothing cached across micro-batches: the fused step casts the weights itself (with its other ops,
            # so they are recorded and replayed with it: ops.layer), as FP8WeightCache.get would
            for module, name in ((lq, "weight"), (proj, "weight"), (mlp, "fc1_weight"), (mlp, "fc2_weight")):
                module._weight_cache.discard(name)
            w_fp8 = None
        else:
            w_fp8 = (lq.fp8_weight("weight", w_qkv, qa[0].weight, is_first_microbatch),
                     proj.fp8_weight("weight", proj.weight, qp[0].weight, is_first_microbatch),
                     mlp.fp8_weight("fc1_weight", mlp.fc1_weight, qm[0].weight, is_first_microbatch),
                     mlp.fp8_weight("fc2_weight", mlp.fc2_weight, qm[1].weight, is_first_microbatch))
        dropout_p = attn.attention_dropout if attn.training else 0.0
        rng = attn.rng_tracker.fork if attn.rng_tracker is not None and dropout_p > 0 else None
        plan = LayerPlan(qkv=qa[0], proj=qp[0], fc1=qm[0], fc2=qm[1], w_fp8=w_fp8, split=(gl, hl // gl, d),
                         rope=rope, attn=dict(dropout_p=dropout_p, is_causal=attn._is_causal, enable_gqa=gl != hl),
                         rng=rng, norm1=(lq.eps, lq._rms, lq.zero_centered_gamma),
                         norm2=(mlp.eps, mlp._rms, mlp.zero_centered_gamma), kind=mlp.activation,
                         fuse_wgrad=mlp.fuse_wgrad_accumulation, gelu_epilogue=mlp.gelu_epilogue,
                         hidden_dropout=self.hidden_dropout if self.training else 0.0)
        params = (lq.layer_norm_weight, lq.layer_norm_bias, w_qkv, b_qkv, proj.weight, proj.bias,
                  mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.fc1_weight, mlp.fc1_bias, mlp.fc2_weight,
                  mlp.fc2_bias)
        return params, plan
