"""Where does the host time of one FP8 TransformerLayer forward + backward go, function by function?
(CUDA or CPU; a measurement tool)

At ``[128, 1, 256]`` (ffn 1024, 4 heads) the GPU work is negligible, so a layer step's time is the host's
(``tools/layer_host_time.py`` gives the totals). This tool breaks one case down:

- ``cProfile`` over ``--steps`` steps: the functions with the most own time (``tottime``) and the most cumulative
  time, in host microseconds per step (the profiler's own overhead inflates small Python functions: compare rows,
  not absolute sums, with ``layer_host_time.py``);
- ``torch.profiler``: the top-level ATen operators of one step by name and count (the ops Python and autograd
  dispatch; each pays the dispatcher's host cost).

Usage: python tools/layer_host_profile.py [--device cuda|cpu] [--recipe delayed|current|bf16] [--steps 50]
[--top 40] [--seq 128 --batch 1 --hidden 256 --ffn 1024 --heads 4]
"""
import argparse
import collections
import cProfile
import io
import pstats

import torch

import fp8engine as fe
from fp8engine.bench.common import fwd_bwd_step


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--recipe", default="delayed", choices=["delayed", "current", "bf16"])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU visible")
    return args


def _top_level_aten(run, device: str) -> collections.Counter:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
        if device == "cuda":
            torch.cuda.synchronize()
    counts = collections.Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            counts[e.name] += 1
    return counts


def main():
    args = _parse()
    from fp8engine.modules.transformer import TransformerLayer

    dev, dtype = args.device, torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(args.seq, args.batch, args.hidden, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    layer = TransformerLayer(args.hidden, args.ffn, args.heads, hidden_dropout=0.0, attention_dropout=0.0,
                             params_dtype=dtype, device=dev)
    recipe = {"delayed": fe.DelayedScaling(), "current": fe.CurrentScaling(), "bf16": None}[args.recipe]
    run = fwd_bwd_step(layer, x, dy, recipe)
    for _ in range(5):
        run()
    if dev == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        run()
    prof.disable()
    if dev == "cuda":
        torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats(key).print_stats(args.top)
        print(f"=== cProfile by {key}, {args.steps} steps (divide times by steps for per-step; seconds) ===")
        print("\n".join(line for line in buf.getvalue().splitlines()[6:] if line.strip()))
    counts = _top_level_aten(run, dev)
    print(f"=== top-level ATen ops in one step: {sum(counts.values())} ===")
    for name, n in counts.most_common():
        print(f"{n:5d}  {name}")


if __name__ == "__main__":
    main()
