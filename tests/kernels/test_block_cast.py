"""The block cast kernels (1 x 128 tiles with the re-tiled transpose, 128 x 128 blocks) against their plain-PyTorch
references: identical FP8 bits, identical scale_inv values and layouts (strides), on random data with planted zero,
inf and NaN tiles and on odd shapes (partial edge tiles)."""
import pytest
import torch

from fp8engine.kernels.block_cast import (
    BLOCK,
    cast_1x128,
    cast_1x128_dbias,
    cast_1x128_dbias_reference,
    cast_1x128_reference,
    cast_128x128,
    cast_128x128_reference,
)

from _kernel_test_utils import DEVICES, FP8_DTYPES, assert_fp8_equal

CASTS = [pytest.param(cast_1x128, cast_1x128_reference, id="1x128"),
         pytest.param(cast_128x128, cast_128x128_reference, id="128x128")]


def _data(shape, dtype, seed=0):
    """Values spread over ~8 binades (log-normal magnitudes), so tiles get different scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2.0)
    return x.to(dtype)


def _assert_same(got, want, fp8_dtype):
    data, sinv, data_t, sinv_t = got
    r_data, r_sinv, r_data_t, r_sinv_t = want
    assert_fp8_equal(data, r_data.to(data.device), fp8_dtype)
    assert sinv.stride() == r_sinv.stride() and torch.equal(sinv.cpu(), r_sinv), "scale_inv differs"
    assert (data_t is None) == (r_data_t is None)
    if data_t is not None:
        assert_fp8_equal(data_t, r_data_t.to(data_t.device), fp8_dtype)
        assert sinv_t.stride() == r_sinv_t.stride() and torch.equal(sinv_t.cpu(), r_sinv_t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cast,reference", CASTS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 70, 130)])
def test_kernel_matches_reference(device, cast, reference, fp8_dtype, shape):
    x = _data(shape, torch.bfloat16)
    for power_2_scale in (True, False):
        for transpose in (False, True):
            got = cast(x.to(device), fp8_dtype, power_2_scale=power_2_scale, transpose=transpose)
            _assert_same(got, reference(x, fp8_dtype, power_2_scale=power_2_scale, transpose=transpose), fp8_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cast,reference", CASTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_special_tiles(device, cast, reference, dtype):
    """A zero tile, a tile with inf, a tile with NaN, a tile of tiny subnormal-range values: scale 1 where the
    amax is 0 or not finite (the data saturates / stays NaN), the largest fp32 scale where fp8_max/amax overflows."""
    x = _data((256, 256), dtype, seed=1)
    x[:128, :128] = 0
    x[5, 130] = float("inf")
    x[140, 7] = float("nan")
    x[200:, 200:] = 1e-30 if dtype == torch.float32 else 1e-7
    fp8 = torch.float8_e4m3fn
    got = cast(x.to(device), fp8, transpose=True)
    want = reference(x, fp8, transpose=True)
    _assert_same(got, want, fp8)
    sinv = want[1]
    if cast is cast_1x128:
        assert sinv[0, 0] == 1 and sinv[5, 1] == 1 and sinv[140, 0] == 1
    else:
        assert sinv[0, 0] == 1 and sinv[0, 1] == 1 and sinv[1, 0] == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 70, 130)])
def test_dbias_cast_matches_reference(device, dtype, shape):
    """cast_1x128_dbias: the four outputs bit for bit those of cast_1x128 (so of the reference), and the column sums
    of x. The kernel sums each 128-row tile in fp32 then the tiles, another order than torch's sum: against the
    float64 sum the fp32 result is within the recursive-summation bound n * 2**-24 * sum|x| (Higham, Accuracy and
    Stability of Numerical Algorithms, §4.2; n the rows), and in bf16 also one bf16 ulp of the result (both round
    an fp32 value within that bound)."""
    x = _data(shape, dtype, seed=4)
    for transpose in (False, True):
        got = cast_1x128_dbias(x.to(device), torch.float8_e4m3fn, transpose=transpose)
        want = cast_1x128_dbias_reference(x, torch.float8_e4m3fn, transpose=transpose)
        _assert_same(got[:4], want[:4], torch.float8_e4m3fn)
        plain = cast_1x128(x.to(device), torch.float8_e4m3fn, transpose=transpose)
        _assert_same(got[:4], tuple(None if t is None else t.cpu() for t in plain), torch.float8_e4m3fn)
        db = got[4].cpu()
        assert db.dtype == dtype and db.shape == (shape[-1],)
        x2 = x.reshape(-1, shape[-1]).double()
        exact, bound = x2.sum(0), x2.shape[0] * 2.0 ** -24 * x2.abs().sum(0)
        if dtype == torch.float32:
            assert torch.all((db.double() - exact).abs() <= bound)
        else:
            ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
            assert torch.all((db.double() - exact).abs() <= 2 * ulp + bound)


def test_dbias_cast_of_no_rows():
    """M = 0: no tile is summed; the bias gradient is zeros (and the casts are empty)."""
    x = torch.empty((0, 256), dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    out = cast_1x128_dbias(x, torch.float8_e4m3fn)
    assert out[0].shape == (0, 256) and torch.equal(out[4].cpu(), torch.zeros(256, dtype=torch.bfloat16))


def test_scale_layouts():
    """1 x 128: [M, K/128] stored M-major (strides (1, M)); re-tiled transpose [K, M/128] strides (1, K).
    128 x 128: [M/128, K/128] row-major and its transpose."""
    x = _data((256, 384), torch.float32)
    _, s, dt, st = cast_1x128_reference(x, torch.float8_e4m3fn, transpose=True)
    assert s.shape == (256, 3) and s.stride() == (1, 256)
    assert dt.shape == (384, 256) and st.shape == (384, 2) and st.stride() == (1, 384)
    _, s, dt, st = cast_128x128_reference(x, torch.float8_e4m3fn, transpose=True)
    assert s.shape == (2, 3) and s.is_contiguous() and torch.equal(st, s.t())
    assert BLOCK == 128


def test_retiled_transpose_is_a_cast_of_the_transpose():
    """The re-tiled transposed output is exactly the 1 x 128 cast of x^T (new scales along the other dim), not the
    forward tiles transposed."""
    x = _data((256, 384), torch.bfloat16, seed=3)
    _, s, data_t, s_t = cast_1x128_reference(x, torch.float8_e4m3fn, transpose=True)
    d2, s2, _, _ = cast_1x128_reference(x.t().contiguous(), torch.float8_e4m3fn)
    assert_fp8_equal(data_t, d2, torch.float8_e4m3fn)
    assert torch.equal(s_t, s2)
    assert s_t.shape != s.t().shape  # [384, 2] vs [3, 256]: the tiles really are different


@pytest.mark.parametrize("cast", [cast_1x128, cast_128x128])
def test_launcher_errors(cast):
    # on a device the kernels run on (CPU only under TRITON_INTERPRET=1), so the checks under test are reached
    x = _data((128, 256), torch.float32).to("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(TypeError, match="fp8_dtype"):
        cast(x, torch.int8)
    with pytest.raises(TypeError, match="dtype"):
        cast(x.double(), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="contiguous"):
        cast(x.t(), torch.float8_e4m3fn)
