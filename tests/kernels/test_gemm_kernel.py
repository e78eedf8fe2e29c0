"""fp8_gemm_accumulate (FP8 GEMM accumulating into fp32, for fuse_wgrad_accumulation) against float64.

Tolerance: FP8 x FP8 products are exact in fp32; the K-sum, the scale multiply and the final add each round in fp32.
A sum of K terms in fp32 (any order) is within K * 2^-24 * sum|terms| of the exact sum (Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., eq. 4.4, first order), so per element we allow
(K + 3) * 2^-23 * (sum_k |a_ik b_jk| * sa * sb + |out_ij|): twice the first-order bound.
"""

import pytest
import torch
from _kernel_test_utils import DEVICES

from fp8engine.kernels._common import HAS_TRITON
from fp8engine.kernels.gemm import fp8_gemm_accumulate, fp8_gemm_accumulate_reference

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(48, 80, 96), (130, 200, 70), (16, 16, 16), (256, 144, 300)]


def _operands(m, n, k, a_dtype, b_dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 4).to(a_dtype)
    b = (torch.randn(n, k, generator=g) * 4).to(b_dtype)
    out = torch.randn(m, n, generator=g) * 100
    sa, sb = torch.tensor([0.37]), torch.tensor([2.0**-5])
    return [t.to(device) for t in (a, sa, b, sb, out)]


def _check_close(got, a, sa, b, sb, out0):
    a64, b64 = a.double().cpu(), b.double().cpu()
    s = sa.double().cpu() * sb.double().cpu()
    want = out0.double().cpu() + (a64 @ b64.t()) * s
    bound = (a.shape[1] + 3) * 2.0**-23 * ((a64.abs() @ b64.abs().t()) * s + out0.double().cpu().abs())
    err = (got.double().cpu() - want).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst error/bound {(err / bound).max():.3g}"


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("a_dtype,b_dtype", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_matches_float64(device, m, n, k, a_dtype, b_dtype):
    a, sa, b, sb, out = _operands(m, n, k, a_dtype, b_dtype, device, seed=m + k)
    out0 = out.clone()
    assert fp8_gemm_accumulate(a, sa, b, sb, out) is out
    _check_close(out, a, sa, b, sb, out0)
    ref = fp8_gemm_accumulate_reference(a, sa, b, sb, out0.clone())
    _check_close(ref, a, sa, b, sb, out0)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_accumulates_across_calls(device):
    """Two micro-batches into one main_grad: out = out0 + 2 * product (the second call adds, never overwrites)."""
    a, sa, b, sb, out = _operands(64, 48, 80, E5M2, E4M3, device, seed=3)
    out0 = out.clone()
    fp8_gemm_accumulate(a, sa, b, sb, out)
    fp8_gemm_accumulate(a, sa, b, sb, out)
    _check_close(out, torch.cat([a, a], 1), sa, torch.cat([b, b], 1), sb, out0)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    a, sa, b, sb, out = _operands(32, 48, 64, E4M3, E4M3, device)
    with pytest.raises(TypeError, match="float8"):
        fp8_gemm_accumulate(a.float(), sa, b, sb, out)
    with pytest.raises(TypeError, match="float32"):
        fp8_gemm_accumulate(a, sa, b, sb, out.bfloat16())
    with pytest.raises(ValueError, match="disagree on K"):
        fp8_gemm_accumulate(a[:, :32].contiguous(), sa, b, sb, out)
    with pytest.raises(ValueError, match=r"\[32, 48\]"):
        fp8_gemm_accumulate(a, sa, b, sb, out.t().contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        fp8_gemm_accumulate(a, sa, b, sb, torch.zeros(48, 32, device=device).t())
    with pytest.raises(TypeError, match="1-element"):
        fp8_gemm_accumulate(a, sa.double(), b, sb, out)
