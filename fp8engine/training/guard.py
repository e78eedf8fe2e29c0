"""Non-finite step guard: a step whose loss or global gradient norm is NaN/inf changes nothing.

Everything runs on the device, so it adds no host synchronisation and can be captured in a CUDA graph:

1. before the forward, the step state held in buffers is copied into one flat byte buffer (the snapshot): every
   :class:`~fp8engine.fp8.state.ScalingState`'s ``amax_history``, ``scale``, ``update_step`` and ``grad_amax``
   (what the FP8 region's exit and the backward write), and the persistent buffers of other modules (running
   statistics such as BatchNorm's). Non-persistent buffers of other modules are caches of constants (rotary
   ``inv_freq``, masks) that no step writes: they are not copied;
2. after clipping, ``found_inf = !isfinite(loss) | !isfinite(grad_norm)`` (a float32 0/1 device scalar),
   MAX-reduced over the data-parallel group when there is one (replicas see different losses, and must all skip
   or all step, or their weights and FP8 state would part);
3. the optimizer step: an optimizer that supports AMP scaling (``_step_supports_amp_scaling``: the fused AdamW
   of :func:`~fp8engine.training.step.make_optimizer` on CUDA) gets ``found_inf`` as ``GradScaler`` passes it
   (``optimizer.found_inf``; its kernel leaves parameters, moments and step count as they are when it is 1);
   other optimizers (the CPU foreach AdamW) are stepped only when the host reads ``found_inf == 0`` (one read,
   on the CPU where it costs nothing);
4. the buffers get ``where(found_inf, snapshot, current)`` back (no branch).

Launches per step do not grow with the model: the snapshot is one ``torch._foreach_copy_`` of byte views of
the buffers into segments of one flat ``uint8`` buffer; the restore is one ``torch._foreach_copy_`` of the
current bytes into a second flat buffer, one ``torch.where`` over all of it and one ``torch._foreach_copy_`` back
(CUDA's multi-tensor apply runs a foreach over many tensors in a few launches), instead of one copy per buffer
and a ``where`` and a copy per buffer (about 440 launches per step for gpt2-124m's 36 FP8 states). The flat
buffers and views are built once and rebuilt only when a buffer was replaced (``.to()``, an amax-history resize:
eager steps only; a captured step sees the same tensors at every replay, so the addresses it recorded stay
valid).

The caller reads ``found_inf`` on the host together with the loss (the loss is read there anyway) and decides
whether to stop (:mod:`fp8engine.train`: ``--skip-nonfinite``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fp8engine.fp8.state import ScalingState

__all__ = ["NonFiniteGuard", "step_state_buffers"]


def step_state_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(qualified name, tensor)`` of every buffer a training step may write, in module order: all buffers of
    each :class:`ScalingState` (also the non-persistent ``grad_amax``) and the persistent buffers of other
    modules; buffers shared between modules are listed once."""
    return [(name, mod._buffers[key]) for name, mod, key in _step_state_slots(module)]


def _step_state_slots(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """``(qualified name, owning module, buffer name)`` of :func:`step_state_buffers` (the slots, so that a
    buffer replaced later is found again by ``owner._buffers[key]``)."""
    found, seen = [], set()
    for prefix, mod in module.named_modules(remove_duplicate=False):
        fp8 = isinstance(mod, ScalingState)
        for key, buf in mod._buffers.items():
            if buf is None or id(buf) in seen or (not fp8 and key in mod._non_persistent_buffers_set):
                continue
            seen.add(id(buf))
            found.append((f"{prefix}.{key}" if prefix else key, mod, key))
    return found


#: Byte alignment of each buffer's segment in the flat snapshot (any dtype's views stay aligned; vector loads).
_ALIGN = 16


class NonFiniteGuard:
    """Snapshot and conditional restore of a module's step state plus the ``found_inf`` flag of one step.

    Args:
        module: the (unwrapped) model whose buffers hold the FP8 scaling state. Its module structure is read at
            the first :meth:`snapshot` (buffers replaced later are followed; modules added later are not).
        group: process group of the data-parallel replicas (None: one replica); :meth:`check` MAX-reduces
            ``found_inf`` over it (one small all-reduce per step, multi-process runs only).

    Attributes:
        found_inf: float32 device scalar of the last :meth:`check`: 1.0 when the step was not finite, else 0.0.
        names: qualified names of the buffers the snapshot holds (:func:`step_state_buffers`).
    """

    def __init__(self, module: torch.nn.Module, group=None):
        self.module, self.group = module, group
        self.found_inf: Optional[torch.Tensor] = None
        self._found: Optional[torch.Tensor] = None  # bool twin of found_inf, for torch.where
        self._slots: Optional[list[tuple[str, torch.nn.Module, str]]] = None
        self.names: list[str] = []
        self._tensors: list[torch.Tensor] = []  # the buffers as snapshotted (identity checked at restore)
        self._views: list[torch.Tensor] = []  # uint8 views of the contiguous ones
        self._flat = self._work = None  # uint8 [padded total bytes]: the snapshot and the restore's scratch
        self._flat_views: list[torch.Tensor] = []  # segment of _flat per entry of _views
        self._work_views: list[torch.Tensor] = []
        self._loose: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, copy) of non-contiguous buffers

    @property
    def num_tensors(self) -> int:
        """How many buffers the snapshot holds."""
        return len(self._tensors)

    def _current(self) -> list[torch.Tensor]:
        if self._slots is None:
            self._slots = _step_state_slots(self.module)
            self.names = [name for name, _, _ in self._slots]
        return [mod._buffers[key] for _, mod, key in self._slots]

    def _plan(self, tensors: list[torch.Tensor]) -> None:
        """(Re)build the flat snapshot for ``tensors`` (first step, or a buffer was replaced: eager steps)."""
        self._tensors = tensors
        flat_src = [t for t in tensors if t.is_contiguous()]
        self._loose = [(t, torch.empty_like(t)) for t in tensors if not t.is_contiguous()]
        self._views = [t.reshape(-1).view(torch.uint8) for t in flat_src]
        offsets, total = [], 0
        for v in self._views:
            offsets.append(total)
            total += -(-v.numel() // _ALIGN) * _ALIGN
        device = flat_src[0].device if flat_src else torch.device("cpu")
        self._flat = torch.zeros(total, dtype=torch.uint8, device=device)
        self._work = torch.zeros_like(self._flat)
        self._flat_views = [self._flat.narrow(0, o, v.numel()) for o, v in zip(offsets, self._views)]
        self._work_views = [self._work.narrow(0, o, v.numel()) for o, v in zip(offsets, self._views)]

    def _same(self, tensors: list[torch.Tensor]) -> bool:
        return (self._flat is not None and len(tensors) == len(self._tensors)
                and all(t is old for t, old in zip(tensors, self._tensors)))

    def snapshot(self) -> None:
        """Copy the step state (:func:`step_state_buffers`) into the persistent flat snapshot: one
        ``_foreach_copy_`` (plus one ``copy_`` per non-contiguous buffer, none in fp8engine's models)."""
        tensors = self._current()
        if not self._same(tensors):
            self._plan(tensors)
        if self._views:
            torch._foreach_copy_(self._flat_views, self._views)
        for buf, copy in self._loose:
            copy.copy_(buf)

    def check(self, loss: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> torch.Tensor:
        """``found_inf``: float32 device scalar, 1.0 when ``loss`` or ``grad_norm`` is not finite (on any rank of
        ``group``), else 0.0."""
        values = loss.detach().float().reshape(1)
        if grad_norm is not None:
            values = torch.cat([values, grad_norm.detach().float().reshape(1)])
        found = ~torch.isfinite(values).all()
        self.found_inf = found.float()
        if self.group is not None:
            dist.all_reduce(self.found_inf, op=dist.ReduceOp.MAX, group=self.group)
            found = self.found_inf > 0
        self._found = found
        return self.found_inf

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` unless ``found_inf`` (device-side where the optimizer supports it, see module doc)."""
        if getattr(optimizer, "_step_supports_amp_scaling", False) and _is_fused(optimizer):
            optimizer.found_inf = self.found_inf  # read by the fused AdamW kernel (torch.amp.GradScaler's way)
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
        elif not bool(self.found_inf):  # host read: only taken on optimizers without device-side skipping
            optimizer.step()

    def restore_if_found(self) -> None:
        """Put the snapshot back where ``found_inf`` is 1 (bit-exact; the buffers stay as they are where it is 0):
        ``work = current bytes; work = where(found, snapshot, work); current bytes = work``.

        Raises:
            RuntimeError: called before :meth:`snapshot` and :meth:`check`.
        """
        if self._found is None or self._flat is None:
            raise RuntimeError("NonFiniteGuard.restore_if_found needs snapshot() and check() first")
        tensors = self._current()
        if not self._same(tensors):  # a buffer replaced during this step (eager only)
            self._restore_replaced(tensors)
            return
        if self._views:
            torch._foreach_copy_(self._work_views, self._views)
            torch.where(self._found, self._flat, self._work, out=self._work)
            torch._foreach_copy_(self._views, self._work_views)
        for buf, copy in self._loose:
            buf.copy_(torch.where(self._found, copy, buf))

    def _restore_replaced(self, current: list[torch.Tensor]) -> None:
        """Restore tensor by tensor when some buffer was reallocated during the step (an amax history resized to
        the recipe's length on its first use): a resized one gets the snapshot's overlapping block and zeros
        elsewhere, which is what :meth:`ScalingState.resize_history` makes of the snapshotted history."""
        loose = {id(buf): copy for buf, copy in self._loose}
        flat = iter(self._flat_views)
        for old, new in zip(self._tensors, current):
            saved = loose.get(id(old))
            if saved is None:  # the segment is _ALIGN-aligned, so it views as any dtype
                saved = next(flat).view(old.dtype).view(old.shape)
            if saved.shape != new.shape:
                if saved.dim() != new.dim():
                    raise RuntimeError(f"a buffer changed rank during the step: {tuple(saved.shape)} -> "
                                       f"{tuple(new.shape)}")
                block = tuple(slice(0, min(a, b)) for a, b in zip(saved.shape, new.shape))
                resized = torch.zeros_like(new)
                resized[block] = saved[block]
                saved = resized
            new.copy_(torch.where(self._found, saved.to(new.dtype), new))


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return all(group.get("fused") for group in optimizer.param_groups)
