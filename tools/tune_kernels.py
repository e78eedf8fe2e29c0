"""Tile sweeps for the activation kernels, the QKV-gradient gather, and host cost per launch (CUDA only).

A measurement tool, not a benchmark of record: each configuration is first checked bit-exact against the same
kernel with the exact FP8 emulation (FP8ENGINE_EMULATE_FP8_CVT=1), then timed with CUDA events (median of 20 after
warm-up) at the layer's shapes (8192 x 16384 bf16 for the MLP activation, SDPA-layout dq/dk/dv for 32 heads of 128).

Usage: python tools/tune_kernels.py [--only act|qkv|host]
"""
import argparse
import os
import time

import torch

from fp8engine.bench.common import print_table, time_fn
from fp8engine.kernels import activation as act
from fp8engine.kernels import cast
from fp8engine.kernels.qkv_grad import qkv_grad_cast_transpose_dbias

p = argparse.ArgumentParser()
p.add_argument("--only", default=None, choices=["act", "qkv", "host"])
p.add_argument("--m", type=int, default=8192)
p.add_argument("--n", type=int, default=16384)
args = p.parse_args()
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _same_bits(run):
    """run() -> tuple of FP8 tensors; True when the hardware conversion gives the emulation's bits."""
    os.environ["FP8ENGINE_EMULATE_FP8_CVT"] = "1"
    want = [t.view(torch.uint8).clone() for t in run()]
    os.environ["FP8ENGINE_EMULATE_FP8_CVT"] = "0"
    got = [t.view(torch.uint8) for t in run()]
    return all(torch.equal(a, b) for a, b in zip(got, want))


def sweep_activation():
    m, n = args.m, args.n
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([448.0 / 8], device="cuda")
    amax = torch.zeros(1, device="cuda")
    gb = m * n / 1e9
    rows = []
    for bm, bn, w in [(16, 256, 4), (32, 256, 4), (32, 256, 8), (8, 512, 4), (16, 512, 8), (64, 128, 4),
                      (32, 128, 4), (16, 1024, 8)]:
        act.FWD_BLOCK_M, act.FWD_BLOCK_N, act.FWD_WARPS = bm, bn, w
        run = lambda: act.gelu_fwd(x, scale=scale, fp8_dtype=E4M3, amax_out=amax)[1:2]  # noqa: E731
        ok = _same_bits(run)
        ms = time_fn(run, warmup=5, iters=20)
        rows.append({"kernel": "gelu_fwd (fp8 out)", "tile": f"{bm}x{bn} w{w}", "bits ok": ok, "us": ms * 1e3,
                     "TB/s": gb * 3 / ms / 1e3})
    act.FWD_BLOCK_M, act.FWD_BLOCK_N, act.FWD_WARPS = 16, 256, 4
    t_ms = time_fn(lambda: cast.transpose_fp8(act.gelu_fwd(x, scale=scale, fp8_dtype=E4M3)[1]), warmup=5, iters=20)
    rows.append({"kernel": "gelu_fwd + transpose_fp8", "tile": "16x256 w4", "bits ok": "", "us": t_ms * 1e3,
                 "TB/s": gb * 5 / t_ms / 1e3})
    for bm, bn, w in [(64, 64, 4), (64, 128, 4), (32, 128, 4), (32, 256, 4), (16, 256, 4), (64, 256, 8),
                      (128, 128, 8), (32, 256, 8)]:
        act.BWD_BLOCK_M, act.BWD_BLOCK_N, act.BWD_WARPS = bm, bn, w
        for name, fn, xx in [("gelu_bwd", act.gelu_bwd_cast_transpose, x)]:
            run = lambda: fn(dy, xx, scale, E5M2, amax)[:2]  # noqa: E731
            ok = _same_bits(run)
            ms = time_fn(run, warmup=5, iters=20)
            # minimum traffic: dy + x read (2 B each), dx + dx_t written (1 B each)
            rows.append({"kernel": f"{name} (+transpose, dbias)", "tile": f"{bm}x{bn} w{w}", "bits ok": ok,
                         "us": ms * 1e3, "TB/s": gb * 6 / ms / 1e3})
    x2 = torch.randn(m, 2 * n // 2, device="cuda", dtype=torch.bfloat16)
    dy2 = torch.randn(m, n // 2, device="cuda", dtype=torch.bfloat16)
    act.BWD_BLOCK_M, act.BWD_BLOCK_N, act.BWD_WARPS = 64, 64, 4
    for name, fn, xx, d in [("swiglu_bwd", act.swiglu_bwd_cast_transpose, x2, dy2),
                            ("relu_bwd", act.relu_bwd_cast_transpose, x, dy)]:
        run = lambda: fn(d, xx, scale, E5M2, amax)[:2]  # noqa: E731
        rows.append({"kernel": name, "tile": "64x64 w4", "bits ok": _same_bits(run),
                     "us": time_fn(run, warmup=5, iters=20) * 1e3, "TB/s": 0.0})
    print_table(rows)


def sweep_qkv():
    b, heads, s, d = 4, 32, 2048, 128
    mk = lambda: torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    dq = mk().permute(2, 0, 1, 3).unsqueeze(3)  # SDPA gradient strides: [b, h, s, d] memory
    dk, dv = mk().permute(2, 0, 1, 3), mk().permute(2, 0, 1, 3)
    scale = torch.tensor([57344.0 / 8], device="cuda")
    amax = torch.zeros(1, device="cuda")
    t, c = s * b, heads * 3 * d
    gb = t * c / 1e9
    run = lambda: qkv_grad_cast_transpose_dbias(dq, dk, dv, scale, E5M2, amax)[:2]  # noqa: E731
    ok = _same_bits(run)
    ms = time_fn(run, warmup=5, iters=20)
    flat = torch.randn(t, c, device="cuda", dtype=torch.bfloat16)
    ms_flat = time_fn(lambda: cast.cast_transpose_dbias(flat, scale, E5M2, amax), warmup=5, iters=20)
    print_table([
        {"kernel": "qkv gather cast-transpose-dbias (SDPA strides)", "bits ok": ok, "us": ms * 1e3,
         "TB/s": gb * 4 / ms / 1e3},
        {"kernel": "cast_transpose_dbias, contiguous [T, C]", "bits ok": "", "us": ms_flat * 1e3,
         "TB/s": gb * 4 / ms_flat / 1e3},
    ])


def host_cost():
    """Host microseconds per call (GPU kept busy by a sleep kernel so the host never waits)."""
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    scale = torch.ones(1, device="cuda")
    amax = torch.zeros(1, device="cuda")
    import fp8engine as fe

    cases = {
        "torch.empty (fp8, 64x64)": lambda: torch.empty((64, 64), dtype=E4M3, device="cuda"),
        "x.abs() (one torch kernel)": lambda: x.abs(),
        "cast.transpose_fp8 (one Triton launch)": lambda: cast.transpose_fp8(y8),
        "cast.cast_to_fp8": lambda: cast.cast_to_fp8(x, scale, E4M3, amax),
        "fe.quantize": lambda: fe.quantize(x, E4M3, scale, amax_out=amax),
        "fe.quantize(transpose=True)": lambda: fe.quantize(x, E4M3, scale, amax_out=amax, transpose=True),
    }
    y8 = x.to(E4M3)
    rows = []
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        us = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        rows.append({"call": name, "host us": us})
    print_table(rows)


if args.only in (None, "act"):
    sweep_activation()
if args.only in (None, "qkv"):
    sweep_qkv()
if args.only in (None, "host"):
    host_cost()
