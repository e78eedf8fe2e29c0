"""All-gather of sequence-parallel activations in FP8 (1 byte per element instead of 2 for bf16).

The input of a sequence-parallel column layer is one tensor ``[s, b, h]`` split along the sequence over the tp
group. To all-gather FP8 bytes instead of bf16, every rank casts its shard ``[s/tp, b, h]`` with the *same* scale:

- delayed scaling: the scale is ``state.scale[row]``, identical on every tp rank because the amax recorded for
  this row is the MAX over the tp group (we all-reduce it here, asynchronously, next to the gather), so the
  histories and hence the scales stay equal;
- current scaling: the tp-MAX of the shards' amaxes is all-reduced first, then each shard is cast with
  ``fp8_max / amax`` of the whole tensor.

Quantization is element-wise, so with one shared scale "cast shards, gather bytes" produces exactly the bits of
"gather bf16, cast the whole": the FP8 path is bit-identical to the high-precision-gather path, at half the bytes.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import Quantizer
from fp8engine.parallel.utils import all_gather_dim0, all_reduce, get_group_size

__all__ = ["cast_and_all_gather_fp8", "all_gather_fp8_bytes", "all_gather_dim0", "sp_all_gather_bytes",
           "measure_sp_all_gather"]


def all_gather_fp8_bytes(local: Float8Tensor, group, async_op: bool = False):
    """All-gather the FP8 bits of shards that share one ``scale_inv`` (moved as uint8).

    Args:
        local: this rank's ``[n, ...]`` shard; every rank's shard must have been cast with the same scale.
    Returns:
        ``(gathered, work)``: a :class:`Float8Tensor` ``[size * n, ...]`` with ``local.scale_inv`` (its data is
        valid once ``work.wait()`` returns when ``async_op``), and the work handle or None.
    """
    raw, work = all_gather_dim0(local.data.view(torch.uint8), group, async_op=async_op)
    return Float8Tensor(raw.view(local.data.dtype), local.scale_inv, local.dtype, kernels=local.kernels), work


def cast_and_all_gather_fp8(x: torch.Tensor, quantizer: Quantizer, group) -> tuple[Float8Tensor, Float8Tensor]:
    """Cast this rank's sequence shard with the tp-shared scale and all-gather the FP8 bytes.

    Args:
        x: ``[s/tp, ..., h]`` high precision, the local sequence shard.
        quantizer: this operand's :class:`Quantizer` (delayed scaling records the tp-MAX amax into its amax slot
            unless it records none: a recompute).
        group: the tensor-parallel group.
    Returns:
        ``(local_fp8, total_fp8)``: the local shard ``[s/tp, ..., h]`` and the gathered ``[s, ..., h]`` FP8 tensors,
        sharing one ``scale_inv``.
    """
    if quantizer.delayed:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device) if quantizer.record_amax else None
        local = Quantizer(quantizer.fp8_dtype, "delayed", quantizer.scale, amax, stats=quantizer.stats,
                          kernels=quantizer.kernels).quantize(x)
        total, work = all_gather_fp8_bytes(local, group, async_op=True)
        amax, amax_work = all_reduce(amax, group, "max", async_op=True) if amax is not None else (None, None)
        work.wait()
        if amax_work is not None:
            amax_work.wait()
            torch.maximum(quantizer.amax, amax, out=quantizer.amax)
        return local, total
    amax = x.detach().abs().amax().float().reshape(1)
    amax = all_reduce(amax, group, "max")[0]  # the scale must be known before the cast
    local = quantizer.quantize(x, amax=amax)
    total, _ = all_gather_fp8_bytes(local, group)
    return local, total


def sp_all_gather_bytes(local_shape, dtype: torch.dtype, group_size: int, fp8: bool) -> int:
    """Bytes one rank receives in a sequence-parallel all-gather of shards ``local_shape`` (ring/NVLS: each rank
    receives the ``size - 1`` other shards): ``(size - 1) * numel * (1 if fp8 else dtype's itemsize)``, plus
    4 bytes per rank for the FP8 path's amax all-reduce (delayed or current scaling)."""
    numel = math.prod(int(d) for d in local_shape)
    if fp8:
        return (group_size - 1) * (numel + 4)
    return (group_size - 1) * numel * dtype.itemsize


def measure_sp_all_gather(x_local: torch.Tensor, group, *, fp8: bool, iters: int = 20, warmup: int = 3,
                          quantizer: Optional[Quantizer] = None) -> dict:
    """Time the sequence-parallel input all-gather of ``x_local`` ``[s/tp, b, h]`` in high precision or FP8.

    The FP8 variant times the whole path a column layer runs (cast with a shared scale + amax all-reduce +
    uint8 all-gather), with current scaling when ``quantizer`` is None (an amax all-reduce before the cast; the
    costlier of the two recipes). Used by :mod:`fp8engine.bench.comm`; nothing here prints.

    Returns:
        ``{"fp8": bool, "bytes_received": int per rank, "seconds": mean seconds per gather, "gbps": received
        GB/s}``.
    """
    size = get_group_size(group)
    if fp8:
        from fp8engine.fp8.dtypes import fp8_dtype_of

        quantizer = quantizer or Quantizer(fp8_dtype_of("e4m3"), "current", kernels=x_local.is_cuda)
    step = ((lambda: cast_and_all_gather_fp8(x_local, quantizer, group)) if fp8
            else (lambda: all_gather_dim0(x_local, group)))
    sync = torch.cuda.synchronize if x_local.is_cuda else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    if size > 1:
        dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / iters
    nbytes = sp_all_gather_bytes(x_local.shape, x_local.dtype, size, fp8)
    return {"fp8": fp8, "bytes_received": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9}
