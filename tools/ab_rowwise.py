"""A/B in the FP8 TransformerLayer: fprop GEMMs through torch's rowwise-scaled dispatch (all scales equal; a
CUTLASS kernel on sm90) against the tensorwise cuBLASLt call. Alternates the two every round in one process."""
import statistics

import torch

import fp8engine as fe
from fp8engine.bench.common import time_back_to_back, time_fn
from fp8engine.bench.layer import _ours, _step
from fp8engine.ops import gemm
from tests.conftest import sqnr

torch.manual_seed(0)
x = torch.randn(2048, 4, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
layer = _ours(4096, 16384, 32, "cuda")
step = _step(layer, x, dy, fe.DelayedScaling())
outs = {}
for flag in (False, True):
    gemm._FPROP_ROWWISE = flag
    with torch.no_grad(), fe.autocast(recipe=fe.DelayedScaling()):
        outs[flag] = layer(x).float()
print("SQNR rowwise vs tensorwise output (dB):", sqnr(outs[False], outs[True]))
res = {False: ([], []), True: ([], [])}
for r in range(6):
    for flag in ((False, True) if r % 2 == 0 else (True, False)):
        gemm._FPROP_ROWWISE = flag
        res[flag][0].append(time_fn(step, warmup=3, iters=10))
        res[flag][1].append(time_back_to_back(step, steps=5, repeats=10))
for flag, (single, b2b) in res.items():
    print("rowwise" if flag else "tensorwise", "single", round(statistics.median(single), 3), "b2b",
          round(statistics.median(b2b), 3), "rounds single", [round(v, 2) for v in single], "b2b",
          [round(v, 2) for v in b2b])
