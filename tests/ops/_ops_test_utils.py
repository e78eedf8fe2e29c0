"""Helpers of the ops tests: states with non-trivial scales, and the fixture that runs the ops' Triton-kernel path
on CPU under TRITON_INTERPRET=1 (import ``force_kernels`` into a test module to use it)."""
import os

import pytest
import torch

from fp8engine.fp8.state import ScalingState
from fp8engine.kernels import kernels_available
from fp8engine.ops.cast import FP8Plan


#: the interpreter evaluates masked-off lanes too (numpy overflow warnings on garbage lanes)
IGNORE_INTERPRETER_WARNINGS = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.fixture
def force_kernels(monkeypatch):
    """Make the ops dispatch to the Triton kernels for CPU tensors (the interpreter): the GPU code path, run in CI.
    Call the returned function with True/False to switch."""
    if not (os.environ.get("TRITON_INTERPRET") == "1" and kernels_available("cpu")):
        pytest.skip("needs Triton with TRITON_INTERPRET=1 (set by tests/conftest.py when there is no GPU)")
    import fp8engine.ops.cast as ops_cast
    import fp8engine.ops.mlp as ops_mlp

    default = ops_cast.use_kernels

    def switch(on: bool):
        pred = (lambda t: True) if on else default
        for mod in (ops_cast, ops_mlp):
            monkeypatch.setattr(mod, "use_kernels", pred)

    return switch


def make_state(roles, delayed: bool, seed: int = 0):
    """A ScalingState with non-trivial scales (powers of two and not) and the matching plan (HYBRID format)."""
    st = ScalingState(roles, amax_history_len=4)
    g = torch.Generator().manual_seed(seed)
    st.scale.copy_(torch.rand(len(roles), generator=g) * 30 + 0.5)
    plan = FP8Plan(torch.float8_e4m3fn, torch.float8_e5m2, delayed, True)
    return st, plan
