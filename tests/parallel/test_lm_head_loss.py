"""The fused vocab-parallel LM head + cross-entropy (fp8engine.parallel.lm_head_loss) on 2 gloo ranks against the
unsharded loss built from the same seed: loss, input gradient (replicated and sequence-parallel) and the weight
shard's gradient, in float64 (only summation order differs) and in float32; and against the unfused
vocab_parallel_cross_entropy on the same shards. And a tensor-parallel GPT with the FP8 LM head vs the unsharded
one."""
import torch
import torch.nn.functional as F

import fp8engine
from _parallel_harness import run_ranks, shard, sqnr, tp_gpt_pair, world_group
from fp8engine.fp8.float8_tensor import kernels_forced
from fp8engine.kernels._common import interpreting
from fp8engine.models import GPTConfig
from fp8engine.parallel import (copy_to_tensor_model_parallel_region, vocab_parallel_cross_entropy,
                                vocab_parallel_linear_cross_entropy)

S, B, H, V = 38, 3, 24, 98  # 114 tokens, 49 vocabulary rows per rank; chunks of 16 rows do not divide 114


def _data(dtype):
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(S, B, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.4
    target = torch.randint(0, V, (S, B), generator=gen)
    target[::5, 1] = -100  # ignored tokens
    return hidden.to(dtype), weight.to(dtype), target


def _reference(hidden, weight, target):
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    loss = F.cross_entropy((h @ w.t()).reshape(-1, V), target.reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _check(rank, ws, dtype, sequence_parallel, chunk_size):
    g = world_group()
    hidden, weight, target = _data(dtype)
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, target)
    h = (shard(hidden, 0, rank, ws) if sequence_parallel else hidden).clone().requires_grad_()
    w = shard(weight, 0, rank, ws).clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(h, w, target, tp_group=g, sequence_parallel=sequence_parallel,
                                               chunk_size=chunk_size)
    loss.backward()
    want_dh = shard(ref_dh, 0, rank, ws) if sequence_parallel else ref_dh
    # float64: the sharded sums differ from the unsharded ones only in order. float32: ~1e-6 relative per element
    # (a few ulps of the 24-term GEMMs and the 98-term sum-exp), judged against each gradient's largest element
    # (elements are sums of terms of both signs).
    rel = 1e-12 if dtype == torch.float64 else 1e-5
    assert abs(loss.item() - ref_loss.item()) <= rel * abs(ref_loss.item())
    for got, want in ((h.grad, want_dh), (w.grad, shard(ref_dw, 0, rank, ws))):
        assert got.shape == want.shape and got.dtype == dtype
        assert (got.double() - want).abs().max() <= rel * want.abs().max()
    # The unfused vocab-parallel loss (Megatron semantics) over the same shards agrees (it has no ignore index:
    # compared on the non-ignored tokens; it computes in float32 whatever the logits' dtype).
    keep = target != -100
    logits = copy_to_tensor_model_parallel_region(hidden.clone(), g) @ w.detach().t()
    unfused = vocab_parallel_cross_entropy(logits, target.masked_fill(~keep, 0), tp_group=g)[keep].mean()
    assert abs(unfused.item() - loss.item()) <= 1e-5 * abs(ref_loss.item())


def _run_all(rank, ws):
    for dtype in (torch.float64, torch.float32):
        for sequence_parallel in (False, True):
            for chunk_size in (16, None):
                _check(rank, ws, dtype, sequence_parallel, chunk_size)
    # float32 through the Triton cross-entropy kernels (the CUDA path; interpreted on CPU): the shards' statistics
    # are combined by rescaling each shard's sum-exp to the global max, same bound as the plain path.
    if not interpreting():
        return  # a GPU machine: the kernels need CUDA tensors (tests/ops/test_lm_head.py runs them there)
    with kernels_forced():
        for sequence_parallel in (False, True):
            _check(rank, ws, torch.float32, sequence_parallel, 16)


def test_vocab_parallel_fused_loss_matches_unsharded():
    run_ranks(_run_all, 2)


def _check_tp_gpt_fp8_head(rank, ws, sequence_parallel):
    """A tensor-parallel GPT with the FP8 LM head (each rank's head GEMM over its vocabulary shard, the unfused
    vocab-parallel loss) against the unsharded one: logits shard >= 25 dB SQNR (per-shard amaxes of the row-parallel
    inputs, as tests/models/test_gpt_tp.py), loss within 2e-2 (that file's FP8 tolerance)."""
    config = GPTConfig(n_layer=1, n_head=4, hidden_size=64, ffn_hidden_size=128, max_seq_len=16, vocab_size=96,
                       fp8_lm_head=True)  # 48 vocabulary rows per rank: a multiple of 16
    ref, tp, x, y = tp_gpt_pair(config, sequence_parallel)
    assert tp.fp8_head.weight is tp.embedding.weight and tp.fp8_head.weight.shape == (48, 64)
    with fp8engine.autocast(recipe=fp8engine.CurrentScaling()):
        ref_loss, ref_logits = ref(x, y), ref(x)
        tp_loss, tp_logits = tp(x, y), tp(x)
    assert sqnr(shard(ref_logits, -1, rank, ws), tp_logits) >= 25
    assert abs(ref_loss.item() - tp_loss.item()) < 2e-2
    tp_loss.backward()
    assert tp.embedding.weight.grad is not None and torch.isfinite(tp.embedding.weight.grad).all()


def _run_gpt(rank, ws):
    for sequence_parallel in (False, True):
        _check_tp_gpt_fp8_head(rank, ws, sequence_parallel)


def test_tp_gpt_with_fp8_head_matches_unsharded():
    run_ranks(_run_gpt, 2)
