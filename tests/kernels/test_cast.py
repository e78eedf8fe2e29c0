"""cast_to_fp8 / cast_transpose_dbias / compute_amax against their plain-PyTorch references (exact bits, exact amax
and scale_inv; dbias within one rounding of the output dtype)."""

import pytest
import torch
from _kernel_test_utils import DEVICES, FP8_DTYPES, FP8_MAX, HP_DTYPES, assert_fp8_equal, dtype_rtol, randn

from fp8engine.kernels.cast import (
    cast_to_fp8,
    cast_to_fp8_reference,
    cast_transpose_dbias,
    cast_transpose_dbias_reference,
    compute_amax,
    compute_amax_reference,
)

# (192, 256): full 64 x 128 tiles, where the tiled kernel uses the hardware FP8 conversion for 16-bit inputs.
SHAPES = [(1151, 24), (33, 48), (1, 16), (3, 5, 40), (70,), (192, 256)]


def _scale(device, fp8_dtype):
    # maps |x| ~ 4 (randn * 1.5 tails) close to fp8_max so values saturate, and tiny ones go subnormal
    return torch.tensor([FP8_MAX[fp8_dtype] / 5.0], device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
def test_cast_matches_reference(device, fp8_dtype, dtype, shape, transpose):
    x = randn(shape, dtype, device, seed=len(shape) + shape[0], scale=1.5)
    s = _scale(device, fp8_dtype)
    amax, amax_ref = torch.full((1,), 0.25, device=device), torch.full((1,), 0.25, device=device)
    data, data_t, si = cast_to_fp8(x, s, fp8_dtype, amax, transpose=transpose)
    rdata, rdata_t, rsi = cast_to_fp8_reference(x, s, fp8_dtype, amax_ref, transpose=transpose)
    assert data.shape == x.shape
    assert_fp8_equal(data, rdata, fp8_dtype)
    if transpose:
        assert data_t.shape == (shape[-1], x.numel() // shape[-1])
        assert_fp8_equal(data_t, rdata_t, fp8_dtype)
    else:
        assert data_t is None
    assert si.dtype == torch.float32 and si.shape == (1,)
    torch.testing.assert_close(si, rsi, rtol=0, atol=0)
    torch.testing.assert_close(amax, amax_ref, rtol=0, atol=0)
    assert amax.item() == x.float().abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transpose", [False, True])
def test_amax_never_lowers_larger_value_and_view_target(device, transpose):
    x = randn((65, 24), torch.bfloat16, device, seed=3)
    history = torch.zeros(4, 3, device=device)
    history[2, 0] = 1000.0
    s = torch.ones(1, device=device)
    cast_to_fp8(x, s, torch.float8_e4m3fn, history[2, 0:1], transpose=transpose)
    cast_to_fp8(x, s, torch.float8_e4m3fn, history[1, 0:1], transpose=transpose)
    expected = torch.zeros(4, 3, device=device)
    expected[2, 0] = 1000.0
    expected[1, 0] = x.float().abs().max()
    torch.testing.assert_close(history, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("transpose", [False, True])
def test_nan_inf_saturation(device, fp8_dtype, transpose):
    x = randn((37, 24), torch.float32, device, seed=5)
    x[3, 4], x[7, 0], x[36, 23] = float("nan"), float("inf"), -float("inf")
    x[10, 10] = 1e30  # saturates
    s = torch.full((1,), 2.0, device=device)
    amax = torch.zeros(1, device=device)
    data, data_t, _ = cast_to_fp8(x, s, fp8_dtype, amax, transpose=transpose)
    assert_fp8_equal(data, cast_to_fp8_reference(x, s, fp8_dtype)[0], fp8_dtype)
    f = data.float()
    assert f[3, 4].isnan() and f[7, 0] == FP8_MAX[fp8_dtype] and f[36, 23] == -FP8_MAX[fp8_dtype]
    assert f[10, 10] == FP8_MAX[fp8_dtype]
    assert amax.item() == float("inf")  # documented: NaN counts as +inf


@pytest.mark.parametrize("device", DEVICES)
def test_scale_inv_is_a_new_tensor(device):
    x = randn((8, 16), torch.float16, device)
    s = torch.full((), 4.0, device=device)  # 0-d scale is accepted too
    _, _, si = cast_to_fp8(x, s, torch.float8_e4m3fn)
    assert si.data_ptr() != s.data_ptr()
    s.fill_(8.0)
    assert si.item() == 0.25


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1151, 24), (33, 48), (1, 16), (2, 65, 72)])
def test_cast_transpose_dbias(device, fp8_dtype, dtype, shape):
    g = randn(shape, dtype, device, seed=11, scale=2.0)
    s = _scale(device, fp8_dtype)
    amax, amax_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    data, data_t, si, dbias = cast_transpose_dbias(g, s, fp8_dtype, amax)
    rdata, rdata_t, rsi, rdbias = cast_transpose_dbias_reference(g, s, fp8_dtype, amax_ref)
    assert_fp8_equal(data, rdata, fp8_dtype)
    assert_fp8_equal(data_t, rdata_t, fp8_dtype)
    torch.testing.assert_close(si, rsi, rtol=0, atol=0)
    torch.testing.assert_close(amax, amax_ref, rtol=0, atol=0)
    assert dbias.dtype == dtype and dbias.shape == (shape[-1],)
    # column sums in fp32 in a different order than torch: fp32 error <= rows * 2^-24 * sum|g| (~1e-5 of sum|g|
    # here), then one rounding to the output dtype
    g64 = g.reshape(-1, shape[-1]).double()
    atol = 1e-5 * g64.abs().sum(0).max().item()
    torch.testing.assert_close(dbias.double(), g64.sum(0), rtol=dtype_rtol(dtype), atol=atol)
    torch.testing.assert_close(rdbias.double(), g64.sum(0), rtol=dtype_rtol(dtype), atol=atol)
    again = cast_transpose_dbias(g, s, fp8_dtype)[3]
    assert torch.equal(again, dbias), "dbias must be deterministic"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_compute_amax(device, dtype):
    x = randn((1151, 24), dtype, device, seed=2)
    a, ar = torch.full((1,), 0.5, device=device), torch.full((1,), 0.5, device=device)
    compute_amax(x, a)
    compute_amax_reference(x, ar)
    torch.testing.assert_close(a, ar, rtol=0, atol=0)
    big = torch.full((1,), 99.0, device=device)
    compute_amax(x, big)
    assert big.item() == 99.0
    x[5, 5] = float("nan")
    compute_amax(x, a)
    assert a.item() == float("inf")


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_problem(device):
    x = randn((8, 16), torch.float32, device)
    s = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="contiguous"):
        cast_to_fp8(x.t(), s, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="dtype"):
        cast_to_fp8(x.to(torch.int32), s, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="fp8_dtype"):
        cast_to_fp8(x, s, torch.float16)
    with pytest.raises(TypeError, match="scale"):
        cast_to_fp8(x, s.half(), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="amax_out"):
        cast_to_fp8(x, s, torch.float8_e4m3fn, torch.zeros(2, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(1151, 24), (192, 256), (2, 65, 144), (1, 16)])
def test_transpose_fp8_is_the_byte_transpose(device, fp8_dtype, shape):
    from fp8engine.kernels.cast import transpose_fp8, transpose_fp8_reference

    data = (torch.randn(shape, device=device) * 50).to(fp8_dtype)
    out = transpose_fp8(data)
    assert out.dtype == fp8_dtype and out.shape == (shape[-1], data.numel() // shape[-1])
    assert torch.equal(out.view(torch.uint8), transpose_fp8_reference(data).view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "transpose"])
@pytest.mark.parametrize("amax_value", [3.7, 2.0 ** -140, 0.0, float("inf"), float("nan")],
                         ids=["normal", "subnormal", "zero", "inf", "nan"])
def test_scale_from_amax_matches_current_scale(device, fp8_dtype, transpose, amax_value):
    # current scaling with the scale derived on the device from the amax: the same scale (hence the same bits and
    # scale_inv) as fp8engine.fp8.float8_tensor.current_scale -- fp8_max / amax, 1.0 for 0 / inf / NaN amaxes
    from fp8engine.fp8.float8_tensor import current_scale

    x = randn((70, 48), torch.bfloat16, device, seed=9, scale=1.5)
    amax = torch.full((1,), amax_value, device=device)
    scale = current_scale(amax, fp8_dtype)
    data, data_t, si = cast_to_fp8(x, amax, fp8_dtype, transpose=transpose, scale_from_amax=True)
    rdata, rdata_t, rsi = cast_to_fp8(x, scale, fp8_dtype, transpose=transpose)
    ref = cast_to_fp8_reference(x, amax, fp8_dtype, transpose=transpose, scale_from_amax=True)
    assert_fp8_equal(data, rdata, fp8_dtype)
    assert_fp8_equal(data, ref[0], fp8_dtype)
    torch.testing.assert_close(si, rsi, rtol=0, atol=0)
    torch.testing.assert_close(si, ref[2], rtol=0, atol=0)
    if amax_value in (0.0, float("inf")) or amax_value != amax_value:
        assert si.item() == 1.0
    if transpose:
        assert_fp8_equal(data_t, rdata_t, fp8_dtype)
    dbias_out = cast_transpose_dbias(x, amax, fp8_dtype, scale_from_amax=True)
    assert_fp8_equal(dbias_out[0], rdata, fp8_dtype)
    torch.testing.assert_close(dbias_out[2], rsi, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "transpose"])
def test_an_amax_in_the_inputs_dtype_gives_the_fp32_amaxs_bits(device, dtype, transpose):
    # current scaling passes max|x| as computed in x's dtype (exact: a value of x); the kernels read it as fp32,
    # so data, data_t and scale_inv equal the fp32 amax's, for cast_to_fp8 and cast_transpose_dbias alike
    x = randn((70, 48), dtype, device, seed=4, scale=3.0)
    amax = torch.linalg.vector_norm(x, float("inf"))
    assert amax.dtype == dtype and amax.float() == x.float().abs().max()
    for fn, kw in ((cast_to_fp8, dict(transpose=transpose)), (cast_transpose_dbias, {})):
        got = fn(x, amax, torch.float8_e4m3fn, scale_from_amax=True, **kw)
        ref = fn(x, amax.float().reshape(1), torch.float8_e4m3fn, scale_from_amax=True, **kw)
        for g, r in zip(got, ref):
            if g is None:
                assert r is None
            elif g.dtype == torch.float8_e4m3fn:
                assert_fp8_equal(g, r, torch.float8_e4m3fn)
            else:
                assert torch.equal(g, r)
    with pytest.raises(TypeError, match="scale"):  # an amax of another dtype: refused as before
        cast_to_fp8(x, amax.to(torch.float16 if dtype == torch.bfloat16 else torch.bfloat16),
                    torch.float8_e4m3fn, scale_from_amax=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
def test_dequantize_every_fp8_value(device, fp8_dtype, out_dtype):
    """All 256 bit patterns (normals, subnormals, zeros, NaN, E5M2's infinities), tiled past one block's end, times a
    scale_inv that is not a power of two: the kernel's integer decode and single rounding give the reference's bits
    exactly (NaNs compared as NaN)."""
    from fp8engine.kernels.cast import dequantize_fp8, dequantize_fp8_reference

    data = torch.arange(256, dtype=torch.uint8, device=device).repeat(40).view(fp8_dtype)  # 10240 > one block
    scale_inv = torch.tensor([0.3711], device=device)
    got = dequantize_fp8(data, scale_inv, torch.empty(data.shape, dtype=out_dtype, device=device))
    want = dequantize_fp8_reference(data, scale_inv, torch.empty(data.shape, dtype=out_dtype, device=device))
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok])


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_rejects_bad_arguments(device):
    from fp8engine.kernels.cast import dequantize_fp8

    data = torch.zeros(8, dtype=torch.float8_e4m3fn, device=device)
    with pytest.raises(ValueError, match="as many elements"):
        dequantize_fp8(data, torch.ones(1, device=device), torch.empty(9, device=device))
    with pytest.raises(TypeError, match="1-element float32"):
        dequantize_fp8(data, torch.ones(2, device=device), torch.empty(8, device=device))
