"""Sweep cast-transpose tile shapes on CUDA (bf16 -> e4m3, 32768 x 4096 and 8192 x 16384), with the emulated and
the hardware FP8 conversion, checking the bits of both copies against torch's cast. Prints a table."""
import itertools

import torch
import triton.testing

import fp8engine.kernels.cast as cast

shapes = [(32768, 4096), (8192, 16384), (8192, 4096)]
rows = []
orig_emulate = cast.emulate_fp8_cvt
for (m, n), (tm, tn, w), hw in itertools.product(shapes, [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8),
                                                          (64, 256, 8), (128, 128, 4), (32, 128, 4)], [False, True]):
    cast.TILE_M, cast.TILE_N, cast.TILE_WARPS = tm, tn, w
    cast.emulate_fp8_cvt = (lambda tiled_transpose=False: False) if hw else orig_emulate
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(m, n, device="cuda", dtype=dtype) * 30
        scale = torch.tensor([3.0], device="cuda")
        amax = torch.zeros(1, device="cuda")
        data, data_t, _ = cast.cast_to_fp8(x, scale, torch.float8_e4m3fn, amax, transpose=True)
        ref = (x.float() * 3.0).clamp(-448, 448).to(torch.float8_e4m3fn)
        ok = torch.equal(data.view(torch.uint8), ref.view(torch.uint8)) and \
            torch.equal(data_t.view(torch.uint8), ref.t().contiguous().view(torch.uint8)) and \
            amax.item() == x.abs().max().item()
        if dtype != torch.bfloat16:
            rows.append((m, n, tm, tn, w, "hw" if hw else "emu", str(dtype), ok, None))
            continue
        ms = triton.testing.do_bench(lambda: cast.cast_to_fp8(x, scale, torch.float8_e4m3fn, amax, transpose=True),
                                     warmup=25, rep=100, return_mode="median")
        rows.append((m, n, tm, tn, w, "hw" if hw else "emu", str(dtype), ok, 4.0 * m * n / ms / 1e9))
print("| M | N | tile_m | tile_n | warps | cvt | dtype | bits ok | TB/s (2B read + 2x1B written) |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join("" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v)) for v in r) + " |")
