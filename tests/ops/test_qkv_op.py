"""The fused QKV projection op (``fp8_linear_qkv``): the same numbers as ``fp8_linear`` followed by the split,
on the torch path and on the kernel path (where dq/dk/dv are cast by the gather kernel instead of copied into one
buffer first)."""
import pytest
import torch

from _ops_test_utils import IGNORE_INTERPRETER_WARNINGS, force_kernels, make_state  # noqa: F401 (fixture)
from fp8engine.ops.linear import LINEAR_ROLES, fp8_linear
from fp8engine.ops.qkv import fp8_linear_qkv, split_grouped_qkv

pytestmark = IGNORE_INTERPRETER_WARNINGS
S, B, K = 9, 7, 32  # 63 tokens: not a multiple of the kernels' 64-row tile


def _grads(g, s, b, groups, hpg, d, dtype):
    """Upstream gradients laid out as attention's backward returns them: [b, heads, s, d] permuted (strided)."""
    dq = torch.randn(b, groups, hpg, s, d, generator=g).to(dtype).permute(3, 0, 1, 2, 4)
    dk, dv = (torch.randn(b, groups, s, d, generator=g).to(dtype).permute(2, 0, 1, 3) for _ in range(2))
    return dq, dk, dv


def _run(fused, delayed, dtype, groups, hpg, d):
    g = torch.Generator().manual_seed(1)
    n = groups * (hpg + 2) * d
    x = torch.randn(S, B, K, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, K, generator=g) * 0.3).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    st, qs = make_state(LINEAR_ROLES, delayed)
    if fused:
        q, k, v = fp8_linear_qkv(x, w, b, qs[0], (groups, hpg, d))
    else:
        q, k, v = split_grouped_qkv(fp8_linear(x, w, b, qs[0]), groups, hpg, d)
    assert q.shape == (S, B, groups, hpg, d) and k.shape == v.shape == (S, B, groups, d)
    torch.autograd.backward((q, k, v), _grads(g, S, B, groups, hpg, d, dtype))
    return [t.detach().clone() for t in (q, k, v)] + [x.grad, w.grad, b.grad, st.amax_history.clone()]


@pytest.mark.parametrize("heads", [(2, 1, 16), (1, 3, 16)], ids=["mha", "gqa"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_qkv_matches_linear_then_split(force_kernels, heads, delayed, dtype):
    # torch path: the two compositions run the same casts and GEMMs -> bit-identical
    ref = _run(False, delayed, dtype, *heads)
    for a, b in zip(_run(True, delayed, dtype, *heads), ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # kernel path (interpreter): the gather-cast kernel gives the bits and dbias of assemble + cast_transpose_dbias
    force_kernels(True)
    ref_k = _run(False, delayed, dtype, *heads)
    for a, b in zip(_run(True, delayed, dtype, *heads), ref_k):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_split_mismatch_raises():
    st, qs = make_state(LINEAR_ROLES, True)
    with pytest.raises(ValueError, match="output features"):
        fp8_linear_qkv(torch.randn(2, 2, 16), torch.randn(48, 16), None, qs[0], (1, 2, 16))
