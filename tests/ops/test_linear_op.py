"""The FP8 linear op's backward (dy cast fused with the bias gradient): kernel path vs torch path."""
import pytest
import torch

from _ops_test_utils import IGNORE_INTERPRETER_WARNINGS, force_kernels, make_state  # noqa: F401 (fixture)
from fp8engine.ops.linear import LINEAR_ROLES, fp8_linear

pytestmark = IGNORE_INTERPRETER_WARNINGS


def _run(delayed, dtype, bias, fuse_wgrad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 37, 48, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(32, 48, generator=g) * 0.2).to(dtype).requires_grad_()
    b = torch.randn(32, generator=g).to(dtype).requires_grad_() if bias else None
    if fuse_wgrad:
        w.main_grad = torch.zeros(32, 48)
    st, qs = make_state(LINEAR_ROLES, delayed)
    y = fp8_linear(x, w, b, qs[0], fuse_wgrad=fuse_wgrad)
    y.backward(torch.randn(y.shape, generator=g).to(dtype) * 2)
    return y.detach(), x.grad, w.main_grad if fuse_wgrad else w.grad, None if b is None else b.grad, st.amax_history


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_kernel_path_matches_torch_path(force_kernels, delayed, bias, dtype):
    # every FP8 cast is bit-identical between the paths, so y, dx, dw and the amaxes are too; db differs only by
    # the fp32 summation order (and, for bf16 under the interpreter, its truncating conversion): 2 bf16 ulps
    torch_path = _run(delayed, dtype, bias)
    force_kernels(True)
    kernel_path = _run(delayed, dtype, bias)
    for i in (0, 1, 2, 4):
        torch.testing.assert_close(kernel_path[i], torch_path[i], rtol=0, atol=0)
    if bias:
        rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(kernel_path[3].float(), torch_path[3].float(), rtol=rtol, atol=1e-5)
    if delayed:
        assert (kernel_path[4][:, 0] > 0).all()


def test_kernel_path_fused_wgrad(force_kernels):
    torch_path = _run(True, torch.float32, True, fuse_wgrad=True)
    force_kernels(True)
    kernel_path = _run(True, torch.float32, True, fuse_wgrad=True)
    torch.testing.assert_close(kernel_path[2], torch_path[2], rtol=0, atol=0)
