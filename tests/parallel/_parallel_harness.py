"""Launch real multi-process gloo groups on 127.0.0.1 from a test (torch.multiprocessing, start method "spawn").

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with
the default process group initialised; an exception (an assertion) in any rank fails the calling test with that
rank's traceback. ``fn`` must be a module-level function of a test module (spawn pickles it by name).
"""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, fn, world_size, store, args):
    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args) -> None:
    # A file rendezvous, not a TCP port picked beforehand: with several pytest workers (pytest-xdist) a free port
    # could be taken by another test's group between the pick and the bind (gloo then aborts a rank).
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(fn, world_size, os.path.join(tmp, "store"), args), nprocs=world_size,
                           join=True, start_method="spawn")


def world_group():
    """The default group as an explicit object (tests pass groups explicitly, like the library)."""
    return dist.group.WORLD


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20*log10(||ref|| / ||ref - actual||) (torchao's metric)."""
    ref, actual = ref.detach().double(), actual.detach().double()
    noise = (ref - actual).norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(ref.norm() / noise))


def shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/size slice of ``t`` along ``dim``."""
    return t.chunk(size, dim=dim)[rank]
