"""Data-parallel gradient averaging that a CUDA graph can capture.

``torch.nn.parallel.DistributedDataParallel`` averages gradients in buckets launched while the backward runs, but
its reducer keeps host-side state between iterations (bucket rebuilding, ready-order checks, the autograd-engine
callback that finalises a backward), and a whole-step capture of it fails on this platform
(``cudaErrorStreamCaptureInvalidated``, also with ``static_graph=True`` after 11 warm-up steps on a side stream).
:class:`GradientAverager` does the same arithmetic with explicit collectives.

What is averaged: a parameter's gradient is its ``main_grad`` where it has one, else its ``.grad``. Layers built with
``fuse_wgrad_accumulation=True`` (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``; the tensor-parallel layers'
``gradient_accumulation_fusion``) and FP8 primary weights (:func:`fp8engine.fp8_model_init`) add their weight
gradient into an fp32 ``param.main_grad`` and leave ``.grad`` None; as in Megatron-core's DDP (where ``main_grad`` is a
view of its grad buffer) and TransformerEngine, ``main_grad`` is then the gradient that is reduced. A parameter holding
a ``.grad`` besides its ``main_grad`` (other memory) is ambiguous and refused (``ValueError``), not guessed at.

- parameters are grouped into buckets of about ``bucket_mb`` MiB in reverse registration order (the order in
  which a transformer's backward produces their gradients, DDP's heuristic), one bucket dtype at a time: a bucket
  holds only gradients of one dtype (fp32 ``main_grad`` and fp32 ``.grad`` together; bf16 ``.grad`` apart), so its
  flat buffer is that dtype and nothing is averaged in a narrower one; buckets are ordered by the position of
  their last parameter, the point of the backward where they can be complete;
- a post-accumulate-grad hook per parameter counts the gradients ready; when a bucket is complete (and every
  bucket before it has been launched, so all ranks launch in the same order) its gradients are copied into one
  flat buffer and AVG-all-reduced asynchronously (NCCL; other backends divide by the group size and sum): the
  communication overlaps with the rest of the backward, as DDP's does. The hook also fires for a ``main_grad``
  parameter: torch runs a leaf's post-accumulate-grad hooks when autograd reaches its gradient accumulator, also
  with no gradient (the fused layers return None for the weight), and that node runs only after every backward
  feeding the parameter, the ones adding into ``main_grad`` included, so ``main_grad`` is complete then (checked
  for every fp8engine module, with and without FP8, FP8 primary weights, FP8 weight caching and torch.compile);
- :meth:`finish` (after the last backward of a step) launches any bucket a parameter without a hook call held
  back (a ``.grad`` still None counts as zeros, and receives the average; a ``main_grad`` is averaged as it is),
  waits for every all-reduce, makes each ``param.grad`` a view of the averaged buffer (no copy back) and copies
  each averaged ``main_grad`` back into the ``main_grad`` tensor itself (in place: the modules look it up and
  accumulate into it, optimizers such as :class:`fp8engine.training.master_weights.FP8MasterWeights` hold it as a
  master's ``.grad``; one extra pass over those bytes).

Every step issues the same collectives in the same order from the same Python, with no host synchronisation, so
the training command captures the whole step, all-reduces included, in one CUDA graph. During gradient
accumulation the averaging runs once per step: micro-batches inside :meth:`no_sync` only accumulate (DDP's
``no_sync``; the fused layers keep adding into ``main_grad``). The result equals DDP's average (sum of the replicas'
gradients / replicas), up to the summation order of the all-reduce.
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


def _describe(param: torch.Tensor) -> str:
    return f"{tuple(param.shape)} ({param.dtype})"


def _is_fp8(param: torch.Tensor) -> bool:
    """An FP8 parameter (``fp8_model_init``'s primary weights): it cannot hold a gradient, ``main_grad`` does."""
    return param.dtype.is_floating_point and param.dtype.itemsize == 1


def _main_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """``param.main_grad``, or None where the parameter has none (or it is None).

    Raises ValueError when it is not a float32 tensor of the parameter's shape on its device."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        return None
    if not isinstance(main_grad, torch.Tensor):
        raise ValueError(f"GradientAverager: main_grad of the parameter {_describe(param)} must be a tensor; got "
                         f"{type(main_grad).__name__}")
    if main_grad.dtype != torch.float32 or main_grad.shape != param.shape or main_grad.device != param.device:
        raise ValueError(f"GradientAverager: main_grad of the parameter {_describe(param)} must be float32 with the "
                         f"parameter's shape, on its device; got {main_grad.dtype} {tuple(main_grad.shape)} on "
                         f"{main_grad.device}")
    return main_grad


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


def _check_single_gradient(param: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Refuse a parameter with a ``.grad`` besides its ``main_grad`` (``.grad`` being ``main_grad`` itself, the same
    memory, is fine)."""
    grad = param.grad
    if grad is not None and not _same_memory(grad, main_grad):
        raise ValueError(
            f"GradientAverager: the parameter {_describe(param)} has both .grad and .main_grad (separate tensors). "
            "Its gradient is main_grad (fuse_wgrad_accumulation, FP8 primary weights: Megatron's and "
            "TransformerEngine's convention), so averaging it would leave .grad out, or its module wrote .grad "
            "although main_grad exists. Fold .grad in (main_grad.add_(grad); grad = None), make .grad main_grad "
            "itself (param.grad = param.main_grad), or delete main_grad where the module writes .grad")


class GradientAverager:
    """Average the gradients of ``params`` over ``group`` in buckets launched during the backward.

    What is averaged, per parameter ``p`` (module docstring): ``p.main_grad`` where it is a tensor (fp32
    ``[p.shape]``: ``fuse_wgrad_accumulation`` layers and FP8 primary weights write there; ``p.grad`` must then be
    None or ``main_grad`` itself), else ``p.grad`` (``[p.shape]``, ``p``'s dtype; None counts as zeros). After
    :meth:`finish`, ``p.main_grad`` (the same tensor object, overwritten in place) or ``p.grad`` (a view of the
    bucket's averaged buffer) holds the group's mean. Zero ``main_grad`` between steps (``FP8MasterWeights
    .zero_grad`` does), as ``.grad`` is reset: the modules accumulate into it.

    Args:
        params: the parameters whose gradients to average (those with ``requires_grad``); every rank of the group
            passes the same parameters in the same order. A parameter's bucket dtype is fixed here: float32 for
            one that has a ``main_grad`` now or is FP8 (its ``main_grad`` may be allocated later, e.g. by
            ``FP8MasterWeights``), else the parameter's dtype; allocate the ``main_grad`` of other parameters
            before building the averager.
        group: the data-parallel process group (more than one rank).
        bucket_mb: bucket size in MiB of gradient bytes (fp32 for ``main_grad``; a parameter larger than it is a
            bucket of its own). 25 is DDP's default; the training command passes 100: few buckets, whose
            all-reduces still overlap.

    Raises:
        ValueError: no parameter requires grad, or ``bucket_mb`` is not positive, or a ``main_grad`` is not a
            float32 tensor of its parameter's shape on its device (here, at a gradient hook or in :meth:`finish`).
            In the backward's gradient hook or in :meth:`finish`: a parameter with both ``.grad`` and ``main_grad``
            (separate tensors); an FP8 parameter without ``main_grad``; a gradient whose dtype is not its bucket's
            (a ``main_grad`` allocated after the averager for a non-fp32 parameter).
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
        limit = bucket_mb * 2 ** 20
        buckets: list[list[torch.nn.Parameter]] = []
        dtypes: list[torch.dtype] = []
        sizes: list[float] = []
        last: list[int] = []  # position (in reverse registration order) of each bucket's last parameter
        open_bucket: dict[torch.dtype, int] = {}  # the bucket that parameters of a dtype are added to
        for position, p in enumerate(reversed(params)):
            dtype = torch.float32 if _main_grad(p) is not None or _is_fp8(p) else p.dtype
            nbytes = p.numel() * dtype.itemsize
            index = open_bucket.get(dtype)
            if index is None or sizes[index] + nbytes > limit:
                index = open_bucket[dtype] = len(buckets)
                buckets.append([])
                dtypes.append(dtype)
                sizes.append(0)
                last.append(position)
            buckets[index].append(p)
            sizes[index] += nbytes
            last[index] = position
        order = sorted(range(len(buckets)), key=last.__getitem__)
        self.buckets: list[list[torch.nn.Parameter]] = [buckets[i] for i in order]
        #: the dtype each bucket averages in (that of all its gradients)
        self.bucket_dtypes: list[torch.dtype] = [dtypes[i] for i in order]
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._sync = True
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the next bucket to launch (buckets launch in index order on every rank)
        # (bucket index, flat averaged buffer, work, per parameter: its main_grad or None for .grad)
        self._pending: list[tuple[int, torch.Tensor, Optional[object], list[Optional[torch.Tensor]]]] = []

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside accumulate gradients (``.grad`` and ``main_grad``) without averaging them (all but a
        step's last micro-batch)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        main_grad = _main_grad(param)
        if main_grad is not None:  # refused at once, inside no_sync too
            _check_single_gradient(param, main_grad)
        if not self._sync:
            return
        index = self._bucket_of[id(param)]
        self._ready[index] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)
            self._next += 1

    def _gradient(self, param: torch.nn.Parameter, dtype: torch.dtype) -> tuple:
        """``(what to average, main_grad or None)`` for ``param`` in a bucket of ``dtype`` (class docstring)."""
        main_grad = _main_grad(param)
        if main_grad is not None:
            _check_single_gradient(param, main_grad)
            grad = main_grad
        elif _is_fp8(param):
            raise ValueError(f"GradientAverager: the FP8 parameter {_describe(param)} has no main_grad: an FP8 "
                             "primary weight (fp8_model_init) accumulates its gradient in an fp32 main_grad; "
                             "allocate it before the backward (FP8MasterWeights does)")
        else:
            grad = param.grad if param.grad is not None else torch.zeros(param.shape, dtype=dtype,
                                                                          device=param.device)
        if grad.dtype != dtype:
            raise ValueError(
                f"GradientAverager: the parameter {_describe(param)}'s gradient "
                f"({'main_grad' if main_grad is not None else '.grad'}) is {grad.dtype} but its bucket averages "
                f"{dtype}, fixed when the averager was built (float32 for a parameter that had a main_grad then or "
                "is FP8, else the parameter's dtype): build the GradientAverager after allocating main_grad")
        return grad, main_grad

    def _launch(self, index: int) -> None:
        dtype = self.bucket_dtypes[index]
        grads, mains = zip(*(self._gradient(p, dtype) for p in self.buckets[index]))
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self._avg:
            work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        else:
            flat.div_(self.world)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._pending.append((index, flat, work, list(mains)))

    def finish(self) -> None:
        """Average what the last backward left: launch the buckets not launched yet (a ``.grad`` still None counts
        as zeros), wait for every all-reduce, then point each ``param.grad`` at its average (``[param.shape]``,
        the parameter's dtype) and copy each averaged ``main_grad`` into ``param.main_grad`` in place (fp32
        ``[param.shape]``, the same tensor). Errors as in the class docstring; the averager is reset either way."""
        try:
            while self._next < len(self.buckets):
                self._launch(self._next)
                self._next += 1
            for _, _, work, _ in self._pending:
                work.wait()
            for index, flat, _, mains in self._pending:
                offset = 0
                for p, main_grad in zip(self.buckets[index], mains):
                    average = flat[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
                    if main_grad is None:
                        p.grad = average
                    else:
                        _check_single_gradient(p, main_grad)  # a .grad given after the bucket was launched
                        main_grad.copy_(average)
        finally:
            self._reset()

    def remove(self) -> None:
        """Remove the gradient hooks (the averager does nothing after)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
