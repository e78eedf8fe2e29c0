"""Data-parallel gradient averaging that a CUDA graph can capture.

``torch.nn.parallel.DistributedDataParallel``'s reducer keeps host-side state between iterations (bucket
rebuilding, ready-order checks, the autograd-engine callback that finalises a backward), and a whole-step capture of
it fails on this platform (``cudaErrorStreamCaptureInvalidated``, also with ``static_graph=True`` after 11 warm-up
steps on a side stream). :class:`GradientAverager` does the same arithmetic with explicit collectives:

- parameters are grouped into buckets of about ``bucket_mb`` MiB in reverse registration order (the order in
  which a transformer's backward produces their gradients, DDP's heuristic); a bucket holds gradients of one dtype
  (fp32 ``main_grad`` and fp32 ``.grad`` together; bf16 ``.grad`` apart), so nothing is averaged in a narrower one;
  buckets are ordered by the position of their last parameter, the point of the backward where they can be
  complete;
- a post-accumulate-grad hook per parameter counts the gradients ready; when a bucket is complete (and every
  bucket before it has been launched, so all ranks launch in the same order) its gradients are copied into one
  flat buffer and AVG-all-reduced asynchronously, overlapping the rest of the backward as DDP's do. The hook also
  fires for a ``main_grad`` parameter: torch runs a leaf's post-accumulate-grad hooks when autograd reaches its
  gradient accumulator, also with no gradient (the fused layers return None for the weight), and that node runs
  only after every backward feeding the parameter, the ones adding into ``main_grad`` included, so ``main_grad`` is
  complete then (checked for every fp8engine module, with and without FP8, FP8 primary weights, FP8 weight caching
  and torch.compile). :meth:`GradientAverager.finish`, after a step's last backward, does the rest.

Every step issues the same collectives in the same order from the same Python, with no host synchronisation, so
the training command captures the whole step, all-reduces included, in one CUDA graph. Micro-batches inside
:meth:`GradientAverager.no_sync` only accumulate (DDP's ``no_sync``). The result equals DDP's average (sum of the
replicas' gradients / replicas), up to the summation order of the all-reduce.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
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

    What is averaged, per parameter ``p``: ``p.main_grad`` where it is a tensor (fp32 ``[p.shape]``: layers built
    with ``fuse_wgrad_accumulation=True`` or ``gradient_accumulation_fusion`` and FP8 primary weights
    (:func:`fp8engine.fp8_model_init`) add their weight gradient there and leave ``.grad`` None; Megatron-core's DDP
    and TransformerEngine reduce it too), else ``p.grad`` (``[p.shape]``, ``p``'s dtype; None counts as zeros). A
    ``.grad`` besides the ``main_grad`` (other memory) is ambiguous and refused, not guessed at. After
    :meth:`finish`, ``p.main_grad`` (the same tensor object, overwritten in place: the modules accumulate into it,
    optimizers such as :class:`fp8engine.training.master_weights.FP8MasterWeights` hold it as a master's ``.grad``)
    or ``p.grad`` (a view of the bucket's averaged buffer) holds the group's mean. Zero ``main_grad`` between steps
    (``FP8MasterWeights.zero_grad`` does), as ``.grad`` is reset.

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
        limit, buckets = bucket_mb * 2 ** 20, []
        open_bucket: dict[torch.dtype, SimpleNamespace] = {}  # the bucket that parameters of a dtype are added to
        for position, p in enumerate(reversed(params)):
            dtype = torch.float32 if _main_grad(p) is not None or _is_fp8(p) else p.dtype
            nbytes = p.numel() * dtype.itemsize
            bucket = open_bucket.get(dtype)
            if bucket is None or bucket.nbytes + nbytes > limit:
                bucket = open_bucket[dtype] = SimpleNamespace(dtype=dtype, nbytes=0, params=[])
                buckets.append(bucket)
            bucket.params.append(p)
            bucket.nbytes += nbytes
            bucket.last = position  # in reverse registration order
        buckets.sort(key=lambda b: b.last)
        self.buckets: list[list[torch.nn.Parameter]] = [b.params for b in buckets]
        #: the dtype each bucket averages in (that of all its gradients)
        self.bucket_dtypes: list[torch.dtype] = [b.dtype for b in buckets]
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
            self._launch_next()

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

    def _launch_next(self) -> None:
        """All-reduce bucket ``self._next`` asynchronously and advance ``self._next``."""
        index = self._next
        dtype = self.bucket_dtypes[index]
        grads, mains = zip(*(self._gradient(p, dtype) for p in self.buckets[index]))
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self._avg:
            work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        else:
            flat.div_(self.world)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._pending.append((index, flat, work, list(mains)))
        self._next += 1

    def finish(self) -> None:
        """Average what the last backward left: launch the buckets not launched yet, wait for every all-reduce and
        write the averages to ``.grad`` / ``main_grad`` (class docstring). The averager is reset, also on errors."""
        try:
            while self._next < len(self.buckets):
                self._launch_next()
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
