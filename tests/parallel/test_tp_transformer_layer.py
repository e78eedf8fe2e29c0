"""fp8engine.modules.TransformerLayer with set_parallel_mode=True on 2 gloo ranks (tensor and sequence parallel)
against the same layer unsharded, loaded with the same weights (each TP parameter is the slice of the unsharded
one along the dimension whose size differs; replicated ones are copied)."""
import pytest
import torch

from _parallel_harness import run_ranks, shard, sqnr, world_group
from fp8engine import DelayedScaling, autocast
from fp8engine.parallel import all_reduce_sequence_parallel_grads

transformer = pytest.importorskip("fp8engine.modules.transformer")
S, B, H, F, HEADS = 8, 2, 32, 64, 4


def _split_dim(full, local):
    diff = [d for d in range(full.dim()) if full.shape[d] != local.shape[d]]
    assert len(diff) <= 1, (full.shape, local.shape)
    return diff[0] if diff else None


def _worker(rank, ws, sp, fp8, sizes=(S, B, H, F, HEADS)):
    S, B, H, F, HEADS = sizes  # noqa: N806 (same names as the module constants)
    g = world_group()
    dt = torch.float32 if fp8 else torch.float64
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dt)
    torch.manual_seed(0)
    ref = transformer.TransformerLayer(H, F, HEADS, **kw)
    tp = transformer.TransformerLayer(H, F, HEADS, set_parallel_mode=True, tp_group=g, sequence_parallel=sp, **kw)
    full = dict(ref.named_parameters())
    dims = {}
    with torch.no_grad():
        for name, p in tp.named_parameters():
            d = dims[name] = _split_dim(full[name], p)
            p.copy_(full[name] if d is None else shard(full[name], d, rank, ws))
    assert sum(d is not None for d in dims.values()) >= 4, dims  # really sharded
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dt)
    dy = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dt)
    xr = x.clone().requires_grad_(True)
    xt = (shard(x, 0, rank, ws) if sp else x).clone().requires_grad_(True)
    with autocast(enabled=fp8, recipe=DelayedScaling()):
        yr = ref(xr)
    yr.backward(dy)
    with autocast(enabled=fp8, recipe=DelayedScaling()):
        yt = tp(xt)
    yt.backward(shard(dy, 0, rank, ws) if sp else dy)
    if sp:
        all_reduce_sequence_parallel_grads(tp, g)  # replicated params (norms, row biases) see sequence shards
    pairs = [(shard(yr, 0, rank, ws) if sp else yr, yt, "output"),
             (shard(xr.grad, 0, rank, ws) if sp else xr.grad, xt.grad, "dgrad")]
    for name, p in tp.named_parameters():
        rg = full[name].grad
        pairs.append((rg if dims[name] is None else shard(rg, dims[name], rank, ws), p.grad, name))
    for want, got, what in pairs:
        if fp8:  # unsharded FP8 vs sharded FP8: different per-shard weight scales; >= 18 dB (torchao's bar)
            assert sqnr(want, got) >= 18, (what, sqnr(want, got))
        else:    # float64: only summation order differs
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=what)


@pytest.mark.parametrize("sp,fp8", [(False, False), (True, False), (True, True)])
def test_transformer_layer_tp2(sp, fp8):
    run_ranks(_worker, 2, sp, fp8)


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True])
def test_transformer_layer_tp8_sequence_parallel(fp8):
    """The tp=8 code path (issue 7's size) on 8 gloo ranks: 8 heads (one per rank), per-rank GEMM dims of 16/32/48
    so the FP8 path runs too; compared with the unsharded layer as above."""
    run_ranks(_worker, 8, True, fp8, (16, 2, 128, 256, 8))


def _dropout_worker(rank, ws, use_tracker):
    from fp8engine.parallel import RNGStatesTracker, model_parallel_manual_seed
    import torch.distributed as dist

    g = world_group()
    masks = []
    for _ in range(2):  # the same seeds twice: the same masks (reproducible)
        torch.manual_seed(0)
        tracker = model_parallel_manual_seed(0, rank, RNGStatesTracker("cpu")) if use_tracker else None
        layer = transformer.TransformerLayer(H, F, HEADS, hidden_dropout=0.5, attention_dropout=0.5,
                                             set_parallel_mode=True, tp_group=g, sequence_parallel=True,
                                             rng_tracker=tracker, params_dtype=torch.float64)
        before = torch.get_rng_state()
        mask = layer._dropout(torch.ones(S // ws, B, H, dtype=torch.float64))
        # With the tracker the default generator is untouched (data order etc. stay the same on every rank).
        assert torch.equal(torch.get_rng_state(), before) == use_tracker
        masks.append(mask)
    assert torch.equal(masks[0], masks[1])
    gathered = [torch.empty_like(masks[0]) for _ in range(ws)]
    dist.all_gather(gathered, masks[0], group=g)
    # Sequence shards on different ranks: independent masks with the tracker (seed + 2718 + tp_rank), the same
    # mask repeated on every shard without it (one default generator seeded alike everywhere).
    assert torch.equal(gathered[0], gathered[1]) != use_tracker


@pytest.mark.parametrize("use_tracker", [False, True])
def test_sequence_parallel_dropout_uses_the_tracker(use_tracker):
    run_ranks(_dropout_worker, 2, use_tracker)
