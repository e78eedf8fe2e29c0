"""ColumnParallelLinear -> RowParallelLinear under Float8BlockScaling on 2 gloo ranks against the same layers built
unsharded (fp8engine.Linear under the same recipe) from the same seed, and against float64; the sequence-parallel
FP8 all-gather of block-scaled shards (scales travel with the data) against the high-precision all-gather; and the
TransformerLayer's own tensor / sequence parallelism under block scaling against the unsharded layer."""
import torch

from _parallel_harness import run_ranks, shard, sqnr, world_group
from fp8engine import Float8BlockScaling, Linear, autocast
from fp8engine.parallel.layers import ColumnParallelLinear, RowParallelLinear, all_reduce_sequence_parallel_grads

K, F = 256, 256  # hidden, ffn: F/2 = 128 keeps every shard a whole number of 128-blocks
RECIPE = Float8BlockScaling()


def _build(g, sp, fp8_ag, seed=1234):
    torch.manual_seed(seed)
    col = ColumnParallelLinear(K, F, tp_group=g, sequence_parallel=sp, fp8_all_gather=fp8_ag)
    row = RowParallelLinear(F, K, tp_group=g, input_is_parallel=True, sequence_parallel=sp)
    return col, row


def _unsharded(seed=1234):
    torch.manual_seed(seed)  # the same draws in the same order as _build
    return Linear(K, F), Linear(F, K)


def _step(col, row, x, dy, recipe, sp=False, rank=0, ws=1, g=None):
    """Forward (inside autocast(recipe) unless None) and backward; returns (y, dx, [grads])."""
    xin = (shard(x, 0, rank, ws) if sp else x).clone().requires_grad_(True)
    with autocast(enabled=recipe is not None, recipe=recipe):
        h = col(xin)
        y = row(h[0] if isinstance(h, tuple) else h)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(shard(dy, 0, rank, ws) if sp else dy)
    if g is not None:
        all_reduce_sequence_parallel_grads(row, g)
    return y, xin.grad, [p.grad for p in (col.weight, col.bias, row.weight, row.bias)]


def _worker(rank, ws, s):
    g = world_group()
    gen = torch.Generator().manual_seed(7)
    x, dy = torch.randn(s, 2, K, generator=gen), torch.randn(s, 2, K, generator=gen)
    ref_col, ref_row = _unsharded()
    by, bdx, bgrads = _step(ref_col, ref_row, x, dy, RECIPE)  # unsharded, block-scaled
    f_col, f_row = (m.double() for m in _unsharded())
    fy, fdx, fgrads = _step(f_col, f_row, x.double(), dy.double(), None)  # float64
    shards = lambda gr: [shard(gr[0], 0, rank, ws), shard(gr[1], 0, rank, ws), shard(gr[2], 1, rank, ws), gr[3]]
    results = {}
    for sp, fp8_ag in ((False, False), (True, False), (True, True)):
        col, row = _build(g, sp, fp8_ag)
        y, dx, grads = _step(col, row, x, dy, RECIPE, sp, rank, ws, g)
        results[(sp, fp8_ag)] = (y, dx, grads)
        cut = (lambda t: shard(t, 0, rank, ws)) if sp else (lambda t: t)
        # Same FP8 operands as the unsharded layers (shard boundaries are block boundaries); only the summation
        # of partial results may differ. Measured: bit-identical, except the sequence-parallel row bias gradient
        # (partial sums over the shards all-reduced: ~140 dB, fp32 rounding); asserted >= 80 dB.
        for name, got, want in [("y", y, cut(by)), ("dx", dx, cut(bdx))] + list(zip("wbWB", grads,
                                                                                    shards(bgrads))):
            assert sqnr(want, got) >= 80, (sp, fp8_ag, name, sqnr(want, got))
        # vs float64: one block-scaled GEMM after another (as in the MLP): measured >= 25.7 dB, asserted >= 21
        # (tests/modules/test_block_modules.py's E4M3 gradient threshold)
        for name, got, want in [("y", y, cut(fy)), ("dx", dx, cut(fdx))] + list(zip("wbWB", grads,
                                                                                    shards(fgrads))):
            assert sqnr(want, got) >= 21, (sp, fp8_ag, name, sqnr(want, got))
    # The FP8 all-gather of block-scaled shards moves the bits and scales the cast of the gathered tensor would
    # have: the two sequence-parallel paths agree bit for bit (tolerance 0). With s * 2 / 2 tokens per rank not a
    # multiple of 128 (s = 100) the op falls back to the high-precision gather: also identical.
    a, b = results[(True, False)], results[(True, True)]
    for ta, tb in zip([a[0], a[1]] + a[2], [b[0], b[1]] + b[2]):
        torch.testing.assert_close(ta, tb, rtol=0, atol=0)


def test_block_parallel_layers_match_unsharded():
    """s = 128: 128 tokens per rank under sequence parallelism (the FP8 all-gather path), and s = 100: 100 per rank
    (high-precision gather; 200 tokens in all, zero-padded to 256 for the GEMMs)."""
    run_ranks(_worker, 2, 128)
    run_ranks(_worker, 2, 100)


def _layer_worker(rank, ws, sp):
    """TransformerLayer(256, 512, 4 heads) with tensor (and sequence) parallelism under block scaling vs the same
    layer unsharded under block scaling, loaded with the same weights (as tests/parallel/test_tp_transformer_layer.py).
    Every shard is a whole number of 128-blocks (QKV 384 rows, proj 128 columns, fc1 256 rows, fc2 256 columns per
    rank), so the FP8 operands are the unsharded ones: only the summation of partial results differs."""
    from fp8engine.modules.transformer import TransformerLayer

    g = world_group()
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    ref = TransformerLayer(256, 512, 4, **kw)
    tp = TransformerLayer(256, 512, 4, set_parallel_mode=True, tp_group=g, sequence_parallel=sp, **kw)
    full = dict(ref.named_parameters())
    dims = {}
    with torch.no_grad():
        for name, p in tp.named_parameters():
            diff = [d for d in range(p.dim()) if p.shape[d] != full[name].shape[d]]
            dims[name] = diff[0] if diff else None
            p.copy_(full[name] if not diff else shard(full[name], diff[0], rank, ws))
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(128, 2, 256, generator=gen), torch.randn(128, 2, 256, generator=gen)
    xr, xt = x.clone().requires_grad_(True), (shard(x, 0, rank, ws) if sp else x).clone().requires_grad_(True)
    with autocast(recipe=RECIPE):
        yr = ref(xr)
        yt = tp(xt)
    yr.backward(dy)
    yt.backward(shard(dy, 0, rank, ws) if sp else dy)
    if sp:
        all_reduce_sequence_parallel_grads(tp, g)
    cut = (lambda t: shard(t, 0, rank, ws)) if sp else (lambda t: t)
    pairs = [(cut(yr), yt, "output"), (cut(xr.grad), xt.grad, "dgrad")]
    pairs += [(full[n].grad if dims[n] is None else shard(full[n].grad, dims[n], rank, ws), p.grad, n)
              for n, p in tp.named_parameters()]
    # Measured: >= 129 dB (fp32 rounding of partial sums, which could flip an FP8 rounding downstream); asserted 60,
    # far above the ~25-30 dB that any difference in the FP8 operands (another block scale) would leave.
    for want, got, what in pairs:
        assert sqnr(want, got) >= 60, (sp, what, sqnr(want, got))


def test_block_transformer_layer_tp2_matches_unsharded():
    run_ranks(_layer_worker, 2, False)
    run_ranks(_layer_worker, 2, True)


def test_gradient_accumulation_fusion_and_frozen_weight_single_rank():
    """tp_group=None (one rank): gradient_accumulation_fusion adds the block-scaled wgrad (fp32) into main_grad,
    equal to the .grad of the unfused layer; a frozen row weight gets no gradient while dgrad still flows."""
    torch.manual_seed(3)
    plain = ColumnParallelLinear(K, F, tp_group=None)
    fused = ColumnParallelLinear(K, F, tp_group=None, gradient_accumulation_fusion=True)
    fused.load_state_dict(plain.state_dict())
    fused.weight.main_grad = torch.full((F, K), 0.5)
    row = RowParallelLinear(F, K, tp_group=None, input_is_parallel=True)
    row.weight.requires_grad_(False)
    x = torch.randn(128, 2, K)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with autocast(recipe=RECIPE):
        y1 = row(plain(x1)[0])[0]
        y2 = row(fused(x2)[0])[0]
    y1.sum().backward()
    y2.sum().backward()
    assert fused.weight.grad is None and row.weight.grad is None and row.bias.grad is not None
    torch.testing.assert_close(fused.weight.main_grad, 0.5 + plain.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)
