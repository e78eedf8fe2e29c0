"""DotProductAttention (TransformerEngine's core attention) against an explicit float64 softmax(q k^T * scale + mask) v,
for every mask type, both formats, GQA, cross-attention and the TE conventions (True = masked out, zero output at
padded queries); its errors; and the mask types it gives MultiheadAttention."""
import math

import pytest
import torch

from fp8engine.modules import DotProductAttention, MultiheadAttention
from fp8engine.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker
from tests.conftest import sqnr

HEADS, GROUPS, D = 4, 2, 16


def reference_core(q, k, v, mask_type, mask=None, scale=None):
    """Explicit attention in q's dtype (float64 in the tests): q ``[sq, b, H, d]``, k ``[skv, b, G, d]``,
    v ``[skv, b, G, dv]`` -> ``[sq, b, H * dv]``. Padding masks (True = masked out) mask the keys; the output at padded
    queries is zero (TransformerEngine's convention: its backends return zeros there)."""
    sq, b, n, d = q.shape
    skv, g = k.shape[0], k.shape[2]
    k, v = k.repeat_interleave(n // g, dim=2), v.repeat_interleave(n // g, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * (1 / math.sqrt(d) if scale is None else scale)
    q_pad = None
    if "causal" in mask_type:
        scores = scores.masked_fill(torch.ones(sq, skv, dtype=torch.bool).triu(1), float("-inf"))
    if "padding" in mask_type:
        q_mask, kv_mask = mask if isinstance(mask, tuple) else (mask, mask)
        scores = scores.masked_fill(kv_mask, float("-inf"))
        q_pad = q_mask.view(b, 1, sq, 1)
    if mask_type == "arbitrary":
        scores = scores.masked_fill(mask, float("-inf"))
    probs = scores.softmax(-1)
    if q_pad is not None:  # (also replaces the NaN rows of queries with no key left)
        probs = probs.masked_fill(q_pad, 0.0)
    return torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(sq, b, n * v.shape[-1])


def right_padding(lengths, s):
    """bool ``[b, 1, 1, s]``, True at the padded positions after each sequence's length."""
    return (torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]).view(len(lengths), 1, 1, s)


def left_padding(lengths, s):
    """bool ``[b, 1, 1, s]``, True at the padded positions before each sequence (under a causal mask the padded
    queries then have no key left: the case SDPA turns into NaN)."""
    return (torch.arange(s)[None, :] < s - torch.tensor(lengths)[:, None]).view(len(lengths), 1, 1, s)


def _qkv(sq, skv, b, dtype, fmt="sbhd", dv=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(sq, b, HEADS, D), (skv, b, GROUPS, D), (skv, b, GROUPS, dv)]
    ts = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]  # sbhd, float64 master copies
    ins = [(t.transpose(0, 1) if fmt == "bshd" else t).to(dtype).requires_grad_() for t in ts]
    refs = [t.to(dtype).double().requires_grad_() for t in ts]  # the same values the module sees
    return ins, refs


def _mask_for(mask_type, b, s):
    if mask_type in ("padding", "padding_causal"):
        return right_padding([s, s - 3, 5][:b], s) if mask_type == "padding" else left_padding([s, s - 3, 5][:b], s)
    if mask_type == "arbitrary":
        gen = torch.Generator().manual_seed(3)
        mask = torch.rand(b, 1, s, s, generator=gen) < 0.3
        mask[..., 0] = False  # every query keeps a key (a fully masked row is NaN for "arbitrary", as SDPA)
        return mask
    return None


@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding", "padding_causal", "arbitrary"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_float64_reference(mask_type, fmt, dtype):
    s, b = 13, 3
    (q, k, v), (qr, kr, vr) = _qkv(s, s, b, dtype, fmt)
    mask = _mask_for(mask_type, b, s)
    dpa = DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, qkv_format=fmt, attn_mask_type=mask_type)
    y = dpa(q, k, v, mask)
    assert y.dtype == dtype and y.shape == ((s, b, HEADS * D) if fmt == "sbhd" else (b, s, HEADS * D))
    y_ref = reference_core(qr, kr, vr, mask_type, mask)
    if fmt == "bshd":
        y_ref = y_ref.transpose(0, 1)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y.backward(g.to(dtype))
    y_ref.backward(g.to(dtype).double())
    grads = [(t.grad.transpose(0, 1) if fmt == "bshd" else t.grad) for t in (q, k, v)]
    assert all(torch.isfinite(t).all() for t in [y, *grads])
    if dtype == torch.float32:  # fp32 vs float64: fp32 rounding only
        torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
            torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)
    else:  # bf16 inputs exactly represented in the reference; bf16 roundings inside (2^-9 relative): measured
        # 54-56 dB for the output, 49-53 dB for the gradients (the backward's extra roundings of dP, dS)
        assert sqnr(y_ref, y) >= 45
        for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
            assert sqnr(want, got) >= 40


def test_padding_convention_and_zero_rows():
    """True = masked out: a padded key changes nothing; padded queries give zero output and pass no gradient."""
    s, b = 9, 2
    (q, k, v), _ = _qkv(s, s, b, torch.float32)
    mask = right_padding([9, 6], s)
    dpa = DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, attn_mask_type="padding")
    y = dpa(q, k, v, mask)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[6:, 1] += 3.0
    v2[6:, 1] -= 2.0
    torch.testing.assert_close(dpa(q, k2, v2, mask), y, rtol=0, atol=0)
    assert torch.equal(y[6:, 1], torch.zeros_like(y[6:, 1]))
    y.sum().backward()
    assert torch.equal(q.grad[6:, 1], torch.zeros_like(q.grad[6:, 1]))


@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding"])
def test_cross_attention_other_lengths(mask_type):
    sq, skv, b = 7, 11, 2
    (q, k, v), (qr, kr, vr) = _qkv(sq, skv, b, torch.float32)
    mask = (right_padding([7, 4], sq), right_padding([11, 8], skv)) if mask_type == "padding" else None
    dpa = DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, attn_mask_type=mask_type, attention_type="cross")
    torch.testing.assert_close(dpa(q, k, v, mask), reference_core(qr, kr, vr, mask_type, mask).float(), rtol=1e-5,
                               atol=1e-5)  # fp32 rounding; "causal" is aligned top-left, as TE's


def test_kv_channels_pair_softmax_scale_and_overrides():
    s, b = 10, 2
    (q, k, v), (qr, kr, vr) = _qkv(s, s, b, torch.float32, dv=32)
    dpa = DotProductAttention(HEADS, (D, 32), num_gqa_groups=GROUPS, softmax_scale=0.3, attn_mask_type="causal")
    y = dpa(q, k, v)
    assert y.shape == (s, b, HEADS * 32)
    torch.testing.assert_close(y, reference_core(qr, kr, vr, "causal", scale=0.3).float(), rtol=1e-5, atol=1e-5)
    # forward overrides: the mask type (TE's alias spelling) and the format
    mask = left_padding([10, 4], s)
    want = reference_core(qr, kr, vr, "padding_causal", mask, scale=0.3).float()
    torch.testing.assert_close(dpa(q, k, v, mask, attn_mask_type="causal,padding"), want, rtol=1e-5, atol=1e-5)
    yb = dpa(*(t.transpose(0, 1) for t in (q, k, v)), qkv_format="bshd")
    torch.testing.assert_close(yb, y.transpose(0, 1), rtol=0, atol=0)


def test_dropout_rng_and_checkpoint():
    s, b = 8, 2
    (q, k, v), _ = _qkv(s, s, b, torch.float32)
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 1234)
    dpa = DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, attention_dropout=0.5,
                              get_rng_state_tracker=lambda: tracker)
    states = tracker.get_states()
    a = dpa(q, k, v)
    tracker.set_states(states)
    torch.testing.assert_close(dpa(q, k, v), a, rtol=0, atol=0)  # the tracker's state, not the default generator
    assert not torch.allclose(dpa(q, k, v), a)  # the tracker advanced: a new mask
    dpa.eval()
    want = DotProductAttention(HEADS, D, num_gqa_groups=GROUPS)(q, k, v)
    torch.testing.assert_close(dpa(q, k, v), want, rtol=0, atol=0)  # no dropout in eval
    # checkpoint_core_attention recomputes with the forward's dropout mask: the same output and gradients
    dpa.train()
    g = torch.randn(s, b, HEADS * D)
    runs = []
    for ckpt in (False, True):
        tracker.set_states(states)
        for t in (q, k, v):
            t.grad = None
        y = dpa(q, k, v, checkpoint_core_attention=ckpt)
        y.backward(g)
        runs.append((y.detach(), *(t.grad.clone() for t in (q, k, v))))
    for plain, ckpt in zip(*runs):
        torch.testing.assert_close(ckpt, plain, rtol=0, atol=0)


def test_errors():
    dpa = DotProductAttention(HEADS, D, num_gqa_groups=GROUPS, attn_mask_type="padding")
    (q, k, v), _ = _qkv(6, 6, 2, torch.float32)
    with pytest.raises(ValueError, match=r"expected query \[sq, b, 4, 16\]"):
        dpa(q[..., :8], k, v, right_padding([6, 3], 6))
    with pytest.raises(ValueError, match="needs attention_mask"):
        dpa(q, k, v)
    with pytest.raises(TypeError, match="bool"):
        dpa(q, k, v, right_padding([6, 3], 6).float())
    with pytest.raises(ValueError, match=r"\[b, 1, 1, s\]"):
        dpa(q, k, v, right_padding([6, 3], 6).view(2, 1, 6, 1))
    with pytest.raises(ValueError, match="only used with"):
        dpa(q, k, v, right_padding([6, 3], 6), attn_mask_type="causal")
    with pytest.raises(ValueError, match="attn_mask_type"):
        DotProductAttention(HEADS, D, attn_mask_type="causal_bottom_right")
    with pytest.raises(ValueError, match="qkv_format"):
        DotProductAttention(HEADS, D, qkv_format="thd")
    with pytest.raises(ValueError, match="sliding-window"):
        DotProductAttention(HEADS, D, window_size=(128, 0))
    with pytest.raises(ValueError, match="num_gqa_groups"):
        DotProductAttention(HEADS, D, num_gqa_groups=3)
    with pytest.raises(ValueError, match="tensor-parallel size 3"):
        DotProductAttention(HEADS, D, tp_size=3)


def test_multihead_attention_mask_override_matches_constructor():
    """MultiheadAttention's forward ``attn_mask_type`` equals building it with that mask type (same seed)."""
    torch.manual_seed(0)
    causal = MultiheadAttention(64, HEADS, GROUPS, attention_dropout=0.0)
    torch.manual_seed(0)
    padded = MultiheadAttention(64, HEADS, GROUPS, attention_dropout=0.0, attn_mask_type="padding_causal")
    x = torch.randn(9, 2, 64)
    mask = left_padding([9, 5], 9)
    torch.testing.assert_close(causal(x, mask, attn_mask_type="padding_causal"), padded(x, mask), rtol=0, atol=0)
    torch.testing.assert_close(padded(x, attn_mask_type="causal"), causal(x), rtol=0, atol=0)
