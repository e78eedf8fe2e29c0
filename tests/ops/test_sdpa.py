"""fp8engine.ops.sdpa (PyTorch's fused attention ops called directly) against
``torch.nn.functional.scaled_dot_product_attention`` with autograd: the same op on the same tensors, so the same bits
on the CPU; and None wherever SDPA would do something the direct call does not (dropout, GQA, other backends)."""
import pytest
import torch
import torch.nn.functional as F

from fp8engine.ops.sdpa import sdpa_bwd, sdpa_fwd

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _qkv(b, h, s, d, dtype, device, seed=0):
    """[b, h, s, d] views of an [s, b, h, d] buffer (the layer's layout), so strides are not SDPA's default."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, b, h, d, generator=gen, dtype=torch.float32).to(device, dtype).permute(1, 2, 0, 3)
            for _ in range(3)]


def _reference(q, k, v, is_causal, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal)
    return out.detach(), torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", [(2, 4, 37, 32), (1, 2, 128, 64)], ids=["odd-seq", "even"])
def test_direct_call_equals_sdpa(device, dtype, is_causal, shape):
    if (device == "cuda") == (dtype == torch.float32):
        # CUDA runs fp32 attention on the memory-efficient or math backend; the CPU calls flash directly for fp32
        # only (ops.sdpa's docstring): no direct call to compare
        assert sdpa_fwd(*_qkv(*shape, dtype, device), is_causal) is None
        return
    q, k, v = _qkv(*shape, dtype, device)
    got = sdpa_fwd(q, k, v, is_causal)
    assert got is not None, "the fused backend was not called directly"
    out, saved = got
    dout = torch.randn_like(out)
    ref_out, ref_grads = _reference(q, k, v, is_causal, dout)
    grads = sdpa_bwd(saved, dout)
    assert torch.equal(out, ref_out)  # the same op on the same tensors
    for g, r, t in zip(grads, ref_grads, (q, k, v)):
        assert g.shape == t.shape
        if device == "cpu":
            assert torch.equal(g, r)
        else:
            # cuDNN / flash accumulate dq over key blocks in fp32 in an order that may differ between two runs of
            # the same kernel; each gradient within bf16 rounding (2**-8 relative) of such a reordering
            torch.testing.assert_close(g, r, rtol=2 ** -7, atol=2 ** -7 * r.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_inference_keeps_nothing(device):
    q, k, v = _qkv(1, 2, 16, 32, torch.bfloat16 if device == "cuda" else torch.float32, device)
    out, saved = sdpa_fwd(q, k, v, True, grad=False)
    assert saved is None
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_not_called_directly_where_sdpa_differs():
    q, k, v = _qkv(1, 4, 16, 32, torch.float32, "cpu")
    assert sdpa_fwd(q, k, v, True, dropout_p=0.1) is None  # dropout: SDPA's own RNG draws
    assert sdpa_fwd(q, k[:, :2], v[:, :2], True, enable_gqa=True) is None
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # the math backend: SDPA's composite
        assert sdpa_fwd(q, k, v, True) is None
