"""The fused activation + 1 x 128 block cast kernels (``fp8engine.kernels.block_activation``), forward and backward
(with dbias): against their plain-PyTorch references, bit for bit against the unfused path (activation kernel, then
``cast_1x128``) for fp32 inputs, against float64 for bf16 inputs, row padding, and the launchers' errors."""
import pytest
import torch

from fp8engine.fp8.block_tensor import TILE_1x128, Float8BlockTensor
from fp8engine.kernels import activation as ka
from fp8engine.kernels.block_activation import (act_bwd_1x128, act_bwd_1x128_reference, act_fwd_1x128,
                                                act_fwd_1x128_reference)
from fp8engine.kernels.block_cast import cast_1x128
from tests.conftest import sqnr

from _kernel_test_utils import DEVICES, FP8_DTYPES, assert_fp8_close, assert_fp8_equal

KINDS = ["gelu", "relu", "swiglu"]
E4M3 = torch.float8_e4m3fn


def _inputs(kind, m, n, dtype, device, seed=0):
    """x [m, D] (D = 2n for swiglu) with log-normal row scales, dy [m, n]."""
    g = torch.Generator().manual_seed(seed)
    d = 2 * n if kind == "swiglu" else n
    x = torch.randn(m, d, generator=g) * torch.exp(torch.randn(m, 1, generator=g)) * 2
    dy = torch.randn(m, n, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    return x.to(dtype).to(device), dy.to(dtype).to(device)


def _dq(data, sinv):
    return Float8BlockTensor(data, sinv, TILE_1x128, torch.float32).dequantize(torch.float64).cpu()


def _assert_outputs(got, want, fp8_dtype, exact):
    """(data, scale_inv, data_t, scale_inv_t): bits equal (exact) or within one FP8 step, scales equal."""
    same = assert_fp8_equal if exact else assert_fp8_close
    for i in (0, 2):
        same(got[i], want[i].to(got[i].device), fp8_dtype)
        assert torch.equal(got[i + 1].cpu(), want[i + 1].cpu()), "scale_inv differs"
        assert got[i + 1].stride() == want[i + 1].stride() or got[i + 1].shape[1] == 1


# Kernel vs reference: the same fp32 formulas; GELU / SwiGLU's exp and division may differ in the last ulp on the GPU
# (fast division), so codes may differ by one step there (assert_fp8_close); ReLU is exact. Measured on the
# interpreter: identical for all three.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pad_rows", [False, True])
def test_kernels_match_reference(device, fp8_dtype, dtype, kind, pad_rows):
    x, dy = _inputs(kind, 333, 256, dtype, device)  # 333 rows: partial row tiles
    kw = dict(transpose=True, pad_rows=pad_rows)
    exact = kind == "relu"
    got = act_fwd_1x128(x, kind, fp8_dtype, **kw)
    _assert_outputs(got, act_fwd_1x128_reference(x.cpu(), kind, fp8_dtype, **kw), fp8_dtype, exact)
    assert got[0].shape == (384 if pad_rows else 333, 256)
    got = act_bwd_1x128(dy, x, kind, fp8_dtype, **kw)
    want = act_bwd_1x128_reference(dy.cpu(), x.cpu(), kind, fp8_dtype, **kw)
    _assert_outputs(got, want, fp8_dtype, exact)
    assert got[0].shape == (384 if pad_rows else 333, x.shape[1]) and got[4].dtype == dtype
    # dbias: fp32 column sums over 333 rows in different orders, rounded once to dtype
    torch.testing.assert_close(got[4].cpu(), want[4], rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_fp32_equals_unfused_path(device, fp8_dtype, kind):
    """fp32 input: the unfused path's intermediate (the per-tensor kernel's high-precision output, same Triton
    functions) is the same fp32 value, so the FP8 bits and scales equal activation kernel -> cast_1x128 exactly.
    dbias: the per-tensor kernel sums per 64-row tile, this one per 128: the same up to fp32 summation order."""
    x, dy = _inputs(kind, 200, 128, torch.float32, device, seed=1)
    y = getattr(ka, f"{kind}_fwd")(x, return_hp=True)[0]
    _assert_outputs(act_fwd_1x128(x, kind, fp8_dtype, transpose=True), cast_1x128(y, fp8_dtype, transpose=True),
                    fp8_dtype, True)
    dx, _, _, db = getattr(ka, f"{kind}_bwd_cast_transpose")(dy, x, None, None)
    got = act_bwd_1x128(dy, x, kind, fp8_dtype)
    _assert_outputs(got, cast_1x128(dx, fp8_dtype, transpose=True), fp8_dtype, True)
    torch.testing.assert_close(got[4], db, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_vs_float64(device, kind):
    """bf16 input: the fused kernels cast the fp32 result, the unfused path its bf16 rounding. Both against float64
    (F.gelu tanh / relu / silu * up of the same bf16 x, autograd for the backward). Measured (E4M3, power-of-two
    scales), fused vs unfused: forward 30.9-31.6 vs 30.8-31.6 dB, backward 31.4-31.7 vs 31.2-31.7 dB (data and
    transposed alike; ReLU's values are exact in bf16, so there both are equal). Asserted: >= 28 dB (one E4M3
    cast ~31 dB) and not worse than unfused by more than 0.1 dB."""
    x, dy = _inputs(kind, 256, 256, torch.bfloat16, device, seed=2)
    x64 = x.double().cpu().requires_grad_()
    if kind == "swiglu":
        gate, up = x64.chunk(2, dim=-1)
        y64 = torch.nn.functional.silu(gate) * up
    else:
        y64 = torch.nn.functional.gelu(x64, approximate="tanh") if kind == "gelu" else torch.relu(x64)
    y64.backward(dy.double().cpu())
    fwd, bwd = getattr(ka, f"{kind}_fwd"), getattr(ka, f"{kind}_bwd_cast_transpose")
    unfused_fwd = cast_1x128(fwd(x, return_hp=True)[0], E4M3, transpose=True)
    unfused_bwd = cast_1x128(bwd(dy, x, None, None)[0], E4M3, transpose=True)
    for fused, unfused, want in ((act_fwd_1x128(x, kind, E4M3, transpose=True), unfused_fwd, y64.detach()),
                                 (act_bwd_1x128(dy, x, kind, E4M3), unfused_bwd, x64.grad)):
        for i, ref in ((0, want), (2, want.t())):
            s_fused, s_unfused = sqnr(ref, _dq(*fused[i:i + 2])), sqnr(ref, _dq(*unfused[i:i + 2]))
            assert s_fused >= 28 and s_fused >= s_unfused - 0.1, (i, s_fused, s_unfused)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows(device):
    """pad_rows: zero rows with scale_inv 1 after row M; the rest equals the unpadded outputs; dbias unchanged."""
    x, dy = _inputs("swiglu", 100, 128, torch.bfloat16, device, seed=3)
    got, plain = act_bwd_1x128(dy, x, "swiglu", E4M3, pad_rows=True), act_bwd_1x128(dy, x, "swiglu", E4M3)
    assert got[0].shape == (128, 256) and got[2].shape == (256, 128)
    assert not got[0][100:].view(torch.uint8).any() and (got[1][100:] == 1).all()
    assert not got[2][:, 100:].view(torch.uint8).any()
    assert_fp8_equal(got[0][:100], plain[0], E4M3)
    assert_fp8_equal(got[2][:, :100].contiguous(), plain[2], E4M3)
    assert torch.equal(got[1][:100], plain[1]) and torch.equal(got[3], plain[3]) and torch.equal(got[4], plain[4])


def test_launcher_errors():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, dy = _inputs("gelu", 4, 192, torch.float32, dev)
    with pytest.raises(ValueError, match="multiple of 128"):
        act_fwd_1x128(x, "gelu", E4M3)
    with pytest.raises(ValueError, match=r"half the last dim.*multiple of 128"):
        act_fwd_1x128(x, "swiglu", E4M3)
    x, dy = _inputs("gelu", 4, 128, torch.float32, dev)
    with pytest.raises(ValueError, match="activation must be one of"):
        act_fwd_1x128(x, "tanh", E4M3)
    with pytest.raises(TypeError, match="fp8_dtype"):
        act_fwd_1x128(x, "gelu", torch.int8)
    with pytest.raises(TypeError, match="same dtype"):
        act_bwd_1x128(dy.bfloat16(), x, "gelu", E4M3)
    with pytest.raises(ValueError, match="does not match"):
        act_bwd_1x128(dy[:2], x, "gelu", E4M3)
