"""Profile one FP8 TransformerLayer fwd+bwd step on CUDA: top kernels by GPU time, and CPU (Python) time.

Usage: python tools/profile_layer.py [--seq 2048 --batch 4 --hidden 4096 --ffn 16384 --heads 32] [--bf16]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import fp8engine as fe
from fp8engine.modules.transformer import TransformerLayer

p = argparse.ArgumentParser()
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--hidden", type=int, default=4096)
p.add_argument("--ffn", type=int, default=16384)
p.add_argument("--heads", type=int, default=32)
p.add_argument("--bf16", action="store_true")
args = p.parse_args()
layer = TransformerLayer(args.hidden, args.ffn, args.heads, hidden_dropout=0.0, attention_dropout=0.0,
                         params_dtype=torch.bfloat16, device="cuda")
x = torch.randn(args.seq, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)


def step():
    with fe.autocast(enabled=not args.bf16):
        y = layer(x)
    y.backward(dy)


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
