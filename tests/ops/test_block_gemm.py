"""The block-scaled GEMM: the emulation equals a per-K-block float64 sum of dequantized tiles (one rounding to the
output), its SQNR against the float64 product of the unquantized inputs, the errors, and on an sm_90 GPU the
cuBLASLt block-wise path against the emulation."""
import pytest
import torch

from fp8engine.fp8.block_tensor import BLOCK_128x128, TILE_1x128, quantize_block
from fp8engine.ops.block_gemm import block_gemm, block_gemm_emulated, hw_block_gemm_available
from tests.conftest import sqnr

E4M3 = torch.float8_e4m3fn


def _data(shape, seed, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))).to(dtype).to(device)


def _blockwise_sum(qa, qb):
    """sum over K blocks kb of (a_data[:, kb] * sa[:, kb]) @ (b_data[:, kb] * sb[., kb]).T, float64: the formula
    the GEMM implements (the hardware applies each K block's scales to its partial sum in the accumulator)."""
    (m, k), n = qa.shape, qb.shape[0]
    out = torch.zeros(m, n, dtype=torch.float64)
    a, b = qa.data.double(), qb.data.double()
    for kb in range(k // 128):
        cols = slice(kb * 128, (kb + 1) * 128)
        sa = qa.scale_inv[:, kb].double()[:, None]
        if qb.block == TILE_1x128:
            sb = qb.scale_inv[:, kb].double()[:, None]
        else:
            sb = qb.scale_inv[:, kb].double().repeat_interleave(128)[:, None]
        out += (a[:, cols] * sa) @ (b[:, cols] * sb).t()
    return out


@pytest.mark.parametrize("b_block", [BLOCK_128x128, TILE_1x128], ids=["1x128-128x128", "1x128-1x128"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_emulation_is_the_blockwise_formula(b_block, out_dtype):
    """Same value as the per-K-block float64 sum, up to the final rounding to out_dtype (float64 sums in a different
    order may differ by ~1e-16 relative, so one ulp of out_dtype at most; almost all elements are identical)."""
    qa = quantize_block(_data((256, 384), 0), E4M3, TILE_1x128)
    qb = quantize_block(_data((128, 384), 1), E4M3, b_block)
    got = block_gemm(qa, qb, out_dtype)
    assert got.shape == (256, 128) and got.dtype == out_dtype
    want = _blockwise_sum(qa, qb)
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}[out_dtype]
    torch.testing.assert_close(got.double(), want, rtol=ulp, atol=0)
    assert (got == want.to(out_dtype)).float().mean() > 0.999
    assert torch.equal(got, block_gemm_emulated(qa, qb, out_dtype))


@pytest.mark.parametrize("b_block", [BLOCK_128x128, TILE_1x128], ids=["1x128-128x128", "1x128-1x128"])
def test_sqnr_vs_unquantized(b_block):
    """E4M3 with power-of-two block scales: each operand ~31 dB (see test_block_tensor), the product of two
    independent errors ~28 dB; >= 25 dB asserted (torchao's GEMM threshold)."""
    a, b = _data((256, 512), 2), _data((256, 512), 3)
    out = block_gemm(quantize_block(a, E4M3, TILE_1x128), quantize_block(b, E4M3, b_block), torch.float32)
    assert sqnr(a.double() @ b.double().t(), out) >= 25



@pytest.mark.parametrize("b_block", [BLOCK_128x128, TILE_1x128], ids=["1x128-128x128", "1x128-1x128"])
def test_bias(b_block):
    """bf16 output: the bias is added before the one rounding (as cuBLASLt's epilogue adds it to the fp32 sum), so
    the result is the float64 formula plus the bias, rounded once to bf16, exactly. fp32 output: the fp32 GEMM plus
    the bias (fp32 add), exactly. A bias in another dtype is brought to the output's first."""
    qa = quantize_block(_data((256, 384), 0), E4M3, TILE_1x128)
    qb = quantize_block(_data((128, 384), 1), E4M3, b_block)
    bias = _data((128,), 5, torch.float32)
    got = block_gemm(qa, qb, torch.bfloat16, bias=bias)
    want = (qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t() + bias.to(torch.bfloat16).double())
    assert torch.equal(got, want.to(torch.bfloat16))
    # one rounding instead of two: never further from the float64 value than GEMM-then-add
    two = (block_gemm(qa, qb, torch.bfloat16) + bias.to(torch.bfloat16)).double()
    assert (got.double() - want).abs().max() <= (two - want).abs().max()
    torch.testing.assert_close(block_gemm(qa, qb, torch.float32, bias=bias),
                               block_gemm(qa, qb, torch.float32) + bias, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \[128\]"):
        block_gemm(qa, qb, bias=bias[:64])


def test_errors():
    qa = quantize_block(_data((128, 256), 0), E4M3, TILE_1x128)
    qw = quantize_block(_data((128, 256), 1), E4M3, BLOCK_128x128)
    with pytest.raises(ValueError, match="1 x 128"):
        block_gemm(qw, qw)
    with pytest.raises(ValueError, match="must match"):
        block_gemm(qa, quantize_block(_data((128, 384), 1), E4M3, BLOCK_128x128))
    with pytest.raises(ValueError, match="multiple of 128"):
        block_gemm(quantize_block(_data((128, 200), 0), E4M3), quantize_block(_data((128, 200), 1), E4M3))
    with pytest.raises(ValueError, match="N = 100"):
        block_gemm(qa, quantize_block(_data((100, 256), 1), E4M3, BLOCK_128x128))
    with pytest.raises(TypeError, match="out_dtype"):
        block_gemm(qa, qw, torch.float16)
    with pytest.raises(TypeError, match="Float8BlockTensor"):
        block_gemm(qa, qw.data)
    if not hw_block_gemm_available(torch.device("cpu")):
        with pytest.raises(RuntimeError, match="sm_90"):
            block_gemm(qa, qw, use_hw=True)


def test_e5m2_operands_are_emulated():
    """torch's block-wise GEMM dispatches E4M3 x E4M3 only: E5M2 operands never select the hardware path."""
    qa = quantize_block(_data((128, 256), 0), torch.float8_e5m2, TILE_1x128)
    qw = quantize_block(_data((128, 256), 1), E4M3, BLOCK_128x128)
    assert not hw_block_gemm_available(torch.device("cuda"), torch.float8_e5m2, E4M3)
    with pytest.raises(RuntimeError, match="E4M3 operands"):
        block_gemm(qa, qw, use_hw=True)
    torch.testing.assert_close(block_gemm(qa, qw), block_gemm_emulated(qa, qw), rtol=0, atol=0)


HW = pytest.mark.skipif(not (torch.cuda.is_available() and hw_block_gemm_available(torch.device("cuda"))),
                        reason="needs an sm_90 GPU and torch.nn.functional.scaled_mm")


@HW
@pytest.mark.parametrize("b_block", [BLOCK_128x128, TILE_1x128], ids=["1x128-128x128", "1x128-1x128"])
@pytest.mark.parametrize("mkn", [(256, 512, 384), (384, 640, 256)])  # K/128 = 4 and 5 (padded scale rows)
def test_cuda_hw_matches_emulation(b_block, mkn):
    """cuBLASLt block-wise GEMM vs the float64 emulation of the same FP8 operands: both round once to bf16; the GPU
    sums in fp32, so a few elements may differ by one bf16 ulp: SQNR >= 45 dB (bf16 rounding alone is ~50 dB)."""
    m, k, n = mkn
    qa = quantize_block(_data((m, k), 0, device="cuda"), E4M3, TILE_1x128)
    qb = quantize_block(_data((n, k), 1, device="cuda"), E4M3, b_block)
    hw = block_gemm(qa, qb, torch.bfloat16, use_hw=True)
    emu = block_gemm(qa, qb, torch.bfloat16, use_hw=False)
    assert sqnr(emu, hw) >= 45
    # the bias in cuBLASLt's epilogue against the emulation's float64 add (one rounding each)
    bias = _data((n,), 9, device="cuda")
    hw = block_gemm(qa, qb, torch.bfloat16, bias=bias, use_hw=True)
    emu = block_gemm(qa, qb, torch.bfloat16, bias=bias, use_hw=False)
    assert sqnr(emu, hw) >= 45
