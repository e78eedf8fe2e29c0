"""make_graphed_callables: a TransformerLayer's FP8 forward+backward captured in CUDA graphs gives the eager
results, and delayed scaling keeps updating (CUDA); the tuple form (several modules, one sample-args tuple each)
likewise; on CPU nothing is captured and the returned callables compute exactly what the modules do."""
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


@cuda
def test_graphed_tuple_matches_eager():
    """Two modules captured together (one memory pool, torch.cuda.make_graphed_callables' tuple form) and
    chained: each graphed callable gives its eager module's results and keeps its scales updating."""
    torch.manual_seed(0)
    mods = (fe.LayerNormLinear(256, 512, params_dtype=torch.bfloat16, device="cuda"),
            fe.Linear(512, 256, params_dtype=torch.bfloat16, device="cuda"))
    eager = copy.deepcopy(mods)
    x = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(128, 2, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    recipe = fe.DelayedScaling(amax_history_len=4)
    graphed = make_graphed_callables(mods, ((x,), (h,)), fp8_recipe=recipe, num_warmup_iters=3)
    assert isinstance(graphed, tuple) and len(graphed) == 2
    for m, e in zip(mods, eager):
        e.load_state_dict(m.state_dict())
    for step in range(3):
        for p in [p for m in mods + eager for p in m.parameters()]:
            p.grad = None
        dy = torch.randn_like(x)
        outs = []
        for first, second in (graphed, eager):
            with fe.autocast(recipe=recipe):
                y = second(first(x))
            y.backward(dy)
            outs.append(y)
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        for m, e in zip(mods, eager):
            for (name, a), b in zip(m.named_parameters(), e.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-2, atol=1e-2, msg=name)
    for m, e in zip(mods, eager):
        torch.testing.assert_close(m.fp8_state.scale, e.fp8_state.scale, rtol=0, atol=0)


def _cpu_pair(seed=0):
    torch.manual_seed(seed)
    return (fe.LayerNormLinear(64, 96), fe.Linear(96, 48))


@pytest.mark.parametrize("recipe", [fe.DelayedScaling(amax_history_len=4), fe.CurrentScaling()],
                         ids=["delayed", "current"])
def test_tuple_on_cpu_runs_the_modules_eagerly(recipe):
    """CPU sample_args: nothing is captured (a warning says so); the tuple form returns one callable per module,
    in order, computing exactly what the ungraphed modules compute under fp8_autocast, FP8 state included."""
    mods, ref = _cpu_pair(), _cpu_pair()
    x, h = torch.randn(16, 2, 64, requires_grad=True), torch.randn(16, 2, 96, requires_grad=True)
    with pytest.warns(UserWarning, match="no CUDA graph"):
        graphed = make_graphed_callables(mods, ((x,), (h,)), fp8_recipe=recipe)
    assert isinstance(graphed, tuple) and len(graphed) == 2
    assert graphed[0].graphed is mods[0] and graphed[1].graphed is mods[1]
    for step in range(3):
        xs = torch.randn(16, 2, 64) * (step + 1)
        outs = []
        for first, second in (graphed, ref):
            xi = xs.clone().requires_grad_()
            with fe.fp8_autocast(fp8_recipe=recipe):
                y = second(first(xi))
            y.square().mean().backward()
            outs.append((y.detach(), xi.grad))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=0)
    for m, r in zip(mods, ref):
        for k, v in r.state_dict().items():
            assert torch.equal(m.state_dict()[k], v), k
        for a, b in zip(m.parameters(), r.parameters()):
            assert torch.equal(a.grad, b.grad)
    # the calling contract of a captured module holds on CPU too
    with pytest.raises(ValueError, match="same recipe"):
        graphed[0](x)
    with fe.fp8_autocast(fp8_recipe=fe.DelayedScaling(amax_history_len=8)), pytest.raises(ValueError, match="same"):
        graphed[0](x)


def test_single_module_on_cpu_returns_one_callable():
    lin = fe.Linear(64, 48)
    x = torch.randn(16, 64)
    with pytest.warns(UserWarning, match="no CUDA graph"):
        graphed = make_graphed_callables(lin, (x,), fp8_enabled=False)
    assert not isinstance(graphed, tuple) and graphed.graphed is lin
    torch.testing.assert_close(graphed(x), lin(x), rtol=0, atol=0)
    with fe.fp8_autocast(), pytest.raises(ValueError, match="fp8_enabled=False"):
        graphed(x)


@pytest.mark.parametrize("modules,sample_args,match", [
    (lambda: _cpu_pair(), lambda: (torch.randn(4, 64), torch.randn(4, 96)), r"sample_args\[0\] is a Tensor"),
    (lambda: _cpu_pair(), lambda: ((torch.randn(4, 64),),), "tuple of 2 tuples of tensors"),
    (lambda: _cpu_pair(), lambda: ((torch.randn(4, 64),), [torch.randn(4, 96)]), r"sample_args\[1\] is a list"),
    (lambda: _cpu_pair(), lambda: ((torch.randn(4, 64),), (3,)), r"sample_args\[1\] holds a non-tensor \(int\)"),
    (lambda: fe.Linear(64, 48), lambda: [torch.randn(4, 64)], "sample_args is a list"),
    (lambda: (fe.Linear(64, 48), lambda t: t), lambda: ((torch.randn(4, 64),), (torch.randn(4, 48),)),
     "nn.Module"),
    (lambda: (), lambda: (), "empty"),
])
def test_bad_arguments(modules, sample_args, match):
    with pytest.raises(TypeError, match=match):
        make_graphed_callables(modules(), sample_args())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA and CPU tensors to mix")
def test_mixed_devices_refused():
    with pytest.raises(ValueError, match="mix CUDA and CPU"):
        make_graphed_callables(_cpu_pair(), ((torch.randn(4, 64),), (torch.randn(4, 96, device="cuda"),)))
