"""Quantizer dispatch: the Triton-kernel path (forced on CPU under the interpreter) against the torch path."""
import pytest
import torch

from _ops_test_utils import IGNORE_INTERPRETER_WARNINGS, force_kernels, make_state  # noqa: F401 (fixture)
from fp8engine.fp8.float8_tensor import use_kernels

pytestmark = IGNORE_INTERPRETER_WARNINGS
ROLES = ("input", "weight", "grad_output")


def _grad(dtype, m=1151, n=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, n, generator=g) * 3).to(dtype)


def test_use_kernels_is_false_on_cpu():
    assert not use_kernels(torch.zeros(1))  # CPU keeps the torch path even when the interpreter is on


def _cast_both(force_kernels, delayed, fn):
    """``fn(quantizers)`` on the torch path, then on the kernel path; the recorded amaxes must be identical."""
    st_t, qs = make_state(ROLES, delayed)
    out_t = fn(qs[0])
    force_kernels(True)
    st_k, qs = make_state(ROLES, delayed)
    out_k = fn(qs[0])
    torch.testing.assert_close(st_k.amax_history, st_t.amax_history, rtol=0, atol=0)
    return out_t, out_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dbias", [True, False], ids=["dbias", "nodbias"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_cast_grad_kernel_matches_torch(force_kernels, delayed, dbias, dtype):
    dy = _grad(dtype)

    def fn(q):
        return q.grad_output.quantize_dbias(dy, transpose=True, dbias=dbias)
    (qt, dbt), (qk, dbk) = _cast_both(force_kernels, delayed, fn)
    # same scale, RNE conversion in both: identical FP8 bits, both layouts, and the same scale_inv
    assert qk.data.dtype == qt.data.dtype == torch.float8_e5m2
    assert torch.equal(qk.data.view(torch.uint8), qt.data.view(torch.uint8))
    assert torch.equal(qk.transpose_2d().view(torch.uint8), qt.transpose_2d().view(torch.uint8))
    torch.testing.assert_close(qk.scale_inv, qt.scale_inv, rtol=0, atol=0)
    if not dbias:
        assert dbk is None and dbt is None
        return
    # fp32 column sums in another order (64-row tiles, then tiles): fp32 within 1e-5 relative to the column's
    # sum of |dy|; bf16 within one bf16 ulp (plus the interpreter's truncating fp32 -> bf16 conversion: 2 ulps)
    ref = dy.double().sum(0)
    tol = dy.double().abs().sum(0) * 1e-5 if dtype == torch.float32 else ref.abs() * 2 ** -7
    assert dbk.dtype == dtype and ((dbk.double() - dbt.double()).abs() <= tol).all()


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_cast_operand_kernel_matches_torch(force_kernels, delayed):
    x = _grad(torch.bfloat16, 200, 64, seed=1)

    def fn(q):
        return q.input.quantize(x, transpose=True)
    qt, qk = _cast_both(force_kernels, delayed, fn)
    assert torch.equal(qk.data.view(torch.uint8), qt.data.view(torch.uint8))
    assert torch.equal(qk.transpose_2d().view(torch.uint8), qt.transpose_2d().view(torch.uint8))
    torch.testing.assert_close(qk.scale_inv, qt.scale_inv, rtol=0, atol=0)
