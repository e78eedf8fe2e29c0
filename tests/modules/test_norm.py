"""LayerNorm / RMSNorm against torch.nn.LayerNorm / torch.nn.RMSNorm."""
import pytest
import torch

from fp8engine.modules import LayerNorm, RMSNorm


def _pair(cls, zero_centered, dtype, seed=0):
    torch.manual_seed(seed)
    ours = cls(48, eps=1e-5, zero_centered_gamma=zero_centered, params_dtype=dtype)
    with torch.no_grad():
        ours.weight.normal_()
        if ours.bias is not None:
            ours.bias.normal_()
    ref_cls = torch.nn.LayerNorm if cls is LayerNorm else torch.nn.RMSNorm
    ref = ref_cls(48, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(ours.weight + 1 if zero_centered else ours.weight)
        if ours.bias is not None:
            ref.bias.copy_(ours.bias)
    return ours, ref


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_matches_torch_exactly(zero_centered, dtype):
    ours, ref = _pair(LayerNorm, zero_centered, dtype)
    x = torch.randn(7, 3, 48, dtype=dtype) * 3 + 1
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), ref(x2)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)  # same ATen kernel: bit-exact
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=0, atol=0)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_matches_torch(zero_centered):
    ours, ref = _pair(RMSNorm, zero_centered, torch.float32)
    assert ours.bias is None
    x = torch.randn(7, 3, 48) * 3 + 1
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), ref(x2)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)  # forward: the same fused ATen kernel
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    # backward: our fp32 formula vs autograd's decomposition -- a few fp32 ulps apart
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)


def test_zero_centered_gamma_init_and_bad_size():
    assert torch.equal(LayerNorm(16, zero_centered_gamma=True).weight, torch.zeros(16))
    assert torch.equal(RMSNorm(16).weight, torch.ones(16))
    with pytest.raises(ValueError, match="hidden_size"):
        LayerNorm(0)
