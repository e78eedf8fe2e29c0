"""fc1 fprop with GELU in cuBLASLt's epilogue (``fp8_gemm_bias_gelu`` / ``cublaslt.scaled_mm_bias_gelu``): the
formula, the FP8 output, the pre-activation, the amax, and the MLP op with and without it. GPU only, except the
fallback and error checks."""
import math

import pytest
import torch

import fp8engine as fe
from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.kernels import cublaslt
from fp8engine.ops.gemm import fp8_gemm, fp8_gemm_bias_gelu
from fp8engine.ops.mlp import MLP_ROLES, fc1_fprop_act, fp8_mlp
from fp8engine.fp8.state import ScalingState
from tests.conftest import sqnr
from tests.kernels._kernel_test_utils import assert_fp8_close

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuBLASLt GELU epilogue needs a GPU")
E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16

from fp8engine.fp8.autocast import FP8Context
from fp8engine.fp8.quantizer import get_quantizers


def _quantizers(state):
    """fc1's and fc2's LinearQuantizers of ``state`` under delayed scaling (HYBRID), amaxes recorded."""
    return get_quantizers(state, FP8Context(fe.DelayedScaling(amax_history_len=state.amax_history.shape[1])))


def _gelu64(x, approximate):
    return torch.nn.functional.gelu(x.double(), approximate=approximate)


def _exact_operands(values: torch.Tensor, device):
    """a = values (exact in E4M3) [M, 64], b = identity [64, 64]: the GEMM's fp32 result is ``values`` exactly."""
    a = Float8Tensor(values.to(E4M3).to(device), torch.ones(1, device=device), BF16)
    b = Float8Tensor(torch.eye(64).to(E4M3).to(device), torch.ones(1, device=device), BF16)
    return a, b


def _fp8_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many E4M3 code points apart two same-signed FP8 tensors are, elementwise (``assert_fp8_close`` checks
    <= 1; this counts the larger distances to erf-GELU)."""
    return ((a.view(torch.uint8) & 0x7F).int() - (b.view(torch.uint8) & 0x7F).int()).abs()


@cuda
def test_epilogue_is_gelu_tanh():
    # Inputs in the negative tail [-3.5, -2.5], where tanh-GELU and erf-GELU differ by 3-33 % (gelu(-3): -0.00362
    # vs -0.00405; below -3.5 the tanh form loses digits in fp32 to 1 + tanh(u) ~ 0), scaled into E4M3's normal
    # range. The FP8 output must be tanh-GELU rounded to E4M3, give or take one code point (GELU evaluated in fp32
    # before the rounding), and several code points away from erf-GELU somewhere (E4M3 steps are 6-12 %).
    g = torch.Generator().manual_seed(0)
    values = (-2.5 - torch.rand(128, 64, generator=g)).to(E4M3).float()
    a, b = _exact_operands(values, "cuda")
    scale = torch.full((1,), 2.0 ** 14, device="cuda")  # |gelu| <= 0.0156 -> <= 256 in FP8 units
    amax = torch.zeros(1, device="cuda")
    h, y = fp8_gemm_bias_gelu(a, b, torch.zeros(64, device="cuda"), BF16, scale, E4M3, amax)
    torch.testing.assert_close(h.float(), values.cuda(), rtol=0, atol=0)  # the aux output is the pre-activation
    got = y.data.cpu()
    tanh8 = (_gelu64(values, "tanh") * 2.0 ** 14).to(E4M3)
    erf8 = (_gelu64(values, "none") * 2.0 ** 14).to(E4M3)
    assert_fp8_close(got, tanh8, E4M3, min_equal=0.0)  # every code within one step of tanh-GELU's
    assert _fp8_steps(got, erf8).max().item() >= 3
    # amax: max |gelu| over the fp32 values cuBLASLt computed (relative 1e-4: fp32 evaluation of tanh)
    assert math.isclose(amax.item(), _gelu64(values, "tanh").abs().max().item(), rel_tol=1e-4)


@cuda
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [8192, 1151], ids=["m8192", "m1151"])
def test_matches_gemm_then_activation(m, dtype):
    # Against the unfused path (_scaled_mm with the bias epilogue, then the Triton GELU kernel on the bf16 h):
    # h bit-identical (same GEMM and bias rounding: H200, tools/gelu_epilogue_variants.py@d6af129), the FP8 activation
    # within one E4M3 step where it differs (GELU of the fp32 vs of the bf16-rounded h; ~2 % of the bytes on H200),
    # both equally close to float64 GELU of h, and the amax recorded by max-accumulation into the history slot.
    g = torch.Generator().manual_seed(1)
    k, n = 256, 512
    x = fe.quantize_current(torch.randn(m, k, generator=g).cuda(), E4M3)
    w = fe.quantize_current((torch.randn(n, k, generator=g) * k ** -0.5).cuda(), E4M3)
    bias = (torch.randn(n, generator=g) * 0.5).to(dtype).cuda()
    state = ScalingState(MLP_ROLES, device="cuda")
    state.scale[3] = 100.0
    state.amax_history[3, 0] = 1e-3  # an amax recorded earlier in this step must be max-accumulated, not lost
    h_ref = fp8_gemm(x, w, dtype, bias=bias, use_fast_accum=True)
    h, y = fc1_fprop_act(x, w, bias, dtype, "gelu", _quantizers(state)[1].input, transpose=True,
                         gelu_epilogue=True)
    assert state.amax_history[3, 0].item() > 1e-3
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    ref_state = ScalingState(MLP_ROLES, device="cuda")
    ref_state.scale[3] = 100.0
    _, y_ref = fc1_fprop_act(x, w, bias, dtype, "gelu", _quantizers(ref_state)[1].input, transpose=True,
                             gelu_epilogue=False)
    assert torch.equal(y.scale_inv, y_ref.scale_inv)  # 1 / scale by IEEE division on both paths
    gelu = _gelu64(h_ref.float(), "tanh")
    assert sqnr(gelu, y.dequantize(torch.float64)) >= sqnr(gelu, y_ref.dequantize(torch.float64)) - 0.5
    # differences are isolated one-step roundings (measured 97.6 % equal at H200 scale; +-0 count as equal)
    assert_fp8_close(y.data, y_ref.data, E4M3, min_equal=0.9)
    torch.testing.assert_close(state.amax_history[3, 0], ref_state.amax_history[3, 0], rtol=1e-2, atol=0)
    torch.testing.assert_close(y.transpose_2d(), y.data.t(), rtol=0, atol=0)


@cuda
def test_mlp_op_with_and_without_epilogue():
    # The whole MLP op, forward and backward: the two paths differ only by the FP8 rounding of a few activation
    # values, so outputs and gradients agree to >= 30 dB with each other (FP8 noise alone is ~30 dB against
    # float64, so a wrong epilogue -- erf, missing bias, wrong scale -- lands far below), and the plan cache shows
    # the epilogue ran.
    g = torch.Generator().manual_seed(2)
    m, h, f = 512, 256, 1024
    x = torch.randn(m, h, generator=g).to(BF16).cuda()
    params = [torch.randn(f, h, generator=g) * h ** -0.5, torch.randn(f, generator=g) * 0.5,
              torch.randn(h, f, generator=g) * f ** -0.5, torch.randn(h, generator=g) * 0.5]
    dy = torch.randn(m, h, generator=g).to(BF16).cuda()
    outs = []
    for epilogue in (True, False):
        state = ScalingState(MLP_ROLES, device="cuda")
        state.scale.fill_(16.0)
        xi = x.clone().requires_grad_()
        ps = [p.to(BF16).cuda().requires_grad_() for p in params]
        y = fp8_mlp(xi, *ps, "gelu", *_quantizers(state), gelu_epilogue=epilogue)
        y.backward(dy)
        outs.append([y.detach(), xi.grad] + [p.grad for p in ps])
    for i, (u, v) in enumerate(zip(*outs)):
        assert sqnr(v.double(), u.double()) >= 30.0, i
    assert any(key[-2] == cublaslt._EPILOGUE_GELU_AUX_BIAS for key in cublaslt._get_context().plans)


def test_the_default_asks_for_the_epilogue_by_the_outputs_size(monkeypatch):
    # gelu_epilogue=None (the modules' default): the epilogue where fc1's output has >= 2^27 elements (where it
    # saves GPU time), the GEMM + activation kernel below (fewer host ops); True / False force either
    from fp8engine.ops import mlp

    assert mlp.GELU_EPILOGUE_MIN_ELEMENTS == 1 << 27
    assert mlp.use_gelu_epilogue(None, 8192, 16384) and not mlp.use_gelu_epilogue(None, 8192, 8192)
    assert mlp.use_gelu_epilogue(True, 1, 16) and not mlp.use_gelu_epilogue(False, 8192, 16384)
    if not torch.cuda.is_available():
        return
    calls = []
    real = cublaslt.scaled_mm_bias_gelu
    monkeypatch.setattr(cublaslt, "scaled_mm_bias_gelu", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(5)
    x = fe.quantize_current((torch.randn(128, 64, generator=g)).cuda(), E4M3)
    w = fe.quantize_current((torch.randn(256, 64, generator=g) * 0.125).cuda(), E4M3)
    bias = torch.zeros(256, dtype=BF16, device="cuda")
    state = ScalingState(MLP_ROLES, device="cuda")
    q = _quantizers(state)[1].input
    fc1_fprop_act(x, w, bias, BF16, "gelu", q, transpose=True)
    assert calls == []  # 128 x 256: below the threshold
    monkeypatch.setattr(mlp, "GELU_EPILOGUE_MIN_ELEMENTS", 128 * 256)
    fc1_fprop_act(x, w, bias, BF16, "gelu", q, transpose=True)
    assert calls == [1]


def test_falls_back_where_the_epilogue_cannot_run():
    # CPU tensors (and any case the cuBLASLt path cannot take) return None: the caller runs the GEMM + kernel.
    a, b = _exact_operands(torch.randn(32, 64), "cpu")
    scale, amax = torch.ones(1), torch.zeros(1)
    assert fp8_gemm_bias_gelu(a, b, torch.zeros(64), BF16, scale, E4M3, amax) is None
    assert amax.item() == 0.0  # nothing recorded
    if torch.cuda.is_available():  # no tokens: nothing for cuBLASLt to do, and its amax would be unwritten
        a0, b = _exact_operands(torch.randn(0, 64), "cuda")
        assert fp8_gemm_bias_gelu(a0, b, torch.zeros(64, device="cuda"), BF16, scale.cuda(), E4M3,
                                  amax.cuda()) is None
    if torch.cuda.is_available():  # fp32 activations: cuBLASLt's GELU aux output would be fp32 -> not this path
        a, b = _exact_operands(torch.randn(32, 64), "cuda")
        assert fp8_gemm_bias_gelu(a, b, torch.zeros(64, device="cuda"), torch.float32, scale.cuda(), E4M3,
                                  amax.cuda()) is None


@cuda
def test_scaled_mm_bias_gelu_errors():
    a, b = _exact_operands(torch.randn(32, 64), "cuda")
    one = torch.ones(1, device="cuda")
    bias, aux = torch.zeros(64, dtype=BF16, device="cuda"), torch.empty(32, 64, dtype=BF16, device="cuda")
    out = torch.empty(32, 64, dtype=E4M3, device="cuda")
    with pytest.raises(TypeError, match="FP8 out"):
        cublaslt.scaled_mm_bias_gelu(a.data, one, b.data, one, bias, aux.clone(), aux, one, one)
    with pytest.raises(ValueError, match="bias \\[64\\]"):
        cublaslt.scaled_mm_bias_gelu(a.data, one, b.data, one, bias[:48], out, aux, one, one)
    with pytest.raises(ValueError, match="amax must be a 1-element float32"):
        cublaslt.scaled_mm_bias_gelu(a.data, one, b.data, one, bias, out, aux, one, torch.ones(2, device="cuda"))
