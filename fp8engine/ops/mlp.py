"""The MLP's activation as one autograd op, optionally writing its output in FP8 for fc2.

The math lives in :func:`act_fwd` / :func:`act_bwd` (the dispatch points for the Triton activation kernels on
CUDA, ``fp8engine.kernels.activation``, once they land). ``_ActCast`` saves only the activation *input* (fc1's
output); fc2 receives the FP8 copy as ``x_fp8`` and saves that, so the high-precision activation output is not kept
for backward.

Activations (TransformerEngine's definitions):
- ``gelu``: tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.
- ``relu``: ``max(x, 0)``.
- ``swiglu``: input ``[..., 2F]`` split as ``[gate | up]``; ``silu(gate) * up`` -> ``[..., F]``
  (Shazeer 2020, "GLU Variants Improve Transformer").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.state import ScalingState
from fp8engine.ops.cast import FP8Plan, cast_operand

__all__ = ["ACTIVATIONS", "act_fwd", "act_bwd", "activation", "activation_cast", "MLP_ROLES"]

#: Names accepted by the ``activation`` argument of the modules; the value is fc1's output width per ffn unit.
ACTIVATIONS = {"gelu": 1, "relu": 1, "swiglu": 2}

#: Rows of LayerNormMLP's :class:`ScalingState`; fc1 uses rows 0-2, fc2 rows 3-5.
MLP_ROLES = ("fc1_input", "fc1_weight", "fc1_grad_output", "fc2_input", "fc2_weight", "fc2_grad_output")


def act_fwd(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Activation ``kind`` of ``x [..., D]``: ``[..., D]`` (``[..., D/2]`` for swiglu), in ``x.dtype``."""
    if kind == "gelu":
        return F.gelu(x, approximate="tanh")
    if kind == "relu":
        return F.relu(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def act_bwd(dy: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    """Gradient w.r.t. ``x`` of :func:`act_fwd` (same ATen backward ops autograd would run)."""
    if kind == "gelu":
        return torch.ops.aten.gelu_backward(dy, x, approximate="tanh")
    if kind == "relu":
        return torch.ops.aten.threshold_backward(dy, x, 0)
    gate, up = x.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(dy * up, gate), dy * F.silu(gate)], dim=-1)


class _ActCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind, fp8):
        y = act_fwd(x, kind)
        y_fp8 = None
        if fp8 is not None:
            state, row, plan, transpose = fp8
            y_fp8 = cast_operand(y.reshape(-1, y.shape[-1]), state, row, plan, transpose=transpose)
        ctx.save_for_backward(x)
        ctx.kind = kind
        return y, y_fp8

    @staticmethod
    def backward(ctx, dy, _unused):
        (x,) = ctx.saved_tensors
        return act_bwd(dy, x, ctx.kind), None, None


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """:func:`act_fwd` with gradients, saving only ``x``."""
    return _ActCast.apply(x, kind, None)[0]


def activation_cast(x: torch.Tensor, kind: str, state: ScalingState, row: int, plan: FP8Plan,
                    transpose: bool) -> tuple[torch.Tensor, Float8Tensor]:
    """``(y, y_fp8)``: the activation and its FP8 copy ``[M, D']`` cast for ``state`` row ``row`` (with the
    transpose for fc2's wgrad when ``transpose``)."""
    return _ActCast.apply(x, kind, (state, row, plan, transpose))
