"""``fp8_mm_accumulate``: the FP8 GEMM that adds into an fp32 output (``fuse_wgrad_accumulation``). On CUDA it is one
cuBLASLt call with beta = 1 (``fp8engine.kernels.cublaslt``); on CPU a GEMM into fp32 plus ``add_``."""
import pytest
import torch

import fp8engine as fe
from fp8engine.kernels import cublaslt
from fp8engine.ops.gemm import fp8_mm, fp8_mm_accumulate
from tests.conftest import sqnr

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuBLASLt accumulate path needs a GPU")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# Bound for the FP8 GEMM against float64 on the dequantized operands: products of two FP8 values are exact, but
# Hopper's FP8 tensor cores keep only ~14 bits while they sum a chunk of products before cuBLASLt promotes the
# chunk to fp32 (DeepSeek-V3 technical report, sec. 3.3.2): relative error up to ~2^-14 -> >= 60 dB (lowest
# measured on H200 79.4 dB; on CPU the GEMM is fp32, ~140 dB). A wrong beta, scale pointer or operand layout
# gives < 30 dB.
MIN_SQNR_DB = 60.0


def _operands(m, n, k, a_dt, b_dt, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = fe.quantize_current(torch.randn(m, k, generator=g).to(device) * 3, a_dt)
    b = fe.quantize_current(torch.randn(n, k, generator=g).to(device) * 0.1, b_dt)
    out0 = torch.randn(m, n, generator=g).to(device) * 50  # the gradient accumulated so far
    return a, b, out0


def _reference(a, b, out0):
    return out0.double() + a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()


@pytest.mark.parametrize("a_dt,b_dt", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], ids=["e4e4", "e5e4", "e4e5"])
@pytest.mark.parametrize("m,n,k", [(77, 48, 1152), (256, 384, 96)])
def test_accumulate_vs_float64(device, a_dt, b_dt, m, n, k):
    a, b, out0 = _operands(m, n, k, a_dt, b_dt, device)
    out = out0.clone()
    fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out, kernels=True)
    assert sqnr(_reference(a, b, out0), out) >= MIN_SQNR_DB
    if device.type == "cpu":  # the fallback is exactly GEMM into fp32 plus add
        expect = out0 + fp8_mm(a.data, a.scale_inv, b.data, b.scale_inv, torch.float32)
        torch.testing.assert_close(out, expect, rtol=0, atol=0)


def test_pad_inner_and_errors(device):
    a, b, out0 = _operands(32, 16, 40, E5M2, E4M3, device)  # K = 40 tokens: zero-padded to 48
    out = out0.clone()
    fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out, pad_inner=True, kernels=True)
    assert sqnr(_reference(a, b, out0), out) >= MIN_SQNR_DB
    with pytest.raises(TypeError, match="float32"):
        fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out.bfloat16(), pad_inner=True, kernels=True)
    with pytest.raises(ValueError, match=r"\[M, N\]"):
        fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out.t().contiguous(), pad_inner=True, kernels=True)
    with pytest.raises(ValueError, match="K=40"):
        fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out, kernels=True)
    e5 = fe.quantize_current(b.dequantize(torch.float32), E5M2)
    with pytest.raises(TypeError, match="E5M2 x E5M2"):
        fp8_mm_accumulate(a.data, a.scale_inv, e5.data, e5.scale_inv, out, pad_inner=True, kernels=True)


def test_cublaslt_unavailable_on_cpu_build():
    # On a machine without a GPU the public entry point says why it cannot run instead of failing inside ctypes.
    if torch.cuda.is_available():
        assert cublaslt.available()  # a GPU build must take the accumulate path, never the fallback silently
    else:
        assert not cublaslt.available()
        a, b, out0 = _operands(16, 16, 16, E4M3, E4M3, "cpu")
        with pytest.raises(RuntimeError, match="needs cuBLASLt on a GPU"):
            cublaslt.scaled_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out0)


@cuda
def test_unaligned_and_strided_out():
    a, b, out0 = _operands(64, 32, 64, E4M3, E4M3, "cuda", seed=1)
    flat = torch.zeros(1 + out0.numel(), device="cuda")
    out = flat[1:].view_as(out0)  # 4-byte aligned: cuBLASLt's FP8 kernels refuse it, so the GEMM-plus-add fallback
    out.copy_(out0)
    fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out, kernels=True)
    assert sqnr(_reference(a, b, out0), out) >= MIN_SQNR_DB
    wide = torch.zeros(64, 64, device="cuda")
    strided = wide[:, :32]  # not contiguous: the GEMM-plus-add fallback
    strided.copy_(out0)
    fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, strided, kernels=True)
    assert sqnr(_reference(a, b, out0), strided) >= MIN_SQNR_DB
    assert (wide[:, 32:] == 0).all()


@cuda
def test_cached_plan_reads_each_calls_scales():
    # Same shape twice with different operands and scale_inv tensors: the cached descriptor must point at the
    # second call's scales, and beta = 1 must add on top of the first call's result.
    a1, b1, out0 = _operands(128, 64, 256, E5M2, E4M3, "cuda", seed=2)
    a2, b2, _ = _operands(128, 64, 256, E5M2, E4M3, "cuda", seed=3)
    a2 = fe.quantize_current(a2.dequantize(torch.float32) * 1000, E5M2)  # a very different scale
    out = out0.clone()
    for a, b in ((a1, b1), (a2, b2)):
        fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out, kernels=True)
    ref = _reference(a1, b1, out0) + a2.dequantize(torch.float64) @ b2.dequantize(torch.float64).t()
    assert sqnr(ref, out) >= MIN_SQNR_DB


@cuda
def test_capturable_in_cuda_graph():
    a, b, out0 = _operands(256, 128, 512, E5M2, E4M3, "cuda", seed=4)
    out = out0.clone()
    fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out, kernels=True)  # warm-up: plan built outside capture
    out.copy_(out0)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out, kernels=True)
    torch.cuda.current_stream().wait_stream(stream)
    out.copy_(out0)
    graph.replay()
    graph.replay()
    prod = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    assert sqnr(out0.double() + 2 * prod, out) >= MIN_SQNR_DB


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_layer_main_grad_matches_grad(dtype):
    # The layer with fuse_wgrad_accumulation (cuBLASLt accumulate into main_grad) against the same layer without
    # it (GEMM into the weight dtype): same FP8 operands; main_grad differs from .grad only by the weight dtype's
    # rounding of the plain layer's wgrad (bf16: 2^-9 relative per rounding, rounded twice -> >= 45 dB; fp32:
    # the FP8 GEMM's own accumulation error, see MIN_SQNR_DB; bit-identical on H200 with cuBLAS 13).
    torch.manual_seed(0)
    kw = dict(params_dtype=dtype, device="cuda", hidden_dropout=0.0, attention_dropout=0.0)  # same math in both
    fused = fe.TransformerLayer(128, 256, 4, fuse_wgrad_accumulation=True, **kw)
    plain = fe.TransformerLayer(128, 256, 4, **kw)
    plain.load_state_dict(fused.state_dict())
    weights = [n for n, p in fused.named_parameters() if p.dim() == 2]
    params = dict(fused.named_parameters())
    for name in weights:
        params[name].main_grad = torch.zeros_like(params[name], dtype=torch.float32)
    x, g = torch.randn(64, 2, 128, device="cuda", dtype=dtype), torch.randn(64, 2, 128, device="cuda", dtype=dtype)
    for layer in (fused, plain):
        for _ in range(2):  # the second step accumulates on top of the first
            with fe.autocast(recipe=fe.DelayedScaling()):
                y = layer(x)
            y.backward(g)
    plain_params = dict(plain.named_parameters())
    for name in weights:
        assert params[name].grad is None, name
        db = sqnr(plain_params[name].grad, params[name].main_grad)
        assert db >= (45.0 if dtype == torch.bfloat16 else MIN_SQNR_DB), (name, db)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_operands_on_another_gpu_than_the_current_one():
    # A cuBLASLt handle and the launch belong to the current device; the call must switch to out's device.
    with torch.cuda.device(1):  # the operands are made on GPU 1 (its Triton casts launch there)
        a, b, out0 = _operands(64, 32, 64, E5M2, E4M3, "cuda:1", seed=5)
    assert torch.cuda.current_device() == 0
    out = out0.clone()
    fp8_mm_accumulate(a.data, a.scale_inv, b.data, b.scale_inv, out, kernels=True)
    assert torch.cuda.current_device() == 0 and out.device == torch.device("cuda:1")
    assert sqnr(_reference(a, b, out0), out) >= MIN_SQNR_DB
