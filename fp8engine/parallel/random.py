"""RNG for tensor parallelism and activation checkpointing (Megatron-core ``tensor_parallel/random.py``).

No global tracker: an :class:`RNGStatesTracker` is an object passed to the code that forks from it
(:func:`default_rng_tracker` gives one per process for convenience). Works on CPU generators and on CUDA.

Activation checkpointing in two spellings over one implementation: Megatron-core's
``checkpoint(function, distribute_saved_activations, *args)`` and TransformerEngine's
``te_checkpoint(function, *args, **kwargs)``; both replay RNG (tracker included), ``torch.autocast`` and FP8
scaling state in the recompute, so results equal those without checkpointing bit for bit.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Dict, Optional

import torch
import torch.utils.checkpoint

from fp8engine.fp8.autocast import get_fp8_context, recompute_context
from fp8engine.parallel.utils import gather_split_1d_tensor, get_group_size, split_tensor_into_1d_equal_chunks

__all__ = ["RNGStatesTracker", "default_rng_tracker", "model_parallel_manual_seed", "checkpoint", "te_checkpoint",
           "CheckpointWithoutOutput", "MODEL_PARALLEL_RNG", "EXPERT_PARALLEL_RNG"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"


def _device_type(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _generator(device_type: str) -> torch.Generator:
    """The default generator the tracker swaps: the CPU one, or the current CUDA device's."""
    if device_type == "cuda":
        index = torch.cuda.current_device()  # initialises CUDA, which fills default_generators
        return torch.cuda.default_generators[index]
    return torch.default_generator


class RNGStatesTracker:
    """Named RNG states of one device type; :meth:`fork` runs a block with a named state, then restores the
    generator (Megatron-core's ``CudaRNGStatesTracker``, on ``"cpu"`` or ``"cuda"`` generators).

    Forks nest as in Megatron-core: entering a fork saves the progress of the stream that is active (the
    default generator, or the state of an enclosing fork) and leaving it resumes that stream where it stopped.
    A fork of the state that is already active (``with fork(name): ... with fork(name): ...``, e.g. an
    activation-checkpoint recompute inside a fork region) continues the same stream: the draws are those of one
    un-nested stream.

    CUDA graphs: on CUDA each named state is a generator state object of its own (``Generator.clone_state``) and
    a fork swaps the default generator's state object (``graphsafe_set_state``) instead of copying seed and offset
    through the host, so a fork can run inside ``torch.cuda.graph`` capture; register :meth:`graph_states` with
    the graph (``CUDAGraph.register_generator_state``) and each replay advances them as an eager step would
    (Megatron-core's ``use_cudagraphable_rng``, TransformerEngine's graph-safe tracker). On the CPU the states
    are ``uint8`` state tensors copied in and out.

    Args:
        device: the generator to swap: ``"cpu"`` (the default CPU generator), ``"cuda"`` (the current CUDA
            device's) or None (CUDA when available, else CPU).
    """

    def __init__(self, device=None):
        self.device_type = _device_type(device)
        #: graph-safe state objects (CUDA) instead of state tensors (CPU)
        self.graph_safe = self.device_type == "cuda"
        self.states_: Dict[str, torch.Tensor] = {}  # name -> uint8 state (CPU) or torch.Generator state (CUDA)
        self.seeds_: set = set()
        #: the state whose stream the generator holds now (the innermost open fork), None outside forks
        self._active: Optional[str] = None

    def reset(self) -> None:
        """Forget all states and seeds (Megatron's ``reset``)."""
        self.states_, self.seeds_, self._active = {}, set(), None

    def graph_states(self) -> list:
        """The CUDA generator state objects a captured graph must register (empty on the CPU)."""
        return list(self.states_.values()) if self.graph_safe else []

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of ``name -> generator state`` (uint8 tensors). Inside a fork, the active state's entry is the
        generator's live state: where that stream continues."""
        if self.graph_safe:  # the active state object is the live one
            return {k: v.get_state() for k, v in self.states_.items()}
        states = {k: v.clone() for k, v in self.states_.items()}
        if self._active is not None:
            states[self._active] = torch.get_rng_state()  # not graph-safe: the CPU generator
        return states

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the states by copies of ``states`` (as returned by :meth:`get_states`). On CUDA a state
        object that exists is written in place, so a graph that registered it keeps reading it."""
        if not self.graph_safe:
            self.states_ = {k: v.clone() for k, v in states.items()}
            return
        new = {}
        for k, v in states.items():
            new[k] = self.states_[k] if k in self.states_ else _generator("cuda").clone_state()
            new[k].set_state(v.clone())
        self.states_ = new

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` seeded with ``seed`` (the generator's own state is left as it was).

        Raises:
            ValueError: the name or the seed is taken.
        """
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already exists in the tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds_.add(seed)
        gen = _generator(self.device_type)
        saved = gen.get_state()
        gen.manual_seed(seed)
        self.states_[name] = gen.clone_state() if self.graph_safe else gen.get_state()
        gen.set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with generator state ``name``; its advanced state is kept for the next fork, and the
        stream that was active before (default generator or enclosing fork) resumes where it stopped.

        Raises:
            KeyError: ``name`` was never added.
        """
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not in the tracker (has {sorted(self.states_)}); call add() or "
                           "model_parallel_manual_seed() first")
        outer, gen = self._active, _generator(self.device_type)
        if self.graph_safe:  # swap state objects: the outer one (maybe ``name`` itself) keeps its own progress
            saved = gen.graphsafe_get_state()
            gen.graphsafe_set_state(self.states_[name])
        else:  # copy state tensors, storing the enclosing fork's progress first (it may be ``name``)
            saved = gen.get_state()
            if outer is not None:
                self.states_[outer] = saved
            gen.set_state(self.states_[name])
        self._active = name
        try:
            yield
        finally:
            if self.graph_safe:
                gen.graphsafe_set_state(saved)
            else:
                self.states_[name] = gen.get_state()
                gen.set_state(self.states_[outer] if outer is not None else saved)
            self._active = outer


@functools.lru_cache(maxsize=None)
def default_rng_tracker(device_type: Optional[str] = None) -> RNGStatesTracker:
    """One tracker per process and device type, created on first call (a convenience; pass trackers explicitly
    where you can)."""
    return RNGStatesTracker(device_type)


def model_parallel_manual_seed(seed: int, tp_rank: int, tracker: Optional[RNGStatesTracker] = None, *,
                               ep_rank: int = 0, device=None) -> RNGStatesTracker:
    """Seed the tracker's device generator with ``seed`` (the data-parallel seed: identical on the ranks of a tp
    group, for e.g. dropout on replicated activations) and reset ``tracker`` with ``"model-parallel-rng" = seed +
    2718 + tp_rank`` (different per tp rank, for dropout inside tp regions) and ``"expert-parallel-rng" = seed + 1024
    + 100*ep_rank + tp_rank`` (Megatron-core's ``model_parallel_cuda_manual_seed`` and seeds).

    Which generator is seeded with ``seed``: only the one the tracker swaps, as Megatron seeds only the current
    CUDA device's. ``device="cuda"``: the current CUDA device's; the default CPU generator is left alone (call
    ``torch.manual_seed`` yourself to seed it too). ``device="cpu"``: the default CPU generator; CUDA generators are
    left alone.

    Args:
        seed: the data-parallel seed (the same on the ranks of a tp group).
        tp_rank, ep_rank: this rank's tensor- and expert-parallel ranks.
        tracker: the tracker to reset; None: :func:`default_rng_tracker` of the device type.
        device: ``"cpu"``, ``"cuda"`` or None (the tracker's device type; without a tracker, CUDA when
            available).
    Returns:
        the tracker.
    Raises:
        ValueError: ``device`` is not the device type of ``tracker``.
    """
    device_type = tracker.device_type if tracker is not None and device is None else _device_type(device)
    tracker = tracker if tracker is not None else default_rng_tracker(device_type)
    if tracker.device_type != device_type:
        raise ValueError(f"the tracker swaps the {tracker.device_type} generator but device={device!r} "
                         f"({device_type}); pass device={tracker.device_type!r} or a tracker of that device")
    tracker.reset()
    _generator(device_type).manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, seed + 1024 + 100 * ep_rank + tp_rank)
    return tracker


# ---------------------------------------------------------------------------------------------------------------
# Activation checkpointing.

class _RNGSnapshot:
    """CPU, CUDA (when initialised) and tracker states at one moment, and which tracker state was active (the
    innermost open fork), so that a recompute replays draws made inside a fork region exactly."""

    def __init__(self, tracker: Optional[RNGStatesTracker]):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.tracker, self.installed = tracker, None
        if tracker is not None:
            self.states, self.active = tracker.get_states(), tracker._active
            if tracker.graph_safe:  # the CUDA state object installed now (an open fork's), re-installed by restore()
                self.installed = _generator("cuda").graphsafe_get_state()

    def restore(self, generators: bool = True) -> None:
        """Put the states back; ``generators=False``: the tracker's only (the caller restores CPU and CUDA)."""
        if self.installed is not None:
            _generator("cuda").graphsafe_set_state(self.installed)
        if generators:
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda)
        if self.tracker is not None:
            self.tracker.set_states(self.states)
            self.tracker._active = self.active


class _ForwardState:
    """What a checkpoint's recompute replays of the forward: the RNG states, ``torch.autocast``'s state and the
    forward-time scales of the delayed-scaling states the function used (the FP8 region's exit may have updated
    them since). ``torch_state=False``: the tracker's states and the FP8 scales only, for ``torch.utils.checkpoint``,
    which restores the CPU/CUDA generators and ``torch.autocast`` itself."""

    def __init__(self, tracker: Optional[RNGStatesTracker], torch_state: bool = True):
        self.rng, self.torch_state = _RNGSnapshot(tracker), torch_state
        if torch_state:  # torch.autocast on the CPU, and on CUDA when available
            devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
            self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]
            self.autocast_cache = torch.is_autocast_cache_enabled()
        self.fp8_ctx, self.fp8_scales = get_fp8_context(), []

    @contextlib.contextmanager
    def record(self):
        """Run the forward, collecting the scaling states it registers with the FP8 region, and their scales."""
        if self.fp8_ctx is None:
            yield
            return
        with self.fp8_ctx.recording() as used:
            yield
        self.fp8_scales = [(st, st.scale.clone()) for st in used.values()]

    @contextlib.contextmanager
    def replay(self):
        """Run the recompute with the forward's RNG states and FP8 scales, recording no amaxes (each is counted
        once, as in TransformerEngine's checkpoint), then put the current states back."""
        now = _RNGSnapshot(self.rng.tracker)
        self.rng.restore(self.torch_state)
        current = [(st, st.scale.clone()) for st, _ in self.fp8_scales]
        for st, scale in self.fp8_scales:
            st.scale.copy_(scale)
        try:
            with recompute_context(self.fp8_ctx):
                yield
        finally:
            for st, scale in current:
                st.scale.copy_(scale)
            now.restore(self.torch_state)

    def recompute(self, function, *args, **kwargs):
        """``function(*args, **kwargs)`` with grad enabled, under :meth:`replay` and the forward's autocast."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            for device, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))
            stack.enter_context(self.replay())
            return function(*args, **kwargs)


def _detach(args):
    return tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)


class _CheckpointFunction(torch.autograd.Function):
    """Megatron-core's / TransformerEngine's reentrant ``CheckpointFunction``: forward without keeping activations,
    recompute in backward with the forward's RNG states, torch autocast state and FP8 scales."""

    @staticmethod
    def forward(ctx, run_function, distribute, tp_group, tracker, kwargs, *args):
        ctx.run_function, ctx.kwargs, ctx.state = run_function, kwargs, _ForwardState(tracker)
        with torch.no_grad(), ctx.state.record():
            outputs = run_function(*args, **kwargs)
        ctx.distribute, ctx.tp_group = distribute, tp_group
        if distribute:
            # Megatron's distribute_saved_activations: args[0] (the caller's tensor) keeps only this rank's 1-D
            # chunk, in new storage, until backward gathers it back; the full storage is freed with its last user.
            x = args[0]
            ctx.input_0_shape, ctx.input_0 = x.shape, weakref.ref(x)
            x.data = split_tensor_into_1d_equal_chunks(x.data, tp_group, new_buffer=True)
        ctx.arg_is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.non_tensors = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() does not support torch.autograd.grad; use .backward() (or "
                               "te_checkpoint(..., use_reentrant=False))")
        saved = list(ctx.saved_tensors)
        if ctx.distribute:
            full = gather_split_1d_tensor(saved[0].detach(), ctx.tp_group).view(ctx.input_0_shape)
            caller = ctx.input_0()  # the caller's tensor gets its data back, as in Megatron, if it is still alive
            if caller is not None:  # (saved_tensors may be another object, e.g. under saved-tensor hooks)
                caller.data = full
            saved[0] = full.detach().requires_grad_(saved[0].requires_grad)
        saved = iter(saved)
        args = _detach([next(saved) if t else nt for t, nt in zip(ctx.arg_is_tensor, ctx.non_tensors)])
        outputs = ctx.state.recompute(ctx.run_function, *args, **ctx.kwargs)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not pairs:
            raise RuntimeError("checkpoint(): no output of the function requires grad, so there is nothing to "
                               "recompute for; call the function without checkpoint()")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) * 5 + tuple(a.grad if isinstance(a, torch.Tensor) else None for a in args)


def _checkpoint(function, distribute_saved_activations: bool, tracker, tp_group, args, kwargs):
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise ValueError(f"keyword argument {key!r} is a tensor that requires grad: pass it positionally "
                             "(the reentrant checkpoint gives gradients to positional tensors only)")
    # without grad mode no backward comes to gather args[0] back: nothing is distributed (nor saved for backward)
    distribute = distribute_saved_activations and torch.is_grad_enabled()
    if distribute:  # checked before the function runs
        if not args or not isinstance(args[0], torch.Tensor):
            raise ValueError("distribute_saved_activations=True splits the first positional argument, which must "
                             f"be a tensor; got {type(args[0]).__name__ if args else 'no arguments'}")
        x = args[0]
        if x._base is not None:
            raise ValueError("distribute_saved_activations=True replaces the storage of args[0], which is a view "
                             "here (its base would keep the full tensor alive); pass a tensor that is not a view, "
                             "e.g. x.clone()")
        size = get_group_size(tp_group)
        if x.numel() % size != 0:
            raise ValueError(f"distribute_saved_activations=True: args[0].numel()={x.numel()} is not divisible by "
                             f"the tensor-parallel size {size}")
    return _CheckpointFunction.apply(function, distribute, tp_group, tracker, kwargs, *args)


def checkpoint(function, distribute_saved_activations: bool, *args, rng_tracker: Optional[RNGStatesTracker] = None,
               tp_group=None):
    """Megatron-core's ``tensor_parallel.checkpoint(function, distribute_saved_activations, *args)``: run
    ``function(*args)`` without keeping its activations and recompute them in backward, with the forward's RNG
    states (CPU, CUDA, and ``rng_tracker``'s, including which fork was open) and ``torch.autocast`` state restored,
    so dropout masks and dtypes repeat exactly.

    Under :func:`fp8engine.autocast` the recompute uses the FP8 scales of the forward (restored for its duration)
    and records no amaxes, so each amax is counted once (what TransformerEngine's checkpoint does).

    Args:
        function: called as ``function(*args)``; returns a tensor or a tuple of tensors.
        distribute_saved_activations: split the saved ``args[0]`` over ``tp_group`` (Megatron's
            ``CheckpointFunction``): after the forward, ``args[0]`` -- the caller's tensor itself -- holds only this
            rank's ``numel / tp`` elements (1-D, new storage), and the backward all-gathers them and gives it back
            its shape before the recompute. Do not read ``args[0]`` between the call and the backward. Saves
            memory when the ranks of ``tp_group`` hold the same ``args[0]`` (a replicated activation).
        args: the function's positional arguments; gradients flow to those that are tensors requiring grad.
        rng_tracker: the tracker whose states ``function`` forks (None: none).
        tp_group: the tensor-parallel group for ``distribute_saved_activations`` (None: one rank, nothing to
            split; process groups are explicit in fp8engine, where Megatron reads a global).
    Returns:
        what ``function`` returns.
    Raises:
        TypeError: ``distribute_saved_activations`` is not a bool (the pre-Megatron signature
            ``checkpoint(function, *args)``).
        ValueError: with ``distribute_saved_activations``, ``args[0]`` is not a tensor, is a view, or its numel is
            not divisible by the size of ``tp_group``.
        RuntimeError: in backward, under ``torch.autograd.grad`` (use ``.backward()``), or when no output requires
            grad.
    """
    if not isinstance(distribute_saved_activations, bool):
        raise TypeError("checkpoint(function, distribute_saved_activations, *args) takes Megatron's signature: "
                        f"distribute_saved_activations must be a bool, got {type(distribute_saved_activations)}; "
                        "write checkpoint(fn, False, x, ...) for the former checkpoint(fn, x, ...)")
    return _checkpoint(function, distribute_saved_activations, rng_tracker, tp_group, args, {})


def te_checkpoint(function, *args, distribute_saved_activations: bool = False, get_rng_state_tracker=None,
                  tp_group=None, use_reentrant: bool = True, **kwargs):
    """TransformerEngine's ``transformer_engine.pytorch.checkpoint(function, *args, **kwargs)``: :func:`checkpoint`
    of ``function(*args, **kwargs)``, with the same replay of RNG states, ``torch.autocast`` and FP8 scales.

    Args:
        distribute_saved_activations, tp_group: as in :func:`checkpoint` (``tp_group`` None: one rank, where TE
            would take the world group); with ``use_reentrant=False`` ``distribute_saved_activations`` has no
            effect (a warning), as in TE.
        get_rng_state_tracker: a callable returning the :class:`RNGStatesTracker` whose states ``function``
            forks (called once, at the forward), or None.
        use_reentrant: True: the reentrant autograd.Function of :func:`checkpoint` (backward only through
            ``.backward()``). False: ``torch.utils.checkpoint``'s non-reentrant checkpoint (works with
            ``torch.autograd.grad``, keeps the inputs referenced instead of saving them).
        args, kwargs: passed to ``function`` in both runs; gradients flow to the positional tensors requiring grad.
            With ``use_reentrant=True`` keyword tensors requiring grad are refused (they would get no gradient).
    Returns:
        what ``function`` returns.
    Raises:
        ValueError: see :func:`checkpoint`; a keyword tensor requiring grad with ``use_reentrant=True``.
    """
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    if use_reentrant:
        return _checkpoint(function, bool(distribute_saved_activations), tracker, tp_group, args, kwargs)
    if distribute_saved_activations:
        warnings.warn("te_checkpoint: distribute_saved_activations=True has no effect with use_reentrant=False "
                      "(the non-reentrant checkpoint saves no inputs of its own to distribute)", stacklevel=2)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=functools.partial(_non_reentrant_contexts, tracker), **kwargs)


def _non_reentrant_contexts(tracker):
    """``context_fn`` of ``torch.utils.checkpoint`` (which restores CPU/CUDA RNG and autocast for the recompute):
    the forward context records the tracker's states and the FP8 scales, the recompute context replays them."""
    states = []

    @contextlib.contextmanager
    def forward():
        states.append(_ForwardState(tracker, torch_state=False))
        with states[0].record():
            yield

    @contextlib.contextmanager
    def recompute():
        with states[0].replay():
            yield

    return forward(), recompute()


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
    activation whose output is consumed by a following layer that keeps its own copy. The recompute restores
    RNG, ``torch.autocast`` and FP8 state as :func:`checkpoint` does. ``checkpoint(run_function, *args)`` has
    Megatron's signature for this class (no ``distribute_saved_activations``: the inputs are kept whole).

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
        self.run_function, self.state = run_function, _ForwardState(self.rng_tracker)
        with self.state.record():
            outputs = _CheckpointWithoutOutputFunction.apply(run_function, self, *args)
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
        outputs = self.state.recompute(self.run_function, *self.inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        with torch.no_grad():
            for out, new in zip(self.outputs, outputs):
                out.untyped_storage().resize_(new.untyped_storage().size())
                out.untyped_storage().copy_(new.untyped_storage())
        self.recomputed, self.outputs, self.run_function = outputs, None, None
