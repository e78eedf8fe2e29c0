"""How many bytes do FSDP2's all-gathers move per forward, bf16 weights against ``--fp8-all-gather``? (CPU, gloo;
a measurement tool)

Builds the training command's GPT (``--model``), shards it with :func:`fp8engine.parallel.fsdp.shard_model` over the
launched processes as the command does on a GPU (bf16 ``param_dtype``; FP8 GEMM weights wrapped for the FP8
all-gather in the second pass), runs one forward of ``[1, 16]`` tokens under bf16 autocast and FP8 delayed scaling,
and counts the output bytes of every all-gather FSDP2 issues (``torch.distributed.all_gather_single`` /
``all_gather_into_tensor``, whichever the torch version calls). The backward re-gathers the same layers
(``reshard_after_forward``), so per step the figures double; the ratio stays.

Usage: torchrun --nproc-per-node 2 tools/fsdp_gather_bytes.py --model 1b
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import fp8engine  # noqa: E402
from fp8engine.models import GPT, GPT_CONFIGS  # noqa: E402
from fp8engine.parallel.fsdp import shard_model  # noqa: E402

_COUNTS = {"bytes": 0, "calls": 0}


def _count_all_gathers() -> None:
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            def counting(out, inp, *args, _orig=getattr(dist, name), **kwargs):
                _COUNTS["bytes"] += out.numel() * out.element_size()
                _COUNTS["calls"] += 1
                return _orig(out, inp, *args, **kwargs)
            setattr(dist, name, counting)


def gathered_bytes(config, fp8_all_gather: bool, world: int) -> tuple[int, int]:
    """(bytes, calls) all-gathered by one forward of ``config``'s GPT sharded over ``world`` gloo ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = GPT(config)
    shard_model(model, init_device_mesh("cpu", (world,)), model.layers, param_dtype=torch.bfloat16,
                fp8_all_gather=fp8_all_gather)
    tokens = torch.randint(0, config.vocab_size, (1, 16))
    _COUNTS.update(bytes=0, calls=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
            fp8engine.fp8_autocast(True, fp8engine.DelayedScaling(), fp8_group=dist.group.WORLD):
        model(tokens)
    return _COUNTS["bytes"], _COUNTS["calls"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", choices=sorted(GPT_CONFIGS))
    args = p.parse_args()
    if "WORLD_SIZE" not in os.environ:
        print("fsdp_gather_bytes: launch with torchrun --nproc-per-node 2 (or more)", file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    _count_all_gathers()
    config = GPT_CONFIGS[args.model]
    world = dist.get_world_size()
    bf16 = gathered_bytes(config, False, world)
    fp8 = gathered_bytes(config, True, world)
    if dist.get_rank() == 0:
        print(f"{args.model}, FSDP2 over {world} ranks, one forward: bf16 all-gather {bf16[0] / 2**20:.1f} MiB "
              f"({bf16[1]} calls), FP8 all-gather {fp8[0] / 2**20:.1f} MiB ({fp8[1]} calls): {fp8[0] / bf16[0]:.3f}x")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
