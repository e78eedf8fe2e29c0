"""make_graphed_callables: a TransformerLayer's FP8 forward+backward captured in CUDA graphs gives the eager
results, and delayed scaling keeps updating (CUDA only)."""
import copy

import pytest
import torch

import fp8engine as fe
from fp8engine.modules.graph import make_graphed_callables
from fp8engine.modules.transformer import TransformerLayer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@cuda
def test_graphed_layer_matches_eager():
    torch.manual_seed(0)
    layer = TransformerLayer(256, 1024, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                             device="cuda")
    eager = copy.deepcopy(layer)
    x = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    recipe = fe.DelayedScaling(amax_history_len=4)
    graphed = make_graphed_callables(layer, (x,), fp8_recipe=recipe, num_warmup_iters=3)
    eager.load_state_dict(layer.state_dict())  # same weights and FP8 state (histories, scales) as after capture
    for step in range(3):
        # Per step: the graphed backward hands out its static gradient buffers, which autograd may adopt as
        # .grad, so accumulating across replays is the caller's job (as with torch.cuda.make_graphed_callables).
        for p in list(layer.parameters()) + list(eager.parameters()):
            p.grad = None
        dy = torch.randn_like(x)
        with fe.autocast(recipe=recipe):
            yg = graphed(x)
        yg.backward(dy)
        with fe.autocast(recipe=recipe):
            ye = eager(x)
        ye.backward(dy)
        # Same kernels on the same inputs: identical up to cuBLAS run-to-run determinism.
        torch.testing.assert_close(yg, ye, rtol=0, atol=0)
        for (name, a), b in zip(layer.named_parameters(), eager.parameters()):
            # same kernels and inputs; bf16 atomics-free reductions: equal up to bf16 rounding of reordering
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-2, atol=1e-2, msg=name)
    for sa, sb in zip([m for m in layer.modules() if isinstance(m, fe.ScalingState)],
                      [m for m in eager.modules() if isinstance(m, fe.ScalingState)]):
        torch.testing.assert_close(sa.scale, sb.scale, rtol=0, atol=0)  # scales kept updating in the graph


def test_needs_cuda_args():
    layer = fe.Linear(16, 16)
    with pytest.raises(ValueError, match="CUDA"):
        make_graphed_callables(layer, (torch.randn(4, 16),))
