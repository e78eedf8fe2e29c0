"""RNG tracker, checkpoint / CheckpointWithoutOutput (RNG replay, FP8 scales, amaxes recorded once),
ParallelDims checks, and on 4 gloo ranks: init_parallel's (dp=2, tp=2) mesh and the data-parallel amax
reduction of the parallel layers (one collective per update)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _parallel_harness import run_ranks
from fp8engine import DelayedScaling, Linear, autocast
from fp8engine.parallel import (CheckpointWithoutOutput, ColumnParallelLinear, ParallelDims, RNGStatesTracker,
                                RowParallelLinear, checkpoint, init_parallel, model_parallel_manual_seed)


def _block(lin, tracker):
    def fn(x):
        with tracker.fork():
            h = F.dropout(lin(x), p=0.5)  # dropout inside the tp stream: must replay in the recompute
        return F.dropout(h, p=0.3)        # dropout on the default stream
    return fn


def test_tracker_fork_and_errors():
    tr = RNGStatesTracker("cpu")
    tr.add("a", 1)
    with pytest.raises(ValueError):
        tr.add("a", 2)
    with pytest.raises(ValueError):
        tr.add("b", 1)
    with pytest.raises(KeyError):
        with tr.fork("missing"):
            pass
    before = torch.get_rng_state()
    with tr.fork("a"):
        first = torch.rand(3)
    torch.testing.assert_close(torch.get_rng_state(), before, rtol=0, atol=0)  # default stream untouched
    with tr.fork("a"):
        second = torch.rand(3)
    torch.manual_seed(1)
    torch.testing.assert_close(torch.cat([first, second]), torch.rand(6), rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True])
def test_checkpoint_matches_plain_backward(fp8):
    """Checkpointed vs plain: same outputs and grads exactly (same RNG masks, same FP8 scales), and under FP8
    delayed scaling the amax histories equal the plain run's (forward amaxes recorded once)."""
    recipe = DelayedScaling(amax_history_len=4)
    results = []
    for use_ckpt in (False, True):
        torch.manual_seed(0)
        lin = Linear(32, 32)
        tracker = model_parallel_manual_seed(123, 0, RNGStatesTracker("cpu"))
        x = torch.randn(16, 32, requires_grad=True)
        fn = _block(lin, tracker)
        for step in range(2):  # step 2 runs after a scale update: the recompute must use the forward's scales
            lin.weight.grad = x.grad = None
            with autocast(enabled=fp8, recipe=recipe):
                y = checkpoint(fn, False, x, rng_tracker=tracker) if use_ckpt else fn(x)
            (y * torch.linspace(-1, 1, 32)).sum().backward()
        results.append((y.detach(), x.grad, lin.weight.grad, lin.fp8_state.amax_history.clone(),
                        lin.fp8_state.scale.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_without_output():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    ref = lin(torch.nn.functional.gelu(x)).sum()
    ref.backward()
    ref_grad = x.grad.clone()
    x.grad = None
    ck = CheckpointWithoutOutput()
    h = ck.checkpoint(torch.nn.functional.gelu, x)
    y = lin(h)
    ck.discard_output_and_register_recompute(y)
    assert h.untyped_storage().size() == 0
    y.sum().backward()
    torch.testing.assert_close(x.grad, ref_grad, rtol=0, atol=0)


def test_parallel_dims_validation():
    assert ParallelDims.from_env(2, world_size=8) == ParallelDims(dp=4, tp=2, world_size=8)
    with pytest.raises(ValueError, match="3"):
        ParallelDims.from_env(3, world_size=8)
    with pytest.raises(ValueError, match="world_size"):
        ParallelDims(dp=2, tp=2, world_size=8)
    dims = ParallelDims(dp=1, tp=4, world_size=4)
    dims.validate_model(num_heads=8, hidden=64, ffn=256, vocab=128)
    with pytest.raises(ValueError, match="num_heads=6"):
        dims.validate_model(num_heads=6)
    with pytest.raises(ValueError, match="vocab=130"):
        dims.validate_model(vocab=130)


def _mesh_worker(rank, ws):
    env = init_parallel(2, model_dims=dict(num_heads=4, hidden=32))
    assert env.dims == ParallelDims(dp=2, tp=2, world_size=4)
    assert dist.get_process_group_ranks(env.tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(env.dp_group) == [rank % 2, rank % 2 + 2]
    assert (env.dp_rank, env.tp_rank) == (rank // 2, rank % 2)

    # Data parallel amax reduction: dp replicas see different data; after the region, the recorded amaxes are
    # the dp-MAX, reduced in exactly one all_reduce for all states of both layers.
    torch.manual_seed(0)
    col = ColumnParallelLinear(32, 64, tp_group=env.tp_group, sequence_parallel=True)
    row = RowParallelLinear(64, 32, tp_group=env.tp_group, input_is_parallel=True, sequence_parallel=True)
    x = torch.randn(4, 2, 32) * (1 + env.dp_rank)  # sequence shard; replica 1 has twice the range
    calls = []
    real = dist.all_reduce

    def counting(tensor, *a, **kw):
        calls.append(tensor.numel())
        return real(tensor, *a, **kw)

    with autocast(recipe=DelayedScaling(amax_history_len=4), amax_group=env.dp_group):
        y, _ = row(col(x)[0])
        dist.all_reduce = counting  # count the collectives of the region's exit only
    dist.all_reduce = real
    assert len(calls) == 1, calls  # one batched amax reduction for both layers' 6 rows
    for st in (col.fp8_state, row.fp8_state):
        # the current amax was rolled into the last slot of the history by the update
        hist = st.amax_history[:, -1].clone()
        peers = [torch.empty_like(hist) for _ in range(ws)]
        dist.all_gather(peers, hist)
        torch.testing.assert_close(peers[rank ^ 2], hist, rtol=0, atol=0)  # dp peer: same tp rank, other replica
    # the input was scaled up on replica 1: the reduced input amax is replica 1's, on both replicas
    local_amax = (x.abs().amax() if env.dp_rank == 1 else None)
    if local_amax is not None:
        assert col.fp8_state.amax_history[0, -1] >= local_amax


def test_init_parallel_mesh_and_dp_amax_4_ranks():
    run_ranks(_mesh_worker, 4)
