"""``DotProductAttention`` (TransformerEngine's core-attention module) and :func:`attention`, the core attention
``softmax(q k^T * scale + mask) v`` that every attention module of the package runs.

Both run ``torch.nn.functional.scaled_dot_product_attention`` (the backend PyTorch picks: flash, memory-efficient or
cuDNN on CUDA; flash or math on CPU), in the activations' precision: attention itself is not an FP8 GEMM here
(TransformerEngine's FP8 attention, ``fp8_dpa``, is not implemented). The fused FP8 layer step
(:mod:`fp8engine.ops.layer`) calls the same backend kernels itself (:mod:`fp8engine.ops.sdpa`) for the mask types it
covers ("causal", "no_mask").

Mask types (TransformerEngine's names; a boolean ``attention_mask`` is True where a position is masked OUT):

- ``"no_mask"``: every query attends every key.
- ``"causal"``: query ``i`` attends keys ``j <= i``, aligned to the top-left corner of the ``[sq, skv]`` score
  matrix (TE's ``"causal"``; ``"causal_bottom_right"`` is not implemented).
- ``"padding"``: ``attention_mask`` bool ``[b, 1, 1, s]`` (self-attention: the same mask for queries and keys) or a
  pair ``([b, 1, 1, sq], [b, 1, 1, skv])``. Masked keys get no weight; the output at masked query positions is
  zero, as TE's backends return it, so padding passes no gradient to the keys and values.
- ``"padding_causal"`` (aliases ``"padding,causal"``, ``"causal,padding"``, ``"causal_padding"``, as TE): both. This
  builds a ``[b, 1, sq, skv]`` boolean mask per call (SDPA takes a causal flag or a mask, not both).
- ``"arbitrary"``: ``attention_mask`` bool, broadcastable to ``[b, heads, sq, skv]``. A query row whose keys are all
  masked gives NaN (as SDPA does).

Not implemented (``ValueError``): bottom-right causal masks, sliding windows other than "none", and, as arguments
``DotProductAttention`` does not take (``TypeError``), TE's ``thd`` format, ``cu_seqlens``, ALiBi, core-attention
bias, context parallelism and inference KV caches.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from fp8engine.modules.layernorm_linear import check_choice, check_divisible, tp_size_rank

__all__ = ["DotProductAttention", "attention", "attn_mask_type_of", "ATTN_MASK_TYPES", "QKV_FORMATS"]

#: The mask types :func:`attention` takes (module docstring).
ATTN_MASK_TYPES = ("causal", "padding", "no_mask", "padding_causal", "arbitrary")
_MASK_ALIASES = {"padding,causal": "padding_causal", "causal,padding": "padding_causal",
                 "causal_padding": "padding_causal"}
#: ``"sbhd"``: ``[s, b, heads, d]``; ``"bshd"``: ``[b, s, heads, d]``.
QKV_FORMATS = ("sbhd", "bshd")
_UNMASKED = ("causal", "no_mask")


def attn_mask_type_of(value: str, owner: str) -> str:
    """``value`` with TE's aliases resolved (``"padding,causal"`` -> ``"padding_causal"``); ``ValueError`` naming
    the supported types for any other name."""
    value = _MASK_ALIASES.get(value, value)
    check_choice("attn_mask_type", value, ATTN_MASK_TYPES, owner)
    return value


def _check_bool(mask: torch.Tensor, what: str) -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{what} must be a bool tensor (True = masked out), got "
                        f"{mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__}")


def _padding_masks(attention_mask, b: int, sq: int, skv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_mask [b, 1, 1, sq], kv_mask [b, 1, 1, skv])`` from one mask (self-attention) or a pair."""
    q_mask, kv_mask = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask,) * 2
    for mask, s, what in ((q_mask, sq, "query"), (kv_mask, skv, "key/value")):
        _check_bool(mask, "attention_mask")
        if tuple(mask.shape) != (b, 1, 1, s):
            raise ValueError(f"padding attention_mask for the {what}s must be [b, 1, 1, s] = {[b, 1, 1, s]}, got "
                             f"{list(mask.shape)} (cross-attention with other lengths: pass a (q_mask, kv_mask) "
                             "pair)")
    return q_mask, kv_mask


def _sdpa_mask(mask_type: str, attention_mask, b: int, sq: int, skv: int
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(allowed, q_pad)`` for a masked type: SDPA's boolean mask (True = attend) and, for the padding types, the
    ``[b, 1, sq, 1]`` mask of query rows whose output is zeroed."""
    if attention_mask is None:
        raise ValueError(f"attn_mask_type={mask_type!r} needs attention_mask (bool, True = masked out: "
                         "[b, 1, 1, s] for padding)")
    if mask_type == "arbitrary":
        _check_bool(attention_mask, "attention_mask")
        return ~attention_mask, None
    q_mask, kv_mask = _padding_masks(attention_mask, b, sq, skv)
    allowed = ~kv_mask  # [b, 1, 1, skv]
    if mask_type == "padding_causal":
        allowed = allowed & torch.ones(sq, skv, dtype=torch.bool, device=allowed.device).tril()  # [b, 1, sq, skv]
    # A row with no key to attend (a padded query under a causal mask, a batch entry with no valid key) would be NaN
    # and poison the keys' gradients in backward: such rows attend every key instead (finite); the padded query
    # rows are zeroed after the attention anyway.
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return allowed, q_mask.reshape(b, 1, sq, 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_type: str,
              attention_mask: Optional[Union[torch.Tensor, tuple]] = None, dropout_p: float = 0.0,
              scale: Optional[float] = None, rng_tracker=None) -> torch.Tensor:
    """Core attention on SDPA's layout (module docstring for the mask types).

    Args:
        q: ``[b, H, sq, d]``; k: ``[b, G, skv, d]``; v: ``[b, G, skv, dv]`` (any strides; G divides H: grouped-query
            attention); one floating dtype.
        mask_type: one of :data:`ATTN_MASK_TYPES` (aliases resolved: :func:`attn_mask_type_of`).
        attention_mask: bool, True = masked out; only with the padding types and ``"arbitrary"``.
        dropout_p: dropout on the attention probabilities (pass 0.0 outside training).
        scale: multiplies ``q k^T``; None: ``1 / sqrt(d)``.
        rng_tracker: object with ``fork()`` (:class:`fp8engine.parallel.RNGStatesTracker`) the dropout draws from;
            None: the default generator.
    Returns:
        ``[b, H, sq, dv]`` in q's dtype.
    Raises:
        ValueError: a mask with ``"causal"``/``"no_mask"``, no mask with the others, a padding mask of the wrong
            shape. TypeError: a mask that is not bool.
    """
    allowed = q_pad = None
    if mask_type in _UNMASKED:
        if attention_mask is not None:
            raise ValueError(f"attention_mask is only used with attn_mask_type='padding' (or 'padding_causal', "
                             f"'arbitrary'), not {mask_type!r}; pass None or change attn_mask_type")
    else:
        allowed, q_pad = _sdpa_mask(mask_type, attention_mask, q.shape[0], q.shape[2], k.shape[2])
    fork = rng_tracker.fork() if rng_tracker is not None and dropout_p > 0 else contextlib.nullcontext()
    with fork:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                             is_causal=mask_type == "causal", scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    return out if q_pad is None else out.masked_fill(q_pad, 0.0)


def _check_window(window_size, mask_type: str) -> None:
    """TE's ``window_size``: only "no window" is implemented, ``(-1, -1)`` or, with a causal mask, ``(-1, 0)``."""
    if window_size is None or tuple(window_size) == (-1, -1) or (
            tuple(window_size) == (-1, 0) and "causal" in mask_type):
        return
    raise ValueError(f"window_size={window_size}: sliding-window attention is not implemented; pass None")


class DotProductAttention(nn.Module):
    """TransformerEngine's ``DotProductAttention``: ``softmax(q k^T * softmax_scale + mask) v`` on per-head q, k, v
    (no projections), through :func:`attention`.

    Args:
        num_attention_heads: ``H`` (all ranks; ``H / tp`` per rank with ``tp_group`` / ``tp_size``).
        kv_channels: head dim ``d`` of q and k (and v), or a pair ``(d_qk, d_v)``.
        num_gqa_groups: ``G`` key/value heads (divides ``H``; default ``H``).
        attention_dropout: dropout on the attention probabilities, in training mode.
        qkv_format: ``"sbhd"`` (q ``[sq, b, H, d]``, output ``[sq, b, H * d_v]``) or ``"bshd"`` (q ``[b, sq, H, d]``,
            output ``[b, sq, H * d_v]``); forward may override it.
        attn_mask_type: the default mask type (module docstring); forward may override it.
        window_size: None, ``(-1, -1)`` or (causal) ``(-1, 0)``: no sliding window (others: ``ValueError``).
        sequence_parallel, tp_size, tp_group: tensor parallelism: each rank holds ``H / tp`` heads and ``G / tp``
            groups (the attention itself communicates nothing).
        get_rng_state_tracker: callable returning an object with ``fork()`` (e.g.
            ``lambda: tracker`` for a :class:`fp8engine.parallel.RNGStatesTracker`): dropout draws from its state
            (TE's semantics: not with ``sequence_parallel``). None: the default generator.
        layer_number: accepted for TE compatibility and stored; it changes nothing. (TE uses it only with
            ``NVTE_APPLY_QK_LAYER_SCALING=1`` in fp16, where it divides the scores by ``layer_number`` and multiplies
            them back inside the softmax -- the same result; SDPA's softmax accumulates in fp32.)
        attention_type: ``"self"`` or ``"cross"`` (informational: a padding mask pair works with either).
        softmax_scale: multiplies ``q k^T``; default ``1 / sqrt(d_qk)``.
    Raises:
        ValueError: unknown mask type or format, ``G`` not dividing ``H``, tp size not dividing ``H`` or ``G``,
            a sliding window.
    """

    def __init__(self, num_attention_heads: int, kv_channels: Union[int, tuple], num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size: Optional[tuple] = None, sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker=None, tp_group=None, layer_number: Optional[int] = None,
                 attention_type: str = "self", softmax_scale: Optional[float] = None):
        super().__init__()
        name = type(self).__name__
        self.attn_mask_type = attn_mask_type_of(attn_mask_type, name)
        _check_window(window_size, self.attn_mask_type)
        check_choice("qkv_format", qkv_format, QKV_FORMATS, name)
        check_choice("attention_type", attention_type, ("self", "cross"), name)
        d_qk, d_v = (kv_channels, kv_channels) if isinstance(kv_channels, int) else tuple(kv_channels)
        groups = num_gqa_groups or num_attention_heads
        if num_attention_heads <= 0 or groups <= 0 or num_attention_heads % groups:
            raise ValueError(f"{name}: num_gqa_groups={groups} must be positive and divide "
                             f"num_attention_heads={num_attention_heads}")
        if d_qk <= 0 or d_v <= 0:
            raise ValueError(f"{name}: kv_channels must be positive, got {kv_channels}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"{name}: attention_dropout must be in [0, 1), got {attention_dropout}")
        tp = tp_size_rank(tp_group)[0] if tp_group is not None else tp_size
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, groups
        self.heads_per_rank = check_divisible("num_attention_heads", num_attention_heads, tp, name)
        self.groups_per_rank = check_divisible("num_gqa_groups", groups, tp, name)
        self.kv_channels, self.qkv_format, self.attention_type = (d_qk, d_v), qkv_format, attention_type
        self.attention_dropout, self.layer_number = attention_dropout, layer_number
        self.softmax_scale = 1.0 / math.sqrt(d_qk) if softmax_scale is None else softmax_scale
        self.rng_tracker = (get_rng_state_tracker() if get_rng_state_tracker is not None and not sequence_parallel
                            else None)

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask: Optional[Union[torch.Tensor, tuple]] = None, qkv_format: Optional[str] = None, *,
                attn_mask_type: Optional[str] = None, window_size: Optional[tuple] = None,
                checkpoint_core_attention: bool = False) -> torch.Tensor:
        """Attention of ``query_layer`` over ``key_layer`` / ``value_layer``.

        Shapes (per rank; ``sbhd``; ``bshd`` swaps the first two dims of every tensor): q ``[sq, b, H, d_qk]``,
        k ``[skv, b, G, d_qk]``, v ``[skv, b, G, d_v]`` -> ``[sq, b, H * d_v]`` in q's dtype.
        ``attention_mask``: see the module docstring (bool, True = masked out). ``qkv_format``, ``attn_mask_type``,
        ``window_size``: override the constructor's for this call. ``checkpoint_core_attention``: recompute the
        attention in backward instead of keeping its activations (dropout masks repeat:
        :func:`fp8engine.parallel.random.checkpoint`).

        Raises:
            ValueError: tensors not 4-D, head counts or head dims other than the module's, mismatched batch or
                sequence dims, an unknown format or mask type, a mask that does not fit the mask type.
        """
        fmt = self.qkv_format if qkv_format is None else qkv_format
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type_of(attn_mask_type,
                                                                                          "DotProductAttention")
        if window_size is not None:
            _check_window(window_size, mask_type)
        if fmt == "sbhd":  # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in self._checked(query_layer, key_layer, value_layer, fmt))
        elif fmt == "bshd":  # [b, s, n, d] -> [b, n, s, d]
            q, k, v = (t.transpose(1, 2) for t in self._checked(query_layer, key_layer, value_layer, fmt))
        else:
            check_choice("qkv_format", fmt, QKV_FORMATS, "DotProductAttention")
        dropout_p = self.attention_dropout if self.training else 0.0
        args = (mask_type, attention_mask, dropout_p, self.softmax_scale, self.rng_tracker)
        if checkpoint_core_attention:
            from fp8engine.parallel.random import checkpoint

            out = checkpoint(lambda q_, k_, v_: attention(q_, k_, v_, *args), False, q, k, v,
                             rng_tracker=self.rng_tracker)
        else:
            out = attention(q, k, v, *args)
        b, n, sq, dv = out.shape
        if fmt == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(sq, b, n * dv)
        return out.transpose(1, 2).reshape(b, sq, n * dv)

    def _checked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str):
        """``(q, k, v)`` after checking their shapes against the module (``ValueError`` naming the layout)."""
        d_qk, d_v = self.kv_channels
        hq, hkv = self.heads_per_rank, self.groups_per_rank
        shapes = tuple(tuple(t.shape) for t in (q, k, v))
        if (any(len(s) != 4 for s in shapes) or shapes[0][2:] != (hq, d_qk) or shapes[1][2:] != (hkv, d_qk)
                or shapes[2][2:] != (hkv, d_v) or shapes[1][:2] != shapes[2][:2]
                or shapes[0][fmt.index("b")] != shapes[1][fmt.index("b")]):
            s, b = ("sq", "b") if fmt == "sbhd" else ("b", "sq")
            kv = ("skv", "b") if fmt == "sbhd" else ("b", "skv")
            raise ValueError(
                f"DotProductAttention ({fmt}): expected query [{s}, {b}, {hq}, {d_qk}], key [{kv[0]}, {kv[1]}, {hkv}, "
                f"{d_qk}], value [{kv[0]}, {kv[1]}, {hkv}, {d_v}] (heads and head dims per rank), got "
                f"{[list(t) for t in shapes]}")
        return q, k, v

    def extra_repr(self) -> str:
        return (f"heads={self.num_attention_heads}, gqa_groups={self.num_gqa_groups}, kv_channels={self.kv_channels}, "
                f"qkv_format={self.qkv_format}, mask={self.attn_mask_type}")
