"""How fast is the block-scaled FP8 GEMM (``torch.nn.functional.scaled_mm`` with 1 x 128 / 128 x 128 scales, the
``Float8BlockScaling`` path of ``fp8engine.ops.block_gemm``) against the per-tensor ``torch._scaled_mm``, and are its
scale layouts right? (CUDA sm_90; a measurement tool, not a benchmark of record)

Per shape ``MxKxN`` (tokens x in_features x out_features of a linear layer) and per GEMM of the layer:
  fprop  y  = x @ w.T    block: x 1x128, w 128x128
  dgrad  dx = dy @ w     block: dy 1x128, w^T 128x128
  wgrad  dw = dy.T @ x   block: dy^T 1x128, x^T 1x128 (both re-tiled along the tokens)
prints the per-tensor and block-scaled GEMM times (ms, median of ``--iters`` after warm-up, interleaved over
``--rounds``), TFLOP/s, the block / per-tensor time ratio, and the SQNR (dB) of the block GEMM against its float64
emulation on the same FP8 operands (>= 45 dB expected: both round once to bf16; lower means a scale-layout bug).
With ``--format hybrid`` the E5M2-gradient GEMMs take the float64 emulation (torch dispatches the block-wise GEMM
for E4M3 x E4M3 only): their rows show how slow that fallback is.
Then the block cast kernels' times for x (1x128 + re-tiled transpose) and w (128x128 + transpose), in ms and GB/s
of bytes moved. Exit status 1 if a block GEMM raised or its SQNR was below 45 dB.

With ``--algos``, instead: does another of cuBLASLt's ranked algorithms run the E4M3 block-scaled fprop
(1 x 128 x 128 x 128) and wgrad (1 x 128 x 1 x 128) faster than the one ``scaled_mm`` runs (the heuristic's first)?
The GEMM is planned through ``ctypes`` as :mod:`fp8engine.kernels.cublaslt` plans its GEMMs, with cuBLASLt's block
scale modes (``CUBLASLT_MATMUL_DESC_{A,B}_SCALE_MODE`` = 31 / 32, ``CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F`` = 4,
``..._BLK128x128_32F`` = 5: the values in CUDA 13.0's ``cublasLt.h``) and the scale tensors ``scaled_mm`` is given;
every algorithm the heuristic returns (up to 32) is timed and its output compared with ``scaled_mm``'s.

Usage: python tools/probe_block_gemm.py [--shapes 8192x4096x4096,8192x4096x16384] [--format e4m3|hybrid]
       [--iters 20] [--rounds 3] [--algos]
"""
import argparse
import statistics
import sys

import torch

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--shapes", default="8192x4096x4096,8192x4096x16384,8192x16384x4096",
               help="comma-separated MxKxN (all multiples of 128)")
p.add_argument("--format", choices=("e4m3", "hybrid"), default="e4m3",
               help="gradient encoding: e4m3 (Float8BlockScaling default) or hybrid (E5M2 gradients)")
p.add_argument("--iters", type=int, default=20)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--algos", action="store_true", help="time every ranked cuBLASLt algorithm of the block GEMMs instead")
args = p.parse_args()


def _shapes(text):
    out = []
    for item in text.split(","):
        try:
            m, k, n = (int(v) for v in item.lower().split("x"))
        except ValueError:
            sys.exit(f"probe_block_gemm.py: bad shape {item!r}; want MxKxN, e.g. 8192x4096x4096")
        if m % 128 or k % 128 or n % 128:
            sys.exit(f"probe_block_gemm.py: {item}: M, K and N must be multiples of 128")
        out.append((m, k, n))
    return out


SHAPES = _shapes(args.shapes)
if not torch.cuda.is_available():
    print("probe_block_gemm.py: needs a CUDA GPU", file=sys.stderr)
    sys.exit(2)

from fp8engine.bench.common import print_table, time_fn  # noqa: E402
from fp8engine.fp8.block_tensor import BLOCK_128x128, TILE_1x128, quantize_block  # noqa: E402
from fp8engine.ops.block_gemm import block_gemm, hw_block_gemm_available  # noqa: E402

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
GRAD = E4M3 if args.format == "e4m3" else E5M2
ONE = torch.ones((), device="cuda")


def sqnr(ref, actual):
    ref, actual = ref.double(), actual.double()
    noise = (ref - actual).norm()
    return float("inf") if noise == 0 else float(20 * torch.log10(ref.norm() / noise))


def cases(m, k, n):
    """(name, flops, per-tensor fn, block fn, block operands) per GEMM; out = a @ b.T in both forms."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).to(BF16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(BF16)
    dy = torch.randn(m, n, device="cuda", generator=g).to(BF16)
    qx, qx_t = quantize_block(x, E4M3, TILE_1x128, transpose=True)
    qw, qw_t = quantize_block(w, E4M3, BLOCK_128x128, transpose=True)
    qdy, qdy_t = quantize_block(dy, GRAD, TILE_1x128, transpose=True)
    flops = 2.0 * m * k * n
    for name, qa, qb in (("fprop", qx, qw), ("dgrad", qdy, qw_t), ("wgrad", qdy_t, qx_t)):
        a, b = qa.data, qb.data  # per-tensor: the same FP8 bytes with unit scales (same GEMM shape and dtypes)
        yield (name, flops, lambda a=a, b=b: torch._scaled_mm(a, b.t(), ONE, ONE, out_dtype=BF16),
               lambda qa=qa, qb=qb: block_gemm(qa, qb, BF16), qa, qb)


_A_SCALE_MODE, _B_SCALE_MODE, _VEC128_32F, _BLK128x128_32F = 31, 32, 4, 5  # cublasLt.h, CUDA 13.0


def _scale_args(qa, qb):
    """The scale tensors and cuBLASLt scale modes of ``a @ b.T``, as ``ops.block_gemm._scaled_mm`` passes them."""
    sa = qa.scale_inv if qa.scale_inv.stride(0) == 1 else qa.scale_inv.t().contiguous().t()
    if qb.block == TILE_1x128:
        return sa, (qb.scale_inv if qb.scale_inv.stride(0) == 1 else qb.scale_inv.t().contiguous().t()), _VEC128_32F
    nb, kb = qb.scale_inv.shape
    sb = torch.zeros((nb, -(-kb // 4) * 4), dtype=torch.float32, device="cuda")
    sb[:, :kb] = qb.scale_inv
    return sa, sb, _BLK128x128_32F


def algo_sweep():
    """``--algos`` (module docstring): one row per (shape, GEMM, algorithm index)."""
    import ctypes

    from fp8engine.kernels import cublaslt

    ctx = cublaslt._get_context()
    if ctx is None:
        sys.exit(f"probe_block_gemm.py --algos: {cublaslt._load_error}")
    lib, handle = ctx.lib, ctx.handle(torch.device("cuda"))
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    rows = []
    for m, k, n in SHAPES:
        for name, flops, _, block_fn, qa, qb in cases(m, k, n):
            if name == "dgrad":  # the fprop's kernel kind (1 x 128 x 128 x 128)
                continue
            sa, sb, b_mode = _scale_args(qa, qb)
            mm, nn, kk = qa.shape[0], qb.shape[0], qa.shape[1]
            # column-major D^T [nn, mm] = op_T(A = b [kk, nn]) @ (B = a [kk, mm]), as kernels/cublaslt.py maps it:
            # its plan with the block scale modes and scale pointers set, one per ranked algorithm
            extra = ((_A_SCALE_MODE, ctypes.c_int32(b_mode)), (_B_SCALE_MODE, ctypes.c_int32(_VEC128_32F)),
                     (cublaslt._DESC_A_SCALE_POINTER, ctypes.c_void_p(sb.data_ptr())),
                     (cublaslt._DESC_B_SCALE_POINTER, ctypes.c_void_p(sa.data_ptr())))
            e4 = cublaslt._CUDA_R_8F_E4M3
            out = torch.empty(mm, nn, dtype=BF16, device="cuda")
            align = tuple(cublaslt._alignment(t.data_ptr()) for t in (qb.data, qa.data, out))
            plans = []
            while True:
                try:
                    plans.append(cublaslt._Plan(lib, handle, nn, mm, kk, e4, e4, cublaslt._CUDA_R_16BF, align, False,
                                                len(plans), extra_attrs=extra))
                except IndexError:  # past the heuristic's last algorithm
                    break
            ref = block_fn()
            t_torch = statistics.median(time_fn(block_fn, iters=args.iters) for _ in range(args.rounds))
            for i, plan in enumerate(plans):
                workspace = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")

                def run(plan=plan, workspace=workspace):
                    cublaslt._check(lib.Matmul(handle, plan.desc, ctypes.byref(one), qb.data.data_ptr(),
                                               plan.a_layout, qa.data.data_ptr(), plan.b_layout, ctypes.byref(zero),
                                               out.data_ptr(), plan.c_layout, out.data_ptr(), plan.d_layout,
                                               ctypes.byref(plan.result.algo), workspace.data_ptr(),
                                               plan.workspace_size, torch.cuda.current_stream().cuda_stream),
                                    "cublasLtMatmul")
                run()
                ms = statistics.median(time_fn(run, iters=args.iters) for _ in range(args.rounds))
                rows.append({"shape": f"{m}x{k}x{n}", "gemm": name, "algo": i, "ms": ms, "TFLOP/s": flops / ms / 1e9,
                             "scaled_mm ms": t_torch, "vs scaled_mm": ms / t_torch,
                             "same output as scaled_mm": bool(torch.equal(out, ref))})
    print(f"\nblock-scaled E4M3 GEMMs, every ranked cuBLASLt algorithm; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}")
    print_table(rows)


def main():
    if not hw_block_gemm_available(torch.device("cuda")):
        print(f"probe_block_gemm.py: the block-wise scaled_mm needs sm_90 and torch.nn.functional.scaled_mm; have "
              f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}, torch {torch.__version__}", file=sys.stderr)
        sys.exit(2)
    failed = False
    rows = []
    for m, k, n in SHAPES:
        per_case = list(cases(m, k, n))
        times = {c[0]: ([], []) for c in per_case}
        errors = {}
        paths = {}
        for name, _, _, block_fn, qa, qb in per_case:
            hw = hw_block_gemm_available(qa.data.device, qa.fp8_dtype, qb.fp8_dtype)
            paths[name] = "cuBLASLt" if hw else "emulated (E5M2 operand)"
            try:
                got = block_fn()
                errors[name] = sqnr(block_gemm(qa, qb, BF16, use_hw=False), got) if hw else float("inf")
            except RuntimeError as exc:  # a layout / support problem of this torch build: report it, go on
                errors[name] = f"error: {str(exc).splitlines()[0][:120]}"
        for _ in range(args.rounds):
            for name, _, pt_fn, block_fn, _, _ in per_case:
                times[name][0].append(time_fn(pt_fn, iters=args.iters))
                if not isinstance(errors[name], str):
                    times[name][1].append(time_fn(block_fn, iters=args.iters))
        for name, flops, *_ in per_case:
            pt = statistics.median(times[name][0])
            row = {"shape": f"{m}x{k}x{n}", "gemm": name, "block path": paths[name], "per-tensor ms": pt,
                   "per-tensor TFLOP/s": flops / pt / 1e9}
            if isinstance(errors[name], str):
                row["block ms"] = errors[name]
                failed = True
            else:
                bt = statistics.median(times[name][1])
                row.update({"block ms": bt, "block TFLOP/s": flops / bt / 1e9, "block/per-tensor": bt / pt,
                            "SQNR vs emulation dB": errors[name]})
                failed |= errors[name] < 45
            rows.append(row)
    print(f"\nFP8 GEMMs, bf16 output, gradients {args.format}; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}")
    print_table(rows)

    cast_rows = []
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda").to(BF16)
        w = torch.randn(n, k, device="cuda").to(BF16)
        for what, t, block in (("x 1x128 + re-tiled T", x, TILE_1x128), ("w 128x128 + T", w, BLOCK_128x128)):
            ms = time_fn(lambda t=t, block=block: quantize_block(t, E4M3, block, transpose=True), iters=args.iters)
            moved = t.numel() * (2 + 1 + 1) + 2 * 4 * t.numel() // 128  # bf16 in, two FP8 copies, fp32 scales
            cast_rows.append({"tensor": f"{what} {tuple(t.shape)}", "ms": ms, "GB/s": moved / ms / 1e6})
    print("\nblock cast kernels (Triton)")
    print_table(cast_rows)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    algo_sweep() if args.algos else main()
