"""qkv_grad_cast_transpose_dbias (gathers dq/dk/dv of any strides) against cast_transpose_dbias run on the assembled
[T, C] buffer (bit-identical: same tiles, same dbias summation order) and against the plain-PyTorch reference."""

import pytest
import torch
from _kernel_test_utils import DEVICES, FP8_DTYPES, FP8_MAX, assert_fp8_equal, dtype_rtol

from fp8engine.kernels._common import HAS_TRITON
from fp8engine.kernels.cast import cast_transpose_dbias
from fp8engine.kernels.qkv_grad import (
    assemble_qkv_grad,
    qkv_grad_cast_transpose_dbias,
    qkv_grad_cast_transpose_dbias_reference,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

E4M3 = torch.float8_e4m3fn
GROUPINGS = [pytest.param(4, 1, id="mha-g4"), pytest.param(2, 3, id="gqa-g2-hpg3")]
# (s, b): T = 64 (whole row tiles) and T = 111 (odd, a partial row tile)
SEQ_BATCH = [pytest.param(32, 2, id="T64"), pytest.param(37, 3, id="T111")]


def _randn(shape, dtype, gen):
    # |x| up to ~6: with scale = fp8_max / 5 the tails saturate and small values go subnormal
    return (torch.randn(shape, generator=gen) * 1.5).to(dtype)


def _make_grads(layout, s, b, g, hpg, d, dtype, device, seed=0):
    """dq [s, b, g, hpg, d], dk, dv [s, b, g, d] with the strides of ``layout``."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        dq, dk, dv = (_randn(sh, dtype, gen) for sh in ((s, b, g, hpg, d), (s, b, g, d), (s, b, g, d)))
    elif layout == "sdpa":  # SDPA's [b, heads, s, d] gradients moved to [s, b, ...] (the dq reshape is a view here)
        dq = _randn((b, g * hpg, s, d), dtype, gen).permute(2, 0, 1, 3).reshape(s, b, g, hpg, d)
        dk, dv = (_randn((b, g, s, d), dtype, gen).permute(2, 0, 1, 3) for _ in range(2))
    elif layout == "views":  # genuinely non-contiguous: permuted, sliced with an offset and a step, expanded
        dq = _randn((b, g, hpg, s, d), dtype, gen).permute(3, 0, 1, 2, 4)
        dk = _randn((s + 2, b, g + 1, 2 * d), dtype, gen)[1:-1, :, 1:, ::2]
        dv = _randn((s, 1, g, d), dtype, gen).expand(s, b, g, d)  # stride 0 along b
    else:
        raise AssertionError(layout)
    dq, dk, dv = dq.to(device), dk.to(device), dv.to(device)
    if layout != "contiguous":
        assert not (dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous())
    return dq, dk, dv


def _scale(fp8_dtype, device):
    return torch.tensor([FP8_MAX[fp8_dtype] / 5.0], device=device)


def _assert_same_outputs(out, ref, fp8_dtype, exact_dbias=True):
    data, data_t, si, dbias = out
    rdata, rdata_t, rsi, rdbias = ref
    assert_fp8_equal(data, rdata, fp8_dtype)
    assert_fp8_equal(data_t, rdata_t, fp8_dtype)
    torch.testing.assert_close(si, rsi, rtol=0, atol=0)
    assert dbias.dtype == rdbias.dtype and dbias.shape == rdbias.shape
    if exact_dbias:
        assert torch.equal(dbias, rdbias), "dbias differs from cast_transpose_dbias on the assembled buffer"


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["sdpa", "views"])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("s,b", SEQ_BATCH)
@pytest.mark.parametrize("d", [16, 32, 128])  # 128: a 128-column tile lies in one head slot (one load per tile)
@pytest.mark.parametrize("g,hpg", GROUPINGS)
def test_matches_cast_transpose_dbias_on_assembled_buffer(device, layout, fp8_dtype, dtype, s, b, d, g, hpg):
    dq, dk, dv = _make_grads(layout, s, b, g, hpg, d, dtype, device, seed=s + 7 * d + g)
    t, c = s * b, g * (hpg + 2) * d
    grad = assemble_qkv_grad(dq, dk, dv).reshape(t, c)
    sc = _scale(fp8_dtype, device)
    amax, amax_fused, amax_ref = (torch.full((1,), 0.25, device=device) for _ in range(3))

    out = qkv_grad_cast_transpose_dbias(dq, dk, dv, sc, fp8_dtype, amax)
    data, data_t, si, dbias = out
    assert data.shape == (t, c) and data_t.shape == (c, t) and data.dtype == data_t.dtype == fp8_dtype
    assert si.shape == (1,) and si.dtype == torch.float32 and torch.equal(si, torch.reciprocal(sc))
    assert dbias.shape == (c,) and dbias.dtype == dtype
    # the inputs are drawn so that some values saturate and some do not
    codes = data.view(torch.uint8) & 0x7F
    max_code = 0x7E if fp8_dtype == E4M3 else 0x7B
    assert (codes == max_code).any() and (codes < max_code).float().mean() > 0.9

    # 1) the existing kernel on the assembled contiguous buffer: everything bit-identical, dbias included
    _assert_same_outputs(out, cast_transpose_dbias(grad, sc, fp8_dtype, amax_fused), fp8_dtype)
    # 2) the plain-PyTorch reference: bits, scale_inv and amax exact; dbias is torch's column sum (another fp32
    #    summation order), so within one rounding of the output dtype plus fp32 reordering (<= T * 2^-24 sum|g|)
    ref = qkv_grad_cast_transpose_dbias_reference(dq, dk, dv, sc, fp8_dtype, amax_ref)
    _assert_same_outputs(out, ref, fp8_dtype, exact_dbias=False)
    g64 = grad.double()
    torch.testing.assert_close(dbias.double(), g64.sum(0), rtol=dtype_rtol(dtype),
                               atol=1e-5 * g64.abs().sum(0).max().item())
    torch.testing.assert_close(dbias.double(), ref[3].double(), rtol=dtype_rtol(dtype),
                               atol=1e-5 * g64.abs().sum(0).max().item())
    torch.testing.assert_close(amax, amax_fused, rtol=0, atol=0)
    torch.testing.assert_close(amax, amax_ref, rtol=0, atol=0)
    assert amax.item() == grad.float().abs().max().item() > 0.25


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_contiguous_inputs_and_data_matches_layout(device):
    """Plain contiguous inputs; and each element of data lands where the grouped layout puts it."""
    s, b, g, hpg, d = 5, 3, 2, 2, 8
    dq, dk, dv = _make_grads("contiguous", s, b, g, hpg, d, torch.float32, device, seed=4)
    sc = torch.ones(1, device=device)
    data = qkv_grad_cast_transpose_dbias(dq, dk, dv, sc, torch.float8_e5m2)[0]
    grouped = data.float().view(s, b, g, hpg + 2, d)
    torch.testing.assert_close(grouped[:, :, :, :hpg], dq.to(torch.float8_e5m2).float(), rtol=0, atol=0)
    torch.testing.assert_close(grouped[:, :, :, hpg], dk.to(torch.float8_e5m2).float(), rtol=0, atol=0)
    torch.testing.assert_close(grouped[:, :, :, hpg + 1], dv.to(torch.float8_e5m2).float(), rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_amax_keeps_larger_value_and_writes_view_target(device):
    dq, dk, dv = _make_grads("sdpa", 9, 2, 2, 3, 16, torch.bfloat16, device, seed=1)
    history = torch.zeros(4, 3, device=device)
    history[2, 0] = 1000.0
    sc = torch.ones(1, device=device)
    qkv_grad_cast_transpose_dbias(dq, dk, dv, sc, E4M3, history[2, 0:1])
    qkv_grad_cast_transpose_dbias(dq, dk, dv, sc, E4M3, history[1, 0:1])
    expected = torch.zeros(4, 3, device=device)
    expected[2, 0] = 1000.0
    expected[1, 0] = max(t.float().abs().max().item() for t in (dq, dk, dv))
    torch.testing.assert_close(history, expected, rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_nan_inf_and_negative_zero(device, fp8_dtype):
    dq, dk, dv = _make_grads("views", 11, 3, 2, 3, 16, torch.float32, device, seed=2)
    dv = dv.clone()  # the expanded view would alias the special values across the batch
    dk[4, 1, 0, 3] = float("nan")
    dq[2, 0, 1, 2, 5] = float("inf")
    dv[0, 2, 1, 7] = -float("inf")
    dq[1, 1, 0, 0, 0] = dk[1, 1, 1, 1] = dv[1, 1, 0, 2] = -0.0  # select, not add: -0.0 must stay -0.0
    sc = torch.full((1,), 2.0, device=device)
    amax = torch.zeros(1, device=device)
    data, data_t, _, dbias = qkv_grad_cast_transpose_dbias(dq, dk, dv, sc, fp8_dtype, amax)
    ref = qkv_grad_cast_transpose_dbias_reference(dq, dk, dv, sc, fp8_dtype)
    assert_fp8_equal(data, ref[0], fp8_dtype)
    assert_fp8_equal(data_t, ref[1], fp8_dtype)
    assert amax.item() == float("inf")  # documented: NaN counts as +inf
    grouped = data.view(11, 3, 2, 5, 16)
    assert grouped[4, 1, 0, 3, 3].float().isnan()
    assert grouped[2, 0, 1, 2, 5].float() == FP8_MAX[fp8_dtype]
    assert grouped[0, 2, 1, 4, 7].float() == -FP8_MAX[fp8_dtype]
    bits = grouped.view(torch.uint8)
    assert bits[1, 1, 0, 0, 0] == bits[1, 1, 1, 3, 1] == bits[1, 1, 0, 4, 2] == 0x80
    assert dbias.view(2, 5, 16)[0, 3, 3].isnan()


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_empty_sequence(device):
    dq, dk, dv = _make_grads("contiguous", 0, 2, 2, 1, 16, torch.bfloat16, device)
    amax = torch.full((1,), 3.0, device=device)
    data, data_t, si, dbias = qkv_grad_cast_transpose_dbias(dq, dk, dv, torch.full((1,), 4.0, device=device), E4M3,
                                                            amax)
    assert data.shape == (0, 96) and data_t.shape == (96, 0)  # C = g * (hpg + 2) * d = 2 * 3 * 16
    assert si.item() == 0.25 and amax.item() == 3.0
    assert torch.equal(dbias, torch.zeros(96, dtype=torch.bfloat16, device=device))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_problem(device):
    dq, dk, dv = _make_grads("contiguous", 4, 2, 2, 3, 8, torch.float32, device)
    sc = torch.ones(1, device=device)
    op = qkv_grad_cast_transpose_dbias
    with pytest.raises(TypeError, match="dtype torch.int32; supported"):
        op(dq.int(), dk.int(), dv.int(), sc, E4M3)
    with pytest.raises(TypeError, match="dk has dtype torch.bfloat16 but dq has torch.float32"):
        op(dq, dk.bfloat16(), dv, sc, E4M3)
    with pytest.raises(ValueError, match=r"inconsistent shapes dq \(4, 2, 2, 3, 8\), dk \(4, 2, 3, 8\)"):
        op(dq, torch.zeros(4, 2, 3, 8, device=device), dv, sc, E4M3)
    with pytest.raises(ValueError, match=r"inconsistent shapes .* dv \(4, 2, 2, 4\)"):
        op(dq, dk, dv[..., :4], sc, E4M3)
    with pytest.raises(ValueError, match=r"expected dq \[s, b, g, heads_per_group, d\].*dq \(4, 2, 6, 8\)"):
        op(dq.flatten(2, 3), dk, dv, sc, E4M3)
    with pytest.raises(ValueError, match="all required"):
        op(dq, None, dv, sc, E4M3)
    with pytest.raises(TypeError, match="scale"):
        op(dq, dk, dv, sc.half(), E4M3)
    with pytest.raises(TypeError, match="amax_out"):
        op(dq, dk, dv, sc, E4M3, torch.zeros(2, device=device))
    with pytest.raises(TypeError, match="fp8_dtype"):
        op(dq, dk, dv, sc, torch.float16)


def test_assemble_is_the_gradient_of_the_grouped_views():
    """assemble_qkv_grad equals what autograd's own slicing gives for the grouped views of the projection output
    (``mixed.view(s, b, g, hpg + 2, d)``: hpg query heads, then key, then value per group), computed independently."""
    s, b, g, hpg, d = 6, 2, 2, 3, 4
    dq, dk, dv = _make_grads("views", s, b, g, hpg, d, torch.float32, "cpu", seed=9)
    mixed = torch.randn(s, b, g * (hpg + 2) * d, requires_grad=True)
    grouped = mixed.view(s, b, g, hpg + 2, d)
    q, k, v = grouped[:, :, :, :hpg], grouped[:, :, :, hpg], grouped[:, :, :, hpg + 1]
    torch.autograd.backward((q, k, v), (dq, dk, dv))
    assembled = assemble_qkv_grad(dq, dk, dv)
    assert assembled.shape == (s, b, g * (hpg + 2) * d) and assembled.is_contiguous()
    assert torch.equal(assembled, mixed.grad)


def test_assemble_none_is_zero():
    s, b, g, hpg, d = 3, 2, 2, 2, 4
    dq, dk, dv = _make_grads("sdpa", s, b, g, hpg, d, torch.bfloat16, "cpu", seed=3)
    full = assemble_qkv_grad(dq, dk, dv).view(s, b, g, hpg + 2, d)
    no_k = assemble_qkv_grad(dq, None, dv).view(s, b, g, hpg + 2, d)
    assert torch.equal(no_k[:, :, :, hpg], torch.zeros_like(dk)) and torch.equal(no_k[:, :, :, hpg + 1], dv)
    only_v = assemble_qkv_grad(None, None, dv, heads_per_group=hpg).view(s, b, g, hpg + 2, d)
    assert torch.equal(only_v[:, :, :, hpg + 1], full[:, :, :, hpg + 1])
    assert not only_v[:, :, :, : hpg + 1].any()
    with pytest.raises(ValueError, match="heads_per_group must be given"):
        assemble_qkv_grad(None, dk, dv)
    with pytest.raises(ValueError, match="all None"):
        assemble_qkv_grad(None, None, None, heads_per_group=1)
