"""Does another cuBLASLt algorithm, torch's rowwise dispatch or the accumulating wgrad GEMM beat ``torch._scaled_mm``
at the layer's 12 FP8 GEMMs? (CUDA; a measurement tool, not a benchmark of record)

Prints, per GEMM (qkv / proj / fc1 / fc2 x fprop / dgrad / wgrad at ``[seq * batch]`` tokens):
- ``_scaled_mm`` as the layer calls it (no bias here, so both sides run the same epilogue);
- cuBLASLt heuristic algorithm 0 (torch's choice), the fastest of the first ``--algos``, and its index;
- for wgrad also the ``fuse_wgrad_accumulation`` forms: fp32 GEMM + ``main_grad.add_`` against one accumulating
  GEMM (beta = 1);
- max |difference| of algorithm 0 against ``_scaled_mm`` (must be ~0: same math);
- for fprop also torch's rowwise-scaled dispatch with all scales equal (same math, a CUTLASS kernel on sm90);
and the host microseconds per call of the entry points (``torch._scaled_mm``, ``cublaslt.gemm`` -- what eager
``fp8_mm`` calls on CUDA -- and its planned site alone, as a replayed step calls it; GPU kept busy by a sleep
kernel). ``--host-only``: only that table.
Cases run interleaved over ``--rounds`` rounds; medians reported (the board's clock drifts under its power cap).

Usage: python tools/gemm_cublaslt_choices.py [--tokens 8192 --hidden 4096 --ffn 16384] [--algos 16] [--rounds 3]
"""
import argparse
import statistics

import torch

from fp8engine.bench.common import host_us_per_call, print_table, time_fn
from fp8engine.kernels import cublaslt

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--tokens", type=int, default=8192)
p.add_argument("--hidden", type=int, default=4096)
p.add_argument("--ffn", type=int, default=16384)
p.add_argument("--algos", type=int, default=16, help="how many of cuBLASLt's ranked algorithms to time")
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--iters", type=int, default=10)
p.add_argument("--host-only", action="store_true", help="only the host microseconds per call")
args = p.parse_args()
t, h, f = args.tokens, args.hidden, args.ffn
E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
one = torch.ones((), device="cuda")


def gemm_cases():
    """(name, a [M, K], b [N, K], out dtype, fast accumulation) for the 12 GEMMs: out = a @ b.T"""
    for name, (k, n) in {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, f), "fc2": (f, h)}.items():
        x = torch.randn(t, k, device="cuda").to(E4M3)
        w = torch.randn(n, k, device="cuda").to(E4M3)
        dy = torch.randn(t, n, device="cuda").to(E5M2)
        yield f"{name} fprop", x, w, BF16, True
        yield f"{name} fprop rowwise", x, w, BF16, True
        yield f"{name} dgrad", dy, w.t().contiguous(), BF16, False
        yield f"{name} wgrad", dy.t().contiguous(), x.t().contiguous(), BF16, False


def main():
    cases, rows = {}, []
    for name, a, b, dtype, fast in gemm_cases():
        out = torch.empty(a.shape[0], b.shape[0], device="cuda", dtype=dtype)
        ref = torch._scaled_mm(a, b.t(), one, one, out_dtype=dtype, use_fast_accum=fast)
        group = {"_scaled_mm": lambda a=a, b=b, d=dtype, fa=fast: torch._scaled_mm(a, b.t(), one, one, out_dtype=d,
                                                                                    use_fast_accum=fa)}
        if name.endswith("rowwise"):  # torch's rowwise dispatch (CUTLASS on sm90) with every scale equal
            ra, rb = one.expand(a.shape[0], 1).contiguous(), one.expand(1, b.shape[0]).contiguous()
            group["rowwise _scaled_mm"] = lambda a=a, b=b, ra=ra, rb=rb: torch._scaled_mm(
                a, b.t(), ra, rb, out_dtype=BF16, use_fast_accum=True)
            cases[name] = (group, 2.0 * a.shape[0] * a.shape[1] * b.shape[0], 0.0)
            continue
        for i in range(args.algos):
            try:
                cublaslt.scaled_mm(a, one, b, one, out, use_fast_accum=fast, algo_index=i)
            except (IndexError, cublaslt.CublasLtError) as err:
                if i == 0:
                    raise
                print(f"{name}: algorithm {i}: {err}")
                break
            if i == 0:
                diff = (out.float() - ref.float()).abs().max().item()
            group[f"algo {i}"] = lambda a=a, b=b, o=out, fa=fast, i=i: cublaslt.scaled_mm(
                a, one, b, one, o, use_fast_accum=fa, algo_index=i)
        if name.endswith("wgrad"):
            main_grad = torch.zeros(a.shape[0], b.shape[0], device="cuda")
            group["fp32 GEMM + add_"] = lambda a=a, b=b, mg=main_grad: mg.add_(
                torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.float32))
            group["accumulating GEMM"] = lambda a=a, b=b, mg=main_grad: cublaslt.scaled_mm_accumulate(
                a, one, b, one, mg)
        cases[name] = (group, 2.0 * a.shape[0] * a.shape[1] * b.shape[0], diff)
    times = {(name, c): [] for name, (group, _, _) in cases.items() for c in group}
    for _ in range(args.rounds):
        for name, (group, _, _) in cases.items():
            for c, fn in group.items():
                times[(name, c)].append(time_fn(fn, warmup=3, iters=args.iters))
    total, rowwise, accumulate = {"_scaled_mm": 0.0, "algo 0": 0.0, "best algo": 0.0}, [], []
    for name, (group, flop, diff) in cases.items():
        med = {c: statistics.median(times[(name, c)]) for c in group}
        if "rowwise _scaled_mm" in med:
            rowwise.append({"gemm": name, "_scaled_mm ms": med["_scaled_mm"], "rowwise ms": med["rowwise _scaled_mm"]})
            continue
        algos = {c: v for c, v in med.items() if c.startswith("algo ")}
        best = min(algos, key=algos.get)
        total["_scaled_mm"] += med["_scaled_mm"]
        total["algo 0"] += med["algo 0"]
        total["best algo"] += med[best]
        row = {"gemm": name, "_scaled_mm ms": med["_scaled_mm"], "algo 0 ms": med["algo 0"],
               "best ms": med[best], "best": best, "best TFLOP/s": flop / med[best] / 1e9,
               "algos": len(algos), "max|algo0 - _scaled_mm|": diff}
        if "accumulating GEMM" in med:  # its own table: print_table takes its columns from the first row
            accumulate.append({"gemm": name, "fp32 GEMM + add_ ms": med["fp32 GEMM + add_"],
                               "accumulating GEMM ms": med["accumulating GEMM"]})
        rows.append(row)
    print_table(rows)
    print_table(rowwise)
    print_table(accumulate)
    print("sum of the 12 GEMMs (ms):", {k: round(v, 3) for k, v in total.items()})


def host_cost():
    a = torch.randn(64, 64, device="cuda").to(E4M3)
    out = torch.empty(64, 64, device="cuda", dtype=BF16)
    mg = torch.zeros(64, 64, device="cuda")
    one1 = one.reshape(1)
    bias = torch.zeros(64, device="cuda", dtype=BF16)
    cublaslt.gemm(a, one1, a, one1, BF16, bias, True)  # plans the site
    site = next(s for s in cublaslt._get_context().sites.values() if not isinstance(s, str))
    cases = {
        "torch._scaled_mm (bf16 out)": lambda: torch._scaled_mm(a, a.t(), one, one, out_dtype=BF16),
        "torch._scaled_mm (bf16 out, bias, fast accumulation)": lambda: torch._scaled_mm(
            a, a.t(), one, one, bias=bias, out_dtype=BF16, use_fast_accum=True),
        "cublaslt.gemm (fp8_mm's eager CUDA path, same call)": lambda: cublaslt.gemm(a, one1, a, one1, BF16, bias,
                                                                                     True),
        "its planned site alone (what a replayed step calls)": lambda: site(a, one1, a, one1, out, bias),
        "cublaslt.scaled_mm (bf16 out)": lambda: cublaslt.scaled_mm(a, one, a, one, out),
        "torch._scaled_mm fp32 + add_": lambda: mg.add_(torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.float32)),
        "cublaslt.scaled_mm_accumulate": lambda: cublaslt.scaled_mm_accumulate(a, one, a, one, mg),
    }
    print_table([{"call": name, "host us": host_us_per_call(fn)} for name, fn in cases.items()])


host_cost()
if not args.host_only:
    main()
