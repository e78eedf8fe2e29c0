"""``kernels._common.sum_partials`` (stage 2 of the kernels' column reductions: dbias, dgamma / dbeta) against float64.

The kernel sums ``[P, N]`` fp32 partials over P in fp32 (a fixed order) and rounds once to the output dtype, so:
its fp32 result is within fp32 summation error of the float64 sum, its bf16 / fp16 result is exactly its own fp32
result rounded once (same additions, one rounding), and a second call gives the same bits.
"""
import pytest
import torch
from _kernel_test_utils import DEVICES, randn
from fp8engine.kernels._common import sum_partials, sum_partials_reference

SHAPES = [(0, 5), (1, 64), (2, 256), (8, 100), (33, 300), (300, 65)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sum_partials_against_float64(device, shape):
    parts = randn(shape, torch.float32, device, seed=shape[0] + shape[1], scale=3.0)
    got = sum_partials(parts, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (shape[1],)
    exact = parts.double().sum(0).cpu()
    # fp32 summation of P terms: error at most P * 2^-24 * sum |x| (the standard recursive-summation bound)
    bound = shape[0] * 2.0 ** -24 * parts.double().abs().sum(0).cpu() + 1e-30
    assert ((got.double().cpu() - exact).abs() <= bound).all()
    ref = sum_partials_reference(parts, torch.float32)  # torch's order: the same bound
    assert ((ref.double().cpu() - exact).abs() <= bound).all()
    assert torch.equal(sum_partials(parts, torch.float32), got), "the reduction must be deterministic"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sum_partials_rounds_once(device, dtype):
    parts = randn((37, 200), torch.float32, device, seed=3)
    got = sum_partials(parts, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, sum_partials(parts, torch.float32).to(dtype))  # exact: one rounding of the fp32 sum


@pytest.mark.parametrize("device", DEVICES)
def test_sum_partials_propagates_nan_and_inf(device):
    parts = torch.zeros(4, 3, device=device)
    parts[1, 0], parts[2, 1] = float("nan"), float("inf")
    got = sum_partials(parts, torch.bfloat16).float().cpu()
    assert got[0].isnan() and got[1] == float("inf") and got[2] == 0
