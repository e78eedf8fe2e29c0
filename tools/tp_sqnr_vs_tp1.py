"""How close is the tensor (+ sequence) parallel TransformerLayer to tp=1 on GPUs over NCCL, in bf16 and FP8?
(the CPU tests check the same on gloo; this runs it on the GPUs' kernels and NCCL)

Usage: torchrun --nproc-per-node T tools/tp_sqnr_vs_tp1.py. TransformerLayer(2048, 8192, 16) on [1024, 2, 2048]
bf16, 3 steps (delayed scaling calibrates). Each rank builds the unsharded layer (the tp=1 reference)
and the TP layer whose parameters are the slices of the reference's; prints per-rank SQNR (dB) of the output,
the input gradient and the worst parameter gradient against the reference.
"""
import argparse
import os

import torch
import torch.distributed as dist

from fp8engine import DelayedScaling, autocast
from fp8engine.modules.transformer import TransformerLayer
from fp8engine.parallel import all_reduce_sequence_parallel_grads

S, B, H, F, HEADS = 1024, 2, 2048, 8192, 16


def sqnr(ref, x):
    ref, x = ref.detach().double(), x.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - x).norm().clamp_min(1e-30)))


def shard(t, dim, rank, ws):
    return t.chunk(ws, dim=dim)[rank]


def run(fp8: bool, sp: bool, group, rank, ws):
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, device="cuda")
    torch.manual_seed(0)
    ref = TransformerLayer(H, F, HEADS, **kw)
    torch.manual_seed(0)
    tp = TransformerLayer(H, F, HEADS, set_parallel_mode=True, tp_group=group, sequence_parallel=sp, **kw)
    full = dict(ref.named_parameters())
    dims = {}
    for name, p in tp.named_parameters():  # the TP weights must already be the slices (same seed)
        diff = [d for d in range(p.dim()) if p.shape[d] != full[name].shape[d]]
        dims[name] = diff[0] if diff else None
        want = full[name] if not diff else shard(full[name], diff[0], rank, ws)
        assert torch.equal(p, want), f"{name}: TP shard is not the slice of the unsharded weight"
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(S, B, H, device="cuda", generator=g).bfloat16()
    dy = torch.randn(S, B, H, device="cuda", generator=g).bfloat16()
    xr, xt = x.clone().requires_grad_(), (shard(x, 0, rank, ws) if sp else x).clone().requires_grad_()
    for _ in range(3):  # a few steps so delayed scaling has calibrated scales
        for p in list(ref.parameters()) + list(tp.parameters()):
            p.grad = None
        xr.grad = xt.grad = None
        with autocast(enabled=fp8, recipe=DelayedScaling()):
            yr = ref(xr)
        yr.backward(dy)
        with autocast(enabled=fp8, recipe=DelayedScaling(), amax_group=group):
            yt = tp(xt)
        yt.backward(shard(dy, 0, rank, ws) if sp else dy)
        if sp:
            all_reduce_sequence_parallel_grads(tp, group)
    out = sqnr(shard(yr, 0, rank, ws) if sp else yr, yt)
    dx = sqnr(shard(xr.grad, 0, rank, ws) if sp else xr.grad, xt.grad)
    worst = min((sqnr(full[n].grad if dims[n] is None else shard(full[n].grad, dims[n], rank, ws), p.grad), n)
                for n, p in tp.named_parameters())
    return out, dx, worst


def main():
    dist.init_process_group("nccl")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    group = dist.new_group(list(range(ws)))
    rows = []
    for fp8 in (False, True):
        for sp in (False, True):
            out, dx, (wg, wname) = run(fp8, sp, group, rank, ws)
            rows.append(f"| {ws} | {'fp8 delayed' if fp8 else 'bf16'} | {sp} | {rank} | {out:.1f} | {dx:.1f} | "
                        f"{wg:.1f} ({wname}) |")
    gathered = [None] * ws
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print("| tp | precision | seq-parallel | rank | output SQNR dB | dgrad SQNR dB | worst wgrad SQNR dB |")
        print("|---|---|---|---|---|---|---|")
        for r in sorted(sum(gathered, []), key=lambda s: s.split("|")[2:5]):
            print(r)
    dist.destroy_process_group()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
