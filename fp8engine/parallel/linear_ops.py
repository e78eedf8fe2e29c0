"""The tensor-parallel communication of a linear op: :class:`TPLinearComm`, the implementation of
:class:`fp8engine.ops.comm.LinearComm` (where each collective runs, shapes per rank: :mod:`fp8engine.ops.comm`)
that the linear, MLP and QKV ops call, under every recipe (per-tensor or block scaling) and in high precision.

Under FP8 with ``fp8_all_gather``, a column layer's sequence-parallel input all-gather moves FP8 bytes, bit for bit
the high-precision gather's cast (:mod:`fp8engine.parallel.fp8_comm`), and backward re-gathers the FP8 shard
asynchronously behind the dgrad GEMM.

Block scaling (``Float8BlockScaling``): the shard dims must be multiples of 128, so a shard boundary is a block
boundary and every rank's 1 x 128 tiles and 128 x 128 blocks are exactly the unsharded layer's. The FP8 all-gather
moves the scales with the data: each rank casts its shard ``[m, K]`` to 1 x 128 tiles along K (rows are independent:
gathering the FP8 rows and their scale rows gives exactly the cast of the gathered tensor), and backward re-gathers
the shard's re-tiled transpose ``[K, m]`` along its columns (with ``m`` a multiple of 128 no tile straddles two
ranks: exactly the re-tiled cast of the total's transpose). Where ``m`` is not a multiple of 128 the layer gathers in
high precision and casts the total (same result, bf16's bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from fp8engine.fp8.block_tensor import TILE_1x128, Float8BlockTensor
from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import Quantizer
from fp8engine.parallel.fp8_comm import all_gather_dim0, all_gather_fp8_bytes, cast_and_all_gather_fp8
from fp8engine.parallel.utils import all_reduce, get_group_size, reduce_scatter_dim0

__all__ = ["TPLinearComm", "PARALLEL_MODES", "all_gather_block_rows", "all_gather_block_cols"]

#: Values of ``TPLinearComm.parallel_mode``.
PARALLEL_MODES = ("column", "row")
_B = TILE_1x128[1]


def all_gather_block_rows(local: Float8BlockTensor, group) -> Float8BlockTensor:
    """All-gather a 1 x 128-tiled ``[m, K]`` shard along its rows: ``[size * m, K]`` in rank order, ``scale_inv``
    ``[size * m, K/128]`` in the M-major layout (strides ``(1, size * m)``). Two collectives (FP8 bytes, fp32
    scales); the result is exactly the cast of the gathered high-precision tensor (module docstring)."""
    data, _ = all_gather_dim0(local.data.view(torch.uint8), group)
    scales, _ = all_gather_dim0(local.scale_inv.contiguous(), group)  # [m, K/128] row-major shards, stacked
    return Float8BlockTensor(data.view(local.data.dtype), scales.t().contiguous().t(), local.block, local.dtype)


def all_gather_block_cols(local_t: Float8BlockTensor, group, async_op: bool = False):
    """Gather a 1 x 128-tiled ``[K, m]`` transposed shard (tiles along its m tokens, ``m`` a multiple of 128) along
    its columns. Returns ``finish``: ``finish()`` waits for the collectives (started asynchronously with
    ``async_op``) and returns the ``[K, size * m]`` tensor with ``scale_inv`` ``[K, size * m / 128]`` (strides
    ``(1, K)``), exactly the re-tiled cast of the gathered tensor's transpose."""
    size = get_group_size(group)
    k, m = local_t.data.shape
    # data: [size * K, m] gathered, then [K, size * m] (one copy); scales: the [m/128, K] storage of the shard's
    # (1, K)-strided [K, m/128] scale_inv stacks along dim 0 into the total's [size * m/128, K] storage directly
    raw, w1 = all_gather_dim0(local_t.data.view(torch.uint8), group, async_op=async_op)
    scales, w2 = all_gather_dim0(local_t.scale_inv.t(), group, async_op=async_op)

    def finish() -> Float8BlockTensor:
        for work in (w1, w2):
            if work is not None:
                work.wait()
        data = raw.view(size, k, m).permute(1, 0, 2).reshape(k, size * m).view(local_t.data.dtype)
        return Float8BlockTensor(data, scales.t(), local_t.block, local_t.dtype)

    return finish


class _Transposed:
    """What the re-gather of a block-scaled shard gives back: only the total's transposed operand (the wgrad's)."""

    __slots__ = ("_t",)

    def __init__(self, t: Float8BlockTensor):
        self._t = t

    def t_operand(self) -> Float8BlockTensor:
        return self._t


@dataclass(frozen=True)
class TPLinearComm:
    """How one tensor-parallel linear communicates (module docstring); implements
    :class:`fp8engine.ops.comm.LinearComm`. Built once per layer; its methods are called by the ops.

    Args:
        tp_group: the tensor-parallel process group (None: one rank; every hook is then the identity).
        parallel_mode: ``"column"`` or ``"row"``.
        sequence_parallel: activations outside the layer are sequence shards ``[s/tp, b, h]``.
        fp8_all_gather: under FP8, a column layer's sequence-parallel all-gather moves FP8 bytes (else high
            precision, cast after the gather).
    Raises:
        ValueError: an unknown ``parallel_mode``.
    """

    tp_group: object = None
    parallel_mode: str = "column"
    sequence_parallel: bool = False
    fp8_all_gather: bool = True
    size: int = field(init=False)
    gathers_input: bool = field(init=False)
    reduces_output: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"TPLinearComm: parallel_mode must be one of {PARALLEL_MODES}, got "
                             f"{self.parallel_mode!r}")
        size = get_group_size(self.tp_group)  # once: the hooks run per layer per micro-batch
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "gathers_input", self.parallel_mode == "column" and self.sequence_parallel
                           and size > 1)
        object.__setattr__(self, "reduces_output", self.parallel_mode == "row")

    def gather_input(self, x: torch.Tensor, quantizer: Optional[Quantizer], transpose: bool
                     ) -> tuple[Union[torch.Tensor, Float8Tensor], Optional[Union[torch.Tensor, Float8Tensor]]]:
        """:meth:`fp8engine.ops.comm.LinearComm.gather_input` (FP8 bytes with ``fp8_all_gather``)."""
        if quantizer is None:
            return all_gather_dim0(x, self.tp_group)[0], x
        if self.fp8_all_gather and not quantizer.is_block:
            local, total = cast_and_all_gather_fp8(x, quantizer, self.tp_group)
            return total, local
        if self.fp8_all_gather and x.shape[0] % _B == 0:  # block scaling: the scales travel with the data
            local = quantizer.quantize(x, transpose=transpose)  # (its re-tiled transpose: backward re-gathers it)
            return all_gather_block_rows(local, self.tp_group), local
        total = all_gather_dim0(x, self.tp_group)[0]
        return quantizer.quantize(total, transpose=transpose), None

    def regather_input(self, shard: Union[torch.Tensor, Float8Tensor]
                       ) -> Callable[[], Union[torch.Tensor, Float8Tensor]]:
        """:meth:`fp8engine.ops.comm.LinearComm.regather_input` (a block-scaled shard: only its re-tiled transpose is
        gathered, and ``finish()`` gives an object whose ``t_operand()`` is the total's)."""
        if isinstance(shard, Float8BlockTensor):
            gathered = all_gather_block_cols(shard.t_operand(), self.tp_group, async_op=True)
            return lambda: _Transposed(gathered())
        gather = all_gather_fp8_bytes if isinstance(shard, Float8Tensor) else all_gather_dim0
        total, work = gather(shard, self.tp_group, async_op=True)

        def finish():
            work.wait()
            return total

        return finish

    def start_dgrad_comm(self, dx: torch.Tensor) -> tuple[torch.Tensor, Optional[object]]:
        """:meth:`fp8engine.ops.comm.LinearComm.start_dgrad_comm`."""
        if self.parallel_mode == "row" or self.size == 1:
            return dx, None
        if not self.sequence_parallel:
            return all_reduce(dx, self.tp_group, async_op=True)
        return reduce_scatter_dim0(dx, self.tp_group, async_op=True)

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """:meth:`fp8engine.ops.comm.LinearComm.reduce_output` (``y`` a fresh GEMM output: all-reduced in place)."""
        if self.parallel_mode != "row" or self.size == 1:
            return y
        if self.sequence_parallel:
            return reduce_scatter_dim0(y, self.tp_group)[0]
        return all_reduce(y, self.tp_group)[0]

    def gather_output_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """:meth:`fp8engine.ops.comm.LinearComm.gather_output_grad`."""
        if self.parallel_mode == "row" and self.sequence_parallel and self.size > 1:
            return all_gather_dim0(dy, self.tp_group)[0]
        return dy
