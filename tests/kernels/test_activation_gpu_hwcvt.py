"""CUDA only: the hardware FP8 conversion inside the activation passes that write a transposed FP8 copy.

The GELU / ReLU forward with ``transpose=True`` and the backward ``*_bwd_cast_transpose`` run 64 x 128 tiles and use
the hardware conversion (``cvt.rn.satfinite``) for 16-bit inputs on full tiles, the exact integer emulation
elsewhere: inside tiled transposing kernels the hardware conversion wrote wrong bytes in some configurations on
H200 / Triton 3.6 (see ``fp8engine.kernels._common.emulate_fp8_cvt``). Here every pass runs on the same bf16 inputs
(full tiles: 8192 x 16384, the FFN activation of the measured TransformerLayer, and 1024 x 4096) twice: with the
hardware conversion, and with FP8ENGINE_EMULATE_FP8_CVT=1 (the emulation, bit-identical to torch on every input,
tests/kernels/test_fp8_conversion.py). The fp32 math is the same code in both compiled variants, so every FP8 byte
of both layouts must be identical; both are also compared with the plain-PyTorch reference (ReLU: identical bytes;
GELU: within one FP8 step and >= 99 % identical, since the GPU's exp differs from torch's by ulps, as in
test_activation.py). Inputs are randn * 3 with a scale that maps 8.0 to fp8_max, so the tails saturate.

The comparisons run on the GPU (the tensors have up to 134 M elements).
"""

import os

import pytest
import torch
from _kernel_test_utils import FP8_DTYPES, FP8_MAX

from fp8engine.kernels import activation as act
from fp8engine.kernels import kernels_available


def _skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (tests the hardware FP8 conversion of the compiled kernels)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "needs the compiled kernels; TRITON_INTERPRET=1 is set"
    if not kernels_available("cuda"):
        return "needs Triton"
    if torch.cuda.get_device_capability() < (8, 9):
        return "needs sm_89+ for the hardware FP8 conversion"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")

ENV = "FP8ENGINE_EMULATE_FP8_CVT"
SHAPES = [(8192, 16384), (1024, 4096)]
ACT_IDS = {"gelu": act._GELU, "relu": act._RELU}
#: largest finite FP8 code with the sign bit masked off (E4M3 448 = 0x7e, E5M2 57344 = 0x7b)
MAX_CODE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}


def _randn(shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * 3.0).to(torch.bfloat16)


def _scale(fp8_dtype):
    # |value| > 8 saturates: about 0.4 % of the GELU outputs / gradients (randn * 3 tails)
    return torch.tensor([FP8_MAX[fp8_dtype] / 8.0], device="cuda")


def _hw_then_emulated(monkeypatch, name, x, run):
    """``(run() with the hardware conversion, run() with FP8ENGINE_EMULATE_FP8_CVT=1)``; checks that the launcher
    really picks each path for ``x`` (it reads the variable at launch time)."""
    x2 = x.reshape(-1, x.shape[-1])
    monkeypatch.delenv(ENV, raising=False)
    assert not act._tiled_emulate(x2, ACT_IDS[name]), "expected the hardware-conversion path for this input"
    hw = run()
    monkeypatch.setenv(ENV, "1")
    assert act._tiled_emulate(x2, ACT_IDS[name])
    emulated = run()
    monkeypatch.delenv(ENV)
    torch.cuda.synchronize()
    return hw, emulated


def _assert_bytes_equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    ua, ub = a.view(torch.uint8), b.view(torch.uint8)
    bad = ua != ub
    n_bad = int(bad.sum())
    assert n_bad == 0, (f"{what}: {n_bad} of {ua.numel()} FP8 bytes differ, e.g. at {bad.nonzero()[:5].tolist()}: "
                        f"{ua[bad][:5].tolist()} vs {ub[bad][:5].tolist()}")


def _assert_close_to_reference(name, got, ref, what):
    """ReLU: identical bytes. GELU: codes at most one FP8 step apart (+-0 equal), >= 99 % identical."""
    if name == "relu":
        _assert_bytes_equal(got, ref, what)
        return
    assert got.dtype == ref.dtype and got.shape == ref.shape, (what, got.shape, ref.shape)
    ua, ub = got.view(torch.uint8).int(), ref.view(torch.uint8).int()
    # signed code position: monotonic in the value, one step = one FP8 ulp, -0 (0x80) and +0 both at 0
    pa = torch.where(ua >= 128, 128 - ua, ua)
    pb = torch.where(ub >= 128, 128 - ub, ub)
    diff = (pa - pb).abs()
    assert int(diff.max()) <= 1, f"{what}: FP8 codes differ from the reference by up to {int(diff.max())} steps"
    equal = int((diff == 0).sum()) / diff.numel()
    assert equal >= 0.99, f"{what}: only {equal:.4f} of the codes equal the reference"


def _assert_saturates(data, fp8_dtype, what):
    # the saturating branch is exercised (else the scale is too small for the test to mean much)
    assert bool(((data.view(torch.uint8) & 0x7F) == MAX_CODE[fp8_dtype]).any()), f"{what}: nothing saturated"


def _assert_transposes(data, data_t, what):
    m = data.numel() // data.shape[-1]
    assert data_t.shape == (data.shape[-1], m), (what, data_t.shape)
    assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).reshape(m, -1).t()), what


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", SHAPES, ids=["8192x16384", "1024x4096"])
@pytest.mark.parametrize("name", ["gelu", "relu"])
def test_fwd_transpose_hw_cvt_matches_emulation(name, shape, fp8_dtype, monkeypatch):
    fwd, fwd_ref = getattr(act, f"{name}_fwd"), getattr(act, f"{name}_fwd_reference")
    x = _randn(shape, seed=1)
    scale = _scale(fp8_dtype)

    def run():
        amax = torch.zeros(1, device="cuda")
        _, y8, y8_t, _ = fwd(x, scale=scale, fp8_dtype=fp8_dtype, amax_out=amax, transpose=True)
        return y8, y8_t, amax

    (hw8, hw8_t, hw_amax), (em8, em8_t, em_amax) = _hw_then_emulated(monkeypatch, name, x, run)
    _assert_bytes_equal(hw8, em8, "row-major, hardware vs emulated conversion")
    _assert_bytes_equal(hw8_t, em8_t, "transposed, hardware vs emulated conversion")
    torch.testing.assert_close(hw_amax, em_amax, rtol=0, atol=0)
    _assert_transposes(hw8, hw8_t, "hardware conversion")
    _assert_saturates(hw8, fp8_dtype, "forward")
    _, ref8, ref8_t, _ = fwd_ref(x, scale=scale, fp8_dtype=fp8_dtype, transpose=True)
    _assert_close_to_reference(name, hw8, ref8, "row-major vs reference")
    _assert_close_to_reference(name, hw8_t, ref8_t, "transposed vs reference")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", SHAPES, ids=["8192x16384", "1024x4096"])
@pytest.mark.parametrize("name", ["gelu", "relu"])
def test_bwd_cast_transpose_hw_cvt_matches_emulation(name, shape, fp8_dtype, monkeypatch):
    bwd, bwd_ref = getattr(act, f"{name}_bwd_cast_transpose"), getattr(act, f"{name}_bwd_cast_transpose_reference")
    x, dy = _randn(shape, seed=2), _randn(shape, seed=3)
    scale = _scale(fp8_dtype)

    def run():
        amax = torch.zeros(1, device="cuda")
        dx8, dx8_t, _, dbias = bwd(dy, x, scale, fp8_dtype, amax)
        return dx8, dx8_t, amax, dbias

    (hw8, hw8_t, hw_amax, hw_db), (em8, em8_t, em_amax, _) = _hw_then_emulated(monkeypatch, name, x, run)
    _assert_bytes_equal(hw8, em8, "row-major, hardware vs emulated conversion")
    _assert_bytes_equal(hw8_t, em8_t, "transposed, hardware vs emulated conversion")
    torch.testing.assert_close(hw_amax, em_amax, rtol=0, atol=0)
    _assert_transposes(hw8, hw8_t, "hardware conversion")
    _assert_saturates(hw8, fp8_dtype, "backward")
    # dbias is deterministic: the same launch again gives the same bits (fixed-order two-stage reduction)
    assert torch.equal(run()[3], hw_db)
    ref8, ref8_t, _, ref_db = bwd_ref(dy, x, scale, fp8_dtype)
    _assert_close_to_reference(name, hw8, ref8, "row-major vs reference")
    _assert_close_to_reference(name, hw8_t, ref8_t, "transposed vs reference")
    # dbias: fp32 column sums in another order, then one bf16 rounding (as in test_activation.py)
    atol = 1e-5 * act._act_bwd_math(dy, x, ACT_IDS[name]).abs().sum(0).max().item() + 1e-6
    torch.testing.assert_close(hw_db.float(), ref_db.float(), rtol=2**-7, atol=atol)
