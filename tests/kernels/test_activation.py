"""Activation kernels (forward + FP8, backward fused with cast-transpose + dbias) against their references, and
the references against float64 autograd.

Exactness: ReLU is exact, so its FP8 bits must be identical. GELU / SwiGLU use exp/sigmoid whose fp32 results
differ by an ulp or so between Triton (and the GPU's approximate exp) and torch: high-precision outputs within a few
fp32 ulps / one ulp of bf16/fp16, FP8 codes within one step and >= 99 % identical (±0 counted equal: when the value
underflows to zero its sign depends on the formula, e.g. -0 from x * sigmoid(..) vs +0 from 0.5 x (1 + tanh)).
"""

import pytest
import torch
import torch.nn.functional as F
from _kernel_test_utils import (
    DEVICES,
    FP8_DTYPES,
    FP8_MAX,
    HP_DTYPES,
    assert_fp8_close,
    assert_fp8_equal,
    dtype_rtol,
    randn,
)

from fp8engine.kernels import activation as act

ACTS = ["gelu", "relu", "swiglu"]
SHAPES = [(1151, 24), (33, 48), (1, 16)]


def _fns(name):
    return (getattr(act, f"{name}_fwd"), getattr(act, f"{name}_fwd_reference"),
            getattr(act, f"{name}_bwd_cast_transpose"), getattr(act, f"{name}_bwd_cast_transpose_reference"))  # fmt: skip


def _inputs(name, shape, dtype, device):
    m, n = shape
    x = randn((m, 2 * n) if name == "swiglu" else (m, n), dtype, device, seed=m + n, scale=2.0)
    dy = randn((m, n), dtype, device, seed=5)
    return x, dy


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), rtol=max(dtype_rtol(dtype), 1e-5), atol=1e-5)


def _fp8_check(name, a, b, fp8_dtype):
    if name == "relu":
        assert_fp8_equal(a, b, fp8_dtype)
    else:
        assert_fp8_close(a, b, fp8_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ACTS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8_dtype", [None] + FP8_DTYPES)
def test_fwd(device, name, dtype, shape, fp8_dtype):
    fwd, fwd_ref = _fns(name)[:2]
    x, _ = _inputs(name, shape, dtype, device)
    kw = {}
    amax = amax_ref = None
    if fp8_dtype is not None:
        amax, amax_ref = torch.full((1,), 0.5, device=device), torch.full((1,), 0.5, device=device)
        kw = dict(scale=torch.tensor([FP8_MAX[fp8_dtype] / 4.0], device=device), fp8_dtype=fp8_dtype)
    y, y8, si = fwd(x, amax_out=amax, return_hp=True, **kw)
    ry, ry8, rsi = fwd_ref(x, amax_out=amax_ref, return_hp=True, **kw)
    assert y.shape == shape and y.dtype == dtype
    _close(y, ry, dtype)
    if fp8_dtype is None:
        assert y8 is None and si is None
        return
    _fp8_check(name, y8, ry8, fp8_dtype)
    torch.testing.assert_close(si, rsi, rtol=0, atol=0)
    torch.testing.assert_close(amax, amax_ref, rtol=0 if name == "relu" else 1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ACTS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8_dtype", [None] + FP8_DTYPES)
def test_bwd_cast_transpose(device, name, dtype, shape, fp8_dtype):
    bwd, bwd_ref = _fns(name)[2:]
    x, dy = _inputs(name, shape, dtype, device)
    nc = x.shape[-1]
    scale = None if fp8_dtype is None else torch.tensor([FP8_MAX[fp8_dtype] / 4.0], device=device)
    amax = amax_ref = None
    if fp8_dtype is not None:
        amax, amax_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    dx, dx_t, si, dbias = bwd(dy, x, scale, fp8_dtype, amax)
    rdx, rdx_t, rsi, rdbias = bwd_ref(dy, x, scale, fp8_dtype, amax_ref)
    assert dx.shape == x.shape and dbias.shape == (nc,) and dbias.dtype == dtype
    if fp8_dtype is None:
        assert dx.dtype == dtype and dx_t is None and si is None
        _close(dx, rdx, dtype)
    else:
        assert dx_t.shape == (nc, shape[0])
        _fp8_check(name, dx, rdx, fp8_dtype)
        _fp8_check(name, dx_t, rdx_t, fp8_dtype)
        torch.testing.assert_close(si, rsi, rtol=0, atol=0)
        torch.testing.assert_close(amax, amax_ref, rtol=0 if name == "relu" else 1e-5, atol=0)
    # dbias: fp32 column sums in another order, then one rounding to dtype (see test_cast)
    atol = 1e-5 * (rdx.float().abs().sum(0).max().item() if fp8_dtype is None else dy.float().abs().sum().item())
    torch.testing.assert_close(dbias.float(), rdbias.float(), rtol=dtype_rtol(dtype), atol=atol + 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ACTS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_high_precision_amax_is_of_the_written_values(device, name, dtype):
    """Without an FP8 output, ``amax_out`` gets ``max |y|`` (``max |dx|``) of the values as written in the output
    dtype, exactly: current scaling casts those values with the scale derived from this amax (no separate read)."""
    fwd, fwd_ref, bwd, bwd_ref = _fns(name)
    x, dy = _inputs(name, (130, 96), dtype, device)
    x = x * 7.0  # magnitudes where the rounding to bf16 / fp16 moves the amax
    for f in (fwd, fwd_ref):
        amax = torch.full((1,), 0.25, device=device)  # below the data's max: replaced
        y = f(x, amax_out=amax, return_hp=True)[0]
        assert amax.item() == y.float().abs().max().item(), f
    for b in (bwd, bwd_ref):
        amax = torch.zeros(1, device=device)
        dx = b(dy, x, None, None, amax)[0]
        assert amax.item() == dx.float().abs().max().item(), b


@pytest.mark.parametrize("name", ACTS)
def test_references_match_float64_autograd(name):
    fwd_ref, bwd_ref = _fns(name)[1], _fns(name)[3]
    x, dy = _inputs(name, (65, 40), torch.float32, "cpu")
    x64 = x.double().requires_grad_()
    if name == "gelu":
        y64 = F.gelu(x64, approximate="tanh")
    elif name == "relu":
        y64 = torch.relu(x64)
    else:
        y64 = F.silu(x64[:, :40]) * x64[:, 40:]
    y64.backward(dy.double())
    y = fwd_ref(x, return_hp=True)[0]
    dx, _, _, dbias = bwd_ref(dy, x, None, None)
    torch.testing.assert_close(y.double(), y64.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), x64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dbias.double(), x64.grad.sum(0), rtol=1e-5, atol=1e-5)
    if name == "gelu":  # the negative tail, relative: where fp32 0.5 x (1 + tanh(u)) cancels
        tail = torch.linspace(-5.5, -3.0, 101)  # float64 F.gelu itself cancels below about -6
        want = F.gelu(tail.double(), approximate="tanh")
        torch.testing.assert_close(fwd_ref(tail, return_hp=True)[0].double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_activation_errors(device):
    x = randn((8, 15), torch.float32, device)
    with pytest.raises(ValueError, match="even"):
        act.swiglu_fwd(x, return_hp=True)
    with pytest.raises(ValueError, match="return_hp"):
        act.gelu_fwd(x)
    with pytest.raises(TypeError, match="same dtype"):
        act.gelu_bwd_cast_transpose(x.half(), x, None, None)
    with pytest.raises(ValueError, match="dy"):
        act.relu_bwd_cast_transpose(x[:, :5].contiguous(), x, None, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hardware FP8 conversion needs a GPU")
@pytest.mark.parametrize("name", ACTS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(512, 1024), (300, 200)])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_hardware_conversion_matches_emulation_on_gpu(name, dtype, shape, fp8_dtype, monkeypatch):
    """On a GPU the activation forward uses Triton's FP8 conversion and the backward (transposed store in the same
    tile) the inline-PTX one (``_common.fp8_cvt_mode``); the same kernels with the exact emulation
    (FP8ENGINE_EMULATE_FP8_CVT=1) compute the same fp32 values, so the FP8 bits must be identical. Full 64 x 128
    tiles (512 x 1024) and ragged ones (300 x 200)."""
    fwd, _, bwd, _ = _fns(name)
    x, _ = _inputs(name, shape, dtype, "cuda")
    dy = randn(shape, dtype, "cuda", seed=7)
    scale = torch.tensor([FP8_MAX[fp8_dtype] / 8.0], device="cuda")
    out = {}
    for emulate in ("0", "1"):
        monkeypatch.setenv("FP8ENGINE_EMULATE_FP8_CVT", emulate)
        _, y8, _ = fwd(x, scale=scale, fp8_dtype=fp8_dtype)
        dx, dx_t, _, _ = bwd(dy, x, scale, fp8_dtype)
        out[emulate] = (y8, dx, dx_t)
    for hw, emu in zip(out["0"], out["1"]):
        assert_fp8_equal(hw, emu, fp8_dtype)
