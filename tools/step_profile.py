"""Where does one training step of the command spend its time: GPU busy or waiting for the host? (CUDA; a
measurement tool)

Builds the step exactly as ``python -m fp8engine.bench train`` does (the training command's model, optimizer,
precision and step object), runs ``--warmup`` steps, then profiles ``--steps`` steps with ``torch.profiler`` (CPU
and CUDA activity) and prints per step:

- ``wall ms``: the step's wall time (host issue + the final loss read, which waits for the GPU);
- ``gpu busy ms``: the union of the GPU kernel and memcpy intervals (what the GPU did); ``wall - busy`` is GPU idle
  time, i.e. time the GPU waited for the host to issue work;
- launches (runtime + driver API) and host synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaMemcpy*`` without Async, ``cudaEventSynchronize``) with their host time: a synchronisation inside the step
  drains the queue and exposes every later launch's host cost;
- the CPU operators with the most self time (host cost by operator);
- under ``torchrun`` (``--tp T [--sequence-parallel]``, the rest data parallel; rank 0 reports): ``comm ms`` = the
  union of NCCL kernel intervals, and how much of it overlaps compute kernels (GEMMs etc. on other streams):
  the sequence-parallel all-gathers behind nothing, the dgrad reduce-scatters behind the wgrad GEMMs, the
  gradient all-reduces behind the backward.

The data is the bench's default: random GPT-2 token ids (vocabulary 50304).

Usage: python tools/step_profile.py --model 1b --mode fp8-delayed [--warmup 4] [--steps 3] [--top 25]
       torchrun --nproc-per-node 2 tools/step_profile.py --model 1b --mode fp8-delayed-graph --tp 2 \
           --sequence-parallel --kernels
       torchrun --nproc-per-node 2 tools/step_profile.py --model 1b --mode fp8-delayed --fsdp --kernels
(modes as ``python -m fp8engine.bench train``: bf16, fp8-delayed, fp8-current, their -graph variants, ...)
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from fp8engine.bench import train as BT  # noqa: E402

_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
_SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def _union_ms(intervals) -> float:
    total, end = 0.0, None
    start_cur = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start_cur
            start_cur, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        total += end - start_cur
    return total / 1e3


def _merged(intervals) -> list:
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _overlap_ms(a, b) -> float:
    """Time (ms) in both the union of intervals ``a`` and the union of ``b`` (us inputs)."""
    a, b = _merged(a), _merged(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total / 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b")
    p.add_argument("--mode", default="fp8-delayed", choices=sorted([*BT.MODES, *BT.PEER_MODES]))
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--kernels", action="store_true", help="GPU kernel time per step by kernel name")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size under torchrun")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over the data-parallel ranks (eager, as the command)")
    p.add_argument("--trace", help="also write the profiled steps as a Chrome trace (JSON) to this file")
    p.add_argument("--train-args", default="", help="more options of the training command, one string (as bench "
                                                    "train's, e.g. \"--fp8-all-gather\")")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("step_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    import os
    import tempfile

    from fp8engine import train as T
    from fp8engine.training.distributed import init_layout

    layout = init_layout(args.tp, torch.device("cuda"))
    if not layout.is_main:
        sys.stdout = open(os.devnull, "w")  # rank 0 reports
    tmp = tempfile.TemporaryDirectory(prefix="step-profile-")
    ns = argparse.Namespace(batch_size=None, steps=args.warmup + args.steps, device="cuda", seq_len=None,
                            data=BT.random_gpt2_bins(tmp.name), no_guard=False, tp=args.tp,
                            sequence_parallel=args.sequence_parallel, layout=layout, fsdp=args.fsdp, lm_loss=None,
                            train_args=args.train_args)
    run, model, step_model, optimizer = BT._setup(args.model, args.mode, ns)
    step_fn = (BT._peer_step(run, model, optimizer) if args.mode in BT.PEER_MODES
               else T.make_step(run, model, step_model, optimizer, guard=True))
    for step in range(1, args.warmup + 1):
        BT._timed_step(run, step_fn, optimizer, step)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    walls = []
    with torch.profiler.profile(activities=acts) as prof:
        for step in range(args.warmup + 1, args.warmup + args.steps + 1):
            walls.append(BT._timed_step(run, step_fn, optimizer, step)[0] * 1e3)
    if args.trace and layout.is_main:
        prof.export_chrome_trace(args.trace)
    events = prof.events()
    gpu = [(e.time_range.start, e.time_range.end) for e in events
           if e.device_type == torch.autograd.DeviceType.CUDA]
    n = args.steps
    launches = [e for e in events if e.name in _LAUNCH]
    syncs = [e for e in events if e.name.startswith(_SYNC) and "Async" not in e.name]
    print(f"{args.model} {args.mode}: wall {sum(walls) / n:.1f} ms/step (steps {', '.join(f'{w:.1f}' for w in walls)}), "
          f"GPU busy {_union_ms(gpu) / n:.1f} ms/step, {len(launches) / n:.0f} launches/step, "
          f"{len(syncs) / n:.1f} host syncs/step ({sum(e.cpu_time_total for e in syncs) / 1e3 / n:.1f} ms/step)")
    if layout.world_size > 1:
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        comm = [(s, e) for name, s, e in kernels if "nccl" in name.lower()]
        compute = [(s, e) for name, s, e in kernels if "nccl" not in name.lower()]
        total, hidden = _union_ms(comm) / n, _overlap_ms(comm, compute) / n
        print(f"  comm (NCCL kernels) {total:.1f} ms/step, {hidden:.1f} ms of it overlapped with compute kernels "
              f"({100 * hidden / total if total else 0:.0f} %); compute alone {_union_ms(compute) / n:.1f} ms/step")
    by_name = {}
    for e in syncs:
        by_name[e.name] = by_name.get(e.name, 0) + 1
    if by_name:
        print("  syncs:", ", ".join(f"{k} x{v / n:g}" for k, v in sorted(by_name.items())))
    if args.kernels:
        per_name, calls = {}, {}
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per_name[e.name] = per_name.get(e.name, 0.0) + e.device_time_total
                calls[e.name] = calls.get(e.name, 0) + 1
        print(f"  GPU kernels: {sum(per_name.values()) / 1e3 / n:.2f} ms/step summed, {sum(calls.values()) / n:.0f} "
              "kernels/step; by name (ms/step, calls/step):")
        for name, us in sorted(per_name.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {us / 1e3 / n:8.3f} {calls[name] / n:6.0f}  {name[:120]}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
