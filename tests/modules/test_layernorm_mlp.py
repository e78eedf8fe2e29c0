"""LayerNormMLP: exact against plain PyTorch outside autocast, SQNR inside, activations, swiglu, wgrad fusion."""
import pytest
import torch
import torch.nn.functional as F

import fp8engine
from tests.conftest import sqnr
from fp8engine.modules import LayerNormMLP

H, FFN = 64, 96


def _mlp(activation="gelu", normalization="LayerNorm", **kw):
    torch.manual_seed(0)
    mlp = LayerNormMLP(H, FFN, activation=activation, normalization=normalization, **kw)
    with torch.no_grad():
        mlp.layer_norm_weight.uniform_(0.5, 1.5)
        if mlp.layer_norm_bias is not None:
            mlp.layer_norm_bias.normal_(0, 0.2)
    return mlp


def reference_mlp(mlp, x, dtype=torch.float64, p=None):
    """Plain-PyTorch LayerNormMLP on copies of ``mlp``'s parameters (or on ``p``, keeping ``x`` in its graph);
    returns (y, x_leaf, params)."""
    if p is None:
        p = {n: t.detach().to(dtype).requires_grad_() for n, t in mlp.named_parameters()}
        x = x.detach().to(dtype).requires_grad_()
    gamma = p["layer_norm_weight"] + 1 if mlp.zero_centered_gamma else p["layer_norm_weight"]
    if mlp.normalization == "RMSNorm":
        ln = F.rms_norm(x, (H,), gamma, mlp.eps)
    else:
        ln = F.layer_norm(x, (H,), gamma, p["layer_norm_bias"], mlp.eps)
    h = F.linear(ln, p["fc1_weight"], p.get("fc1_bias"))
    if mlp.activation == "gelu":
        a = F.gelu(h, approximate="tanh")
    elif mlp.activation == "relu":
        a = F.relu(h)
    else:
        gate, up = h.chunk(2, -1)
        a = F.silu(gate) * up
    return F.linear(a, p["fc2_weight"], p.get("fc2_bias")), x, p


@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_matches_pytorch_outside_autocast(activation, normalization):
    mlp = _mlp(activation, normalization, zero_centered_gamma=True)
    x = torch.randn(7, 3, H, requires_grad=True)
    y = mlp(x)
    y_ref, x_ref, p = reference_mlp(mlp, x, torch.float32)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # the same ATen ops in the same order
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    # LayerNorm path: bit-exact; RMSNorm backward is our fp32 formula (a few ulps from autograd's)
    tol = dict(rtol=0, atol=0) if normalization == "LayerNorm" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    for name, param in mlp.named_parameters():
        torch.testing.assert_close(param.grad, p[name].grad, **tol)


@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fp8_sqnr(recipe, activation):
    mlp = _mlp(activation, return_layernorm_output=True)
    x = torch.randn(7, 3, H, requires_grad=True)
    for _ in range(2):  # step 2 uses the scales learned in step 1 (delayed scaling)
        x.grad = None
        mlp.zero_grad()
        with fp8engine.autocast(recipe=recipe):
            y, ln = mlp(x)
        g = torch.randn_like(y)
        y.backward(g)
    y_ref, x_ref, p = reference_mlp(mlp, x)
    y_ref.backward(g.double())
    # torchao's >= 18 dB for outputs and the fc weight/bias grads; gradients that went through both E5M2 dgrads
    # (x and the norm parameters: two quantised GEMMs in a row) get >= 15 dB.
    assert sqnr(y_ref, y) >= 18
    assert sqnr(x_ref.grad, x.grad) >= 15
    for name, param in mlp.named_parameters():
        assert sqnr(p[name].grad, param.grad) >= (15 if name.startswith("layer_norm") else 18), name
    assert ln.shape == x.shape
    if isinstance(recipe, fp8engine.DelayedScaling):  # all six rows (fc1 and fc2 operands) were recorded
        assert (mlp.fp8_state.amax_history[:, -2:].amax(-1) > 0).all()


def test_weight_caching_matches_no_caching():
    mlp = _mlp("swiglu")
    xs = [torch.randn(5, 3, H) for _ in range(3)]
    with torch.no_grad(), fp8engine.autocast(recipe=fp8engine.CurrentScaling()):
        plain = [mlp(x) for x in xs]
        cached = [mlp(x, is_first_microbatch=i == 0) for i, x in enumerate(xs)]
    for a, b in zip(plain, cached):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True])
def test_fuse_wgrad_accumulation(fp8):
    fused, plain = _mlp(fuse_wgrad_accumulation=True), _mlp()
    for w in (fused.fc1_weight, fused.fc2_weight):
        w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    x, g = torch.randn(7, 3, H), torch.randn(7, 3, H)
    for mlp in (fused, plain):
        with fp8engine.autocast(enabled=fp8, recipe=fp8engine.CurrentScaling()):
            y = mlp(x)
        y.backward(g)
    for name in ("fc1_weight", "fc2_weight"):
        assert getattr(fused, name).grad is None
        torch.testing.assert_close(getattr(fused, name).main_grad, getattr(plain, name).grad, rtol=0, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="activation"):
        LayerNormMLP(H, FFN, activation="tanh")
    with pytest.raises(ValueError, match="normalization"):
        LayerNormMLP(H, FFN, normalization="GroupNorm")


@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_fused_fp8_mlp_matches_unfused(recipe, activation, bias):
    # The FP8 path runs fc1 -> activation -> fc2 as one autograd node; on CPU it must give the same bits as the
    # three-node composition it replaced (fused=False): outputs, every gradient, the amax histories and scales
    # over two steps (step 2 uses the scales learned in step 1), with weight caching on the second micro-batch.
    x = torch.randn(7, 3, H)
    results = []
    for fused in (True, False):
        mlp = _mlp(activation, bias=bias)
        mlp.fused = fused
        xi = x.clone().requires_grad_()
        ys = []
        for step in range(2):
            for mb in range(2):
                with fp8engine.autocast(recipe=recipe):
                    y = mlp(xi, is_first_microbatch=mb == 0)
                y.backward(torch.full_like(y, 0.5) + xi.detach()[..., :1])
                ys.append(y.detach())
        results.append((ys, [xi.grad] + [p.grad for p in mlp.parameters()], mlp.fp8_state.amax_history.clone(),
                         mlp.fp8_state.scale.clone()))
    (ya, ga, ha, sa), (yb, gb, hb, sb) = results
    for u, v in zip(ya + ga + [ha, sa], yb + gb + [hb, sb]):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True])
def test_residual_argument_matches_add_in_front(fp8):
    """mlp(b, residual=r, return_norm_input=True) == (mlp(r + b), r + b), gradients included (CPU torch path:
    the same add and the same gradient accumulation, so exact)."""
    g = torch.Generator().manual_seed(4)
    r0, b0 = torch.randn(5, 3, H, generator=g), torch.randn(5, 3, H, generator=g)
    dy, ds = torch.randn(5, 3, H, generator=g), torch.randn(5, 3, H, generator=g)
    outs = []
    for fused in (True, False):
        mlp = _mlp()  # fresh scaling state each time (delayed scaling updates it)
        r, b = r0.clone().requires_grad_(), b0.clone().requires_grad_()
        with fp8engine.autocast(enabled=fp8):
            if fused:
                y, s = mlp(b, residual=r, return_norm_input=True)
            else:
                s = r + b
                y = mlp(s)
        torch.autograd.backward([y, s], [dy, ds])
        outs.append([y.detach(), s.detach(), r.grad, b.grad] + [p.grad.clone() for p in mlp.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
