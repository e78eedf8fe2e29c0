"""block_linear: forward and the three gradients against a float64 linear (SQNR, thresholds commented), the
pieces it is built from (the fprop output is exactly the block GEMM of the quantized operands), the Triton kernel
path (interpreter on CPU) against the reference path, and the errors."""
import os

import pytest
import torch

from fp8engine.fp8.block_tensor import BLOCK_128x128, TILE_1x128, quantize_block
from fp8engine.ops.block_gemm import block_gemm
from fp8engine.ops.linear import block_linear
from fp8engine.recipe import DelayedScaling, Float8BlockScaling, Format
from tests.conftest import sqnr


def _inputs(dtype=torch.float32, device="cpu", seed=0, shape=(2, 128, 256), n=384):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(n, shape[-1], generator=g) * shape[-1] ** -0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(*shape[:-1], n, generator=g).to(dtype)
    return [t.to(device) for t in (x, w, b, dy)]


def _run(x, w, b, dy, **kw):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = block_linear(x, w, b, **kw)
    y.backward(dy)
    return y, x.grad, w.grad, b.grad


def _reference(x, w, b, dy):
    x, w, b = (t.detach().double().requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.linear(x, w, b)
    y.backward(dy.double())
    return y, x.grad, w.grad, b.grad


# Thresholds (dB), all quantized operands E4M3 with power-of-two 1 x 128 / 128 x 128 scales (~31 dB each):
# y ~32.5 (bias adds exact signal), dx / dw ~28.5 (two quantized operands); HYBRID gradients are E5M2 (2 mantissa
# bits, ~25.5 dB alone): dx / dw ~24.5. Asserted with ~3 dB of margin; torchao asserts >= 18 dB for linear grads.
THRESHOLDS = {Format.E4M3: (29, 25, 25), Format.HYBRID: (29, 21, 21)}


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_grads_vs_float64(fmt, dtype):
    x, w, b, dy = _inputs(dtype)
    y, dx, dw, db = _run(x, w, b, dy, recipe=Float8BlockScaling(fmt))
    ry, rdx, rdw, rdb = _reference(x, w, b, dy)
    t_y, t_dx, t_dw = THRESHOLDS[fmt]
    assert y.dtype == dx.dtype == dw.dtype == dtype and y.shape == (2, 128, 384)
    assert sqnr(ry, y) >= t_y
    assert sqnr(rdx, dx) >= t_dx
    assert sqnr(rdw, dw) >= t_dw
    # the bias gradient is an fp32 sum of the unquantized dy, rounded to dtype: bf16 ~50 dB, fp32 ~140 dB
    assert sqnr(rdb, db) >= (45 if dtype == torch.bfloat16 else 100)


def test_fprop_is_the_block_gemm_of_the_quantized_operands():
    """y == block_gemm(x 1x128, w 128x128) + bias exactly, and dx / dw are the GEMMs of the re-tiled operands."""
    x, w, b, dy = _inputs(torch.float32, seed=1)
    y, dx, dw, _ = _run(x, w, b, dy)
    e4m3 = torch.float8_e4m3fn
    qx, qx_t = quantize_block(x.reshape(-1, 256), e4m3, TILE_1x128, transpose=True)
    qw, qw_t = quantize_block(w, e4m3, BLOCK_128x128, transpose=True)
    qdy, qdy_t = quantize_block(dy.reshape(-1, 384), e4m3, TILE_1x128, transpose=True)
    torch.testing.assert_close(y.reshape(-1, 384), block_gemm(qx, qw, torch.float32) + b, rtol=0, atol=0)
    torch.testing.assert_close(dx.reshape(-1, 256), block_gemm(qdy, qw_t, torch.float32), rtol=0, atol=0)
    torch.testing.assert_close(dw, block_gemm(qdy_t, qx_t, torch.float32), rtol=0, atol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors through the kernels need "
                    "TRITON_INTERPRET=1 (set by tests/conftest.py when there is no GPU)")
def test_kernel_path_matches_reference_path():
    """kernels=True: the Triton cast kernels (interpreter on CPU); bit-identical casts, so identical results."""
    x, w, b, dy = _inputs(torch.bfloat16, seed=2, shape=(128, 256), n=128)
    for got, want in zip(_run(x, w, b, dy, kernels=True), _run(x, w, b, dy, kernels=False)):
        assert torch.equal(got, want)


def test_frozen_weight_and_no_bias():
    x, w, _, dy = _inputs(torch.float32, seed=3)
    xr = x.clone().requires_grad_()
    y = block_linear(xr, w, None)
    y.backward(dy)
    ry, rdx, _, _ = _reference(x, w, torch.zeros(384), dy)
    assert sqnr(ry, y) >= 25 and sqnr(rdx, xr.grad) >= 25  # no bias: y ~28.5 dB like the grads


def test_token_dim_not_a_multiple_of_128_is_padded_exactly():
    """M = 2 * 100 tokens: the op zero-pads the token rows to 256 and slices back; a zero row changes no tile's
    amax and adds nothing to wgrad, so every output equals the run on explicitly zero-padded tensors, bit for bit."""
    x, w, b, dy = _inputs(torch.float32, seed=5, shape=(200, 256))
    y, dx, dw, db = _run(x, w, b, dy)
    zeros = torch.zeros(56, 256)
    py, pdx, pdw, pdb = _run(torch.cat([x, zeros]), w, b, torch.cat([dy, torch.zeros(56, 384)]))
    assert y.shape == (200, 384) and dx.shape == (200, 256)
    for got, want in ((y, py[:200]), (dx, pdx[:200]), (dw, pdw), (db, pdb)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    ry, rdx, rdw, _ = _reference(x, w, b, dy)
    assert sqnr(ry, y) >= 29 and sqnr(rdx, dx) >= 25 and sqnr(rdw, dw) >= 25  # as THRESHOLDS[E4M3]


def test_errors():
    x, w, b, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="in_features=100 is not a multiple of 128"):
        block_linear(x[..., :100], w[:, :100], b)
    with pytest.raises(ValueError, match="out_features=200 is not a multiple of 128"):
        block_linear(x, w[:200], b[:200])
    with pytest.raises(ValueError, match="do not match"):
        block_linear(x, w.t(), b)
    with pytest.raises(TypeError, match="Float8BlockScaling"):
        block_linear(x, w, b, DelayedScaling())
    with pytest.raises(TypeError, match="float16"):
        block_linear(x.half(), w, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_cuda_matches_cpu(fmt):
    """On the GPU: Triton casts (bit-identical to the references) and, on sm_90, cuBLASLt's block-wise GEMM (fp32
    accumulation vs the CPU's float64): outputs and grads within a bf16 ulp or so of the CPU path: >= 40 dB."""
    x, w, b, dy = _inputs(torch.bfloat16, seed=4, shape=(4, 128, 512), n=768)
    cpu = _run(x, w, b, dy, recipe=Float8BlockScaling(fmt))
    gpu = _run(*(t.cuda() for t in (x, w, b, dy)), recipe=Float8BlockScaling(fmt))
    for c, g in zip(cpu, gpu):
        assert sqnr(c, g.cpu()) >= 40


def test_one_op_for_every_recipe():
    """Block scaling runs the linear op the per-tensor recipes run (one autograd node type, ``_FP8Linear``), its
    FP8 tensors carrying the block-scaled GEMMs: no op of its own."""
    x, w, b, _ = _inputs()
    y = block_linear(x.requires_grad_(), w, b)
    assert type(y.grad_fn).__name__ == "_FP8LinearBackward"
