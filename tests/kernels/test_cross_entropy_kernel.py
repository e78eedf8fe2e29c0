"""The cross-entropy kernels of the fused LM-head loss (fp8engine.kernels.cross_entropy) against their plain-PyTorch
references: row statistics (max, sum-exp, target logit) and the in-place logits gradient, for 16-bit and fp32
logits, rows longer than one block, vocabulary shards (targets outside the shard) and ignored targets."""
import pytest
import torch

from fp8engine.kernels.cross_entropy import ce_grad_, ce_grad_reference, ce_row_stats, ce_row_stats_reference

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # cpu: TRITON_INTERPRET=1 (tests/conftest.py)


def _logits(rows, vocab, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype).to(device)  # logits of std 4: a peaked softmax
    t = torch.randint(-3, vocab + 50, (rows,), generator=gen).to(device)   # some outside this shard
    t[0] = -100                                                             # an ignored target
    return z, t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab,vocab_start", [(97, 0), (5003, 40)])  # one block; two blocks, a shard at 40
def test_stats_and_grad_match_reference(device, dtype, vocab, vocab_start):
    z, t = _logits(6, vocab, dtype, device)
    got, want = ce_row_stats(z, t, vocab_start), ce_row_stats_reference(z, t, vocab_start)
    # max and target logit are exact (values of z); the sum-exp differs by fp32 summation order (online, per lane)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0)
    scale = torch.rand(6, device=device)
    scale[0] = 0.0  # the ignored row's gradient is zero
    ref = ce_grad_reference(z, t, got[0], got[1], scale, vocab_start)
    out = ce_grad_(z, t, got[0], got[1], scale, vocab_start)
    assert out is z and out.dtype == dtype
    # both compute in fp32 and round once to dtype: at most one ulp apart (|dz| <= 1: 2**-8 for bf16)
    ulp = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-6}[dtype]
    assert (out.float() - ref.float()).abs().max().item() <= ulp
    assert (out[0] == 0).all()
    # a row's gradient sums to scale * (1 - [target in shard]) up to rounding: softmax sums to 1
    inside = ((t - vocab_start >= 0) & (t - vocab_start < vocab)).float()
    torch.testing.assert_close(out.double().sum(-1), (scale * (1 - inside)).double(), rtol=0, atol=vocab * ulp)


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    z, t = _logits(4, 33, torch.bfloat16, device)
    with pytest.raises(ValueError, match="int64 target"):
        ce_row_stats(z, t.int())
    with pytest.raises(ValueError, match=r"z \[R, V\]"):
        ce_row_stats(z[None], t)
    with pytest.raises(TypeError, match="dtype"):
        ce_row_stats(z.double(), t)
    m, s, _ = ce_row_stats(z, t)
    with pytest.raises(ValueError, match="row_scale must be contiguous"):
        ce_grad_(z, t, m, s, torch.ones(4, device=device, dtype=torch.float64))
