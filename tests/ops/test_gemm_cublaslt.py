"""``cublaslt.gemm``: ``torch._scaled_mm``'s tensor-wise FP8 GEMM called through cuBLASLt directly, planned once per
configuration. It must give ``torch._scaled_mm``'s bits (same cuBLASLt call, same algorithm) on the GPU, and
``fp8_mm`` must take it in eager CUDA code only."""
import pytest
import torch

import fp8engine as fe
from fp8engine.kernels import cublaslt
from fp8engine.ops import gemm as gemm_mod
from fp8engine.ops.gemm import fp8_mm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt needs a GPU")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16 = torch.bfloat16


def _operand(rows, cols, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return fe.quantize_current((torch.randn(rows, cols, generator=g) * scale).cuda(), dtype)


# The layer's GEMM kinds (fp8_fprop / dgrad / wgrad, ops/linear.py): fprop E4M3 x E4M3 with the bias in the
# epilogue and fast accumulation; dgrad E5M2 x E4M3; wgrad E5M2 x E4M3 into bf16 or fp32; sizes of the small
# host-time layer, of gpt2-124m's fc1, and odd token counts.
CASES = [
    # (name, m, n, k, a dtype, b dtype, out dtype, bias, fast accumulation)
    ("fprop", 128, 768, 256, E4M3, E4M3, BF16, True, True),
    ("fprop-gpt2-fc1", 16384, 3072, 768, E4M3, E4M3, BF16, True, True),
    ("fprop-odd-m", 1151, 256, 1024, E4M3, E4M3, BF16, True, True),
    ("fprop-no-bias", 1151, 256, 1024, E4M3, E4M3, BF16, False, True),
    ("dgrad", 128, 256, 1024, E5M2, E4M3, BF16, False, False),
    ("wgrad", 1024, 256, 128, E5M2, E4M3, BF16, False, False),
    ("wgrad-fp32", 768, 256, 1152, E5M2, E4M3, torch.float32, False, False),
    ("fp16-bias", 64, 48, 32, E4M3, E5M2, torch.float16, True, True),
]


@cuda
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gemm_gives_scaled_mms_bits(case):
    _, m, n, k, a_dt, b_dt, out_dt, with_bias, fast = case
    a, b = _operand(m, k, a_dt, 0, 3.0), _operand(n, k, b_dt, 1, 0.1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to("cuda", out_dt) if with_bias else None
    out = cublaslt.gemm(a.data, a.scale_inv, b.data, b.scale_inv, out_dt, bias, fast)
    assert out is not None and out.shape == (m, n) and out.dtype == out_dt
    ref = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, bias=bias,
                           out_dtype=out_dt, use_fast_accum=fast)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the same cuBLASLt call: the same bits
    # a second call of the planned site with other scales (the descriptor's pointers are rewritten) and bias
    a2 = fe.quantize_current(a.dequantize(torch.float32) * 7, a_dt)
    bias2 = None if bias is None else bias * 2
    out2 = cublaslt.gemm(a2.data, a2.scale_inv, b.data, b.scale_inv, out_dt, bias2, fast)
    ref2 = torch._scaled_mm(a2.data, b.data.t(), scale_a=a2.scale_inv, scale_b=b.scale_inv, bias=bias2,
                            out_dtype=out_dt, use_fast_accum=fast)
    torch.testing.assert_close(out2, ref2, rtol=0, atol=0)


@cuda
def test_gemm_declines_what_it_does_not_run():
    a, b = _operand(64, 32, E4M3, 0), _operand(48, 32, E4M3, 1)
    # a non-contiguous operand, a bias of another dtype, M = 0: None (the caller runs torch._scaled_mm)
    wide = _operand(64, 64, E4M3, 3)
    assert cublaslt.gemm(wide.data[:, :32], a.scale_inv, b.data, b.scale_inv, BF16) is None
    assert cublaslt.gemm(a.data, a.scale_inv, b.data, b.scale_inv, BF16, torch.zeros(48, device="cuda")) is None
    empty = a.data[:0]
    assert cublaslt.gemm(empty, a.scale_inv, b.data, b.scale_inv, BF16) is None


@cuda
def test_fp8_mm_takes_the_direct_call_in_eager_cuda(monkeypatch):
    calls = []
    real = cublaslt.gemm

    def counting(*args, **kwargs):
        calls.append(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(cublaslt, "gemm", counting)
    a, b = _operand(64, 32, E4M3, 0), _operand(48, 32, E4M3, 1)
    bias = torch.randn(48, device="cuda")
    out = fp8_mm(a.data, a.scale_inv, b.data, b.scale_inv, BF16, bias=bias.to(BF16), use_fast_accum=True,
                 kernels=True)
    assert calls == [BF16]
    ref = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, bias=bias.to(BF16),
                           out_dtype=BF16, use_fast_accum=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # an fp32 bias with a bf16 output is added after the GEMM, as with torch._scaled_mm
    out = fp8_mm(a.data, a.scale_inv, b.data, b.scale_inv, BF16, bias=bias, kernels=True)
    ref = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=BF16) + bias.to(BF16)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    monkeypatch.setattr(gemm_mod, "CUBLASLT_GEMM", False)  # FP8ENGINE_CUBLASLT_GEMM=0
    fp8_mm(a.data, a.scale_inv, b.data, b.scale_inv, BF16, kernels=True)
    assert len(calls) == 2
    fp8_mm(a.data, a.scale_inv, b.data, b.scale_inv, BF16)  # the torch backend (kernels=False): torch._scaled_mm
    assert len(calls) == 2


def test_fp8_mm_on_cpu_does_not_call_cublaslt(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("cublaslt.gemm called for CPU tensors")

    monkeypatch.setattr(cublaslt, "gemm", fail)
    g = torch.Generator().manual_seed(0)
    a = fe.quantize_current(torch.randn(32, 16, generator=g), E4M3)
    b = fe.quantize_current(torch.randn(16, 16, generator=g), E4M3)
    out = fp8_mm(a.data, a.scale_inv, b.data, b.scale_inv, torch.float32, kernels=True)  # CPU: never cuBLASLt
    # exact: products of FP8 values and their sums over K = 16 are exact in float64 and the fp32 result is one rounding
    ref = (a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()).float()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ptr", [0, 1, 2, 48, 96, 256, 512, 4096 + 16, (1 << 40) + 128, (1 << 40) + 8])
def test_pointer_alignment_equals_the_loop(ptr):
    """``_alignment`` (the lowest set bit, capped at 256) against the plain definition: the largest power of two up
    to 256 dividing the pointer."""
    align = 256
    while ptr % align:
        align //= 2
    assert cublaslt._alignment(ptr) == align


@cuda
def test_gemm_declines_new_configurations_beyond_the_cap(monkeypatch):
    a, b = _operand(80, 32, E4M3, 0), _operand(48, 32, E4M3, 1)
    monkeypatch.setattr(cublaslt, "_MAX_SITES", len(cublaslt._get_context().sites))
    assert cublaslt.gemm(a.data, a.scale_inv, b.data, b.scale_inv, torch.float16) is None  # not planned: declined
    out = fp8_mm(a.data, a.scale_inv, b.data, b.scale_inv, torch.float16, kernels=True)  # torch._scaled_mm then
    ref = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=torch.float16)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@cuda
def test_sm_margin_plans_for_fewer_sms_and_stays_correct(monkeypatch):
    """FP8ENGINE_GEMM_SM_MARGIN (cublaslt.SM_MARGIN) plans the GEMMs for fewer SMs (SM_COUNT_TARGET): another
    algorithm may be picked (another fp32 summation order), so not the same bits as ``torch._scaled_mm``, but both
    round the same product to bf16: within two bf16 ulps (2**-6 relative; H100: the margin-less bound of one ulp
    against an fp32 reference was exceeded by accumulation order alone)."""
    a, b = _operand(1024, 512, E4M3, 0, 3.0), _operand(768, 512, E4M3, 1, 0.1)
    ref = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=BF16)
    monkeypatch.setattr(cublaslt, "SM_MARGIN", 20)
    monkeypatch.setattr(cublaslt, "_context", None)  # fresh plans (a context caches its sites), restored after
    out = cublaslt.gemm(a.data, a.scale_inv, b.data, b.scale_inv, BF16, None, False)
    assert out is not None
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=1e-2)
