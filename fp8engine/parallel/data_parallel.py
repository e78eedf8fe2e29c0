"""Data-parallel gradient averaging that a CUDA graph can capture.

``torch.nn.parallel.DistributedDataParallel`` averages gradients in buckets launched while the backward runs, but
its reducer keeps host-side state between iterations (bucket rebuilding, ready-order checks, the autograd-engine
callback that finalises a backward), and a whole-step capture of it fails on this platform
(``cudaErrorStreamCaptureInvalidated``, also with ``static_graph=True`` after 11 warm-up steps on a side stream).
:class:`GradientAverager` does the same arithmetic with explicit collectives:

- parameters are grouped into buckets of about ``bucket_mb`` MiB in reverse registration order (the order in
  which a transformer's backward produces their gradients, DDP's heuristic);
- a post-accumulate-grad hook per parameter counts the gradients ready; when a bucket is complete (and every
  bucket before it has been launched, so all ranks launch in the same order) its gradients are copied into one
  flat buffer and AVG-all-reduced asynchronously (NCCL; other backends divide by the group size and sum): the
  communication overlaps with the rest of the backward, as DDP's does;
- :meth:`finish` (after the last backward of a step) launches any bucket a parameter without a gradient held
  back (its gradient counts as zeros, and receives the average), waits for every all-reduce and makes each
  ``param.grad`` a view of the averaged buffer (no copy back).

Every step issues the same collectives in the same order from the same Python, with no host synchronisation, so
the training command captures the whole step, all-reduces included, in one CUDA graph. During gradient
accumulation the averaging runs once per step: micro-batches inside :meth:`no_sync` only accumulate (DDP's
``no_sync``). The result equals DDP's average (sum of the replicas' gradients / replicas), up to the summation
order of the all-reduce.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch
import torch.distributed as dist

__all__ = ["GradientAverager", "broadcast_parameters"]


def broadcast_parameters(module: torch.nn.Module, group) -> None:
    """Copy the parameters of ``group``'s first rank to its other ranks (what DDP does at construction), so
    replicas start equal even if their initialisations differed. Buffers stay per rank (DDP's
    ``broadcast_buffers=False``): FP8 amax histories hold each rank's own amaxes until the next reduction."""
    src = dist.get_global_rank(group, 0)
    for p in module.parameters():
        dist.broadcast(p.data, src=src, group=group)


class GradientAverager:
    """Average the gradients of ``params`` over ``group`` in buckets launched during the backward.

    Args:
        params: the parameters whose gradients to average (those with ``requires_grad``); every rank of the group
            passes the same parameters in the same order.
        group: the data-parallel process group (more than one rank).
        bucket_mb: bucket size in MiB of gradient bytes (a parameter larger than it is a bucket of its own).
            25 is DDP's default; the training command passes 100: few buckets, whose all-reduces still overlap.

    Raises:
        ValueError: no parameter requires grad, or ``bucket_mb`` is not positive.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group, bucket_mb: float = 25.0):
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("GradientAverager: no parameter requires grad")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive; got {bucket_mb}")
        self.group, self.world = group, dist.get_world_size(group)
        # NCCL averages inside the all-reduce (ReduceOp.AVG, NCCL >= 2.10: a pre-multiplied sum); other backends
        # (gloo) sum a bucket divided by the group size first: one more pass over the bucket.
        self._avg = dist.get_backend(group) == "nccl"
        self.buckets: list[list[torch.nn.Parameter]] = []
        size, limit = 0, bucket_mb * 2 ** 20
        for p in reversed(params):
            if not self.buckets or size + p.numel() * p.element_size() > limit and self.buckets[-1]:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._sync = True
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the next bucket to launch (buckets launch in index order on every rank)
        self._pending: list[tuple[int, torch.Tensor, Optional[object]]] = []

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside accumulate gradients without averaging them (all but a step's last micro-batch)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self._sync:
            return
        index = self._bucket_of[id(param)]
        self._ready[index] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self._avg:
            work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        else:
            flat.div_(self.world)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._pending.append((index, flat, work))

    def finish(self) -> None:
        """Average what the last backward left: launch the buckets not launched yet (a parameter without a
        gradient counts as zeros), wait for every all-reduce, and point each ``param.grad`` at its average
        (``[param.shape]``, the parameter's dtype)."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        for index, flat, work in self._pending:
            work.wait()
            offset = 0
            for p in self.buckets[index]:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self._reset()

    def remove(self) -> None:
        """Remove the gradient hooks (the averager does nothing after)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
