"""Helpers of the ops tests: states with non-trivial scales, and the fixture that runs the ops' Triton-kernel path
on CPU under TRITON_INTERPRET=1 (import ``force_kernels`` into a test module to use it)."""
import os

import pytest
import torch

from fp8engine.fp8.autocast import FP8Context
from fp8engine.fp8.float8_tensor import _FORCE_KERNELS
from fp8engine.fp8.quantizer import get_quantizers
from fp8engine.fp8.state import ScalingState
from fp8engine.kernels import kernels_available
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
