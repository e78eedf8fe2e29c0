"""Data x tensor parallel training under ``torchrun``: layout checks and gradient helpers.

Layout (``fp8engine.parallel.init_parallel``): ``world = dp * tp``, tp innermost. Every tp rank of a data-parallel
replica sees the same batch; dp replica ``r`` takes micro-batch ``micro * dp + r`` of the step, so the global
batch of a step does not depend on how it is split (with dp = 1 it is exactly the single-process batch).

Checkpoints of multi-rank runs: :mod:`fp8engine.training.sharded_checkpoint`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from fp8engine.training import UsageError

__all__ = ["Layout", "env_world_size", "check_layout", "init_layout", "clip_grad_norm", "all_reduce_sum",
           "all_reduce_sum_", "wait_for_all"]


@dataclass
class Layout:
    """This process's place in the ``dp x tp`` grid (all sizes 1 and groups None for a single process)."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    dp_group: Any = None
    tp_group: Any = None
    #: the 1-D ``DeviceMesh`` of the data-parallel ranks (FSDP2 shards over it); None for one process
    dp_mesh: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """``WORLD_SIZE`` set by ``torchrun`` (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(tp: int, sequence_parallel: bool, config, seq_len: int, fp8: bool) -> None:
    """Raise :class:`UsageError` when ``--tp``/``--sequence-parallel`` cannot work with this launch and model."""
    world = env_world_size()
    if tp < 1 or world % tp:
        raise UsageError(f"--tp {tp} must divide the number of processes ({world}); launch with "
                         f"torchrun --nproc-per-node {max(tp, 1)} (or a multiple of it)")
    if sequence_parallel and tp == 1:
        raise UsageError("--sequence-parallel needs --tp 2 or more")
    if tp == 1:
        return
    for name, value in (("n_head", config.n_head), ("kv heads", config.kv_heads),
                        ("ffn_hidden_size", config.ffn_hidden_size), ("vocab size", config.vocab_size)):
        if value % tp:
            raise UsageError(f"--tp {tp} does not divide the model's {name} ({value}); choose a --tp that does")
    if sequence_parallel and seq_len % tp:
        raise UsageError(f"--sequence-parallel needs --seq-len divisible by --tp {tp}; got {seq_len}")
    if fp8 and config.fp8_problems(tp):
        raise UsageError(f"--tp {tp} leaves FP8 GEMMs misaligned: {config.fp8_problems(tp)[0]}; use a smaller "
                         "--tp or --precision bf16")


def init_layout(tp: int, device: torch.device, timeout: Optional[float] = None) -> Layout:
    """Initialise ``torch.distributed`` from ``torchrun``'s environment when there is more than one process;
    ``timeout`` (seconds, None: torch's default) bounds every collective's wait."""
    if env_world_size() == 1:
        return Layout()
    from fp8engine.parallel import init_parallel

    env = init_parallel(tp, backend=None if device.type == "cuda" else "gloo", timeout=timeout)
    return Layout(dist.get_rank(), dist.get_world_size(), env.dp_rank, env.dims.dp, env.dims.tp, env.tp_rank,
                  env.dp_group if env.dims.dp > 1 else None, env.tp_group if env.dims.tp > 1 else None,
                  env.mesh["dp"])


def wait_for_all(layout: Layout) -> None:
    """A barrier of every rank (nothing for one process). Before the ranks leave on an error they all raised alike:
    rank 0 prints the error line first, and ``torchrun`` stops the other ranks as soon as one exits, so no rank
    may exit before rank 0 has printed (a fixed sleep lost that race on a loaded machine)."""
    if layout.world_size > 1 and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float], group, device) -> list[float]:
    """SUM a few Python floats across ``group`` (identity for None)."""
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def all_reduce_sum_(t: torch.Tensor, group) -> torch.Tensor:
    """SUM a device tensor across ``group`` in place, without a host synchronisation (identity for None)."""
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, tp_group,
                   fsdp_group=None) -> torch.Tensor:
    """Clip to a global L2 norm ``max_norm``; returns the norm before clipping (fp32 device scalar, no host
    synchronisation, so it can run inside a captured CUDA graph).

    With tensor parallelism a parameter holding a shard contributes its local sum of squares, summed over
    ``tp_group``; a replicated one (norms and row-parallel biases, marked with a ``sequence_parallel``
    attribute by the layers) is counted once (Megatron's ``clip_grad_norm_fp32``). With FSDP (``fsdp_group``:
    the data-parallel group the gradients are sharded over, as ``DTensor`` shards) each rank sums the squares of
    its local shards and the sums are added over ``fsdp_group`` too.
    """
    from fp8engine.parallel.fsdp import local_tensor

    params = [p for p in params if p.grad is not None]
    if tp_group is None and fsdp_group is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [local_tensor(p.grad) for p in params]
    sharded = [g for p, g in zip(params, grads) if not hasattr(p, "sequence_parallel")]
    replicated = [g for p, g in zip(params, grads) if hasattr(p, "sequence_parallel")]
    device = grads[0].device
    sq_sharded, sq_replicated = _sum_of_squares(sharded, device), _sum_of_squares(replicated, device)
    if fsdp_group is not None:  # the shards of every parameter are disjoint over the data-parallel ranks
        both = torch.stack([sq_sharded, sq_replicated])
        dist.all_reduce(both, group=fsdp_group)
        sq_sharded, sq_replicated = both[0], both[1]
    if tp_group is not None:
        dist.all_reduce(sq_sharded, group=tp_group)
    norm = (sq_sharded + sq_replicated).sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for dtype in {g.dtype for g in grads}:  # (one multi-tensor kernel per dtype, as torch's clip_grad_norm_)
        torch._foreach_mul_([g for g in grads if g.dtype == dtype], coef.to(dtype))
    return norm


def _sum_of_squares(grads: list, device: torch.device) -> torch.Tensor:
    """``sum_i ||g_i||^2`` in fp32 (a 0-d device tensor): the per-tensor L2 norms in one multi-tensor kernel
    (``torch._foreach_norm``, fp32 accumulation, as ``torch.nn.utils.clip_grad_norm_`` takes them), squared and
    summed; 0 for no gradient."""
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).pow(2).sum()
