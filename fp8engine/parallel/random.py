"""RNG for tensor parallelism and activation checkpointing (Megatron-core ``tensor_parallel/random.py``).

No global tracker: an :class:`RNGStatesTracker` is an object passed to the code that forks from it
(:func:`default_rng_tracker` gives one per process for convenience). Works on CPU generators and on CUDA.

Seeds (Megatron's): data-parallel seed = ``seed`` (the default generator: identical on the ranks of a tp group,
for e.g. dropout on replicated activations); tensor-parallel seed = ``seed + 2718 + tp_rank`` (the
``"model-parallel-rng"`` state: different per tp rank, for dropout inside tp regions); expert-parallel seed =
``seed + 1024 + 100 * ep_rank + tp_rank``.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Dict, Optional

import torch

from fp8engine.fp8.autocast import get_fp8_context, recompute_context

__all__ = ["RNGStatesTracker", "default_rng_tracker", "model_parallel_manual_seed", "checkpoint",
           "CheckpointWithoutOutput", "MODEL_PARALLEL_RNG", "EXPERT_PARALLEL_RNG"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"


def _device_type(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states of one device type; :meth:`fork` runs a block with a named state, then restores the
    default generator (Megatron's ``CudaRNGStatesTracker``, on ``"cpu"`` or ``"cuda"`` generators).

    Args:
        device: the generator to swap: ``"cpu"``, ``"cuda"`` (the current CUDA device's) or None (CUDA when
            available, else CPU).
    """

    def __init__(self, device=None):
        self.device_type = _device_type(device)
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of ``name -> generator state``."""
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` seeded with ``seed``. Raises ``ValueError`` if the name or seed is taken."""
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already exists in the tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds_.add(seed)
        saved = _get_state(self.device_type)
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)  # seeds the CPU generator (and CUDA ones, restored below if in use)
        self.states_[name] = _get_state(self.device_type)
        _set_state(self.device_type, saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with generator state ``name``; its advanced state is kept for the next fork.

        Raises:
            KeyError: ``name`` was never added.
        """
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not in the tracker (has {sorted(self.states_)}); call add() or "
                           "model_parallel_manual_seed() first")
        saved = _get_state(self.device_type)
        _set_state(self.device_type, self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state(self.device_type)
            _set_state(self.device_type, saved)


@functools.lru_cache(maxsize=None)
def default_rng_tracker(device_type: Optional[str] = None) -> RNGStatesTracker:
    """One tracker per process and device type, created on first call (a convenience; pass trackers explicitly
    where you can)."""
    return RNGStatesTracker(device_type)


def model_parallel_manual_seed(seed: int, tp_rank: int, tracker: Optional[RNGStatesTracker] = None, *,
                               ep_rank: int = 0, device=None) -> RNGStatesTracker:
    """Seed the default generator with ``seed`` (data-parallel seed) and reset ``tracker`` with
    ``"model-parallel-rng" = seed + 2718 + tp_rank`` and ``"expert-parallel-rng" = seed + 1024 + 100*ep_rank +
    tp_rank`` (Megatron's ``model_parallel_cuda_manual_seed``). Returns the tracker (``default_rng_tracker`` of
    the device type when None)."""
    device_type = _device_type(device)
    tracker = tracker if tracker is not None else default_rng_tracker(device_type)
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
    torch.manual_seed(seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, seed + 1024 + 100 * ep_rank + tp_rank)
    return tracker


# ---------------------------------------------------------------------------------------------------------------
# Activation checkpointing.

class _RNGSnapshot:
    """CPU, CUDA (when initialised) and tracker states at one moment."""

    def __init__(self, tracker: Optional[RNGStatesTracker]):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.tracker = tracker.get_states() if tracker is not None else None
        self._tracker = tracker

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        if self._tracker is not None:
            self._tracker.set_states(self.tracker)


@contextlib.contextmanager
def _record_fp8_states(ctx):
    """Collect the scaling states a checkpointed function registers with the FP8 region ``ctx``."""
    if ctx is None:
        yield None
        return
    with ctx.recording() as used:
        yield used


class _FP8Recompute:
    """Forward-time scales of the delayed-scaling states a checkpointed function used; the recompute runs with
    them (the region's exit may have updated the scales since) and without recording amaxes."""

    def __init__(self, ctx, used: Optional[dict]):
        self.ctx = ctx
        self.scales = [(st, st.scale.clone()) for st in (used or {}).values()]

    @contextlib.contextmanager
    def __call__(self):
        current = [(st, st.scale.clone()) for st, _ in self.scales]
        for st, scale in self.scales:
            st.scale.copy_(scale)
        try:
            with recompute_context(self.ctx):
                yield
        finally:
            for st, scale in current:
                st.scale.copy_(scale)


def _detach(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            d = a.detach()
            d.requires_grad_(a.requires_grad)
            out.append(d)
        else:
            out.append(a)
    return tuple(out)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, tracker, *args):
        ctx.run_function, ctx.rng = run_function, _RNGSnapshot(tracker)
        fp8_ctx = get_fp8_context()
        with torch.no_grad(), _record_fp8_states(fp8_ctx) as used:
            outputs = run_function(*args)
        ctx.fp8 = _FP8Recompute(fp8_ctx, used)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.arg_is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.non_tensors = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() does not support torch.autograd.grad; use .backward()")
        saved = iter(ctx.saved_tensors)
        args = _detach([next(saved) if t else nt for t, nt in zip(ctx.arg_is_tensor, ctx.non_tensors)])
        now = _RNGSnapshot(ctx.rng._tracker)
        ctx.rng.restore()
        try:
            with torch.enable_grad(), ctx.fp8():
                outputs = ctx.run_function(*args)
        finally:
            now.restore()
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(a.grad if isinstance(a, torch.Tensor) else None for a in args)


def checkpoint(function, *args, rng_tracker: Optional[RNGStatesTracker] = None):
    """Run ``function(*args)`` without keeping its activations; recompute them in backward with the forward's
    RNG states (CPU, CUDA and ``rng_tracker``'s) restored, so dropout masks repeat exactly.

    Under :func:`fp8engine.autocast` the recompute uses the FP8 scales of the forward (restored for its duration)
    and records no amaxes, so each amax is counted once. Returns what ``function`` returns (tensors).
    """
    return _CheckpointFunction.apply(function, rng_tracker, *args)


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, owner, *args):
        with torch.no_grad():
            outputs = run_function(*args)
        owner.inputs = _detach(args)
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        owner = ctx.owner
        outputs = owner.recomputed
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads_in = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in owner.inputs)
        owner.inputs = owner.recomputed = None
        return (None, None) + grads_in


class CheckpointWithoutOutput:
    """Checkpoint whose *outputs* are freed too (Megatron's ``CheckpointWithoutOutput``): typical for a norm or
    activation whose output is consumed by a following layer that keeps its own copy.

    Usage::

        ckpt = CheckpointWithoutOutput(rng_tracker=tracker)
        h = ckpt.checkpoint(norm, x)           # h: no storage kept after discard
        y = linear(h)
        ckpt.discard_output_and_register_recompute(y)  # h is recomputed when y's gradient arrives
    """

    def __init__(self, rng_tracker: Optional[RNGStatesTracker] = None):
        self.rng_tracker = rng_tracker
        self.inputs = self.recomputed = self.ctx = self.outputs = None

    def checkpoint(self, run_function, *args):
        self.run_function = run_function
        self.rng = _RNGSnapshot(self.rng_tracker)
        fp8_ctx = get_fp8_context()
        with _record_fp8_states(fp8_ctx) as used:
            outputs = _CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.fp8 = _FP8Recompute(fp8_ctx, used)
        self.ctx.owner = self
        self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage now; recompute them when ``hook_tensor``'s gradient is computed."""
        for out in self.outputs:
            out.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad) -> None:
        now = _RNGSnapshot(self.rng_tracker)
        self.rng.restore()
        try:
            with torch.enable_grad(), self.fp8():
                outputs = self.run_function(*self.inputs)
        finally:
            now.restore()
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        with torch.no_grad():
            for out, new in zip(self.outputs, outputs):
                out.untyped_storage().resize_(new.untyped_storage().size())
                out.untyped_storage().copy_(new.untyped_storage())
        self.recomputed, self.outputs, self.run_function = outputs, None, None
