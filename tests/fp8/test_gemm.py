import pytest
import torch

import fp8engine as fe
from fp8engine.ops.gemm import fp8_mm
from tests.conftest import sqnr


def _q(x, dt):
    return fe.quantize_current(x, dt)


@pytest.mark.parametrize("a_dt,b_dt", [(torch.float8_e4m3fn, torch.float8_e4m3fn),
                                       (torch.float8_e5m2, torch.float8_e4m3fn)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemm_vs_float64(device, a_dt, b_dt, out_dtype):
    torch.manual_seed(1)
    a, b = torch.randn(77, 64, device=device), torch.randn(48, 64, device=device)
    bias = torch.randn(48, device=device).to(out_dtype)
    qa, qb = _q(a, a_dt), _q(b, b_dt)
    y = fe.fp8_gemm(qa, qb, out_dtype, bias=bias)
    assert y.dtype == out_dtype and y.shape == (77, 48)
    ref = a.double() @ b.double().t() + bias.double()
    # GEMM of two FP8 operands (torchao threshold for FP8 GEMMs: 25 dB; E5M2 x E4M3 ~ 24-27 dB -> 22 dB)
    assert sqnr(ref, y) >= (25.0 if a_dt == b_dt else 22.0)
    # Exactly the GEMM of the dequantized operands, up to accumulation-order rounding.
    exact = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t() + bias.double()
    assert sqnr(exact, y) >= (40.0 if out_dtype == torch.float32 else 38.0)


def test_e5m2_times_e5m2_rejected():
    a = _q(torch.randn(16, 16), torch.float8_e5m2)
    with pytest.raises(TypeError, match="E5M2 x E5M2"):
        fe.fp8_gemm(a, a, torch.float32)


@pytest.mark.parametrize("k,n,dim", [(24, 32, "K=24"), (32, 24, "N=24")])
def test_dims_not_multiple_of_16(k, n, dim):
    a = _q(torch.randn(8, k), torch.float8_e4m3fn)
    b = _q(torch.randn(n, k), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=dim):
        fe.fp8_gemm(a, b, torch.float32)


def test_pad_inner_is_exact():
    a = _q(torch.randn(32, 37), torch.float8_e4m3fn)
    b = _q(torch.randn(16, 37), torch.float8_e4m3fn)
    y = fp8_mm(a.data, a.scale_inv, b.data, b.scale_inv, torch.float32, pad_inner=True)
    ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-5)  # fp32 accumulate of exact products
