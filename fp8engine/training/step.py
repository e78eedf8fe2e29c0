"""The training command's optimizer step: eager, or captured once in a CUDA graph and replayed.

One step = ``grad_accum`` micro-batches of forward (inside the precision context: ``torch.autocast`` and the FP8
region, whose exit runs the delayed-scaling update) and backward, gradient clipping to a global norm, the AdamW
step, and zeroed gradients. :class:`TrainStep` runs it eagerly; :class:`CUDAGraphStep` runs its first
``warmup`` steps eagerly (on a side stream: kernels compile, the FP8 amax histories take the recipe's length, the
optimizer state is allocated), then captures the whole step in one ``torch.cuda.CUDAGraph`` and replays it, so the
step costs one graph launch of host time instead of thousands of Python-dispatched kernels.

What stays exact under capture: the captured kernels are the eager ones, reading and writing the same parameter,
optimizer-state and FP8-buffer memory in place (amax histories, scales, the delayed-scaling update of every
``fp8_autocast`` exit, the FP8 weight cache of ``is_first_microbatch``); the learning rate is a device tensor the
optimizer reads (``AdamW(lr=tensor, fused=True)``), filled before each replay; dropout draws from the default CUDA
generator, whose offset a replay advances as the eager step would. Graphed and eager runs of the same seed log
the same losses (``tests/test_train_cuda.py``).

Multi-process runs are captured too: the tensor- and sequence-parallel collectives, the FP8 amax all-reduce at
each ``fp8_autocast`` exit, the data-parallel gradient average
(:class:`~fp8engine.parallel.data_parallel.GradientAverager`: bucketed all-reduces launched from gradient hooks
during the backward, in place of DDP's reducer) and the gradient-norm all-reduce are NCCL kernels on the captured
streams, replayed in the same order on every rank. The tensor-parallel RNG tracker's states are graph-safe
generator states the graph registers (``graph_generators``), so dropout in tensor-parallel regions draws what
the eager step draws.

What it needs: static shapes (batch, sequence length, micro-batch count), parameters that keep their storage,
CUDA (NCCL). ``capture_problem`` says in one line why a run cannot be captured; the training command prints it
and runs eagerly.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from fp8engine.training.guard import NonFiniteGuard

__all__ = ["TrainStep", "CUDAGraphStep", "capture_problem", "graph_warmup", "make_optimizer", "set_lr"]


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device
                   ) -> torch.optim.AdamW:
    """AdamW (betas 0.9/0.95, eps 1e-8), weight decay on matrices only.

    On CUDA the fused implementation with a device-tensor learning rate: one kernel per step, no host
    synchronisation, capturable in a CUDA graph; the eager and graphed steps use it alike, so their losses match
    bit for bit. With FSDP2-sharded (``DTensor``) parameters, which run eagerly, the fused implementation with a float
    learning rate, as torchtitan's: DTensor derives an op's output metadata by running it on fake tensors, and the
    tensor-learning-rate overload (``aten._fused_adamw_.tensor_lr``) has no fake kernel (torch 2.11-2.13), so its
    first step ran on real copies of every shard and state (an 8B model over 4 GPUs: no first step in 75 s). On the
    CPU the default (foreach) implementation with a float learning rate.
    """
    from fp8engine.parallel.fsdp import is_sharded

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if device.type == "cuda" and any(is_sharded(p) for p in model.parameters()):
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    if device.type == "cuda":
        return torch.optim.AdamW(groups, lr=torch.tensor(lr, dtype=torch.float32, device=device),
                                 betas=(0.9, 0.95), eps=1e-8, fused=True, capturable=True)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate: in place where it is a device tensor (a captured step reads it there).

    A tensor learning rate that is not on its parameters' device (``optimizer.load_state_dict`` of a checkpoint
    loaded with ``map_location="cpu"`` puts it on the CPU) is replaced by one on that device: the fused AdamW reads
    a CPU learning rate as a host scalar, which a CUDA graph would freeze at its capture-time value. FSDP2-sharded
    parameters get a float (:func:`make_optimizer`; also when a checkpoint loaded a tensor one).
    """
    from fp8engine.parallel.fsdp import is_sharded

    for group in optimizer.param_groups:
        current = group["lr"]
        if not isinstance(current, torch.Tensor) or is_sharded(group["params"][0]):
            group["lr"] = lr
        elif current.device != group["params"][0].device:
            group["lr"] = torch.tensor(lr, dtype=torch.float32, device=group["params"][0].device)
        else:
            current.fill_(lr)


def capture_problem(device: torch.device, compile_: bool) -> Optional[str]:
    """Why the training step cannot be captured in a CUDA graph here (one line), or None when it can.

    A ``torch.compile``'d model (``compile_``) is captured too: its Inductor kernels and our custom ops run on
    static buffers like the eager ones (what ``mode="reduce-overhead"`` does per graph, here for the whole step);
    :func:`graph_warmup` gives it the extra eager step its re-trace needs."""
    if device.type != "cuda":
        return "CUDA graphs need --device cuda"
    return None


def graph_warmup(compile_: bool) -> int:
    """Eager steps before :class:`CUDAGraphStep` captures: 2 (kernels compile, the amax histories take the recipe's
    length, the optimizer state exists); 3 under ``--compile``: Dynamo traces in step 1 and re-traces once in step 2
    (the history resized in step 1's graph changes a buffer shape it guards on), and nothing may compile while a
    graph is captured."""
    return 3 if compile_ else 2


class TrainStep:
    """One eager optimizer step.

    Args:
        step_model: the module called as ``step_model(x, y, is_first_microbatch=...)`` returning the mean loss
            (fp32 scalar); may be a DDP wrapper (``no_sync`` is used on all but the last micro-batch).
        params: the parameters to clip and step (the unwrapped model's).
        optimizer: from :func:`make_optimizer`.
        precision_context: ``() -> context manager`` entered around each micro-batch's forward.
        grad_accum: micro-batches per step (>= 1).
        clip: ``(params) -> norm`` clipping gradients in place (may all-reduce over tensor parallel ranks); the
            norm is returned as a tensor (no host synchronisation).
        after_backward: called after the last backward and before clipping (sequence-parallel gradient
            all-reduce), or None.
        grad_averager: a :class:`~fp8engine.parallel.data_parallel.GradientAverager` of the data-parallel
            replicas, or None: micro-batches but the last run in its ``no_sync``, and its ``finish`` runs after
            the last backward (before ``after_backward``).
        guard: a :class:`~fp8engine.training.guard.NonFiniteGuard` of the model, or None (no check): a step whose
            loss or gradient norm is not finite then leaves weights, optimizer state and FP8 buffers unchanged,
            and ``found_inf`` (float32 device scalar, 0/1) says so after each call.
    ``__call__(xs, ys, eager=False)`` takes ``[grad_accum, b, s]`` int64 token and target ids (any device) and
    returns the mean loss over the micro-batches as a device scalar (this process's share; the caller reduces over
    data parallel). ``eager`` asks for a step run op by op (always so here; see :class:`CUDAGraphStep`).
    """

    def __init__(self, step_model: torch.nn.Module, params: list, optimizer: torch.optim.Optimizer,
                 precision_context: Callable[[], contextlib.AbstractContextManager], grad_accum: int,
                 clip: Callable[[list], torch.Tensor], after_backward: Optional[Callable[[], None]] = None,
                 device: Optional[torch.device] = None, guard: Optional[NonFiniteGuard] = None,
                 grad_averager=None):
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1; got {grad_accum}")
        self.step_model, self.params, self.optimizer = step_model, list(params), optimizer
        self.precision_context, self.grad_accum = precision_context, grad_accum
        self.clip, self.after_backward = clip, after_backward
        self.device = device if device is not None else self.params[0].device
        self.grad_norm: Optional[torch.Tensor] = None
        self.guard = guard
        self.grad_averager = grad_averager

    @property
    def found_inf(self) -> Optional[torch.Tensor]:
        """1.0 when the last step was skipped as non-finite (device scalar; None without a guard)."""
        return None if self.guard is None else self.guard.found_inf

    def _step(self, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        if self.guard is not None:
            self.guard.snapshot()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro in range(self.grad_accum):
            first = None if self.grad_accum == 1 else micro == 0
            last = micro == self.grad_accum - 1
            no_sync = getattr(self.grad_averager or self.step_model, "no_sync", None)
            sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
            with sync:
                with self.precision_context():
                    loss = self.step_model(xs[micro], ys[micro], is_first_microbatch=first)
                (loss / self.grad_accum).backward()
            total += loss.detach().float()
        if self.grad_averager is not None:
            self.grad_averager.finish()
        if self.after_backward is not None:
            self.after_backward()
        self.grad_norm = self.clip(self.params)
        mean = total / self.grad_accum
        if self.guard is None:
            self.optimizer.step()
        else:
            self.guard.check(mean, self.grad_norm)
            self.guard.optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.guard is not None:
            self.guard.restore_if_found()
        return mean

    def __call__(self, xs: torch.Tensor, ys: torch.Tensor, eager: bool = False) -> torch.Tensor:
        return self._step(xs.to(self.device, non_blocking=True), ys.to(self.device, non_blocking=True))


class CUDAGraphStep(TrainStep):
    """:class:`TrainStep` captured in one CUDA graph after ``warmup`` eager steps, then replayed.

    Same arguments as :class:`TrainStep` (a ``step_model`` that is not a DDP wrapper: use ``grad_averager``),
    plus ``warmup`` (>= 1) eager steps before the capture and ``graph_generators``: generator states besides the
    default CUDA generator's that the step draws from (:meth:`fp8engine.parallel.RNGStatesTracker.graph_states`),
    registered with the graph so each replay advances them. Inputs are copied into static device buffers; the
    returned loss is a static device tensor overwritten by the next call (read it before calling again).
    ``__call__(xs, ys, eager=True)`` runs that one step eagerly, outside the graph, on the same parameters,
    optimizer state and FP8 buffers (work whose host-side switches a replay would not see, e.g. FP8 stats
    recording, :func:`fp8engine.fp8.stats.fp8_stats_recording`); the replays before and after are unaffected.

    Raises:
        ValueError: not on CUDA, ``warmup < 1``, or a later call with other shapes than the captured ones.
    """

    def __init__(self, *args, warmup: int = 2, graph_generators=(), **kwargs):
        super().__init__(*args, **kwargs)
        if self.device.type != "cuda":
            raise ValueError(f"CUDAGraphStep needs CUDA parameters; got {self.device}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the optimizer state must exist before capture); got {warmup}")
        if isinstance(self.step_model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("CUDAGraphStep cannot capture DistributedDataParallel's reducer; pass the model and a "
                             "fp8engine.parallel.data_parallel.GradientAverager as grad_averager")
        self.warmup, self.steps_done = warmup, 0
        self.graph_generators = list(graph_generators)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._xs = self._ys = self._loss = None
        # the grad norm and the guard's flag that the graph writes (an eager step in between rebinds both)
        self._graph_outputs: Optional[tuple] = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _load(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        if self._xs is None:
            self._xs = torch.empty(xs.shape, dtype=xs.dtype, device=self.device)
            self._ys = torch.empty(ys.shape, dtype=ys.dtype, device=self.device)
        if xs.shape != self._xs.shape or ys.shape != self._ys.shape:
            raise ValueError(f"CUDAGraphStep was set up for batches {tuple(self._xs.shape)}; got {tuple(xs.shape)} "
                             "(a captured step needs static shapes)")
        self._xs.copy_(xs, non_blocking=True)
        self._ys.copy_(ys, non_blocking=True)

    def __call__(self, xs: torch.Tensor, ys: torch.Tensor, eager: bool = False) -> torch.Tensor:
        self._load(xs, ys)
        if eager and self.steps_done >= self.warmup:
            self.steps_done += 1
            return self._step(self._xs, self._ys)  # rebinds grad_norm and guard.found_inf to its own tensors
        if self.steps_done < self.warmup:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                loss = self._step(self._xs, self._ys)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.steps_done += 1
            return loss
        if self.graph is None:
            self._capture()
        self.grad_norm, found_inf = self._graph_outputs
        if self.guard is not None:
            self.guard.found_inf = found_inf
        self.graph.replay()
        self.steps_done += 1
        return self._loss

    def _capture(self) -> None:
        for group in self.optimizer.param_groups:
            lr = group["lr"]
            # the device of the step's parameters ("cuda" and "cuda:0" name one device: compare the params')
            on = group["params"][0].device if group["params"] else self.device
            if not (isinstance(lr, torch.Tensor) and lr.device == on):
                raise ValueError(f"CUDAGraphStep needs each learning rate as a tensor on {self.device} (a host value "
                                 f"would be frozen into the graph); got {lr!r}: set it with set_lr")
        torch.cuda.synchronize(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        for state in self.graph_generators:
            graph.register_generator_state(state)
        with torch.cuda.graph(graph):
            self._loss = self._step(self._xs, self._ys)
        self.graph = graph
        self._graph_outputs = (self.grad_norm, None if self.guard is None else self.guard.found_inf)
