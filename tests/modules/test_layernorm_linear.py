"""LayerNormLinear: exact against F.layer_norm/F.rms_norm + F.linear outside autocast, SQNR inside."""
import pytest
import torch
import torch.nn.functional as F

import fp8engine
from tests.conftest import sqnr
from fp8engine.modules import LayerNormLinear

RECIPES = [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()]
K, N = 64, 48


def _layer(normalization="LayerNorm", **kw):
    torch.manual_seed(0)
    layer = LayerNormLinear(K, N, normalization=normalization, **kw)
    with torch.no_grad():  # non-trivial norm parameters
        layer.layer_norm_weight.uniform_(0.5, 1.5)
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.normal_(0, 0.2)
    return layer


def _reference(layer, x, dtype=torch.float64):
    p = {n: t.detach().to(dtype).requires_grad_() for n, t in layer.named_parameters()}
    x = x.detach().to(dtype).requires_grad_()
    gamma = p["layer_norm_weight"] + 1 if layer.zero_centered_gamma else p["layer_norm_weight"]
    if layer.normalization == "RMSNorm":
        ln = F.rms_norm(x, (K,), gamma, layer.eps)
    else:
        ln = F.layer_norm(x, (K,), gamma, p["layer_norm_bias"], layer.eps)
    return F.linear(ln, p["weight"], p.get("bias")), ln, x, p


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_matches_pytorch_outside_autocast(normalization, zero_centered):
    layer = _layer(normalization, zero_centered_gamma=zero_centered, return_layernorm_output=True)
    x = torch.randn(7, 3, K, requires_grad=True)
    y, ln = layer(x)
    y_ref, ln_ref, x_ref, p = _reference(layer, x, torch.float32)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # same ATen ops in the same order
    torch.testing.assert_close(ln, ln_ref, rtol=0, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    exact = normalization == "LayerNorm"  # RMSNorm backward is our fp32 formula, not autograd's decomposition
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, p[name].grad, **tol)


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_fp8_sqnr(recipe, normalization):
    layer = _layer(normalization)
    x = torch.randn(7, 3, K, requires_grad=True)  # 21 tokens: odd token dim
    for _ in range(2):  # the second step runs with scales from the first step's amaxes
        x.grad = None
        layer.zero_grad()
        with fp8engine.autocast(recipe=recipe):
            y = layer(x)
        g = torch.randn_like(y)
        y.backward(g)
    y_ref, _, x_ref, p = _reference(layer, x)
    y_ref.backward(g.double())
    # torchao test_base.py thresholds: >= 18 dB for FP8 linear outputs and gradients
    assert sqnr(y_ref, y) >= 18
    assert sqnr(x_ref.grad, x.grad) >= 18
    for name, param in layer.named_parameters():
        assert sqnr(p[name].grad, param.grad) >= 18, name
    if isinstance(recipe, fp8engine.DelayedScaling):  # the norm op recorded the input amax (row 0)
        assert (layer.fp8_state.amax_history[:, -2:].amax(-1) > 0).all()


def test_weight_caching_matches_no_caching():
    layer = _layer()
    xs = [torch.randn(5, 3, K) for _ in range(3)]
    recipe = fp8engine.CurrentScaling()  # scales do not move between calls: outputs comparable exactly
    with torch.no_grad(), fp8engine.autocast(recipe=recipe):
        plain = [layer(x) for x in xs]
        cached = [layer(x, is_first_microbatch=i == 0) for i, x in enumerate(xs)]
    for a, b in zip(plain, cached):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with fp8engine.autocast(recipe=recipe), pytest.raises(ValueError, match="is_first_microbatch"):
        _layer()(xs[0], is_first_microbatch=False)


@pytest.mark.parametrize("fp8", [False, True])
def test_fuse_wgrad_accumulation(fp8):
    fused, plain = _layer(fuse_wgrad_accumulation=True), _layer()
    fused.weight.main_grad = torch.zeros_like(fused.weight, dtype=torch.float32)
    x = torch.randn(7, 3, K)
    g = torch.randn(7, 3, N)
    for layer in (fused, plain):
        with fp8engine.autocast(enabled=fp8, recipe=fp8engine.CurrentScaling()):
            y = layer(x)
        y.backward(g)
    assert fused.weight.grad is None
    torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad, rtol=0, atol=0)  # same GEMM, fp32
    torch.testing.assert_close(fused.layer_norm_weight.grad, plain.layer_norm_weight.grad, rtol=0, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="normalization"):
        LayerNormLinear(K, N, normalization="BatchNorm")
    with pytest.raises(ValueError, match="parallel_mode"):
        LayerNormLinear(K, N, parallel_mode="row")
    with pytest.raises(ValueError, match="multiple of 16"), fp8engine.autocast():
        LayerNormLinear(K, 40)(torch.randn(3, 1, K))
