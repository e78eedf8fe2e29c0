"""Does the replay of recorded steps (fp8engine.ops.replay) change the step time or the peak memory of a GPU-bound
layer? (CUDA; a measurement tool)

The TransformerEngine performance guide's layer (``[2048, 4, 4096]``, ffn 16384, 32 heads, bf16 parameters) under FP8
delayed scaling, with ``fp8engine.ops.layer.REPLAY`` on and off, alternated over 4 rounds in one process: median ms
of single steps (each after a synchronisation) and back-to-back (5 steps per timing), CUDA events; peak memory
allocated (``torch.cuda.max_memory_allocated``) over the timed steps.

Usage: python tools/replay_ab.py
"""
import argparse
import statistics, torch, fp8engine as fe
import fp8engine.ops.layer as L
from fp8engine.modules.transformer import TransformerLayer
from fp8engine.bench.common import fwd_bwd_step


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(2048, 4, 4096, device="cuda", dtype=dt, requires_grad=True); dy = torch.randn_like(x)
    lay = TransformerLayer(4096, 16384, 32, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dt, device="cuda")
    run = fwd_bwd_step(lay, x, dy, fe.DelayedScaling())
    def timed(on, n=10, b2b=5):
        L.REPLAY = on
        for _ in range(3): run()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        single = []
        for _ in range(n):
            torch.cuda.synchronize(); s.record(); run(); e.record(); e.synchronize(); single.append(s.elapsed_time(e))
        bb = []
        for _ in range(4):
            torch.cuda.synchronize(); s.record()
            for _ in range(b2b): run()
            e.record(); e.synchronize(); bb.append(s.elapsed_time(e) / b2b)
        return statistics.median(single), statistics.median(bb), torch.cuda.max_memory_allocated() / 2**30
    res = {True: [], False: []}
    for r in range(4):
        for on in (True, False):
            res[on].append(timed(on))
    for on in (True, False):
        a = res[on]
        print(f"replay {'on ' if on else 'off'}: single {statistics.median(t[0] for t in a):.3f} ms, back-to-back {statistics.median(t[1] for t in a):.3f} ms, peak {max(t[2] for t in a):.2f} GiB; rounds single {[round(t[0],2) for t in a]}")


if __name__ == "__main__":
    main()
