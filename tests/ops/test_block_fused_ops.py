"""The ops under block scaling with the fused kernels (the kernel path, run on CPU under TRITON_INTERPRET=1): the
norm writing the GEMM's 1 x 128 FP8 input (``ops.norm_linear.norm_cast`` with a ``BlockQuantizer`` ->
``fp8_linear(x_fp8=...)``) and the one-node MLP with the activation kernels (``ops.mlp.fp8_mlp``), against the
unfused compositions: bit for bit where the high-precision intermediate is rounded the same way (fp32), against
float64 otherwise."""
import pytest
import torch

from _ops_test_utils import IGNORE_INTERPRETER_WARNINGS, force_kernels  # noqa: F401 (fixture)
from fp8engine.fp8.block_quantizer import block_quantizers_for
from fp8engine.fp8.float8_tensor import use_kernels
from fp8engine.fp8.quantizer import LinearQuantizers
from fp8engine.ops.linear import fp8_linear
from fp8engine.ops.mlp import _unfused_fp8_mlp, act_fwd, fp8_mlp
from fp8engine.ops.norm_linear import norm, norm_cast
from fp8engine.recipe import Float8BlockScaling, Format
from tests.conftest import sqnr

pytestmark = IGNORE_INTERPRETER_WARNINGS


def _quantizers(fmt=Format.E4M3, gemms=1):
    # the backend get_quantizers would give a CPU module here: the kernels under force_kernels(True)
    qs = block_quantizers_for(Float8BlockScaling(fmt), 3 * gemms, use_kernels(torch.zeros(0)))
    return [LinearQuantizers(*qs[3 * g:3 * g + 3]) for g in range(gemms)]


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


def _grads(*ts):
    return [None if t is None else t.grad for t in ts]


def _norm_params(k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(k, generator=g) * 0.5 - 0.25).to(dtype), (torch.randn(k, generator=g) * 0.3).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# norm -> block linear
# ---------------------------------------------------------------------------------------------------------------
def _norm_linear(fused, x, res, nw, nb, w, b, dy, ds, rms, q):
    x, res, nw, nb, w, b = (_leaf(t) for t in (x, res, nw, nb, w, b))
    kw = dict(rms=rms, zero_centered_gamma=True, residual=res)
    if fused:
        ln, x_q, s = norm_cast(x, nw, nb, 1e-5, quantizer=q.input, transpose=True, return_hp=False,
                               return_input=True, **kw)
        y = fp8_linear(ln, w, b, q, x_fp8=x_q)
    else:
        ln, s = norm(x, nw, nb, 1e-5, return_input=True, kernels=q.input.kernels, **kw)
        y = fp8_linear(ln, w, b, q)
    torch.autograd.backward([y, s], [dy, ds])
    return [y] + _grads(x, res, nw, nb, w, b)


@pytest.mark.parametrize("rms", [False, True])
def test_norm_linear_fp32_equals_unfused(force_kernels, rms):
    """fp32, kernel path both ways: the unfused norm kernel writes the fp32 y that the fused kernel casts, so y and
    every gradient (x, residual, norm weight / bias, W, b) are identical. 200 tokens: padded to 256 for the GEMMs."""
    force_kernels(True)
    g = torch.Generator().manual_seed(0)
    x, res, ds = (torch.randn(200, 256, generator=g) for _ in range(3))
    w, b, dy = torch.randn(384, 256, generator=g) / 16, torch.randn(384, generator=g), torch.randn(200, 384,
                                                                                                 generator=g)
    nw, nb = _norm_params(256, torch.float32, 1)
    nb = None if rms else nb
    q = _quantizers()[0]
    got = _norm_linear(True, x, res, nw, nb, w, b, dy, ds, rms, q)
    want = _norm_linear(False, x, res, nw, nb, w, b, dy, ds, rms, q)
    for i, (a, e) in enumerate(zip(got, want)):
        assert (a is None) == (e is None), i
        if a is not None:
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=f"output {i}")


def test_norm_cast_return_hp_and_no_grad(force_kernels):
    """return_hp writes the norm output (as the unfused norm kernel, within an fp32 ulp... here exactly: same math);
    without grad no transposed copy is made; the padded rows of the FP8 copy are zero."""
    force_kernels(True)
    x = torch.randn(3, 50, 128)
    nw, nb = _norm_params(128, torch.float32, 2)
    q = _quantizers()[0].input
    y, qx = norm_cast(x, nw, nb, 1e-5, rms=False, zero_centered_gamma=False, quantizer=q, transpose=False,
                      return_hp=True)
    torch.testing.assert_close(y, norm(x, nw, nb, 1e-5, rms=False, kernels=q.kernels), rtol=0, atol=0)
    assert qx.t_operand() is None and qx.shape == (256, 128) and not qx.data[150:].view(torch.uint8).any()


# ---------------------------------------------------------------------------------------------------------------
# the MLP
# ---------------------------------------------------------------------------------------------------------------
H, FF = 128, 256


def _mlp_inputs(kind, dtype, m=200, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    d = 2 * FF if kind == "swiglu" else FF
    x = torch.randn(m, H, generator=g)
    params = [torch.randn(d, H, generator=g) * H ** -0.5, torch.randn(d, generator=g) * 0.5 if bias else None,
              torch.randn(H, FF, generator=g) * FF ** -0.5, torch.randn(H, generator=g) * 0.5 if bias else None]
    dy = torch.randn(m, H, generator=g)
    return x.to(dtype), [None if p is None else p.to(dtype) for p in params], dy.to(dtype)


def _mlp(x, params, dy, kind, fused, fmt=Format.E4M3, frozen=False, fuse_wgrad=False):
    x = _leaf(x)
    params = [None if p is None else p.detach().clone().requires_grad_(not (frozen and p.dim() == 2))
              for p in params]
    if fuse_wgrad:
        for w in (params[0], params[2]):
            w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    fc1, fc2 = _quantizers(fmt, 2)
    y = (fp8_mlp if fused else _unfused_fp8_mlp)(x, *params, kind, fc1, fc2, fuse_wgrad=fuse_wgrad)
    y.backward(dy)
    grads = [(p.main_grad if fuse_wgrad and p.dim() == 2 else p.grad) if p is not None else None for p in params]
    return [y, x.grad] + grads


def test_mlp_relu_fp32_equals_unfused(force_kernels):
    """ReLU in fp32 is exact in both paths (no rounding of the intermediate, the same 1 x 128 casts), so y, dx, dW1,
    dW2 and db2 are identical to the three-node composition; db1 is an fp32 column sum in another order (the kernel
    sums per 128-row tile): within 1e-5 relative. 200 tokens: padded to 256."""
    force_kernels(True)
    x, params, dy = _mlp_inputs("relu", torch.float32)
    got, want = _mlp(x, params, dy, "relu", True), _mlp(x, params, dy, "relu", False)
    for i in (0, 1, 2, 4, 5):
        torch.testing.assert_close(got[i], want[i], rtol=0, atol=0, msg=f"output {i}")
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5)


# Against float64 (fp32 / bf16 autograd of the same parameters): the MLP thresholds of
# tests/modules/test_block_modules.py (E4M3: y >= 22, grads >= 21 dB; HYBRID grads >= 18), and the fused op within
# 0.5 dB of the unfused composition. Measured (seed 1): y 25.6-27.3 dB, grads >= 23.8 (E4M3) / >= 20.7 (HYBRID)
# both ways; fused - unfused -0.05..+0.06 dB (the bias gradients are exact-ish sums: far above).
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=["E4M3", "HYBRID"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_mlp_vs_float64(force_kernels, kind, dtype, fmt):
    force_kernels(True)
    x, params, dy = _mlp_inputs(kind, dtype, seed=1)
    x64 = _leaf(x.double())
    p64 = [_leaf(p.double()) for p in params]
    y64 = torch.nn.functional.linear(act_fwd(torch.nn.functional.linear(x64, p64[0], p64[1]), kind), p64[2], p64[3])
    y64.backward(dy.double())
    ref = [y64, x64.grad] + _grads(*p64)
    got, unfused = _mlp(x, params, dy, kind, True, fmt), _mlp(x, params, dy, kind, False, fmt)
    t_grad = 21 if fmt == Format.E4M3 else 18
    for i, r in enumerate(ref):
        s_got, s_unfused = sqnr(r, got[i]), sqnr(r, unfused[i])
        assert s_got >= (22 if i == 0 else t_grad), (i, s_got)
        assert s_got >= s_unfused - 0.5, (i, s_got, s_unfused)


def test_mlp_frozen_weights_and_fused_wgrad(force_kernels):
    """Frozen weights: dx (and the biases' grads) as with trainable ones; fuse_wgrad: main_grad gets the same
    wgrads (fp32 GEMM output vs the weight's fp32 dtype: identical here)."""
    force_kernels(True)
    x, params, dy = _mlp_inputs("gelu", torch.float32, m=128, seed=2)
    full = _mlp(x, params, dy, "gelu", True)
    frozen = _mlp(x, params, dy, "gelu", True, frozen=True)
    assert frozen[2] is None and frozen[4] is None
    for i in (0, 1, 3, 5):
        torch.testing.assert_close(frozen[i], full[i], rtol=0, atol=0)
    fused_wgrad = _mlp(x, params, dy, "gelu", True, fuse_wgrad=True)
    for i in range(6):
        torch.testing.assert_close(fused_wgrad[i], full[i], rtol=0, atol=0)


def test_x_fp8_takes_either_path(force_kernels):
    """An input cast already (by the norm kernel) runs through the one-node MLP and the three-node composition
    alike (the block-scaled MLP once needed its fused path for it): the same output, bit for bit (ReLU, fp32)."""
    force_kernels(True)
    x, params, _ = _mlp_inputs("relu", torch.float32, m=128)
    fc1, fc2 = _quantizers(gemms=2)
    x_fp8 = fc1.input.quantize(x, transpose=True)
    ys = [mlp(x, *params, "relu", fc1, fc2, x_fp8=x_fp8) for mlp in (fp8_mlp, _unfused_fp8_mlp)]
    torch.testing.assert_close(ys[0], ys[1], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Without gradients: the fused norm writes no transposed copy (evaluation, sampling in the training command)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["LayerNormLinear", "LayerNormMLP"])
def test_no_grad_forward_equals_grad_forward(force_kernels, module):
    """Under ``torch.no_grad`` the norm casts without the wgrad's transpose, while ``ctx.needs_input_grad`` of the
    GEMM node still says True (autograd sets it from the inputs). The forward must run and give the bits of the
    forward with gradients (a 3-token batch: the rows are padded to 128). It failed on the H100 with
    ``x_q does not fit x`` (the training command's sampling under --recipe block)."""
    import fp8engine as fe

    force_kernels(True)
    torch.manual_seed(0)
    m = fe.LayerNormLinear(128, 256) if module == "LayerNormLinear" else fe.LayerNormMLP(128, 256)
    x = torch.randn(3, 1, 128)
    with fe.autocast(recipe=Float8BlockScaling()):
        with torch.no_grad():
            y0 = m(x)
        y1 = m(x)
    assert y1.requires_grad and not y0.requires_grad
    assert torch.equal(y0, y1.detach())


@pytest.mark.parametrize("op", ["linear", "mlp"])
def test_x_q_without_transpose_refused_when_a_wgrad_runs(force_kernels, op):
    force_kernels(True)
    (q,) = _quantizers()
    x = torch.randn(128, 128)
    w = torch.randn(128, 128, requires_grad=True)
    y, x_q = norm_cast(x, torch.ones(128), None, 1e-5, rms=True, zero_centered_gamma=False, quantizer=q.input,
                       transpose=False, return_hp=False)
    assert x_q.t_operand() is None
    with pytest.raises(ValueError, match="no transposed copy"):
        if op == "linear":
            fp8_linear(y, w, None, q, x_fp8=x_q)
        else:
            fc1, fc2 = _quantizers(gemms=2)
            fp8_mlp(y, w, None, torch.randn(128, 128), None, "gelu", fc1, fc2, x_fp8=x_q)
