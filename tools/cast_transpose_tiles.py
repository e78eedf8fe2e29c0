"""Which cast-transpose tile is fastest, and which FP8 conversion writes torch's bytes at each tile? (CUDA; a tuning
tool)

Sweeps ``TILE_M x TILE_N`` / warps of the cast-transpose kernel (``fp8engine/kernels/cast.py``) at three shapes, with
each FP8 conversion the kernel can use: ``triton`` (Triton's ``.to(float8)``, what full 16-bit tiles use),
``ptx`` (inline ``cvt.rn.satfinite``, the other cases) and ``emulate`` (exact integer emulation). For each it checks
both copies and the amax against torch's saturating cast (bf16 and fp32 inputs) and times the bf16 case with
``triton.testing.do_bench`` (median). Bandwidth = 2 B read + 2 x 1 B written per element.

Usage: python tools/cast_transpose_tiles.py [--shapes 32768x4096,8192x16384,8192x4096]
"""
import argparse
import itertools
import os

import torch

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--shapes", default="32768x4096,8192x16384,8192x4096", help="comma-separated MxN list")
args = p.parse_args()

import triton.testing  # noqa: E402  (after --help, which needs no GPU)

import fp8engine.kernels.cast as cast  # noqa: E402

TILES = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 256, 8), (128, 128, 4), (32, 128, 4)]
CVTS = ("triton", "ptx", "emulate")
default = (cast.TILE_M, cast.TILE_N, cast.TILE_WARPS, cast._hw_cvt_ok)


def set_cvt(cvt: str) -> None:
    """Route the tiled kernel to one conversion: ``_hw_cvt_ok`` True -> Triton's; False -> inline PTX, or the
    emulation with ``FP8ENGINE_TILED_FP8_CVT=emulate`` (fp8engine/kernels/_common.py: fp8_cvt_mode)."""
    cast._hw_cvt_ok = lambda m, n, dtype: cvt == "triton"
    if cvt == "emulate":
        os.environ["FP8ENGINE_TILED_FP8_CVT"] = "emulate"
    else:
        os.environ.pop("FP8ENGINE_TILED_FP8_CVT", None)


rows = []
shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
for (m, n), (tm, tn, warps), cvt in itertools.product(shapes, TILES, CVTS):
    cast.TILE_M, cast.TILE_N, cast.TILE_WARPS = tm, tn, warps
    set_cvt(cvt)
    ok, tbs = {}, None
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(m, n, device="cuda", dtype=dtype) * 30
        scale = torch.tensor([3.0], device="cuda")
        amax = torch.zeros(1, device="cuda")
        data, data_t, _ = cast.cast_to_fp8(x, scale, torch.float8_e4m3fn, amax, transpose=True)
        ref = (x.float() * 3.0).clamp(-448, 448).to(torch.float8_e4m3fn)
        ok[dtype] = (torch.equal(data.view(torch.uint8), ref.view(torch.uint8))
                     and torch.equal(data_t.view(torch.uint8), ref.t().contiguous().view(torch.uint8))
                     and amax.item() == x.abs().max().item())
        if dtype == torch.bfloat16:
            ms = triton.testing.do_bench(lambda: cast.cast_to_fp8(x, scale, torch.float8_e4m3fn, amax, transpose=True),
                                         warmup=25, rep=100, return_mode="median")
            tbs = 4.0 * m * n / ms / 1e9
    rows.append((m, n, tm, tn, warps, cvt, ok[torch.bfloat16], ok[torch.float32], tbs))
cast.TILE_M, cast.TILE_N, cast.TILE_WARPS, cast._hw_cvt_ok = default
os.environ.pop("FP8ENGINE_TILED_FP8_CVT", None)
print("| M | N | tile_m | tile_n | warps | cvt | bf16 bits ok | fp32 bits ok | bf16 TB/s |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r) + " |")
