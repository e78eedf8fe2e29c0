"""BlockQuantizer and the block kind of get_quantizers: roles -> blocks and formats, caching, the casts are
exactly quantize_block's, nothing recorded or registered."""
import pytest
import torch

from fp8engine.fp8.autocast import FP8Context
from fp8engine.fp8.block_quantizer import BlockQuantizer
from fp8engine.fp8.block_tensor import BLOCK_128x128, TILE_1x128, quantize_block
from fp8engine.fp8.quantizer import LinearQuantizers, get_quantizers, recipe_kind
from fp8engine.fp8.state import ScalingState
from fp8engine.ops.linear import LINEAR_ROLES
from fp8engine.ops.mlp import MLP_ROLES
from fp8engine.recipe import Float8BlockScaling, Format

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("fmt,grad_dtype", [(Format.E4M3, E4M3), (Format.HYBRID, E5M2)])
def test_roles_blocks_and_formats(fmt, grad_dtype):
    recipe = Float8BlockScaling(fmt, power_2_scale=False)
    assert recipe_kind(recipe) == "block"
    qs = get_quantizers(ScalingState(MLP_ROLES), FP8Context(recipe))
    assert len(qs) == 2 and all(isinstance(q, LinearQuantizers) for q in qs)
    for gemm in qs:
        assert all(isinstance(q, BlockQuantizer) and q.is_block and q.kind == "block" for q in gemm)
        assert (gemm.input.block, gemm.weight.block, gemm.grad_output.block) == (TILE_1x128, BLOCK_128x128,
                                                                                   TILE_1x128)
        assert (gemm.input.fp8_dtype, gemm.weight.fp8_dtype, gemm.grad_output.fp8_dtype) == (E4M3, E4M3, grad_dtype)
        assert not any(q.power_2_scale for q in gemm)
        # what per-tensor code reads off a quantizer: no delayed scale, nothing recorded
        assert all(q.delayed is False and q.scale is None and q.amax is None and not q.record_amax for q in gemm)


def test_cached_per_state_and_recipe_and_not_registered():
    st = ScalingState(LINEAR_ROLES)
    recipe = Float8BlockScaling()
    ctx = FP8Context(recipe)
    first = get_quantizers(st, ctx)
    assert get_quantizers(st, ctx) is first  # the same tuple: no per-call building
    assert get_quantizers(st, FP8Context(Float8BlockScaling())) is first  # an equal recipe: the same set
    assert get_quantizers(st, FP8Context(Float8BlockScaling(Format.HYBRID))) is not first
    assert ctx.states == {}  # just in time: nothing to update at the region's exit
    assert st.amax_history.shape[1] == 1024  # no resize to a history length


@pytest.mark.parametrize("block", [TILE_1x128, BLOCK_128x128])
def test_quantize_is_quantize_block(block):
    x = torch.randn(256, 384, dtype=torch.bfloat16) * torch.logspace(-3, 3, 384)
    q = BlockQuantizer(E4M3, block)
    got = q.quantize(x, transpose=True)
    got_t = got.t_operand()
    want, want_t = quantize_block(x, E4M3, block, transpose=True)
    for a, b in ((got, want), (got_t, want_t)):
        assert a.block == b.block and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale_inv, b.scale_inv)
    only = q.quantize(x)
    assert only._t is None and torch.equal(only.data.view(torch.uint8), want.data.view(torch.uint8))


@pytest.mark.parametrize("use_kernel", [False, True])  # True: the Triton kernel (the interpreter on the CPU)
def test_quantize_dbias_is_quantize_and_the_column_sums(use_kernel):
    """``quantize_dbias``: the casts are ``quantize``'s, bit for bit, and the bias gradient the fp32 column sums of
    dy rounded once (the reference path: exactly torch's sum; the kernel: another fp32 summation order, within one
    bf16 ulp of it). The 3-D input is viewed as [M, N]."""
    if use_kernel and not torch.cuda.is_available():
        pytest.importorskip("triton")
    dev = "cuda" if use_kernel and torch.cuda.is_available() else "cpu"
    dy = (torch.randn(2, 128, 384) * torch.logspace(-2, 2, 384)).to(torch.bfloat16).to(dev)
    q = BlockQuantizer(E5M2, TILE_1x128, kernels=use_kernel)
    got, db = q.quantize_dbias(dy, transpose=True)
    got_t = got.t_operand()
    want = q.quantize(dy, transpose=True)
    want_t = want.t_operand()
    for a, b in ((got, want), (got_t, want_t)):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale_inv, b.scale_inv)
    ref = dy.reshape(-1, 384).sum(0, dtype=torch.float32).to(torch.bfloat16)
    assert db.dtype == torch.bfloat16 and db.shape == (384,)
    if use_kernel:  # fp32 reordering (recursive-summation bound n * 2**-24 * sum|dy|) plus two bf16 ulps
        d64 = dy.reshape(-1, 384).double()
        exact, bound = d64.sum(0), 256 * 2.0 ** -24 * d64.abs().sum(0)
        assert torch.all((db.double() - exact).abs() <= 2 * 2.0 ** -7 * exact.abs() + bound)
    else:
        assert torch.equal(db, ref)
    only, db2 = q.quantize_dbias(dy, transpose=False)
    assert only.t_operand() is None and torch.equal(only.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(db2, db)


def test_quantize_dbias_errors():
    with pytest.raises(ValueError, match="1 x 128"):
        BlockQuantizer(E4M3, BLOCK_128x128, role="weight").quantize_dbias(torch.randn(128, 128))
    with pytest.raises(TypeError, match="dtype"):
        BlockQuantizer(E4M3, TILE_1x128, kernels=True).quantize_dbias(torch.randn(128, 128, dtype=torch.float64))


def test_bad_block():
    with pytest.raises(ValueError, match="block must be"):
        BlockQuantizer(E4M3, (128, 1))
