"""LayerNorm / RMSNorm kernels against their plain-PyTorch references, and the references against float64 autograd.

Tolerances: the kernel and the reference both compute in fp32 but reduce in different orders (and on GPU use
approximate sqrt/division), so fp32 outputs agree to a few ulps (rtol 2e-5 with atol 2e-5 covers ~100 ulps of O(1)
values); outputs rounded to bf16/fp16 agree to one ulp of that dtype. FP8 outputs: within one FP8 step, >= 99 %
identical (a flip needs an fp32 value within a few ulps of an FP8 rounding midpoint).
"""

import pytest
import torch
import torch.nn.functional as F
from _kernel_test_utils import DEVICES, FP8_DTYPES, FP8_MAX, HP_DTYPES, assert_fp8_close, dtype_rtol, randn

from fp8engine.kernels.norm import (
    layernorm_bwd,
    layernorm_bwd_reference,
    layernorm_fwd,
    layernorm_fwd_reference,
    rmsnorm_bwd,
    rmsnorm_bwd_reference,
    rmsnorm_fwd,
    rmsnorm_fwd_reference,
)

SHAPES = [(1151, 24), (33, 48), (1, 16), (2, 9, 300)]
EPS = 1e-5


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), rtol=max(dtype_rtol(dtype), 2e-5), atol=2e-5)


def _params(shape, dtype, device, zero_centered):
    n = shape[-1]
    w = randn((n,), dtype, device, seed=7, scale=0.5)
    if not zero_centered:
        w = (w.float() + 1.0).to(dtype)
    b = randn((n,), dtype, device, seed=8, scale=0.5)
    return w, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_norm_fwd_bwd_hp(device, dtype, shape, rms, zero_centered):
    x = randn(shape, dtype, device, seed=shape[0], scale=2.0)
    x = (x.float() + 0.7).to(dtype)  # non-zero mean
    dy = randn(shape, dtype, device, seed=99)
    w, b = _params(shape, dtype, device, zero_centered)
    kw = dict(zero_centered_gamma=zero_centered)
    if rms:
        y, y8, si, rstd = rmsnorm_fwd(x, w, EPS, **kw)
        ry, _, _, rrstd = rmsnorm_fwd_reference(x, w, EPS, **kw)
        grads = rmsnorm_bwd(dy, x, rrstd, w, **kw)
        rgrads = rmsnorm_bwd_reference(dy, x, rrstd, w, **kw)
    else:
        bias = None if zero_centered else b  # cover bias=None
        y, y8, si, mean, rstd = layernorm_fwd(x, w, bias, EPS, **kw)
        ry, _, _, rmean, rrstd = layernorm_fwd_reference(x, w, bias, EPS, **kw)
        torch.testing.assert_close(mean, rmean, rtol=2e-5, atol=2e-6)
        grads = layernorm_bwd(dy, x, rmean, rrstd, w, **kw)
        rgrads = layernorm_bwd_reference(dy, x, rmean, rrstd, w, **kw)
    assert y8 is None and si is None
    assert y.dtype == dtype and y.shape == x.shape and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd, rrstd, rtol=2e-5, atol=0)
    _close(y, ry, dtype)
    dx, dgamma = grads[0], grads[1]
    assert dx.dtype == dtype and dx.shape == x.shape and dgamma.dtype == w.dtype
    _close(dx, rgrads[0], dtype)
    # dgamma / dbeta: sums over up to 1151 rows in different orders: fp32 error <= rows * 2^-24 * sum|terms|
    for g, rg in zip(grads[1:], rgrads[1:]):
        scale = rg.float().abs().max().item() + 1.0
        torch.testing.assert_close(g.float(), rg.float(), rtol=dtype_rtol(dtype), atol=1e-4 * scale)
    again = (rmsnorm_bwd(dy, x, rrstd, w, **kw) if rms else layernorm_bwd(dy, x, rmean, rrstd, w, **kw))
    for g, g2 in zip(grads[1:], again[1:]):
        assert torch.equal(g, g2), "dgamma / dbeta must be deterministic"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("return_hp", [False, True])
def test_norm_fwd_fp8(device, fp8_dtype, dtype, rms, return_hp):
    shape = (257, 40)
    x = randn(shape, dtype, device, seed=4, scale=3.0)
    w, b = _params(shape, dtype, device, False)
    s = torch.tensor([FP8_MAX[fp8_dtype] / 3.0], device=device)
    amax, amax_ref = torch.full((1,), 0.1, device=device), torch.full((1,), 0.1, device=device)
    kw = dict(scale=s, fp8_dtype=fp8_dtype, return_hp=return_hp)
    if rms:
        y, y8, si, _ = rmsnorm_fwd(x, w, EPS, amax_out=amax, **kw)
        ry, ry8, rsi, _ = rmsnorm_fwd_reference(x, w, EPS, amax_out=amax_ref, **kw)
    else:
        y, y8, si, _, _ = layernorm_fwd(x, w, b, EPS, amax_out=amax, **kw)
        ry, ry8, rsi, _, _ = layernorm_fwd_reference(x, w, b, EPS, amax_out=amax_ref, **kw)
    assert (y is None) == (not return_hp)
    if return_hp:
        _close(y, ry, dtype)
    assert y8.shape == x.shape
    assert_fp8_close(y8, ry8, fp8_dtype)
    torch.testing.assert_close(si, rsi, rtol=0, atol=0)
    torch.testing.assert_close(amax, amax_ref, rtol=2e-5, atol=0)  # max|y| of fp32 y, same ulp argument as y


@pytest.mark.parametrize("zero_centered", [False, True])
def test_references_match_float64_autograd(zero_centered):
    x = randn((65, 48), torch.float32, "cpu", seed=1, scale=2.0) + 0.5
    dy = randn((65, 48), torch.float32, "cpu", seed=2)
    w, b = _params((65, 48), torch.float32, "cpu", zero_centered)
    kw = dict(zero_centered_gamma=zero_centered)
    # LayerNorm
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    y64 = F.layer_norm(x64, (48,), (w64 + 1.0) if zero_centered else w64, b64, EPS)
    y64.backward(dy.double())
    y, _, _, mean, rstd = layernorm_fwd_reference(x, w, b, EPS, **kw)
    dx, dgamma, dbeta = layernorm_bwd_reference(dy, x, mean, rstd, w, **kw)
    for got, want in ((y, y64), (dx, x64.grad), (dgamma, w64.grad), (dbeta, b64.grad)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-4)
    # RMSNorm
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    g64 = (w64 + 1.0) if zero_centered else w64
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * g64
    y64.backward(dy.double())
    y, _, _, rstd = rmsnorm_fwd_reference(x, w, EPS, **kw)
    dx, dgamma = rmsnorm_bwd_reference(dy, x, rstd, w, **kw)
    for got, want in ((y, y64), (dx, x64.grad), (dgamma, w64.grad)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_errors(device):
    x = randn((8, 16), torch.float32, device)
    w = torch.ones(16, device=device)
    with pytest.raises(ValueError, match="contiguous"):
        layernorm_fwd(x.t().contiguous().t(), w, None, EPS)
    with pytest.raises(ValueError, match="shape"):
        layernorm_fwd(x, torch.ones(15, device=device), None, EPS)
    with pytest.raises(ValueError, match="both scale and fp8_dtype"):
        rmsnorm_fwd(x, w, EPS, scale=torch.ones(1, device=device))
    with pytest.raises(ValueError, match="no output"):
        rmsnorm_fwd(x, w, EPS, return_hp=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(33, 48), (2, 9, 300)])
@pytest.mark.parametrize("rms", [False, True])
def test_residual_fused_equals_add_then_norm(device, dtype, shape, rms):
    """Forward with ``residual``: residual_out is exactly torch's ``x + residual`` and every output (y, FP8 bits,
    mean, rstd, amax) is that of the kernel run on the sum (exact under the interpreter; on a GPU within the
    kernel tolerances, see below). Backward with ``dresidual``: dx equals the
    plain backward's fp32 dx plus dresidual, rounded once (the reference; within the usual tolerances), and
    dgamma/dbeta are unchanged."""
    x = randn(shape, dtype, device, seed=3, scale=2.0)
    r = randn(shape, dtype, device, seed=4, scale=2.0)
    dy, dres = randn(shape, dtype, device, seed=5), randn(shape, dtype, device, seed=6)
    w, b = _params(shape, dtype, device, False)
    fp8 = dict(scale=torch.tensor([FP8_MAX[torch.float8_e4m3fn] / 8.0], device=device), fp8_dtype=torch.float8_e4m3fn)
    amax_f, amax_p = torch.zeros(1, device=device), torch.zeros(1, device=device)
    fwd, bwd = (rmsnorm_fwd, rmsnorm_bwd) if rms else (layernorm_fwd, layernorm_bwd)
    fwd_ref, bwd_ref = (rmsnorm_fwd_reference, rmsnorm_bwd_reference) if rms else (layernorm_fwd_reference,
                                                                                   layernorm_bwd_reference)
    args = (w,) if rms else (w, b)
    s = torch.empty_like(x)
    fused = fwd(x, *args, EPS, residual=r, residual_out=s, amax_out=amax_f, **fp8)
    plain = fwd(x + r, *args, EPS, amax_out=amax_p, **fp8)
    assert torch.equal(s, x + r)
    # the same values normalised; on a GPU the compiler may order the row reductions differently in the fused
    # kernel (seen for fp32 on H200: last-bit differences in y), so outputs agree to the kernel tolerances
    for a, p in zip(fused, plain):
        if a is not None and a.dtype in FP8_DTYPES:
            assert_fp8_close(a, p, a.dtype)
        elif a is not None:
            _close(a, p, a.dtype)
    torch.testing.assert_close(amax_f, amax_p, rtol=1e-5, atol=0)
    s_ref = torch.empty_like(x)
    ref = fwd_ref(x, *args, EPS, residual=r, residual_out=s_ref, **fp8)
    assert torch.equal(s_ref, x + r)
    _close(fused[0], ref[0], dtype)
    stats = fused[-1:] if rms else fused[-2:]
    g = bwd(dy, s, *stats, w, dresidual=dres)
    g_plain = bwd(dy, s, *stats, w)
    g_ref = bwd_ref(dy, s, *stats, w, dresidual=dres)
    _close(g[0], g_ref[0], dtype)
    # against the unfused backward + add: one rounding of a sum of two values, each within an ulp of dtype
    diff = (g[0].float() - (g_plain[0].float() + dres.float())).abs()
    assert (diff <= 2 * max(dtype_rtol(dtype), 2e-5) * (g_plain[0].float().abs() + dres.float().abs()) + 2e-5).all()
    for a, p in zip(g[1:], g_plain[1:]):
        assert torch.equal(a, p)


@pytest.mark.parametrize("device", DEVICES)
def test_residual_argument_errors(device):
    x = randn((4, 16), torch.float32, device)
    w = torch.ones(16, device=device)
    with pytest.raises(ValueError, match="both residual and residual_out"):
        layernorm_fwd(x, w, None, EPS, residual=x.clone())
    with pytest.raises(ValueError, match="residual must match x"):
        layernorm_fwd(x, w, None, EPS, residual=x.half(), residual_out=torch.empty_like(x))
    with pytest.raises(ValueError, match="dresidual must match x"):
        rmsnorm_bwd(x, x, torch.ones(4, device=device), w, dresidual=x[:2].contiguous())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_high_precision_amax_is_of_the_written_values(device, rms, dtype):
    """Without an FP8 output, ``amax_out`` gets ``max |y|`` of y as written in x.dtype, exactly (current scaling
    casts those values with the scale derived from it; no separate read of y)."""
    x = randn((70, 96), dtype, device) * 3.0
    w, b = _params((70, 96), dtype, device, False)
    for fwd in ((rmsnorm_fwd, rmsnorm_fwd_reference) if rms else (layernorm_fwd, layernorm_fwd_reference)):
        amax = torch.full((1,), 0.25, device=device)
        args = (x, w, EPS) if rms else (x, w, b, EPS)
        y = fwd(*args, amax_out=amax, return_hp=True)[0]
        assert amax.item() == y.float().abs().max().item(), fwd
