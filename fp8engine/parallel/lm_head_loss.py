"""The vocabulary-parallel LM head fused with the cross-entropy: each rank holds the vocabulary shard
``W [V/tp, h]`` and computes, chunk by chunk, only its ``[c, V/tp]`` logits; the per-row max and the
(target logit, sum-exp) pair are all-reduced over the tensor-parallel group (Megatron-core's
``vocab_parallel_cross_entropy`` semantics, :mod:`fp8engine.parallel.cross_entropy`, which stays the unfused
reference). The chunk math is :func:`fp8engine.ops.lm_head.fused_linear_cross_entropy`; this file adds the
communication: the region mapping in front of ``hidden`` and the all-reduce callback.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8engine.ops.lm_head import IGNORE_INDEX, fused_linear_cross_entropy
from fp8engine.parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region
from fp8engine.parallel.utils import all_reduce, get_group_rank, get_group_size

__all__ = ["vocab_parallel_linear_cross_entropy"]


class _GroupReduce:
    """``reduce(t, op)`` for the chunk math: ``t`` all-reduced over ``group``. The chunk math passes fresh contiguous
    temporaries (a row max, a stacked pair), which eager mode reduces in place."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def __call__(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return all_reduce(t, self.group, op)[0]


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                                        tp_group, sequence_parallel: bool = False,
                                        ignore_index: int = IGNORE_INDEX,
                                        chunk_size: Optional[int] = None) -> torch.Tensor:
    """Mean cross-entropy of the vocabulary-parallel logits ``hidden @ W.T``, fused and chunked.

    Args:
        hidden: ``[s, b, h]`` replicated on the tp ranks, or with ``sequence_parallel`` this rank's sequence shard
            ``[s/tp, b, h]`` (all-gathered here). It enters through
            :func:`~fp8engine.parallel.copy_to_tensor_model_parallel_region` (resp.
            :func:`~fp8engine.parallel.gather_from_sequence_parallel_region`), whose backward all-reduces (resp.
            reduce-scatters) this rank's partial input gradient ``dz_local @ W_local``.
        weight: ``[V/tp, h]``, rows ``rank*V/tp : (rank+1)*V/tp`` of the vocabulary (the
            :class:`~fp8engine.parallel.VocabParallelEmbedding` shard when tied). Any dtype; under
            ``torch.autocast`` the GEMMs run in its dtype, the softmax statistics in float32.
        target: ``[s, b]`` int64 full-vocabulary ids in ``[0, V)`` or ``ignore_index``, the same on every tp rank.
        tp_group: the tensor-parallel group (None: one rank, the whole vocabulary).
        sequence_parallel: ``hidden`` is a sequence shard (above).
        ignore_index, chunk_size: as :func:`~fp8engine.ops.lm_head.fused_linear_cross_entropy`
            (``chunk_size`` counts rows of the gathered ``[s*b, h]``).
    Returns:
        0-d float32 mean over the non-ignored tokens, identical on every tp rank.
    Raises:
        ValueError: shapes that do not match (after the gather), ``chunk_size < 1``.
    """
    reduce = None
    if get_group_size(tp_group) > 1:
        enter = gather_from_sequence_parallel_region if sequence_parallel else copy_to_tensor_model_parallel_region
        hidden, reduce = enter(hidden, tp_group), _GroupReduce(tp_group)
    vocab_start = get_group_rank(tp_group) * weight.shape[0]
    return fused_linear_cross_entropy(hidden, weight, target, ignore_index=ignore_index, chunk_size=chunk_size,
                                      vocab_start=vocab_start, reduce=reduce)
