"""Tensor-parallel GPT on 2 real gloo ranks vs the unsharded GPT built from the same seed: loss, logits shards,
and gradients (vocab-sharded embedding, replicated norms)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_harness import run_ranks, shard, sqnr, tp_gpt_pair, world_group  # noqa: E402

import fp8engine  # noqa: E402
from fp8engine.models import GPTConfig  # noqa: E402
from fp8engine.parallel import all_reduce_sequence_parallel_grads  # noqa: E402

CONFIG = GPTConfig(n_layer=2, n_head=4, hidden_size=64, ffn_hidden_size=128, max_seq_len=16, vocab_size=96)


def _check_tp_gpt(rank, world_size, sequence_parallel, fp8):
    ref, tp, x, y = tp_gpt_pair(CONFIG, sequence_parallel)
    recipe = fp8engine.CurrentScaling()  # no warm-up needed: compares the same FP8 math sharded and not
    with fp8engine.autocast(enabled=fp8, recipe=recipe):
        ref_loss, ref_logits = ref(x, y), ref(x)
    ref_loss.backward()
    with fp8engine.autocast(enabled=fp8, recipe=recipe):
        tp_loss, tp_logits = tp(x, y), tp(x)
    tp_loss.backward()
    all_reduce_sequence_parallel_grads(tp, world_group())
    # fp32 sharded math differs from unsharded only by summation order; FP8 also by per-shard amaxes of the
    # row-parallel inputs (>= 25 dB, the cast/GEMM bar).
    if fp8:
        assert sqnr(shard(ref_logits, -1, rank, world_size), tp_logits) >= 25
        assert abs(ref_loss.item() - tp_loss.item()) < 2e-2
    else:
        torch.testing.assert_close(tp_logits, shard(ref_logits, -1, rank, world_size), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tp_loss, ref_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(tp.embedding.weight.grad, shard(ref.embedding.weight.grad, 0, rank, world_size),
                                   rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(tp.final_norm.weight.grad, ref.final_norm.weight.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_tp_gpt_matches_unsharded(sequence_parallel, fp8):
    run_ranks(_check_tp_gpt, 2, sequence_parallel, fp8)
