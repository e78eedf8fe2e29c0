"""Launch real multi-process gloo groups on 127.0.0.1 from a test (torch.multiprocessing, start method "spawn").

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with
the default process group initialised; an exception (an assertion) in any rank fails the calling test with that
rank's traceback. ``fn`` must be a module-level function of a test module (spawn pickles it by name).
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, fn, world_size, port, args):
    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown. A rank that compiled (torch.compile) could die there with
    # "terminate called without an active exception" (SIGABRT: a C++ thread of the compile machinery still joinable
    # at exit; once in CI on 2 cores, tests/parallel/test_mappings.py::test_mappings_exact_compiled), after every
    # check had passed. A failing rank still raises above, and the spawn wrapper reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args) -> None:
    # The rendezvous store is served by this (parent) process on a port the OS assigns while binding it: no port is
    # picked first and bound later, which another test's group (pytest-xdist workers) could take in between.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    mp.start_processes(_entry, args=(fn, world_size, store.port, args), nprocs=world_size, join=True,
                       start_method="spawn")
    del store


def world_group():
    """The default group as an explicit object (tests pass groups explicitly, like the library)."""
    return dist.group.WORLD


def tp_groups(tp: int):
    """``(group, group_index, group_rank)`` of this rank among Megatron's tensor-parallel groups of ``tp`` consecutive
    ranks (group ``i`` = ranks ``i*tp .. (i+1)*tp - 1``; at world size 8 and ``tp`` 4, rank 5 is rank 1 of group 1).
    Every rank creates every group, in the same order, as ``torch.distributed.new_group`` requires; ``tp`` equal to
    the world size gives the world group."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    if ws % tp:
        raise ValueError(f"tp={tp} does not divide the world size {ws}")
    if tp == ws:
        return dist.group.WORLD, 0, rank
    mine = None
    for i in range(ws // tp):
        g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
        if rank // tp == i:
            mine = g
    return mine, rank // tp, rank % tp


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


def tp_gpt_pair(config, sequence_parallel: bool, batch: int = 3):
    """``(ref, tp, x, y)``: an unsharded GPT and its tensor-parallel twin over the world group, both built from seed 0
    (every rank draws the same master weights), and one batch of ``[batch, config.max_seq_len]`` tokens and targets."""
    from fp8engine.models import GPT

    torch.manual_seed(0)
    ref = GPT(config)
    torch.manual_seed(0)
    tp = GPT(config, tp_group=world_group(), sequence_parallel=sequence_parallel)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, config.vocab_size, (batch, config.max_seq_len), generator=gen) for _ in range(2))
    return ref, tp, x, y

