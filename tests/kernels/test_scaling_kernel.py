"""delayed_scaling_update (one launch for many tensors) against its reference: exact (rtol=0, atol=0), including
rows whose amax is NaN / inf / zero / negative / denormal (scale kept), update_scale False (bool or tensor), both
algos, non-integer margin, and the history roll checked against hand-written expected values."""

import pytest
import torch
from _kernel_test_utils import DEVICES

from fp8engine.kernels.scaling import delayed_scaling_update, delayed_scaling_update_reference

L = 6


def _state(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hists = [torch.rand(5, L, generator=g) * 10, torch.rand(1, L, generator=g), torch.rand(7, L, generator=g) * 1e3]
    hists[0][0, 2] = float("nan")  # NaN in the middle: "max" keeps the scale, "most_recent" does not care
    hists[0][1] = 0.0  # zero amax
    hists[0][2, 0] = float("nan")  # NaN as the newest amax
    hists[2][1, 3] = float("inf")
    hists[2][2, 0] = float("inf")
    hists[2][3] = -1.0  # negative (invalid) amax
    hists[2][4] = 1e-44  # denormal: fp8_max / amax overflows to inf -> keep
    scales = [torch.rand(h.shape[0], generator=g) + 0.5 for h in hists]
    maxes = [torch.full((hists[0].shape[0],), 448.0), torch.full((1,), 57344.0), torch.full((7,), 448.0)]
    return [[t.to(device) for t in group] for group in (hists, scales, maxes)]


def _assert_same(a, b):
    for ta, tb in zip(a, b):
        for x, y in zip(ta, tb):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 0.5])
@pytest.mark.parametrize("update", [True, False, "tensor_true", "tensor_false"])
def test_matches_reference_exactly(device, algo, margin, update):
    if isinstance(update, str):
        update = torch.tensor(update == "tensor_true", device=device)
    state, ref = _state(device), _state(device)
    before = [[t.clone() for t in group] for group in state]
    delayed_scaling_update(*state, margin=margin, algo=algo, update_scale=update)
    delayed_scaling_update_reference(*ref, margin=margin, algo=algo, update_scale=update)
    _assert_same(state, ref)
    # the roll: new[:, :-1] = old[:, 1:], new[:, -1] = old[:, 0], then new[:, 0] = 0
    for h, h0 in zip(state[0], before[0]):
        expect = torch.cat([h0[:, 1:], h0[:, :1]], dim=1)
        expect[:, 0] = 0.0
        torch.testing.assert_close(h, expect, rtol=0, atol=0, equal_nan=True)
    # scales: kept exactly where the amax is invalid or updates are off
    s, s0 = state[1], before[1]
    on = update if isinstance(update, bool) else bool(update.item())
    kept_rows = {0: [1, 2] + ([0] if algo == "max" else []), 2: [3, 4, 2] + ([1] if algo == "max" else [])}
    for t, rows in kept_rows.items():
        torch.testing.assert_close(s[t][rows], s0[t][rows], rtol=0, atol=0)
    if on:
        amax = before[0][1][0, 0] if algo == "most_recent" else before[0][1][0].max()
        want = (torch.tensor(57344.0, device=device) / amax) / torch.tensor(2.0**margin, device=device)
        torch.testing.assert_close(s[1][0], want, rtol=0, atol=0)
    else:
        _assert_same([s], [s0])


@pytest.mark.parametrize("device", DEVICES)
def test_history_length_one_and_errors(device):
    h = torch.tensor([[3.0], [0.0]], device=device)
    s = torch.ones(2, device=device)
    delayed_scaling_update([h], [s], [torch.full((2,), 448.0, device=device)], margin=0)
    torch.testing.assert_close(h, torch.zeros(2, 1, device=device), rtol=0, atol=0)
    torch.testing.assert_close(s, torch.tensor([448.0 / 3.0, 1.0], device=device), rtol=0, atol=0)
    with pytest.raises(ValueError, match="same L"):
        delayed_scaling_update(
            [torch.ones(1, 4, device=device), torch.ones(1, 5, device=device)],
            [torch.ones(1, device=device)] * 2, [torch.ones(1, device=device)] * 2, margin=0,
        )  # fmt: skip
    with pytest.raises(TypeError, match="float32"):
        delayed_scaling_update([torch.ones(1, 4, device=device).half()], [torch.ones(1, device=device)],
                               [torch.ones(1, device=device)], margin=0)  # fmt: skip
    with pytest.raises(ValueError, match="algo"):
        delayed_scaling_update([h], [s], [s], margin=0, algo="mean")


@pytest.mark.parametrize("device", DEVICES)
def test_update_counters_and_the_planned_update_match_the_reference(device):
    """``update_steps`` are incremented by the launch itself; a :class:`DelayedScalingUpdate` called three times
    gives the reference's three updates bit for bit (it re-reads the tensors on each call)."""
    from fp8engine.kernels.scaling import DelayedScalingUpdate

    state, ref = _state(device), _state(device)
    steps = [torch.tensor(5, device=device), torch.tensor(0, device=device), torch.tensor(9, device=device)]
    ref_steps = [c.clone() for c in steps]
    update = DelayedScalingUpdate(*state, margin=1, update_steps=steps)
    for _ in range(3):
        update()
        delayed_scaling_update_reference(*ref, margin=1, update_steps=ref_steps)
        _assert_same(state, ref)
    assert [int(c) for c in steps] == [8, 3, 12] == [int(c) for c in ref_steps]
    delayed_scaling_update(*state, margin=1, update_steps=steps, update_scale=False)
    delayed_scaling_update_reference(*ref, margin=1, update_steps=ref_steps, update_scale=False)
    _assert_same(state, ref)
    assert [int(c) for c in steps] == [9, 4, 13]
    with pytest.raises(TypeError, match="int64"):
        DelayedScalingUpdate(*state, margin=0, update_steps=[c.float() for c in steps])
    with pytest.raises(ValueError, match="one update_steps counter"):
        DelayedScalingUpdate(*state, margin=0, update_steps=steps[:2])


@pytest.mark.parametrize("device", DEVICES)
def test_planned_update_takes_a_flag_tensor_and_refuses_a_wrong_one(device):
    from fp8engine.kernels.scaling import DelayedScalingUpdate

    state, ref = _state(device), _state(device)
    update = DelayedScalingUpdate(*state, margin=0)
    off = torch.tensor(False, device=device)
    update(off)
    delayed_scaling_update_reference(*ref, margin=0, update_scale=off)
    _assert_same(state, ref)
    with pytest.raises(TypeError, match="1-element bool"):
        update(torch.tensor([1, 0], device=device))
