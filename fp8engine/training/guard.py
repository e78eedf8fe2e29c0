"""Non-finite step guard: a step whose loss or global gradient norm is NaN/inf changes nothing.

Everything runs on the device, so it adds no host synchronisation and can be captured in a CUDA graph:

1. before the forward, every buffer of the model (the FP8 scaling state: amax histories, scales, update
   counters) is copied into a snapshot;
2. after clipping, ``found_inf = !isfinite(loss) | !isfinite(grad_norm)`` (a float32 0/1 device scalar);
3. the optimizer step: an optimizer that supports AMP scaling (``_step_supports_amp_scaling``: the fused AdamW
   of :func:`~fp8engine.training.step.make_optimizer` on CUDA) gets ``found_inf`` as ``GradScaler`` passes it
   (``optimizer.found_inf``; its kernel leaves parameters, moments and step count as they are when it is 1);
   other optimizers (the CPU foreach AdamW) are stepped only when the host reads ``found_inf == 0`` (one read,
   on the CPU where it costs nothing);
4. the buffers are restored from the snapshot where ``found_inf`` is 1 (``torch.where``, no branch).

The caller reads ``found_inf`` on the host together with the loss (the loss is read there anyway) and decides
whether to stop (:mod:`fp8engine.train`: ``--skip-nonfinite``).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["NonFiniteGuard"]


class NonFiniteGuard:
    """Snapshot and conditional restore of a module's buffers plus the ``found_inf`` flag of one step.

    Args:
        module: the (unwrapped) model whose buffers hold the FP8 scaling state.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._snap: dict[str, torch.Tensor] = {}
        self.found_inf: Optional[torch.Tensor] = None

    def _buffers(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_buffers())

    def snapshot(self) -> None:
        """Copy every buffer into a persistent snapshot (reallocated only when a buffer's shape changed, which
        happens in eager warm-up steps only: a captured step sees static shapes)."""
        for name, buf in self._buffers().items():
            snap = self._snap.get(name)
            if snap is None or snap.shape != buf.shape or snap.dtype != buf.dtype or snap.device != buf.device:
                self._snap[name] = snap = torch.empty_like(buf)
            snap.copy_(buf)

    def check(self, loss: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> torch.Tensor:
        """``found_inf``: float32 device scalar, 1.0 when ``loss`` or ``grad_norm`` is not finite, else 0.0."""
        bad = ~torch.isfinite(loss.detach().float())
        if grad_norm is not None:
            bad = bad | ~torch.isfinite(grad_norm.detach().float())
        self.found_inf = bad.float()
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
        """Put back every snapshotted buffer (same name and shape) where ``found_inf`` is 1."""
        keep = self.found_inf.bool()
        for name, buf in self._buffers().items():
            snap = self._snap.get(name)
            if snap is not None and snap.shape == buf.shape and snap.dtype == buf.dtype:
                buf.copy_(torch.where(keep, snap, buf))


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return all(group.get("fused") for group in optimizer.param_groups)
