"""VocabParallelEmbedding, vocab_parallel_cross_entropy, broadcast_data, the 1-D split helpers, the RNG tracker
and the inference layers on 2 gloo ranks (8 ranks in test_world_size_8.py), each against its unsharded single-process
reference."""
import pytest
import torch
import torch.nn.functional as F

from _parallel_harness import run_ranks, shard, world_group
from fp8engine.parallel import (InferenceLayerNormColumnParallelLinear, InferenceRowParallelLinear,
                                VocabParallelEmbedding, broadcast_data, gather_split_1d_tensor,
                                model_parallel_manual_seed, split_tensor_along_last_dim,
                                split_tensor_into_1d_equal_chunks, vocab_parallel_cross_entropy, RNGStatesTracker)

V, D, S, B = 64, 16, 8, 3


def _embedding_and_loss(rank, ws, g):
    tol = dict(rtol=1e-12, atol=1e-12)  # float64: only summation order differs
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))
    for rs in (False, True):
        torch.manual_seed(11)
        emb = VocabParallelEmbedding(V, D, tp_group=g, reduce_scatter_embeddings=rs, params_dtype=torch.float64)
        torch.manual_seed(11)
        ref = torch.nn.Embedding(V, D, dtype=torch.float64)  # same N(0, 1) draws
        torch.testing.assert_close(emb.weight, shard(ref.weight, 0, rank, ws), rtol=0, atol=0)
        out = emb(tokens)
        want = ref(tokens).transpose(0, 1) if rs else ref(tokens)  # [S, B, D] when reduce-scattering
        want = shard(want, 0, rank, ws) if rs else want
        torch.testing.assert_close(out, want, **tol)
        grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(4 + rank), dtype=torch.float64)
        out.backward(grad)
        # Reference output gradient. Reduce-scattered output: the backward all-gathers every rank's shard
        # gradient. All-reduced output: the backward is the identity, so this rank's own gradient.
        grads = [torch.randn(want.shape, generator=torch.Generator().manual_seed(4 + r), dtype=torch.float64)
                 for r in range(ws)]
        full_grad = torch.cat(grads).transpose(0, 1) if rs else grads[rank]
        ref(tokens).backward(full_grad)
        torch.testing.assert_close(emb.weight.grad, shard(ref.weight.grad, 0, rank, ws), **tol)

    logits = torch.randn(S, B, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(6))
    for smoothing in (0.0, 0.1):
        local = shard(logits, -1, rank, ws).clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, smoothing, tp_group=g)
        full = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(full.reshape(-1, V), target.reshape(-1), label_smoothing=smoothing,
                              reduction="none").reshape(S, B)
        # the loss is computed in float32 internally: compare at float32 precision
        torch.testing.assert_close(loss, ref.float(), rtol=1e-5, atol=1e-5)
        w = torch.rand(S, B, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        (loss.double() * w).sum().backward()
        (ref * w).sum().backward()
        torch.testing.assert_close(local.grad, shard(full.grad, -1, rank, ws), rtol=1e-5, atol=1e-6)


def _data_and_utils(rank, ws, g):
    data = {"tokens": torch.randint(0, 100, (2, 5)), "labels": torch.arange(7)} if rank == 0 else None
    got = broadcast_data(["tokens", "labels"], data, torch.int64, tp_group=g)
    if rank == 0:
        torch.testing.assert_close(got["tokens"], data["tokens"], rtol=0, atol=0)
    gathered = [torch.empty_like(got["tokens"]) for _ in range(ws)]
    torch.distributed.all_gather(gathered, got["tokens"], group=g)  # every rank received rank 0's tensor
    for t in gathered:
        torch.testing.assert_close(t, gathered[0], rtol=0, atol=0)
    torch.testing.assert_close(got["labels"], torch.arange(7), rtol=0, atol=0)
    assert got["tokens"].shape == (2, 5)

    x = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    chunk = split_tensor_into_1d_equal_chunks(x, g)
    torch.testing.assert_close(chunk, x.reshape(-1).chunk(ws)[rank], rtol=0, atol=0)
    torch.testing.assert_close(gather_split_1d_tensor(chunk, g), x.reshape(-1), rtol=0, atol=0)
    parts = split_tensor_along_last_dim(x, 4, contiguous_split_chunks=True)
    assert all(p.is_contiguous() and p.shape == (6, 2) for p in parts)
    torch.testing.assert_close(torch.cat(parts, -1), x, rtol=0, atol=0)

    # RNG: the tensor-parallel stream differs across tp ranks, the data-parallel (default) stream does not.
    tracker = model_parallel_manual_seed(1234, rank, RNGStatesTracker("cpu"))
    with tracker.fork():
        tp_draw = torch.rand(4)
    dp_draw = torch.rand(4)
    torch.manual_seed(1234 + 2718 + rank)
    torch.testing.assert_close(tp_draw, torch.rand(4), rtol=0, atol=0)
    torch.manual_seed(1234)
    torch.testing.assert_close(dp_draw, torch.rand(4), rtol=0, atol=0)
    draws = [torch.empty(4) for _ in range(ws)]
    torch.distributed.all_gather(draws, tp_draw, group=g)
    assert not torch.equal(draws[0], draws[1])


def _inference(rank, ws, g):
    """Two layers LN-column -> row with the fused reduce-scatter+residual+RMSNorm+all-gather, vs unsharded."""
    t, h, f, eps = 8, 32, 64, 1e-5
    dt = torch.float64
    torch.manual_seed(21)
    col = InferenceLayerNormColumnParallelLinear(h, f, tp_group=g, bias=True, params_dtype=dt)
    row = InferenceRowParallelLinear(f, h, tp_group=g, bias=True, params_dtype=dt)
    torch.manual_seed(21)
    rc, rr = torch.nn.Linear(h, f, dtype=dt), torch.nn.Linear(f, h, dtype=dt)  # same draws as the layers
    with torch.no_grad():
        col.layer_norm_weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    next_norm = torch.rand(h, generator=torch.Generator().manual_seed(3), dtype=dt) + 0.5
    resid = torch.randn(t, h, generator=torch.Generator().manual_seed(1), dtype=dt)
    with torch.no_grad():
        a, _ = col(shard(resid, 0, rank, ws))
        normed, resid_out = row(a, shard(resid, 0, rank, ws), next_norm, eps)
        want_resid = rr(rc(F.rms_norm(resid, (h,), col.layer_norm_weight, eps))) + resid
    torch.testing.assert_close(resid_out, shard(want_resid, 0, rank, ws), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(normed, F.rms_norm(want_resid, (h,), next_norm, eps), rtol=1e-12, atol=1e-12)
    out, _ = row(a)
    torch.testing.assert_close(out, shard(want_resid - resid, 0, rank, ws), rtol=1e-12, atol=1e-12)


def _misc_check(rank, ws, g):
    """All of the above on group ``g``, of which this process is rank ``rank`` of ``ws``."""
    _embedding_and_loss(rank, ws, g)
    _data_and_utils(rank, ws, g)
    _inference(rank, ws, g)


def _misc_worker(rank, ws):
    _misc_check(rank, ws, world_group())


def test_embedding_loss_data_rng_inference_2_ranks():
    run_ranks(_misc_worker, 2)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_single_rank_matches_torch(smoothing):
    logits = torch.randn(37, 48, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 48, (37,))
    loss = vocab_parallel_cross_entropy(logits, target, smoothing, tp_group=None)
    ref = F.cross_entropy(logits, target, label_smoothing=smoothing, reduction="none")
    torch.testing.assert_close(loss, ref.float(), rtol=1e-5, atol=1e-5)
    g1, = torch.autograd.grad(loss.sum(), logits)
    g2, = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)
