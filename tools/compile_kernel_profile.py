"""Where does a compiled FP8 TransformerLayer step spend its GPU time, against the eager one? (CUDA; a measurement
tool, not a benchmark of record)

For eager FP8 and ``torch.compile`` (Inductor) FP8 of the same ``TransformerLayer`` (dropout 0, bf16 parameters,
fwd+bwd with ``y.backward(dy)``, grads reset to None each step as in ``bench layer``), profiles ``--steps`` steps after
warm-up and prints, per variant: GPU kernel time per step by kind (FP8/bf16 GEMMs, attention, Triton kernels --
ours in eager mode, Inductor's under compile --, other), and the ``--top`` kernels by total time.

With ``--variants eager`` only the eager layer is profiled, e.g. to put ``--recipe block`` (``Float8BlockScaling``,
which has no compiled path) beside delayed scaling: where the block-scaled step's extra time goes.

Usage: python tools/compile_kernel_profile.py [--seq 2048 --batch 4 --hidden 4096 --ffn 16384 --heads 32]
       [--recipe delayed|current|block] [--variants eager,compile] [--steps 5] [--top 12]
"""
import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import fp8engine as fe
from fp8engine.bench.common import add_layer_shape_args
from fp8engine.modules.transformer import TransformerLayer


def _kind(name: str) -> str:
    n = name.lower()
    if n.startswith("triton") or (n.startswith("_") and n.endswith("_kernel")):  # Inductor's, or ours
        return "triton"
    if "sdpa" in n or "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "gemm" in n or "cutlass" in n or "nvjet" in n or "sm90" in n:
        return "gemm"
    return "other"


def _profile(layer, x, dy, recipe, steps):
    def step():
        with fe.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.backward(dy)
        for p in layer.parameters():
            p.grad = None

    for _ in range(5):  # warm-up (compiles under torch.compile)
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for ev in prof.key_averages():
        if ev.device_time_total > 0 and ev.key and not ev.key.startswith("ProfilerStep"):
            per_kernel[ev.key] += ev.self_device_time_total / steps / 1e3  # ms per step
    return per_kernel


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_shape_args(p, seq=2048, batch=4, hidden=4096, ffn=16384, heads=32)  # the guide's layer
    p.add_argument("--recipe", choices=("delayed", "current", "block"), default="delayed")
    p.add_argument("--variants", default="eager,compile", help="comma-separated: eager, compile")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compile_kernel_profile: needs a CUDA GPU")
    recipe = {"delayed": fe.DelayedScaling, "current": fe.CurrentScaling, "block": fe.Float8BlockScaling}[args.recipe]()
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in ("eager", "compile") for v in variants):
        raise SystemExit(f"compile_kernel_profile: --variants takes eager and/or compile, got {args.variants!r}")
    torch.manual_seed(0)
    x = torch.randn(args.seq, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    for name in variants:
        layer = TransformerLayer(args.hidden, args.ffn, args.heads, hidden_dropout=0.0, attention_dropout=0.0,
                                 params_dtype=torch.bfloat16, device="cuda")
        run = torch.compile(layer) if name == "compile" else layer
        per_kernel = _profile(run, x, dy, recipe, args.steps)
        by_kind = defaultdict(float)
        for k, ms in per_kernel.items():
            by_kind[_kind(k)] += ms
        total = sum(per_kernel.values())
        print(f"\n## {name} FP8 {args.recipe}: GPU kernel time {total:.3f} ms/step; "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
        print("| kernel | kind | ms/step |\n|---|---|---|")
        for k, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"| {k[:110]} | {_kind(k)} | {ms:.3f} |")
        del run, layer
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
