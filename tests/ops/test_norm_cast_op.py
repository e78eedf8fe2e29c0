"""norm_cast on the fused-kernel path (run on CPU under TRITON_INTERPRET=1): skipping the high-precision output
(``return_hp=False``) changes nothing but that output -- same FP8 bits, same amax, same gradients."""
import pytest
import torch

from fp8engine.fp8.float8_tensor import use_kernels
from fp8engine.ops.norm_linear import norm_cast
from tests.ops._ops_test_utils import IGNORE_INTERPRETER_WARNINGS, force_kernels, make_state  # noqa: F401

pytestmark = IGNORE_INTERPRETER_WARNINGS


def _run(rms, delayed, return_hp, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(70, 48, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(48, generator=g) + 0.5).to(dtype).requires_grad_()
    b = None if rms else (torch.randn(48, generator=g) * 0.1).to(dtype).requires_grad_()
    st, qs = make_state(("input", "weight", "grad_output"), delayed)
    y, y_fp8 = norm_cast(x, w, b, 1e-5, rms=rms, zero_centered_gamma=False, quantizer=qs[0].input,
                         transpose=True, return_hp=return_hp)
    assert y.shape == x.shape and y.dtype == x.dtype
    dy = torch.randn(x.shape, generator=g).to(dtype)
    y.backward(dy)  # the gradient a consumer of y_fp8 routes through y
    grads = [t.grad for t in (x, w, b) if t is not None]
    return y, y_fp8, st.amax_history[0, 0].clone(), grads


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("delayed", [True, False])
def test_return_hp_false_changes_only_the_hp_output(force_kernels, rms, delayed):
    force_kernels(True)
    y_hp, f_hp, amax_hp, g_hp = _run(rms, delayed, True, torch.bfloat16)
    _, f_no, amax_no, g_no = _run(rms, delayed, False, torch.bfloat16)
    assert torch.equal(f_hp.data.view(torch.uint8), f_no.data.view(torch.uint8))
    assert torch.equal(f_hp.transpose_2d().view(torch.uint8), f_no.transpose_2d().view(torch.uint8))
    assert torch.equal(f_hp.scale_inv, f_no.scale_inv) and torch.equal(amax_hp, amax_no)
    for a, b in zip(g_hp, g_no):
        assert torch.equal(a, b)
    assert y_hp.isfinite().all()


def test_torch_path_ignores_return_hp():
    """Without kernels the norm output is computed anyway (the cast reads it): return_hp=False returns it too."""
    x = torch.randn(33, 48, generator=torch.Generator().manual_seed(5))
    w, b = torch.rand(48) + 0.5, torch.randn(48)
    st, qs = make_state(("input", "weight", "grad_output"), True)
    y, _ = norm_cast(x, w, b, 1e-5, rms=False, zero_centered_gamma=False, quantizer=qs[0].input,
                     transpose=False, return_hp=False)
    assert not use_kernels(x)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (48,), w, b, 1e-5), rtol=0, atol=0)


def _run_residual(rms, dtype, fused):
    """``s = x + r``, ``y = norm(s)``; the loss uses y (through its gradient) and s (a residual path). fused: the
    add inside norm_cast (residual=r, return_input=True); else torch's add, then norm_cast on the sum."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(70, 48, generator=g) * 2).to(dtype).requires_grad_()
    r = (torch.randn(70, 48, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(48, generator=g) + 0.5).to(dtype).requires_grad_()
    b = None if rms else (torch.randn(48, generator=g) * 0.1).to(dtype).requires_grad_()
    st, qs = make_state(("input", "weight", "grad_output"), True)
    kw = dict(rms=rms, zero_centered_gamma=False, quantizer=qs[0].input, transpose=True, return_hp=True)
    if fused:
        y, y_fp8, s = norm_cast(x, w, b, 1e-5, residual=r, return_input=True, **kw)
    else:
        s = x + r
        y, y_fp8 = norm_cast(s, w, b, 1e-5, **kw)
    dy, ds = torch.randn(x.shape, generator=g).to(dtype), torch.randn(x.shape, generator=g).to(dtype)
    torch.autograd.backward([y, s], [dy, ds])
    return s.detach(), y.detach(), y_fp8, [t.grad for t in (x, r, w, b) if t is not None]


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_residual_fused_matches_add_then_norm(force_kernels, rms, dtype, kernels):
    """The residual add inside norm_cast vs torch's add in front of it, on both paths: s, y, the FP8 bits and
    dgamma/dbeta identical; x and r get one gradient, the norm's dx plus ds: on the kernel path added in fp32
    inside the kernel (one rounding), on the torch path and in autograd's accumulation after rounding (two), so
    within 2 ulps of dtype on the kernel path and exact on the torch path."""
    if kernels:
        force_kernels(True)
    s_u, y_u, f_u, g_u = _run_residual(rms, dtype, False)
    s_f, y_f, f_f, g_f = _run_residual(rms, dtype, True)
    assert torch.equal(s_f, s_u) and torch.equal(y_f, y_u)
    assert torch.equal(f_f.data.view(torch.uint8), f_u.data.view(torch.uint8))
    assert torch.equal(g_f[0], g_f[1])  # x and residual: one gradient
    tol = 0 if not kernels else (2e-5 if dtype == torch.float32 else 2 ** -7)
    for a, b in zip(g_f[:2], g_u[:2]):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    for a, b in zip(g_f[2:], g_u[2:]):
        assert torch.equal(a, b)


def test_return_input_without_residual_is_a_gradient_path():
    """return_input without residual returns x itself (a view); a gradient into it is added to the norm's dx."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 32, generator=g, requires_grad=True)
    w, b = torch.rand(32, generator=g) + 0.5, torch.randn(32, generator=g)
    st, qs = make_state(("input", "weight", "grad_output"), True)
    y, _, s = norm_cast(x, w, b, 1e-5, rms=False, zero_centered_gamma=False, quantizer=qs[0].input,
                        transpose=False, return_input=True)
    assert torch.equal(s, x)
    dy, ds = torch.randn(9, 32, generator=g), torch.randn(9, 32, generator=g)
    torch.autograd.backward([y, s], [dy, ds])
    x2 = x.detach().clone().requires_grad_()
    torch.nn.functional.layer_norm(x2, (32,), w, b, 1e-5).backward(dy)
    torch.testing.assert_close(x.grad, x2.grad + ds, rtol=0, atol=0)
