"""MultiheadAttention against an explicit float64 softmax-attention reference; GQA, masks, rotary, fused QKV."""
import math

import pytest
import torch
import torch.nn.functional as F

import fp8engine
from tests.conftest import sqnr
from fp8engine.modules import MultiheadAttention, RotaryEmbedding
from fp8engine.modules.attention import apply_rotary_pos_emb

H, HEADS = 64, 4


def _mha(**kw):
    torch.manual_seed(0)
    kw.setdefault("attention_dropout", 0.0)
    mha = MultiheadAttention(H, HEADS, **kw)
    qkv = mha.layernorm_qkv
    with torch.no_grad():
        qkv.layer_norm_weight.uniform_(0.5, 1.5)
        qkv.layer_norm_bias.normal_(0, 0.2)
        for name, p in mha.named_parameters():
            if name.endswith("bias") and "layer_norm" not in name:
                p.normal_(0, 0.1)
    return mha


def qkv_params(mha, p):
    """(q_w, k_w, v_w, q_b, k_b, v_b) in [heads * d, h] layout from either parameterisation."""
    pre = "layernorm_qkv."
    if mha.fuse_qkv_params:
        c = mha.config
        q_per, d = c.num_attention_heads // c.num_gqa_groups, c.head_dim
        w = p[pre + "weight"].view(c.num_gqa_groups, q_per + 2, d, -1)
        b = p[pre + "bias"].view(c.num_gqa_groups, q_per + 2, d)
        return (w[:, :q_per].reshape(-1, H), w[:, q_per].reshape(-1, H), w[:, q_per + 1].reshape(-1, H),
                b[:, :q_per].reshape(-1), b[:, q_per].reshape(-1), b[:, q_per + 1].reshape(-1))
    return tuple(p[pre + n] for n in ("query_weight", "key_weight", "value_weight", "query_bias", "key_bias",
                                      "value_bias"))


def reference_attention(mha, x, p, mask_type, mask=None, rope=None):
    """Explicit attention in x's dtype: norm, q/k/v projections, rotary, softmax(q k^T / sqrt(d) + mask) v, proj."""
    c = mha.config
    s, b, _ = x.shape
    d, n, g = c.head_dim, c.num_attention_heads, c.num_gqa_groups
    ln = F.layer_norm(x, (H,), p["layernorm_qkv.layer_norm_weight"], p["layernorm_qkv.layer_norm_bias"], 1e-5)
    qw, kw, vw, qb, kb, vb = qkv_params(mha, p)
    q = F.linear(ln, qw, qb).view(s, b, n, d)
    k = F.linear(ln, kw, kb).view(s, b, g, d)
    v = F.linear(ln, vw, vb).view(s, b, g, d)
    if rope is not None:
        q, k = apply_rotary_pos_emb(q, rope.to(x.dtype)), apply_rotary_pos_emb(k, rope.to(x.dtype))
    k, v = k.repeat_interleave(n // g, dim=2), v.repeat_interleave(n // g, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    if mask_type in ("causal", "padding_causal"):
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    if mask_type in ("padding", "padding_causal"):
        scores = scores.masked_fill(mask, float("-inf"))  # [b, 1, 1, s], True = masked out
    probs = scores.softmax(-1)
    if mask_type in ("padding", "padding_causal"):  # padded queries: zero output, as TransformerEngine returns
        probs = probs.masked_fill(mask.view(b, 1, s, 1), 0.0)
    ctx = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, n * d)
    return F.linear(ctx, p["proj.weight"], p["proj.bias"])


def _padding_mask(b, s):
    lengths = torch.tensor([s, s - 2, 3])[:b]
    return (torch.arange(s)[None, :] >= lengths[:, None]).view(b, 1, 1, s)


@pytest.mark.parametrize("mask_type", ["causal", "padding", "no_mask", "padding_causal"])
@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("rotary", [False, True])
def test_matches_reference_outside_autocast(mask_type, groups, rotary):
    mha = _mha(num_gqa_groups=groups, attn_mask_type=mask_type)
    s, b = 7, 3
    x = torch.randn(s, b, H, requires_grad=True)
    mask = _padding_mask(b, s) if "padding" in mask_type else None
    rope = RotaryEmbedding(mha.config.head_dim)(s) if rotary else None
    y = mha(x, mask, rotary_pos_emb=rope)
    p = {n: t.detach().double().requires_grad_() for n, t in mha.named_parameters()}
    x_ref = x.detach().double().requires_grad_()
    y_ref = reference_attention(mha, x_ref, p, mask_type, mask, rope)
    # fp32 layer vs float64 reference: fp32 rounding only
    torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g.double())
    torch.testing.assert_close(x.grad, x_ref.grad.float(), rtol=1e-4, atol=1e-5)
    for name, param in mha.named_parameters():
        torch.testing.assert_close(param.grad, p[name].grad.float(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_sqnr(recipe):
    mha = _mha(num_gqa_groups=2)
    x = torch.randn(9, 3, H, requires_grad=True)
    for _ in range(2):
        x.grad = None
        mha.zero_grad()
        with fp8engine.autocast(recipe=recipe):
            y = mha(x)
        g = torch.randn_like(y)
        y.backward(g)
    p = {n: t.detach().double().requires_grad_() for n, t in mha.named_parameters()}
    x_ref = x.detach().double().requires_grad_()
    y_ref = reference_attention(mha, x_ref, p, "causal")
    y_ref.backward(g.double())
    # outputs and grads of the FP8 GEMMs: torchao's >= 18 dB; x and norm grads pass two E5M2 dgrads: >= 15 dB
    assert sqnr(y_ref, y) >= 18
    assert sqnr(x_ref.grad, x.grad) >= 15
    for name, param in mha.named_parameters():
        assert sqnr(p[name].grad, param.grad) >= (15 if "layer_norm" in name else 18), name


def test_fused_and_unfused_qkv_agree():
    torch.manual_seed(0)
    fused = MultiheadAttention(H, HEADS, num_gqa_groups=2, attention_dropout=0.0)
    torch.manual_seed(0)
    split = MultiheadAttention(H, HEADS, num_gqa_groups=2, attention_dropout=0.0, fuse_qkv_params=False)
    names = {n for n, _ in split.named_parameters()}
    assert {"layernorm_qkv.query_weight", "layernorm_qkv.key_weight", "layernorm_qkv.value_weight"} <= names
    x = torch.randn(7, 3, H)
    # same seed -> same layer (the unfused weights are the fused master's rows, reordered)
    torch.testing.assert_close(fused(x), split(x), rtol=1e-6, atol=1e-6)
    with fp8engine.autocast(recipe=fp8engine.CurrentScaling()):
        torch.testing.assert_close(fused(x), split(x), rtol=1e-6, atol=1e-6)


def test_padding_mask_convention():
    """True = masked out: changing a masked key must not change any output."""
    mha = _mha(attn_mask_type="padding")
    x = torch.randn(6, 2, H)
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    mask[:, ..., -1] = True
    x2 = x.clone()
    x2[-1] += 5.0  # the last token is masked out as a key; only its own output row may change
    y1, y2 = mha(x, mask), mha(x2, mask)
    torch.testing.assert_close(y1[:-1], y2[:-1], rtol=0, atol=1e-6)


def test_dropout_determinism():
    mha = _mha(attention_dropout=0.5, attn_mask_type="no_mask")
    x = torch.randn(5, 3, H)
    torch.manual_seed(1)
    a = mha(x)
    torch.manual_seed(1)
    b = mha(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, mha(x))  # a different draw
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x), rtol=0, atol=0)


def test_rotary_embedding_shape_and_identity_at_zero():
    rope = RotaryEmbedding(16)(5)
    assert rope.shape == (5, 1, 1, 16) and torch.equal(rope[0], torch.zeros(1, 1, 16))
    t = torch.randn(5, 2, 3, 16)
    out = apply_rotary_pos_emb(t, rope)
    torch.testing.assert_close(out[0], t[0])
    torch.testing.assert_close(out.norm(dim=-1), t.norm(dim=-1))  # a rotation keeps norms
    partial = apply_rotary_pos_emb(t, RotaryEmbedding(8)(5))
    torch.testing.assert_close(partial[..., 8:], t[..., 8:], rtol=0, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="divide hidden_size"):
        MultiheadAttention(64, 5)
    with pytest.raises(ValueError, match="num_gqa_groups"):
        MultiheadAttention(64, 4, num_gqa_groups=3)
    with pytest.raises(ValueError, match="attn_mask_type"):
        MultiheadAttention(64, 4, attn_mask_type="sliding")
    with pytest.raises(ValueError, match="normalization"):
        MultiheadAttention(64, 4, normalization="Foo")
    with pytest.raises(ValueError, match="needs attention_mask"):
        MultiheadAttention(64, 4, attn_mask_type="padding")(torch.randn(3, 1, 64))
    with pytest.raises(ValueError, match="only used with"):
        MultiheadAttention(64, 4)(torch.randn(3, 1, 64), torch.zeros(1, 1, 1, 3, dtype=torch.bool))
