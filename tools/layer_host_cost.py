"""Does the FP8 layer step make the host wait for the GPU, and what does each kind of call in it cost on the host?
(CUDA; a measurement tool)

Prints the synchronising calls inside one TransformerLayer(4096, 16384, 32) step on [2048, 4, 4096] (torch's sync
debug mode), then the host microseconds per call of the calls a step is made of (``_scaled_mm``, SDPA,
``autograd.Function.apply``, allocation, views), with the GPU kept busy by a sleep kernel so the host never waits.

Usage: python tools/layer_host_cost.py
"""
import argparse
import warnings

import torch
import torch.nn.functional as F

import fp8engine as fe
from fp8engine.bench.common import host_us_per_call, print_table
from fp8engine.modules.transformer import TransformerLayer

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
s, b, h, f, heads = 2048, 4, 4096, 16384, 32
layer = TransformerLayer(h, f, heads, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                         device="cuda")
x = torch.randn(s, b, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
params = list(layer.parameters())


def step():
    x.grad = None
    for prm in params:
        prm.grad = None
    with fe.autocast():
        y = layer(x)
    y.backward(dy)


for _ in range(3):
    step()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step()
torch.cuda.set_sync_debug_mode("default")
torch.cuda.synchronize()
print(f"synchronising calls in one step: {len(caught)}")
for w in caught[:10]:
    print("  ", str(w.message)[:120], f"{w.filename}:{w.lineno}")

# host cost per call
one = torch.ones((), device="cuda")
xa = torch.randn(256, 256, device="cuda").to(torch.float8_e4m3fn)
wb = torch.randn(256, 256, device="cuda").to(torch.float8_e4m3fn)
bias = torch.zeros(256, device="cuda", dtype=torch.bfloat16)
q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
small = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)


class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g


req = small.clone().requires_grad_()
cases = {
    "torch._scaled_mm (bias, bf16 out)": lambda: torch._scaled_mm(xa, wb.t(), one, one, bias=bias,
                                                                   out_dtype=torch.bfloat16, use_fast_accum=True),
    "torch._scaled_mm (fp32 out)": lambda: torch._scaled_mm(xa, wb.t(), one, one, out_dtype=torch.float32),
    "F.scaled_dot_product_attention causal": lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
    "autograd.Function.apply (identity, grad)": lambda: Ident.apply(req),
    "torch.empty_like": lambda: torch.empty_like(small),
    "tensor.view(torch.uint8)": lambda: small.view(torch.uint8),
    "tensor.reshape(-1, n)": lambda: small.reshape(-1, 64),
    "small.add_(1)": lambda: small.add_(1),
    "torch.cuda.current_device()": lambda: torch.cuda.current_device(),
    "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
}
rows = []
for name, fn in cases.items():
    try:
        fn()
    except Exception as e:  # a call this torch cannot run: say so in the table
        rows.append({"call": name, "host us": f"error: {str(e).splitlines()[0][:60]}"})
        continue
    rows.append({"call": name, "host us": host_us_per_call(fn)})
print_table(rows)
