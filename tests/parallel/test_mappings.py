"""The mapping functions, forward and backward, exactly (integer-valued float32 data: every sum is exact, so the
distributed result must equal the unsharded one bit for bit, tolerance 0), on 2 and 4 gloo ranks (8 ranks in
test_world_size_8.py); eager, and under
``torch.compile`` (where they issue functional collectives: the in-place ones, as traced by the Dynamo of torch 2.11,
gave ``reduce_from_tensor_model_parallel_region`` a zero input gradient)."""
import pytest
import torch

from _parallel_harness import run_ranks, world_group
from fp8engine.parallel import mappings as M

# full sequence, batch, hidden: S and H divisible by 2, 4 and 8; at 8 ranks the uneven sequence shards take
# S >= 12 rows (1 + 2 + 1 + 2 + ...) and the uneven all_to_all S*B >= 36 (rank r sends j + 1 rows to rank j)
S, B, H = 16, 3, 16


def _ints(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).float()


def _exact(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _check(fn, x_local, grad_local, want_out, want_grad, what, compiled=False):
    if compiled:  # aot_eager: Dynamo and AOTAutograd trace forward and backward, ATen runs them (no codegen)
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x = x_local.clone().requires_grad_(True)
    y = fn(x)
    _exact(y, want_out, what + " forward")
    y.backward(grad_local)
    _exact(x.grad, want_grad, what + " backward")


def _mappings_check(rank, ws, g, compiled=False, salt=0):
    """Every mapping on group ``g``, of which this process is rank ``rank`` of ``ws``. ``salt``: seeds the data, so
    that disjoint groups (e.g. two tp groups of 4 in 8 ranks, salt = group index) hold different tensors."""
    def check(*args):
        _check(*args, compiled=compiled)

    full = _ints(salt * 1000, S, B, H)                  # the same full tensor on every rank
    per_rank = [_ints(salt * 1000 + 100 + r, S, B, H) for r in range(ws)]  # a different full-size tensor per rank
    total = sum(per_rank)
    hs, ss = H // ws, S // ws
    hsl = slice(rank * hs, (rank + 1) * hs)
    ssl = slice(rank * ss, (rank + 1) * ss)
    mine = per_rank[rank]

    check(lambda x: M.copy_to_tensor_model_parallel_region(x, g), full, mine, full, total, "copy_to")
    check(lambda x: M.reduce_from_tensor_model_parallel_region(x, g), mine, full, total, full, "reduce_from")
    # scatter: grad is the local shard of a rank-specific tensor; backward all-gathers every rank's shard.
    gathered_h = torch.cat([per_rank[r][..., r * hs:(r + 1) * hs] for r in range(ws)], dim=-1)
    check(lambda x: M.scatter_to_tensor_model_parallel_region(x, g), full, mine[..., hsl], full[..., hsl],
           gathered_h, "scatter_to_tp")
    check(lambda x: M.gather_from_tensor_model_parallel_region(x, g), mine[..., hsl], full, gathered_h,
           full[..., hsl], "gather_from_tp")
    gathered_s = torch.cat([per_rank[r][r * ss:(r + 1) * ss] for r in range(ws)], dim=0)
    check(lambda x: M.scatter_to_sequence_parallel_region(x, g), full, mine[ssl], full[ssl], gathered_s,
           "scatter_to_sp")
    check(lambda x: M.gather_from_sequence_parallel_region(x, g), mine[ssl], mine, gathered_s, total[ssl],
           "gather_from_sp (reduce-scatter grad)")
    check(lambda x: M.gather_from_sequence_parallel_region(x, g, tensor_parallel_output_grad=False), mine[ssl],
           full, gathered_s, full[ssl], "gather_from_sp (split grad)")
    check(lambda x: M.reduce_scatter_to_sequence_parallel_region(x, g), mine, mine[ssl], total[ssl], gathered_s,
           "reduce_scatter_to_sp")
    check(lambda x: M.all_gather_last_dim_from_tensor_parallel_region(x, g), mine[..., hsl], mine, gathered_h,
           total[..., hsl], "all_gather_last_dim")
    check(lambda x: M.reduce_scatter_last_dim_to_tensor_parallel_region(x, g), mine, mine[..., hsl],
           total[..., hsl], gathered_h, "reduce_scatter_last_dim")

    # uneven sequence shards: rank r holds r % 2 + 1 rows (the sequence-parallel gather / reduce-scatter with sizes)
    sizes = [r % 2 + 1 for r in range(ws)]
    starts = [sum(sizes[:r]) for r in range(ws)]
    usl = slice(starts[rank], starts[rank] + sizes[rank])
    gathered_u = torch.cat([per_rank[r][starts[r]:starts[r] + sizes[r]] for r in range(ws)], dim=0)
    total_u = total[:sum(sizes)]
    check(lambda x: M.gather_from_sequence_parallel_region(x, g, output_split_sizes=sizes), mine[usl],
           mine[:sum(sizes)], gathered_u, total_u[usl], "gather_from_sp uneven")
    check(lambda x: M.reduce_scatter_to_sequence_parallel_region(x, g, input_split_sizes=sizes), mine[:sum(sizes)],
           mine[usl], total_u[usl], gathered_u, "reduce_scatter_to_sp uneven")

    # all_to_all with even splits: chunk j of rank r lands at chunk r of rank j; its own inverse in backward.
    chunks = [per_rank[r].reshape(S * B, H).chunk(ws) for r in range(ws)]
    want = torch.cat([chunks[r][rank] for r in range(ws)])
    check(lambda x: M.all_to_all(g, x), mine.reshape(S * B, H), want, want, mine.reshape(S * B, H), "all_to_all")
    # uneven splits: rank r sends (j + 1) rows to rank j and receives (rank + 1) rows from everyone.
    in_splits = [j + 1 for j in range(ws)]
    out_splits = [rank + 1] * ws
    rows = sum(in_splits)
    src = [per_rank[r].reshape(S * B, H)[:rows] for r in range(ws)]  # [rows, H]
    want = torch.cat([src[r].split(in_splits)[rank] for r in range(ws)])
    check(lambda x: M.all_to_all(g, x, out_splits, in_splits), src[rank], want, want, src[rank],
           "all_to_all uneven")

    # sp2hp: [s/tp * b, h] sequence shard -> [s * b, h/tp] hidden shard of the full tensor; hp2sp inverts it.
    sp = mine[ssl].reshape(ss * B, H)
    hp_want = gathered_s.reshape(S * B, H)[:, hsl]  # the hidden shard of the logical full tensor
    check(lambda x: M.all_to_all_sp2hp(x, g), sp, hp_want, hp_want, sp, "all_to_all_sp2hp")
    check(lambda x: M.all_to_all_hp2sp(x, g), hp_want, sp, sp, hp_want, "all_to_all_hp2sp")


def _mappings_worker(rank, ws, compiled=False):
    _mappings_check(rank, ws, world_group(), compiled)


@pytest.mark.parametrize("world_size", [2, 4])
def test_mappings_exact(world_size):
    run_ranks(_mappings_worker, world_size)


def test_mappings_exact_compiled():
    run_ranks(_mappings_worker, 2, True)


def test_mappings_identity_without_group():
    x = torch.randn(4, 2, 16, requires_grad=True)
    for fn in (M.copy_to_tensor_model_parallel_region, M.reduce_from_tensor_model_parallel_region,
               M.scatter_to_tensor_model_parallel_region, M.gather_from_tensor_model_parallel_region,
               M.scatter_to_sequence_parallel_region, M.gather_from_sequence_parallel_region,
               M.reduce_scatter_to_sequence_parallel_region, M.all_gather_last_dim_from_tensor_parallel_region,
               M.reduce_scatter_last_dim_to_tensor_parallel_region):
        y = fn(x, None)
        _exact(y, x, fn.__name__)
        y.sum().backward()
        _exact(x.grad, torch.ones_like(x), fn.__name__ + " grad")
        x.grad = None
