"""The FP8 conversion inside every kernel is bit-identical to torch's saturating cast (round to nearest even).

Under TRITON_INTERPRET the kernels use an integer emulation (the interpreter's own float->fp8 conversion does not
round to nearest even, see fp8engine/kernels/_common.py); on CUDA the hardware conversion, and the emulation when
FP8ENGINE_EMULATE_FP8_CVT=1, and in the tiled kernels that also write the transposed copy the inline-PTX
conversion. All are checked against torch on every bf16 / fp16 bit pattern and on the rounding ties between
adjacent FP8 values.
"""

import subprocess
import sys

import pytest
import torch
from _kernel_test_utils import DEVICES, FP8_DTYPES, assert_fp8_equal

from fp8engine.kernels import kernels_available
from fp8engine.kernels.cast import cast_to_fp8, cast_to_fp8_reference


def _emulate_params(device):
    return [False, True] if device == "cuda" else [True]


def _all_patterns(dtype):
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()


def _ties(fp8_dtype):
    """Midpoints between adjacent finite FP8 values (positive and negative), and one fp32 ulp either side."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    v = v[v.isfinite()].unique().sort().values.double()
    mid = ((v[1:] + v[:-1]) / 2).float()  # exact in fp32 (FP8 has <= 4 significant bits)
    up = torch.nextafter(mid, torch.full_like(mid, float("inf")))
    down = torch.nextafter(mid, torch.full_like(mid, -float("inf")))
    return torch.cat([mid, up, down, v.float()])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 2.0**-9, 3.3, 2.0**17])
def test_every_bit_pattern_matches_torch(device, fp8_dtype, src, scale, monkeypatch):
    x = _all_patterns(src).to(device)  # includes +-0, subnormals, +-inf, NaNs
    s = torch.tensor([scale], device=device)
    want, _, _ = cast_to_fp8_reference(x, s, fp8_dtype)
    for emulate in _emulate_params(device):
        monkeypatch.setenv("FP8ENGINE_EMULATE_FP8_CVT", "1" if emulate else "0")
        got, _, _ = cast_to_fp8(x, s, fp8_dtype)
        assert_fp8_equal(got, want, fp8_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_rounding_ties_and_neighbours_match_torch(device, fp8_dtype, monkeypatch):
    x = _ties(fp8_dtype)
    x = torch.cat([x, -x]).to(device)
    s = torch.ones(1, device=device)
    want, _, _ = cast_to_fp8_reference(x, s, fp8_dtype)
    for emulate in _emulate_params(device):
        monkeypatch.setenv("FP8ENGINE_EMULATE_FP8_CVT", "1" if emulate else "0")
        got, _, _ = cast_to_fp8(x, s, fp8_dtype)
        assert_fp8_equal(got, want, fp8_dtype)
        # exactly equal bits, not only up to NaN: there are no NaNs here
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_kernels_available():
    import os

    interp = os.environ.get("TRITON_INTERPRET") == "1"
    assert kernels_available("cpu") == interp
    assert kernels_available("cuda") == (interp or torch.cuda.is_available())


def test_references_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import fp8engine.kernels as k, fp8engine.kernels.cast as c, fp8engine.kernels.norm as n\n"
        "import fp8engine.kernels.activation as a, fp8engine.kernels.scaling as s\n"
        "assert not k.kernels_available('cpu')\n"
        "d, _, si = c.cast_to_fp8_reference(torch.randn(4, 8), torch.ones(1), torch.float8_e4m3fn)\n"
        "try:\n"
        "    c.cast_to_fp8(torch.randn(4, 8), torch.ones(1), torch.float8_e4m3fn)\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton is not installed' in str(e)\n"
        "else:\n"
        "    raise AssertionError('launch without triton must raise')\n"
    )
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX runs on a GPU only")
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
def test_tiled_ptx_conversion_matches_torch(fp8_dtype, src):
    """The cast-transpose tiles that take the inline-PTX conversion (``fp8_cvt_mode(tiled_transpose=True)``: rows
    of 64 columns, not a multiple of the 128-column tile, and fp32 input): every bf16 / fp16 bit pattern (as
    fp32 for the fp32 case, with the rounding ties of both formats) in both copies, bit-identical to torch."""
    x = _all_patterns(torch.float16 if src == torch.float16 else torch.bfloat16)
    if src == torch.float32:
        ties = torch.cat([_ties(torch.float8_e4m3fn), _ties(torch.float8_e5m2)])
        ties = torch.cat([ties, -ties])
        x = torch.cat([x, ties, torch.zeros(-(x.numel() + ties.numel()) % 64)])
    x = x.to(src).reshape(-1, 64).cuda()
    for scale in (1.0, 2.0**-9, 3.3, 2.0**17):
        s = torch.tensor([scale], device="cuda")
        want, _, _ = cast_to_fp8_reference(x, s, fp8_dtype)
        got, got_t, _ = cast_to_fp8(x, s, fp8_dtype, transpose=True)
        assert_fp8_equal(got, want, fp8_dtype)
        assert_fp8_equal(got_t, want.t().contiguous(), fp8_dtype)
