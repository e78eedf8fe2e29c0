"""The fused FP8 TransformerLayer step (``fp8engine.ops.layer``, ``TransformerLayer(fused=True)``) against the
composed sublayers (``fused=False``): the same kernels and GEMMs in the same math, so on CPU the same bits --
outputs, every gradient, and the FP8 scaling state after a few delayed-scaling steps. Plus: where it does not apply,
the composed path runs (and gives the same result as ``fused=False`` by construction)."""
import copy

import pytest
import torch

import fp8engine
from fp8engine.fp8.float8_tensor import kernels_forced
from fp8engine.kernels._common import interpreting
from fp8engine.modules import RotaryEmbedding, TransformerLayer
from tests.conftest import sqnr
import fp8engine.modules.transformer as transformer_mod

H, FFN, HEADS, S, B = 64, 128, 4, 16, 2


def _pair(seed=0, **kw):
    kw.setdefault("hidden_dropout", 0.0)
    kw.setdefault("attention_dropout", 0.0)
    torch.manual_seed(seed)
    fused = TransformerLayer(H, FFN, HEADS, **kw)
    composed = copy.deepcopy(fused)
    composed.fused = False
    return fused, composed


def _steps(layer, xs, recipe, rope=None, grads=None, is_first=None):
    """Forward + backward over ``xs`` (one FP8 region each, so delayed scaling updates between steps), from one RNG
    seed (dropout masks)."""
    torch.manual_seed(123)
    outs, x_grads = [], []
    for i, x0 in enumerate(xs):
        x = x0.clone().requires_grad_()
        with fp8engine.autocast(recipe=recipe):
            y = layer(x, rotary_pos_emb=rope, is_first_microbatch=None if is_first is None else is_first[i])
        y.backward(grads[i])
        outs.append(y.detach())
        x_grads.append(x.grad)
    return outs, x_grads


def _assert_same(fused, composed, xs, recipe, rope=None, is_first=None):
    grads = [torch.randn_like(x) for x in xs]
    calls = []
    real = transformer_mod.fused_layer
    transformer_mod.fused_layer = lambda *a: calls.append(1) or real(*a)
    try:
        out_f, dx_f = _steps(fused, xs, recipe, rope, grads, is_first)
    finally:
        transformer_mod.fused_layer = real
    assert len(calls) == len(xs), "the fused step did not run"
    out_c, dx_c = _steps(composed, xs, recipe, rope, grads, is_first)
    for a, b in zip(out_f + dx_f, out_c + dx_c):
        assert torch.equal(a, b)  # same ops on the same inputs: exact
    pf, pc = dict(fused.named_parameters()), dict(composed.named_parameters())
    for name in pf:
        assert torch.equal(pf[name].grad, pc[name].grad), name
    bf, bc = dict(fused.named_buffers()), dict(composed.named_buffers())
    for name in bf:  # amax histories and scales after the steps' updates
        assert torch.equal(bf[name], bc[name]), name


@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("kw", [dict(), dict(activation="swiglu", normalization="RMSNorm", num_gqa_groups=2),
                                dict(activation="relu", bias=False, zero_centered_gamma=True),
                                dict(self_attn_mask_type="no_mask"),
                                dict(hidden_dropout=0.3, attention_dropout=0.2)],
                         ids=["gelu-ln", "swiglu-rms-gqa", "relu-nobias-zc", "nomask", "dropout"])
@pytest.mark.parametrize("rope", [False, True], ids=["norope", "rope"])
def test_fused_step_equals_composed(recipe, kw, rope):
    fused, composed = _pair(**kw)
    xs = [torch.randn(S, B, H) for _ in range(3)]
    freqs = RotaryEmbedding(H // HEADS)(S) if rope else None
    _assert_same(fused, composed, xs, recipe, freqs)


def test_fused_step_bf16_partial_rotary_and_weight_caching():
    fused, composed = _pair(params_dtype=torch.bfloat16)
    xs = [torch.randn(S, B, H, dtype=torch.bfloat16) for _ in range(3)]
    freqs = RotaryEmbedding(8)(S)  # rotates 8 of the 16 head channels
    _assert_same(fused, composed, xs, fp8engine.DelayedScaling(), freqs, is_first=[True, False, False])


def test_fused_step_fuse_wgrad_accumulation():
    fused, composed = _pair(fuse_wgrad_accumulation=True)
    for layer in (fused, composed):
        for name, p in layer.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    xs = [torch.randn(S, B, H) for _ in range(2)]
    grads = [torch.randn_like(x) for x in xs]
    _steps(fused, xs, fp8engine.DelayedScaling(), grads=grads)
    _steps(composed, xs, fp8engine.DelayedScaling(), grads=grads)
    pc = dict(composed.named_parameters())
    for name, p in fused.named_parameters():
        if hasattr(p, "main_grad"):
            assert p.grad is None and torch.equal(p.main_grad, pc[name].main_grad), name
        else:
            assert torch.equal(p.grad, pc[name].grad), name


def test_fused_step_attention_dropout_draws_as_composed():
    fused, composed = _pair(attention_dropout=0.5)
    x = torch.randn(S, B, H)
    g = torch.randn_like(x)
    out = []
    for layer in (fused, composed):
        torch.manual_seed(7)
        xi = x.clone().requires_grad_()
        with fp8engine.autocast():
            y = layer(xi)
        y.backward(g)
        out.append((y, xi.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("kw, direct", [(dict(), True), (dict(attention_dropout=0.5), False),
                                        (dict(num_gqa_groups=2), False)], ids=["plain", "dropout", "gqa"])
def test_fused_step_calls_the_attention_ops_directly(kw, direct, monkeypatch):
    """Without dropout or GQA the fused step calls the fused SDPA backend's ops itself (ops.sdpa, no autograd node
    of their own); with them it records SDPA as a node (the results equal the composed layer's either way:
    test_fused_step_equals_composed)."""
    import fp8engine.ops.layer as layer_mod

    monkeypatch.setattr(layer_mod, "REPLAY", False)  # the ordinary Python's calls (a replay runs the ATen ops)
    calls = {"direct": 0, "node": 0}
    real_direct, real_node = layer_mod.sdpa_bwd, layer_mod._node_bwd
    monkeypatch.setattr(layer_mod, "sdpa_bwd", lambda *a: calls.__setitem__("direct", calls["direct"] + 1)
                        or real_direct(*a))
    monkeypatch.setattr(layer_mod, "_node_bwd", lambda *a: calls.__setitem__("node", calls["node"] + 1)
                        or real_node(*a))
    fused, _ = _pair(**kw)
    x = torch.randn(S, B, H, requires_grad=True)
    with fp8engine.autocast():
        y = fused(x)
    y.sum().backward()
    assert calls == ({"direct": 1, "node": 0} if direct else {"direct": 0, "node": 1})


def test_not_applicable_runs_the_composed_sublayers():
    """Separate q/k/v weights, block scaling, no FP8 region, a padding mask: no fused step where it does not apply;
    in eval mode under no_grad it applies (no backward state kept)."""
    calls = []
    real = transformer_mod.fused_layer
    transformer_mod.fused_layer = lambda *a: calls.append(1) or real(*a)
    try:
        x = torch.randn(S, B, 128)
        split = TransformerLayer(128, 256, 4, fuse_qkv_params=False)
        with fp8engine.autocast():
            split(x)
        padded = TransformerLayer(128, 256, 4, self_attn_mask_type="padding")
        with fp8engine.autocast():
            padded(x, attention_mask=torch.zeros(B, 1, 1, S, dtype=torch.bool))
        layer = TransformerLayer(128, 256, 4)
        layer(x)
        with fp8engine.autocast(recipe=fp8engine.Float8BlockScaling()):
            layer.eval()
            layer(x)
        assert calls == []
        with torch.no_grad(), fp8engine.autocast():
            y = layer(x)
        assert calls == [1] and y.grad_fn is None
    finally:
        transformer_mod.fused_layer = real


@pytest.mark.skipif(not interpreting(), reason="the Triton kernel path on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
def test_fused_step_equals_composed_on_the_kernel_path(recipe):
    """The Triton kernels (interpreted): norm kernels writing FP8, the QKV gradient kernel, the activation kernels."""
    fused, composed = _pair(params_dtype=torch.bfloat16)
    xs = [torch.randn(S, B, H, dtype=torch.bfloat16) for _ in range(2)]
    with kernels_forced():
        _assert_same(fused, composed, xs, recipe, RotaryEmbedding(H // HEADS)(S))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
def test_fused_step_close_to_composed_on_cuda(recipe):
    """On the GPU: the same kernels in the same order, as the training command runs them (fp32 master parameters,
    bf16 input under ``torch.autocast``). Forward: the same bits. Gradients: SDPA's backward on CUDA accumulates
    dq with atomics (its bits vary from run to run, in either path), and FP8 casts of gradients that differ in the
    last bit can round to neighbouring FP8 values: 25 dB (a few % of noise, far below what a real difference, such as
    a dropped residual gradient or a wrong rotary sign, gives) is asked of every gradient."""
    fused, composed = _pair(device="cuda")
    freqs = RotaryEmbedding(H // HEADS)(S).cuda()
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    out = []
    for layer in (fused, composed):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8engine.autocast(recipe=recipe):
            y = layer(xi, rotary_pos_emb=freqs)
        y.backward(g)
        out.append((y.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    assert torch.equal(out[0][0], out[1][0])
    assert sqnr(out[1][1], out[0][1]) > 25
    for name, grad in out[1][2].items():
        assert sqnr(grad, out[0][2][name]) > 25, name


# -- autograd semantics (issue 44): retain_graph, torch.autograd.grad, hooks, create_graph ----------------------------

_RECIPES = pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                                   ids=["delayed", "current"])
#: Three steps: the first records the fused step, the later ones replay it (ops.replay), where it is replayed.
_STEPS = 3


def _fresh_programs(monkeypatch, replay: bool) -> tuple[list, list]:
    """A new, empty replay cache (so the first step records and the later ones replay), replay on or off; returns
    the lists the fused step's calls and the replayed backwards (``Pair.backward``) are counted in."""
    import fp8engine.ops.layer as layer_mod

    monkeypatch.setattr(layer_mod, "_PROGRAMS", type(layer_mod._PROGRAMS)())
    monkeypatch.setattr(layer_mod, "REPLAY", replay)
    calls, real = [], transformer_mod.fused_layer
    monkeypatch.setattr(transformer_mod, "fused_layer", lambda *a: calls.append(1) or real(*a))
    replayed, real_bwd = [], layer_mod.replay.Pair.backward
    monkeypatch.setattr(layer_mod.replay.Pair, "backward", lambda *a: replayed.append(1) or real_bwd(*a))
    return calls, replayed


def _grads(layer, x):
    return [x.grad] + [p.grad for p in layer.parameters()]


def _run(layer, x0, g, recipe, backwards: int, rope=None):
    """One step: forward, then ``backwards`` backward calls of ``g`` (all but the last with retain_graph); the
    input's and the parameters' gradients (reset before the step)."""
    layer.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    with fp8engine.autocast(recipe=recipe):
        y = layer(x, rotary_pos_emb=rope)
    for i in range(backwards):
        y.backward(g, retain_graph=i + 1 < backwards)
    return _grads(layer, x)


def _assert_state_equal(a, b):
    """The FP8 scaling state (amax histories, scales) of two layers: exact."""
    bb = dict(b.named_buffers())
    for name, buf in a.named_buffers():
        assert torch.equal(buf, bb[name]), name


@_RECIPES
@pytest.mark.parametrize("path, kw, replay", [
    ("fused", dict(), True),
    ("fused", dict(), False),
    ("fused", dict(hidden_dropout=0.3, attention_dropout=0.2, num_gqa_groups=2), True),
    ("composed", dict(), True),
], ids=["fused-replay", "fused-noreplay", "fused-dropout-gqa", "composed"])
def test_second_backward_with_retain_graph_accumulates_twice(recipe, path, kw, replay, monkeypatch):
    """``backward(retain_graph=True)`` then ``backward()``: every gradient exactly twice one backward's (the second
    backward recomputes the same bits, and ``g + g == 2 g`` exactly), and the FP8 state equal to one backward's
    (delayed scaling max-accumulates the same gradient amaxes again), step after step -- on the recorded step, the
    replayed one, and the plain Python (``replay`` False; dropout and GQA: SDPA and dropout as nodes, kept too).
    The reference: ``fused=False`` with one backward (equal to the fused step's bits: test_fused_step_equals_composed)."""
    calls, replayed = _fresh_programs(monkeypatch, replay)
    layer, reference = _pair(**kw)
    layer.fused = path == "fused"
    rope = RotaryEmbedding(H // HEADS)(S)
    for step in range(_STEPS):
        x, g = torch.randn(S, B, H), torch.randn(S, B, H)
        torch.manual_seed(step)  # (the same dropout masks in both)
        twice = _run(layer, x, g, recipe, 2, rope)
        torch.manual_seed(step)
        once = _run(reference, x, g, recipe, 1, rope)
        for i, (a, b) in enumerate(zip(twice, once)):
            assert torch.equal(a, 2 * b), (step, i)
        _assert_state_equal(layer, reference)
    assert len(calls) == (_STEPS if path == "fused" else 0), "the fused step did not run"
    # replayed: the steps after the first, both backwards each (dropout and GQA are not replayed)
    assert len(replayed) == (2 * (_STEPS - 1) if path == "fused" and replay and not kw else 0)


@_RECIPES
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "noreplay"])
def test_autograd_grad_equals_composed(recipe, replay, monkeypatch):
    """``torch.autograd.grad`` twice on one graph (``retain_graph=True``, then ``create_graph=False``): both equal
    ``fused=False``'s one ``torch.autograd.grad``, nothing is accumulated into ``.grad``, and the FP8 state equals
    the composed layer's."""
    calls, replayed = _fresh_programs(monkeypatch, replay)
    fused, composed = _pair()
    for step in range(_STEPS):
        x0, g = torch.randn(S, B, H), torch.randn(S, B, H)
        out = []
        for layer, grad_calls in ((fused, ({"retain_graph": True}, {"create_graph": False})), (composed, ({},))):
            x = x0.clone().requires_grad_()
            with fp8engine.autocast(recipe=recipe):
                y = layer(x)
            inputs = [x, *layer.parameters()]
            out.append([torch.autograd.grad(y, inputs, g, **kw) for kw in grad_calls])
            assert all(t.grad is None for t in inputs)
        (first, second), (ref,) = out
        for i, (a, b, c) in enumerate(zip(first, second, ref)):
            assert torch.equal(a, c) and torch.equal(b, c), (step, i)
        _assert_state_equal(fused, composed)
    assert len(calls) == _STEPS and len(replayed) == (2 * (_STEPS - 1) if replay else 0)


@_RECIPES
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "noreplay"])
def test_backward_after_the_graph_was_freed_raises(recipe, replay, monkeypatch):
    """``backward(retain_graph=True)``, ``backward()`` (frees the graph), then a third ``backward()``: PyTorch's
    usual RuntimeError, as the composed layer raises -- recorded and replayed steps alike."""
    calls, replayed = _fresh_programs(monkeypatch, replay)
    fused, composed = _pair()
    for _ in range(_STEPS):
        x = torch.randn(S, B, H, requires_grad=True)
        for layer in (fused, composed):
            with fp8engine.autocast(recipe=recipe):
                y = layer(x)
            y.backward(torch.ones_like(y), retain_graph=True)
            y.backward(torch.ones_like(y))
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                y.backward(torch.ones_like(y))
    assert len(calls) == _STEPS and len(replayed) == (2 * (_STEPS - 1) if replay else 0)


@_RECIPES
def test_backward_hooks_fire_on_each_backward(recipe, monkeypatch):
    """Hooks on the output (scaling its gradient), on parameters (scaling theirs) and a module full backward hook,
    over two backwards of one graph: each backward's hooked gradients equal ``fused=False``'s one backward's."""
    calls, replayed = _fresh_programs(monkeypatch, True)
    fused, composed = _pair()
    for step in range(_STEPS):
        x0, g = torch.randn(S, B, H), torch.randn(S, B, H)
        seen = []
        for layer, backwards in ((fused, 2), (composed, 1)):
            layer.zero_grad(set_to_none=True)
            module_grads = []
            handle = layer.register_full_backward_hook(lambda m, gin, gout: module_grads.append((gin[0], gout[0])))
            params = dict(layer.named_parameters())
            hooks = [params["layernorm_mlp.fc1_weight"].register_hook(lambda t: 3 * t),
                     params["self_attention.layernorm_qkv.layer_norm_weight"].register_hook(lambda t: -t)]
            x = x0.clone().requires_grad_()
            with fp8engine.autocast(recipe=recipe):
                y = layer(x)
            y.register_hook(lambda t: 0.5 * t)
            for i in range(backwards):
                y.backward(g, retain_graph=i + 1 < backwards)
            for h in [handle, *hooks]:
                h.remove()
            seen.append((_grads(layer, x), module_grads))
        (twice, hooked_f), (once, hooked_c) = seen
        for i, (a, b) in enumerate(zip(twice, once)):
            assert torch.equal(a, 2 * b), (step, i)
        assert len(hooked_f) == 2 and len(hooked_c) == 1
        for gin, gout in hooked_f:
            assert torch.equal(gin, hooked_c[0][0]) and torch.equal(gout, hooked_c[0][1])
        _assert_state_equal(fused, composed)
    assert len(calls) == _STEPS and len(replayed) == 2 * (_STEPS - 1)


@_RECIPES
def test_double_backward_raises(recipe, monkeypatch):
    """``create_graph=True`` through the fused step: a RuntimeError that says so and names what works (the
    FP8 backward records no graph: its gradients could not be differentiated again; a gradient penalty would
    silently miss its second-order term). The composed layer raises a RuntimeError as well (a less clear one)."""
    calls, _ = _fresh_programs(monkeypatch, True)
    fused, composed = _pair()
    x = torch.randn(S, B, H, requires_grad=True)
    for layer in (fused, composed):
        with fp8engine.autocast(recipe=recipe):
            y = layer(x)
        with pytest.raises(RuntimeError, match=r"no double backward \(create_graph=True\)" if layer is fused
                           else None):
            torch.autograd.grad((y * y).sum(), x, create_graph=True)
    assert len(calls) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@_RECIPES
@pytest.mark.parametrize("kw", [dict(), dict(num_gqa_groups=2)], ids=["direct-sdpa", "gqa-node"])
def test_second_backward_on_cuda(recipe, kw, monkeypatch):
    """On the GPU (Triton kernels, cuBLASLt, SDPA's backward op called directly or SDPA as a node; recorded then
    replayed steps): a second backward of a retained graph adds what the first added, and a third raises. SDPA's
    backward accumulates dq with atomics on CUDA (bits vary from run to run), so each gradient is asked for 25 dB
    against twice the first backward's, as test_fused_step_close_to_composed_on_cuda asks of fused vs composed (a
    buffer the first backward freed or overwrote gives noise or an error); the amax histories after the second
    backward within 1% of those after the first (max-accumulated again over nearly the same gradients)."""
    calls, replayed = _fresh_programs(monkeypatch, True)
    layer, _ = _pair(device="cuda", **kw)
    freqs = RotaryEmbedding(H // HEADS)(S).cuda()
    for step in range(_STEPS):
        layer.zero_grad(set_to_none=True)
        x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn_like(x)
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8engine.autocast(recipe=recipe):
            y = layer(x, rotary_pos_emb=freqs)
        y.backward(g, retain_graph=True)
        first = [t.clone() for t in _grads(layer, x)]
        state = {n: b.clone() for n, b in layer.named_buffers()}
        y.backward(g)
        for i, (a, b) in enumerate(zip(_grads(layer, x), first)):
            assert sqnr(2 * b.float(), a.float()) > 25, (step, i)
        for n, b in layer.named_buffers():
            assert torch.allclose(b, state[n], rtol=0.01), n
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            y.backward(g)
    assert len(calls) == _STEPS and len(replayed) == (2 * (_STEPS - 1) if not kw else 0)
