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
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Union

import torch

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import Quantizer

__all__ = ["LinearComm"]


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
        """All-gather the sequence shard ``x [m, K]`` (high precision, no autograd) along dim 0: ``(total, shard)``.

        ``quantizer`` None: ``total [tp * m, K]`` in ``x.dtype``, ``shard`` = ``x`` (what backward re-gathers).
        Under FP8: ``total`` the FP8 ``[tp * m, K]`` cast by ``quantizer`` (delayed scaling records the whole
        tensor's amax), and ``shard`` the FP8 local shard that backward re-gathers, or None when ``total`` holds
        its own transpose (made when ``transpose``) for wgrad."""
        ...

    def regather_input(self, shard: Union[torch.Tensor, Float8Tensor]
                       ) -> Callable[[], Union[torch.Tensor, Float8Tensor]]:
        """Start all-gathering ``shard`` (from :meth:`gather_input`) again, asynchronously; the returned ``finish()``
        waits and gives the ``[tp * m, K]`` total (for an FP8 shard: anything whose ``t_operand()`` is the total's
        wgrad operand)."""
        ...

    def start_dgrad_comm(self, dx: torch.Tensor) -> tuple[torch.Tensor, Optional[object]]:
        """Start summing the partial dgrad ``dx [M, K]`` over the ranks (column parallel): all-reduce in place, or
        reduce-scatter to a new ``[M / tp, K]`` (sequence parallel). Returns ``(dx, work)``; ``dx`` is valid after
        ``work.wait()`` (``work`` None when nothing was started: row parallel, one rank)."""
        ...

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """Row parallel: the sum over the ranks of the partial ``y [M, N]`` (``[M / tp, N]``, sequence parallel),
        synchronously. Column parallel: ``y``."""
        ...

    def gather_output_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """Row parallel with sequence parallelism: all-gather ``dy [M / tp, N]`` to ``[M, N]``. Otherwise ``dy``."""
        ...
