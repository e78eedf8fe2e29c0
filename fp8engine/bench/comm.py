"""``torchrun --nproc-per-node T -m fp8engine.bench comm``: all-gathers in bf16 vs FP8.

Default: times :func:`fp8engine.parallel.fp8_comm.measure_sp_all_gather` on ``[s/T, b, h]`` bf16 shards (CUDA,
NCCL): the bf16 sequence-parallel gather, and the FP8 path a column-parallel layer runs (current-scaling amax
all-reduce + cast + uint8 all-gather).

``--fsdp-model NAME``: the bytes FSDP2's all-gathers move in one forward of the training command's GPT ``NAME``
sharded over the launched processes as ``--fsdp`` shards it (:func:`fp8engine.parallel.fsdp.shard_model`, bf16
``param_dtype``), with bf16 weights and with ``--fp8-all-gather`` (:func:`fsdp_gather_bytes`): counted, not timed,
so ``--device cpu`` (gloo) gives the figure on any machine. The backward re-gathers the same layers
(``reshard_after_forward``), so per step the bytes double and the ratio stays.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fp8engine._cli import CommandParser
from fp8engine.bench.common import env_info, print_table, write_json

_COUNTS = {"bytes": 0, "calls": 0}


def _count_all_gathers() -> None:
    """Wrap the all-gather FSDP2 calls (``all_gather_single`` or ``all_gather_into_tensor``, by torch version) so
    that each call adds its output bytes to ``_COUNTS`` (idempotent)."""
    for name in ("all_gather_single", "all_gather_into_tensor"):
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_fp8engine_counting", False):
            continue

        def counting(out, inp, *args, _orig=fn, **kwargs):
            _COUNTS["bytes"] += out.numel() * out.element_size()
            _COUNTS["calls"] += 1
            return _orig(out, inp, *args, **kwargs)

        counting._fp8engine_counting = True
        setattr(dist, name, counting)


def fsdp_gather_bytes(config, fp8_all_gather: bool, device: torch.device) -> tuple[int, int]:
    """``(bytes, calls)`` FSDP2 all-gathers in one forward of ``config``'s GPT sharded over the default process
    group (one ``[1, 16]`` token batch under bf16 autocast and FP8 delayed scaling)."""
    import fp8engine
    from fp8engine.models import GPT
    from fp8engine.parallel.fsdp import shard_model
    from torch.distributed.device_mesh import init_device_mesh

    _count_all_gathers()
    torch.manual_seed(0)
    model = GPT(config, device=device)
    shard_model(model, init_device_mesh(device.type, (dist.get_world_size(),)), model.layers,
                param_dtype=torch.bfloat16, fp8_all_gather=fp8_all_gather)
    tokens = torch.randint(0, config.vocab_size, (1, 16), device=device)
    _COUNTS.update(bytes=0, calls=0)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16), \
            fp8engine.fp8_autocast(True, fp8engine.DelayedScaling(), fp8_group=dist.group.WORLD):
        model(tokens)
    return _COUNTS["bytes"], _COUNTS["calls"]


def _fsdp_rows(model_name: str, device: torch.device) -> list[dict]:
    from fp8engine.models import GPT_CONFIGS

    rows = []
    for fp8 in (False, True):
        nbytes, calls = fsdp_gather_bytes(GPT_CONFIGS[model_name], fp8, device)
        rows.append({"model": model_name, "ranks": dist.get_world_size(),
                     "weights all-gathered as": "FP8 (--fp8-all-gather)" if fp8 else "bf16",
                     "MiB per forward": nbytes / 2**20, "all-gathers": calls})
    for row in rows:
        row["vs bf16"] = row["MiB per forward"] / rows[0]["MiB per forward"]
    return rows


def main(argv=None) -> int:
    p = CommandParser(prog="python -m fp8engine.bench comm", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="2048x4x4096,8192x4x4096", help="global s x b x h list")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--fsdp-model", default=None, metavar="NAME",
                   help="instead: count the bytes FSDP2 all-gathers per forward of this model of the training command "
                        "(bf16 vs FP8 weights)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"),
                   help="with --fsdp-model: cpu counts over gloo (the sequence-parallel timing needs cuda)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from fp8engine.models import GPT_CONFIGS

    if args.fsdp_model is not None and args.fsdp_model not in GPT_CONFIGS:
        p.error(f"--fsdp-model {args.fsdp_model!r}: choose one of {', '.join(GPT_CONFIGS)}")
    if args.device == "cpu" and args.fsdp_model is None:
        p.error("the sequence-parallel all-gather timing runs on CUDA; on cpu pass --fsdp-model NAME")
    if "WORLD_SIZE" not in os.environ:
        p.error("launch with torchrun --nproc-per-node 2 (or more)")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if args.fsdp_model is not None:
        rows, title = _fsdp_rows(args.fsdp_model, device), "FSDP2 all-gather bytes per forward"
    else:
        from fp8engine.parallel.fp8_comm import measure_sp_all_gather

        group, tp = dist.group.WORLD, dist.get_world_size()
        rows, title = [], "sequence-parallel all-gather"
        for shape in args.shapes.split(","):
            s, b, h = (int(v) for v in shape.split("x"))
            x = torch.randn(s // tp, b, h, device=device, dtype=torch.bfloat16)
            for fp8 in (False, True):
                r = measure_sp_all_gather(x, group, fp8=fp8, iters=args.iters)
                rows.append({"tp": tp, "global [s,b,h]": shape,
                             "payload": "fp8 (cast+amax+gather)" if fp8 else "bf16",
                             "MB received/rank": r["bytes_received"] / 1e6, "ms": r["seconds"] * 1e3,
                             "GB/s": r["gbps"]})
    if dist.get_rank() == 0:
        print(f"# {title}  {env_info()}")
        print_table(rows)
        write_json(args.json, "comm", rows)
    dist.destroy_process_group()
    return 0
