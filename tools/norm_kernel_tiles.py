"""Which tile, warps and backward waves make the LayerNorm kernels fastest? (CUDA; a tuning tool)

Times the FP8-output LayerNorm forward, its backward and the partial-sum reduction for a few configurations and
prints one row per configuration (us), with how many FP8 bytes differ from the first configuration (the row
reductions' order depends on the tile). The constants it tunes are ``NORM_TILE``, ``NORM_BWD_WAVES`` and the warps
rule in ``fp8engine/kernels/norm.py``.

Usage: python tools/norm_kernel_tiles.py [--m 8192 --n 4096]
"""
import argparse

import torch
import triton.testing

from fp8engine.kernels import _common
from fp8engine.kernels import norm as kn

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--m", type=int, default=8192)
p.add_argument("--n", type=int, default=4096)
args = p.parse_args()
m, n = args.m, args.n
x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x)
w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
scale = torch.full((1,), 3.0, device="cuda")
amax = torch.zeros(1, device="cuda")
default_tile = kn._tile
ref = kn.layernorm_fwd(x, w, b, 1e-5, scale=scale, fp8_dtype=torch.float8_e4m3fn, amax_out=amax, return_hp=False)
_, _, _, mean, rstd = ref
print("| config | fwd fp8-only us | fwd fp8+hp us | bwd us | bwd GB/s | FP8 bytes differing from rows 1 warps 8 |")
print("|---|---|---|---|---|---|")
for rows, warps in ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16)):
    kn._tile = lambda nn, r=rows, wp=warps: (r, triton.next_power_of_2(nn), wp)
    out = kn.layernorm_fwd(x, w, b, 1e-5, scale=scale, fp8_dtype=torch.float8_e4m3fn, return_hp=False)
    # the row reductions' order depends on the tile, so a few bytes may round differently: report how many
    ndiff = int((out[1].view(torch.uint8) != ref[1].view(torch.uint8)).sum())
    f8 = triton.testing.do_bench(lambda: kn.layernorm_fwd(x, w, b, 1e-5, scale=scale, fp8_dtype=torch.float8_e4m3fn,
                                                          amax_out=amax, return_hp=False)) * 1e3
    fhp = triton.testing.do_bench(lambda: kn.layernorm_fwd(x, w, b, 1e-5, scale=scale, fp8_dtype=torch.float8_e4m3fn,
                                                           amax_out=amax, return_hp=True)) * 1e3
    bw = triton.testing.do_bench(lambda: kn.layernorm_bwd(dy, x, mean, rstd, w)) * 1e3
    print(f"| rows {rows} warps {warps} | {f8:.1f} | {fhp:.1f} | {bw:.1f} | {3 * m * n * 2 / bw / 1e3:.0f} | {ndiff} |")
kn._tile = default_tile
for waves in (1, 2, 4, 8):
    kn.NORM_BWD_WAVES = waves
    bw = triton.testing.do_bench(lambda: kn.layernorm_bwd(dy, x, mean, rstd, w)) * 1e3
    print(f"| bwd waves {waves} (default tile) | | | {bw:.1f} | {3 * m * n * 2 / bw / 1e3:.0f} |")
for parts in (128, 528, 1056):
    buf = torch.randn(parts, n, device="cuda")
    us = triton.testing.do_bench(lambda: _common.sum_partials(buf, torch.bfloat16)) * 1e3
    print(f"| sum_partials [{parts}, {n}] | | | {us:.1f} | |")
