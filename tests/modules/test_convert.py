"""convert_to_fp8's report and default filter, and the GPT-2 ``Conv1D`` swap (Conv1DLinear)."""
import pytest
import torch

import fp8engine as fe
from fp8engine.modules.conv1d import Conv1DLinear
from fp8engine.modules.convert import KEEP_DIMS, KEEP_FILTER, KEEP_OUTPUT, KEEP_TIED
from tests.conftest import sqnr

# Same bar as tests/modules/test_linear.py (torchao's 18 dB for FP8 linear outputs and grads).
MIN_SQNR = 18.0


def test_report_plain_model():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model.lm_head = torch.nn.Linear(64, 64)
    report = fe.convert_to_fp8(model)
    assert report.converted == ["0"]
    assert report.kept == [("2", KEEP_DIMS), ("lm_head", KEEP_OUTPUT)]
    text = str(report)
    assert "1 layers converted" in text and "kept  2: " in text and "kept  lm_head: output projection" in text
    assert isinstance(model[0], fe.Linear) and type(model.lm_head) is torch.nn.Linear


def test_user_filter_replaces_default():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
    model.lm_head = torch.nn.Linear(32, 32)
    report = fe.convert_to_fp8(model, module_filter_fn=lambda mod, fqn: fqn != "1")
    assert report.converted == ["0", "lm_head"] and report.kept == [("1", KEEP_FILTER)]


def test_tied_weight_kept_whatever_its_name():
    emb = torch.nn.Embedding(64, 32)
    model = torch.nn.ModuleDict({"emb": emb, "proj": torch.nn.Linear(32, 64, bias=False), "out": torch.nn.Linear(32, 32)})
    model["proj"].weight = emb.weight
    report = fe.convert_to_fp8(model)
    assert report.kept == [("proj", KEEP_TIED)] and report.converted == ["out"]
    assert model._keys_to_ignore_on_save == {f"out.fp8_state.{k}" for k in ("amax_history", "scale", "update_step")}


@pytest.mark.parametrize("arg,what", [
    (lambda: torch.nn.Linear(32, 64).state_dict(), "got an object of type OrderedDict"),
    (lambda: [torch.nn.Linear(32, 64)], "got an object of type list"),
    (lambda: torch.nn.Sequential, "got the class Sequential"),
    (lambda: "checkpoints/model.pt", "got an object of type str"),
    (lambda: None, "got an object of type NoneType"),
])
def test_not_a_module_is_a_type_error_saying_what_to_pass(arg, what):
    with pytest.raises(TypeError, match=rf"takes a model \(a torch.nn.Module instance.*{what}$"):
        fe.convert_to_fp8(arg())


def test_bare_linear_refused():
    with pytest.raises(TypeError, match="wrap a bare nn.Linear"):
        fe.convert_to_fp8(torch.nn.Linear(32, 64))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_report_hf_models(name):
    pytest.importorskip("transformers")
    from tests.modules.hf_models import MODELS
    model = MODELS[name]()
    report = fe.convert_to_fp8(model)
    if name == "llama":  # 7 projections per layer, untied lm_head kept by name
        assert len(report.converted) == 14 and report.kept == [("lm_head", KEEP_OUTPUT)]
        assert all(isinstance(model.get_submodule(n), fe.Linear) for n in report.converted)
    else:  # GPT-2: 4 Conv1D per layer, lm_head tied to wte
        assert len(report.converted) == 8 and report.kept == [("lm_head", KEEP_TIED)]
        assert all(type(model.get_submodule(n)) is Conv1DLinear for n in report.converted)


def test_conv1d_linear_matches_conv1d():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    ref = Conv1D(48, 32)  # nf=48 out, nx=32 in; weight [32, 48]
    with torch.no_grad():
        ref.bias.normal_()
    holder = torch.nn.Sequential(ref)
    keys = set(holder.state_dict())
    x = torch.randn(3, 5, 32, requires_grad=True)
    y_ref = ref(x)
    y_ref.sum().backward()
    gw_ref, gx_ref = ref.weight.grad.clone(), x.grad.clone()
    ref.weight.grad = x.grad = None
    report = fe.convert_to_fp8(holder)
    conv = holder[0]
    assert report.converted == ["0"] and type(conv) is Conv1DLinear and conv.weight is ref.weight
    assert {k for k in holder.state_dict() if ".fp8_state." not in k} == keys
    y = conv(x)
    assert torch.equal(y, y_ref)  # outside autocast: the same math, F.linear on the transposed weight
    y.sum().backward()
    torch.testing.assert_close(conv.weight.grad, gw_ref)
    torch.testing.assert_close(x.grad, gx_ref)
    conv.weight.grad = x.grad = None
    for _ in range(3):  # delayed scaling calibrates on the first step
        with fe.autocast():
            y = conv(x)
        dy = torch.randn_like(y)
        conv.weight.grad = x.grad = None
        y.backward(dy)
    assert sqnr(y_ref, y) >= MIN_SQNR
    assert sqnr(torch.einsum("...k,...n->kn", x.detach(), dy), conv.weight.grad) >= MIN_SQNR


def test_fp32_input_under_torch_autocast():
    """HF models run norms in fp32 inside torch.autocast(bf16); the FP8 path casts such inputs to bf16."""
    torch.manual_seed(0)
    lin = fe.Linear(32, 64)
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = lin(x)  # F.linear under autocast: bf16 out
        with fe.autocast():
            y = lin(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert sqnr(x @ lin.weight.detach().T + lin.bias.detach(), y) >= MIN_SQNR
