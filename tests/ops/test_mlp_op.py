"""The fused FP8 MLP op (fc1 -> activation -> fc2 as one autograd node) against the unfused composition
(fp8_linear -> activation_cast -> fp8_linear), and its Triton-kernel path against its torch path."""
import pytest
import torch

from _ops_test_utils import IGNORE_INTERPRETER_WARNINGS, force_kernels, make_state  # noqa: F401 (fixture)
from tests.conftest import sqnr
from fp8engine.ops.mlp import ACTIVATIONS, MLP_ROLES, _unfused_fp8_mlp, fp8_mlp

pytestmark = IGNORE_INTERPRETER_WARNINGS

H, F = 48, 80  # multiples of 16; 1151 tokens: not a multiple of 16 (wgrad pads) nor of the 64-row kernel tiles


def _inputs(kind, bias, dtype=torch.float32, m=1151, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = ACTIVATIONS[kind] * F
    x = torch.randn(m, H, generator=g).to(dtype)
    params = [torch.randn(d, H, generator=g) * H ** -0.5, torch.randn(d, generator=g) * 0.5 if bias else None,
              torch.randn(H, F, generator=g) * F ** -0.5, torch.randn(H, generator=g) * 0.5 if bias else None]
    dy = torch.randn(m, H, generator=g).to(dtype)
    return x, [None if p is None else p.to(dtype) for p in params], dy


def _run(fn, kind, delayed, x, params, dy, *, frozen=False, fuse_wgrad=False, x_grad=True):
    st, qs = make_state(MLP_ROLES, delayed)
    x = x.clone().requires_grad_(x_grad)
    params = [None if p is None else p.clone().requires_grad_(not (frozen and p.dim() == 2)) for p in params]
    if fuse_wgrad:
        for w in (params[0], params[2]):
            w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    y = fn(x, *params, kind, *qs, fuse_wgrad=fuse_wgrad)
    y.backward(dy)
    grads = [x.grad] + [None if p is None else (p.main_grad if fuse_wgrad and p.dim() == 2 else p.grad)
                        for p in params]
    return y.detach(), grads, st.amax_history[:, 0].clone()


def _assert_same(a, b):
    ya, ga, ha = a
    yb, gb, hb = b
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    for i, (u, v) in enumerate(zip(ga, gb)):
        assert (u is None) == (v is None), i
        if u is not None:
            torch.testing.assert_close(u, v, rtol=0, atol=0, msg=f"gradient {i}")
    torch.testing.assert_close(ha, hb, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
@pytest.mark.parametrize("kind", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_unfused_bit_exact(kind, delayed, bias, dtype):
    # On CPU the fused op runs the same torch ops as the composition, so outputs, all gradients and the recorded
    # amaxes (six rows) must be bit-identical.
    x, params, dy = _inputs(kind, bias, dtype)
    fused = _run(fp8_mlp, kind, delayed, x, params, dy)
    _assert_same(fused, _run(_unfused_fp8_mlp, kind, delayed, x, params, dy))
    if delayed:
        assert (fused[2] > 0).all()  # every role recorded an amax


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_fused_frozen_and_fused_wgrad(kind):
    x, params, dy = _inputs(kind, True)
    for kw in (dict(frozen=True), dict(fuse_wgrad=True), dict(frozen=True, x_grad=False)):
        fused = _run(fp8_mlp, kind, True, x, params, dy, **kw)
        _assert_same(fused, _run(_unfused_fp8_mlp, kind, True, x, params, dy, **kw))
        if kw.get("frozen") and not kw.get("fuse_wgrad"):
            assert fused[1][1] is None and fused[1][3] is None


def test_no_backward_state_without_grad():
    x, params, _ = _inputs("gelu", True, m=64)
    st, qs = make_state(MLP_ROLES, True)
    with torch.no_grad():
        y = fp8_mlp(x, *params, "gelu", *qs)
    assert y.shape == x.shape and y.grad_fn is None


# Kernel path (what runs on CUDA), under the Triton interpreter on CPU, vs the torch path. The FP8 conversions are
# bit-identical (same scale, RNE); what differs:
# - the activation math: the kernels compute act / act' in fp32 straight into FP8, the torch path rounds them to
#   the input dtype first (double rounding for bf16), and GELU's fp32 forms differ by ~1 ulp (sigmoid vs tanh);
# - the dbias summation order (fp32 partial sums of 64-row tiles, then over tiles; torch: one fp32 sum).
# - under the interpreter only: Triton's interpreter converts fp32 -> bf16 by truncation, not round-to-nearest-even
#   (kernel outputs in bf16: dbias, and the high-precision activation / activation gradient of current scaling),
#   so bf16 runs differ from the torch path by up to one bf16 ulp there.
# Bounds, measured with margin: fp32 inputs: >= 100 dB SQNR between the paths (measured >= 132 dB: fp32-ulp
# differences only; ReLU: output and x/weight gradients bit-exact); bf16 inputs: >= 30 dB (measured 31-50 dB; an
# FP8 cast alone is ~25-30 dB from its input, and a wrong scale, amax row or layout gives < 20 dB).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
@pytest.mark.parametrize("kind", list(ACTIVATIONS))
def test_kernel_path_matches_torch_path(force_kernels, kind, delayed, bias, dtype):
    x, params, dy = _inputs(kind, bias, dtype, m=200)
    torch_path = _run(fp8_mlp, kind, delayed, x, params, dy)
    force_kernels(True)
    kernel_path = _run(fp8_mlp, kind, delayed, x, params, dy)
    (yt, gt, ht), (yk, gk, hk) = torch_path, kernel_path
    if kind == "relu" and dtype == torch.float32:
        torch.testing.assert_close(yk, yt, rtol=0, atol=0)
        for i in (0, 1, 3):
            torch.testing.assert_close(gk[i], gt[i], rtol=0, atol=0)
    bound = 100 if dtype == torch.float32 else 30
    assert sqnr(yt, yk) >= bound
    for i, (u, v) in enumerate(zip(gt, gk)):
        assert (u is None) == (v is None), i
        if u is not None:
            assert sqnr(u, v) >= bound, (i, sqnr(u, v))
    # the same six amax rows are recorded under delayed scaling (max|.| of nearly identical tensors: within 1 %)
    torch.testing.assert_close(hk, ht, rtol=1e-2, atol=0)
