"""The fused QKV projection op (``fp8_linear_qkv``): the same numbers as ``fp8_linear`` followed by the split,
on the torch path and on the kernel path (where dq/dk/dv are cast by the gather kernel instead of copied into one
buffer first)."""
import pytest
import torch

from _ops_test_utils import IGNORE_INTERPRETER_WARNINGS, force_kernels, make_state  # noqa: F401 (fixture)
from fp8engine.fp8.float8_tensor import use_kernels
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
        q, k, v = split_grouped_qkv(fp8_linear(x, w, b, qs[0]), groups, hpg, d, kernels=qs[0].input.kernels)
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


def _run_rope(in_op, fp8, delayed, dtype, groups, hpg, d, r, rotate=True):
    """The QKV op with rotary angles applied inside it (``freqs=``) against the views rotated afterwards by
    ``ops.rotary.rope_fwd`` (autograd through the plain-PyTorch rotation): outputs, input/weight/bias gradients and
    the FP8 amax history."""
    from fp8engine.ops.rotary import rope_cos_sin, rope_fwd

    g = torch.Generator().manual_seed(2)
    n = groups * (hpg + 2) * d
    x = torch.randn(S, B, K, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, K, generator=g) * 0.3).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    freqs = torch.randn(S, 1, 1, r, generator=g) * 3  # angles of every sign
    st, qs = make_state(LINEAR_ROLES, delayed)
    if fp8:
        q, k, v = fp8_linear_qkv(x, w, b, qs[0], (groups, hpg, d), freqs=freqs if in_op else None)
    else:
        q, k, v = split_grouped_qkv(torch.nn.functional.linear(x, w, b), groups, hpg, d,
                                    freqs=freqs if in_op else None, kernels=use_kernels(x))
    if not in_op and rotate:
        cos, sin = rope_cos_sin(freqs, dtype)
        q = rope_fwd(q.reshape(S, B, groups * hpg, d), cos, sin).view(S, B, groups, hpg, d)
        k = rope_fwd(k, cos, sin)
    torch.autograd.backward((q, k, v), _grads(g, S, B, groups, hpg, d, dtype))
    return [t.detach().clone() for t in (q, k, v)] + [x.grad, w.grad, b.grad, st.amax_history.clone()]


@pytest.mark.parametrize("heads", [(2, 1, 16, 16), (1, 3, 16, 8)], ids=["mha-full", "gqa-partial"])
@pytest.mark.parametrize("mode", ["delayed", "current", "hp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_inside_the_qkv_op_equals_rotating_the_views(force_kernels, heads, mode, dtype):
    # exact: the op's rotation (rope_qk kernel / rope_fwd) and its gradient (inside the QKV-gradient cast / rope_bwd)
    # round each product and sum to the dtype as the plain-PyTorch rotation and its autograd do
    args = (mode != "hp", mode == "delayed", dtype, *heads)
    for kernels in (False, True):  # torch path, then the Triton kernels under the interpreter
        force_kernels(kernels)
        ref = _run_rope(False, *args)
        got = _run_rope(True, *args)
        for name, a, b in zip(("q", "k", "v", "dx", "dw", "db", "amax_history"), got, ref):
            assert torch.equal(a, b), (kernels, name)
    # the rotation is there: without it q, k and the input gradient differ
    plain = _run_rope(False, *args, rotate=False)
    assert not torch.equal(plain[0], got[0]) and not torch.equal(plain[1], got[1])
    assert not torch.equal(plain[3], got[3])


def test_split_grouped_qkv_rotary_needs_matching_angles():
    mixed = torch.randn(4, 2, 2 * 3 * 16)
    with pytest.raises(ValueError, match="rotated width"):
        split_grouped_qkv(mixed, 2, 1, 16, freqs=torch.randn(4, 1, 1, 3), kernels=False)


def test_rope_tables_computed_once_per_angle_tensor():
    """``rope_cos_sin`` keeps the tables on the angle tensor: the same objects for the same tensor and dtype (what
    the layers of one model share), the formula's values exactly, recomputed after an in-place change of the angles,
    per dtype, and not kept for angles that require grad."""
    from fp8engine.ops.rotary import rope_cos_sin

    freqs = torch.randn(8, 1, 1, 16)
    cos, sin = rope_cos_sin(freqs, torch.bfloat16)
    assert torch.equal(cos, freqs.cos().to(torch.bfloat16)) and torch.equal(sin, freqs.sin().to(torch.bfloat16))
    again = rope_cos_sin(freqs, torch.bfloat16)
    assert again[0] is cos and again[1] is sin
    assert rope_cos_sin(freqs, torch.float32)[0].dtype == torch.float32
    freqs.mul_(2)
    cos2, sin2 = rope_cos_sin(freqs, torch.bfloat16)
    assert cos2 is not cos and torch.equal(cos2, freqs.cos().to(torch.bfloat16))
    assert torch.equal(sin2, freqs.sin().to(torch.bfloat16))
    learned = freqs.clone().requires_grad_()
    assert rope_cos_sin(learned, torch.float32)[0] is not rope_cos_sin(learned, torch.float32)[0]
    with torch.inference_mode():  # inference tensors have no version counter: computed, not kept
        made = freqs.clone()
        assert torch.equal(rope_cos_sin(made, torch.float32)[0], made.cos())
