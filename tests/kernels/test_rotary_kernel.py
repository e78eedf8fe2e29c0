"""The rotary kernels: ``rope_qk`` (q and k rotated from the grouped QKV output in one pass) against
``fp8engine.ops.rotary.rope_fwd`` on the views, and the QKV-gradient cast with the rotation's gradient in its gather
against ``rope_bwd`` followed by the cast of the assembled buffer. Both exact: each product and sum is rounded to the
input dtype as the reference's separate ops round it (kernels/rotary.py)."""

import pytest
import torch
from _kernel_test_utils import DEVICES, FP8_DTYPES, FP8_MAX, assert_fp8_equal

from fp8engine.kernels._common import HAS_TRITON
from fp8engine.kernels.cast import cast_transpose_dbias
from fp8engine.kernels.qkv_grad import assemble_qkv_grad, qkv_grad_cast_transpose_dbias
from fp8engine.kernels.rotary import rope_qk
from fp8engine.ops.rotary import qkv_views as _views
from fp8engine.ops.rotary import rope_bwd, rope_cos_sin, rope_fwd

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

# (g, hpg, d, r): MHA with full rotary; GQA with partial rotary; head dim not a power of two; a wide GQA group
SPLITS = [pytest.param(3, 1, 16, 16, id="mha-full"), pytest.param(2, 3, 16, 8, id="gqa-partial"),
          pytest.param(1, 4, 24, 12, id="d24"), pytest.param(2, 8, 32, 32, id="gqa-hpg8")]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _tables(s, r, dtype, device, gen):
    # angles up to ~9 rad: every sign of cos and sin occurs
    return rope_cos_sin((torch.randn(s, 1, 1, r, generator=gen) * 3).to(device), dtype)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g,hpg,d,r", SPLITS)
def test_rope_qk_equals_rope_fwd_on_the_views(device, dtype, g, hpg, d, r):
    gen = torch.Generator().manual_seed(g * 100 + d + r)
    s, b = 7, 3
    qkv = (torch.randn(s, b, g * (hpg + 2) * d, generator=gen) * 2).to(dtype).to(device)
    cos, sin = _tables(s, r, dtype, device, gen)
    q_view, k_view, _ = _views(qkv, g, hpg, d)
    q_ref = rope_fwd(q_view.reshape(s, b, g * hpg, d), cos, sin)
    k_ref = rope_fwd(k_view, cos, sin)
    for src in (qkv, qkv.view(s * b, -1)):  # [s, b, C] and the [T, C] view the fused step passes
        q, k = rope_qk(src, cos, sin, (g, hpg, d), b)
        assert q.shape == (s, b, g * hpg, d) and k.shape == (s, b, g, d) and q.is_contiguous() and k.is_contiguous()
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    # the values really are rotated (a kernel that copied q through would fail above only for rotated channels)
    assert not torch.equal(q[..., :r], q_view.reshape(s, b, g * hpg, d)[..., :r])


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_rope_qk_rejects_bad_tables(device):
    s, b, g, hpg, d = 4, 2, 2, 1, 16
    qkv = torch.randn(s, b, g * (hpg + 2) * d, dtype=torch.bfloat16, device=device)
    cos, sin = rope_cos_sin(torch.randn(s, 1, 1, d, device=device), torch.bfloat16)
    with pytest.raises(TypeError, match="rope_cos_sin"):
        rope_qk(qkv, cos.float(), sin.float(), (g, hpg, d), b)
    with pytest.raises(ValueError, match="one row per position"):
        rope_qk(qkv, cos[:2], sin[:2], (g, hpg, d), b)
    odd = rope_cos_sin(torch.randn(s, 1, 1, 3, device=device), torch.bfloat16)
    with pytest.raises(ValueError, match="even"):
        rope_qk(qkv, *odd, (g, hpg, d), b)
    with pytest.raises(ValueError, match="does not hold rows"):
        rope_qk(qkv, cos, sin, (g, hpg + 1, d), b)
    with pytest.raises(ValueError, match="does not hold rows"):
        rope_qk(qkv[:, :, :-16], cos, sin, (g, hpg, d), b)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("g,hpg,d,r", SPLITS)
def test_qkv_grad_with_rotary_equals_rope_bwd_then_cast(device, fp8_dtype, dtype, g, hpg, d, r):
    gen = torch.Generator().manual_seed(7 * g + d + r)
    s, b = 37, 3  # T = 111: a partial row tile
    # SDPA's [b, heads, s, d] gradients moved to [s, b, ...]: the strides the fused layer step passes
    dq = (torch.randn(b, g * hpg, s, d, generator=gen) * 1.5).to(dtype).to(device).permute(2, 0, 1, 3)
    dk, dv = ((torch.randn(b, g, s, d, generator=gen) * 1.5).to(dtype).to(device).permute(2, 0, 1, 3)
              for _ in range(2))
    cos, sin = _tables(s, r, dtype, device, gen)
    scale = torch.tensor([FP8_MAX[fp8_dtype] / 5.0], device=device)
    amax, amax_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)

    out = qkv_grad_cast_transpose_dbias(dq.reshape(s, b, g, hpg, d), dk, dv, scale, fp8_dtype, amax, cos=cos, sin=sin)
    dq_r = rope_bwd(dq, cos, sin).reshape(s, b, g, hpg, d)
    grad = assemble_qkv_grad(dq_r, rope_bwd(dk, cos, sin), dv).reshape(s * b, -1)
    ref = cast_transpose_dbias(grad, scale, fp8_dtype, amax_ref)
    for got, want in zip(out[:2], ref[:2]):
        assert_fp8_equal(got, want, fp8_dtype)
    assert torch.equal(out[2], ref[2]) and torch.equal(out[3], ref[3]) and torch.equal(amax, amax_ref)
    # and the rotation mattered: without it the FP8 data differs
    plain = qkv_grad_cast_transpose_dbias(dq.reshape(s, b, g, hpg, d), dk, dv, scale, fp8_dtype)
    assert not torch.equal(plain[0].view(torch.uint8), out[0].view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_qkv_grad_rotary_tables_checked(device):
    s, b, g, hpg, d = 4, 2, 2, 1, 16
    dq = torch.randn(s, b, g, hpg, d, device=device)
    dk, dv = torch.randn(s, b, g, d, device=device), torch.randn(s, b, g, d, device=device)
    cos, sin = rope_cos_sin(torch.randn(s, 1, 1, d, device=device), torch.float32)
    scale = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="both cos and sin"):
        qkv_grad_cast_transpose_dbias(dq, dk, dv, scale, torch.float8_e5m2, cos=cos)
    with pytest.raises(ValueError, match="head dim"):
        wide = rope_cos_sin(torch.randn(s, 1, 1, 2 * d, device=device), torch.float32)
        qkv_grad_cast_transpose_dbias(dq, dk, dv, scale, torch.float8_e5m2, cos=wide[0], sin=wide[1])
