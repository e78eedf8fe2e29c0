"""Cross entropy over vocabulary-parallel logits (Megatron-core ``tensor_parallel/cross_entropy.py``), with
``torch.nn.functional.cross_entropy``'s label smoothing.

Loss per token, ``K`` = full vocabulary, ``p = softmax(logits)``, smoothing ``e``:
``loss = (1 - e) * (-log p[target]) + e * mean_i(-log p[i])`` (torch's definition: the uniform part covers all K
classes, target included). Gradient w.r.t. the logits: ``p - (1 - e) * onehot(target) - e / K``.
"""
from __future__ import annotations

import torch

from fp8engine.parallel.utils import VocabUtility, all_reduce, get_group_rank, get_group_size

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        size, rank = get_group_size(group), get_group_rank(group)
        part = logits.shape[-1]
        vocab = part * size
        x = logits.float()
        logits_max = x.amax(dim=-1)
        if size > 1:
            logits_max = all_reduce(logits_max, group, "max")[0]
        x = x - logits_max.unsqueeze(-1)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(part, rank, size)
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = torch.gather(x, -1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = x.exp()
        # One SUM all-reduce for the target logit, the softmax denominator and (for smoothing) the logit sum.
        stats = torch.stack([predicted, exp.sum(dim=-1), x.sum(dim=-1)])
        if size > 1:
            stats = all_reduce(stats, group)[0]
        predicted, sum_exp, sum_logits = stats
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - predicted
        if label_smoothing > 0:
            mean_log_probs = sum_logits / vocab - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_probs
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab, ctx.in_dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        e = ctx.label_smoothing
        grad = softmax  # reused in place: backward runs once
        hit = (~outside).to(grad.dtype) * (1.0 - e)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if e > 0:
            grad.sub_(e / ctx.vocab)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, tp_group) -> torch.Tensor:
    """Per-token cross entropy of logits split over the vocabulary.

    Args:
        vocab_parallel_logits: ``[*, V/tp]``, this rank's vocabulary slice ``rank*V/tp : (rank+1)*V/tp`` (any float
            dtype; computed in float32).
        target: ``[*]`` int64 class indices in ``[0, V)`` (no ignore index).
        label_smoothing: ``e`` in ``[0, 1)``, as in ``torch.nn.functional.cross_entropy``.
        tp_group: the tensor-parallel group (None: the logits are the full vocabulary).
    Returns:
        ``[*]`` float32 losses (unreduced), identical on every tp rank.
    Raises:
        ValueError: ``label_smoothing`` outside ``[0, 1)``.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing), tp_group)
