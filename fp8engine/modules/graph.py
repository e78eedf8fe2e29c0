"""CUDA-graph capture of FP8 modules (forward + backward), with delayed scaling still updating every step.

``torch.cuda.make_graphed_callables`` replays the captured kernels without running the module's Python code, so
the module would no longer register its :class:`ScalingState` with the FP8 region and its scales would never
update. :func:`make_graphed_callables` wraps the graphed module so that every call registers those states with
the active ``autocast`` region (the amaxes are written by the captured casts into the same buffers, in place).
Several modules captured together (a tuple, as ``torch.cuda.make_graphed_callables`` takes them) get one wrapper
each. On a CPU nothing is captured: the wrappers run the modules eagerly.
"""
from __future__ import annotations

import warnings

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


def make_graphed_callables(modules, sample_args: tuple, *, fp8_enabled: bool = True, fp8_recipe=None,
                           num_warmup_iters: int = 3):
    """Capture the modules' forward and backward in CUDA graphs (``torch.cuda.make_graphed_callables``) under
    FP8 (TransformerEngine's helper of the same name).

    Args:
        modules: one ``nn.Module`` (e.g. a :class:`TransformerLayer` on a CUDA device), or a tuple of them, given
            in the order they run in the training step (their captures share one memory pool and must replay in
            that order, backward in reverse: ``torch.cuda.make_graphed_callables``'s contract).
        sample_args: for one module, a tuple of tensors with the shapes, dtypes and ``requires_grad`` of every
            later call; for a tuple of modules, a tuple holding one such tuple per module.
        fp8_enabled: capture inside ``autocast(recipe=fp8_recipe)`` (one value for all the modules).
        fp8_recipe: default ``DelayedScaling()``.
        num_warmup_iters: eager iterations before capture (they also calibrate delayed-scaling scales).
    Returns:
        For one module, a module to call (inside ``fp8_autocast`` with the same recipe, or outside any with
        ``fp8_enabled=False``) like the original; for a tuple, a tuple of such modules, in the same order.

        CPU ``sample_args`` (no CUDA graphs there): nothing is captured and no warm-up runs; the returned modules
        run the originals eagerly with the same calling contract (same recipe checks), and a ``UserWarning``
        says so. This lets a script written for the GPU run on a CPU.
    Raises:
        TypeError: no module, a module that is not an ``nn.Module``, or ``sample_args`` not of the form above
            (e.g. a tuple of tensors where one tuple per module is due) or holding a non-tensor.
        ValueError: the tensors are on different device types, or CUDA ones while CUDA is not available.
    """
    single = not isinstance(modules, tuple)
    mods = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    _check_args(mods, args, single)
    tensors = [a for per_module in args for a in per_module]
    on_cuda = {a.is_cuda for a in tensors}
    if len(on_cuda) > 1:
        raise ValueError("make_graphed_callables: sample_args mix CUDA and CPU tensors; put every module and its "
                         "sample_args on one device")
    capture = on_cuda == {True}
    if capture and not torch.cuda.is_available():
        raise ValueError("make_graphed_callables: CUDA sample_args but CUDA is not available")
    recipe = (fp8_recipe or DelayedScaling()) if fp8_enabled else None
    states = [[m for m in mod.modules() if isinstance(m, ScalingState)] for mod in mods]
    if capture:
        with autocast(enabled=fp8_enabled, recipe=recipe):
            graphed = torch.cuda.make_graphed_callables(mods, args, num_warmup_iters=num_warmup_iters)
    else:
        warnings.warn("make_graphed_callables: CPU sample_args, so no CUDA graph is captured; the returned modules "
                      "run the originals eagerly", UserWarning, stacklevel=2)
        graphed = mods
    out = tuple(_GraphedFP8Module(g, st, recipe, fp8_enabled) for g, st in zip(graphed, states))
    return out[0] if single else out


def _check_args(mods: tuple, args, single: bool) -> None:
    """``TypeError`` naming what is wrong with ``modules`` / ``sample_args`` (:func:`make_graphed_callables`)."""
    form = ("a tuple of tensors" if single else
            f"a tuple of {len(mods)} tuples of tensors (one per module, in the modules' order)")
    if not mods:
        raise TypeError("make_graphed_callables: modules is an empty tuple; pass an nn.Module or a tuple of them")
    for mod in mods:
        if not isinstance(mod, nn.Module):
            raise TypeError(f"make_graphed_callables takes an nn.Module or a tuple of them; got {type(mod).__name__}")
    if not isinstance(args, tuple) or len(args) != len(mods):
        raise TypeError(f"make_graphed_callables: sample_args must be {form}; got {type(args).__name__}"
                        + ("" if not isinstance(args, tuple) else f" of length {len(args)}"))
    for i, per_module in enumerate(args):
        where = "sample_args" if single else f"sample_args[{i}]"
        if not isinstance(per_module, tuple):
            raise TypeError(f"make_graphed_callables: sample_args must be {form}; {where} is a "
                            f"{type(per_module).__name__}")
        bad = [type(a).__name__ for a in per_module if not isinstance(a, torch.Tensor)]
        if bad:
            raise TypeError(f"make_graphed_callables: sample_args must be {form}; {where} holds a non-tensor "
                            f"({bad[0]})")
