"""How close are the activation kernels and the QKV-gradient gather to the memory floor of a plain cast, do their
hardware FP8 conversions give the emulation's bytes, and what does a Triton launch cost on the host? (CUDA)

A measurement tool, not a benchmark of record: each kernel is first checked bit-exact against the same
kernel with the exact FP8 emulation (FP8ENGINE_EMULATE_FP8_CVT=1), then timed with CUDA events (median of 20 after
warm-up) at the layer's shapes (8192 x 16384 bf16 for the MLP activation, SDPA-layout dq/dk/dv for 32 heads of 128).

Usage: python tools/kernels_vs_memory_floor.py [--only act|qkv|host]
"""
import argparse
import os

import torch

from fp8engine.bench.common import host_us_per_call, print_table, time_back_to_back, time_fn
from fp8engine.kernels import activation as act
from fp8engine.kernels import cast
from fp8engine.kernels.qkv_grad import qkv_grad_cast_transpose_dbias

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def _tiled_emulated(run):
    """run with the tiled kernels' FP8 conversion switched from inline PTX to the integer emulation."""
    def wrapped():
        os.environ["FP8ENGINE_TILED_FP8_CVT"] = "emulate"
        try:
            return run()
        finally:
            os.environ.pop("FP8ENGINE_TILED_FP8_CVT")
    return wrapped


def sweep_activation():
    """The activation kernels as configured (fp8engine/kernels/activation.py) at the MLP's shape, next to a plain
    cast of the same size (the memory floor of a 2 B read + 1 B write pass)."""
    m, n = args.m, args.n
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x2, dy2 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16), torch.randn(m, n // 2, device="cuda",
                                                                                  dtype=torch.bfloat16)
    scale = torch.tensor([448.0 / 8], device="cuda")
    amax = torch.zeros(1, device="cuda")
    rows = []
    cases = [
        ("floor: cast_to_fp8 of dy (read 2 B, write 1 B)", lambda: cast.cast_to_fp8(dy, scale, E4M3, amax)[:1], 3),
        ("gelu_fwd (fp8 out)", lambda: act.gelu_fwd(x, scale=scale, fp8_dtype=E4M3, amax_out=amax)[1:2], 3),
        ("gelu_fwd + transpose_fp8", lambda: (cast.transpose_fp8(act.gelu_fwd(x, scale=scale, fp8_dtype=E4M3)[1]),),
         5),
        ("gelu_bwd_cast_transpose (dbias)", lambda: act.gelu_bwd_cast_transpose(dy, x, scale, E5M2, amax)[:2], 6),
        ("relu_bwd_cast_transpose (dbias)", lambda: act.relu_bwd_cast_transpose(dy, x, scale, E5M2, amax)[:2], 6),
        ("swiglu_bwd_cast_transpose (dbias)", lambda: act.swiglu_bwd_cast_transpose(dy2, x2, scale, E5M2)[:2], 4),
        ("gelu_bwd_cast_transpose, emulated conversion", _tiled_emulated(
            lambda: act.gelu_bwd_cast_transpose(dy, x, scale, E5M2, amax)[:2]), 6),
        ("relu_bwd_cast_transpose, emulated conversion", _tiled_emulated(
            lambda: act.relu_bwd_cast_transpose(dy, x, scale, E5M2, amax)[:2]), 6),
        ("cast_to_fp8 transpose, fp32 input (inline PTX)", lambda: cast.cast_to_fp8(
            dy.float(), scale, E4M3, amax, transpose=True)[:2], 6),
        ("cast_to_fp8 transpose, fp32 input, emulated", _tiled_emulated(lambda: cast.cast_to_fp8(
            dy.float(), scale, E4M3, amax, transpose=True)[:2]), 6),
    ]

    def timed(name, run, bytes_per_elem):
        ok = _same_bits(run)
        ms = time_fn(run, warmup=5, iters=20)
        b2b = time_back_to_back(run, steps=10, repeats=10)
        # minimum traffic per [m, n] element: bf16 reads 2 B each, FP8 writes 1 B each
        rows.append({"kernel": name, "bits ok": ok, "us": ms * 1e3, "us back-to-back": b2b * 1e3,
                     "TB/s back-to-back": m * n * bytes_per_elem / b2b / 1e9})

    for name, run, bytes_per_elem in cases:
        timed(name, run, bytes_per_elem)
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
         "TB/s": gb * 4 / ms},
        {"kernel": "cast_transpose_dbias, contiguous [T, C]", "bits ok": "", "us": ms_flat * 1e3,
         "TB/s": gb * 4 / ms_flat},
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
    # the floor of a Triton launch: replay the exact arguments JITFunction.run hands the compiled launcher
    out8 = torch.empty((64, 64), dtype=E4M3, device="cuda")
    grid = (1, 1)
    kern = cast._transpose_bytes_kernel
    compiled = kern[grid](y8.view(torch.uint8), out8.view(torch.uint8), 64, 64, BLOCK_M=cast.BYTE_TILE_M,
                          BLOCK_N=cast.BYTE_TILE_N, num_warps=4)
    real_run, captured = compiled.run, []
    compiled._run = lambda *a: (captured.append(a), real_run(*a))[1]  # the launcher behind the run property
    kern[grid](y8.view(torch.uint8), out8.view(torch.uint8), 64, 64, BLOCK_M=cast.BYTE_TILE_M,
               BLOCK_N=cast.BYTE_TILE_N, num_warps=4)
    compiled._run = real_run
    print("launcher args:", [type(a).__name__ for a in captured[0]])
    cases["bare JITFunction launch (kernel[grid](...))"] = lambda: kern[grid](
        y8.view(torch.uint8), out8.view(torch.uint8), 64, 64, BLOCK_M=cast.BYTE_TILE_M, BLOCK_N=cast.BYTE_TILE_N,
        num_warps=4)
    cases["compiled launcher replayed (CompiledKernel.run)"] = lambda: real_run(*captured[0])
    cases["torch.cuda.current_stream().cuda_stream"] = lambda: torch.cuda.current_stream().cuda_stream
    print_table([{"call": name, "host us": host_us_per_call(fn)} for name, fn in cases.items()])


if args.only in (None, "act"):
    sweep_activation()
if args.only in (None, "qkv"):
    sweep_qkv()
if args.only in (None, "host"):
    host_cost()
