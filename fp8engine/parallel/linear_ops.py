"""The tensor-parallel communication of a linear op: :class:`TPLinearComm`, the implementation of
:class:`fp8engine.ops.comm.LinearComm` that :func:`fp8engine.ops.linear.linear`, the fused MLP op
(:func:`fp8engine.ops.mlp.fp8_mlp`), the QKV op and the block-scaled op (:mod:`fp8engine.parallel.block_linear_ops`)
call at the points Megatron-core places its collectives.

Per rank (tp = the group's size):

- ``"column"`` (``weight [N/tp, K]``): with ``sequence_parallel`` the input shard ``[s/tp, b, K]`` is all-gathered
  along dim 0 before fprop; under FP8 with ``fp8_all_gather`` as FP8 bytes (each rank casts its shard with the
  tp-shared scale, :func:`fp8engine.parallel.fp8_comm.cast_and_all_gather_fp8`: bit-identical to gathering in high
  precision and casting the whole, at half of bf16's bytes) and backward re-gathers the FP8 shard asynchronously
  behind the dgrad GEMM. The dgrad ``[s, b, K]`` is a partial sum: all-reduced, or reduce-scattered to
  ``[s/tp, b, K]`` with sequence parallelism, asynchronously while the wgrad GEMM runs.
- ``"row"`` (``weight [N, K/tp]``): fprop's partial output ``[s, b, N]`` is all-reduced, or reduce-scattered to
  ``[s/tp, b, N]`` with sequence parallelism (whose backward all-gathers the output gradient first).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import Quantizer
from fp8engine.parallel.fp8_comm import all_gather_dim0, all_gather_fp8_bytes, cast_and_all_gather_fp8
from fp8engine.parallel.utils import all_reduce, get_group_size, reduce_scatter_dim0

__all__ = ["TPLinearComm", "PARALLEL_MODES"]

#: Values of ``TPLinearComm.parallel_mode``.
PARALLEL_MODES = ("column", "row")


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
        """All-gather the sequence shard ``x [m, K]`` along dim 0 to ``[tp * m, K]``: ``(total, shard)`` as
        :meth:`fp8engine.ops.comm.LinearComm.gather_input` describes (FP8 bytes with ``fp8_all_gather``)."""
        if quantizer is None:
            return all_gather_dim0(x, self.tp_group)[0], x
        if self.fp8_all_gather:
            local, total = cast_and_all_gather_fp8(x, quantizer, self.tp_group)
            return total, local
        total = all_gather_dim0(x, self.tp_group)[0]
        return quantizer.quantize(total, transpose=transpose), None

    def regather_input(self, shard: Union[torch.Tensor, Float8Tensor]
                       ) -> Callable[[], Union[torch.Tensor, Float8Tensor]]:
        """Start the all-gather of ``shard`` (high precision, or FP8 bytes sharing one ``scale_inv``)
        asynchronously; ``finish()`` waits and returns the ``[tp * m, K]`` total."""
        if isinstance(shard, Float8Tensor):
            total, work = all_gather_fp8_bytes(shard, self.tp_group, async_op=True)
        else:
            total, work = all_gather_dim0(shard, self.tp_group, async_op=True)

        def finish():
            work.wait()
            return total

        return finish

    def start_dgrad_comm(self, dx: torch.Tensor) -> tuple[torch.Tensor, Optional[object]]:
        """Column parallel: start summing the partial dgrad ``dx [M, K]`` over the group asynchronously (in place
        all-reduce; with sequence parallelism a reduce-scatter into a new ``[M / tp, K]``). Returns ``(dx, work)``,
        ``dx`` valid after ``work.wait()``; ``work`` None when nothing was started (row parallel, one rank)."""
        if self.parallel_mode == "row" or self.size == 1:
            return dx, None
        if not self.sequence_parallel:
            return all_reduce(dx, self.tp_group, async_op=True)
        return reduce_scatter_dim0(dx, self.tp_group, async_op=True)

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """Row parallel: the SUM over the group of the partial ``y [M, N]`` (a fresh GEMM output, all-reduced in
        place), reduce-scattered to ``[M / tp, N]`` with sequence parallelism. Column parallel: ``y``."""
        if self.parallel_mode != "row" or self.size == 1:
            return y
        if self.sequence_parallel:
            return reduce_scatter_dim0(y, self.tp_group)[0]
        return all_reduce(y, self.tp_group)[0]

    def gather_output_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """Row parallel with sequence parallelism: all-gather ``dy [M / tp, N]`` to ``[M, N]``; else ``dy``."""
        if self.parallel_mode == "row" and self.sequence_parallel and self.size > 1:
            return all_gather_dim0(dy, self.tp_group)[0]
        return dy
