"""``TransformerLayer``: a pre-norm GPT block, ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``, every
GEMM in FP8 inside :func:`fp8engine.autocast` (TransformerEngine's ``TransformerLayer``, its encoder layer: no
cross-attention). Every recipe runs, ``Float8BlockScaling`` too (per-rank GEMM dims multiples of 128; on CUDA the
norms and the MLP activation write the block-scaled FP8 operands themselves, see the sublayers)."""
from __future__ import annotations

import contextlib

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fp8engine.fp8.autocast import get_fp8_context
from fp8engine.fp8.gathered_weight import GatheredFP8Weight
from fp8engine.modules.attention import MultiheadAttention
from fp8engine.modules.dot_product_attention import QKV_FORMATS, attn_mask_type_of
from fp8engine.modules.layernorm_linear import check_choice
from fp8engine.modules.layernorm_mlp import LayerNormMLP
from fp8engine.modules.base import FP8_INPUT_DTYPES
from fp8engine.modules.norm import LayerNorm, RMSNorm
from fp8engine.ops.layer import LayerPlan, fused_layer

__all__ = ["TransformerLayer"]

_FUSED_MASKS = ("causal", "no_mask")  # the mask types the fused layer step implements (SDPA's causal flag)


class TransformerLayer(nn.Module):
    """Pre-LN transformer block on ``[s, b, h]`` (``attn_input_format="bshd"``: ``[b, s, h]``):

    ``x = x + dropout(self_attention(x))`` (the attention's own input norm), then
    ``x = x + dropout(layernorm_mlp(x))`` (the MLP's own input norm). TransformerEngine's variants
    (``transformer_engine/pytorch/transformer.py``), with ``ln1``/``ln2`` the attention's / MLP's input norms:

    - ``apply_residual_connection_post_layernorm``: the residuals are taken from the norms' outputs,
      ``x1 = ln1(x) + drop(attn(ln1(x)))``, ``out = ln2(x1) + drop(mlp(ln2(x1)))``.
    - ``output_layernorm``: the attention has no input norm; a final norm (``self.layernorm``) follows the last add:
      ``x1 = x + drop(attn(x))``, ``out = norm(x1 + drop(mlp(ln2(x1))))`` (BERT's post-LN block). Combined with the
      previous option only the MLP's residual is post-norm (as TE).

    Args:
        hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups: ``h``, ``F``, ``H``, ``G``.
        layernorm_epsilon, normalization (``"LayerNorm"``/``"RMSNorm"``), zero_centered_gamma: all norms.
        hidden_dropout: dropout on each branch before the residual add. attention_dropout: on attention probs.
        self_attn_mask_type: the default mask type (``"causal"``, ``"no_mask"``, ``"padding"``,
            ``"padding_causal"``, ``"arbitrary"``: :mod:`fp8engine.modules.dot_product_attention`); forward may
            override it.
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
            (no tensor parallelism, fused QKV weight, mask type ``"causal"`` or ``"no_mask"``, neither
            ``apply_residual_connection_post_layernorm`` nor ``output_layernorm``, no
            ``checkpoint_core_attention``, not traced by ``torch.compile``, no FP8 primary weights
            (:func:`fp8engine.fp8_model_init`: the fused step casts the weights itself and returns its bias
            gradients in the weights' dtype); otherwise the sublayers run one by one, as with ``fused=False``).
        layer_type: ``"encoder"`` (the only one: self-attention + MLP; the mask comes from ``self_attn_mask_type``,
            causal by default, as in TE). TE's ``"decoder"`` adds a cross-attention block over ``encoder_output``,
            which is not implemented (``ValueError``).
        apply_residual_connection_post_layernorm, output_layernorm: see above.
        layer_number: accepted for TE compatibility and stored (``self.layer_number``, and the attention's); it
            changes nothing (TE uses it only for fp16 query-key layer scaling, which leaves the result unchanged).
        kv_channels: head dim ``d`` (default ``h / H``); the QKV projection then has ``(H + 2G) d`` outputs and
            the output projection ``H d`` inputs (for FP8, multiples of 16).
        attn_input_format: ``"sbhd"`` (default; ``[s, b, h]`` in and out) or ``"bshd"`` (``[b, s, h]`` in and out:
            the layer runs on the transposed input, ``[s, b, h]`` internally, and returns a contiguous ``[b, s, h]``;
            one copy each way).
    Raises:
        ValueError: an invalid combination (heads/hidden, groups/heads, tp size vs heads/groups/ffn, unknown
            activation/normalization/mask type/input format, ``layer_type="decoder"``), naming what to change.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5, hidden_dropout: float = 0.1,
                 attention_dropout: float = 0.1, self_attn_mask_type: str = "causal",
                 normalization: str = "LayerNorm", activation: str = "gelu", params_dtype=None, device=None,
                 init_method: Optional[Callable] = None, output_layer_init_method: Optional[Callable] = None,
                 fuse_qkv_params: bool = True, fuse_wgrad_accumulation: bool = False,
                 zero_centered_gamma: bool = False, bias: bool = True, set_parallel_mode: bool = False,
                 tp_group=None, sequence_parallel: bool = False, rng_tracker=None, fused: bool = True, *,
                 layer_type: str = "encoder", apply_residual_connection_post_layernorm: bool = False,
                 output_layernorm: bool = False, layer_number: Optional[int] = None,
                 kv_channels: Optional[int] = None, attn_input_format: str = "sbhd"):
        super().__init__()
        name = type(self).__name__
        if not 0.0 <= hidden_dropout < 1.0:
            raise ValueError(f"hidden_dropout must be in [0, 1), got {hidden_dropout}")
        check_choice("layer_type", layer_type, ("encoder", "decoder"), name)
        if layer_type == "decoder":
            raise ValueError(f"{name}: layer_type='decoder' adds TransformerEngine's cross-attention block (over "
                             "encoder_output), which fp8engine does not implement; use layer_type='encoder' "
                             "(self-attention + MLP; self_attn_mask_type sets the mask)")
        check_choice("attn_input_format", attn_input_format, QKV_FORMATS, name)
        post_ln = apply_residual_connection_post_layernorm
        common = dict(normalization=normalization, bias=bias, zero_centered_gamma=zero_centered_gamma,
                      params_dtype=params_dtype, device=device, init_method=init_method,
                      output_layer_init_method=output_layer_init_method,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group,
                      sequence_parallel=sequence_parallel, set_parallel_mode=set_parallel_mode)
        self.self_attention = MultiheadAttention(hidden_size, num_attention_heads, num_gqa_groups,
                                                 attn_mask_type=self_attn_mask_type,
                                                 attention_dropout=attention_dropout,
                                                 layernorm_epsilon=layernorm_epsilon,
                                                 input_layernorm=not output_layernorm,
                                                 return_layernorm_output=post_ln and not output_layernorm,
                                                 fuse_qkv_params=fuse_qkv_params, rng_tracker=rng_tracker,
                                                 kv_channels=kv_channels, layer_number=layer_number, **common)
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, activation=activation, eps=layernorm_epsilon,
                                          return_layernorm_output=post_ln, **common)
        if output_layernorm:
            norm = RMSNorm if normalization == "RMSNorm" else LayerNorm
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon, zero_centered_gamma=zero_centered_gamma,
                                  params_dtype=params_dtype, device=device)
            for p in self.layernorm.parameters():  # partial gradients per sequence shard, as the other norms'
                p.sequence_parallel = self.layernorm_mlp.sequence_parallel
        self.hidden_size, self.hidden_dropout, self.layer_number = hidden_size, hidden_dropout, layer_number
        self.self_attn_mask_type = self.self_attention.config.attn_mask_type
        self.apply_residual_connection_post_layernorm, self.output_layernorm = post_ln, output_layernorm
        self.layer_type, self.attn_input_format = layer_type, attn_input_format
        # With sequence parallelism each rank holds a different slice of the sequence: its hidden-dropout mask
        # comes from the tracker's per-rank state (as in Megatron), not from the default generator shared by all.
        self._sp_rng = rng_tracker if sequence_parallel and set_parallel_mode else None
        self.fused = fused
        fp8_weights = self.self_attention.proj.fp8_primary_weights() or self.layernorm_mlp.fp8_primary_weights()
        self._fusable = not (post_ln or output_layernorm or fp8_weights)  # what the fused step implements (ops.layer)

    def _dropout(self, branch: torch.Tensor) -> torch.Tensor:
        if self.training and self.hidden_dropout > 0:
            with self._sp_rng.fork() if self._sp_rng is not None else contextlib.nullcontext():
                branch = F.dropout(branch, self.hidden_dropout, training=True)
        return branch

    def _check_input(self, x: torch.Tensor) -> None:
        """``ValueError`` / ``TypeError`` naming the expected layout and dtypes (the sublayers would fail deep
        inside with a reshape error, or an FP8 GEMM return garbage for an integer tensor)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            layout = "[s, b, h]" if self.attn_input_format == "sbhd" else "[b, s, h]"
            raise ValueError(f"TransformerLayer: hidden_states must be {layout} (attn_input_format="
                             f"{self.attn_input_format!r}) with h = hidden_size = {self.hidden_size}, got shape "
                             f"{list(x.shape)}" + ("; add the batch dim, e.g. x.unsqueeze(1)" if x.dim() == 2 else ""))
        if x.dtype not in FP8_INPUT_DTYPES and not (x.dtype == torch.float64 and get_fp8_context() is None):
            raise TypeError(f"TransformerLayer: hidden_states must be float32, bfloat16 or float16 (float64 outside "
                            f"FP8), got {x.dtype}")

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                self_attn_mask_type: Optional[str] = None, *, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False,
                rotary_pos_emb: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``hidden_states``: ``[s, b, h]`` (``[s/tp, b, h]`` sequence parallel; ``[b, s, h]`` with
        ``attn_input_format="bshd"``) float32/bfloat16/float16 -> same shape and dtype.

        ``attention_mask``: bool, True = masked out: ``[b, 1, 1, s]`` for the padding mask types (``[b, 1, s, s]``
        or broadcastable for ``"arbitrary"``); None for ``"causal"``/``"no_mask"``.
        ``self_attn_mask_type``: this call's mask type (default: the constructor's).
        ``rotary_pos_emb``: ``[s, 1, 1, r]`` angles from :class:`fp8engine.modules.RotaryEmbedding` (full ``s``).
        ``is_first_microbatch``: FP8 weight caching across micro-batches (None: cast every call).
        ``checkpoint_core_attention``: recompute the attention's core in backward (composed path).

        Raises:
            ValueError: ``hidden_states`` not 3-D or its last dim not ``hidden_size``; a mask that does not fit the
                mask type. TypeError: another dtype (an integer tensor; float64 under FP8).
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size or (
                hidden_states.dtype not in FP8_INPUT_DTYPES):
            self._check_input(hidden_states)
        mask_type = (self.self_attn_mask_type if self_attn_mask_type is None
                     else attn_mask_type_of(self_attn_mask_type, "TransformerLayer"))
        bshd = self.attn_input_format == "bshd"
        x = hidden_states.transpose(0, 1).contiguous() if bshd else hidden_states  # [s, b, h]
        if (self.fused and self._fusable and mask_type in _FUSED_MASKS and attention_mask is None
                and not checkpoint_core_attention):
            plan = self._fused_plan(x, rotary_pos_emb, is_first_microbatch, mask_type == "causal")
            if plan is not None:
                out = fused_layer(x, plan[0], plan[1])
                return out.transpose(0, 1).contiguous() if bshd else out
        out = self._composed(x, attention_mask, mask_type, is_first_microbatch, checkpoint_core_attention,
                             rotary_pos_emb)
        return out.transpose(0, 1).contiguous() if bshd else out

    def _composed(self, x: torch.Tensor, attention_mask, mask_type: str, is_first_microbatch: Optional[bool],
                  checkpoint_core_attention: bool, rope: Optional[torch.Tensor]) -> torch.Tensor:
        """The sublayers one by one on ``[s, b, h]`` (the variants of the class docstring)."""
        # The first residual add runs inside the MLP's norm kernel (it normalises residual + attn and returns the
        # sum); the gradients reaching the residuals through the residual path are added inside the two norms'
        # backward kernels (return_norm_input), so only the last add is a separate kernel.
        attn_out = self.self_attention(x, attention_mask, rotary_pos_emb=rope, is_first_microbatch=is_first_microbatch,
                                       attn_mask_type=mask_type, checkpoint_core_attention=checkpoint_core_attention,
                                       return_norm_input=True)
        if self.self_attention.return_layernorm_output:  # post-LN residual: ln1(x), added outside the norm
            attn, ln1, _ = attn_out
            mlp_in, residual = ln1 + self._dropout(attn), None
        else:
            attn, hidden_in = attn_out
            mlp_in, residual = self._dropout(attn), hidden_in
        mlp_out = self.layernorm_mlp(mlp_in, is_first_microbatch=is_first_microbatch, residual=residual,
                                     return_norm_input=True)
        if self.apply_residual_connection_post_layernorm:  # residual: ln2(x1)
            mlp, ln2, _ = mlp_out
            out = ln2 + self._dropout(mlp)
        else:
            mlp, x1 = mlp_out
            out = x1 + self._dropout(mlp)
        return self.layernorm(out) if self.output_layernorm else out

    def _fused_plan(self, x: torch.Tensor, rope: Optional[torch.Tensor], is_first_microbatch: Optional[bool],
                    is_causal: bool):
        """``(params, LayerPlan)`` for :func:`fp8engine.ops.layer.fused_layer` (``is_causal``: the mask, causal or
        none), or None where the fused step does not apply (see ``fused`` in the class docstring; the composed
        sublayers then run)."""
        attn, mlp = self.self_attention, self.layernorm_mlp
        if (get_fp8_context() is None or torch.compiler.is_compiling() or x.dim() != 3
                or not attn.fuse_qkv_params
                or not attn._input_layernorm or attn.config.tp_size > 1 or mlp.tp_group is not None
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
        gathered = any(isinstance(w, GatheredFP8Weight)
                       for w in (w_qkv, proj.weight, mlp.fc1_weight, mlp.fc2_weight))  # FSDP2's FP8 all-gather
        if is_first_microbatch is None and torch.is_grad_enabled() and not gathered:
            # nothing cached across micro-batches: the fused step casts the weights itself (with its other ops,
            # so they are recorded and replayed with it: ops.layer), as FP8WeightCache.get would; FP8-gathered
            # weights come in as their bits (fp8_weight)
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
                         rope=rope, attn=dict(dropout_p=dropout_p, is_causal=is_causal, enable_gqa=gl != hl),
                         rng=rng, norm1=(lq.eps, lq._rms, lq.zero_centered_gamma),
                         norm2=(mlp.eps, mlp._rms, mlp.zero_centered_gamma), kind=mlp.activation,
                         fuse_wgrad=mlp.fuse_wgrad_accumulation, gelu_epilogue=mlp.gelu_epilogue,
                         hidden_dropout=self.hidden_dropout if self.training else 0.0)
        params = (lq.layer_norm_weight, lq.layer_norm_bias, w_qkv, b_qkv, proj.weight, proj.bias,
                  mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.fc1_weight, mlp.fc1_bias, mlp.fc2_weight,
                  mlp.fc2_bias)
        return params, plan
