"""``torchrun --nproc-per-node T -m fp8engine.bench comm``: the sequence-parallel input all-gather in bf16 vs FP8.

Times :func:`fp8engine.parallel.fp8_comm.measure_sp_all_gather` on ``[s/T, b, h]`` bf16 shards: the bf16 gather,
and the FP8 path a column-parallel layer runs (current-scaling amax all-reduce + cast + uint8 all-gather).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fp8engine._cli import CommandParser
from fp8engine.bench.common import env_info, print_table, write_json


def main(argv=None) -> int:
    p = CommandParser(prog="python -m fp8engine.bench comm", description=__doc__)
    p.add_argument("--shapes", default="2048x4x4096,8192x4x4096", help="global s x b x h list")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from fp8engine.parallel.fp8_comm import measure_sp_all_gather

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    group, tp = dist.group.WORLD, dist.get_world_size()
    rows = []
    for shape in args.shapes.split(","):
        s, b, h = (int(v) for v in shape.split("x"))
        x = torch.randn(s // tp, b, h, device="cuda", dtype=torch.bfloat16)
        for fp8 in (False, True):
            r = measure_sp_all_gather(x, group, fp8=fp8, iters=args.iters)
            rows.append({"tp": tp, "global [s,b,h]": shape, "payload": "fp8 (cast+amax+gather)" if fp8 else "bf16",
                         "MB received/rank": r["bytes_received"] / 1e6, "ms": r["seconds"] * 1e3,
                         "GB/s": r["gbps"]})
    if dist.get_rank() == 0:
        print(f"# sequence-parallel all-gather  {env_info()}")
        print_table(rows)
        write_json(args.json, "comm", rows)
    dist.destroy_process_group()
    return 0
