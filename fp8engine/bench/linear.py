"""``python -m fp8engine.bench linear``: fp8engine.Linear vs ``torch.nn.Linear`` (bf16) and torchao.float8, fwd+bwd.

FLOPs counted: 3 GEMMs of ``2*M*K*N`` each (fprop, dgrad, wgrad).
"""
from __future__ import annotations

import statistics

import torch

import fp8engine as fe
from fp8engine._cli import CommandParser
from fp8engine.bench.common import env_info, fwd_bwd_step, peak_memory_gib, print_table, time_fn, write_json
from fp8engine.bench.torchao_ref import torchao_available, torchao_float8

DEFAULT_SHAPES = "8192x4096x16384,8192x16384x4096,8192x4096x4096,4096x4096x4096,2048x2048x2048,1024x1024x1024"


def bench_shape(m: int, k: int, n: int, device: str, iters: int, with_torchao: bool, rounds: int = 1
                ) -> list[dict]:
    dtype = torch.bfloat16
    torch.manual_seed(0)
    ref = torch.nn.Linear(k, n, bias=True, device=device, dtype=dtype)
    ours = fe.Linear(k, n, bias=True, device=device, params_dtype=dtype)
    ours.load_state_dict(ref.state_dict(), strict=False)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    flops = 6.0 * m * k * n
    cases = [("nn.Linear bf16", ref, None), ("fp8engine bf16", ours, None),
             ("fp8engine fp8 delayed", ours, fe.DelayedScaling()),
             ("fp8engine fp8 current", ours, fe.CurrentScaling()),
             ("fp8engine fp8 block", ours, fe.Float8BlockScaling())]
    if with_torchao:
        cases.append(("torchao.float8 eager", torchao_float8(ref), None))
        cases.append(("torchao.float8 compile", torchao_float8(ref, compile=True), None))
    times = {name: ([], []) for name, _, _ in cases}  # ms and peak GiB per round
    for _ in range(rounds):  # rows interleaved, as in bench layer --rounds
        for name, model, recipe in cases:
            peak_memory_gib(reset=True)
            times[name][0].append(time_fn(fwd_bwd_step(model, x, dy, recipe), warmup=5, iters=iters, device=device))
            times[name][1].append(peak_memory_gib())
    rows, base = [], None
    for name, (ms_rounds, peak) in times.items():
        ms = statistics.median(ms_rounds)
        base = base or ms
        rows.append({"impl": name, "M": m, "K": k, "N": n, "ms": ms, "TFLOP/s": flops / ms / 1e9,
                     "speedup_vs_bf16": base / ms, "peak_GiB": max(peak),
                     "ms per round": " / ".join(f"{v:.3f}" for v in ms_rounds)})
    return rows


def main(argv=None) -> int:
    p = CommandParser(prog="python -m fp8engine.bench linear", description=__doc__)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN list")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1, help="time the rows this many times, interleaved; report medians")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    with_torchao = not args.no_torchao and args.device == "cuda" and torchao_available()
    print(f"# linear fwd+bwd  {env_info()}  torchao={'yes' if with_torchao else 'no'}")
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.lower().split("x"))
        rows += bench_shape(m, k, n, args.device, args.iters, with_torchao, args.rounds)
    print_table(rows)
    write_json(args.json, "linear", rows)
    return 0
