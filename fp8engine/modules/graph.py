"""CUDA-graph capture of FP8 modules (forward + backward), with delayed scaling still updating every step.

``torch.cuda.make_graphed_callables`` replays the captured kernels without running the module's Python code, so
the module would no longer register its :class:`ScalingState` with the FP8 region and its scales would never
update. :func:`make_graphed_callables` wraps the graphed module so that every call registers those states with
the active ``autocast`` region (the amaxes are written by the captured casts into the same buffers, in place).
"""
from __future__ import annotations

import torch
from torch import nn

from fp8engine.fp8.autocast import autocast, get_fp8_context
from fp8engine.fp8.state import ScalingState
from fp8engine.recipe import DelayedScaling

__all__ = ["make_graphed_callables"]


class _GraphedFP8Module(nn.Module):
    def __init__(self, graphed: nn.Module, states: list, recipe, fp8_enabled: bool):
        super().__init__()
        self.graphed = graphed
        self._states, self._recipe, self._fp8_enabled = states, recipe, fp8_enabled

    def forward(self, *args):
        ctx = get_fp8_context()
        if self._fp8_enabled:
            if ctx is None or ctx.recipe != self._recipe:
                raise ValueError(f"this module was captured under fp8_autocast(fp8_recipe={self._recipe!r}); call "
                                 "it inside an fp8_autocast region with that same recipe")
            if isinstance(self._recipe, DelayedScaling):
                for st in self._states:
                    ctx.register(st)
        elif ctx is not None:
            raise ValueError("this module was captured with fp8_enabled=False; call it outside fp8_autocast")
        return self.graphed(*args)


def make_graphed_callables(module: nn.Module, sample_args: tuple, *, fp8_enabled: bool = True,
                           fp8_recipe=None, num_warmup_iters: int = 3) -> nn.Module:
    """Capture ``module``'s forward and backward in CUDA graphs (``torch.cuda.make_graphed_callables``) under
    FP8 (TransformerEngine's helper of the same name).

    Args:
        module: e.g. a :class:`TransformerLayer` on a CUDA device.
        sample_args: tuple of CUDA tensors with the shapes, dtypes and ``requires_grad`` of every later call.
        fp8_enabled: capture inside ``autocast(recipe=fp8_recipe)``.
        fp8_recipe: default ``DelayedScaling()``.
        num_warmup_iters: eager iterations before capture (they also calibrate delayed-scaling scales).
    Returns:
        A module to call (inside ``fp8_autocast`` with the same recipe) like the original.
    Raises:
        ValueError: no CUDA device, or CPU tensors in ``sample_args``.
    """
    if not torch.cuda.is_available() or not all(isinstance(a, torch.Tensor) and a.is_cuda for a in sample_args):
        raise ValueError("make_graphed_callables needs a CUDA GPU and CUDA sample_args; run the module eagerly on CPU")
    recipe = (fp8_recipe or DelayedScaling()) if fp8_enabled else None
    states = [m for m in module.modules() if isinstance(m, ScalingState)]
    with autocast(enabled=fp8_enabled, recipe=recipe):
        graphed = torch.cuda.make_graphed_callables(module, sample_args, num_warmup_iters=num_warmup_iters)
    return _GraphedFP8Module(graphed, states, recipe, fp8_enabled)
