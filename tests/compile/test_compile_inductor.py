"""``torch.compile`` with Inductor (the default backend) of FP8 modules and the GPT (issue 18); CPU, and CUDA where
a GPU is present (a ``Linear``, and a ``TransformerLayer`` under ``mode="reduce-overhead"``).

Inductor generates its own kernels for everything but the GEMMs, and its partitioner may recompute forward values in
the backward, which ``aot_eager`` (``test_compile_fp8.py``) never does. That recomputation is what broke delayed
scaling under Inductor: the backward re-cast the weight from the scale buffer that the autocast exit had updated
since the forward (dgrad scaled by new / old scale; the fix and its story: :mod:`fp8engine.fp8.library`).

What Inductor computes bit for bit like eager mode on the CPU: FP8 casts (multiply by the scale, clamp, round to
nearest even), amax, the scale update and the FP8 GEMMs (ATen's ``_scaled_mm``): a compiled ``Linear`` matches
eager mode exactly except its bias gradient, a column sum that Inductor reduces in another order. Its fused layer
norms, softmax and GELU differ from ATen's in the last bit, so a model's losses differ at first by an ulp; FP8
training then amplifies such ulps, as eager mode does with itself (measured in ``test_gpt_20_steps_inductor``).
"""
import copy
import dataclasses

import pytest
import torch

import fp8engine.modules as M
from fp8engine.fp8.autocast import FP8Context, fp8_autocast, recompute_context
from fp8engine.fp8.library import fold_grad_amax, frozen_scale
from fp8engine.fp8.state import ScalingState
from fp8engine.models import GPT
from tests.compile.test_compile_fp8 import B, H, RECIPES, S, TINY



def _states(model):
    return [m for m in model.modules() if isinstance(m, ScalingState)]


def test_frozen_scale_op():
    """The custom op's fake (meta) implementation, schema and autograd registration agree with its eager kernel."""
    torch.library.opcheck(frozen_scale, (torch.rand(3) + 0.5,))
    scale = torch.rand(3) + 0.5
    frozen = frozen_scale(scale)
    scale.mul_(2)
    assert torch.equal(frozen * 2, scale)  # a copy, not a view


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_linear_inductor_equals_eager(recipe, device):
    """Three steps, the input growing each step (its delayed scale changes between each forward and backward, and
    at step 1 the weight's too). CPU: with SGD on the weight (its scale changes every step), output, input and
    weight gradients and the FP8 state bit-identical to eager mode. CUDA: eager mode runs the Triton cast kernels
    where the compiled code runs Inductor's casts: 40 dB (room for one FP8 step on a few elements), state to 1e-5.
    Before the frozen scale, delayed scaling's first input gradient was off by the weight's new scale (3.6e3x)."""
    from tests.conftest import sqnr

    cpu = device.type == "cpu"
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = M.Linear(H, H, device=device)
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, fullgraph=True)
    # SGD on the weight only: the bias gradient is not bit-identical (below), the rest must stay so
    opts = [torch.optim.SGD([m.weight], lr=0.5) for m in (eager, compiled_mod)] if cpu else [None, None]
    for step in range(3):
        x = torch.randn(S, B, H, device=device) * (step + 1)
        outs = []
        for mod, opt in zip((eager, compiled), opts):
            xi = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=RECIPES[recipe]()):
                y = mod(xi)
            y.square().mean().backward()
            outs.append((y.detach(), xi.grad, mod.weight.grad.clone(), mod.bias.grad.clone()))
            if opt is not None:
                opt.step()
            mod.zero_grad(set_to_none=True)
        (y0, dx0, dw0, db0), (y1, dx1, dw1, db1) = outs
        if cpu:
            assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(dw0, dw1), step
        else:
            assert min(sqnr(y0, y1), sqnr(dx0, dx1), sqnr(dw0, dw1)) > 40, step
        # dbias = dy.sum(0) over M = S*B rows in Inductor's order: within the float32 summation bound
        # M * eps * sum |dy| (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2), dy = 2 y / numel
        dy_abs = (2 * y0 / y0.numel()).abs().reshape(-1, H)
        bound = dy_abs.shape[0] * torch.finfo(torch.float32).eps * dy_abs.sum(0)
        assert ((db1 - db0).abs() <= (bound if cpu else 1e-2 * dy_abs.sum(0))).all(), step
    fold_grad_amax(_states(compiled_mod))
    sd0, sd1 = eager.fp8_state.state_dict(), compiled_mod.fp8_state.state_dict()
    for k in sd0:
        torch.testing.assert_close(sd1[k], sd0[k], rtol=0 if cpu else 1e-5, atol=0, msg=k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_transformer_layer_reduce_overhead_cuda(recipe):
    """``mode="reduce-overhead"`` (Inductor's CUDA graphs) of a ``TransformerLayer`` in bf16 autocast, three
    steps: the FP8 state updated between forward and backward by the autocast exit (outside the graphs) is read by
    the replays as eager mode reads it. Outputs and input gradients within 25 dB of eager mode (bf16 intermediates
    rounded by other kernels, then FP8; the layer tests' own bound against a bf16 reference is 18 dB), FP8 scales
    within 1 %."""
    from tests.conftest import sqnr

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = M.TransformerLayer(H, 4 * H, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cuda")
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, mode="reduce-overhead", fullgraph=True)
    for step in range(3):
        x = torch.randn(S, B, H, device="cuda") * (step + 1)
        outs = []
        for mod in (eager, compiled):
            torch.compiler.cudagraph_mark_step_begin()
            xi = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16), fp8_autocast(fp8_recipe=RECIPES[recipe]()):
                y = mod(xi)
            y.float().square().mean().backward()
            outs.append((y.detach().float().clone(), xi.grad.clone()))
            # as a training loop does between steps: the weight gradients are outputs of the backward's CUDA graph,
            # which the next replay overwrites, so accumulating into them across steps would read freed memory
            # (torch raises "accessing tensor output of CUDAGraphs that has been overwritten")
            mod.zero_grad(set_to_none=True)
        assert sqnr(outs[0][0], outs[1][0]) > 25 and sqnr(outs[0][1], outs[1][1]) > 25, step
    fold_grad_amax(_states(compiled_mod))
    for s0, s1 in zip(_states(eager), _states(compiled_mod)):
        torch.testing.assert_close(s1.scale, s0.scale, rtol=1e-2, atol=0)


def _train(model, step_fn, recipe, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(0))
    # one forward that records nothing and updates nothing: the modules' one-time shape check and the histories'
    # resize to the recipe's length happen here, not in the first compiled call (one Inductor compile, not two)
    with torch.no_grad(), recompute_context(FP8Context(recipe)):
        step_fn(tokens[:, :-1], tokens[:, 1:])
    losses, states = [], []
    for step in range(steps):  # one batch, learned by heart: the loss must fall
        with fp8_autocast(fp8_recipe=recipe):
            loss = step_fn(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 2:
            fold_grad_amax(_states(model))
            states.append({k: v.clone() for k, v in model.state_dict().items() if "fp8_state" in k})
    fold_grad_amax(_states(model))
    states.append({k: v.clone() for k, v in model.state_dict().items() if "fp8_state" in k})
    return losses, states


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpt_20_steps_inductor(recipe):
    """20 AdamW steps of the tiny GPT in FP8, Inductor against eager mode.

    Measured (CPU, torch 2.13, 2 cores; max over steps of |loss_compiled / loss_eager - 1|): steps 1-3 agree to
    2e-7 (an ulp: Inductor's layer norm, softmax and GELU); over 20 steps 8e-4 (delayed) and 2e-4 (current), once an
    ulp moved an FP8 rounding. Eager mode against itself with one weight vector (``final_norm.weight``) nudged by
    one ulp drifts as far: 9e-4 (delayed), 1.9e-3 (current), against 3e-7 for the same two runs in float32.
    So the bounds: 1e-5 for steps 1-3, 5e-3 for all 20. The bug this file guards against gave 2.6e-2 at step 2.
    FP8 state after step 3 equal to 1e-5. After 20 steps the scales follow the drift: measured up to 1.2e-2 apart
    for inputs and weights, 0.11 for gradients (delayed), bounded by 5e-2 and 0.5; the bug gave a factor 3.6e3.
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = GPT(dataclasses.replace(TINY, n_layer=1))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    l0, s0 = _train(eager, eager, RECIPES[recipe](), 20)
    l1, s1 = _train(compiled_model, compiled, RECIPES[recipe](), 20)
    rel = [abs(b / a - 1) for a, b in zip(l0, l1)]
    assert max(rel[:3]) < 1e-5, rel
    assert max(rel) < 5e-3, rel
    assert l1[-1] < 0.5 * l1[0]
    for k in s0[0]:
        torch.testing.assert_close(s1[0][k], s0[0][k], rtol=1e-5, atol=0, msg=k)
    roles = {f"{name}.scale": st.is_grad for name, st in eager.named_modules() if isinstance(st, ScalingState)}
    for k in s0[1]:
        if k.endswith("update_step"):
            assert torch.equal(s1[1][k], s0[1][k])
        elif k.endswith("scale"):
            grad = torch.tensor([roles[k](i) for i in range(len(s0[1][k]))])
            rel = (s1[1][k] / s0[1][k] - 1).abs()
            assert (rel[~grad] < 5e-2).all() and (rel[grad] < 0.5).all(), (k, rel)
