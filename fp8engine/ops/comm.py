"""The tensor-parallel communication a linear op may carry: the :class:`LinearComm` protocol.

The ops in this package never talk to ``torch.distributed`` (STYLE.md: model math never imports it). A linear op
that is column or row parallel takes an object implementing :class:`LinearComm` instead, and calls its hooks at the
points of fprop / dgrad / wgrad where Megatron-core places the collectives; ``None`` means no communication. The
implementation lives in :mod:`fp8engine.parallel.linear_ops` (``TPLinearComm``); tests may pass their own.

Per rank (tp = tensor-parallel size, ``m`` tokens of this rank):

- column parallel (``weight [N/tp, K]``): the input is ``[m, K]`` (replicated), or with sequence parallelism
  a sequence shard all-gathered along dim 0 to ``[tp * m, K]`` before fprop (:meth:`gather_input`, in FP8 where
  the implementation can; backward re-gathers the shard behind the dgrad GEMM, :meth:`regather_input`). The dgrad
  ``dx = dy @ w`` is a partial sum over the ranks: :meth:`start_dgrad_comm` all-reduces it (or reduce-scatters it
  to the shard) *asynchronously*; the op runs the wgrad GEMM, then waits.
- row parallel (``weight [N, K/tp]``): fprop's partial ``[m, N]`` is summed over the ranks by
  :meth:`reduce_output` (all-reduce, or reduce-scatter to ``[m / tp, N]`` with sequence parallelism), then the
  bias is added; backward all-gathers the output gradient first (:meth:`gather_output_grad`, sequence parallel).

Overlap (Megatron's ``tp_comm_overlap``, by splitting the GEMM by rows as TransformerEngine's userbuffers and
PyTorch's async-TP ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` do, with plain NCCL collectives):
:meth:`gather_input` may return a :class:`GatherInFlight` whose ``fprop`` runs this rank's rows beside the gather
and the other ranks' rows after it; :meth:`fprop_reduce` may compute the other ranks' rows first, start their
reduce-scatter, and run this rank's rows beside it. Both give the rows of the one-GEMM result (a split GEMM may pick
another cuBLASLt algorithm for its rows: equal up to the GEMM's own rounding).
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Union

import torch

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import Quantizer

__all__ = ["LinearComm", "GatherInFlight", "row_block", "part_fprop"]


def row_block(x: Union[torch.Tensor, Float8Tensor], start: int, stop: int) -> Union[torch.Tensor, Float8Tensor]:
    """Rows ``[start, stop)`` of a ``[M, K]`` operand (a view), high precision or per-tensor FP8."""
    if isinstance(x, Float8Tensor):
        return Float8Tensor(x.data.reshape(-1, x.shape[-1])[start:stop], x.scale_inv, x.dtype, kernels=x.kernels)
    return x.reshape(-1, x.shape[-1])[start:stop]


def part_fprop(x: Union[torch.Tensor, Float8Tensor], w: Union[torch.Tensor, Float8Tensor], out_dtype: torch.dtype,
               bias: Optional[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fprop of a row block: ``x [m, K] @ w.T (+ bias)`` ``[m, N]``, into ``out`` when given. FP8 operands:
    ``x.fprop`` (per-tensor, :func:`fp8engine.ops.gemm.fp8_fprop`); high precision: ``torch.addmm`` /
    ``torch.matmul`` (what ``F.linear`` runs for a 2-D input), result in ``x.dtype``."""
    if isinstance(x, Float8Tensor):
        return x.fprop(w, out_dtype, bias, out=out)
    kw = {} if out is None else {"out": out}
    return torch.matmul(x, w.t(), **kw) if bias is None else torch.addmm(bias, x, w.t(), **kw)


class GatherInFlight:
    """A sequence-parallel input all-gather ``[m, K] -> [tp * m, K]`` still in flight, standing for its total.

    ``fprop`` overlaps: this rank's rows ``[rank * m, (rank + 1) * m)`` are computed from the local shard while the
    gather runs, then the other rows from the gathered total, each written into its block of one ``[tp * m, N]``
    output. Anything else reads the total after waiting (``data``, ``t_operand``, :meth:`wait`), so the object can
    stand wherever the total (a :class:`Float8Tensor` or a high-precision tensor) is read.

    Args:
        local: this rank's shard ``[m, K]`` (FP8 with the tp-shared scale, or high precision).
        total: ``[tp * m, K]``, valid once ``finish()`` returned. finish: waits for the gather (and what it records).
        rank, size: this rank's index in the tp group and the group's size.
    """

    __slots__ = ("local", "_total", "_finish", "rank", "size")

    def __init__(self, local, total, finish: Callable[[], None], rank: int, size: int):
        self.local, self._total, self._finish, self.rank, self.size = local, total, finish, rank, size

    def wait(self) -> Union[torch.Tensor, Float8Tensor]:
        """Wait for the gather; the total."""
        if self._finish is not None:
            self._finish()
            self._finish = None
        return self._total

    @property
    def shape(self) -> torch.Size:
        return self._total.shape

    @property
    def data(self) -> torch.Tensor:
        return self.wait().data

    @property
    def scale_inv(self) -> torch.Tensor:
        return self._total.scale_inv

    @property
    def dtype(self) -> torch.dtype:
        return self._total.dtype

    @property
    def kernels(self) -> bool:
        return self._total.kernels

    lacks_transpose = False

    def t_operand(self):
        return self.wait().t_operand()

    def fprop(self, w, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``total @ w.T + bias`` ``[tp * m, N]`` in ``out_dtype`` (``w`` FP8 ``[N, K]``; for a high-precision
        total ``w`` is the weight and ``out_dtype`` the input's dtype), this rank's rows beside the gather."""
        m, rank = self.local.shape[0], self.rank
        rows = m * self.size
        y = torch.empty(rows, w.shape[0], dtype=out_dtype, device=self.local.device)
        part_fprop(self.local, w, out_dtype, bias, y[rank * m:(rank + 1) * m])
        total = self.wait()
        for start, stop in ((0, rank * m), ((rank + 1) * m, rows)):
            if stop > start:
                part_fprop(row_block(total, start, stop), w, out_dtype, bias, y[start:stop])
        return y


class LinearComm(Protocol):
    """What a linear op needs from its tensor-parallel communication (module docstring).

    Attributes:
        gathers_input: column parallel with sequence parallelism: fprop's input is all-gathered along dim 0.
        reduces_output: row parallel: fprop's output is summed over the ranks, the bias added after the sum.
    """

    gathers_input: bool
    reduces_output: bool

    def gather_input(self, x: torch.Tensor, quantizer: Optional[Quantizer], transpose: bool
                     ) -> tuple[Union[torch.Tensor, Float8Tensor], Optional[Union[torch.Tensor, Float8Tensor]]]:
        """All-gather the sequence shard ``x [m, K]`` (high precision, no autograd) along dim 0.

        Returns ``(total, shard)``. ``quantizer`` None: ``total [tp * m, K]`` in ``x.dtype`` and ``shard`` the
        tensor backward re-gathers (``x``). Under FP8: ``total`` the FP8 tensor ``[tp * m, K]`` cast by ``quantizer``
        (the GEMM's input role, per-tensor or block-scaled; delayed scaling records the amax of the whole tensor),
        and either
        ``shard`` the FP8 local shard that backward re-gathers (FP8 all-gather), or ``shard`` None when ``total``
        holds its own transpose (made when ``transpose``) for wgrad."""
        ...

    def regather_input(self, shard: Union[torch.Tensor, Float8Tensor]
                       ) -> Callable[[], Union[torch.Tensor, Float8Tensor]]:
        """Start all-gathering ``shard`` (what :meth:`gather_input` returned) again, asynchronously; the returned
        ``finish()`` waits and gives the ``[tp * m, K]`` total (called after the dgrad GEMM was issued); for an FP8
        shard, anything whose ``t_operand()`` is the total's wgrad operand (a block-scaled shard re-gathers only its
        re-tiled transpose)."""
        ...

    def start_dgrad_comm(self, dx: torch.Tensor) -> tuple[torch.Tensor, Optional[object]]:
        """Start summing the partial dgrad ``dx [M, K]`` over the ranks (column parallel): all-reduce in place, or
        reduce-scatter to a new ``[M / tp, K]`` (sequence parallel). Returns ``(dx, work)``; ``dx`` is valid after
        ``work.wait()`` (``work`` None when nothing was started: row parallel, one rank)."""
        ...

    def fprop_reduce(self, fprop: Callable[..., torch.Tensor], rows: int, n: int, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
        """Row parallel: fprop and :meth:`reduce_output` of its partial ``[rows, n]`` output. ``fprop(start, stop,
        out)`` computes rows ``[start, stop)`` of the partial (into ``out``, a ``[stop - start, n]`` block of
        ``dtype`` on ``device``, when not None; else as a new tensor). An implementation may split the rows to
        overlap the reduction (module docstring); the plain one is ``reduce_output(fprop(0, rows, None))``."""
        ...

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """Row parallel: the sum over the ranks of the partial ``y [M, N]`` (``[M / tp, N]``, sequence parallel),
        synchronously. Column parallel: ``y``."""
        ...

    def gather_output_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """Row parallel with sequence parallelism: all-gather the output gradient ``dy [M / tp, N]`` to
        ``[M, N]``. Otherwise ``dy``."""
        ...
