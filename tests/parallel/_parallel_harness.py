"""Launch real multi-process gloo groups on 127.0.0.1 from a test (torch.multiprocessing, start method "spawn").

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with
the default process group initialised; an exception (an assertion) in any rank fails the calling test with that
rank's traceback. ``fn`` must be a module-level function of a test module (spawn pickles it by name).
"""
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, args):
    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args) -> None:
    mp.start_processes(_entry, args=(fn, world_size, _free_port(), args), nprocs=world_size, join=True,
                       start_method="spawn")


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
