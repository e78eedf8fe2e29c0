"""FP8 health counters (fp8engine.fp8.stats): exact underflow / saturation counts on constructed tensors for both
formats, delayed and current scaling, the torch and the kernel path; every role of a TransformerLayer counted once
(fused kernel paths included); and the off switch adds no ATen op to a forward + backward."""
import contextlib
import math
import os
from collections import Counter

import pytest
import torch

import fp8engine as fe
from fp8engine.fp8.autocast import FP8Context
from fp8engine.fp8.float8_tensor import current_scale, kernels_forced
from fp8engine.fp8.quantizer import get_quantizers
from fp8engine.fp8.state import ScalingState
from fp8engine.fp8.stats import SATURATION_BOUND, FP8StatsRow, format_fp8_stats, fp8_stats, fp8_stats_recording
from fp8engine.kernels import kernels_available
from fp8engine.modules import TransformerLayer
from fp8engine.ops.linear import LINEAR_ROLES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMAT = {E4M3: fe.Format.E4M3, E5M2: fe.Format.E5M2}
NAME = {E4M3: "e4m3", E5M2: "e5m2"}

#: Magnitudes of ``x * scale`` by what the cast does to them (all exact in bfloat16). min subnormal: E4M3 2**-9,
#: E5M2 2**-16; half of it is a tie that rounds to (even) zero. Near-max values round to fp8_max without the clamp
#: (not saturated); E4M3's 464 ties down to 448, E5M2's 61440 ties up to 65536 (saturated).
SCALED = {
    E4M3: dict(underflow=[2.0 ** -11, 2.0 ** -12, 3 * 2.0 ** -12, 2.0 ** -10],
               kept=[33 * 2.0 ** -15, 2.0 ** -9, 2.0 ** -8, 1.0, 1.5, 3.25, 100.0, 448.0, 456.0, 464.0],
               saturated=[472.0, 480.0, 1024.0, 2.0 ** 20]),
    E5M2: dict(underflow=[2.0 ** -18, 2.0 ** -19, 3 * 2.0 ** -19, 2.0 ** -17],
               kept=[33 * 2.0 ** -22, 2.0 ** -16, 2.0 ** -15, 1.0, 1.5, 3.5, 100.0, 57344.0, 59392.0, 60416.0],
               saturated=[61440.0, 65536.0, 2.0 ** 20, 2.0 ** 30]),
}


def _kernel_device():
    """Device for the kernel path: CUDA when present, else CPU under the Triton interpreter (or skip)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not (os.environ.get("TRITON_INTERPRET") == "1" and kernels_available("cpu")):
        pytest.skip("needs Triton with TRITON_INTERPRET=1 (set by tests/conftest.py when there is no GPU)")
    return torch.device("cpu")


@contextlib.contextmanager
def _backend(name):
    """Yield the device of backend ``name``: "torch" (the CPU reference) or "kernels"."""
    if name == "torch":
        yield torch.device("cpu")
        return
    device = _kernel_device()
    with kernels_forced(device.type == "cpu"):
        yield device


def _constructed(fp8_dtype, n_zeros, seed):
    """``(scaled values [rows, 16] float64 in random order and sign, counts by category)``."""
    g = torch.Generator().manual_seed(seed)
    values, counts = [], {"underflow": 0, "kept": 0, "saturated": 0, "zero": n_zeros}
    for kind, mags in SCALED[fp8_dtype].items():
        for m in mags:
            k = int(torch.randint(1, 8, (1,), generator=g))
            values += [m] * k
            counts[kind] += k
    values += [0.0] * n_zeros
    pad = -len(values) % 16  # whole rows; padding with kept values (1.0)
    values += [1.0] * pad
    counts["kept"] += pad
    t = torch.tensor(values, dtype=torch.float64)
    t = t[torch.randperm(len(t), generator=g)]
    sign = torch.where(torch.rand(len(t), generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return (t * sign).reshape(-1, 16), counts


def _single_row(state):
    rows = fp8_stats(state)
    assert [r.role for r in rows] == list(LINEAR_ROLES) and all(r.module == "" for r in rows)
    return {r.role: r for r in rows}


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("call", ["quantize", "quantize_dbias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_delayed_counts_are_exact(fp8_dtype, dtype, call, backend):
    scaled, n = _constructed(fp8_dtype, n_zeros=13, seed=hash((NAME[fp8_dtype], str(dtype), call)) % 1000)
    scale = 2.0 ** 3  # a power of two: x = scaled / scale and x * scale are exact in every dtype
    with _backend(backend) as device:
        state = ScalingState(LINEAR_ROLES, amax_history_len=4, device=device)
        state.scale.fill_(scale)
        x = (scaled / scale).to(dtype).to(device)
        assert torch.equal(x.double().cpu() * scale, scaled)  # the constructed values survived the dtype
        with fp8_stats_recording(state):
            q = get_quantizers(state, FP8Context(fe.DelayedScaling(fp8_format=FORMAT[fp8_dtype])))[0]
            if call == "quantize":
                out = q.input.quantize(x, transpose=True)
            else:
                out, _ = q.grad_output.quantize_dbias(x, transpose=True, dbias=True)
        role = "input" if call == "quantize" else "grad_output"
        row = _single_row(state)[role]
    nonzero = x.numel() - n["zero"]
    assert row == FP8StatsRow("", role, NAME[fp8_dtype], float(scaled.abs().max()) / scale, scale,
                              100.0 * n["underflow"] / nonzero, 100.0 * n["saturated"] / x.numel())
    # the counts agree with the bits written: every constructed underflow is a ±0 byte
    flushed = (out.data.view(torch.uint8) & 0x7F).eq(0).cpu() & (scaled != 0)
    assert int(flushed.sum()) == n["underflow"]
    # the roles not cast stay "not counted"
    other = _single_row(state)["weight"]
    assert other.format is None and other.amax is None and other.underflow_pct is None and other.scale == scale


def _rounds_up(fp8_max):
    """An amax ``a`` whose current-scaling scale rounds up: ``a * (fp8_max / a) > fp8_max`` in float32."""
    for i in range(1, 10_000):
        a = torch.tensor([1.0 + i / 997.0], dtype=torch.float32)
        if (a * current_scale(a, E4M3 if fp8_max == 448.0 else E5M2)).item() > fp8_max:
            return float(a)
    raise AssertionError("no amax found whose scale rounds up")


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("call", ["quantize", "quantize_dbias"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_current_counts_are_exact(fp8_dtype, call, backend):
    fp8_max = torch.finfo(fp8_dtype).max
    amax = _rounds_up(fp8_max)  # TransformerEngine's |x| > fp8_max * scale_inv would count the amax element
    g = torch.Generator().manual_seed(7)
    n_tiny, n_zero, n = 37, 11, 1151 * 16
    mags = amax * (0.01 + 0.98 * torch.rand(n, generator=g, dtype=torch.float64))  # kept: scaled in [4.4, 439]
    mags[:n_tiny] = amax * 2.0 ** -40  # scaled ~ fp8_max * 2**-40: below half the smallest subnormal
    mags[n_tiny:n_tiny + n_zero] = 0.0
    mags[-1] = amax
    x32 = (mags * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)).float()
    x32 = x32[torch.randperm(n, generator=g)].reshape(1151, 16)
    with _backend(backend) as device:
        x = x32.to(device)
        state = ScalingState(LINEAR_ROLES, device=device)
        with fp8_stats_recording(state):
            q = get_quantizers(state, FP8Context(fe.CurrentScaling(FORMAT[fp8_dtype])))[0]
            if call == "quantize":
                q.input.quantize(x)
            else:
                q.grad_output.quantize_dbias(x, transpose=True, dbias=True)
        row = _single_row(state)["input" if call == "quantize" else "grad_output"]
    scale = current_scale(torch.tensor(amax), fp8_dtype)
    assert (torch.tensor(amax) * scale).item() > fp8_max
    assert row.amax == float(torch.tensor(amax)) and row.scale == scale.item()
    assert row.underflow_pct == 100.0 * n_tiny / (n - n_zero)
    assert row.saturation_pct == 0.0


def test_nan_and_inf_are_counted_as_defined():
    # inf: nonzero, clamped to fp8_max -> saturated; NaN: nonzero, FP8 NaN -> neither; amax propagates NaN
    state = ScalingState(LINEAR_ROLES, amax_history_len=4)
    x = torch.tensor([[math.inf, -math.inf, math.nan, 1.0] * 4])
    with fp8_stats_recording(state):
        get_quantizers(state, FP8Context(fe.DelayedScaling()))[0].input.quantize(x)
    row = _single_row(state)["input"]
    assert row.underflow_pct == 0.0 and row.saturation_pct == 50.0 and math.isnan(row.amax)


def test_saturation_bound_matches_rounding_without_the_clamp():
    # independent of the constants: round |v| to the format's mantissa with an unbounded exponent (float64,
    # half to even) and compare with fp8_max, for a dense sweep around the bound
    for fp8_dtype, mant in ((E4M3, 3), (E5M2, 2)):
        fp8_max = torch.finfo(fp8_dtype).max
        v = torch.linspace(fp8_max * 0.99, fp8_max * 1.2, 20001, dtype=torch.float32)
        v = torch.cat([v, torch.tensor([SATURATION_BOUND[fp8_dtype]]), torch.nextafter(
            torch.tensor([SATURATION_BOUND[fp8_dtype]]), torch.tensor([0.0]))])
        ulp = 2.0 ** (torch.floor(torch.log2(v.double())) - mant)
        rounded = torch.round(v.double() / ulp) * ulp
        assert torch.equal(rounded > fp8_max, v >= SATURATION_BOUND[fp8_dtype])


def _layer(seed=0):
    torch.manual_seed(seed)
    return TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0)


def _fwd_bwd(layer, x, recipe):
    with fe.autocast(recipe=recipe):
        y = layer(x)
    y.backward(torch.ones_like(y))


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("recipe", [fe.DelayedScaling(), fe.CurrentScaling()], ids=["delayed", "current"])
def test_every_role_of_a_layer_is_counted_once(backend, recipe):
    # the kernel path covers the fused casts (norm kernel, activation kernels, QKV-gradient kernel), which record
    # through their unfused path
    with _backend(backend) as device:
        layer = _layer().to(device)
        x = torch.randn(7, 3, 64, device=device, requires_grad=True)
        _fwd_bwd(layer, x, recipe)  # a first step outside recording: nothing counted
        assert all(r.amax is None for r in fp8_stats(layer))
        with fp8_stats_recording(layer):
            _fwd_bwd(layer, x, recipe)
        rows = fp8_stats(layer)
        casts = torch.cat([st.stats_counters.counts[:, 4] for st in layer.modules() if isinstance(st, ScalingState)])
        assert casts.tolist() == [1] * 12
        _fwd_bwd(layer, x, recipe)  # after the block: counts stay
        assert fp8_stats(layer) == rows
    assert len(rows) == 12 and {r.module for r in rows} == {"self_attention.layernorm_qkv", "self_attention.proj",
                                                           "layernorm_mlp"}
    for r in rows:
        assert r.format == ("e5m2" if r.role.endswith("grad_output") else "e4m3")
        assert r.amax > 0 and r.scale > 0 and 0 <= r.underflow_pct < 100 and 0 <= r.saturation_pct < 100
    weights = {"self_attention.layernorm_qkv": layer.self_attention.layernorm_qkv.weight,
               "self_attention.proj": layer.self_attention.proj.weight}
    for r in rows:
        if r.role == "weight":
            assert r.amax == weights[r.module].abs().max().item()
    table = format_fp8_stats(rows)
    assert len(table.splitlines()) == 13 and "fc2_grad_output" in table and "underflow %" in table


def _aten_ops(layer, x, recipe) -> Counter:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _fwd_bwd(layer, x, recipe)
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


@pytest.mark.parametrize("recipe", [fe.DelayedScaling(), fe.CurrentScaling()], ids=["delayed", "current"])
def test_off_adds_no_aten_ops(recipe):
    """Stats off: the same ATen ops as a layer that never recorded (the code path before this feature: the only
    difference is one ``stats is None`` attribute check per cast). Stats on: exactly the counting ops on top."""
    layer = _layer()
    x = torch.randn(7, 3, 64, requires_grad=True)
    _fwd_bwd(layer, x, recipe)  # sizes the amax histories, builds the quantizers
    never = _aten_ops(layer, x, recipe)
    with fp8_stats_recording(layer):
        on = _aten_ops(layer, x, recipe)
    off = _aten_ops(layer, x, recipe)
    assert off == never
    extra = on - off
    assert not (off - on)  # recording only adds
    assert extra["aten::logical_and_"] == 12 and never["aten::logical_and_"] == 0  # one count per cast, 12 casts
    assert extra["aten::ge"] == 12 and extra["aten::sum"] == 36


def test_recording_needs_fp8_modules():
    with pytest.raises(ValueError, match="no FP8 modules"):
        fp8_stats(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no FP8 modules"):
        with fp8_stats_recording(torch.nn.Linear(4, 4)):
            pass
    with fp8_stats_recording(torch.nn.Linear(4, 4), enabled=False):  # off: nothing looked at
        pass


def test_entry_zeroes_the_counters():
    layer = _layer()
    x = torch.randn(7, 3, 64, requires_grad=True)
    for _ in range(2):
        with fp8_stats_recording(layer):
            _fwd_bwd(layer, x, fe.DelayedScaling())
        casts = [st.stats_counters.counts[:, 4].tolist() for st in layer.modules() if isinstance(st, ScalingState)]
        assert casts == [[1, 1, 1], [1, 1, 1], [1] * 6]
        assert all(r.format in ("e4m3", "e5m2") and r.amax > 0 for r in fp8_stats(layer))
