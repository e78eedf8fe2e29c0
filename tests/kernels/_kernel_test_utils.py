"""Helpers shared by the kernel tests: devices, random inputs, FP8 bit comparisons."""

import os

import pytest
import torch

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
HP_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _device_params():
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    cpu_marks = [] if interp else [pytest.mark.skip(reason="CPU runs need TRITON_INTERPRET=1 (GPU present)")]
    cuda_marks = [] if torch.cuda.is_available() else [pytest.mark.skip(reason="no CUDA device")]
    return [pytest.param("cpu", marks=cpu_marks), pytest.param("cuda", marks=cuda_marks)]


DEVICES = _device_params()


def randn(shape, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def fp8_is_nan(bits: torch.Tensor, fp8_dtype) -> torch.Tensor:
    b = bits.view(torch.uint8) & 0x7F
    return b == 0x7F if fp8_dtype == torch.float8_e4m3fn else b > 0x7C


def assert_fp8_equal(a: torch.Tensor, b: torch.Tensor, fp8_dtype):
    """Bit-identical FP8 tensors, except that any two NaN encodings count as equal (the GPU's hardware conversion
    may drop a NaN's sign; torch keeps it)."""
    assert a.dtype == b.dtype == fp8_dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    ua, ub = a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()
    na, nb = fp8_is_nan(ua, fp8_dtype), fp8_is_nan(ub, fp8_dtype)
    assert torch.equal(na, nb), "NaN positions differ"
    bad = (ua != ub) & ~na
    assert not bad.any(), f"{int(bad.sum())} of {ua.numel()} FP8 codes differ, e.g. {ua[bad][:5]} vs {ub[bad][:5]}"


def assert_fp8_close(a: torch.Tensor, b: torch.Tensor, fp8_dtype, min_equal=0.99):
    """For FP8 of values computed with transcendental / reduction math that may differ by a few fp32 ulps between
    the kernel and the reference: codes differ by at most one step (same sign; +-0 count as equal), and at least
    ``min_equal`` of them are identical (a flip needs a value within a few ulps of a rounding midpoint)."""
    assert a.dtype == b.dtype == fp8_dtype and a.shape == b.shape
    fa, fb = a.float().cpu(), b.float().cpu()
    assert torch.equal(fa.isnan(), fb.isnan())
    ua, ub = a.view(torch.uint8).cpu().int(), b.view(torch.uint8).cpu().int()
    zero_a, zero_b = (ua & 0x7F) == 0, (ub & 0x7F) == 0
    ua = torch.where(zero_a, 0, ua)
    ub = torch.where(zero_b, 0, ub)
    # signed code position: monotonic in the value, one step = one FP8 ulp (crossing zero included)
    pa = torch.where(ua >= 128, -(ua - 128), ua)
    pb = torch.where(ub >= 128, -(ub - 128), ub)
    diff = (pa - pb).abs()[~fa.isnan()]
    assert diff.numel() == 0 or diff.max() <= 1, f"FP8 codes differ by up to {int(diff.max())} steps"
    if diff.numel():
        assert (diff == 0).float().mean() >= min_equal, f"only {(diff == 0).float().mean():.4f} identical"


def dtype_rtol(dtype):
    """One unit in the last place, relative, of a high-precision dtype (outputs are rounded once to it)."""
    return {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2e-6}[dtype]
