"""The fused QKV projection of attention as one FP8 linear whose output comes back as the grouped ``q, k, v``.

Layout (Megatron-LM / TransformerEngine interleaved QKV): the projection output ``[s, b, C]``,
``C = g * (hpg + 2) * d``, is ``[s, b, g, hpg + 2, d]``: per KV group its ``hpg`` query heads, its key head, its
value head. Forward returns the views ``q [s, b, g, hpg, d]``, ``k, v [s, b, g, d]`` (no copy).

Backward receives ``dq, dk, dv`` (as scaled-dot-product attention's backward returns them, any strides) and casts
them into the FP8 output gradient (:func:`qkv_grad_fp8`: one pass with the Triton kernels, no ``[T, C]``
high-precision buffer; else through that buffer, the same bits); dgrad and wgrad are then the linear's own
(:func:`fp8engine.ops.linear.linear_backward`).

Rotary embedding (``freqs=``, the angles of :class:`fp8engine.modules.attention.RotaryEmbedding`): q and k come back
rotated (:func:`split_rotate`); the backward applies the rotation's gradient first, inside the kernel where it runs.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import LinearQuantizers, Quantizer
from fp8engine.kernels.qkv_grad import assemble_qkv_grad, qkv_grad_cast_transpose_dbias
from fp8engine.kernels.rotary import check_rope_table, rope_qk
from fp8engine.ops.backward import backward_keeps_graph
from fp8engine.ops import kernel_ops
from fp8engine.ops.linear import _FP8Linear, linear_backward, linear_input
from fp8engine.ops.rotary import qkv_views, rope_cos_sin, rotate_views, unrotate_grads

__all__ = ["fp8_linear_qkv", "split_grouped_qkv", "qkv_grad_fp8"]


def split_rotate(y: torch.Tensor, split: tuple, freqs: Optional[torch.Tensor], kernels: bool):
    """``y [s, b, C]`` -> ``(q [s, b, g, hpg, d], k [s, b, g, d], v [s, b, g, d], rope)``: views of ``y``, or with
    rotary angles ``freqs [s, 1, 1, r]`` q and k rotated (new tensors: with ``kernels``, the caller's backend, one
    kernel pass from ``y``, :func:`fp8engine.kernels.rotary.rope_qk`; else :func:`fp8engine.ops.rotary.rope_fwd`, the
    same bits) and ``rope = (cos, sin)`` in ``y``'s dtype for the backward (None without ``freqs``)."""
    q, k, v = qkv_views(y, *split)
    if freqs is None:
        return q, k, v, None
    g, hpg, d = split
    s, b = y.shape[:2]
    cos, sin = rope_cos_sin(freqs, y.dtype)
    if kernels and y.is_contiguous():
        q, k = rope_qk(y, cos, sin, split, b)  # (validates the tables)
    elif kernel_ops.compiled_kernel_ops(y):  # traced by torch.compile: the kernel as an opaque op
        q, k = kernel_ops.rope_qk(y.contiguous(), cos, sin, g, hpg, d, b)
    else:
        check_rope_table(cos, sin, s, d, y, "rotary in the QKV op")
        q, k = rotate_views(y, split, cos, sin)
    return q.view(s, b, g, hpg, d), k, v, (cos, sin)


class _SplitGroupedQKV(torch.autograd.Function):
    """High-precision split: the views of ``mixed`` (q and k rotated when ``freqs`` is given); backward writes dq,
    dk, dv once each into one buffer (autograd's own slicing would give each view a zero-filled full-size gradient
    and add the three up), after the rotation's gradient."""

    @staticmethod
    def forward(ctx, mixed, groups: int, heads_per_group: int, head_dim: int, freqs, kernels: bool):
        q, k, v, ctx.rope = split_rotate(mixed, (groups, heads_per_group, head_dim), freqs, kernels)
        ctx.hpg = heads_per_group
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        if ctx.rope is not None:
            dq, dk = unrotate_grads(dq, dk, ctx.rope)
        return assemble_qkv_grad(dq, dk, dv, heads_per_group=ctx.hpg), None, None, None, None, None


def split_grouped_qkv(mixed: torch.Tensor, groups: int, heads_per_group: int, head_dim: int,
                      freqs: Optional[torch.Tensor] = None, *, kernels: bool):
    """``mixed [s, b, g * (hpg + 2) * d]`` -> ``(q, k, v)`` as :func:`split_rotate` (high precision, autograd)."""
    return _SplitGroupedQKV.apply(mixed, groups, heads_per_group, head_dim, freqs, kernels)


class _FP8LinearQKV(torch.autograd.Function):
    """:class:`fp8engine.ops.linear._FP8Linear` whose output is returned as the grouped q, k, v views."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_fp8: Float8Tensor, w_fp8: Float8Tensor, grad_quantizer: Quantizer,
                fuse_wgrad: bool, split: tuple, comm=None, x_shard=None, freqs=None):
        y = _FP8Linear.forward(ctx, x, weight, bias, x_fp8, w_fp8, grad_quantizer, fuse_wgrad, comm, x_shard)
        ctx.hpg = split[1]
        q, k, v, ctx.rope = split_rotate(y, split, freqs, grad_quantizer.kernels)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        # with rotary: the rotation's gradient inside the QKV-gradient cast (kernels) or rope_bwd first
        dy_fp8, db = qkv_grad_fp8(dq, dk, dv, ctx.grad_quantizer, ctx.hpg,
                                  transpose=ctx.needs_input_grad[1] or ctx.fuse_wgrad, dbias=ctx.needs_input_grad[2],
                                  rope=ctx.rope)
        if not backward_keeps_graph("the FP8 QKV projection"):
            ctx.rope = None
        return (*linear_backward(ctx, dy_fp8, db), None, None, None, None)


def qkv_grad_fp8(dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], dv: Optional[torch.Tensor],
                 quantizer: Quantizer, heads_per_group: int, *, transpose: bool,
                 dbias: bool, rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                 ) -> tuple[Float8Tensor, Optional[torch.Tensor]]:
    """The fused projection's output gradient in FP8 from ``dq [s, b, g, hpg, d]``, ``dk, dv [s, b, g, d]`` (any
    strides; None is zero), cast by ``quantizer`` (the grad_output role), with its transpose when ``transpose`` and
    the bias gradient ``[C]`` when ``dbias``: ``(dy_fp8 [T, C], db or None)``. ``rope``: ``(cos, sin)`` angle tables
    (:func:`fp8engine.ops.rotary.rope_cos_sin`) when dq and dk are the gradients of rotated q and k: the rotation's
    gradient (:func:`fp8engine.ops.rotary.rope_bwd`) is applied first. One pass, the rotation inside, with the
    kernels under delayed scaling (all three given) or a quantizer's own fused cast (block scaling's
    ``cast_qkv_grad``); else the assembled buffer cast as any linear's output gradient (same bits)."""
    q = quantizer
    if q.delayed and q.stats is None and dq is not None and dk is not None and dv is not None:
        cos, sin = rope if rope is not None else (None, None)
        out = None
        if q.kernels:
            out = qkv_grad_cast_transpose_dbias(dq, dk, dv, q.scale, q.fp8_dtype, q.amax, cos=cos, sin=sin)
        elif q.state is not None and kernel_ops.compiled_kernel_ops(dq):
            # traced by torch.compile: the same kernel as an opaque op, into the state's compiled views
            scale, amax_out, _ = q._op_args(dq, None)
            out = kernel_ops.qkv_grad_cast_fp8(dq, dk, dv, scale, q.fp8_dtype, amax_out, cos, sin)
        if out is not None:
            data, data_t, scale_inv, db = out
            return Float8Tensor(data, scale_inv, dq.dtype, data_t, kernels=q.kernels), (db if dbias else None)
    elif q.cast_qkv_grad is not None:  # the quantizer's own fused cast (block scaling: 1 x 128 tiles)
        out = q.cast_qkv_grad(dq, dk, dv, transpose=transpose, dbias=dbias, rope=rope)
        if out is not None:
            return out
    if rope is not None:
        dq, dk = unrotate_grads(dq, dk, rope)
    dy = assemble_qkv_grad(dq, dk, dv, heads_per_group=heads_per_group)
    return q.quantize_dbias(dy.reshape(-1, dy.shape[-1]), transpose=transpose, dbias=dbias)


def fp8_linear_qkv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   quantizers: LinearQuantizers, split: tuple[int, int, int], *, w_fp8: Optional[Float8Tensor] = None,
                   x_fp8: Optional[Float8Tensor] = None, fuse_wgrad: bool = False, comm=None,
                   freqs: Optional[torch.Tensor] = None):
    """FP8 QKV projection ``x @ weight.T + bias`` returned as ``(q, k, v)`` grouped views (with ``freqs``, rotary
    angles ``[s, 1, 1, r]``: q and k rotated, new tensors, see :func:`split_grouped_qkv`).

    Args:
        x: ``[s, b, K]`` high precision (``[s/tp, b, K]`` when ``comm`` all-gathers it). weight: ``[C, K]`` with
            ``C = g * (hpg + 2) * d`` rows in the grouped layout (module docstring); bias ``[C]`` or None.
            quantizers/w_fp8/x_fp8/fuse_wgrad/comm: as :func:`fp8engine.ops.linear.linear` (column parallel).
        split: ``(g, hpg, d)`` -- KV groups, query heads per group, head dim (per rank).
    Returns:
        ``q [s, b, g, hpg, d]``, ``k [s, b, g, d]``, ``v [s, b, g, d]`` in ``x.dtype`` (views of one buffer).
    Raises:
        ValueError: ``g * (hpg + 2) * d`` is not the weight's row count.
    """
    groups, hpg, d = split
    if groups * (hpg + 2) * d != weight.shape[0]:
        raise ValueError(f"fp8_linear_qkv: split {split} gives {groups * (hpg + 2) * d} output features, but the "
                         f"weight has {weight.shape[0]} rows")
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    x_fp8, x_shard = linear_input(x, quantizers.input, x_fp8, comm, needs_grad)
    if w_fp8 is None:
        w_fp8 = quantizers.weight.quantize(weight, transpose=needs_grad)
    return _FP8LinearQKV.apply(x, weight, bias, x_fp8, w_fp8, quantizers.grad_output, fuse_wgrad, tuple(split),
                               comm, x_shard, freqs)
