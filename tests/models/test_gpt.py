"""GPT model: shapes, configs, causality, FP8 vs high precision, tied head, checkpoint round trip, generation."""
import dataclasses

import pytest
import torch

import fp8engine
from fp8engine.models import GPT, GPT_CONFIGS, GPTConfig
from tests.conftest import sqnr

# Tiny but FP8-capable (all GEMM dims multiples of 16); an odd vocabulary is fine (the LM head is not FP8).
SMALL = GPTConfig(n_layer=2, n_head=4, hidden_size=64, ffn_hidden_size=128, max_seq_len=32, vocab_size=97)
RECIPES = [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()]


def _model(config=SMALL, seed=0):
    torch.manual_seed(seed)
    return GPT(config)


def _tokens(b, s, vocab=SMALL.vocab_size, seed=1):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("b,s", [(3, 13), (1, 32), (2, 1)])
def test_forward_shapes_and_loss(b, s):
    model = _model()
    x, y = _tokens(b, s), _tokens(b, s, seed=2)
    logits = model(x)
    assert logits.shape == (b, s, SMALL.vocab_size) and logits.dtype == torch.float32
    loss = model(x, y)
    assert loss.shape == () and torch.isfinite(loss)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, SMALL.vocab_size), y.reshape(-1))
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)


def test_sequence_longer_than_context_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        _model()(_tokens(1, SMALL.max_seq_len + 1))


def test_causal():
    """Changing token t changes no logits before t."""
    model = _model().eval()
    x = _tokens(2, 20)
    x2 = x.clone()
    x2[:, 11] = (x2[:, 11] + 1) % SMALL.vocab_size
    a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :11], b[:, :11], rtol=0, atol=0)
    assert (a[:, 11:] - b[:, 11:]).abs().max() > 1e-4


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
def test_fp8_forward_and_grads_close_to_high_precision(recipe):
    """FP8 logits and embedding grads vs the same model in fp32: >= 18 dB SQNR (torchao's bar for linear
    outputs and grads); delayed scaling gets two warm-up steps so its scales come from real amaxes."""
    model = _model()
    x, y = _tokens(4, 32), _tokens(4, 32, seed=3)
    for _ in range(2):
        with fp8engine.autocast(recipe=recipe):
            model(x, y)
    model.zero_grad()
    ref_loss = model(x, y)
    ref_loss.backward()
    ref_logits, ref_grad = model(x).detach(), model.embedding.weight.grad.clone()
    model.zero_grad()
    with fp8engine.autocast(recipe=recipe):
        fp8_logits = model(x)
        fp8_loss = model(x, y)
    fp8_loss.backward()
    assert sqnr(ref_logits, fp8_logits) >= 18
    assert sqnr(ref_grad, model.embedding.weight.grad) >= 18


def test_tied_head_and_parameter_count():
    model = _model()
    vocab_sized = [n for n, p in model.named_parameters() if SMALL.vocab_size in p.shape]
    assert vocab_sized == ["embedding.weight"]
    assert model.num_params() == SMALL.num_params()
    # The embedding gets gradient from both its uses (lookup and LM head): rows of tokens never seen as input
    # still get LM-head gradient.
    x = torch.zeros(2, 8, dtype=torch.long)
    model(x, _tokens(2, 8)).backward()
    grad = model.embedding.weight.grad
    assert grad[1:].abs().sum() > 0 and grad[0].abs().sum() > 0


@pytest.mark.parametrize("name,expected_millions", [("tiny", 0.43), ("small", 10.7), ("gpt2-124m", 123.7),
                                                    ("1b", 1311.6)])
def test_named_configs(name, expected_millions):
    cfg = GPT_CONFIGS[name]
    assert cfg.num_params() / 1e6 == pytest.approx(expected_millions, abs=0.1)
    assert cfg.fp8_problems() == []
    if name == "small":
        assert (cfg.n_layer, cfg.n_head, cfg.hidden_size, cfg.max_seq_len) == (6, 6, 384, 256)
    if name == "tiny":  # the built module agrees with the formula
        assert GPT(cfg).num_params() == cfg.num_params()


def test_config_validation():
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(hidden_size=100, n_head=3)
    with pytest.raises(ValueError, match="even"):
        GPTConfig(hidden_size=60, n_head=4, ffn_hidden_size=64)  # head dim 15
    with pytest.raises(ValueError, match="positive"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="unknown model"):
        GPTConfig.from_name("gpt5")
    bad = GPTConfig(hidden_size=72, n_head=4, ffn_hidden_size=288)
    assert any("hidden_size=72" in p for p in bad.fp8_problems())
    assert GPTConfig.from_name("tiny", vocab_size=65).vocab_size == 65
    assert any("per rank" in p for p in GPT_CONFIGS["tiny"].fp8_problems(tp_size=16))


def test_state_dict_round_trip_carries_fp8_state():
    """After FP8 steps the scaling buffers are in the state_dict; a fresh model loading it computes the same
    FP8 forward bit for bit."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _tokens(2, 32), _tokens(2, 32, seed=4)
    for _ in range(3):
        with fp8engine.autocast():
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    scales = [k for k in state if k.endswith("fp8_state.scale") or k.endswith(".scale")]
    assert scales and any((state[k] != 1).any() for k in scales)
    clone = _model(seed=123)
    clone.load_state_dict(state)
    with fp8engine.autocast():
        a = model(x)
    with fp8engine.autocast():
        b = clone(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_generate_shapes_greedy_and_determinism():
    model = _model()
    prompt = _tokens(2, 5)
    out = model.generate(prompt, 40, temperature=0.0)  # runs past max_seq_len=32: the context is cropped
    assert out.shape == (2, 45) and torch.equal(out[:, :5], prompt)
    # Greedy equals argmax of a manual forward at every position.
    manual = prompt
    for _ in range(6):
        nxt = model(manual[:, -SMALL.max_seq_len:])[:, -1].argmax(-1, keepdim=True)
        manual = torch.cat([manual, nxt], 1)
    torch.testing.assert_close(out[:, :11], manual, rtol=0, atol=0)
    # top_k=1 sampling is greedy; the same generator seed gives the same sample.
    top1 = model.generate(prompt, 6, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(top1, manual, rtol=0, atol=0)
    s1 = model.generate(prompt, 10, top_k=5, generator=torch.Generator().manual_seed(7))
    s2 = model.generate(prompt, 10, top_k=5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(s1, s2)
    assert model.training  # generate restores the mode


def test_generate_top_k_restricts_tokens():
    model = _model()
    prompt = _tokens(1, 4)
    logits = model(prompt)[:, -1]
    allowed = set(torch.topk(logits, 3, dim=-1).indices[0].tolist())
    for seed in range(20):
        tok = model.generate(prompt, 1, temperature=2.0, top_k=3, generator=torch.Generator().manual_seed(seed))
        assert tok[0, -1].item() in allowed
    with pytest.raises(ValueError):
        model.generate(prompt, 1, top_k=0)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_loss_falls_on_a_repeated_batch(precision):
    """Memorising one batch: 40 AdamW steps take the loss from ~ln(97)=4.6 to well under half of it."""
    model = _model(dataclasses.replace(SMALL, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = _tokens(4, 32)
    y = torch.roll(x, -1, dims=1)
    losses = []
    for _ in range(40):
        with fp8engine.autocast(enabled=precision == "fp8"):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 4.0 and losses[-1] < 0.5 * losses[0]
