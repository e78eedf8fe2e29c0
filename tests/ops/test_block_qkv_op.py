"""fp8_linear_qkv under block scaling (the QKV projection returning q, k, v, its backward casting the gradient
straight from dq, dk, dv) against the composed fp8_linear + split_grouped_qkv: the same q, k, v and the same
gradients, bit for bit (the same FP8 operands reach the same GEMMs), with and without rotary angles, on the
kernel path (the Triton kernels: the interpreter on the CPU) and the reference path."""
import pytest
import torch

from fp8engine.fp8.block_quantizer import block_quantizers_for
from fp8engine.fp8.float8_tensor import use_kernels
from fp8engine.fp8.quantizer import LinearQuantizers
from fp8engine.kernels._common import HAS_TRITON
from fp8engine.ops.linear import fp8_linear
from fp8engine.ops.qkv import fp8_linear_qkv
from fp8engine.kernels.qkv_grad import assemble_qkv_grad
from fp8engine.ops.qkv import split_grouped_qkv
from fp8engine.ops.rotary import unrotate_grads
from fp8engine.ops.rotary import rope_cos_sin
from fp8engine.recipe import Float8BlockScaling

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SPLIT = (2, 1, 64)  # g, hpg, d: C = 2 * 3 * 64 = 384


def _run(fused: bool, use_kernel: bool, rope: bool, bias: bool, s=24, b=3, k=128):
    g = torch.Generator().manual_seed(0)
    c = SPLIT[0] * (SPLIT[1] + 2) * SPLIT[2]
    x = (torch.randn(s, b, k, generator=g)).to(torch.bfloat16).to(DEV).requires_grad_()
    w = (torch.randn(c, k, generator=g) * 0.05).to(torch.bfloat16).to(DEV).requires_grad_()
    bb = (torch.randn(c, generator=g) * 0.1).to(torch.bfloat16).to(DEV).requires_grad_() if bias else None
    freqs = (torch.rand(s, 1, 1, SPLIT[2], generator=g) * 6).to(DEV) if rope else None
    qs = LinearQuantizers(*block_quantizers_for(Float8BlockScaling(), 3, use_kernel))
    if fused:
        q, kk, v = fp8_linear_qkv(x, w, bb, qs, SPLIT, freqs=freqs)
    else:
        q, kk, v = split_grouped_qkv(fp8_linear(x, w, bb, qs), *SPLIT, freqs=freqs, kernels=use_kernels(x))
    grads = [torch.randn(t.shape, generator=g).to(torch.bfloat16).to(DEV) for t in (q, kk, v)]
    torch.autograd.backward([q, kk, v], grads)
    dq, dk = grads[0], grads[1]
    if rope:
        dq, dk = unrotate_grads(dq, dk, rope_cos_sin(freqs, torch.bfloat16))
    assembled = assemble_qkv_grad(dq, dk, grads[2]).reshape(s * b, c)
    return [t.detach() for t in (q, kk, v)], x.grad, w.grad, (bb.grad if bias else None), assembled


@pytest.mark.parametrize("use_kernel", [pytest.param(True, marks=pytest.mark.skipif(not HAS_TRITON,
                                                                                     reason="needs Triton")), False])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_equals_composed(use_kernel, rope, bias, monkeypatch):
    if use_kernel is False and DEV == "cuda":
        pytest.skip("the reference path is the CPU's")
    import fp8engine.kernels.qkv_grad as op_module

    calls = []
    real = op_module.qkv_grad_1x128
    monkeypatch.setattr(op_module, "qkv_grad_1x128", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = _run(True, use_kernel, rope, bias)
    assert len(calls) == int(use_kernel), "the fused gradient cast runs exactly on the kernel path"
    want = _run(False, use_kernel, rope, bias)
    for a, b in zip(got[0], want[0]):
        assert torch.equal(a, b)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # dx, dw: the same GEMMs of the same bits
    if bias:
        # the reference path: the same torch sum; the kernels: fp32 tile sums in the gather kernel's order (one
        # bf16 ulp at most after the rounding)
        if use_kernel:
            # two fp32 summation orders of the same gradient G [T, C] (the assembled, unrotated dq, dk, dv): within
            # twice the recursive-summation bound T * 2**-24 * sum|G| (Higham §4.2), plus two bf16 ulps
            g = got[4].double()
            bound = 2 * g.shape[0] * 2.0 ** -24 * g.abs().sum(0)
            diff = (got[3].double() - want[3].double()).abs()
            assert torch.all(diff <= 2 * 2.0 ** -7 * want[3].double().abs() + bound)
        else:
            assert torch.equal(got[3], want[3])
    else:
        assert got[3] is None and want[3] is None


def test_wrong_dtype():
    qs = LinearQuantizers(*block_quantizers_for(Float8BlockScaling(), 3, False))
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        fp8_linear_qkv(torch.randn(4, 1, 128, dtype=torch.float16), torch.randn(384, 128), None, qs, SPLIT)
