"""The MLP's FP8 part, fc1 -> activation -> fc2, as one autograd op (:func:`fp8_mlp`), and the activation alone.

``_FP8MLP`` is organised around the six GEMMs (TransformerEngine's names):

- forward:  fc1 fprop ``h = x @ W1.T + b1`` -> activation writing fc2's FP8 input ``a`` -> fc2 fprop
  ``y = a @ W2.T + b2`` (GELU on a GPU: fc1's GEMM may write ``a`` itself, :func:`fc1_fprop_act`);
- backward: cast ``dy`` (with fc2's dbias) -> fc2 dgrad ``da = dy @ W2`` -> fc2 wgrad ``dW2 = dy.T @ a`` ->
  activation backward cast to FP8 (with fc1's dbias) -> fc1 dgrad ``dx = dh @ W1`` -> fc1 wgrad ``dW1 = dh.T @ x``.

Tensor parallelism (Megatron-LM's MLP): fc1 is column parallel, fc2 row parallel, each with its own
:class:`~fp8engine.ops.comm.LinearComm` (``fc1_comm``, ``fc2_comm``; None: no communication), called where
:func:`fp8engine.ops.linear.linear` calls them.

It keeps for backward only x^T (or, sequence parallel, this rank's FP8 shard of x) and W1^T (FP8), the
pre-activation ``h`` (high precision, for the activation backward), a^T and W2^T (FP8). The elementwise passes
run the backend the quantizers carry (``Quantizer.kernels``): the Triton kernels of ``fp8engine.kernels.activation``
/ ``.cast`` (activation forward writing FP8 directly, activation backward + cast-transpose + dbias in one pass),
elsewhere :func:`act_fwd` / :func:`act_bwd` and the torch casts -- on CPU exactly the ops of the unfused
composition ``fp8_linear -> activation_cast -> fp8_linear`` (:func:`_unfused_fp8_mlp`), so both give the same bits.

Block scaling (``Float8BlockScaling``): the same op with :class:`~fp8engine.fp8.block_quantizer.BlockQuantizer`
objects, whose FP8 tensors carry the block-scaled GEMMs and whose fused casts replace the activation kernels on the
kernel path (:mod:`fp8engine.kernels.block_activation`: fc2's 1 x 128-tiled input, fc1's gradient, each with its
re-tiled transpose; token rows zero-padded to 128).

``_ActCast`` (the activation alone) saves only its *input*; its FP8 output goes to the next GEMM as ``x_fp8``.

Activations (TransformerEngine's definitions):
- ``gelu``: tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.
- ``relu``: ``max(x, 0)``.
- ``swiglu``: input ``[..., 2F]`` split as ``[gate | up]``; ``silu(gate) * up`` -> ``[..., F]``
  (Shazeer 2020, "GLU Variants Improve Transformer").
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import LinearQuantizers, Quantizer
from fp8engine.ops.backward import backward_keeps_graph
from fp8engine.ops.gemm import fp8_gemm_bias_gelu
from fp8engine.ops.gemm_ops import gemm_bias_gelu_fp8
from fp8engine.ops.kernel_ops import (ACT_KINDS, act_bwd_dbias_amax, act_bwd_fp8, act_fwd_amax, act_fwd_fp8,
                                      compiled_kernel_ops)
from fp8engine.ops.comm import LinearComm
from fp8engine.ops.linear import dgrad_wgrad, fp8_linear, linear_input, output_leading_dims

__all__ = ["ACTIVATIONS", "act_fwd", "act_bwd", "activation", "activation_cast", "act_fwd_cast", "act_bwd_cast",
           "fc1_fprop_act", "fp8_mlp", "MLP_ROLES"]

#: Names accepted by the ``activation`` argument of the modules; the value is fc1's output width per ffn unit.
ACTIVATIONS = {"gelu": 1, "relu": 1, "swiglu": 2}

#: Rows of LayerNormMLP's :class:`~fp8engine.fp8.state.ScalingState`: fc1's GEMM uses rows 0-2, fc2's rows 3-5
#: (``FP8Module.fp8_begin()`` returns their two :class:`LinearQuantizers` in that order).
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
    def forward(ctx, x, kind, quantizer, transpose):
        y = act_fwd(x, kind)
        y_fp8 = None if quantizer is None else quantizer.quantize(y.reshape(-1, y.shape[-1]), transpose=transpose)
        ctx.save_for_backward(x)
        ctx.kind = kind
        return y, y_fp8

    @staticmethod
    def backward(ctx, dy, _unused):
        (x,) = ctx.saved_tensors
        return act_bwd(dy, x, ctx.kind), None, None, None


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """:func:`act_fwd` with gradients, saving only ``x``."""
    return _ActCast.apply(x, kind, None, False)[0]


def activation_cast(x: torch.Tensor, kind: str, quantizer: Quantizer,
                    transpose: bool) -> tuple[torch.Tensor, Float8Tensor]:
    """``(y, y_fp8)``: the activation and its FP8 copy ``[M, D']`` cast by ``quantizer`` (with the transpose for
    fc2's wgrad when ``transpose``)."""
    return _ActCast.apply(x, kind, quantizer, transpose)


def _compiled_op_args(h: torch.Tensor, quantizer: Quantizer) -> Optional[tuple]:
    """``(scale, amax)`` for the custom kernel ops (:mod:`fp8engine.ops.kernel_ops`) when ``torch.compile`` traces
    this call on CUDA, else None (the torch path). Delayed scaling with an amax to record: the state's views (the
    kernel writes FP8). Current scaling: ``(None, a zero [1] float32 amax)`` (the kernel writes high precision and
    the amax of what it wrote, then the cast op scales by that amax: eager mode's kernels)."""
    if not (compiled_kernel_ops(h) and quantizer.stats is None):
        return None
    if quantizer.kind == "current":
        return None, torch.zeros(1, dtype=torch.float32, device=h.device)
    if not quantizer.delayed or quantizer.state is None:
        return None
    scale, amax = quantizer.compiled_views()
    return None if amax is None else (scale, amax)


def act_fwd_cast(h: torch.Tensor, kind: str, quantizer: Quantizer, transpose: bool) -> Float8Tensor:
    """``act(h)`` for ``h [M, D]`` written only in FP8 (``[M, D']``, by ``quantizer``: fc2's input role), with
    its transposed copy when ``transpose``; the high-precision activation is not returned.

    Kernels, delayed scaling: the activation kernel writes FP8 directly (the quantizer's scale, amax into its
    history slot); the transpose is left to the first ``transpose_2d()`` call. Current scaling: the kernel writes
    high precision and the amax of what it wrote, then the cast-transpose. Traced by ``torch.compile`` on CUDA: the
    same kernels as custom ops (:mod:`fp8engine.ops.kernel_ops`). Torch: :func:`act_fwd` then ``quantizer.quantize``.
    """
    op_args = _compiled_op_args(h, quantizer)
    if op_args is not None:  # traced by torch.compile: our kernels as opaque ops
        scale, amax = op_args
        if scale is None:  # current scaling: as the kernel path below (the cast: a custom op too)
            return quantizer.quantize(act_fwd_amax(h.contiguous(), kind, amax), transpose=transpose, amax=amax)
        y8, scale_inv = act_fwd_fp8(h.contiguous(), kind, scale, quantizer.fp8_dtype, amax)
        return Float8Tensor(y8, scale_inv, h.dtype)
    if not quantizer.kernels:
        return quantizer.quantize(act_fwd(h, kind), transpose=transpose)
    from fp8engine.kernels import activation as ka

    fwd = getattr(ka, ACT_KINDS[kind][0])
    h = h.contiguous()
    if quantizer.stats is not None:  # stats recording counts the written act(h)
        return quantizer.quantize(fwd(h, return_hp=True)[0], transpose=transpose)
    if not quantizer.delayed:  # the activation kernel takes the amax of what it writes: no separate read
        if quantizer.cast_act is not None:  # or the quantizer's own fused activation cast (block scaling)
            a_fp8 = quantizer.cast_act(h, kind, transpose)
            if a_fp8 is not None:
                return a_fp8
        amax = torch.zeros(1, dtype=torch.float32, device=h.device)
        return quantizer.quantize(fwd(h, return_hp=True, amax_out=amax)[0], transpose=transpose, amax=amax)
    _, y8, scale_inv = fwd(h, scale=quantizer.scale, fp8_dtype=quantizer.fp8_dtype, amax_out=quantizer.amax)
    # the byte transpose (when ``transpose``) is left to the consumer's first ``transpose_2d()`` call, which comes
    # after its fprop GEMM was issued: the GEMM does not wait behind the transpose's launch on the host
    return Float8Tensor(y8, scale_inv, h.dtype, kernels=True)


def act_bwd_cast(da: torch.Tensor, h: torch.Tensor, kind: str, quantizer: Quantizer, *,
                 transpose: bool, dbias: bool) -> tuple[Float8Tensor, Optional[torch.Tensor]]:
    """Gradient ``dh = da * act'(h)`` (``da [M, D']``, ``h [M, D]``, same dtype) cast to FP8 by ``quantizer``
    (fc1's grad_output role: backward format, amax recorded under delayed scaling), with its transpose when
    ``transpose`` and its column sums when ``dbias``: ``(dh_fp8, dbias [D] in da.dtype or None)``.

    Kernels, delayed scaling: one ``*_bwd_cast_transpose`` pass (both FP8 layouts, fp32-accumulated dbias).
    Current scaling: its high-precision variant (dh, dbias and the amax of the dh written), then the cast-transpose.
    Traced by ``torch.compile`` on CUDA: the same kernels as custom ops (:mod:`fp8engine.ops.kernel_ops`).
    Torch: :func:`act_bwd` then ``quantizer.quantize_dbias``.
    """
    op_args = _compiled_op_args(h, quantizer)
    if op_args is not None:  # traced by torch.compile: our kernels as opaque ops
        scale, amax = op_args
        if scale is None:  # current scaling: as the kernel path below (the cast: a custom op too)
            dh, db = act_bwd_dbias_amax(da.contiguous(), h.contiguous(), kind, amax)
            return quantizer.quantize(dh, transpose=transpose, amax=amax), (db if dbias else None)
        dh8, dh8_t, scale_inv, db = act_bwd_fp8(da.contiguous(), h.contiguous(), kind, scale, quantizer.fp8_dtype,
                                                amax)
        return Float8Tensor(dh8, scale_inv, da.dtype, dh8_t), (db if dbias else None)
    if not quantizer.kernels:
        return quantizer.quantize_dbias(act_bwd(da, h, kind), transpose=transpose, dbias=dbias)
    from fp8engine.kernels import activation as ka

    bwd = getattr(ka, ACT_KINDS[kind][1])
    da, h = da.contiguous(), h.contiguous()
    if not quantizer.delayed or quantizer.stats is not None:  # stats recording counts the written dh
        if quantizer.cast_act_grad is not None:  # the quantizer's own fused cast (block scaling)
            out = quantizer.cast_act_grad(da, h, kind, transpose=transpose, dbias=dbias)
            if out is not None:
                return out
        # current scaling: the kernel takes the amax of the dh it writes (no separate read of dh)
        amax = None if quantizer.stats is not None else torch.zeros(1, dtype=torch.float32, device=h.device)
        dh, _, _, db = bwd(da, h, None, None, amax)
        return quantizer.quantize(dh, transpose=transpose, amax=amax), (db if dbias else None)
    dh8, dh8_t, scale_inv, db = bwd(da, h, quantizer.scale, quantizer.fp8_dtype, quantizer.amax)
    return Float8Tensor(dh8, scale_inv, da.dtype, dh8_t, kernels=True), (db if dbias else None)


#: fc1 outputs (tokens x F) with at least this many elements take the GELU epilogue by default
#: (``gelu_epilogue=None``), smaller ones the GEMM + the activation kernel. Chosen from docs/benchmarks.md: the
#: epilogue saves one pass over ``h`` on the GPU, which pays only at the largest layers (2^27 elements: 11.21 against
#: 11.60 ms per step on H200; 2^26: no gain), while it costs about 80 us more host work per call.
GELU_EPILOGUE_MIN_ELEMENTS = 1 << 27


def use_gelu_epilogue(gelu_epilogue: Optional[bool], tokens: int, ffn: int) -> bool:
    """Whether fc1 asks for the GELU epilogue: ``gelu_epilogue`` when set, else (None) where its output
    ``[tokens, ffn]`` has at least :data:`GELU_EPILOGUE_MIN_ELEMENTS` elements."""
    return gelu_epilogue if gelu_epilogue is not None else tokens * ffn >= GELU_EPILOGUE_MIN_ELEMENTS


def fc1_fprop_act(x_fp8: Float8Tensor, w1_fp8: Float8Tensor, b1: Optional[torch.Tensor], out_dtype: torch.dtype,
                  kind: str, quantizer: Quantizer, *, transpose: bool,
                  gelu_epilogue: Optional[bool] = None) -> tuple[torch.Tensor, Float8Tensor]:
    """fc1 fprop ``h = x @ W1.T + b1`` (``[M, D]`` in ``out_dtype``) and the activation written in FP8 for fc2
    (by ``quantizer``, fc2's input role; its transpose when ``transpose``): ``(h, a_fp8)``.

    With the epilogue asked for (``gelu_epilogue``: True; None: by the output's size, :func:`use_gelu_epilogue`),
    GELU, a bias, delayed scaling and a GPU whose cuBLASLt has the kernel, one GEMM with the GELU epilogue writes
    both (:func:`fp8engine.ops.gemm.fp8_gemm_bias_gelu`; traced by ``torch.compile`` on CUDA, the custom op
    :func:`~fp8engine.ops.gemm_ops.gemm_bias_gelu_fp8`, which falls back inside itself); otherwise fc1's fprop then
    :func:`act_fwd_cast`.
    """
    # not while FP8 stats record: they need the high-precision activation
    if (kind == "gelu" and b1 is not None and quantizer.delayed and quantizer.stats is None
            and use_gelu_epilogue(gelu_epilogue, x_fp8.data.numel() // max(x_fp8.shape[-1], 1), w1_fp8.shape[0])):
        if quantizer.kernels:
            fused = fp8_gemm_bias_gelu(x_fp8, w1_fp8, b1, out_dtype, quantizer.scale, quantizer.fp8_dtype,
                                       quantizer.amax)
            if fused is not None:
                return fused  # a^T is made by the consumer's first transpose_2d() call, as in act_fwd_cast
        else:
            op_args = _compiled_op_args(x_fp8.data, quantizer)
            if op_args is not None:  # traced by torch.compile on CUDA: the epilogue GEMM as an opaque op
                scale, amax = op_args  # the state's views (delayed scaling)
                h, y8, scale_inv = gemm_bias_gelu_fp8(x_fp8.data.reshape(-1, x_fp8.shape[-1]), x_fp8.scale_inv,
                                                      w1_fp8.data, w1_fp8.scale_inv, b1, out_dtype, scale,
                                                      quantizer.fp8_dtype, amax)
                return h, Float8Tensor(y8, scale_inv, out_dtype)
    h = x_fp8.fprop(w1_fp8, out_dtype, b1)
    return h, act_fwd_cast(h, kind, quantizer, transpose=transpose)


class _FP8MLP(torch.autograd.Function):
    """``y = fc2(act(fc1(x)))`` with FP8 GEMMs; see the module docstring for the GEMMs and what is saved."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, x_fp8: Float8Tensor, w1_fp8: Float8Tensor, w2_fp8: Float8Tensor,
                fc1: LinearQuantizers, fc2: LinearQuantizers, kind: str, fuse_wgrad: bool,
                gelu_epilogue: Optional[bool],
                fc1_comm: Optional[LinearComm] = None, fc2_comm: Optional[LinearComm] = None,
                x_shard: Optional[Float8Tensor] = None):
        need_x, need_w1, need_b1, need_w2 = ctx.needs_input_grad[:4]
        need_dw1, need_dw2 = need_w1 or fuse_wgrad, need_w2 or fuse_wgrad
        need_dh = need_x or need_dw1 or need_b1  # anything upstream of the activation
        # fc1 fprop h = x @ W1.T + b1 and the activation, written in FP8 for fc2 (with a^T for fc2's wgrad)
        h, a_fp8 = fc1_fprop_act(x_fp8, w1_fp8, b1, x.dtype, kind, fc2.input, transpose=need_dw2,
                                 gelu_epilogue=gelu_epilogue)
        # fc2 fprop: y = a @ W2.T + b2 (row parallel: b2 added after the reduction over the ranks)
        row = fc2_comm is not None and fc2_comm.reduces_output
        y = a_fp8.fprop(w2_fp8, x.dtype, None if b2 is None or row else b2)
        if row:
            y = fc2_comm.reduce_output(y)
            if b2 is not None:
                y = y + b2.to(y.dtype)
        ctx.save_for_backward(w1, w2, h if need_dh else None)
        ctx.x_shard = x_shard if need_dw1 else None  # re-gathered in backward instead of keeping x^T
        ctx.x_t = x_fp8.t_operand() if need_dw1 and x_shard is None else None
        ctx.w1_t = w1_fp8.t_operand() if need_x else None
        ctx.a_t = a_fp8.t_operand() if need_dw2 else None
        ctx.w2_t = w2_fp8.t_operand() if need_dh else None
        ctx.grad_q1, ctx.grad_q2, ctx.kind, ctx.fuse_wgrad = fc1.grad_output, fc2.grad_output, kind, fuse_wgrad
        ctx.x_shape, ctx.comms = x.shape, (fc1_comm, fc2_comm)
        return y.reshape(*output_leading_dims(x, y.shape[0]), y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        w1, w2, h = ctx.saved_tensors
        need_b1, need_b2 = ctx.needs_input_grad[2], ctx.needs_input_grad[4]
        fuse, (fc1_comm, fc2_comm) = ctx.fuse_wgrad, ctx.comms
        dy2d, db2 = dy.reshape(-1, dy.shape[-1]), None
        if fc2_comm is not None and fc2_comm.reduces_output:
            if need_b2:  # b2 was added to this rank's rows after the reduction
                db2 = dy2d.sum(0, dtype=torch.float32)  # (to dy.dtype below)
            need_b2 = False
            dy2d = fc2_comm.gather_output_grad(dy2d)
        # fc2: cast dy (+ fc2 dbias), dgrad da = dy @ W2, wgrad dW2 = dy.T @ a
        dy_fp8, db2_fused = ctx.grad_q2.quantize_dbias(dy2d, transpose=ctx.a_t is not None, dbias=need_b2)
        db2 = db2 if db2_fused is None else db2_fused
        da, dw2 = dgrad_wgrad(dy_fp8, ctx.w2_t, ctx.a_t, w2, fuse)
        dx = dw1 = db1 = None
        if da is not None:
            # activation backward cast to FP8 (+ fc1 dbias), fc1 dgrad dx = dh @ W1 (its communication overlapped
            # with the wgrad), wgrad dW1 = dh.T @ x
            need_dw1 = ctx.x_t is not None or ctx.x_shard is not None
            dh_fp8, db1 = act_bwd_cast(da, h, ctx.kind, ctx.grad_q1, transpose=need_dw1, dbias=need_b1)
            dx, dw1 = dgrad_wgrad(dh_fp8, ctx.w1_t, ctx.x_t, w1, fuse, comm=fc1_comm, x_shard=ctx.x_shard)
            if dx is not None:
                dx = dx.reshape(ctx.x_shape)
            if db1 is not None:
                db1 = db1.to(da.dtype)
        if db2 is not None:
            db2 = db2.to(dy.dtype)
        if not backward_keeps_graph("the FP8 MLP"):  # (kept for another backward under retain_graph)
            ctx.x_t = ctx.w1_t = ctx.a_t = ctx.w2_t = ctx.x_shard = None
        return dx, dw1, db1, dw2, db2, None, None, None, None, None, None, None, None, None, None, None


def fp8_mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: Optional[torch.Tensor], fc2_weight: torch.Tensor,
            fc2_bias: Optional[torch.Tensor], kind: str, fc1: LinearQuantizers, fc2: LinearQuantizers, *,
            w1_fp8: Optional[Float8Tensor] = None, w2_fp8: Optional[Float8Tensor] = None,
            x_fp8: Optional[Float8Tensor] = None, fuse_wgrad: bool = False,
            gelu_epilogue: Optional[bool] = None, fc1_comm: Optional[LinearComm] = None,
            fc2_comm: Optional[LinearComm] = None) -> torch.Tensor:
    """FP8 ``fc2(act(fc1(x)))`` with gradients, as one autograd node.

    Args:
        x: ``[*, h]`` high precision: per rank ``[s, b, h]``, or ``[s/tp, b, h]`` when ``fc1_comm`` all-gathers it
            (sequence parallel). Output in ``x.dtype``: ``[*, h_out]``; with ``fc2_comm`` (row parallel) summed over
            the ranks (``[s/tp, b, h_out]`` with sequence parallelism) and ``fc2_bias`` added after the sum.
        fc1_weight: ``[D, h]`` (``D = 2F`` for swiglu, ``[gate | up]``); fc2_weight ``[h_out, F]``; biases ``[D]``,
            ``[h_out]`` or None. All dims multiples of 16.
        kind: ``"gelu"``, ``"relu"`` or ``"swiglu"``.
        fc1, fc2: the two GEMMs' :class:`LinearQuantizers` (``fc2.input`` casts the activation).
        w1_fp8, w2_fp8: already cast weights (FP8 weight caching), with their transposes when a backward may run;
            cast now when None. x_fp8: ``x`` already cast (by the norm kernel); cast now when None.
        fuse_wgrad: weight gradients go to fp32 ``weight.main_grad``; ``.grad`` stays None.
        gelu_epilogue: let fc1's GEMM apply GELU and write the FP8 activation where it can: True; None (default):
            where fc1's output is large enough to gain from it (:func:`use_gelu_epilogue`); False: never
            (:func:`fc1_fprop_act`).
        fc1_comm, fc2_comm: the :class:`~fp8engine.ops.comm.LinearComm` of fc1 (column parallel) and fc2 (row
            parallel), or None.
    Raises:
        ValueError: ``x_fp8`` given while ``fc1_comm`` all-gathers the input (:func:`linear_input`).
    """
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or fc1_weight.requires_grad
                                              or fc2_weight.requires_grad)
    x_fp8, x_shard = linear_input(x, fc1.input, x_fp8, fc1_comm, needs_grad)
    if w1_fp8 is None:
        w1_fp8 = fc1.weight.quantize(fc1_weight, transpose=needs_grad)
    if w2_fp8 is None:
        w2_fp8 = fc2.weight.quantize(fc2_weight, transpose=needs_grad)
    return _FP8MLP.apply(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, x_fp8, w1_fp8, w2_fp8, fc1, fc2, kind,
                         fuse_wgrad, gelu_epilogue, fc1_comm, fc2_comm, x_shard)


def _unfused_fp8_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, kind, fc1, fc2, *, w1_fp8=None,
                     w2_fp8=None, x_fp8=None, fuse_wgrad=False, gelu_epilogue=None, fc1_comm=None,
                     fc2_comm=None) -> torch.Tensor:
    """:func:`fp8_mlp` as three autograd nodes, ``fp8_linear -> activation_cast -> fp8_linear`` (``LayerNormMLP``'s
    ``fused=False``; the fused op matches it bit for bit on CPU). ``gelu_epilogue`` is accepted and ignored."""
    if w1_fp8 is None:
        w1_fp8 = fc1.weight.quantize(fc1_weight, transpose=torch.is_grad_enabled())
    if w2_fp8 is None:
        w2_fp8 = fc2.weight.quantize(fc2_weight, transpose=torch.is_grad_enabled())
    h = fp8_linear(x, fc1_weight, fc1_bias, fc1, w_fp8=w1_fp8, x_fp8=x_fp8, fuse_wgrad=fuse_wgrad, comm=fc1_comm)
    a, a_fp8 = activation_cast(h, kind, fc2.input, transpose=torch.is_grad_enabled())
    return fp8_linear(a, fc2_weight, fc2_bias, fc2, w_fp8=w2_fp8, x_fp8=a_fp8, fuse_wgrad=fuse_wgrad,
                      comm=fc2_comm)
