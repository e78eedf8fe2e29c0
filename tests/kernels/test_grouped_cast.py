"""Grouped cast-transpose (a layer's weights in one launch) against the per-tensor reference: identical FP8 bits
(transposed copy included), scale_inv and amax, for mixed shapes (partial tiles -> emulated conversion) and full
64 x 128 tiles of 16-bit inputs (the hardware conversion on GPU)."""

import pytest
import torch
from _kernel_test_utils import DEVICES, FP8_DTYPES, FP8_MAX, HP_DTYPES, assert_fp8_equal, randn

from fp8engine.kernels.cast import grouped_cast_transpose, grouped_cast_transpose_reference

MIXED = [(192, 256), (1151, 24), (33, 48), (16, 16)]
FULL_TILES = [(192, 256), (128, 384), (64, 128)]


def _inputs(shapes, dtype, device, fp8_dtype):
    xs = [randn(s, dtype, device, seed=i, scale=1.5) for i, s in enumerate(shapes)]
    # scales put randn's tails past fp8_max (saturation) and small values into the subnormals
    scales = [torch.tensor([FP8_MAX[fp8_dtype] / (4.0 + i)], device=device) for i in range(len(shapes))]
    return xs, scales


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shapes", [MIXED, FULL_TILES], ids=["mixed", "full_tiles"])
@pytest.mark.parametrize("with_amax", [True, False])
def test_grouped_matches_per_tensor_reference(device, fp8_dtype, dtype, shapes, with_amax):
    xs, scales = _inputs(shapes, dtype, device, fp8_dtype)
    amax = [torch.full((1,), 0.5, device=device) for _ in xs] if with_amax else None
    amax_ref = [a.clone() for a in amax] if with_amax else None
    got = grouped_cast_transpose(xs, scales, fp8_dtype, amax)
    want = grouped_cast_transpose_reference(xs, scales, fp8_dtype, amax_ref)
    for (d, dt, si), (rd, rdt, rsi), x in zip(got, want, xs):
        assert d.shape == x.shape and dt.shape == x.shape[::-1]
        assert_fp8_equal(d, rd, fp8_dtype)
        assert_fp8_equal(dt, rdt, fp8_dtype)
        torch.testing.assert_close(si, rsi, rtol=0, atol=0)  # IEEE 1/scale on both sides
        # torch._scaled_mm / cuBLASLt need 16-byte aligned operands and scales
        assert d.data_ptr() % 16 == 0 and dt.data_ptr() % 16 == 0 and si.data_ptr() % 16 == 0
    if with_amax:
        for a, ra in zip(amax, amax_ref):
            torch.testing.assert_close(a, ra, rtol=0, atol=0)  # max is exact


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_reuses_its_table_and_follows_new_tensors(device):
    fp8 = torch.float8_e4m3fn
    xs, scales = _inputs(MIXED, torch.bfloat16, device, fp8)
    first = grouped_cast_transpose(xs, scales, fp8)
    again = grouped_cast_transpose(xs, scales, fp8)  # cached device table
    for (a, at, _), (b, bt, _) in zip(first, again):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(at.view(torch.uint8), bt.view(torch.uint8))
    # same shapes, other storage: a different table, the new values
    ys = [x * 0.5 for x in xs]
    for (d, _, _), (rd, _, _) in zip(grouped_cast_transpose(ys, scales, fp8),
                                     grouped_cast_transpose_reference(ys, scales, fp8)):
        assert_fp8_equal(d, rd, fp8)
    # tensors at lower addresses than xs[0] (negative offsets from the kernel's base pointer)
    rev = xs[::-1]
    for (d, dt, _), (rd, rdt, _) in zip(grouped_cast_transpose(rev, scales, fp8),
                                        grouped_cast_transpose_reference(rev, scales, fp8)):
        assert_fp8_equal(d, rd, fp8)
        assert_fp8_equal(dt, rdt, fp8)
    # in-place update of the same storage (an optimizer step): the same table, the new values
    xs[0].mul_(2.0)
    d = grouped_cast_transpose(xs, scales, fp8)[0][0]
    assert_fp8_equal(d, grouped_cast_transpose_reference(xs[:1], scales[:1], fp8)[0][0], fp8)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_errors_name_the_problem(device):
    fp8 = torch.float8_e4m3fn
    x = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    s = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="non-empty"):
        grouped_cast_transpose([], [], fp8)
    with pytest.raises(ValueError, match="one scale"):
        grouped_cast_transpose([x, x], [s], fp8)
    with pytest.raises(TypeError, match="dtype"):
        grouped_cast_transpose([x, x.float()], [s, s], fp8)
    with pytest.raises(ValueError, match="2-D"):
        grouped_cast_transpose([x, x.reshape(2, 8, 16)], [s, s], fp8)
    with pytest.raises(TypeError, match="fp8_dtype"):
        grouped_cast_transpose([x], [s], torch.bfloat16)
    with pytest.raises(TypeError):
        grouped_cast_transpose([x], [s.double()], fp8)
