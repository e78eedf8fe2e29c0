"""``transformers`` causal LMs converted to FP8: training tracks fp32, and the save/load round trips."""
import pytest
import torch

import fp8engine as fe

pytest.importorskip("transformers")
from tests.modules.hf_models import MODELS, VOCAB  # noqa: E402

STEPS = 20
# Loss gap bound between FP8 (delayed scaling, E4M3 fwd / E5M2 bwd) and fp32 training over 20 AdamW steps of the
# tiny models on byte text (the fp32 loss falls by > 1 nat): measured max gaps 0.005 (gpt2) and 0.086 (llama)
# (`pytest tests/modules/test_hf.py -s`, CPU, torch 2.13, 2026-11-24); the bound leaves ~2x room.
MAX_LOSS_GAP = 0.2

_TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are all "
         "resolved rather to die than to famish? All: Resolved. resolved. ") * 4


def _batches(n, batch=2, seq=16):
    data = torch.tensor(list(_TEXT.encode()), dtype=torch.long) % VOCAB
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=gen)
        yield torch.stack([data[s:s + seq] for s in starts])


def _train(model, fp8, steps=STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x in _batches(steps):
        with fe.autocast(enabled=fp8):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp8_training_tracks_fp32(name):
    ref = _train(MODELS[name](), fp8=False)
    model = MODELS[name]()
    fe.convert_to_fp8(model)
    got = _train(model, fp8=True)
    gap = max(abs(a - b) for a, b in zip(ref, got))
    assert ref[-1] < ref[0] - 1.0, ref  # the run learns something, so tracking it means something
    assert gap <= MAX_LOSS_GAP, (gap, ref, got)


def _trained_converted(name):
    model = MODELS[name]()
    fe.convert_to_fp8(model)
    _train(model, fp8=True, steps=2)  # amax histories and scales now differ from their initial values
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_pretrained_loads_into_plain_model(name, tmp_path):
    from safetensors import safe_open
    model = _trained_converted(name)
    plain_keys = set(MODELS[name]().state_dict())
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert not any(".fp8_state." in k for k in saved) and saved <= plain_keys
    loaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"] and not info["mismatched_keys"]
    for key, value in model.state_dict().items():
        if ".fp8_state." not in key:
            assert torch.equal(loaded.state_dict()[key], value), key
    x = next(_batches(1))
    model.eval(), loaded.eval()  # GPT-2 has dropout
    with torch.no_grad():  # outside fe.autocast a converted model computes what the plain one does, bit for bit
        assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp8_state_round_trip(name, tmp_path):
    model = _trained_converted(name)
    model.save_pretrained(tmp_path)
    fe.save_fp8_state(model, tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    fe.convert_to_fp8(loaded)
    before = {k: v.clone() for k, v in loaded.state_dict().items() if ".fp8_state." in k}
    fe.load_fp8_state(loaded, tmp_path)
    want = {k: v for k, v in model.state_dict().items() if ".fp8_state." in k}
    got = {k: v for k, v in loaded.state_dict().items() if ".fp8_state." in k}
    assert set(got) == set(want) and len(want) > 0
    assert any(not torch.equal(before[k], want[k]) for k in want)  # the load had something to restore
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_fp8_state_errors(tmp_path):
    model = MODELS["llama"]()
    with pytest.raises(ValueError, match="convert_to_fp8 first"):
        fe.save_fp8_state(model, tmp_path)
    fe.convert_to_fp8(model)
    with pytest.raises(FileNotFoundError, match="save_fp8_state"):
        fe.load_fp8_state(model, tmp_path)
    fe.save_fp8_state(model, tmp_path)
    other = MODELS["llama"]()
    fe.convert_to_fp8(other, module_filter_fn=lambda mod, fqn: "mlp" not in fqn)
    with pytest.raises(ValueError, match="does not match"):
        fe.load_fp8_state(other, tmp_path)
