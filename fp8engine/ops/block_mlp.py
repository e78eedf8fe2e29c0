"""The MLP's FP8 part under ``Float8BlockScaling``: fc1 -> activation -> fc2.

Fused (the kernel path: CUDA, or any device inside ``kernels_forced()``), one autograd node ``_BlockMLP`` organised
around the six GEMMs:

- forward:  fc1 fprop ``h = x @ W1.T + b1`` -> the activation kernel writes fc2's 1 x 128-tiled FP8 input ``a`` and
  its re-tiled transpose (:func:`fp8engine.kernels.block_activation.act_fwd_1x128`) -> fc2 fprop ``y = a @ W2.T + b2``;
- backward: cast ``dy`` (1 x 128, with the transpose) -> fc2 dgrad ``da = dy @ W2`` -> fc2 wgrad ``dW2 = dy.T @ a``
  -> the activation-backward kernel writes ``dh = da * act'(h)`` 1 x 128-tiled with its transpose and fc1's dbias
  (:func:`~fp8engine.kernels.block_activation.act_bwd_1x128`) -> fc1 dgrad ``dx = dh @ W1`` -> fc1 wgrad
  ``dW1 = dh.T @ x``.
The activation's high-precision output and gradient are never written (unfused: one ``[M, F]`` write + read in
forward, one ``[M, D]`` in backward). The rounding: :mod:`fp8engine.kernels.block_activation` (fp32 inputs: the
same FP8 bits as the unfused composition; bf16: one rounding fewer). ``x`` may come already cast (``x_q``, from
:func:`fp8engine.ops.block_norm.block_norm_cast`). Token rows that are not a multiple of 128 are zero-padded as
:mod:`fp8engine.ops.block_linear` does (the activation kernels write the padded rows as zeros).

Unfused (elsewhere: the CPU reference path), three autograd nodes:

    fc1: h = x @ W1.T + b1      block-scaled (:func:`fp8engine.ops.block_linear.block_fp8_linear`)
    act: a = act(h)             high precision (:func:`fp8engine.ops.mlp.activation`, saves only h)
    fc2: y = a @ W2.T + b2      block-scaled; the op casts ``a`` to 1 x 128 tiles (and a^T re-tiled for wgrad)

What backward keeps, either way: fc1's FP8 ``x^T`` and ``W1^T``, ``h`` (high precision, for the activation
backward), fc2's FP8 ``a^T`` and ``W2^T`` -- as the fused per-tensor op (:func:`fp8engine.ops.mlp.fp8_mlp`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fp8engine.fp8.block_tensor import TILE_1x128, Float8BlockTensor
from fp8engine.fp8.float8_tensor import use_kernels
from fp8engine.fp8.quantizer import LinearQuantizers
from fp8engine.ops.backward import backward_keeps_graph
from fp8engine.ops.block_gemm import block_gemm
from fp8engine.ops.block_linear import BLOCK_DTYPES, block_fp8_linear, check_x_q
from fp8engine.ops.linear import main_grad_of
from fp8engine.ops.mlp import activation
from fp8engine.recipe import Float8BlockScaling

__all__ = ["block_fp8_mlp"]

_B = Float8BlockScaling.BLOCK_SIZE


def _weight_pair(w: torch.Tensor, quantizer, w_q: Optional[tuple], need_t: bool) -> tuple:
    """``(qw, qw_t or None)``: the cached cast, or a new one; the transpose (exact for 128 x 128) when needed."""
    qw, qw_t = quantizer.quantize(w, transpose=need_t) if w_q is None else w_q
    return qw, (qw.t() if need_t and qw_t is None else qw_t)


def _wgrad(dy_t: Float8BlockTensor, x_t: Float8BlockTensor, weight: torch.Tensor, fuse: bool):
    """``dW = dy.T @ x`` in weight's dtype, or added (fp32) to ``weight.main_grad`` (then None)."""
    if fuse:
        main_grad_of(weight).add_(block_gemm(dy_t, x_t, torch.float32))
        return None
    return block_gemm(dy_t, x_t, weight.dtype)


def _fp8(data, sinv, data_t, sinv_t, dtype) -> tuple:
    return (Float8BlockTensor(data, sinv, TILE_1x128, dtype),
            None if data_t is None else Float8BlockTensor(data_t, sinv_t, TILE_1x128, dtype))


class _BlockMLP(torch.autograd.Function):
    """``y = fc2(act(fc1(x)))``, block-scaled FP8 GEMMs, activation fused with the casts (module docstring)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, x_q: Optional[tuple], w1_q: Optional[tuple], w2_q: Optional[tuple],
                fc1: LinearQuantizers, fc2: LinearQuantizers, kind: str, fuse_wgrad: bool):
        from fp8engine.kernels.block_activation import act_fwd_1x128

        need_x, need_w1, need_b1, need_w2 = ctx.needs_input_grad[:4]
        need_dw1, need_dw2 = need_w1 or fuse_wgrad, need_w2 or fuse_wgrad
        need_dh = need_x or need_dw1 or need_b1  # anything upstream of the activation
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        pad = -m % _B
        if x_q is None:
            qx, qx_t = fc1.input.quantize(F.pad(x2, (0, 0, 0, pad)) if pad else x2, transpose=need_dw1)
        else:  # cast by the fused norm (ops.block_norm): rows padded already; q_t None when no backward runs
            qx, qx_t = x_q
            assert qx.shape[0] == m + pad, "x_q does not fit x"
        qw1, qw1_t = _weight_pair(w1, fc1.weight, w1_q, need_x)
        qw2, qw2_t = _weight_pair(w2, fc2.weight, w2_q, need_dh)
        # fc1 fprop: h = x @ W1.T + b1, the bias in the GEMM (the padding rows dropped: they hold b1, not zero)
        h = block_gemm(qx, qw1, x.dtype, bias=b1)[:m].contiguous()
        # the activation, written 1 x 128-tiled for fc2 (with a^T for fc2's wgrad), padded rows zero
        qa, qa_t = _fp8(*act_fwd_1x128(h, kind, fc2.input.fp8_dtype, power_2_scale=fc2.input.power_2_scale,
                                       transpose=need_dw2, pad_rows=True), x.dtype)
        # fc2 fprop: y = a @ W2.T + b2
        y = block_gemm(qa, qw2, x.dtype, bias=b2)[:m]
        ctx.save_for_backward(w1, w2, h if need_dh else None)
        ctx.saved = (qx_t if need_dw1 else None, qw1_t if need_x else None, qa_t, qw2_t if need_dh else None)
        ctx.cfg = (fc1.grad_output, fc2.grad_output, kind, fuse_wgrad, x.shape, pad)
        return y.reshape(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, dy):
        from fp8engine.kernels.block_activation import act_bwd_1x128

        w1, w2, h = ctx.saved_tensors
        qx_t, qw1_t, qa_t, qw2_t = ctx.saved
        grad_q1, grad_q2, kind, fuse, x_shape, pad = ctx.cfg
        if not backward_keeps_graph("the block-scaled FP8 MLP"):  # (kept for another backward under retain_graph)
            ctx.saved = ctx.cfg = None
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        dy2 = dy.reshape(-1, dy.shape[-1])
        if dy2.dtype not in BLOCK_DTYPES:
            dy2 = dy2.float()
        m = dy2.shape[0]
        dx = dw1 = db1 = dw2 = db2 = None
        if qa_t is None and qw2_t is None:
            db2 = dy2.sum(0, dtype=torch.float32).to(w2.dtype) if need_b2 else None
            return dx, dw1, db1, dw2, db2, None, None, None, None, None, None, None
        # fc2: cast dy (with fc2's bias gradient from the same pass), dgrad da = dy @ W2, wgrad dW2 = dy.T @ a
        dy2p = F.pad(dy2, (0, 0, 0, pad)) if pad else dy2
        if need_b2:
            qdy, qdy_t, db2 = grad_q2.quantize_dbias(dy2p, transpose=qa_t is not None)
            db2 = db2.to(w2.dtype)
        else:
            qdy, qdy_t = grad_q2.quantize(dy2p, transpose=qa_t is not None)
        if qa_t is not None:
            dw2 = _wgrad(qdy_t, qa_t, w2, fuse)
        if qw2_t is not None:
            da = block_gemm(qdy, qw2_t, h.dtype)[:m].contiguous()
            # activation backward written 1 x 128-tiled (with dh^T for fc1's wgrad) + fc1's dbias
            data, sinv, data_t, sinv_t, db1 = act_bwd_1x128(
                da, h, kind, grad_q1.fp8_dtype, power_2_scale=grad_q1.power_2_scale, transpose=qx_t is not None,
                pad_rows=True, dbias=need_b1)
            qdh, qdh_t = _fp8(data, sinv, data_t, sinv_t, h.dtype)
            if qw1_t is not None:  # fc1 dgrad: dx = dh @ W1
                dx = block_gemm(qdh, qw1_t, h.dtype)[:m].reshape(x_shape)
            if qx_t is not None:  # fc1 wgrad: dW1 = dh.T @ x
                dw1 = _wgrad(qdh_t, qx_t, w1, fuse)
            if db1 is not None:
                db1 = db1.to(w1.dtype)  # as block_linear's dbias
        return dx, dw1, db1, dw2, db2, None, None, None, None, None, None, None


def block_fp8_mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: Optional[torch.Tensor],
                  fc2_weight: torch.Tensor, fc2_bias: Optional[torch.Tensor], kind: str, fc1: LinearQuantizers,
                  fc2: LinearQuantizers, *, w1_q: Optional[tuple] = None, w2_q: Optional[tuple] = None,
                  x_q: Optional[tuple] = None, fuse_wgrad: bool = False, fused: Optional[bool] = None
                  ) -> torch.Tensor:
    """Block-scaled FP8 ``fc2(act(fc1(x)))`` with gradients (module docstring).

    Args:
        x: ``[*, h]`` bf16 / fp32 (per rank: the gathered sequence when sequence parallel); output ``[*, h_out]``
            in x's dtype, before any tensor-parallel reduction. With ``x_q``, only the gradient carrier.
        fc1_weight: ``[D, h]`` (``D = 2F`` for swiglu, ``[gate | up]``); fc2_weight ``[h_out, F]``; biases ``[D]``,
            ``[h_out]`` or None. ``h``, ``D``, ``F`` and ``h_out`` multiples of 128 (checked by the module).
        kind: ``"gelu"``, ``"relu"`` or ``"swiglu"``.
        fc1, fc2: the two GEMMs' :class:`LinearQuantizers` of ``BlockQuantizer`` objects.
        w1_q, w2_q: already cast weights ``(q, q_t)`` (FP8 weight caching); cast by the op when None.
        x_q: ``x`` already cast ``(q, q_t or None)``, rows padded to 128 (the fused norm,
            :func:`fp8engine.ops.block_norm.block_norm_cast`); needs the fused path.
        fuse_wgrad: weight gradients go to fp32 ``weight.main_grad``; ``.grad`` stays None.
        fused: the one-node op with the activation kernels (default: where the kernels run,
            :func:`~fp8engine.fp8.float8_tensor.use_kernels`); False: the three-node composition.
    Raises:
        TypeError: as :func:`~fp8engine.ops.block_linear.block_fp8_linear`. ValueError: ``x_q`` with
        ``fused=False``.
    """
    if fused is None:
        fused = use_kernels(x)
    if fused:
        for t in (x, fc1_weight, fc2_weight):
            if t.dtype not in BLOCK_DTYPES:
                raise TypeError(f"Float8BlockScaling: {t.dtype} tensor; the block-scaled GEMMs take bfloat16 or "
                                "float32 (use torch.autocast(dtype=torch.bfloat16) or bf16 parameters)")
        check_x_q(x_q, torch.is_grad_enabled() and (fc1_weight.requires_grad or fuse_wgrad), "block_fp8_mlp")
        return _BlockMLP.apply(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, x_q, w1_q, w2_q, fc1, fc2, kind,
                               fuse_wgrad)
    if x_q is not None:
        raise ValueError("block_fp8_mlp: x_q (a fused norm's FP8 output) needs the fused path (fused=True)")
    h = block_fp8_linear(x, fc1_weight, fc1_bias, fc1, w_q=w1_q, fuse_wgrad=fuse_wgrad)
    return block_fp8_linear(activation(h, kind), fc2_weight, fc2_bias, fc2, w_q=w2_q, fuse_wgrad=fuse_wgrad)
