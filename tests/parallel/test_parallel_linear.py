"""ColumnParallelLinear -> RowParallelLinear (an MLP without activation) on 2 and 4 gloo ranks (8 ranks in
test_world_size_8.py) against the same layers built unsharded (fp8engine.Linear) from the same seed: outputs, input
grads, weight/bias grads."""
import pytest
import torch

from _parallel_harness import run_ranks, shard, sqnr, world_group
from fp8engine import CurrentScaling, DelayedScaling, Linear, autocast
from fp8engine.parallel.mappings import gather_from_tensor_model_parallel_region
from fp8engine.parallel.layers import ColumnParallelLinear, RowParallelLinear, all_reduce_sequence_parallel_grads

S, B, K, F = 8, 2, 32, 64  # sequence, batch, hidden, ffn; F/4 = 16 keeps every FP8 shard a multiple of 16


def _build(tp_group, sp, dtype, seed=1234, **kw):
    torch.manual_seed(seed)
    col = ColumnParallelLinear(K, F, tp_group=tp_group, sequence_parallel=sp, params_dtype=dtype, **kw)
    row = RowParallelLinear(F, K, tp_group=tp_group, input_is_parallel=True, sequence_parallel=sp,
                            params_dtype=dtype)
    return col, row


def _reference(dtype, seed=1234):
    torch.manual_seed(seed)  # same draws, same order as _build: full column weight+bias, then full row weight+bias
    return Linear(K, F, params_dtype=dtype), Linear(F, K, params_dtype=dtype)


def _input(dtype, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, K, generator=g, dtype=torch.float64).to(dtype)


def _run_tp(col, row, x, sp, rank, ws, grad_out):
    xin = (shard(x, 0, rank, ws) if sp else x).clone().requires_grad_(True)
    h, _ = col(xin)
    y, _ = row(h)
    y.backward(shard(grad_out, 0, rank, ws) if sp else grad_out)
    return xin, y


def _check_hp(rank, ws, g, sp):
    """float64, no FP8: the sharded MLP must equal the unsharded one to float64 rounding (1e-12)."""
    tol = dict(rtol=1e-12, atol=1e-12)  # only the summation order of the all-reduce / GEMM splits differs
    dtype = torch.float64
    col, row = _build(g, sp, dtype)
    ref_col, ref_row = _reference(dtype)
    # Initialisation: the shards equal the slices of the unsharded layers, exactly.
    torch.testing.assert_close(col.weight, shard(ref_col.weight, 0, rank, ws), rtol=0, atol=0)
    torch.testing.assert_close(col.bias, shard(ref_col.bias, 0, rank, ws), rtol=0, atol=0)
    torch.testing.assert_close(row.weight, shard(ref_row.weight, 1, rank, ws), rtol=0, atol=0)
    torch.testing.assert_close(row.bias, ref_row.bias, rtol=0, atol=0)

    x, dy = _input(dtype), _input(dtype, seed=8)
    xr = x.clone().requires_grad_(True)
    yr = ref_row(ref_col(xr))
    yr.backward(dy)
    xin, y = _run_tp(col, row, x, sp, rank, ws, dy)
    all_reduce_sequence_parallel_grads(row, g)
    torch.testing.assert_close(y, shard(yr, 0, rank, ws) if sp else yr, **tol)
    torch.testing.assert_close(xin.grad, shard(xr.grad, 0, rank, ws) if sp else xr.grad, **tol)
    torch.testing.assert_close(col.weight.grad, shard(ref_col.weight.grad, 0, rank, ws), **tol)
    torch.testing.assert_close(col.bias.grad, shard(ref_col.bias.grad, 0, rank, ws), **tol)
    torch.testing.assert_close(row.weight.grad, shard(ref_row.weight.grad, 1, rank, ws), **tol)
    torch.testing.assert_close(row.bias.grad, ref_row.bias.grad, **tol)


def _check_options(rank, ws, g):
    """gather_output, skip_bias_add, input_is_parallel=False, gradient_accumulation_fusion, frozen weights."""
    tol = dict(rtol=1e-12, atol=1e-12)
    dtype = torch.float64
    x, dy = _input(dtype), _input(dtype, seed=8)
    torch.manual_seed(5)
    col = ColumnParallelLinear(K, F, tp_group=g, gather_output=True, skip_bias_add=True, params_dtype=dtype,
                               gradient_accumulation_fusion=True)
    row = RowParallelLinear(F, K, tp_group=g, input_is_parallel=False, skip_bias_add=True, params_dtype=dtype)
    row.weight.requires_grad_(False)  # frozen: no wgrad, but dgrad still flows
    torch.manual_seed(5)
    ref_col, ref_row = Linear(K, F, params_dtype=dtype), Linear(F, K, params_dtype=dtype)
    col.weight.main_grad = torch.full_like(col.weight, 0.5, dtype=torch.float32)
    xin = x.clone().requires_grad_(True)
    h, hb = col(xin)
    assert h.shape == (S, B, F) and hb is col.bias
    # The skipped bias is this rank's [F/tp] shard (as in Megatron); gather it to add it to the gathered output.
    y, yb = row(h + gather_from_tensor_model_parallel_region(hb, g))
    assert yb is row.bias
    (y + yb).backward(dy)
    xr = x.clone().requires_grad_(True)
    yr = ref_row(ref_col(xr))
    yr.backward(dy)
    torch.testing.assert_close(y + yb, yr, **tol)
    torch.testing.assert_close(xin.grad, xr.grad, **tol)
    assert col.weight.grad is None, "gradient_accumulation_fusion must leave weight.grad None"
    # main_grad is fp32: wgrad accumulated on top of 0.5, compared at fp32 precision
    torch.testing.assert_close(col.weight.main_grad, (0.5 + shard(ref_col.weight.grad, 0, rank, ws)).float(),
                               rtol=1e-6, atol=1e-6)
    assert row.weight.grad is None, "a frozen weight must get no gradient"
    torch.testing.assert_close(row.bias.grad, ref_row.bias.grad, **tol)
    torch.testing.assert_close(col.bias.grad, shard(ref_col.bias.grad, 0, rank, ws), **tol)


def _hp_check(rank, ws, g):
    """The float64 checks on group ``g``, of which this process is rank ``rank`` of ``ws``."""
    _check_hp(rank, ws, g, sp=False)
    _check_hp(rank, ws, g, sp=True)
    _check_options(rank, ws, g)


def _hp_worker(rank, ws):
    _hp_check(rank, ws, world_group())


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_mlp_matches_unsharded_fp64(world_size):
    run_ranks(_hp_worker, world_size)


def _fp8_step(col, row, x, dy, sp, rank, ws, recipe, g):
    with autocast(recipe=recipe, amax_group=None):
        xin = (shard(x, 0, rank, ws) if sp else x).clone().requires_grad_(True)
        h, _ = col(xin)
        y, _ = row(h)
    y.backward(shard(dy, 0, rank, ws) if sp else dy)
    all_reduce_sequence_parallel_grads(row, g)
    return y, xin.grad, [p.grad.clone() for p in (col.weight, col.bias, row.weight, row.bias)]


def _fp8_worker(rank, ws, recipe_name):
    g = world_group()
    recipe = DelayedScaling(amax_history_len=4) if recipe_name == "delayed" else CurrentScaling()
    x, dy = _input(torch.float32), _input(torch.float32, seed=8)
    ref_col, ref_row = (m.double() for m in _reference(torch.float32))  # draw in fp32 like the layers, then fp64
    xr = x.double().requires_grad_(True)
    yr = ref_row(ref_col(xr))
    yr.backward(dy.double())
    ref_grads = [shard(ref_col.weight.grad, 0, rank, ws), shard(ref_col.bias.grad, 0, rank, ws),
                 shard(ref_row.weight.grad, 1, rank, ws), ref_row.bias.grad]
    results = {}
    for sp, fp8_ag in ((False, False), (True, False), (True, True)):
        col, row = _build(g, sp, torch.float32, fp8_all_gather=fp8_ag)
        for step in range(3):  # delayed scaling: step 0 uses scale 1, later steps the recorded amaxes
            for p in (col.weight, col.bias, row.weight, row.bias):
                p.grad = None
            out = _fp8_step(col, row, x, dy, sp, rank, ws, recipe, g)
        results[(sp, fp8_ag)] = out
        y, dx, grads = out
        # FP8 vs the float64 unsharded reference: >= 18 dB for linear outputs and grads (torchao's threshold).
        assert sqnr(shard(yr, 0, rank, ws) if sp else yr, y) >= 18, (sp, fp8_ag, "output")
        assert sqnr(shard(xr.grad, 0, rank, ws) if sp else xr.grad, dx) >= 18, (sp, fp8_ag, "dgrad")
        for name, ref, got in zip(("col.w", "col.b", "row.w", "row.b"), ref_grads, grads):
            assert sqnr(ref, got) >= 18, (sp, fp8_ag, name, sqnr(ref, got))
        if sp and fp8_ag and recipe_name == "delayed":
            # The input amax recorded by the FP8 all-gather is the tp-MAX: every rank's history row is equal.
            hist = col.fp8_state.amax_history[0].clone()
            others = [torch.empty_like(hist) for _ in range(ws)]
            torch.distributed.all_gather(others, hist, group=g)
            for o in others:
                torch.testing.assert_close(o, hist, rtol=0, atol=0)
    # Casting shards with the shared scale then gathering FP8 bytes gives exactly the bits of gathering in high
    # precision then casting: the two sequence-parallel paths must agree bit for bit (tolerance 0).
    a, b = results[(True, False)], results[(True, True)]
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    for ga, gb in zip(a[2], b[2]):
        torch.testing.assert_close(ga, gb, rtol=0, atol=0)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_parallel_mlp_fp8(recipe_name):
    run_ranks(_fp8_worker, 2, recipe_name)


def test_fp8_all_gather_4_ranks():
    run_ranks(_fp8_worker, 4, "current")
