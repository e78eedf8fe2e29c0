"""What a hand-written FP8 backward must know about the autograd call running it: :func:`backward_keeps_graph`.

It reads the running graph task's flag (``torch._C._autograd._get_current_graph_task_keep_graph``: private, the call
PyTorch's AOTAutograd makes for the same decision; present in torch 2.11 and 2.13).
"""
from __future__ import annotations

import torch

__all__ = ["backward_keeps_graph"]

_keep_graph = torch._C._autograd._get_current_graph_task_keep_graph


def backward_keeps_graph(op: str) -> bool:
    """Whether the autograd backward running now keeps its graph (``retain_graph=True``), for a hand-written
    backward that keeps its state (FP8 transposes, shards, rotary tables) on ``ctx`` outside autograd's saved
    tensors: with it, the backward leaves that state in place for another backward; without it, it may drop each
    piece once used (as autograd frees its saved tensors; a second backward then meets autograd's own error on
    ``ctx.saved_tensors``). Call it first in the backward.

    Raises:
        RuntimeError: the backward runs with ``create_graph=True`` (a double backward: gradient penalty,
            Hessian-vector product): the FP8 GEMMs and casts record no graph, so the gradients returned could not
            be differentiated again and a second-order term would silently be missing. ``op`` names the op.
    """
    if torch.compiler.is_compiling():
        # a backward traced by torch.compile (AOTAutograd) runs as a graph that keeps what it saved by itself; the
        # graph task's flag is no traceable call, and clearing Python attributes in a trace changes nothing
        return True
    if torch.is_grad_enabled():  # (the engine runs a backward in grad mode exactly under create_graph=True)
        raise RuntimeError(
            f"{op}: no double backward (create_graph=True): its FP8 GEMMs and casts record no autograd graph, so "
            "its gradients cannot be differentiated again. Take first-order gradients without create_graph "
            "(loss.backward(), torch.autograd.grad(..., create_graph=False)); no FP8 op of this package has a double "
            "backward (their backward builds no graph).")
    return _keep_graph()
