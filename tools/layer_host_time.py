"""What does one FP8 TransformerLayer forward + backward cost the host (CPU), and how many ops does it issue?
(CUDA or CPU; a measurement tool)

At the small layer shape ``[128, 1, 256]`` (ffn 1024, 4 heads) the GPU work is negligible, so a step's time is the
host's: Python, autograd and the dispatcher. For the plain PyTorch bf16 block (``fp8engine.bench.layer.PlainBlock``),
our TransformerLayer in bf16, and under FP8 delayed and current scaling (the fused layer step, replayed from its
recording as the layer runs it by default, with its GEMMs through ``torch._scaled_mm`` instead of the direct
cuBLASLt call (``fp8engine.ops.gemm.CUBLASLT_GEMM``), and with the replay off: :mod:`fp8engine.ops.replay`; and with
``fused=False`` the sublayers one by one), it prints per fwd+bwd step:

- ``host ms``: median wall time of the step's issue (``time.perf_counter`` around forward + backward, the GPU
  synchronised before the step and not inside it; on a CPU device this includes the CPU's math too), the median
  over ``--rounds`` rounds that alternate the cases;
- ``aten ops``: ATen operators called from outside another ATen operator (torch.profiler, CPU activity): the ops
  Python and autograd dispatch, each paying the dispatcher's host cost; ``aten ops (all)`` counts nested ones too;
- ``launches`` (CUDA only): kernel launches seen by the profiler (runtime and driver API: ATen and Triton kernels).

With ``--profile delayed|current|bf16`` it also breaks that case down: ``cProfile`` over the timed steps (the
functions with the most own and cumulative time; the profiler's overhead inflates small Python functions, so
compare rows, not sums) and the top-level ATen operators of one step by name and count.

With ``--sections delayed|current`` it times the parts of the fused FP8 layer step instead (no profiler): each
function the fused step (``fp8engine.ops.layer``) calls, the layer's plan (``TransformerLayer._fused_plan``), the
replayed forward and backward programs (:mod:`fp8engine.ops.replay`: after the first step, the fused step's
functions above are called only where its configuration is not replayed), the quantizer casts, the autocast entry and exit (the delayed-scaling update) and the
autograd engine around the backward, as host us per step over ``--steps`` steps (``time.perf_counter`` wrappers,
about a microsecond each; nested rows are included in their callers' rows).

Usage: python tools/layer_host_time.py [--device cuda|cpu] [--steps 50] [--profile delayed|current|bf16]
[--sections delayed|current] [--top 40] [--seq 128 --batch 1 --hidden 256 --ffn 1024 --heads 4]
"""
import argparse
import collections
import copy
import cProfile
import io
import pstats
import statistics
import time

import torch

import fp8engine as fe
from fp8engine.bench.layer import PlainBlock
from fp8engine.bench.common import add_layer_shape_args, fwd_bwd_step, print_table

_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per row, median reported (default 50 on CUDA, 2 on CPU, where FP8 GEMMs are slow)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all cases; each row: median of the rounds")
    p.add_argument("--profile", choices=["delayed", "current", "bf16"],
                   help="also print the cProfile and ATen-op breakdown of this TransformerLayer case")
    p.add_argument("--sections", choices=["delayed", "current"],
                   help="instead: host us per step of each part of the fused FP8 layer step under this recipe")
    p.add_argument("--top", type=int, default=40, help="rows of each cProfile table (with --profile)")
    add_layer_shape_args(p)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU visible")
    if args.steps is None:
        args.steps = 50 if args.device == "cuda" else 2
    return args


def _host_ms(run, steps: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    sync()
    return statistics.median(times) * 1e3


def _op_counts(run, device: str) -> dict:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if not _has_aten_ancestor(e)]
    out = {"aten ops": len(top), "aten ops (all)": len(aten), "by name": collections.Counter(e.name for e in top)}
    if device == "cuda":
        out["launches"] = sum(e.name in _LAUNCH for e in events)
    return out


def _has_aten_ancestor(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def main():
    args = _parse()
    from fp8engine.modules.transformer import TransformerLayer

    dev, dtype = args.device, torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(args.seq, args.batch, args.hidden, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    if args.sections:
        layer = TransformerLayer(args.hidden, args.ffn, args.heads, hidden_dropout=0.0, attention_dropout=0.0,
                                 params_dtype=dtype, device=dev)
        recipe = fe.DelayedScaling() if args.sections == "delayed" else fe.CurrentScaling()
        _sections(layer, x, dy, recipe, args)
        return
    plain = PlainBlock(args.hidden, args.ffn, args.heads, device=dev, dtype=dtype)
    ours = TransformerLayer(args.hidden, args.ffn, args.heads, hidden_dropout=0.0, attention_dropout=0.0,
                            params_dtype=dtype, device=dev)
    composed = copy.deepcopy(ours)
    composed.fused = False  # the sublayers one by one (TransformerLayer's ``fused`` step off)
    cases = [("plain PyTorch block bf16", plain, None), ("TransformerLayer bf16", ours, None),
             ("TransformerLayer fp8 delayed", ours, fe.DelayedScaling()),
             ("TransformerLayer fp8 current", ours, fe.CurrentScaling()),
             ("TransformerLayer fp8 delayed, torch._scaled_mm", ours, fe.DelayedScaling()),
             ("TransformerLayer fp8 current, torch._scaled_mm", ours, fe.CurrentScaling()),
             ("TransformerLayer fp8 delayed, replay off", ours, fe.DelayedScaling()),
             ("TransformerLayer fp8 current, replay off", ours, fe.CurrentScaling()),
             ("TransformerLayer fp8 delayed, fused=False", composed, fe.DelayedScaling()),
             ("TransformerLayer fp8 current, fused=False", composed, fe.CurrentScaling())]
    rows, by_name, runs = [], {}, []
    for name, model, recipe in cases:
        run = _switch(fwd_bwd_step(model, x, dy, recipe), not name.endswith("replay off"),
                      not name.endswith("torch._scaled_mm"))
        for _ in range(3):  # warm-up: caches, the first scale update, Triton compilation on CUDA
            run()
        runs.append(run)
    times = [[] for _ in cases]
    for _ in range(args.rounds):  # rounds alternate the cases: the host's speed drifts over a process
        for i, run in enumerate(runs):
            times[i].append(_host_ms(run, args.steps, dev))
    for (name, _, _), run, t in zip(cases, runs, times):
        row = {"case": name, "host ms": statistics.median(t)}
        row.update(_op_counts(run, dev))
        by_name[name] = row.pop("by name")
        rows.append(row)
    base = rows[0]["host ms"]
    for row in rows:
        row["x plain"] = row["host ms"] / base
    print(f"device {dev}, torch {torch.__version__}, layer [{args.seq}, {args.batch}, {args.hidden}], "
          f"ffn {args.ffn}, heads {args.heads}; per fwd+bwd step")
    print_table(rows)
    if args.profile:
        name, model, recipe = next(c for c in cases if c[0].endswith(args.profile))
        _profile(fwd_bwd_step(model, x, dy, recipe), args, dev)
        print(f"=== top-level ATen ops of one step, {name} ===")
        for op, n in by_name[name].most_common():
            print(f"{n:5d}  {op}")


def _switch(run, replay_on: bool, cublaslt_on: bool):
    """``run`` with the fused step's replay of recorded steps (``fp8engine.ops.layer.REPLAY``) on or off, and the
    eager CUDA GEMMs through cuBLASLt directly (``fp8engine.ops.gemm.CUBLASLT_GEMM``) or ``torch._scaled_mm``."""
    import fp8engine.ops.gemm as gemm
    import fp8engine.ops.layer as fused

    def switched():
        saved = fused.REPLAY, gemm.CUBLASLT_GEMM
        fused.REPLAY, gemm.CUBLASLT_GEMM = replay_on, cublaslt_on
        try:
            run()
        finally:
            fused.REPLAY, gemm.CUBLASLT_GEMM = saved
    return switched


def _sections(layer, x, dy, recipe, args) -> None:
    """``--sections`` (module docstring): wrap the parts in timers, run ``args.steps`` steps, print the table."""
    import contextlib

    import fp8engine.ops.layer as fused
    from fp8engine.fp8 import quantizer as quantizer_mod
    from fp8engine.modules.base import FP8Module
    from fp8engine.modules.transformer import TransformerLayer
    from fp8engine.ops import replay

    acc, calls = collections.defaultdict(float), collections.Counter()
    targets = [(fused, name, name) for name in ("norm_fwd", "fp8_fprop", "split_rotate", "_node_fwd",
                                                   "fc1_fprop_act", "dgrad_wgrad", "act_bwd_cast", "norm_bwd",
                                                   "qkv_grad_fp8", "_node_bwd", "_dropout_fwd", "sdpa_fwd", "sdpa_bwd")]
    targets += [(fused._FP8TransformerLayer, "forward", "fused step forward (all of it)"),
                (fused._FP8TransformerLayer, "backward", "fused step backward (all of it)"),
                (TransformerLayer, "_fused_plan", "layer plan (the weight casts where they are cached)"),
                (FP8Module, "fp8_weight", "FP8Module.fp8_weight (weight cast)"),
                (quantizer_mod.Quantizer, "quantize", "Quantizer.quantize"),
                (quantizer_mod.Quantizer, "quantize_dbias", "Quantizer.quantize_dbias"),
                (replay.Pair, "forward", "replayed forward (the recorded ops)"),
                (replay.Pair, "backward", "replayed backward (the recorded ops)")]

    def timed(fn, label):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[label] += time.perf_counter() - t0
                calls[label] += 1
        return wrapper

    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in targets]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    params = list(layer.parameters())
    with contextlib.ExitStack() as restore:
        restore.callback(lambda: [setattr(o, n, f) for o, n, f in saved])
        for owner, name, label in targets:
            fn = owner.__dict__[name]
            inner = fn.__func__ if isinstance(fn, staticmethod) else fn
            w = timed(inner, label)
            setattr(owner, name, staticmethod(w) if isinstance(fn, staticmethod) else w)

        def step(record: bool):
            x.grad = None
            for p in params:
                p.grad = None
            t0 = time.perf_counter()
            with fe.autocast(recipe=recipe):
                t1 = time.perf_counter()
                y = layer(x)
                t2 = time.perf_counter()
            t3 = time.perf_counter()
            y.backward(dy)
            t4 = time.perf_counter()
            if record:
                for label, dt in (("step (all of it)", t4 - t0), ("autocast entry", t1 - t0),
                                  ("module forward (plan + fused forward)", t2 - t1),
                                  ("autocast exit (scale update)", t3 - t2),
                                  ("backward() call (engine + fused backward)", t4 - t3)):
                    acc[label] += dt
                    calls[label] += 1

        for _ in range(3):
            step(False)
        sync()
        acc.clear()
        calls.clear()
        for _ in range(args.steps):
            sync()
            step(True)
        sync()
    n = args.steps
    rows = [{"part": label, "host us per step": acc[label] / n * 1e6, "calls per step": calls[label] / n}
            for label in sorted(acc, key=lambda k: -acc[k])]
    print(f"device {args.device}, torch {torch.__version__}, layer [{args.seq}, {args.batch}, {args.hidden}], "
          f"ffn {args.ffn}, heads {args.heads}, {type(recipe).__name__}, {n} steps; nested rows are inside their "
          "callers' rows")
    print_table(rows)


def _profile(run, args, device: str) -> None:
    """cProfile over ``args.steps`` steps: the ``args.top`` functions by own and by cumulative time."""
    run()
    if device == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        run()
    prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        print(f"=== cProfile by {key}, {args.steps} steps (seconds; divide by the steps for one step) ===")
        print("\n".join(line for line in buf.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main()
