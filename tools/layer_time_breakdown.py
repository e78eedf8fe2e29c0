"""Where does the FP8 TransformerLayer's step time go? (CUDA; a measurement tool, not a benchmark of record)

Prints:
1. the layer's 12 FP8 GEMMs as the layer runs them and in alternative cuBLASLt configurations (fast accumulation
   on dgrad/wgrad, bias epilogue off, fp32 output, swapped operands = transposed output);
2. causal SDPA fwd+bwd ``[b, H, s, d]`` per backend (flash, cuDNN, efficient);
3. the FP8 layer step: GPU time (CUDA events) and host issue time (the step issued behind a long sleep kernel,
   so the host never waits for the GPU);
4. a profiler table of the FP8 step by CUDA kernel (grads reset to None every step, as in ``bench layer``), the
   GPU busy / idle time per step of 5 back-to-back steps with the largest gaps, back-to-back ms per step, and the
   kernel sequence of one synchronised step with the idle time before each kernel.

Usage: python tools/layer_time_breakdown.py [--seq 2048 --batch 4 --hidden 4096 --ffn 16384 --heads 32]
       [--skip-gemm] [--skip-sdpa] [--host-profile]
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import fp8engine as fe
from fp8engine.bench.common import add_layer_shape_args, print_table, time_back_to_back, time_fn
from fp8engine.modules.transformer import TransformerLayer

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add_layer_shape_args(p, seq=2048, batch=4, hidden=4096, ffn=16384, heads=32)  # the guide's layer
p.add_argument("--iters", type=int, default=20)
p.add_argument("--skip-gemm", action="store_true")
p.add_argument("--skip-sdpa", action="store_true")
p.add_argument("--host-profile", action="store_true", help="cProfile the host side of one step")
args = p.parse_args()
s, b, h, f, heads = args.seq, args.batch, args.hidden, args.ffn, args.heads
t = s * b
one = torch.ones((), device="cuda")


def gemm_probe():
    rows = []
    for name, (k, n) in {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, f), "fc2": (f, h)}.items():
        x = torch.randn(t, k, device="cuda").to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        dy = torch.randn(t, n, device="cuda").to(torch.float8_e5m2)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        w_t, dy_t, x_t = w.t().contiguous(), dy.t().contiguous(), x.t().contiguous()
        bf = torch.bfloat16
        mm = torch._scaled_mm
        # rowwise dispatch (CUTLASS on sm90) with every row / column scale equal: tensorwise math, another kernel
        ra, rb_n, rb_k = one.expand(t, 1).contiguous(), one.expand(1, n).contiguous(), one.expand(1, k).contiguous()
        rw_k = one.expand(n, 1).contiguous()
        # operands spread over the whole FP8 range, as scaled activations are (power draw depends on the bits)
        xf = (torch.randn(t, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        wf = (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        dy4, dy4_t = dy.float().to(torch.float8_e4m3fn), dy_t.float().to(torch.float8_e4m3fn)
        cases = {
            "fprop as used (bias, fast)": lambda: mm(x, w.t(), one, one, bias=bias, out_dtype=bf, use_fast_accum=True),
            "fprop no bias (fast)": lambda: mm(x, w.t(), one, one, out_dtype=bf, use_fast_accum=True),
            "fprop swapped (y^T = w x^T)": lambda: mm(w, x.t(), one, one, out_dtype=bf, use_fast_accum=True),
            "dgrad as used (split acc)": lambda: mm(dy, w_t.t(), one, one, out_dtype=bf),
            "dgrad fast acc": lambda: mm(dy, w_t.t(), one, one, out_dtype=bf, use_fast_accum=True),
            "dgrad swapped (dx^T = w^T dy^T)": lambda: mm(w_t, dy.t(), one, one, out_dtype=bf),
            "wgrad as used (split acc)": lambda: mm(dy_t, x_t.t(), one, one, out_dtype=bf),
            "wgrad fast acc": lambda: mm(dy_t, x_t.t(), one, one, out_dtype=bf, use_fast_accum=True),
            "wgrad fp32 out (main_grad)": lambda: mm(dy_t, x_t.t(), one, one, out_dtype=torch.float32),
            "wgrad swapped (dw^T = x^T dy)": lambda: mm(x_t, dy_t.t(), one, one, out_dtype=bf),
            "fprop full-range data (bias, fast)": lambda: mm(xf, wf.t(), one, one, bias=bias, out_dtype=bf,
                                                             use_fast_accum=True),
            "fprop rowwise kernel (bias, fast)": lambda: mm(x, w.t(), ra, rb_n, bias=bias, out_dtype=bf,
                                                            use_fast_accum=True),
            "fprop rowwise kernel full-range": lambda: mm(xf, wf.t(), ra, rb_n, bias=bias, out_dtype=bf,
                                                          use_fast_accum=True),
            "dgrad rowwise kernel (e5m2 dy)": lambda: mm(dy, w_t.t(), ra, rb_k, out_dtype=bf),
            "dgrad rowwise kernel (e4m3 dy)": lambda: mm(dy4, w_t.t(), ra, rb_k, out_dtype=bf),
            "dgrad e4m3 dy tensorwise": lambda: mm(dy4, w_t.t(), one, one, out_dtype=bf),
            "wgrad rowwise kernel (e5m2 dy)": lambda: mm(dy_t, x_t.t(), rw_k, rb_k, out_dtype=bf),
            "wgrad rowwise kernel (e4m3 dy)": lambda: mm(dy4_t, x_t.t(), rw_k, rb_k, out_dtype=bf),
        }
        for case, fn in cases.items():
            try:
                fn()
            except RuntimeError as e:
                rows.append({"gemm": name, "case": case, "ms": str(e).splitlines()[0][:70]})
                continue
            ms = time_fn(fn, warmup=5, iters=args.iters)
            rows.append({"gemm": name, "case": case, "ms": ms, "TFLOP/s": 2.0 * t * k * n / ms / 1e9})
    print_table(rows)


def sdpa_probe():
    d = h // heads
    q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    rows = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def step():
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(do)

        def fwd():
            with sdpa_kernel([backend]), torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            rows.append({"backend": backend.name, "fwd ms": time_fn(fwd, iters=args.iters),
                         "fwd+bwd ms": time_fn(step, iters=args.iters)})
        except RuntimeError as e:
            rows.append({"backend": backend.name, "fwd ms": str(e).splitlines()[0][:60]})
    # the layout the layer hands SDPA: views of the fused [s, b, g, H/g+2, d] projection output
    mixed = torch.randn(s, b, heads, 3, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        def step_strided():
            qq, kk, vv = (mixed[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            o.backward(do)
        try:
            rows.append({"backend": backend.name + " strided views", "fwd+bwd ms": time_fn(step_strided,
                                                                                         iters=args.iters)})
        except RuntimeError as e:
            rows.append({"backend": backend.name + " strided views", "fwd ms": str(e).splitlines()[0][:60]})
    print_table(rows)


def layer_probe():
    layer = TransformerLayer(h, f, heads, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                             device="cuda")
    x = torch.randn(s, b, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        x.grad = None
        for prm in layer.parameters():
            prm.grad = None
        with fe.autocast():
            y = layer(x)
        y.backward(dy)

    gpu_ms = time_fn(step, warmup=5, iters=args.iters)
    if args.host_profile:
        import cProfile
        import pstats

        prof_host = cProfile.Profile()
        for _ in range(3):
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)
            t0 = time.perf_counter()
            prof_host.enable()
            step()
            prof_host.disable()
            print(f"host issue under cProfile {(time.perf_counter() - t0) * 1e3:.3f} ms")
        torch.cuda.synchronize()
        pstats.Stats(prof_host).sort_stats("tottime").print_stats(35)
        pstats.Stats(prof_host).sort_stats("cumulative").print_stats(45)
    host = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # keeps the GPU busy for far longer than one step's host work
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    host.sort()
    idle_host = []
    for _ in range(5):  # the same, right after a synchronisation (GPU idle), as time_fn runs a step
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        idle_host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    idle_host.sort()
    print(f"FP8 layer step: {gpu_ms:.3f} ms (CUDA events, median of {args.iters}); host issue time "
          f"{host[len(host) // 2]:.3f} ms (median of 5, GPU kept busy), {idle_host[2]:.3f} ms after a sync")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))
    gap_report(prof, 5)
    n = 10
    b2b = time_back_to_back(step, steps=n, repeats=1, warmup=0)
    print(f"back-to-back: {b2b:.3f} ms/step over {n} steps (no sync between steps)")
    # one step after a sync, as time_fn runs it: the kernel sequence with the GPU idle time before each kernel
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gap_report(prof, 1, sequence=True)
    if args.host_profile:  # host-side ops of one step after a sync, with their start times
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        host_timeline(prof)


def host_timeline(prof, limit: int = 90):
    """The first ``limit`` top-level CPU ops / runtime calls of a profiled step: start (us from the first), dur."""
    import json
    import os
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    ev = sorted((e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver") and "ts" in e),
                key=lambda e: e["ts"])
    if not ev:
        return
    t0, end = ev[0]["ts"], 0.0
    shown = 0
    for e in ev:
        if e["ts"] < end and e.get("cat") == "cpu_op":  # nested inside the previous top-level op
            continue
        print(f"  {e['ts'] - t0:9.1f} us  +{e['dur']:7.1f}  {e.get('cat', '')[:11]:11s} {e['name'][:70]}")
        end = max(end, e["ts"] + e["dur"]) if e.get("cat") == "cpu_op" else end
        shown += 1
        if shown >= limit:
            break


def _trace_kernels(prof):
    import json
    import os
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    return sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                  key=lambda e: e["ts"])


def gap_report(prof, steps: int, sequence: bool = False):
    """GPU idle time between consecutive kernels of the profiled steps: kernel count, busy and idle time per
    step, and the largest gaps with the kernels around them (``sequence``: every kernel in order instead)."""
    kernels = _trace_kernels(prof)
    busy = sum(e["dur"] for e in kernels)
    gaps = [(kernels[i + 1]["ts"] - (kernels[i]["ts"] + kernels[i]["dur"]), kernels[i]["name"][:40],
             kernels[i + 1]["name"][:40]) for i in range(len(kernels) - 1)]
    idle = sum(g for g, _, _ in gaps if g > 0)
    print(f"kernels per step {len(kernels) / steps:.0f}; GPU busy {busy / steps / 1e3:.3f} ms/step; idle between "
          f"kernels {idle / steps / 1e3:.3f} ms/step; span {(kernels[-1]['ts'] + kernels[-1]['dur'] - kernels[0]['ts']) / steps / 1e3:.3f} ms/step")
    if sequence:
        for i, e in enumerate(kernels):
            gap = 0.0 if i == 0 else e["ts"] - (kernels[i - 1]["ts"] + kernels[i - 1]["dur"])
            print(f"  {i:3d} idle {gap:7.1f} us  run {e['dur']:7.1f} us  {e['name'][:70]}")
        return
    for g, a, b_ in sorted(gaps, reverse=True)[:25]:
        print(f"  gap {g:8.1f} us  after {a:40s} before {b_}")


if not args.skip_gemm:
    gemm_probe()
if not args.skip_sdpa:
    sdpa_probe()
layer_probe()
