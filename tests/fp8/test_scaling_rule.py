"""The delayed-scaling rule, exactly (rtol=0, atol=0): it is pure arithmetic on a few floats."""
import math

import pytest
import torch

import fp8engine as fe
from fp8engine.fp8.scaling import update_amax_history, update_fp8_scale
from fp8engine.fp8.state import ScalingState, reduce_and_update


def test_history_roll_by_hand():
    h = torch.tensor([[5.0, 1.0, 2.0, 3.0]])
    assert torch.equal(update_amax_history(h), torch.tensor([[0.0, 2.0, 3.0, 5.0]]))


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_scale_by_hand_max_and_most_recent(margin):
    h = torch.tensor([[2.0, 8.0, 1.0], [4.0, 0.5, 0.25]])
    scale = torch.tensor([1.0, 1.0])
    s, s_inv = update_fp8_scale(h, scale, 448.0, margin=margin, amax_compute_algo="max")
    expect = torch.tensor([448.0 / 8.0, 448.0 / 4.0]) / 2**margin
    torch.testing.assert_close(s, expect, rtol=0, atol=0)
    torch.testing.assert_close(s_inv, 1 / expect, rtol=0, atol=0)
    s, _ = update_fp8_scale(h, scale, 448.0, margin=margin, amax_compute_algo="most_recent")
    torch.testing.assert_close(s, torch.tensor([448.0 / 2.0, 448.0 / 4.0]) / 2**margin, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [0.0, math.inf, math.nan, -1.0])
def test_unusable_amax_keeps_previous_scale(bad):
    h = torch.tensor([[bad, 0.0], [3.0, 1.0]]) if bad != -1.0 else torch.tensor([[0.0, 0.0], [3.0, 1.0]])
    prev = torch.tensor([7.0, 9.0])
    s, s_inv = update_fp8_scale(h, prev, 57344.0, amax_compute_algo="most_recent")
    assert s[0] == 7.0 and s_inv[0] == torch.tensor(7.0).reciprocal()
    assert s[1] == torch.tensor(57344.0) / torch.tensor(3.0)  # float32 arithmetic


def test_callable_algo():
    h = torch.tensor([[2.0, 6.0]])
    s, _ = update_fp8_scale(h, torch.ones(1), 448.0, amax_compute_algo=lambda x: x.mean(-1))
    assert s.item() == 448.0 / 4.0


def _record(state, values):
    state.amax_history[:, 0] = torch.maximum(state.amax_history[:, 0], torch.tensor(values))


def test_interval_records_every_step_updates_every_k():
    recipe = fe.DelayedScaling(interval=2, amax_history_len=4, amax_compute_algo="most_recent")
    st = ScalingState(("input", "weight", "grad_output"), amax_history_len=4)
    scales = []
    for step, amax in enumerate([1.0, 2.0, 4.0, 8.0]):
        _record(st, [amax, amax, amax])
        reduce_and_update([st], recipe)
        scales.append(st.scale.clone())
        assert st.amax_history[0, -1] == amax  # recorded (rolled to the end) on every step
    fwd, bwd = 448.0, 57344.0
    assert torch.equal(scales[0], torch.tensor([fwd / 1, fwd / 1, bwd / 1]))
    assert torch.equal(scales[1], scales[0])  # step 1: interval skips the recompute
    assert torch.equal(scales[2], torch.tensor([fwd / 4, fwd / 4, bwd / 4]))
    assert torch.equal(scales[3], scales[2])


def test_history_length_window():
    recipe = fe.DelayedScaling(amax_history_len=2, amax_compute_algo="max", fp8_format=fe.Format.E4M3)
    st = ScalingState(("input",), amax_history_len=2)
    out = []
    for amax in [8.0, 1.0, 1.0, 1.0]:
        _record(st, [amax])
        reduce_and_update([st], recipe)
        out.append(st.scale.item())
    # Window of 2 (ring): the 8.0 stays visible for two updates, then drops out.
    assert out == [448.0 / 8, 448.0 / 8, 448.0 / 1, 448.0 / 1]


def test_nan_amax_never_overwrites_good_scale():
    recipe = fe.DelayedScaling(amax_history_len=1, fp8_format=fe.Format.E4M3)
    st = ScalingState(("input",), amax_history_len=1)
    _record(st, [2.0])
    reduce_and_update([st], recipe)
    good = st.scale.clone()
    st.amax_history[0, 0] = float("nan")
    reduce_and_update([st], recipe)
    assert torch.equal(st.scale, good)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_kernel_update_equals_torch_update_and_counts_steps(device):
    """The fused kernel path of ``reduce_and_update`` (Triton on CUDA, or under TRITON_INTERPRET on CPU) gives the
    torch path's scales and histories bit for bit, and advances every state's ``update_step`` once per call."""
    from fp8engine.kernels._common import interpreting

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if device == "cpu" and not interpreting():
        pytest.skip("the kernel path on CPU needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    recipe = fe.DelayedScaling(amax_history_len=3, margin=1)
    roles = ("input", "weight", "grad_output")
    kern = [ScalingState(roles, amax_history_len=3, device=device) for _ in range(3)]
    ref = [ScalingState(roles, amax_history_len=3, device=device) for _ in range(3)]
    for st in kern:
        st.kernels = True  # as get_quantizers leaves a state whose quantizers run the kernels
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        for a, b in zip(kern, ref):
            amax = (torch.rand(3, generator=gen) * 10).to(device)
            a.amax_history[:, 0] = amax
            b.amax_history[:, 0] = amax
        reduce_and_update(kern, recipe)
        reduce_and_update(ref, fe.DelayedScaling(amax_history_len=3, margin=1, interval=1,
                                                 amax_compute_algo=lambda h: h.amax(-1)))  # the torch path
        for a, b in zip(kern, ref):
            assert torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history)
            assert a.update_step.item() == b.update_step.item() == step + 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_kernel_update_follows_replaced_buffers(device, monkeypatch):
    """The kernel update is planned once per set of buffers (``fp8engine.fp8.state._UPDATES``): a history re-sized
    (a new tensor) is planned again and updated, not the old one; a ``load_state_dict`` (copied in place) keeps the
    plan. Same scales, histories and counters as the torch path throughout."""
    from fp8engine.fp8 import state as state_mod
    from fp8engine.kernels._common import interpreting

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if device == "cpu" and not interpreting():
        pytest.skip("the kernel path on CPU needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    monkeypatch.setattr(state_mod, "_UPDATES", {})
    recipe = fe.DelayedScaling(amax_history_len=3, margin=0)
    torch_recipe = fe.DelayedScaling(amax_history_len=3, margin=0, amax_compute_algo=lambda h: h.amax(-1))
    roles = ("input", "weight", "grad_output")
    kern = [ScalingState(roles, amax_history_len=3, device=device) for _ in range(2)]
    ref = [ScalingState(roles, amax_history_len=3, device=device) for _ in range(2)]
    for st in kern:
        st.kernels = True  # the kernel update (the quantizers' backend, ScalingState.kernels)
    gen = torch.Generator().manual_seed(1)

    def step():
        for a, b in zip(kern, ref):
            amax = (torch.rand(3, generator=gen) * 10).to(device)
            a.amax_history[:, 0] = amax
            b.amax_history[:, 0] = amax
        state_mod.reduce_and_update(kern, recipe)
        state_mod.reduce_and_update(ref, torch_recipe)
        for a, b in zip(kern, ref):
            assert torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history)
            assert a.update_step.item() == b.update_step.item()

    step()
    step()
    plans = len(state_mod._UPDATES)
    kern[1].load_state_dict(ref[1].state_dict())  # same values, copied into the same buffers
    step()
    assert len(state_mod._UPDATES) == plans
    for st in kern + ref:
        st.resize_history(5)
    step()
    step()
    assert all(st.amax_history.shape == (3, 5) for st in kern) and len(state_mod._UPDATES) == plans + 1


def test_exit_update_runs_the_backend_the_quantizers_chose(monkeypatch):
    """The update at the region's exit runs the backend ``get_quantizers`` chose for the states
    (``ScalingState.kernels``), not one chosen again there: the fused kernel for a module whose quantizers ran the
    kernels (``kernels_forced`` around its forward only, not the exit), the torch path for one whose did not. The
    same scales either way."""
    from fp8engine.fp8 import state as state_mod
    from fp8engine.fp8.float8_tensor import kernels_forced
    from fp8engine.kernels._common import interpreting

    if not interpreting():
        pytest.skip("the kernel path on CPU needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    monkeypatch.setattr(state_mod, "_UPDATES", {})
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3)) * 5
    mods = [fe.Linear(16, 16), fe.Linear(16, 16)]
    mods[1].load_state_dict(mods[0].state_dict())
    for forced, mod in zip((True, False), mods):
        with fe.autocast(recipe=fe.DelayedScaling(amax_history_len=4)):
            with kernels_forced(forced):
                mod(x)
        assert mod.fp8_state.kernels is forced
    assert len(state_mod._UPDATES) == 1  # one kernel update planned: the first module's
    assert torch.equal(mods[0].fp8_state.scale, mods[1].fp8_state.scale)
    assert torch.equal(mods[0].fp8_state.amax_history, mods[1].fp8_state.amax_history)
