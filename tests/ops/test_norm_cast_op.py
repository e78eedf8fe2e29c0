"""norm_cast on the fused-kernel path (run on CPU under TRITON_INTERPRET=1): skipping the high-precision output
(``return_hp=False``) changes nothing but that output -- same FP8 bits, same amax, same gradients."""
import pytest
import torch

import fp8engine.ops.cast as ops_cast
import fp8engine.ops.norm_linear as ops_norm
from fp8engine.ops.norm_linear import norm_cast
from tests.ops._ops_test_utils import IGNORE_INTERPRETER_WARNINGS, force_kernels, make_state  # noqa: F401

pytestmark = IGNORE_INTERPRETER_WARNINGS


def _run(rms, delayed, return_hp, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(70, 48, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(48, generator=g) + 0.5).to(dtype).requires_grad_()
    b = None if rms else (torch.randn(48, generator=g) * 0.1).to(dtype).requires_grad_()
    st, plan = make_state(("input", "weight", "grad_output"), delayed)
    y, y_fp8 = norm_cast(x, w, b, 1e-5, rms=rms, zero_centered_gamma=False, state=st, row=0, plan=plan,
                         transpose=True, return_hp=return_hp)
    assert y.shape == x.shape and y.dtype == x.dtype
    dy = torch.randn(x.shape, generator=g).to(dtype)
    y.backward(dy)  # the gradient a consumer of y_fp8 routes through y
    grads = [t.grad for t in (x, w, b) if t is not None]
    return y, y_fp8, st.amax_history[0, 0].clone(), grads


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("delayed", [True, False])
def test_return_hp_false_changes_only_the_hp_output(force_kernels, monkeypatch, rms, delayed):
    monkeypatch.setattr(ops_norm, "use_kernels", lambda t: True)
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
    st, plan = make_state(("input", "weight", "grad_output"), True)
    y, _ = norm_cast(x, w, b, 1e-5, rms=False, zero_centered_gamma=False, state=st, row=0, plan=plan,
                     transpose=False, return_hp=False)
    assert not ops_cast.use_kernels(x)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (48,), w, b, 1e-5), rtol=0, atol=0)
