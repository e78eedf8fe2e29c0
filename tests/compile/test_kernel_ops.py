"""The Triton kernels' custom ops (:mod:`fp8engine.ops.kernel_ops`): schema, fake implementation and declared
mutation (``torch.library.opcheck``), bits equal to the launchers they wrap, and a compiled ``LayerNormMLP`` that
calls them (on CPU their plain-PyTorch references; the test forces the op path, which CUDA takes by itself)."""
import copy

import pytest
import torch

import fp8engine.modules as M
import fp8engine.ops.mlp as mlp_ops
from fp8engine.fp8.autocast import fp8_autocast
from fp8engine.kernels import activation as ka
from fp8engine.ops.kernel_ops import ACT_KINDS, act_bwd_fp8, act_fwd_fp8
from fp8engine.recipe import DelayedScaling
from tests.conftest import DEVICES, sqnr

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _inputs(kind, device, rows=64, cols=96):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, 2 * cols if kind == "swiglu" else cols, generator=g) * 3).to(device, torch.bfloat16)
    da = torch.randn(rows, cols, generator=g).to(device, torch.bfloat16)
    return h, da


@pytest.mark.parametrize("kind", list(ACT_KINDS))
def test_opcheck(kind):
    """Schema, fake (meta) outputs, declared mutation of ``amax`` and autograd registration agree (CPU)."""
    h, da = _inputs(kind, "cpu")
    scale = torch.tensor([4.0])
    torch.library.opcheck(act_fwd_fp8, (h, kind, scale, E4M3, torch.zeros(1)))
    torch.library.opcheck(act_bwd_fp8, (da, h, kind, scale, E5M2, torch.zeros(1)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(ACT_KINDS))
def test_ops_equal_the_launchers(kind, device):
    """Exact: the op returns the launcher's outputs (the kernel on CUDA, its reference elsewhere) and max-accumulates
    the same amax."""
    h, da = _inputs(kind, device)
    scale = torch.tensor([4.0], device=device)
    fwd, bwd = (getattr(ka, n if device == "cuda" else n + "_reference") for n in ACT_KINDS[kind])
    amax_op, amax_ref = torch.full((1,), 0.5, device=device), torch.full((1,), 0.5, device=device)
    y8, sinv = act_fwd_fp8(h, kind, scale, E4M3, amax_op)
    _, y8_ref, sinv_ref = fwd(h, scale=scale, fp8_dtype=E4M3, amax_out=amax_ref)
    assert torch.equal(y8.view(torch.uint8), y8_ref.view(torch.uint8)) and torch.equal(sinv, sinv_ref)
    assert torch.equal(amax_op, amax_ref) and amax_op.item() > 0.5
    amax_op.zero_(), amax_ref.zero_()
    out = act_bwd_fp8(da, h, kind, scale, E5M2, amax_op)
    ref = bwd(da, h, scale, E5M2, amax_ref)
    for a, b in zip(out, ref):
        assert torch.equal(a.view(torch.uint8) if a.dtype == E5M2 else a, b.view(torch.uint8) if b.dtype == E5M2 else b)
    assert torch.equal(amax_op, amax_ref)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_compiled_mlp_through_the_ops(monkeypatch, activation):
    """A compiled ``LayerNormMLP`` (Inductor, CPU) taking the op path, three delayed-scaling steps against eager mode:
    outputs and input gradients within 30 dB (the ops run the activation reference's formula, eager mode's torch
    path ``F.gelu`` / ``F.silu``: the same function rounded differently, then FP8-cast; one FP8 step on an element is
    ~2^-4 relative for e4m3), the activation rows of the FP8 state (fc2's input, fc1's grad_output) to 1 %."""
    torch._dynamo.reset()
    calls = []
    real = mlp_ops.act_fwd_fp8

    def counting(*args):
        calls.append(args[1])
        return real(*args)

    monkeypatch.setattr(mlp_ops, "compiled_kernel_ops", lambda x: torch.compiler.is_compiling())
    monkeypatch.setattr(mlp_ops, "act_fwd_fp8", counting)
    torch.manual_seed(0)
    eager = M.LayerNormMLP(64, 128, activation=activation)
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, fullgraph=True)
    recipe = DelayedScaling(amax_history_len=4)
    for step in range(3):
        x = torch.randn(16, 2, 64) * (step + 1)
        outs = []
        for mod in (eager, compiled):
            xi = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=recipe):
                y = mod(xi)
            y.square().mean().backward()
            outs.append((y.detach(), xi.grad))
            mod.zero_grad(set_to_none=True)
        assert sqnr(outs[0][0], outs[1][0]) > 30 and sqnr(outs[0][1], outs[1][1]) > 30, step
    assert calls, "the compiled forward did not call the custom op"
    from fp8engine.fp8.library import fold_grad_amax

    fold_grad_amax([compiled_mod.fp8_state])
    torch.testing.assert_close(compiled_mod.fp8_state.scale, eager.fp8_state.scale, rtol=1e-2, atol=0)
