"""What a TransformerEngine user's script reaches for: a TE-quickstart script run unchanged (``import fp8engine as
te``), TransformerLayer's TE options against a float64 plain-PyTorch block (fp32, bf16, FP8), the fused layer step
taking only what it implements, input checks, and ``Linear``'s ``return_bias`` / ``parallel_mode`` (2 gloo ranks
against the unsharded layer of the same seed)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fp8engine
import fp8engine.modules.transformer as transformer_module
from fp8engine.modules import Linear, TransformerLayer
from test_dot_product_attention import left_padding, reference_core, right_padding
from tests.conftest import sqnr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_harness import run_ranks  # noqa: E402

H, FFN, HEADS, GROUPS = 64, 128, 4, 2
HYBRID = dict(fp8_format=fp8engine.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


def reference_layer(layer, x, mask_type, mask=None):
    """TransformerEngine's ``TransformerLayer`` forward (``transformer_engine/pytorch/transformer.py``) written out in
    plain PyTorch in ``x``'s dtype with ``layer``'s parameters: returns ``(y, params)``. Post-LN residuals take the
    norms' outputs; ``output_layernorm`` drops the attention's input norm and normalises the output."""
    p = {n: t.detach().to(x.dtype).requires_grad_() for n, t in layer.named_parameters()}
    post_ln, out_ln = layer.apply_residual_connection_post_layernorm, layer.output_layernorm
    bshd = layer.attn_input_format == "bshd"
    x = x.transpose(0, 1) if bshd else x
    cfg = layer.self_attention.config
    s, b, h = x.shape
    n, g, d = cfg.num_attention_heads, cfg.num_gqa_groups, cfg.head_dim

    def norm(t, prefix):
        return F.layer_norm(t, (h,), p[prefix + "weight"], p[prefix + "bias"], 1e-5)

    if out_ln:
        a_in, qkv_name = x, "self_attention.qkv."
    else:
        a_in, qkv_name = norm(x, "self_attention.layernorm_qkv.layer_norm_"), "self_attention.layernorm_qkv."
    qkv = F.linear(a_in, p[qkv_name + "weight"], p[qkv_name + "bias"]).view(s, b, g, n // g + 2, d)  # grouped
    q, k, v = qkv[:, :, :, : n // g].reshape(s, b, n, d), qkv[:, :, :, n // g], qkv[:, :, :, n // g + 1]
    attn = F.linear(reference_core(q, k, v, mask_type, mask), p["self_attention.proj.weight"],
                    p["self_attention.proj.bias"])
    x1 = (a_in if post_ln and not out_ln else x) + attn
    ln2 = norm(x1, "layernorm_mlp.layer_norm_")
    hid = F.gelu(F.linear(ln2, p["layernorm_mlp.fc1_weight"], p["layernorm_mlp.fc1_bias"]), approximate="tanh")
    out = (ln2 if post_ln else x1) + F.linear(hid, p["layernorm_mlp.fc2_weight"], p["layernorm_mlp.fc2_bias"])
    if out_ln:
        out = norm(out, "layernorm.")
    return (out.transpose(0, 1) if bshd else out), p


#: (name, TransformerLayer kwargs, mask type at forward, mask maker, whether the fused FP8 step applies)
CASES = [
    ("post_ln", dict(apply_residual_connection_post_layernorm=True), "causal", None, False),
    ("output_ln", dict(output_layernorm=True), "causal", None, False),
    ("post_ln+output_ln", dict(apply_residual_connection_post_layernorm=True, output_layernorm=True), "causal",
     None, False),
    ("kv_channels32", dict(kv_channels=32), "causal", None, True),
    ("encoder_no_mask", dict(self_attn_mask_type="no_mask", layer_type="encoder"), "no_mask", None, True),
    ("padding", dict(self_attn_mask_type="padding"), "padding", right_padding, False),
    ("padding_causal_left", dict(self_attn_mask_type="padding_causal"), "padding_causal", left_padding, False),
    ("bshd", dict(attn_input_format="bshd", layer_number=3), "causal", None, True),
]


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    kw = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "num_gqa_groups": GROUPS, **kw}
    return TransformerLayer(H, FFN, HEADS, **kw)


def _inputs(kw, make_mask, dtype, s=13, b=3):
    gen = torch.Generator().manual_seed(1)
    shape = (b, s, H) if kw.get("attn_input_format") == "bshd" else (s, b, H)
    x = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
    mask = None if make_mask is None else make_mask([s, s - 4, 5][:b], s)
    return x, mask, torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("name,kw,mask_type,make_mask,_fused", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_options_match_reference(name, kw, mask_type, make_mask, _fused, precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layer = _layer(params_dtype=dtype, **kw)
    x, mask, g = _inputs(kw, make_mask, dtype)
    recipe = fp8engine.DelayedScaling(**HYBRID)
    for _ in range(2 if precision == "fp8" else 1):  # delayed scaling: the second step uses the first's amaxes
        x.grad = None
        layer.zero_grad()
        with fp8engine.fp8_autocast(enabled=precision == "fp8", fp8_recipe=recipe):
            y = layer(x, mask)
        y.backward(g)
    assert y.dtype == dtype and y.shape == x.shape
    x_ref = x.detach().double().requires_grad_()
    y_ref, p = reference_layer(layer, x_ref, mask_type, mask)
    y_ref.backward(g.double())
    if precision == "fp32":  # fp32 vs float64: fp32 rounding only
        torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, x_ref.grad.float(), rtol=1e-4, atol=1e-5)
        for pname, param in layer.named_parameters():
            torch.testing.assert_close(param.grad, p[pname].grad.float(), rtol=1e-4, atol=1e-5, msg=pname)
        return
    # bf16 parameters and activations (2^-9 relative per rounding, a few dozen roundings deep): >= 30 dB.
    # FP8: torchao's >= 18 dB for outputs and GEMM-weight gradients; 15 dB behind two E5M2 dgrads (norm parameters).
    out_db, grad_db, norm_db = (30, 25, 25) if precision == "bf16" else (18, 18, 15)
    assert sqnr(y_ref, y) >= out_db
    assert sqnr(x_ref.grad, x.grad) >= grad_db
    for pname, param in layer.named_parameters():
        assert sqnr(p[pname].grad, param.grad) >= (norm_db if "norm" in pname else grad_db), pname


@pytest.mark.parametrize("name,kw,mask_type,make_mask,fused", CASES, ids=[c[0] for c in CASES])
def test_fused_step_takes_only_what_it_implements(monkeypatch, name, kw, mask_type, make_mask, fused):
    """Under per-tensor FP8 the layer runs the fused step (fp8engine.ops.layer) for the options it implements and
    the composed sublayers otherwise; either way the result is the composed layer's, bit for bit (CPU)."""
    calls = []
    real = transformer_module.fused_layer
    monkeypatch.setattr(transformer_module, "fused_layer", lambda *a: calls.append(1) or real(*a))
    fast, plain = _layer(**kw), _layer(fused=False, **kw)
    x, mask, g = _inputs(kw, make_mask, torch.float32)
    x2 = x.detach().clone().requires_grad_()
    with fp8engine.fp8_autocast(fp8_recipe=fp8engine.CurrentScaling()):
        y, y2 = fast(x, mask), plain(x2, mask)
    y.backward(g)
    y2.backward(g)
    assert len(calls) == int(fused)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    for (pname, a), b in zip(fast.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=pname)


@pytest.mark.parametrize("fp8", [False, True])
def test_forward_mask_override_and_layer_number(fp8):
    """``self_attn_mask_type`` at forward equals building the layer with it (the fused step too); ``layer_number``
    changes nothing."""
    causal, no_mask = _layer(), _layer(self_attn_mask_type="no_mask", layer_number=7)
    x = torch.randn(11, 2, H)
    with fp8engine.fp8_autocast(enabled=fp8, fp8_recipe=fp8engine.CurrentScaling()):
        torch.testing.assert_close(causal(x, self_attn_mask_type="no_mask"), no_mask(x), rtol=0, atol=0)
        torch.testing.assert_close(no_mask(x, self_attn_mask_type="causal"), causal(x), rtol=0, atol=0)
    assert no_mask.layer_number == 7 and no_mask.self_attention.layer_number == 7


def test_checkpoint_core_attention_repeats_dropout():
    layer = _layer(attention_dropout=0.3, hidden_dropout=0.2)
    x, g = torch.randn(9, 2, H), torch.randn(9, 2, H)
    runs = []
    for ckpt in (False, True):
        torch.manual_seed(5)
        xi = x.clone().requires_grad_()
        layer.zero_grad()
        y = layer(xi, checkpoint_core_attention=ckpt)
        y.backward(g)
        runs.append([y.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()])
    for plain, ckpt in zip(*runs):
        torch.testing.assert_close(ckpt, plain, rtol=0, atol=0)


def test_bad_options():
    with pytest.raises(ValueError, match="cross-attention"):
        TransformerLayer(H, FFN, HEADS, layer_type="decoder")
    with pytest.raises(ValueError, match="layer_type"):
        TransformerLayer(H, FFN, HEADS, layer_type="moe")
    with pytest.raises(ValueError, match="attn_input_format"):
        TransformerLayer(H, FFN, HEADS, attn_input_format="thd")
    with pytest.raises(ValueError, match="attn_mask_type"):
        _layer()(torch.randn(4, 2, H), self_attn_mask_type="sliding")


# ---------------------------------------------------------------------------------------------------------------
# Input checks (TypeError / ValueError naming what is expected, instead of garbage or a reshape error deep inside)

def test_integer_input_into_fp8_linear_raises():
    lin = Linear(32, 16)
    x = torch.randint(-3, 3, (4, 32))
    with fp8engine.fp8_autocast(), pytest.raises(TypeError, match="float32, bfloat16 or float16.*int64"):
        lin(x)
    with fp8engine.fp8_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x.double()).dtype == torch.bfloat16  # a floating input that torch.autocast casts is taken


@pytest.mark.parametrize("make", [lambda: fp8engine.LayerNormLinear(32, 16), lambda: fp8engine.LayerNormMLP(32, 64)],
                         ids=["LayerNormLinear", "LayerNormMLP"])
def test_integer_input_into_fp8_norm_modules_raises(make):
    mod = make()
    with fp8engine.fp8_autocast(), pytest.raises(TypeError, match=f"{type(mod).__name__}: .*float32, bfloat16 or "
                                                                    "float16.*int64"):
        mod(torch.randint(-3, 3, (4, 2, 32)))


def test_transformer_layer_input_checks():
    layer = _layer()
    with pytest.raises(ValueError, match=r"\[s, b, h\].*hidden_size = 64.*\[16, 64\].*unsqueeze"):
        layer(torch.randn(16, H))
    with pytest.raises(ValueError, match=r"hidden_size = 64, got shape \[16, 2, 32\]"):
        layer(torch.randn(16, 2, 32))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        layer(torch.randint(0, 5, (16, 2, H)))
    with fp8engine.fp8_autocast(), pytest.raises(TypeError, match="float64"):
        layer(torch.randn(16, 2, H, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[b, s, h\]"):
        _layer(attn_input_format="bshd")(torch.randn(16, H))


# ---------------------------------------------------------------------------------------------------------------
# Linear: return_bias, parallel_mode

@pytest.mark.parametrize("fp8", [False, True])
def test_linear_return_bias(fp8):
    torch.manual_seed(0)
    lin = Linear(64, 48, return_bias=True)
    torch.manual_seed(0)
    plain = Linear(64, 48)
    x = torch.randn(5, 3, 64, requires_grad=True)
    with fp8engine.fp8_autocast(enabled=fp8, fp8_recipe=fp8engine.CurrentScaling()):
        y, bias = lin(x)
        y_plain = plain(x)
    assert bias is lin.bias
    y.backward(torch.ones_like(y))
    assert lin.bias.grad is None  # the bias was not added: it is the caller's to add
    torch.testing.assert_close(y + bias, y_plain, rtol=1e-6, atol=1e-6)  # the same GEMM; one fp32 add apart
    if not fp8:  # exactly F.linear without the bias
        torch.testing.assert_close(y, F.linear(x, lin.weight), rtol=0, atol=0)
    else:  # FP8 GEMM vs float64 x @ w.T: torchao's 18 dB
        assert sqnr(F.linear(x.detach().double(), lin.weight.detach().double()), y) >= 18


def test_linear_parallel_mode_without_group_is_plain():
    torch.manual_seed(0)
    plain = Linear(64, 48)
    for mode in ("column", "row"):
        torch.manual_seed(0)
        lin = Linear(64, 48, parallel_mode=mode, sequence_parallel=True)  # one rank: no split, no communication
        assert lin.tp_group is None and not lin.sequence_parallel
        torch.testing.assert_close(lin.weight, plain.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match="parallel_mode"):
        Linear(64, 48, parallel_mode="sequence")


def _linear_tp_worker(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    K, N = 64, 96
    for mode in ("column", "row"):
        for sp in (False, True):
            for fp8 in (False, True):
                what = f"mode={mode} sp={sp} fp8={fp8} rank={rank}"
                torch.manual_seed(0)
                ref = Linear(K, N)
                torch.manual_seed(0)
                tp = Linear(K, N, parallel_mode=mode, tp_group=group, sequence_parallel=sp, return_bias=mode == "row")
                col = mode == "column"
                w_want = ref.weight.chunk(world, 0 if col else 1)[rank]
                torch.testing.assert_close(tp.weight, w_want, rtol=0, atol=0, msg=what)
                torch.manual_seed(1)
                x, g = torch.randn(8, 3, K), torch.randn(8, 3, N)
                x_ref = x.clone().requires_grad_()
                y_ref = ref(x_ref)  # fp32 unsharded reference
                y_ref.backward(g)
                if col:
                    x_in = x.chunk(world, 0)[rank] if sp else x
                    want_y, g_in = y_ref.chunk(world, 2)[rank], g.chunk(world, 2)[rank]
                    want_dx = x_ref.grad.chunk(world, 0)[rank] if sp else x_ref.grad
                else:
                    x_in = x.chunk(world, 2)[rank]
                    want_y = y_ref.chunk(world, 0)[rank] if sp else y_ref
                    g_in = g.chunk(world, 0)[rank] if sp else g
                    want_dx = x_ref.grad.chunk(world, 2)[rank]
                x_in = x_in.clone().requires_grad_()
                with fp8engine.fp8_autocast(enabled=fp8, fp8_recipe=fp8engine.CurrentScaling()):
                    y = tp(x_in)
                if not col:  # return_bias: the full bias, not yet added
                    y, bias = y
                    assert bias is tp.bias
                    y = y + bias
                y.backward(g_in)
                dw_want = ref.weight.grad.chunk(world, 0 if col else 1)[rank]
                db = tp.bias.grad.clone()
                if getattr(tp.bias, "sequence_parallel", False):  # row + sp: partial per shard, summed over ranks
                    dist.all_reduce(db, group=group)
                db_want = ref.bias.grad.chunk(world, 0)[rank] if col else ref.bias.grad
                if not fp8:  # the same math, other summation orders: fp32 rounding
                    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5, msg=what)
                    torch.testing.assert_close(x_in.grad, want_dx, rtol=1e-4, atol=1e-5, msg=what)
                    torch.testing.assert_close(tp.weight.grad, dw_want, rtol=1e-4, atol=1e-5, msg=what)
                    torch.testing.assert_close(db, db_want, rtol=1e-4, atol=1e-5, msg=what)
                else:  # FP8 sharded vs fp32 unsharded: torchao's 18 dB (bias grads come from the fp32 dy)
                    assert sqnr(want_y, y) >= 18, what
                    assert sqnr(want_dx, x_in.grad) >= 18, what
                    assert sqnr(dw_want, tp.weight.grad) >= 18, what
                    torch.testing.assert_close(db, db_want, rtol=1e-4, atol=1e-5, msg=what)


@pytest.mark.slow
def test_linear_parallel_mode_matches_unsharded():
    run_ranks(_linear_tp_worker, 2)


# ---------------------------------------------------------------------------------------------------------------
# Exports and a TransformerEngine quickstart script

def test_te_names():
    import fp8engine as te
    from fp8engine.parallel.random import te_checkpoint

    assert te.Float8CurrentScaling is te.CurrentScaling
    assert te.checkpoint is te_checkpoint
    assert te.DotProductAttention is fp8engine.modules.DotProductAttention
    assert {"DotProductAttention", "Float8CurrentScaling", "checkpoint"} <= set(te.__all__)
    # the lazy names keep the torch-free frontends importable
    code = "import sys; sys.modules['torch'] = None; import fp8engine, fp8engine.jax; print(fp8engine.Format.HYBRID)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_te_quickstart_script():
    """TransformerEngine's getting-started flow (docs/examples/quickstart*): a layer hand-built from te.LayerNorm /
    te.Linear / te.DotProductAttention, one from te.LayerNormLinear / te.LayerNormMLP, and te.TransformerLayer
    sharing their parameters, run under ``te.fp8_autocast`` with a HYBRID delayed-scaling recipe, forward and
    backward; then ``te_transformer.to(dtype=torch.bfloat16)``. Written as a TE user writes it."""
    import fp8engine as te
    from fp8engine import recipe

    torch.manual_seed(1234)
    hidden_size, ffn_hidden_size, num_attention_heads = 64, 256, 4
    sequence_length, batch_size = 32, 2
    kv_channels = hidden_size // num_attention_heads

    class BasicTETransformerLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = te.LayerNorm(hidden_size, eps=1e-5)
            self.qkv_projection = te.Linear(hidden_size, 3 * hidden_size, bias=True)
            self.attention = te.DotProductAttention(num_attention_heads, kv_channels, attention_dropout=0.0,
                                                    attn_mask_type="causal")
            self.projection = te.Linear(hidden_size, hidden_size, bias=True)
            self.ln2 = te.LayerNorm(hidden_size, eps=1e-5)
            self.ln_mlp = te.LayerNormMLP(hidden_size, ffn_hidden_size, eps=1e-5, bias=True)

        def forward(self, x, attention_mask=None):
            res = x
            x = self.ln1(x)
            qkv = self.qkv_projection(x)
            qkv = qkv.view(qkv.size(0), qkv.size(1), num_attention_heads, 3 * kv_channels)
            q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)
            x = self.projection(self.attention(q, k, v, attention_mask))
            x = res + x
            return x + self.ln_mlp(x)

    class FusedTETransformerLayer(BasicTETransformerLayer):
        def __init__(self):
            super().__init__()
            self.ln_qkv = te.LayerNormLinear(hidden_size, 3 * hidden_size, eps=1e-5, bias=True)

        def forward(self, x, attention_mask=None):
            qkv = self.ln_qkv(x)
            qkv = qkv.view(qkv.size(0), qkv.size(1), num_attention_heads, 3 * kv_channels)
            q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)
            x = x + self.projection(self.attention(q, k, v, attention_mask))
            return x + self.ln_mlp(x)

    basic, fused = BasicTETransformerLayer(), FusedTETransformerLayer()
    te_transformer = te.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads,
                                         self_attn_mask_type="causal", layer_type="encoder", hidden_dropout=0.0,
                                         attention_dropout=0.0)
    with torch.no_grad():  # TE's share_parameters_with_* (per-head interleaved QKV rows in all three)
        for model, qkv in ((fused, fused.ln_qkv), (te_transformer, te_transformer.self_attention.layernorm_qkv)):
            qkv.layer_norm_weight.copy_(basic.ln1.weight)
            qkv.layer_norm_bias.copy_(basic.ln1.bias)
            qkv.weight.copy_(basic.qkv_projection.weight)
            qkv.bias.copy_(basic.qkv_projection.bias)
        for proj in (fused.projection, te_transformer.self_attention.proj):
            proj.load_state_dict(basic.projection.state_dict())
        for mlp in (fused.ln_mlp, te_transformer.layernorm_mlp):
            mlp.load_state_dict(basic.ln_mlp.state_dict())

    x = torch.rand(sequence_length, batch_size, hidden_size)
    dy = torch.rand(sequence_length, batch_size, hidden_size)
    fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    outs = {}
    for name, model in (("basic", basic), ("fused", fused), ("transformer", te_transformer)):
        for fp8 in (False, True):
            for _ in range(2 if fp8 else 1):
                xi = x.clone().requires_grad_()
                with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
                    y = model(xi, attention_mask=None)
                y.backward(dy)
            outs[name, fp8] = (y.detach(), xi.grad)
    want, want_dx = outs["basic", False]
    for key, (y, dx) in outs.items():
        if not key[1]:  # the three fp32 layers are the same function: fp32 rounding apart
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=str(key))
            torch.testing.assert_close(dx, want_dx, rtol=1e-4, atol=1e-5, msg=str(key))
        else:  # FP8 against the fp32 layer: torchao's 18 dB for outputs and input gradients
            assert sqnr(want, y) >= 18 and sqnr(want_dx, dx) >= 18, key
    # the getting-started guide then casts the whole layer to bf16
    te_transformer.to(dtype=torch.bfloat16)
    xb = x.to(torch.bfloat16).requires_grad_()
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        y = te_transformer(xb, attention_mask=None)
    y.backward(dy.to(torch.bfloat16))
    assert y.dtype == xb.grad.dtype == torch.bfloat16
    assert sqnr(want, y) >= 18 and sqnr(want_dx, xb.grad) >= 18  # bf16 + FP8 vs the fp32 layer
