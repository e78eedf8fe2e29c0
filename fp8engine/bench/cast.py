"""``python -m fp8engine.bench cast``: bf16 -> E4M3 cast with amax + scale_inv, effective bandwidth.

Two timings per row (``bench.common``): "ms" synchronises before every call, so it includes the host time of the
call until its kernel starts (Python checks, allocation, Triton launch); "back-to-back" issues 10 calls without
synchronisation, as the casts of a training step run, and reports the time per call.

Bytes counted: 2 read + 1 written per element (+1 more written for the transposed copy in cast-transpose), the
minimum traffic; a device-to-device copy on the H200 moves 4.24 TB/s (../shared/ANCHORS.md).
"""
from __future__ import annotations


import torch

import fp8engine as fe
from fp8engine._cli import CommandParser
from fp8engine.bench.common import env_info, print_table, time_back_to_back, time_fn, write_json


def _eager_three_pass(x, fp8_dtype):
    amax = x.abs().amax().float()
    scale = torch.finfo(fp8_dtype).max / amax
    data = (x.float() * scale).clamp(-448.0, 448.0).to(fp8_dtype)
    return data, scale.reciprocal()


def main(argv=None) -> int:
    p = CommandParser(prog="python -m fp8engine.bench cast", description=__doc__)
    p.add_argument("--m", type=int, default=32768)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    m, n, dev = args.m, args.n, args.device
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    scale = torch.tensor([100.0], device=dev)
    amax = torch.zeros(1, device=dev)
    e4m3 = torch.float8_e4m3fn
    nbytes = 3.0 * m * n
    cases = [
        ("device copy (bf16, read+write)", lambda: x.clone(), 4.0 * m * n),
        ("eager torch: amax + scale + cast (3 passes)", lambda: _eager_three_pass(x, e4m3), nbytes),
        ("fp8engine quantize (delayed: known scale, amax recorded)",
         lambda: fe.quantize(x, e4m3, scale, amax_out=amax), nbytes),
        ("fp8engine cast-transpose (delayed)",
         lambda: fe.quantize(x, e4m3, scale, amax_out=amax, transpose=True), nbytes + m * n),
        ("fp8engine quantize_current (amax pass + cast)", lambda: fe.quantize_current(x, e4m3), nbytes),
    ]
    if dev == "cuda":
        compiled = torch.compile(_eager_three_pass)
        cases.insert(2, ("torch.compile: amax + scale + cast", lambda: compiled(x, e4m3), nbytes))
    print(f"# cast {m}x{n} bf16 -> e4m3  {env_info()}")
    rows = []
    for name, fn, moved in cases:
        ms = time_fn(fn, warmup=5, iters=args.iters, device=dev)
        ms_b2b = time_back_to_back(fn, steps=10, repeats=args.iters, warmup=5, device=dev)
        rows.append({"impl": name, "ms": ms, "TB/s": moved / ms / 1e9, "ms back-to-back": ms_b2b,
                     "TB/s back-to-back": moved / ms_b2b / 1e9})
    ref = _eager_three_pass(x, e4m3)[0]
    amax.zero_()
    q = fe.quantize(x, e4m3, x.abs().amax().float().reshape(1).reciprocal() * 448.0, amax_out=amax)
    rows.append({"impl": "check: bits equal eager cast", "ms": float(torch.equal(q.data.view(torch.uint8),
                                                                           ref.view(torch.uint8))), "TB/s": 0.0})
    print_table(rows)
    write_json(args.json, "cast", rows)
    return 0
