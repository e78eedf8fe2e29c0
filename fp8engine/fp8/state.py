"""Per-module FP8 scaling state, kept as buffers so ``state_dict``, ``.to()``, DDP and checkpoints carry it."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from fp8engine.fp8.scaling import update_amax_history, update_fp8_scale
from fp8engine.recipe import DelayedScaling

__all__ = ["ScalingState", "reduce_and_update"]


class ScalingState(nn.Module):
    """Amax histories and scales of the FP8 tensors one module casts (e.g. input, weight, grad_output).

    Buffers:
        amax_history: ``[n, L]`` float32, row ``i`` for ``roles[i]``, column 0 = the current step's amax
            (max-accumulated by every cast of that tensor until the next update).
        scale: ``[n]`` float32, initially 1.0; multiply by it to enter the FP8 range.
        update_step: ``[]`` int64, how many updates ran (drives ``DelayedScaling.interval``).
        grad_amax: ``[n]`` float32, not persistent: where a ``torch.compile``-d backward max-accumulates the
            gradients' amaxes (eager backward writes ``amax_history[:, 0]`` directly); folded into
            ``amax_history[:, 0]`` and zeroed by :func:`reduce_and_update`. See :mod:`fp8engine.fp8.library`.

    The buffers keep these dtypes under any dtype cast of the model (``.to(torch.bfloat16)``, ``.half()``): such a
    cast moves them to its device, if any, and converts nothing (:meth:`_apply`).

    Args:
        roles: one name per FP8 tensor; a role ending in ``"grad_output"`` or ``"grad"`` uses the recipe's
            backward format (E5M2 under ``Format.HYBRID``), the others the forward format.
        amax_history_len: initial ``L``; re-sized (keeping the newest entries) to the active recipe's length on
            first use, and to a loaded checkpoint's length by ``load_state_dict``.
    """

    def __init__(self, roles: Sequence[str], amax_history_len: int = 1024, device=None):
        super().__init__()
        self.roles = tuple(roles)
        n = len(self.roles)
        self.register_buffer("amax_history", torch.zeros(n, amax_history_len, dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer("update_step", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("grad_amax", torch.zeros(n, dtype=torch.float32, device=device), persistent=False)
        #: set (while tracing) when a torch.compile-d backward records into ``grad_amax``: only such states pay the
        #: fold before each update (fp8engine.fp8.library.fold_grad_amax)
        self.compiled_backward = False
        #: set (while tracing) when a torch.compile-d forward re-sized the history: the new buffer is then an output
        #: of the compiled graph, memory that ``mode="reduce-overhead"`` (CUDA graphs) reuses on its next replay;
        #: the next update copies it out first (:func:`reduce_and_update`)
        self.history_from_graph = False
        self.kernels = False  #: its quantizers' backend (fp8.quantizer.get_quantizers), which its update runs too
        #: True when eager code registers this state with each FP8 region before a compiled forward uses it
        #: (fp8engine.train's per-layer compile under FSDP2): the traced code then leaves the region's registry alone,
        #: whose per-state keys would make Dynamo guard on each layer's state and recompile every layer
        self.registered_outside_graph = False
        self._fp8_max_cache: dict = {}
        self._quantizers: dict = {}  #: the quantizer cache of fp8.quantizer.get_quantizers
        #: FP8 health counters (fp8.stats.StatsCounters; not buffers), whether quantizers built now count into them,
        #: and the quantizer cache of the other mode (swapped with ``_quantizers``); set by fp8engine.fp8.stats
        self.stats_counters = None
        self.stats_recording = False
        self._other_quantizers: dict = {}

    def index(self, role: str) -> int:
        return self.roles.index(role)

    def is_grad(self, i: int) -> bool:
        return self.roles[i].endswith("grad") or self.roles[i].endswith("grad_output")

    def fp8_max(self, recipe) -> torch.Tensor:
        """``[n]`` float32 per-row FP8 maxima under ``recipe``'s format (cached per format and device)."""
        key = (recipe.fp8_format, self.scale.device)
        value = self._fp8_max_cache.get(key)
        if value is None:
            fmt = recipe.fp8_format
            value = torch.tensor([fmt.bwd_max if self.is_grad(i) else fmt.fwd_max for i in range(len(self.roles))],
                                 dtype=torch.float32, device=self.scale.device)
            self._fp8_max_cache[key] = value
        return value

    def resize_history(self, length: int) -> None:
        """Change ``L`` keeping entries ``[:, :min(L, old)]`` (index 0 = current step)."""
        old = self.amax_history
        if old.shape[1] == length:
            return
        new = torch.zeros(old.shape[0], length, dtype=old.dtype, device=old.device)
        k = min(length, old.shape[1])
        new[:, :k] = old[:, :k]
        self.amax_history = new

    def _apply(self, fn, recurse=True):
        """``nn.Module.to`` / ``.cuda()`` / ``.half()`` / ``to_empty(device=)`` / ... with the dtypes kept: the buffers
        follow ``fn``'s device, never its dtype (``torch._scaled_mm`` takes float32 scales only; values are moved,
        not converted). A buffer whose device does not change stays the same tensor object, so the quantizers cached
        on it stay valid; a moved one is a new tensor, which the caches validate by identity and rebuild."""
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            new = fn(t)
            return new if new.dtype == t.dtype else t.to(device=new.device)

        return super()._apply(keep_dtype, recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        hist = state_dict.get(prefix + "amax_history")
        if hist is not None and hist.shape != self.amax_history.shape and hist.shape[0] == len(self.roles):
            self.resize_history(hist.shape[1])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # a compiled backward's amaxes not yet folded (fp8engine.fp8.library) are saved where eager mode keeps them
        if self.compiled_backward and bool(self.grad_amax.ne(0).any()):
            hist = destination[prefix + "amax_history"].detach().clone()
            hist[:, 0] = torch.maximum(hist[:, 0], self.grad_amax)
            destination[prefix + "amax_history"] = hist

    def extra_repr(self) -> str:
        return f"roles={self.roles}, amax_history_len={self.amax_history.shape[1]}"


#: Planned kernel updates (:class:`fp8engine.kernels.scaling.DelayedScalingUpdate`) by the states' buffers and the
#: recipe's numbers; a training loop uses one (a few with several models or recipes). Bounded.
_UPDATES: dict = {}
_UPDATES_MAX = 16


@torch.no_grad()
def reduce_and_update(states: Sequence[ScalingState], recipe: DelayedScaling, amax_group=None) -> None:
    """One delayed-scaling update for every state: optional MAX all-reduce of the current amaxes (one collective
    for all tensors), then new scales and rolled histories (TransformerEngine's rule, see
    :func:`fp8engine.fp8.scaling.update_fp8_scale`). A NaN/inf/zero amax keeps the previous scale.

    On the kernel path (the states' ``kernels``, their quantizers' backend; ``interval == 1``, one history length,
    a named ``amax_compute_algo``) it is one launch for all states, update counters included, planned once per set
    of buffers (the plan holds them: a buffer replaced -- ``.to()``, a history resize, a load -- plans again)."""
    states = list(states)
    if not states:
        return
    from fp8engine.fp8.library import fold_grad_amax

    for st in states:
        if st.history_from_graph:  # eager memory from now on (the flag's comment, __init__)
            st.amax_history = st.amax_history.clone()
            st.history_from_graph = False
    fold_grad_amax(states)
    if recipe.reduce_amax and amax_group is not None:
        from fp8engine.fp8.amax import all_reduce_current_amax

        all_reduce_current_amax([st.amax_history for st in states], amax_group)
    # The fused kernel takes one update flag for all states, so it serves interval == 1 (every update
    # recomputes scales); other intervals use the per-state torch path.
    if recipe.interval == 1 and not callable(recipe.amax_compute_algo) and all(st.kernels for st in states):
        hists, scales, steps = ([st.amax_history for st in states], [st.scale for st in states],
                                [st.update_step for st in states])
        # (the plan holds the tensors it was made for, so their ids are not reused while it is cached)
        key = (recipe.fp8_format, recipe.margin, recipe.amax_compute_algo,
               tuple((id(h), id(sc), id(c), h.data_ptr()) for h, sc, c in zip(hists, scales, steps)))
        update = _UPDATES.get(key)
        if update is None and all(h.shape[1] == hists[0].shape[1] for h in hists):
            from fp8engine.kernels.scaling import DelayedScalingUpdate

            update = DelayedScalingUpdate(hists, scales, [st.fp8_max(recipe) for st in states], margin=recipe.margin,
                                          algo=recipe.amax_compute_algo, update_steps=steps)
            if len(_UPDATES) >= _UPDATES_MAX:
                _UPDATES.clear()
            _UPDATES[key] = update
        if update is not None:
            update()
            return
    for st in states:
        new_scale, _ = update_fp8_scale(st.amax_history, st.scale, st.fp8_max(recipe), margin=recipe.margin,
                                        amax_compute_algo=recipe.amax_compute_algo)
        do_update = (st.update_step % recipe.interval) == 0
        st.scale.copy_(torch.where(do_update, new_scale, st.scale))
        st.amax_history.copy_(update_amax_history(st.amax_history))
        st.update_step.add_(1)
