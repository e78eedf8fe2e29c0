"""A GPT built from fp8engine's ``TransformerLayer``: token embedding, rotary positions, N pre-norm layers, a
final norm and an LM head tied to the embedding.

Only the layers' Linears run in FP8 (inside :func:`fp8engine.autocast`); the embedding, the tied LM head and the
cross-entropy stay in high precision (the parameters' dtype, or the ``torch.autocast`` dtype around the call),
as in TransformerEngine/Megatron recipes: the first and last GEMMs are the most sensitive to quantization.
``GPTConfig.fp8_lm_head`` runs the LM head GEMMs in FP8 too (off by default; see :class:`GPTConfig`).

Loss: with ``targets`` the LM head and the cross-entropy are fused and chunked by default
(``GPTConfig.lm_loss="chunked"``, :func:`fp8engine.ops.lm_head.fused_linear_cross_entropy`): the
``[tokens, vocab]`` logits, their fp32 copy and their gradient never exist whole. Without ``targets`` the model
returns the logits (sampling, evaluation).

Layout: the model takes and returns batch-first tensors (``tokens [b, s]``, ``logits [b, s, V]``); inside it
works in TransformerEngine's ``[s, b, h]``.

Tensor parallelism (``tp_group`` given): the embedding and the LM head are vocab-parallel
(:class:`fp8engine.parallel.VocabParallelEmbedding`; the local vocab shard is read from the weight's shape), the
layers are column/row parallel, and the loss is the fused
:func:`fp8engine.parallel.vocab_parallel_linear_cross_entropy` (``lm_loss="unfused"``:
:func:`fp8engine.parallel.vocab_parallel_cross_entropy` over materialized logits).
Everything that talks to ``torch.distributed`` lives in ``fp8engine.parallel``; this file only passes groups on.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fp8engine.fp8.autocast import get_fp8_context
from fp8engine.modules.attention import RotaryEmbedding
from fp8engine.modules.fp8_init import fp8_model_init
from fp8engine.modules.linear import Linear
from fp8engine.modules.norm import LayerNorm, RMSNorm
from fp8engine.modules.transformer import TransformerLayer
from fp8engine.ops.lm_head import LM_LOSS_BACKENDS, lm_head_cross_entropy
from fp8engine.parallel import (VocabParallelEmbedding, copy_to_tensor_model_parallel_region,
                                gather_from_sequence_parallel_region, vocab_parallel_cross_entropy,
                                vocab_parallel_linear_cross_entropy)

__all__ = ["GPTConfig", "GPT", "GPT_CONFIGS", "FP8_ALIGN"]

#: FP8 GEMMs (torch._scaled_mm / cuBLASLt) need every Linear's in/out features to be a multiple of this.
FP8_ALIGN = 16


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT. Frozen; invariants are checked in ``__post_init__``.

    Args:
        n_layer: number of ``TransformerLayer`` blocks.
        n_head: attention heads; ``hidden_size`` must divide by it, and the head dim must be even (rotary).
        hidden_size: model width ``h``.
        ffn_hidden_size: MLP inner width (usually ``4 * h``).
        max_seq_len: context length the model is built and sized for (rotary table length).
        vocab_size: embedding rows; the training command sets it from the data (256 for bytes).
        num_gqa_groups: key/value heads for grouped-query attention (None = ``n_head``, plain MHA).
        dropout: hidden and attention dropout probability.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``. activation: passed to ``TransformerLayer``.
        layernorm_eps: norm epsilon. rotary_base: RoPE base ``theta``. init_std: std of the normal init
            (output projections use ``init_std / sqrt(2 * n_layer)``, GPT-2's scaled init).
        lm_loss: how ``model(tokens, targets)`` computes the LM head + cross-entropy
            (:func:`fp8engine.ops.lm_head.lm_head_cross_entropy`): ``"chunked"`` (default: fused, chunked, plain
            PyTorch; vocab-parallel under tensor parallelism), ``"liger"`` / ``"cce"`` (liger-kernel / cut-cross-
            entropy, CUDA only, not tensor-parallel; a missing package or a CPU tensor raises RuntimeError at the
            first loss, no fallback), ``"unfused"`` (logits materialized, then ``F.cross_entropy``).
        fp8_lm_head: inside :func:`fp8engine.autocast`, run the tied LM head's three GEMMs in FP8 with their own
            scaling state (``GPT.fp8_head``); the loss is then the unfused cross-entropy over the FP8 GEMM's
            logits, whatever ``lm_loss`` says (an accuracy option: the logits are materialized). Needs
            ``vocab_size`` (per tp rank) to be a multiple of 16 (128 under block scaling). Off by default, as in
            TransformerEngine/Megatron recipes.
    Raises:
        ValueError: a size is non-positive or inconsistent; the message says which and what to change.
    """

    n_layer: int = 2
    n_head: int = 4
    hidden_size: int = 128
    ffn_hidden_size: int = 512
    max_seq_len: int = 128
    vocab_size: int = 256
    num_gqa_groups: Optional[int] = None
    dropout: float = 0.0
    normalization: str = "LayerNorm"
    activation: str = "gelu"
    layernorm_eps: float = 1e-5
    rotary_base: int = 10000
    init_std: float = 0.02
    lm_loss: str = "chunked"
    fp8_lm_head: bool = False

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "hidden_size", "ffn_hidden_size", "max_seq_len", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int; got {value!r}")
        if self.hidden_size % self.n_head:
            raise ValueError(f"GPTConfig.hidden_size={self.hidden_size} must be divisible by n_head={self.n_head}")
        if self.head_dim % 2:
            raise ValueError(f"GPTConfig head dim hidden_size/n_head={self.head_dim} must be even for rotary "
                             "embeddings; change hidden_size or n_head")
        if self.num_gqa_groups is not None and (self.num_gqa_groups < 1 or self.n_head % self.num_gqa_groups):
            raise ValueError(f"GPTConfig.num_gqa_groups={self.num_gqa_groups} must divide n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1); got {self.dropout!r}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"GPTConfig.normalization must be 'LayerNorm' or 'RMSNorm'; got {self.normalization!r}")
        if self.lm_loss not in LM_LOSS_BACKENDS:
            raise ValueError(f"GPTConfig.lm_loss must be one of {', '.join(map(repr, LM_LOSS_BACKENDS))}; "
                             f"got {self.lm_loss!r}")
        if not isinstance(self.fp8_lm_head, bool):
            raise ValueError(f"GPTConfig.fp8_lm_head must be True or False; got {self.fp8_lm_head!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.num_gqa_groups or self.n_head

    @classmethod
    def from_name(cls, name: str, **overrides) -> "GPTConfig":
        """The named config (see :data:`GPT_CONFIGS`) with ``overrides`` applied.

        Raises:
            ValueError: unknown name (the message lists the known ones).
        """
        if name not in GPT_CONFIGS:
            raise ValueError(f"unknown model {name!r}; choose one of {', '.join(GPT_CONFIGS)}")
        return dataclasses.replace(GPT_CONFIGS[name], **overrides)

    def fp8_problems(self, tp_size: int = 1, align: int = FP8_ALIGN) -> list[str]:
        """Why this model's Linears cannot run as FP8 GEMMs with ``tp_size``-way tensor parallelism ([] if they can).

        Per rank the Linears are QKV ``h -> (n_head + 2 kv_heads) * head_dim / tp``, proj ``h / tp -> h``,
        fc1 ``h -> ffn / tp``, fc2 ``ffn / tp -> h``, and with ``fp8_lm_head`` the head ``h -> vocab / tp``;
        each dim must be a multiple of ``align``:
        :data:`FP8_ALIGN` for per-tensor scaling, ``Float8BlockScaling.BLOCK_SIZE`` (128) for block scaling.
        (swiglu's fc1 has ``2 * ffn / tp`` outputs, a multiple of ``align`` when ``ffn / tp`` is.)
        """
        qkv = (self.n_head + 2 * self.kv_heads) * self.head_dim
        dims = {"hidden_size": self.hidden_size, "ffn_hidden_size": self.ffn_hidden_size,
                "QKV width (n_head + 2*kv_heads)*head_dim": qkv}
        if self.fp8_lm_head:
            dims["vocab_size (fp8_lm_head)"] = self.vocab_size
        problems = []
        for what, dim in dims.items():
            if dim % tp_size:
                problems.append(f"{what}={dim} is not divisible by tp={tp_size}")
            elif (dim // tp_size) % align:
                per_rank = "" if tp_size == 1 else f" per rank ({dim // tp_size} with tp={tp_size})"
                problems.append(f"{what}={dim}{per_rank} is not a multiple of {align}")
        return problems

    def num_params(self) -> int:
        """Parameter count (the tied LM head counted once; biases and norms included), unsharded."""
        h, f, qkv = self.hidden_size, self.ffn_hidden_size, (self.n_head + 2 * self.kv_heads) * self.head_dim
        f1 = 2 * f if self.activation == "swiglu" else f  # SwiGLU's fc1 holds gate and up
        norm = 2 * h if self.normalization == "LayerNorm" else h
        layer = (h * qkv + qkv) + (h * h + h) + (h * f1 + f1) + (f * h + h) + 2 * norm
        return self.vocab_size * h + self.n_layer * layer + norm


#: Named sizes. ``vocab_size`` is a default: the training command replaces it with the data's vocabulary.
GPT_CONFIGS: dict[str, GPTConfig] = {
    # CPU default: FP8-capable (all dims multiples of 16), ~0.4M parameters, trains in minutes on 2 cores.
    "tiny": GPTConfig(n_layer=2, n_head=4, hidden_size=128, ffn_hidden_size=512, max_seq_len=128, vocab_size=256),
    # nanoGPT's character-level Shakespeare "baby GPT": 6 layers, 6 heads, 384 wide, context 256 (~10.7M).
    "small": GPTConfig(n_layer=6, n_head=6, hidden_size=384, ffn_hidden_size=1536, max_seq_len=256,
                       vocab_size=256, dropout=0.2),
    # GPT-2 small (124M with GPT-2's 50257-token BPE padded to 50304, a multiple of 64).
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, hidden_size=768, ffn_hidden_size=3072, max_seq_len=1024,
                           vocab_size=50304),
    # ~1.3B: 24 layers x 16 heads x 2048 wide, ffn 8192, context 2048 (GPT-3 XL's shape); 1.21B in the
    # layers plus 0.10B tied embedding at vocab 50304.
    "1b": GPTConfig(n_layer=24, n_head=16, hidden_size=2048, ffn_hidden_size=8192, max_seq_len=2048,
                    vocab_size=50304),
    # Llama-3-8B's shape (32 layers x 32 heads x 4096, grouped-query attention with 8 KV heads, SwiGLU FFN 14336,
    # RMSNorm, rotary base 500000, context 2048) at GPT-2's vocabulary: 7.2 B parameters, 115 GB of fp32 weights and
    # AdamW state: more than one GPU holds, trained with --fsdp (python -m fp8engine.train --fsdp, issue 46).
    "8b": GPTConfig(n_layer=32, n_head=32, hidden_size=4096, ffn_hidden_size=14336, max_seq_len=2048,
                    vocab_size=50304, num_gqa_groups=8, normalization="RMSNorm", activation="swiglu",
                    rotary_base=500000),
}


def _normal_init(std: float):
    def init(weight: torch.Tensor) -> None:
        nn.init.normal_(weight, mean=0.0, std=std)
    return init


def _no_init(weight: torch.Tensor) -> None:
    """Leave a weight uninitialized (one that is replaced right after construction)."""


class GPT(nn.Module):
    """Decoder-only transformer LM.

    Args:
        config: a :class:`GPTConfig`.
        tp_group: tensor-parallel process group (None: unsharded). Vocab-parallel embedding/LM head/loss and
            column/row-parallel layers when given.
        sequence_parallel: with ``tp_group``, layer norms and dropout run on sequence shards ``[s / tp, b, h]``.
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``).
        device: where to allocate parameters.
        rng_tracker: with ``tp_group``, the :class:`fp8engine.parallel.RNGStatesTracker` whose model-parallel state
            drives dropout inside tensor-parallel regions (see :class:`TransformerLayer`).
    Attributes:
        fp8_head: with ``config.fp8_lm_head``, the LM head as an :class:`fp8engine.Linear` ``h -> V_local`` without
            bias whose ``weight`` is the embedding's (tied, as Hugging Face ties ``lm_head.weight``): it owns the
            head's FP8 scaling state (``fp8_head.fp8_state`` in the ``state_dict``; the tied weight appears there
            twice, ``embedding.weight`` and ``fp8_head.weight``, one tensor); else None.
    Raises:
        ValueError: ``sequence_parallel`` without ``tp_group``; ``lm_loss`` ``"liger"``/``"cce"`` with ``tp_group``
            (they have no vocab-parallel form: use ``"chunked"``).
    Shapes:
        ``forward(tokens [b, s] int64)`` -> ``logits [b, s, V_local]`` (``V_local = V / tp``), or the mean
        cross-entropy (float32 scalar) when ``targets [b, s]`` is given. ``s <= config.max_seq_len``.
    """

    def __init__(self, config: GPTConfig, *, tp_group=None, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None, rng_tracker=None):
        super().__init__()
        if sequence_parallel and tp_group is None:
            raise ValueError("sequence_parallel=True needs a tp_group")
        if tp_group is not None and config.lm_loss in ("liger", "cce"):
            raise ValueError(f"lm_loss={config.lm_loss!r} has no vocab-parallel form; with tensor parallelism use "
                             "lm_loss='chunked' (fused, vocab-parallel) or 'unfused'")
        self.config, self.tp_group, self.sequence_parallel = config, tp_group, sequence_parallel
        dtype = params_dtype or torch.get_default_dtype()
        # The unsharded model uses the same module with tp_group=None (a plain lookup), so the same seed gives
        # the same table whether or not it is split over the vocabulary.
        self.embedding = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group=tp_group,
                                                reduce_scatter_embeddings=sequence_parallel,
                                                init_method=_normal_init(config.init_std), params_dtype=dtype,
                                                device=device)
        self.rotary = RotaryEmbedding(config.head_dim, base=config.rotary_base, device=device)
        self._rope_cache: dict = {}
        layer_kwargs = dict(
            num_gqa_groups=config.num_gqa_groups, layernorm_epsilon=config.layernorm_eps,
            hidden_dropout=config.dropout, attention_dropout=config.dropout, self_attn_mask_type="causal",
            normalization=config.normalization, activation=config.activation, params_dtype=dtype, device=device,
            init_method=_normal_init(config.init_std),
            output_layer_init_method=_normal_init(config.init_std / math.sqrt(2 * config.n_layer)))
        if tp_group is not None:
            layer_kwargs.update(set_parallel_mode=True, tp_group=tp_group, sequence_parallel=sequence_parallel,
                                rng_tracker=rng_tracker)
        self.layers = nn.ModuleList(
            TransformerLayer(config.hidden_size, config.ffn_hidden_size, config.n_head, **layer_kwargs)
            for _ in range(config.n_layer))
        norm_cls = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
        self.final_norm = norm_cls(config.hidden_size, eps=config.layernorm_eps, params_dtype=dtype, device=device)
        for p in self.final_norm.parameters():  # replicated over tp; grads summed over tp when sequence parallel
            p.sequence_parallel = sequence_parallel
        self.fp8_head = None
        if config.fp8_lm_head:  # no init (no RNG drawn): its weight is replaced by the embedding's (so never FP8)
            with fp8_model_init(enabled=False):
                self.fp8_head = Linear(config.hidden_size, self.embedding.weight.shape[0], bias=False,
                                       params_dtype=dtype, device=device, init_method=_no_init)
            self.fp8_head.weight = self.embedding.weight

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [b, s]`` -> ``[s, b, h]`` (``[s/tp, b, h]`` sequence parallel), dropout applied.

        Dropout draws from the default generator, which is seeded alike on all tp ranks (replicated activations
        get identical masks; sequence shards get the same pattern per shard)."""
        hidden = self.embedding(tokens if self.sequence_parallel else tokens.t())
        if torch.is_autocast_enabled(hidden.device.type):
            # The residual stream runs in the autocast dtype, as in a model with bf16 parameters: the layers'
            # fused residual adds (norm kernels) take x and the residual in one dtype.
            hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
        return F.dropout(hidden, self.config.dropout, self.training)

    def num_params(self) -> int:
        """Parameters held by this rank (the tied LM head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``tokens [b, s]`` -> ``logits [b, s, V_local]``; with ``targets [b, s]`` the mean cross-entropy (0-d
        float32) instead, by ``config.lm_loss`` (the logits are then not returned, and by default never
        materialized).

        ``is_first_microbatch`` is passed to every layer and the FP8 head (FP8 weight caching during gradient
        accumulation).
        """
        b, s = tokens.shape
        if s > self.config.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds the model's max_seq_len={self.config.max_seq_len}")
        hidden = self._embed(tokens)                            # [s(/tp), b, h]
        rope = self._rope(s, hidden.device)                      # [s, 1, 1, head_dim]
        for layer in self.layers:
            hidden = layer(hidden, is_first_microbatch=is_first_microbatch, rotary_pos_emb=rope)
        hidden = self.final_norm(hidden)                         # [s(/tp), b, h]
        if targets is None:
            return self._lm_head(hidden, is_first_microbatch).transpose(0, 1)
        return self._loss(hidden, targets.t(), is_first_microbatch)

    def _rope(self, s: int, device: torch.device) -> torch.Tensor:
        """Rotary angles ``[s, 1, 1, head_dim]`` fp32 on ``device``, computed once per (length, device): no
        host-to-device copy per forward (which a captured CUDA graph would also refuse). Under ``torch.compile``
        computed in the graph (from the ``inv_freq`` buffer, on its device)."""
        if torch.compiler.is_compiling():  # in the graph: a cache look-up would be guarded, its fill re-trace once
            return self.rotary(s).to(device)
        key = (s, device)
        rope = self._rope_cache.get(key)
        if rope is None:
            rope = self._rope_cache[key] = self.rotary(s).to(device)
        return rope

    def _head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's input ``[s, b, h]`` on every tp rank: the sequence shards all-gathered, or the replicated
        activations entering the tensor-parallel region (their gradient, a partial sum per vocab shard, is
        reduced in backward)."""
        if self.tp_group is None:
            return hidden
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden, self.tp_group)
        return copy_to_tensor_model_parallel_region(hidden, self.tp_group)

    def _lm_head(self, hidden: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """Tied LM head ``hidden [s(/tp), b, h]`` -> ``[s, b, V_local]``: ``hidden @ embedding.weight.T`` in high
        precision, or in FP8 by :attr:`fp8_head` inside :func:`fp8engine.autocast`."""
        hidden = self._head_input(hidden)
        if self.fp8_head is not None and get_fp8_context() is not None:
            return self.fp8_head(hidden, is_first_microbatch)
        return F.linear(hidden, self.embedding.weight)

    def _cross_entropy(self, logits_sb: torch.Tensor, targets_sb: torch.Tensor) -> torch.Tensor:
        """The unfused loss: mean cross-entropy of materialized logits ``[s, b, V_local]`` (in float32)."""
        if self.tp_group is not None:
            return vocab_parallel_cross_entropy(logits_sb.float(), targets_sb, tp_group=self.tp_group).mean()
        return F.cross_entropy(logits_sb.float().reshape(-1, logits_sb.shape[-1]), targets_sb.reshape(-1))

    def _loss(self, hidden: torch.Tensor, targets_sb: torch.Tensor,
              is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """Mean cross-entropy of the LM head over ``hidden [s(/tp), b, h]`` and ``targets [s, b]``, by
        ``config.lm_loss`` (the FP8 head, when active, over its materialized logits)."""
        backend = self.config.lm_loss
        if backend == "unfused" or (self.fp8_head is not None and get_fp8_context() is not None):
            return self._cross_entropy(self._lm_head(hidden, is_first_microbatch), targets_sb)
        if self.tp_group is not None:
            return vocab_parallel_linear_cross_entropy(hidden, self.embedding.weight, targets_sb,
                                                       tp_group=self.tp_group,
                                                       sequence_parallel=self.sequence_parallel)
        return lm_head_cross_entropy(hidden, self.embedding.weight, targets_sb, backend)

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``tokens [b, t]``; returns ``[b, t + max_new_tokens]``.

        The context is cropped to the last ``max_seq_len`` tokens (no KV cache: one full forward per token).
        ``temperature <= 0`` picks the argmax; ``top_k`` keeps the k most likely tokens before sampling.
        Unsharded models only (``tp_group`` None).

        Raises:
            ValueError: ``max_new_tokens < 0``, ``top_k < 1``, a tensor-parallel model, or logits that are not
                finite (a diverged model: sampling from them would trip ``torch.multinomial``'s device-side
                assert, which ends the process's CUDA context; checked on the host once per token).
        """
        if self.tp_group is not None:
            raise ValueError("generate() runs on unsharded models only (tp_group=None)")
        if max_new_tokens < 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"need max_new_tokens >= 0 and top_k >= 1; got {max_new_tokens}, {top_k}")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                context = tokens[:, -self.config.max_seq_len:]
                logits = self(context)[:, -1, :].float()         # [b, V]
                if not bool(torch.isfinite(logits).all()):
                    raise ValueError("cannot sample: the model's logits are not finite (its weights diverged)")
                next_token = _sample(logits, temperature, top_k, generator)
                tokens = torch.cat([tokens, next_token], dim=1)
        finally:
            self.train(was_training)
        return tokens


def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int],
            generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logits [b, V]`` -> ``[b, 1]`` int64."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)
