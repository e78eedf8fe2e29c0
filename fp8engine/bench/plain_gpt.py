"""The peers of ``bench train``: the training command's GPT written in plain PyTorch, trained in bf16 or with
torchao.float8, on one GPU or sharded with FSDP2 the way torchtitan does it.

:class:`PlainGPT` has the shapes of :class:`fp8engine.models.GPTConfig` (embedding tied to the LM head, pre-norm
blocks with LayerNorm or RMSNorm, rotary attention with grouped-query heads through SDPA (causal), a GELU(tanh) or
SwiGLU MLP, the same init std) built from ``nn.Linear``, so ``torchao.float8.convert_to_float8_training`` swaps
its GEMMs (tensorwise dynamic scaling, torchao's default) and nothing else. Under ``--fsdp`` each block and the
root are ``fully_shard``-ed (bf16 all-gather, fp32 reduce-scatter), torchao with
``enable_fsdp_float8_all_gather=True`` and ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer
step (torchao's recipe for FSDP2). Each block is ``torch.compile``-d in the ``-compile`` modes (torchao.float8
is meant to be compiled: its eager casts are separate kernels).

Modes (``bench train --modes``): ``plain-bf16``, ``plain-bf16-compile``, ``torchao-fp8-compile``; same data,
batches, AdamW settings and gradient clipping as the command's step; eager steps (no CUDA graph), as FSDP2 runs.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PlainGPT", "PEER_MODES", "build_peer"]

#: mode -> (torchao.float8, compile the blocks)
PEER_MODES = {"plain-bf16": (False, False), "plain-bf16-compile": (False, True), "torchao-fp8-compile": (True, True)}


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x [b, heads, s, d]`` (rotate-half form, GPT-NeoX / Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class PlainBlock(nn.Module):
    """Pre-norm block: norm, QKV, rotary, SDPA (causal, GQA), proj, residual; norm, MLP, residual."""

    def __init__(self, config, device=None):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.heads, self.kv, self.d = config.n_head, config.kv_heads, config.head_dim
        norm = nn.LayerNorm if config.normalization == "LayerNorm" else nn.RMSNorm
        self.norm1, self.norm2 = norm(h, eps=config.layernorm_eps, device=device), norm(h, eps=config.layernorm_eps,
                                                                                        device=device)
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv) * self.d, device=device)
        self.proj = nn.Linear(h, h, device=device)
        self.swiglu = config.activation == "swiglu"
        self.fc1 = nn.Linear(h, 2 * f if self.swiglu else f, device=device)
        self.fc2 = nn.Linear(f, h, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        q = _rope(q.view(b, s, self.heads, self.d).transpose(1, 2), cos, sin)
        k = _rope(k.view(b, s, self.kv, self.d).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        u = self.fc1(self.norm2(x))
        if self.swiglu:
            gate, up = u.chunk(2, dim=-1)
            u = F.silu(gate) * up
        else:
            u = F.gelu(u, approximate="tanh")
        return x + self.fc2(u)


class PlainGPT(nn.Module):
    """``forward(tokens [b, s], targets [b, s])`` -> mean cross-entropy (fp32 logits, as the command's unfused
    loss). Shapes and init of :class:`fp8engine.models.GPT` for ``config``."""

    def __init__(self, config, device=None):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size, device=device)
        self.layers = nn.ModuleList(PlainBlock(config, device) for _ in range(config.n_layer))
        norm = nn.LayerNorm if config.normalization == "LayerNorm" else nn.RMSNorm
        self.final_norm = norm(config.hidden_size, eps=config.layernorm_eps, device=device)
        d = config.head_dim
        inv = 1.0 / config.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
        angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32, device=device), inv)
        self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)
        out_std = config.init_std / math.sqrt(2 * config.n_layer)  # GPT-2's scaled init of output projections
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, out_std if name.endswith(("proj.weight", "fc2.weight")) else config.init_std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:  # the command's step passes it; unused
        s = tokens.shape[1]
        x = self.embedding(tokens)
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = F.linear(self.final_norm(x), self.embedding.weight)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_peer(mode: str, config, device: torch.device, layout, fsdp: bool):
    """``(model, after_step)`` for a peer ``mode`` of :data:`PEER_MODES`: the plain GPT (converted by torchao,
    sharded, compiled as the mode says); ``after_step()`` runs after each optimizer step (torchao's scale
    precompute under FSDP2, else nothing).

    Raises:
        ValueError: an unknown mode, or a tensor-parallel layout (the peers are data-parallel only).
        ImportError: torchao.float8 is not installed (torchao modes).
    """
    if mode not in PEER_MODES:
        raise ValueError(f"unknown peer mode {mode!r}; choose from {', '.join(PEER_MODES)}")
    if layout.tp_size > 1:
        raise ValueError("the plain PyTorch peers run on one GPU, data parallel or with --fsdp; not with --tp")
    use_torchao, compile_blocks = PEER_MODES[mode]
    model = PlainGPT(config, device=device)
    after_step = None
    if use_torchao:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp),
                                   module_filter_fn=lambda m, fqn: fqn.startswith("layers."))
        if fsdp:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            after_step = functools.partial(precompute_float8_dynamic_scale_for_fsdp, model)
    if compile_blocks:
        for layer in model.layers:
            layer.compile()
    if fsdp:
        from fp8engine.parallel.fsdp import shard_model

        param_dtype = torch.bfloat16 if device.type == "cuda" else None
        shard_model(model, layout.dp_mesh, model.layers, param_dtype=param_dtype)
    return model, after_step
