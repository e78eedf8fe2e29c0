"""``Quantizer`` / ``get_quantizers``: the cast of each FP8 role against float64 references, what is recorded where,
and the cache (one set of quantizers per state, recipe and record flag, rebuilt when any of them changes)."""
import contextlib

import pytest
import torch

import fp8engine as fe
from fp8engine.fp8.autocast import FP8Context, get_fp8_context, recompute_context
from fp8engine.fp8.quantizer import LinearQuantizers, Quantizer, get_quantizers, recipe_kind
from fp8engine.fp8.state import ScalingState
from fp8engine.ops.linear import LINEAR_ROLES
from fp8engine.ops.mlp import MLP_ROLES
from tests.conftest import sqnr

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: torchao's thresholds (test_base.py) a few dB lower: per-tensor E4M3 ~30 dB on Gaussian data, E5M2 ~25 dB
MIN_SQNR = {E4M3: 28.0, E5M2: 23.0}


def _state(roles=LINEAR_ROLES, scales=(2.0 ** 4, 2.0 ** -3, 2.0 ** 9)):
    st = ScalingState(roles, amax_history_len=4)
    st.scale.copy_(torch.tensor(scales[: len(roles)]))
    return st


def _reference(x: torch.Tensor, scale: float, fp8_dtype) -> torch.Tensor:
    """float64 reference of the cast: ``saturate(x * scale)`` rounded to nearest even in ``fp8_dtype``."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (x.double() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delayed_quantize_matches_float64_reference(dtype):
    # power-of-two scales: x * scale is exact in fp32 and float64 alike, so the FP8 bits must equal the float64
    # reference's exactly (saturation included: |x| * 2**9 exceeds 57344 for |x| > 112)
    st = _state()
    q = get_quantizers(st, FP8Context(fe.DelayedScaling(amax_history_len=4)))[0]
    x = (torch.randn(1151, 48, generator=torch.Generator().manual_seed(0)) * 200).to(dtype)
    for quantizer, scale, fp8_dtype in ((q.input, 2.0 ** 4, E4M3), (q.weight, 2.0 ** -3, E4M3),
                                        (q.grad_output, 2.0 ** 9, E5M2)):
        out = quantizer.quantize(x, transpose=True)
        assert quantizer.fp8_dtype == fp8_dtype and out.data.dtype == fp8_dtype and out.dtype == dtype
        ref = _reference(x, scale, fp8_dtype)
        assert torch.equal(out.data.view(torch.uint8), ref.view(torch.uint8))
        assert torch.equal(out.transpose_2d().view(torch.uint8), ref.t().contiguous().view(torch.uint8))
        assert out.scale_inv.item() == 1.0 / scale
    # amaxes max-accumulated into column 0 of each row (HYBRID: grads in E5M2)
    torch.testing.assert_close(st.amax_history[:, 0], x.float().abs().max().expand(3), rtol=0, atol=0)


@pytest.mark.parametrize("fp8_format", [fe.Format.HYBRID, fe.Format.E4M3])
def test_current_quantize_scale_rule_and_sqnr(fp8_format):
    # current scaling: scale = fp8_max / max|x| of the tensor being cast (no state read or written)
    st = _state()
    recipe = fe.CurrentScaling(fp8_format)
    q = get_quantizers(st, FP8Context(recipe))[0]
    assert q.input.scale is None and q.input.amax is None and recipe_kind(recipe) == "current"
    x = torch.randn(1151, 48, generator=torch.Generator().manual_seed(1)) * 7
    for quantizer in q:
        out = quantizer.quantize(x)
        fp8_max = torch.finfo(quantizer.fp8_dtype).max
        scale = torch.tensor(fp8_max) / x.abs().max()
        assert out.scale_inv.item() == pytest.approx(1.0 / scale.item(), rel=1e-6)
        assert out.data.float().abs().max().item() == fp8_max  # the largest element lands on fp8_max
        assert sqnr(x.double(), out.dequantize(torch.float64)) >= MIN_SQNR[quantizer.fp8_dtype]
    assert (st.amax_history == 0).all()


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_current_quantize_with_a_given_amax_in_the_inputs_dtype(kernels, dtype):
    # an amax computed already (the fused layer's one multi-tensor reduction of its four weights) in x's dtype or
    # float32, 0-dim or [1]: the same bits and scale_inv as the quantizer's own reduction
    from fp8engine.fp8.float8_tensor import kernels_forced
    from fp8engine.kernels._common import HAS_TRITON, interpreting

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if kernels and not (HAS_TRITON and (device == "cuda" or interpreting())):
        pytest.skip("needs Triton on a GPU, or TRITON_INTERPRET=1")
    q = get_quantizers(_state(), FP8Context(fe.CurrentScaling()))[0].weight
    q.kernels = kernels  # the backend under test (get_quantizers picks it from the state's CPU buffers)
    x = (torch.randn(96, 48, generator=torch.Generator().manual_seed(2)) * 5).to(device, dtype)
    with kernels_forced() if kernels else contextlib.nullcontext():
        ref = q.quantize(x, transpose=True)
        for amax in (torch._foreach_norm([x], float("inf"))[0], x.abs().amax().float().reshape(1)):
            out = q.quantize(x, transpose=True, amax=amax)
            assert torch.equal(out.data.view(torch.uint8), ref.data.view(torch.uint8))
            assert torch.equal(out.scale_inv, ref.scale_inv)


def test_quantize_dbias_column_sums():
    st = _state()
    q = get_quantizers(st, FP8Context(fe.DelayedScaling(amax_history_len=4)))[0].grad_output
    dy = torch.randn(97, 32, generator=torch.Generator().manual_seed(2))
    out, db = q.quantize_dbias(dy, transpose=True, dbias=True)
    torch.testing.assert_close(db.double(), dy.double().sum(0), rtol=1e-6, atol=1e-5)
    assert torch.equal(out.data.view(torch.uint8), _reference(dy, 2.0 ** 9, E5M2).view(torch.uint8))
    assert q.quantize_dbias(dy, transpose=False, dbias=False)[1] is None


def test_recompute_records_grad_amax_only():
    # activation-checkpoint recompute: forward roles record nothing (their amax was counted in the first forward),
    # the gradient role always records
    st = _state()
    with fe.autocast(recipe=fe.DelayedScaling(amax_history_len=4)) as ctx:
        with recompute_context(ctx):
            q = get_quantizers(st, get_fp8_context())[0]
    assert q.input.amax is None and q.weight.amax is None and q.grad_output.record_amax
    x = torch.randn(16, 16) + 3
    q.input.quantize(x)
    assert st.amax_history[0, 0] == 0
    q.grad_output.quantize(x)
    assert st.amax_history[2, 0] == x.abs().max()


def test_cache_same_object_and_rebuilt_on_change():
    st = _state(MLP_ROLES, scales=(1.0,) * 6)
    delayed, current = fe.DelayedScaling(amax_history_len=4), fe.CurrentScaling()
    first = get_quantizers(st, FP8Context(delayed))
    assert len(first) == 2 and all(isinstance(g, LinearQuantizers) for g in first)
    assert first[1].input.role == "fc2_input" and first[0].grad_output.role == "fc1_grad_output"
    # the same state and an equal recipe in a new region: the very same objects (no per-call construction)
    assert get_quantizers(st, FP8Context(fe.DelayedScaling(amax_history_len=4))) is first
    # another recipe kind: rebuilt; back to the first recipe: the cached set again
    other = get_quantizers(st, FP8Context(current))
    assert other is not first and other[0].input.kind == "current"
    assert get_quantizers(st, FP8Context(delayed)) is first
    # another record flag: its own set
    assert get_quantizers(st, FP8Context(delayed, record_amax=False)) is not first
    # a history length change replaces the buffer: the views are rebuilt onto the new one
    longer = get_quantizers(st, FP8Context(fe.DelayedScaling(amax_history_len=8)))
    assert st.amax_history.shape[1] == 8 and longer is not first
    assert longer[0].input.amax.data_ptr() == st.amax_history.data_ptr()
    # the scale views are the live buffer: an in-place update (the scale update, load_state_dict) is seen
    st.scale[3] = 4.0
    assert longer[1].input.scale.item() == 4.0
    # a dtype cast keeps the buffers (float32, the same tensors): the cached views stay valid and are reused
    mod = fe.Linear(16, 16)
    with fe.autocast(recipe=delayed):
        before = mod.fp8_begin()
        assert mod.fp8_begin() is before
        scale = mod.fp8_state.scale
        mod.to(torch.float64)
        assert mod.fp8_state.scale is scale and mod.fp8_begin() is before
        # a move to another device gives new buffers (to_empty: new tensors even on the same device): new views
        mod.to_empty(device="cpu")
        after = mod.fp8_begin()
    assert after is not before and mod.fp8_state.scale is not scale
    assert after[0].input.scale.data_ptr() == mod.fp8_state.scale.data_ptr()  # row 0: the buffer's start
    assert after[0].weight.scale.dtype == torch.float32


def test_module_forward_builds_once():
    mod = fe.Linear(32, 16)
    x = torch.randn(8, 32)
    for _ in range(3):
        with fe.autocast(recipe=fe.DelayedScaling()):
            mod(x).sum().backward()
    assert len([k for k in mod.fp8_state._quantizers if k is not None]) == 1  # one recipe, one set


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        Quantizer(E4M3, "block")
    with pytest.raises(ValueError, match="scale"):
        Quantizer(E4M3, "delayed")
    with pytest.raises(TypeError, match="recipe"):
        recipe_kind(object())
