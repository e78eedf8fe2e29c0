"""The MLP's FP8 part under ``Float8BlockScaling``: fc1 -> activation -> fc2 as three autograd nodes.

    fc1: h = x @ W1.T + b1      block-scaled (:func:`fp8engine.ops.block_linear.block_fp8_linear`)
    act: a = act(h)             high precision (:func:`fp8engine.ops.mlp.activation`, saves only h)
    fc2: y = a @ W2.T + b2      block-scaled; the op casts ``a`` to 1 x 128 tiles (and a^T re-tiled for wgrad)

Unfused by design for now: the per-tensor path (:func:`fp8engine.ops.mlp.fp8_mlp`) lets the activation kernel (or
cuBLASLt's GELU epilogue) write fc2's FP8 input and the activation-backward kernel write the FP8 gradient, but those
kernels produce one per-tensor scale; a block-scaled activation(-backward)+cast kernel can come later. Here the
activation writes ``a`` in high precision (one extra ``[M, F]`` write and read per pass) and the block op casts it.
What backward keeps: fc1's FP8 ``x^T`` and ``W1^T``, ``h`` (high precision, for the activation backward), fc2's
FP8 ``a^T`` and ``W2^T`` -- as the fused per-tensor op.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8engine.fp8.quantizer import LinearQuantizers
from fp8engine.ops.block_linear import block_fp8_linear
from fp8engine.ops.mlp import activation

__all__ = ["block_fp8_mlp"]


def block_fp8_mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: Optional[torch.Tensor],
                  fc2_weight: torch.Tensor, fc2_bias: Optional[torch.Tensor], kind: str, fc1: LinearQuantizers,
                  fc2: LinearQuantizers, *, w1_q: Optional[tuple] = None, w2_q: Optional[tuple] = None,
                  fuse_wgrad: bool = False) -> torch.Tensor:
    """Block-scaled FP8 ``fc2(act(fc1(x)))`` with gradients (module docstring).

    Args:
        x: ``[*, h]`` bf16 / fp32 (per rank: the gathered sequence when sequence parallel); output ``[*, h_out]``
            in x's dtype, before any tensor-parallel reduction.
        fc1_weight: ``[D, h]`` (``D = 2F`` for swiglu, ``[gate | up]``); fc2_weight ``[h_out, F]``; biases ``[D]``,
            ``[h_out]`` or None. ``h``, ``D``, ``F`` and ``h_out`` multiples of 128 (checked by the module).
        kind: ``"gelu"``, ``"relu"`` or ``"swiglu"``.
        fc1, fc2: the two GEMMs' :class:`LinearQuantizers` of ``BlockQuantizer`` objects.
        w1_q, w2_q: already cast weights ``(q, q_t)`` (FP8 weight caching); cast by the op when None.
        fuse_wgrad: weight gradients go to fp32 ``weight.main_grad``; ``.grad`` stays None.
    Raises:
        TypeError: as :func:`~fp8engine.ops.block_linear.block_fp8_linear`.
    """
    h = block_fp8_linear(x, fc1_weight, fc1_bias, fc1, w_q=w1_q, fuse_wgrad=fuse_wgrad)
    return block_fp8_linear(activation(h, kind), fc2_weight, fc2_bias, fc2, w_q=w2_q, fuse_wgrad=fuse_wgrad)
