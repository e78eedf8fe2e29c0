"""``fp8engine.fp8_model_init`` (FP8 primary weights) and ``FP8MasterWeights``: the parameters are FP8 bytes with a
scale_inv (half the bytes of bf16 parameters), training matches the same model with ordinary parameters under
``fp8_autocast`` (bit for bit with current scaling and the preserved initial values, within the FP8 bound
otherwise), ``state_dict`` round-trips, TE's spelling runs, and bad inputs are refused with clear errors."""
import io

import pytest
import torch
import torch.nn.functional as F

import fp8engine
from fp8engine.fp8.float8_tensor import quantize_current
from fp8engine.models import GPT, GPTConfig
from fp8engine.modules import Conv1DLinear, LayerNormLinear, LayerNormMLP, Linear, MultiheadAttention, TransformerLayer
from fp8engine.modules.fp8_init import FP8_PARAM_DTYPES, get_high_precision_init_val
from fp8engine.training.master_weights import FP8MasterWeights

H, FFN, HEADS, S, B = 64, 128, 4, 16, 2
_GPT = GPTConfig(n_layer=1, n_head=HEADS, hidden_size=H, ffn_hidden_size=FFN, max_seq_len=S, vocab_size=128)
_G = torch.Generator().manual_seed(1)
X, TARGET = torch.randn(S, B, H, generator=_G), torch.randn(S, B, H, generator=_G)
TOKENS = torch.randint(0, _GPT.vocab_size, (B, S), generator=_G)

#: name -> (build the model, its loss)
MODELS = {
    "Linear": (lambda: Linear(H, H), lambda m: F.mse_loss(m(X), TARGET)),
    "LayerNormMLP": (lambda: LayerNormMLP(H, FFN), lambda m: F.mse_loss(m(X), TARGET)),
    "TransformerLayer": (lambda: TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0),
                         lambda m: F.mse_loss(m(X), TARGET)),
    "GPT": (lambda: GPT(_GPT), lambda m: m(TOKENS, TOKENS.roll(-1, 1))),
}
RECIPES = {"current": fp8engine.Float8CurrentScaling(), "delayed": fp8engine.DelayedScaling()}
#: GEMM weights of each model, by parameter name
WEIGHTS = {"Linear": ["weight"], "LayerNormMLP": ["fc1_weight", "fc2_weight"],
           "TransformerLayer": ["self_attention.layernorm_qkv.weight", "self_attention.proj.weight",
                                "layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_weight"]}
# FP8 bound on the losses: a few AdamW steps of the FP8 model (ordinary or FP8 primary weights) against the same
# steps in high precision. E4M3 rounds each element by up to 2^-4 relative; over K-term dot products and a mean
# loss the errors mostly cancel: the ordinary FP8 models stay within 1.4 % of high precision here, the FP8 primary
# ones within 1.3 %; 3 % leaves room for other seeds while catching a wrong scale (a factor of 2 or more).
LOSS_RTOL = 0.03


def _build(name, fp8_init, preserve=True, **kw):
    torch.manual_seed(0)
    if fp8_init:
        with fp8engine.fp8_model_init(preserve_high_precision_init_val=preserve, **kw):
            return MODELS[name][0]()
    return MODELS[name][0]()


def _train(model, opt, name, recipe, steps=4):
    """Losses of ``steps`` optimizer steps (under ``fp8_autocast(recipe)``; high precision when recipe is None)."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with fp8engine.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            loss = MODELS[name][1](model)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _bytes(model) -> int:
    """Bytes of the parameters and of the FP8 weights' scale_inv buffers (the optimizer's state excluded)."""
    tensors = list(model.parameters()) + [b for n, b in model.named_buffers() if n.endswith("_scale_inv")]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_gemm_weights_are_fp8_bytes_with_scale_inv(name):
    ref, model = _build(name, False), _build(name, True)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    for w in WEIGHTS[name]:
        p, want = params[w], dict(ref.named_parameters())[w]
        assert p.dtype == torch.float8_e4m3fn and p.requires_grad and p.shape == want.shape
        fp8 = quantize_current(want.detach(), torch.float8_e4m3fn)  # current scaling of the initial value
        assert torch.equal(p.view(torch.uint8), fp8.data.view(torch.uint8))
        assert buffers[w + "_scale_inv"].dtype == torch.float32
        torch.testing.assert_close(buffers[w + "_scale_inv"], fp8.scale_inv, rtol=0, atol=0)
        torch.testing.assert_close(get_high_precision_init_val(p), want.detach(), rtol=0, atol=0)
    fp8_params = {n for n, p in params.items() if p.dtype == torch.float8_e4m3fn}
    assert fp8_params == set(WEIGHTS[name])  # norms and biases stay high precision
    assert all(m.fuse_wgrad_accumulation for m in model.modules() if hasattr(m, "fuse_wgrad_accumulation"))


def test_weight_memory_is_half_of_bf16_parameters():
    # the done-when row: a TransformerLayer's weights under fp8_model_init vs the same layer with bf16 parameters
    torch.manual_seed(0)
    bf16 = TransformerLayer(128, 512, HEADS, params_dtype=torch.bfloat16)
    with fp8engine.fp8_model_init():
        fp8 = TransformerLayer(128, 512, HEADS, params_dtype=torch.bfloat16)
    ratio = _bytes(fp8) / _bytes(bf16)
    assert 0.5 <= ratio < 0.51, ratio  # 1 byte per GEMM weight element; norms and biases (<1 %) stay bf16


@pytest.mark.parametrize("name", list(MODELS))
def test_trains_bit_for_bit_like_ordinary_parameters_under_current_scaling(name):
    """Current scaling casts the ordinary weight as fp8_model_init stores it, the wgrad lands in main_grad as it
    would in .grad, and AdamW runs on identical fp32 masters: the same losses and weights, bit for bit."""
    recipe = RECIPES["current"]
    ref, model = _build(name, False), _build(name, True)
    want = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), name, recipe)
    opt = FP8MasterWeights(model, lr=1e-2)
    got = _train(model, opt, name, recipe)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref_params = dict(ref.named_parameters())
    for (module, w, master) in opt._masters:
        full = next(n for n, p in model.named_parameters() if p is getattr(module, w))
        torch.testing.assert_close(master, ref_params[full], rtol=0, atol=0)


@pytest.mark.parametrize("preserve", [True, False], ids=["preserved-init", "dequantized-init"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", ["LayerNormMLP", "GPT"])
def test_losses_within_the_fp8_bound(name, recipe, preserve):
    hp = _build(name, False)
    want = _train(hp, torch.optim.AdamW(hp.parameters(), lr=1e-2), name, None)
    model = _build(name, True, preserve, recipe=RECIPES[recipe])
    got = _train(model, FP8MasterWeights(model, lr=1e-2), name, RECIPES[recipe])
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0)


def test_outside_autocast_the_weight_is_dequantized_and_its_gradient_goes_to_main_grad():
    with fp8engine.fp8_model_init():
        lin = Linear(H, 32)
    w = lin.weight.float() * lin.weight_scale_inv  # what TE computes with outside FP8 regions
    x = torch.randn(5, H, requires_grad=True)
    with pytest.raises(ValueError, match="main_grad"):  # nobody allocated it yet
        lin(x).sum().backward()
    lin.weight.main_grad = torch.zeros(32, H)
    x.grad = None
    y = lin(x)
    torch.testing.assert_close(y, F.linear(x, w, lin.bias), rtol=0, atol=0)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert lin.weight.grad is None
    torch.testing.assert_close(lin.weight.main_grad, dy.t() @ x.detach(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, dy @ w, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_state_dict_round_trips_exactly(recipe):
    name = "TransformerLayer"
    model = _build(name, True)
    opt = FP8MasterWeights(model, lr=1e-2)
    _train(model, opt, name, RECIPES[recipe], steps=2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    torch.manual_seed(7)  # other initial values, overwritten by the load
    with fp8engine.fp8_model_init():
        other = MODELS[name][0]()
    other.load_state_dict(saved["model"])
    other_opt = FP8MasterWeights(other, lr=1e-2)
    other_opt.load_state_dict(saved["opt"])
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), n
    # the same next steps: masters, moments and FP8 weights all came back
    torch.testing.assert_close(_train(other, other_opt, name, RECIPES[recipe], 2),
                               _train(model, opt, name, RECIPES[recipe], 2), rtol=0, atol=0)


def test_state_dict_crosses_between_fp8_and_high_precision_weights():
    ref = _build("LayerNormMLP", False)
    model = _build("LayerNormMLP", True)
    ref.fc1_weight.data.mul_(3)  # a checkpoint that differs from the initial values
    model.load_state_dict(ref.state_dict())  # high precision -> FP8: cast with a new current-scaling scale
    want = quantize_current(ref.fc1_weight.detach(), torch.float8_e4m3fn)
    assert torch.equal(model.fc1_weight.view(torch.uint8), want.data.view(torch.uint8))
    torch.testing.assert_close(model.fc1_weight_scale_inv, want.scale_inv, rtol=0, atol=0)
    ref.load_state_dict(model.state_dict())  # FP8 -> high precision: dequantized, scale_inv consumed
    torch.testing.assert_close(ref.fc1_weight, want.dequantize(torch.float32), rtol=0, atol=0)


def test_te_spelling_dtype_casts_and_pickling():
    with fp8engine.fp8_model_init(enabled=True, preserve_high_precision_init_val=True):  # as a TE user writes it
        lin = fp8engine.Linear(H, 32)
    with fp8engine.quantized_model_init(recipe=fp8engine.DelayedScaling(fp8_format=fp8engine.Format.E5M2)):
        e5m2 = fp8engine.Linear(H, 32)
    assert lin.weight.dtype == torch.float8_e4m3fn and e5m2.weight.dtype == torch.float8_e5m2
    init = lin.weight.get_high_precision_init_val()
    assert init.device.type == "cpu" and init.dtype == torch.float32
    lin = torch.load(io.BytesIO(_saved(lin)), weights_only=False)  # the whole module pickles
    torch.testing.assert_close(lin.weight.get_high_precision_init_val(), init, rtol=0, atol=0)
    lin.weight.clear_high_precision_init_val()
    assert lin.weight.get_high_precision_init_val() is None
    lin.to(torch.bfloat16)  # the FP8 bytes and their float32 scale_inv are kept; the bias is cast
    assert (lin.weight.dtype, lin.weight_scale_inv.dtype, lin.bias.dtype) == (torch.float8_e4m3fn, torch.float32,
                                                                              torch.bfloat16)


def _saved(module) -> bytes:
    buf = io.BytesIO()
    torch.save(module, buf)
    return buf.getvalue()


def test_disabled_builds_ordinary_parameters():
    torch.manual_seed(0)
    with fp8engine.fp8_model_init(enabled=False):
        off = Linear(H, 32)
    torch.manual_seed(0)
    with fp8engine.fp8_model_init():
        with fp8engine.fp8_model_init(enabled=False):  # an inner disabled region wins
            inner = Linear(H, 32)
        on = Linear(H, 32)
    torch.manual_seed(0)
    plain = Linear(H, 32)
    for m in (off, inner):
        assert m.weight.dtype == torch.float32 and not m.fuse_wgrad_accumulation
        torch.testing.assert_close(m.weight, plain.weight, rtol=0, atol=0)
        assert "weight_scale_inv" not in m.state_dict()
    assert on.weight.dtype == torch.float8_e4m3fn
    layer = _build("TransformerLayer", True)
    assert not layer._fusable  # the fused layer step casts its weights itself: the sublayers run instead


def test_bad_inputs_are_refused():
    with pytest.raises(TypeError, match="enabled must be True or False"):
        with fp8engine.fp8_model_init(enabled="yes"):
            pass
    with pytest.raises(TypeError, match="preserve_high_precision_init_val"):
        with fp8engine.fp8_model_init(preserve_high_precision_init_val=1):
            pass
    with pytest.raises(TypeError, match="recipe must be"):
        with fp8engine.fp8_model_init(recipe="hybrid"):
            pass
    with pytest.raises(ValueError, match="Float8BlockScaling"):
        with fp8engine.fp8_model_init(recipe=fp8engine.Float8BlockScaling()):
            pass
    with fp8engine.fp8_model_init():
        with pytest.raises(ValueError, match="one weight parameter"):
            MultiheadAttention(H, HEADS, fuse_qkv_params=False)
        with pytest.raises(ValueError, match="one weight parameter"):
            LayerNormLinear(H, 2 * H, parameters_split={"a_": H, "b_": H})
        with pytest.raises(TypeError, match="Conv1DLinear"):
            Conv1DLinear(H, 32)
        lin = Linear(128, 128)
    lin.weight.main_grad = torch.zeros(128, 128)
    with fp8engine.fp8_autocast(fp8_recipe=fp8engine.Float8BlockScaling()):
        with pytest.raises(ValueError, match="Float8BlockScaling cannot use it"):
            lin(torch.randn(4, 128))
    lin.fuse_wgrad_accumulation = False
    with fp8engine.fp8_autocast(), pytest.raises(ValueError, match="fuse_wgrad_accumulation must stay True"):
        lin(torch.randn(4, 128))
    with pytest.raises(ValueError, match="not a primary weight"):
        FP8MasterWeights(torch.nn.Linear(4, 4), param_groups=[{"params": [lin.weight]}])
    opt = FP8MasterWeights(_build("Linear", True))
    with pytest.raises(ValueError, match="masters"):
        opt.load_state_dict(FP8MasterWeights(_build("LayerNormMLP", True)).state_dict())


@pytest.mark.parametrize("preserve", [True, False], ids=["kept-init", "dequantized"])
def test_fsdp2_masters_replace_fp8_primary_weights(preserve):
    """Before FSDP2 shards them (fully_shard wants one dtype per group; FP8 weights' gradients are in main_grad, which
    FSDP does not reduce-scatter), each FP8 primary weight becomes a parameter holding its master: the kept initial
    value, else the FP8 bytes dequantized, in the other parameters' dtype; its scale_inv buffer goes, its module
    puts gradients in .grad again, and a checkpoint of the FP8 model still loads (dequantized, exact)."""
    from fp8engine.parallel.fsdp import masters_of_fp8_primary_weights

    model = _build("TransformerLayer", True, preserve)
    fp8_state = {k: v.clone() for k, v in model.state_dict().items()}
    plain = _build("TransformerLayer", False)
    want = {}
    for name, p in model.named_parameters():
        if p.dtype in FP8_PARAM_DTYPES:
            module, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            want[name] = (dict(plain.named_parameters())[name].detach() if preserve
                          else p.float() * getattr(module, attr + "_scale_inv"))
    assert masters_of_fp8_primary_weights(model) == len(want) == 4
    assert not any(n.endswith("_scale_inv") for n, _ in model.named_buffers())
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        if name in want:
            assert torch.equal(p, want[name]), name
    assert not any(getattr(m, "fuse_wgrad_accumulation", False) for m in model.modules())
    assert masters_of_fp8_primary_weights(model) == 0  # nothing left to convert
    model.load_state_dict(fp8_state)  # the FP8 model's checkpoint: FP8 bytes and scale_inv, dequantized on load
    for name, p in model.named_parameters():
        key = name.rpartition(".")
        if name in want:
            assert torch.equal(p, fp8_state[name].float() * fp8_state[key[0] + "." + key[2] + "_scale_inv"]), name
