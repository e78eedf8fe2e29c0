"""The multi-rank families at world size 8 (gloo), where Megatron runs its tensor-parallel tests: the mappings,
vocab-parallel embedding + cross entropy + broadcast_data + 1-D split + RNG streams + inference layers, the
parallel linear layers (float64), and checkpoint with distribute_saved_activations -- each on the world group of 8
and on two tensor-parallel groups of 4 (ranks 0-3 and 4-7: group offsets, e.g. rank 5 is tp rank 1 of group 1 and
broadcasts come from global rank 4), each against its unsharded reference, exactly or to float64 rounding.

All in one 8-process launch: starting 8 processes (each importing torch) costs far more than these tiny checks on
the 2-core CI machine.
"""
import time

import torch.distributed as dist

from _parallel_harness import run_ranks, tp_groups
from test_mappings import _mappings_check
from test_parallel_linear import _hp_check
from test_parallel_misc import _misc_check
from test_rng_checkpoint import _distributed_checkpoint_check


def _worker(rank, ws):
    for tp in (ws, 4):
        group, group_index, tp_rank = tp_groups(tp)
        assert dist.get_process_group_ranks(group) == list(range(group_index * tp, (group_index + 1) * tp))
        for name, check in (("mappings", lambda: _mappings_check(tp_rank, tp, group, salt=group_index)),
                            ("embedding/cross-entropy/data/rng/inference", lambda: _misc_check(tp_rank, tp, group)),
                            ("parallel linear", lambda: _hp_check(tp_rank, tp, group)),
                            ("checkpoint", lambda: _distributed_checkpoint_check(group, group_index, tp_rank, tp))):
            start = time.perf_counter()
            try:
                check()
            except Exception as e:
                raise AssertionError(f"{name} failed at world size {ws}, tp={tp} (group {group_index}, tp rank "
                                     f"{tp_rank}, global rank {rank})") from e
            if rank == 0:
                print(f"ws{ws} tp{tp} {name}: {time.perf_counter() - start:.2f}s", flush=True)


def test_tensor_parallel_families_world_size_8():
    run_ranks(_worker, 8)
