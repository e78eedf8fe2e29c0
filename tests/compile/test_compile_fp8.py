"""``torch.compile`` of FP8 modules under ``fp8_autocast`` (issue 18).

On CPU the compiled code is built with ``backend="aot_eager"`` (Dynamo + AOTAutograd, whose functionalization of
the FP8 state's in-place updates is what these tests check, run by eager kernels): it computes the same ops as
eager mode in the same order, so outputs, gradients, losses and the FP8 state after training are compared for
exact equality. Inductor, whose fused kernels round differently: ``test_compile_inductor.py``.
"""
import copy
import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fp8engine.modules as M
from fp8engine.fp8.autocast import fp8_autocast
from fp8engine.fp8.library import fold_grad_amax
from fp8engine.fp8.state import ScalingState
from fp8engine.models import GPT, GPTConfig
from fp8engine.recipe import CurrentScaling, DelayedScaling


H, HEADS, S, B = 64, 4, 16, 2
TINY = GPTConfig(n_layer=2, n_head=HEADS, hidden_size=H, ffn_hidden_size=4 * H, max_seq_len=S, vocab_size=256,
                 dropout=0.0)
RECIPES = {"delayed": lambda: DelayedScaling(amax_history_len=4), "current": CurrentScaling}

MODULES = {
    "Linear": lambda: M.Linear(H, H),
    "LayerNormLinear": lambda: M.LayerNormLinear(H, H),
    "LayerNormMLP": lambda: M.LayerNormMLP(H, 4 * H),
    "MultiheadAttention": lambda: M.MultiheadAttention(H, HEADS, attention_dropout=0.0),
    "TransformerLayer": lambda: M.TransformerLayer(H, 4 * H, HEADS, hidden_dropout=0.0, attention_dropout=0.0),
}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _states(model):
    return [m for m in model.modules() if isinstance(m, ScalingState)]


def _assert_state_equal(eager, compiled):
    """Same buffers, after folding the compiled backward's pending gradient amaxes where eager mode keeps them."""
    fold_grad_amax(_states(compiled))
    sd0, sd1 = eager.state_dict(), compiled.state_dict()
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k


@pytest.mark.parametrize("name", list(MODULES))
def test_module_forward_has_no_graph_break(name):
    torch.manual_seed(0)
    mod = MODULES[name]()
    x = torch.randn(S, B, H)
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        explained = torch._dynamo.explain(mod)(x)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1


def test_gpt_forward_has_no_graph_break():
    torch.manual_seed(0)
    model = GPT(TINY)
    tokens = torch.randint(0, 256, (B, S))
    with fp8_autocast(fp8_recipe=CurrentScaling()):
        explained = torch._dynamo.explain(model)(tokens, tokens)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", list(MODULES))
def test_module_compiled_equals_eager(name, recipe):
    """Three forward/backward steps (delayed scaling: scales from the previous steps' amaxes, gradient amaxes of
    the compiled backward included): outputs, input/weight gradients and the FP8 state bit-identical."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = MODULES[name]()
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, backend="aot_eager", fullgraph=True)
    for step in range(3):
        x = (torch.randn(S, B, H) * (step + 1)).requires_grad_()
        outs = []
        for mod in (eager, compiled):
            xi = x.detach().clone().requires_grad_()
            with fp8_autocast(fp8_recipe=RECIPES[recipe]()):
                y = _first(mod(xi))
            y.float().square().mean().backward()
            outs.append((y.detach(), xi.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), step
    for p0, p1 in zip(eager.parameters(), compiled_mod.parameters()):
        assert torch.equal(p0.grad, p1.grad)
    _assert_state_equal(eager, compiled_mod)


def _train(model, recipe, steps, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(seed))
    losses = []
    for _ in range(steps):  # one batch, learned by heart: the loss must fall
        with fp8_autocast(fp8_recipe=recipe):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["delayed", pytest.param("current", marks=pytest.mark.slow)])  # ~50 s each
def test_gpt_20_steps_compiled_equals_eager(recipe):
    """20 AdamW steps of a tiny GPT in FP8: identical losses, parameters and FP8 state (aot_eager runs the same
    kernels in the same order as eager mode, so any difference would be a mis-traced state update)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = GPT(dataclasses.replace(TINY, n_layer=1))
    compiled_model = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True)
    l0 = _train(eager, RECIPES[recipe](), 20)
    l1 = _train(compiled, RECIPES[recipe](), 20)
    # one graph for all 20 steps, two for delayed scaling with a history length other than the state's 1024: the
    # first call resizes the histories (a new buffer shape, so a re-trace); no re-trace per step after that
    assert counter.frame_count == (2 if recipe == "delayed" else 1)
    assert l0 == l1
    assert l0[-1] < l0[0]
    _assert_state_equal(eager, compiled_model)


def test_recipe_change_retraces():
    """The compiled code guards the active recipe: a new recipe (or FP8 off) compiles a new graph and computes
    what eager mode computes under it; an equal recipe again (a new but equal object) reuses its graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = M.Linear(H, H)
    compiled_mod = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_mod, backend=counter)
    x = torch.randn(S, B, H)
    # one eager call first: the one-time shape check and the history resize to the recipe's length would each
    # invalidate the first graph otherwise (a re-trace of their own, not of the recipe)
    for mod in (eager, compiled_mod):
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
            mod(x)
    expected_frames = []
    for recipe in (CurrentScaling(), DelayedScaling(amax_history_len=4), None, CurrentScaling(),
                   DelayedScaling(amax_history_len=4)):
        outs = []
        for mod in (eager, compiled):
            with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                outs.append(mod(x))
        assert torch.equal(outs[0], outs[1])
        expected_frames.append(counter.frame_count)
    # current, delayed and FP8-off each traced once; the repeats reuse them
    assert expected_frames == [1, 2, 3, 3, 3]
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4, margin=1)):
        assert torch.equal(eager(x), compiled(x))
    assert counter.frame_count == 4
    _assert_state_equal(eager, compiled_mod)


def test_checkpoint_of_compiled_run_holds_pending_grad_amax():
    """A state_dict taken between a compiled backward and the next update stores the gradient amax in
    ``amax_history[:, 0]`` as eager mode would, without changing the live buffers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = M.Linear(H, H)
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, backend="aot_eager")
    x = torch.randn(S, B, H)
    for mod in (eager, compiled):
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
            y = mod(x)
        y.sum().backward()
    pending = compiled_mod.fp8_state.grad_amax.clone()
    assert pending.max() > 0
    assert torch.equal(eager.state_dict()["fp8_state.amax_history"], compiled_mod.state_dict()["fp8_state.amax_history"])
    assert torch.equal(compiled_mod.fp8_state.grad_amax, pending)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA meta checks of torch._scaled_mm run on a GPU")
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float32])
def test_compiled_layer_on_cuda_each_params_dtype(params_dtype, recipe):
    """``torch.compile`` (Inductor, as ``python -m fp8engine.bench layer`` compiles it) of the FP8
    ``TransformerLayer`` on CUDA with bf16 and fp32 parameters: it traces (the custom cast ops' fake ``scale_inv``
    stays float32 when current scaling passes a bf16 amax: a bf16 one made ``torch._scaled_mm``'s CUDA meta check
    refuse the graph) and two steps match eager mode. SQNR >= 25 dB: both run FP8 GEMMs, Inductor's fused ops round
    the high-precision parts differently and may flip single FP8 steps (torchao's bound for FP8 casts)."""
    from tests.conftest import sqnr

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = M.TransformerLayer(H, 4 * H, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=params_dtype, device="cuda")
    compiled = torch.compile(copy.deepcopy(eager))
    for step in range(2):
        x = torch.randn(S, B, H, device="cuda", dtype=params_dtype) * (step + 1)
        outs = []
        for mod in (eager, compiled):
            xi = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=RECIPES[recipe]()):
                y = mod(xi)
            y.float().square().mean().backward()
            outs.append((y.detach(), xi.grad))
        assert sqnr(outs[0][0], outs[1][0]) >= 25 and sqnr(outs[0][1], outs[1][1]) >= 25, step
    for st in _states(compiled):
        assert st.scale.dtype == torch.float32 and st.amax_history.dtype == torch.float32
