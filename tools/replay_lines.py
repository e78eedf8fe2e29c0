"""Which ops of the replayed FP8 layer step cost the host the most? (CUDA; CPU with ``--device cpu``; a measurement
tool)

The fused FP8 TransformerLayer step is replayed from its recording (:mod:`fp8engine.ops.replay`): one generated
straight-line function for the forward and one for the backward. This tool runs a layer (``[128, 1, 256]``, ffn 1024,
4 heads, bf16 parameters by default: the shape where a step's time is the host's) under FP8 delayed and current
scaling, swaps each program's function for a copy of its source with a ``time.perf_counter_ns`` stamp after every
line (a fraction of a microsecond each), runs ``--steps`` steps and prints, per recipe:

- each line of the forward and backward programs with its median host us per step (a line is one ATen op, one
  Triton launch through its compiled launcher, or one cuBLASLt call; ``cN`` names the op: the by-callee table and
  ``Program._consts`` say which);
- the host us per step by callee (``torch.empty``, ``_scaled_mm``, the Triton launcher, ...), summed over lines.

The sum of per-line medians is below the programs' wall time (medians drop the slow outliers); compare lines and
callees with each other, not with ``tools/layer_host_time.py``'s step times.

Usage: python tools/replay_lines.py [--recipe delayed|current|both] [--steps 300] [--device cuda|cpu]
[--seq 128 --batch 1 --hidden 256 --ffn 1024 --heads 4] [--lines]
"""
import argparse
import collections
import statistics
import time

import torch

from fp8engine.bench.common import add_layer_shape_args

def _instrument(prog, tag: str, acc: dict) -> list:
    """Replace ``prog``'s function by a copy with a timestamp after each line; per-line host us go to ``acc``."""
    lines = prog.source.split("\n")
    new = [lines[0], "    _T.append((0, _pc()))"]
    for i, line in enumerate(lines[1:], start=1):
        new.append(line)
        stripped = line.strip()
        if not stripped.startswith("return") and not stripped.endswith("= None"):
            new.append(f"    _T.append(({i}, _pc()))")
    stamps: list = []
    scope: dict = {}
    exec(compile("\n".join(new), "<replay_lines>", "exec"), {**prog._consts, "_T": stamps,
                                                              "_pc": time.perf_counter_ns}, scope)
    fn = scope["program"]

    def timed(inputs, outer=()):
        stamps.clear()
        out = fn(inputs, outer)
        for (_, t0), (line, t1) in zip(stamps, stamps[1:]):
            acc[(tag, line)].append((t1 - t0) / 1000)
        return out
    prog._fn = timed
    return lines


def _callee(line: str, consts: dict) -> str:
    call = line.split("=", 1)[1].strip() if "=" in line.split("(")[0] else line
    name = call.split("(")[0].strip()
    fn = consts.get(name)
    return getattr(fn, "__name__", type(fn).__name__) if fn is not None else name


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", choices=["delayed", "current", "both"], default="both")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--lines", action="store_true", help="also print every line of the programs with its time")
    add_layer_shape_args(p)
    args = p.parse_args()

    import fp8engine as fe
    import fp8engine.ops.layer as L
    from fp8engine.bench.common import fwd_bwd_step
    from fp8engine.modules.transformer import TransformerLayer

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("replay_lines: no CUDA device; run with --device cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # (on CPU the replay takes fp32 parameters)
    torch.manual_seed(0)
    x = torch.randn(args.seq, args.batch, args.hidden, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    layer = TransformerLayer(args.hidden, args.ffn, args.heads, hidden_dropout=0.0, attention_dropout=0.0,
                             params_dtype=dt, device=dev)
    recipes = {"delayed": fe.DelayedScaling(), "current": fe.CurrentScaling()}
    names = list(recipes) if args.recipe == "both" else [args.recipe]
    if dev.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in names:
        L._PROGRAMS.clear()
        run = fwd_bwd_step(layer, x, dy, recipes[name])
        for _ in range(3):  # record, then replay
            run()
        pairs = [v for v in L._PROGRAMS.values() if type(v) is not int]
        if not pairs or isinstance(pairs[0], str):
            print(f"{name}: the step is not replayed ({pairs[0] if pairs else 'no recording'})")
            continue
        pair = pairs[0]
        acc: dict = collections.defaultdict(list)
        src = {"fwd": _instrument(pair.fwd, "fwd", acc), "bwd": _instrument(pair.bwd, "bwd", acc)}
        consts = {"fwd": pair.fwd._consts, "bwd": pair.bwd._consts}
        sync()
        for _ in range(args.steps):
            run()
        sync()
        rows = [(statistics.median(v), tag, i) for (tag, i), v in acc.items()]
        total = collections.Counter()
        by_callee = collections.Counter()
        count = collections.Counter()
        for med, tag, i in rows:
            total[tag] += med
            key = (tag, _callee(src[tag][i].strip(), consts[tag]))
            by_callee[key] += med
            count[key] += 1
        print(f"\n## FP8 {name}: forward program {total['fwd']:.1f} us, backward program {total['bwd']:.1f} us "
              f"(sums of per-line medians over {args.steps} steps; {pair.fwd.n_ops} + {pair.bwd.n_ops} ops)")
        print("\n| program | callee | lines | host us per step |\n|---|---|---|---|")
        for (tag, callee), us in by_callee.most_common():
            if not callee.startswith(("s", "_r", "outer", "inputs")):  # (unpacking lines)
                print(f"| {tag} | `{callee}` | {count[(tag, callee)]} | {us:.1f} |")
        if args.lines:
            print("\n| program | line | host us | source |\n|---|---|---|---|")
            for med, tag, i in sorted(rows, key=lambda r: (r[1] != "fwd", r[2])):
                print(f"| {tag} | {i} | {med:.2f} | `{src[tag][i].strip()[:110]}` |")


if __name__ == "__main__":
    main()
