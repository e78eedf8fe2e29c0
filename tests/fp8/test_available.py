"""is_fp8_available: TransformerEngine 2.x's signature (a bool; ``(bool, reason)`` with ``return_reason=True``) and
its rules, the CUDA ones checked on any machine with the device queries monkeypatched."""
import pytest
import torch

import fp8engine as fe
import fp8engine.fp8.available as available


def test_cpu_bare_call_is_a_bool():
    ok = fe.is_fp8_available(device="cpu")
    assert ok is True  # torch >= 2.11 runs torch._scaled_mm on CPU (the environment this package pins)
    assert fe.is_fp8_available(return_reason=True, device="cpu") == (
        True, "FP8 is emulated on CPU by torch._scaled_mm (correct numerics, no speed-up).")


@pytest.fixture
def no_fp8_anywhere(monkeypatch):
    """No CUDA device and a torch whose CPU ``_scaled_mm`` fails."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(available, "_cpu_scaled_mm_works", lambda: False)


def test_unavailable_bare_call_is_falsy(no_fp8_anywhere):
    """The bug this signature fixes: a ``(False, reason)`` tuple made ``if is_fp8_available():`` always true."""
    assert fe.is_fp8_available() is False
    assert not fe.is_fp8_available(device="cpu")
    ok, reason = fe.is_fp8_available(return_reason=True)
    assert ok is False and "cannot run torch._scaled_mm on CPU" in reason
    assert fe.is_fp8_available(return_reason=True, device="cuda") == (
        False, "CUDA is not available: no GPU visible or torch is a CPU build.")


@pytest.mark.parametrize("capability,cuda,expected", [
    ((9, 0), "12.4", True), ((10, 0), "12.8", True), ((8, 9), "12.1", True), ((8, 9), "12.0", False),
    ((8, 0), "12.4", False), ((7, 5), "11.8", False),
])
def test_cuda_rules(monkeypatch, capability, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert fe.is_fp8_available() is expected  # default device: CUDA when available
    ok, reason = fe.is_fp8_available(return_reason=True, device="cuda:0")
    assert ok is expected and (f"{capability[0]}.{capability[1]}" in reason or "8.9 or higher" in reason)


def test_other_device_types(no_fp8_anywhere):
    assert fe.is_fp8_available(device="meta") is False
    assert "got device type 'meta'" in fe.is_fp8_available(return_reason=True, device="meta")[1]


@pytest.mark.parametrize("arg", ["cpu", torch.device("cpu"), 0, None])
def test_device_passed_positionally_is_refused(arg):
    """The device used to be the first argument; passed there now it would be read as ``return_reason`` (a
    device is truthy): refused, with the keyword to use."""
    with pytest.raises(TypeError, match=r"is_fp8_available\(device=\.\.\.\)"):
        fe.is_fp8_available(arg)
