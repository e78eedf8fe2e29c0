"""How much of a layer step's host time is spent inside its ATen ops and kernel launches, and how much in the
Python between them? (CUDA; a measurement tool)

At ``[128, 1, 256]`` (ffn 1024, 4 heads; GPU work negligible) for the plain PyTorch bf16 block and our
TransformerLayer under FP8 delayed and current scaling: the wall time of 20 profiled steps (torch.profiler, CPU
activity) against the CPU time inside the step's top-level ATen ops and launch API calls, the largest of those by
name, and the unprofiled wall time. What is left after the ops is Python (and the profiler's own cost).

Usage: python tools/host_op_share.py
"""
import argparse
import collections, statistics, time, torch
import fp8engine as fe
from fp8engine.bench.layer import PlainBlock
from fp8engine.bench.common import fwd_bwd_step
from fp8engine.modules.transformer import TransformerLayer


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(128, 1, 256, device=dev, dtype=dt, requires_grad=True); dy = torch.randn_like(x)
    plain = PlainBlock(256, 1024, 4, device=dev, dtype=dt)
    ours = TransformerLayer(256, 1024, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dt, device=dev)
    LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
    def anc(e):
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::") or p.name in LAUNCH: return True
            p = p.cpu_parent
        return False
    for name, model, recipe in (("plain", plain, None), ("delayed", ours, fe.DelayedScaling()), ("current", ours, fe.CurrentScaling())):
        run = fwd_bwd_step(model, x, dy, recipe)
        for _ in range(5): run()
        torch.cuda.synchronize()
        walls, by = [], collections.defaultdict(float)
        n = 20
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                torch.cuda.synchronize(); t0 = time.perf_counter(); run(); walls.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        ev = prof.events()
        top = [e for e in ev if (e.name.startswith("aten::") or e.name in LAUNCH) and not anc(e)]
        tot = sum(e.cpu_time_total for e in top) / n
        for e in top: by[e.name] += e.cpu_time_total / n
        cnt = collections.Counter(e.name for e in top)
        print(f"== {name}: profiled wall {statistics.median(walls)*1e3:.3f} ms/step, inside top-level ops+launches {tot/1e3:.3f} ms/step ({tot/1e3/statistics.median(walls)/1e3*100:.0f} %)")
        for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:14]:
            print(f"   {v:8.1f} us  {cnt[k]//n:4d}x  {k}")
        # unprofiled
        ts = []
        for _ in range(50):
            torch.cuda.synchronize(); t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)
        print(f"   unprofiled wall {statistics.median(ts)*1e3:.3f} ms/step")


if __name__ == "__main__":
    main()
