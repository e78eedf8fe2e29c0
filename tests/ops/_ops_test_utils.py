"""Helpers of the ops tests: states with non-trivial scales, the fixture that runs the ops' Triton-kernel path
on CPU under TRITON_INTERPRET=1 (import ``force_kernels`` into a test module to use it), and the replay tests'
recording helper and check-mode-off fixture (import ``replay_unchecked`` to use it)."""
import contextlib
import os

import pytest
import torch

import fp8engine
from fp8engine.fp8.autocast import FP8Context
from fp8engine.fp8.float8_tensor import _FORCE_KERNELS, kernels_forced
from fp8engine.fp8.quantizer import get_quantizers
from fp8engine.fp8.state import ScalingState
from fp8engine.kernels import kernels_available
from fp8engine.ops import replay, replay_cache
from fp8engine.recipe import CurrentScaling, DelayedScaling


#: the interpreter evaluates masked-off lanes too (numpy overflow warnings on garbage lanes)
IGNORE_INTERPRETER_WARNINGS = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.fixture
def force_kernels():
    """Make the backend predicate (``fp8engine.fp8.float8_tensor.use_kernels``) pick the Triton kernels for CPU
    tensors (the interpreter): the GPU code path, run in CI. Call the returned function with True/False to switch."""
    if not (os.environ.get("TRITON_INTERPRET") == "1" and kernels_available("cpu")):
        pytest.skip("needs Triton with TRITON_INTERPRET=1 (set by tests/conftest.py when there is no GPU)")
    tokens = []

    def switch(on: bool):
        tokens.append(_FORCE_KERNELS.set(bool(on)))

    yield switch
    for token in reversed(tokens):
        _FORCE_KERNELS.reset(token)


def make_state(roles, delayed: bool, seed: int = 0):
    """A ScalingState with non-trivial scales (powers of two and not) and its quantizers (HYBRID format, amaxes
    recorded): ``(state, (LinearQuantizers per GEMM))``."""
    st = ScalingState(roles, amax_history_len=4)
    g = torch.Generator().manual_seed(seed)
    st.scale.copy_(torch.rand(len(roles), generator=g) * 30 + 0.5)
    recipe = DelayedScaling(amax_history_len=4) if delayed else CurrentScaling()
    return st, get_quantizers(st, FP8Context(recipe))


@pytest.fixture(autouse=True)
def replay_unchecked(monkeypatch):
    """``FP8ENGINE_REPLAY=check`` off, whatever the environment says: the replay tests look at the stored programs
    themselves (check mode stores them as ``replay_cache.Checked``); the check-mode tests turn it on themselves."""
    monkeypatch.setattr(replay_cache, "CHECK", False)


def record(fn, *inputs):
    """``(recorder, outputs)`` of ``fn(*inputs)`` run under a :class:`fp8engine.ops.replay.Recorder`."""
    rec = replay.Recorder(inputs)
    with rec:
        out = fn(*inputs)
    return rec, out


def replay_layer_steps(layer, xs, gs, recipe, on: bool, rope=None, kernels: bool = False, keep_cache: bool = False,
                       **autocast):
    """Forward + backward steps of a ``TransformerLayer`` on inputs ``xs`` / output gradients ``gs`` with the fused
    step's replay ``on`` / off, from an empty program cache (``fp8engine.ops.layer._PROGRAMS``), under
    ``fp8engine.autocast(recipe=recipe)`` (and ``torch.autocast(**autocast)`` when given; ``kernels``: the Triton
    path, forced on CPU). Returns ``(outputs and input gradients per step, the cache's entries, its recordings)``;
    the cache is emptied after unless ``keep_cache`` (a test that replays the kept program next)."""
    import fp8engine.ops.layer as layer_mod

    layer_mod._PROGRAMS.clear()
    saved = layer_mod.REPLAY
    layer_mod.REPLAY = on
    out = []
    try:
        with kernels_forced() if kernels else contextlib.nullcontext():
            for x0, g in zip(xs, gs):
                x = x0.clone().requires_grad_()
                with torch.autocast(**autocast) if autocast else contextlib.nullcontext(), \
                        fp8engine.autocast(recipe=recipe):
                    y = layer(x, rotary_pos_emb=rope)
                y.backward(g)
                out.append((y.detach(), x.grad))
        cache, recordings = dict(layer_mod._PROGRAMS), layer_mod._PROGRAMS.recordings
    finally:
        layer_mod.REPLAY = saved
        if not keep_cache:
            layer_mod._PROGRAMS.clear()
    return out, cache, recordings
