"""A dtype cast of an FP8 module (``.to(torch.bfloat16)``, ``.bfloat16()``, ``.half()``; TransformerEngine's
getting-started guide does ``te_transformer.to(dtype=torch.bfloat16)``) converts its parameters and leaves the FP8
scaling state as it was: float32 scales and amax histories, int64 step counter, the same bits. Before the fix the
cast turned the scales into bf16 and the next FP8 forward failed in ``torch._scaled_mm`` (issue 42, item 8).

Everything here runs the same ops in the same order on both sides of each comparison, so comparisons are exact.
"""
import copy

import pytest
import torch

import fp8engine.modules as M
from fp8engine.fp8.autocast import fp8_autocast
from fp8engine.fp8.state import ScalingState
from fp8engine.recipe import DelayedScaling

H, HEADS, S, B = 64, 4, 16, 2
RECIPE = DelayedScaling(amax_history_len=4)

MODULES = {
    "Linear": lambda: M.Linear(H, 48),
    "LayerNormLinear": lambda: M.LayerNormLinear(H, 48),
    "LayerNormMLP": lambda: M.LayerNormMLP(H, 4 * H),
    "TransformerLayer": lambda: M.TransformerLayer(H, 4 * H, HEADS, hidden_dropout=0.0, attention_dropout=0.0),
}
CASTS = {  # name -> (cast, parameter dtype after it)
    "to(bfloat16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "to(dtype=bfloat16)": (lambda m: m.to(dtype=torch.bfloat16), torch.bfloat16),
    "bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    "half()": (lambda m: m.half(), torch.float16),
}
#: dtype of every ScalingState buffer, whatever the module's dtype
STATE_DTYPES = {"amax_history": torch.float32, "scale": torch.float32, "update_step": torch.int64,
                "grad_amax": torch.float32}


def _states(model):
    return [m for m in model.modules() if isinstance(m, ScalingState)]


def _snapshot(model):
    """``{name: clone}`` of every ScalingState buffer (persistent or not)."""
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.split(".")[-1] in STATE_DTYPES}


def _assert_state_unchanged(model, before):
    """Same dtypes as at construction, same bits as ``before``."""
    now = _snapshot(model)
    assert now.keys() == before.keys() and now
    for name, buf in now.items():
        assert buf.dtype == STATE_DTYPES[name.split(".")[-1]], name
        assert torch.equal(buf, before[name]), name  # fp32 values a bf16 round trip would have rounded


def _train(model, dtype, steps, seed=0):
    """``steps`` FP8 (delayed scaling) forward/backward/SGD steps on random ``[S, B, H]`` inputs in ``dtype`` (on
    the model's device); returns the float losses."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        x = (torch.randn(S, B, H, generator=g) * (step + 1)).to(next(model.parameters()).device, dtype)
        with fp8_autocast(fp8_recipe=RECIPE):
            y = model(x)
        loss = y.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("name", list(MODULES))
def test_cast_keeps_fp8_state_fp32_and_trains(name, cast):
    torch.manual_seed(0)
    model = MODULES[name]()
    _train(model, torch.float32, 2)  # scales and histories away from their initial 1.0 / 0.0
    assert any(bool((st.scale != 1).any()) for st in _states(model))
    before = _snapshot(model)
    fn, dtype = CASTS[cast]
    assert fn(model) is model
    _assert_state_unchanged(model, before)
    assert {p.dtype for p in model.parameters()} == {dtype}
    steps_before = [int(st.update_step) for st in _states(model)]
    losses = _train(model, dtype, 3, seed=1)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    for st in _states(model):
        assert {n: b.dtype for n, b in st.named_buffers()} == STATE_DTYPES
    # the three regions updated every state (the update ran on the fp32 buffers)
    assert [int(st.update_step) for st in _states(model)] == [s + 3 for s in steps_before]
    assert {p.dtype for p in model.parameters()} == {dtype}  # the optimizer steps kept them in the cast dtype


@pytest.mark.parametrize("name", list(MODULES))
def test_state_dict_round_trip_after_cast(name):
    """A bf16 model's state dict holds bf16 parameters and fp32 FP8 state, and loads into a freshly cast model
    that then computes the same output and the same state update, bit for bit."""
    torch.manual_seed(0)
    model = MODULES[name]().to(torch.bfloat16)
    _train(model, torch.bfloat16, 2)
    sd = model.state_dict()
    for key, value in sd.items():
        owner, _, leaf = key.rpartition(".")
        expect = STATE_DTYPES[leaf] if owner.endswith("fp8_state") else torch.bfloat16
        assert value.dtype == expect, key
    torch.manual_seed(1)  # other initial weights: the load must bring them
    other = MODULES[name]().bfloat16()
    other.load_state_dict(sd)
    sd2 = other.state_dict()
    assert sd2.keys() == sd.keys()
    for key in sd:
        assert sd2[key].dtype == sd[key].dtype and torch.equal(sd2[key], sd[key]), key
    x = torch.randn(S, B, H).to(torch.bfloat16)
    outs = []
    for m in (model, other):
        with fp8_autocast(fp8_recipe=RECIPE):
            outs.append(m(x))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for a, b in zip(_states(model), _states(other)):
        assert torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("name", list(MODULES))
def test_device_moves_keep_dtype(name, dtype):
    """``.to(device, dtype)`` / ``to_empty(device=)`` still move the FP8 state (here to ``meta``, the device every
    machine has besides the CPU), as float32, while the parameters take the new device and dtype."""
    model = MODULES[name]()
    model.to("meta", dtype)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", dtype)}
    for st in _states(model):
        assert {n: (b.device.type, b.dtype) for n, b in st.named_buffers()} == {
            n: ("meta", d) for n, d in STATE_DTYPES.items()}
    model.to_empty(device="cpu")
    for st in _states(model):
        assert {n: (b.device.type, b.dtype) for n, b in st.named_buffers()} == {
            n: ("cpu", d) for n, d in STATE_DTYPES.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device to move to")
def test_cuda_move_with_cast_is_exact():
    """``.to("cuda", torch.bfloat16)``: the FP8 state arrives on the GPU as the same float32 bits."""
    torch.manual_seed(0)
    model = MODULES["LayerNormMLP"]()
    _train(model, torch.float32, 2)
    before = _snapshot(model)
    model.to("cuda", torch.bfloat16)
    now = _snapshot(model)
    for name, buf in now.items():
        assert buf.is_cuda and buf.dtype == before[name].dtype and torch.equal(buf.cpu(), before[name]), name
    assert all(torch.isfinite(torch.tensor(_train(model, torch.bfloat16, 2))))


def test_cast_drops_cached_fp8_weights():
    """FP8 weights cached for gradient accumulation (``is_first_microbatch=True``) were cast from the fp32
    weights: after ``.to(torch.bfloat16)`` a ``is_first_microbatch=False`` call must not reuse them."""
    torch.manual_seed(0)
    lin = M.Linear(H, 48)
    x = torch.randn(S, H)
    with fp8_autocast(fp8_recipe=RECIPE):
        lin(x, is_first_microbatch=True)
        lin(x, is_first_microbatch=False)  # the cached copy serves this one
    lin.to(torch.bfloat16)
    with fp8_autocast(fp8_recipe=RECIPE):
        with pytest.raises(ValueError, match="is_first_microbatch=True"):
            lin(x.bfloat16(), is_first_microbatch=False)
        y = lin(x.bfloat16(), is_first_microbatch=True)
    assert y.dtype == torch.bfloat16


def test_cast_keeps_cached_quantizers_valid():
    """A dtype cast keeps the very buffers (no device change), so the quantizers cached on them stay in use; they
    point at the live float32 buffers."""
    lin = M.Linear(H, 48)
    with fp8_autocast(fp8_recipe=RECIPE):
        before = lin.fp8_begin()
    scale, hist = lin.fp8_state.scale, lin.fp8_state.amax_history
    lin.bfloat16()
    assert lin.fp8_state.scale is scale and lin.fp8_state.amax_history is hist
    with fp8_autocast(fp8_recipe=RECIPE):
        assert lin.fp8_begin() is before
    assert before[0].input.scale.dtype == torch.float32


def test_compiled_bf16_module_equals_eager():
    """``torch.compile`` (``aot_eager``: the eager kernels, so exact) of a module cast to bf16: same outputs,
    gradients and fp32 FP8 state as the eager bf16 module over three delayed-scaling steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = MODULES["Linear"]().to(torch.bfloat16)
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, backend="aot_eager", fullgraph=True)
    for step in range(3):
        x = (torch.randn(S, B, H) * (step + 1)).to(torch.bfloat16)
        outs = []
        for mod in (eager, compiled):
            xi = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=RECIPE):
                y = mod(xi)
            y.float().square().mean().backward()
            outs.append((y.detach(), xi.grad))
        assert outs[0][0].dtype == torch.bfloat16
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), step
    from fp8engine.fp8.library import fold_grad_amax

    fold_grad_amax(_states(compiled_mod))
    for a, b in zip(_states(eager), _states(compiled_mod)):
        assert a.scale.dtype == b.scale.dtype == torch.float32
        assert torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history)
