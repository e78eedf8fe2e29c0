"""qkv_grad_1x128 (the block-scaled QKV-gradient cast, gathering dq/dk/dv of any strides, with the rotation's
gradient) against its plain-PyTorch reference -- assemble, rope_bwd, pad the rows to 128, cast_1x128_reference --
and against the block cast kernel run on the assembled buffer: identical FP8 bits and scales; the bias gradient the
same fp32 sums up to summation order."""
import pytest
import torch
from _kernel_test_utils import DEVICES, FP8_DTYPES, assert_fp8_equal
from test_qkv_grad_kernel import _make_grads

from fp8engine.kernels._common import HAS_TRITON
from fp8engine.kernels.block_cast import cast_1x128_dbias
from fp8engine.kernels.qkv_grad import assemble_qkv_grad, qkv_grad_1x128, qkv_grad_1x128_reference
from fp8engine.ops.rotary import unrotate_grads
from fp8engine.ops.rotary import rope_cos_sin

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


def _same_casts(got, want, fp8_dtype):
    for i in (0, 2):  # data, data_t
        assert (got[i] is None) == (want[i] is None)
        if got[i] is not None:
            assert got[i].shape == want[i].shape
            assert_fp8_equal(got[i], want[i].to(got[i].device), fp8_dtype)
    for i in (1, 3):  # scale_inv, scale_inv_t: values and (T- / C-major) strides
        if got[i] is not None:
            # strides compared where the dim has more than one element (a size-1 dim's stride is arbitrary)
            assert all(sg == sw for sg, sw, n in zip(got[i].stride(), want[i].stride(), got[i].shape) if n > 1)
            assert got[i].shape == want[i].shape and torch.equal(got[i].cpu(), want[i].cpu())


def _qkv_columns(g, hpg, d):
    """Column order of the grouped layout from [dq heads | dk | dv] concatenated: per group its hpg query heads,
    its key head, its value head."""
    q = torch.arange(g * hpg * d).view(g, hpg, d)
    k = g * hpg * d + torch.arange(g * d).view(g, 1, d)
    v = g * hpg * d + g * d + torch.arange(g * d).view(g, 1, d)
    return torch.cat([q, k, v], dim=1).reshape(-1)


def _close_dbias(db, ref, grad):
    """fp32 sums in another order, rounded once to the dtype: within the recursive-summation bound n * 2**-24 *
    sum|grad| of the float64 sum (Higham §4.2; n the rows), plus two ulps of the dtype of the result (the rounding of
    each side)."""
    g64 = grad.double().cpu()
    exact, bound = g64.sum(0), g64.shape[0] * 2.0 ** -24 * g64.abs().sum(0)
    ulp = torch.finfo(ref.dtype).eps * exact.abs()
    assert db.dtype == ref.dtype and db.shape == ref.shape
    assert torch.all((db.double().cpu() - exact).abs() <= 2 * ulp + bound)


# every layout, dtype pair, token count (padded or not), grouping and rotary width appears; 12 cases, not the full
# product (the interpreter runs each in a few seconds)
_E4, _E5 = FP8_DTYPES
CASES = [(layout, dtype, fp8, sb, grp, rope)
         for i, (layout, (dtype, fp8), sb) in enumerate(
             [(lay, dt, sb) for lay in ("sdpa", "views") for dt in ((torch.bfloat16, _E4), (torch.float32, _E5))
              for sb in ((32, 2), (37, 3), (64, 2))])
         for grp, rope in [(((4, 1, 32), (2, 3, 64))[i % 2], (None, "full", "partial")[i % 3])]]


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout,dtype,fp8_dtype,sb,grouping,rope", CASES)
def test_matches_reference(device, layout, dtype, fp8_dtype, sb, grouping, rope):
    (s, b), (g, hpg, d) = sb, grouping
    dq, dk, dv = _make_grads(layout, s, b, g, hpg, d, dtype, device, seed=s + d + g)
    cos = sin = None
    if rope is not None:
        r = d if rope == "full" else d // 2
        freqs = torch.rand(s, 1, 1, r, generator=torch.Generator().manual_seed(1)) * 6.0
        cos, sin = (t.to(device) for t in rope_cos_sin(freqs, dtype))
    for transpose, dbias in ((True, True), (False, False)):
        got = qkv_grad_1x128(dq, dk, dv, fp8_dtype, transpose=transpose, dbias=dbias, cos=cos, sin=sin)
        rq, rk = (dq.cpu(), dk.cpu()) if cos is None else unrotate_grads(dq.cpu(), dk.cpu(), (cos.cpu(), sin.cpu()))
        want = qkv_grad_1x128_reference(rq, rk, dv.cpu(), fp8_dtype, transpose=transpose, dbias=dbias)
        t_out = -(-s * b // 128) * 128
        assert got[0].shape == (t_out, g * (hpg + 2) * d)
        _same_casts(got, want, fp8_dtype)
        if dbias:
            grad = assemble_qkv_grad(dq, dk, dv).reshape(s * b, -1) if rope is None else None
            if grad is not None:
                _close_dbias(got[4], want[4], grad)
                # the block cast kernel on the assembled, padded buffer: the same casts
                padded = torch.nn.functional.pad(grad, (0, 0, 0, t_out - s * b))
                _same_casts(got, cast_1x128_dbias(padded, fp8_dtype, transpose=True), fp8_dtype)
            else:  # the rotated gradient's column sums (the reference's assembled buffer is not at hand here)
                _close_dbias(got[4], want[4], torch.cat([t.reshape(s * b, -1) for t in (rq, rk, dv.cpu())], dim=1)
                             [:, _qkv_columns(g, hpg, d)])
        else:
            assert got[4] is None and got[2] is None


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_problem(device):
    dq, dk, dv = _make_grads("sdpa", 8, 2, 2, 1, 16, torch.bfloat16, device)  # C = 2 * 3 * 16 = 96
    with pytest.raises(ValueError, match="multiple of 128"):
        qkv_grad_1x128(dq, dk, dv, torch.float8_e4m3fn)
    dq, dk, dv = _make_grads("sdpa", 8, 2, 4, 1, 32, torch.bfloat16, device)
    with pytest.raises(ValueError, match="all required"):
        qkv_grad_1x128(dq, None, dv, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="fp8_dtype"):
        qkv_grad_1x128(dq, dk, dv, torch.int8)
    with pytest.raises(TypeError, match="dtype"):
        qkv_grad_1x128(dq, dk.float(), dv, torch.float8_e4m3fn)
