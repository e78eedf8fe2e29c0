"""``VocabParallelEmbedding`` (Megatron-core ``tensor_parallel/layers.py``): the table split along the vocabulary."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fp8engine.parallel.mappings import (reduce_from_tensor_model_parallel_region,
                                         reduce_scatter_to_sequence_parallel_region)
from fp8engine.parallel.utils import VocabUtility, ensure_divisibility, get_group_rank, get_group_size

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """Embedding table ``[V, D]`` split by rows: rank ``r`` holds ``weight [V/tp, D]``, rows
    ``vocab_start_index = r*V/tp`` to ``vocab_end_index``. Tokens outside this range look up zeros; the partial
    embeddings are summed over the tp group.

    Args:
        num_embeddings, embedding_dim: ``V`` (divisible by the tp size) and ``D``.
        tp_group: the tensor-parallel group (None: one rank).
        reduce_scatter_embeddings: input ``[b, s]`` -> output ``[s/tp, b, D]`` (transposed to sequence-first,
            then reduce-scattered along the sequence, for sequence parallelism); otherwise output ``[*, D]``
            all-reduced.
        init_method: ``fn(weight)`` applied to the unsharded ``[V, D]`` table (default ``torch.nn.Embedding``'s
            N(0, 1)), so the shards equal the slices of the same table built unsharded from the same seed.
        params_dtype, device: of the weight.
    Raises:
        ValueError: ``V`` not divisible by the tp size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group, reduce_scatter_embeddings: bool = False,
                 init_method: Optional[Callable] = None, params_dtype=None, device=None):
        super().__init__()
        size, rank = get_group_size(tp_group), get_group_rank(tp_group)
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        ensure_divisibility(num_embeddings, size, "VocabParallelEmbedding num_embeddings")
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, rank, size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        full = torch.empty(num_embeddings, embedding_dim, dtype=params_dtype or torch.get_default_dtype(),
                           device=device)
        with torch.no_grad():
            (init_method or nn.init.normal_)(full)
        self.weight = nn.Parameter(full[self.vocab_start_index:self.vocab_end_index].clone())
        self.weight.tensor_model_parallel, self.weight.partition_dim, self.weight.partition_stride = True, 0, 1

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """``input_``: int64 token ids ``[b, s]`` (any shape without ``reduce_scatter_embeddings``)."""
        if get_group_size(self.tp_group) == 1:
            out = F.embedding(input_, self.weight)
        else:  # tokens of other ranks' rows look up row 0, then zeros
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local = (input_ - self.vocab_start_index).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            out = out.transpose(0, 1).contiguous()  # [b, s, D] -> [s, b, D]
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings} (per rank {self.num_embeddings_per_partition}), "
                f"embedding_dim={self.embedding_dim}, reduce_scatter_embeddings={self.reduce_scatter_embeddings}")
