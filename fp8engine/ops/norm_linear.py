"""LayerNorm / RMSNorm as one autograd op, optionally writing its output in FP8 for the GEMM that follows.

The norm math lives in exactly two functions, :func:`norm_fwd` and :func:`norm_bwd` (the dispatch points: the
Triton kernels of ``fp8engine.kernels.norm`` on CUDA, PyTorch's own fused norms elsewhere). ``_NormCast`` is the
autograd node; a norm followed by an FP8 GEMM (LayerNormLinear, LayerNormMLP) hands the FP8 output it produced to
:func:`fp8engine.ops.linear.fp8_linear` as ``x_fp8``, so the norm output is cast once and never saved in high
precision for backward (the node saves the norm *input*, mean and rstd; the GEMM saves the FP8 copy).

Formulas (TransformerEngine / Apex): ``LayerNorm: y = (x - mean) * rstd * gamma + beta``,
``RMSNorm: y = x * rstd * gamma``, ``rstd = 1 / sqrt(var + eps)`` (var = mean((x - mean)^2), or mean(x^2) for RMS),
``gamma = weight`` or ``1 + weight`` with ``zero_centered_gamma``.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import Quantizer
from fp8engine.ops.kernel_ops import compiled_kernel_ops, norm_bwd as norm_bwd_op, norm_fwd_fp8

__all__ = ["norm", "norm_cast", "norm_fwd", "norm_bwd", "NORMALIZATIONS"]

#: Names accepted by the ``normalization`` argument of the modules.
NORMALIZATIONS = ("LayerNorm", "RMSNorm")

_HAS_FUSED_RMS = hasattr(torch, "_fused_rms_norm")  # torch >= 2.8: the kernel F.rms_norm runs


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    return weight + 1 if zero_centered_gamma else weight


def norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, *, rms: bool,
             zero_centered_gamma: bool, quantizer: Optional[Quantizer] = None, transpose: bool = False,
             return_hp: bool = True, residual: Optional[torch.Tensor] = None, placeholder: bool = True,
             kernels: bool = False):
    """Normalise the last dim of ``x`` and, with a ``quantizer``, cast the result to FP8.

    Args:
        x: ``[..., N]`` float32/bfloat16/float16. weight, bias: ``[N]`` (bias None for RMSNorm).
        quantizer: the :class:`Quantizer` of the FP8 output (the next GEMM's input role), or None.
        transpose: also make the FP8 output's transpose (for wgrad; with the fused kernel the byte transpose is
            deferred to the first ``y_fp8.transpose_2d()`` call).
        return_hp: False when only the FP8 copy is consumed: the fused kernel (delayed scaling) then skips writing
            the high-precision output and ``y`` is a placeholder of the right shape and dtype whose values must
            not be read (it only carries the gradient back to this op, see :class:`_NormCast`); with
            ``placeholder=False`` it is None instead (a caller that consumes only ``y_fp8``, no autograd output).
        residual: optional ``[..., N]`` like ``x``: normalise ``x + residual`` (the residual connection in front
            of a pre-norm sublayer; in the norm kernel on CUDA, torch's add elsewhere).
        kernels: the backend, chosen by the caller (the quantizer's ``kernels``, or the one :func:`norm` got): the
            Triton norm kernels, or ATen's norm and the quantizer's cast.
    Returns:
        ``(y [..., N] in x.dtype, y_fp8 Float8Tensor [M, N] or None, mean or None, rstd, s)``; ``s`` is the
        normalised tensor (``x``, or ``x + residual``); mean/rstd are opaque to callers (only :func:`norm_bwd`
        reads them; their layout depends on the path taken).
    """
    if _op_path(x, quantizer, rms):  # traced by torch.compile: the fused kernel as a custom op
        x = x.contiguous()
        fused = _fuses_cast(x, quantizer)
        scale = amax = None
        if fused:
            scale, amax = quantizer.compiled_views()
        elif _kernel_amax(x, quantizer):  # current scaling: the amax of the y the kernel writes, as below
            amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        return_hp = return_hp or not fused
        y, y8, scale_inv, mean, rstd, s = norm_fwd_fp8(x, weight, bias, None if residual is None else
                                                       residual.contiguous(), eps, rms, zero_centered_gamma, scale,
                                                       quantizer.fp8_dtype if fused else None, amax, return_hp)
        s = x if residual is None else s
        if not return_hp:  # gradient carrier only, as below
            y = s.new_empty(()).expand(s.shape)
        y_fp8 = None
        if fused:
            y_fp8 = Float8Tensor(y8.reshape(-1, y8.shape[-1]), scale_inv, x.dtype)
        elif quantizer is not None:  # amax None: computed in the graph by the cast
            y_fp8 = quantizer.quantize(y.reshape(-1, y.shape[-1]), transpose=transpose, amax=amax)
        return y, y_fp8, mean, rstd, s
    if kernels:  # Triton: normalisation and FP8 cast (delayed scaling) in one pass over x
        from fp8engine.kernels import norm as kn

        x = x.contiguous()
        res = {} if residual is None else dict(residual=residual.contiguous(), residual_out=torch.empty_like(x))
        # fused cast for delayed scaling; current scaling (the kernel also takes the amax of the y it writes) and
        # FP8 stats recording (fp8engine.fp8.stats: counts need y) write y and cast it separately; block scaling
        # has its own norm kernel writing the 1 x 128-tiled copy (rows padded) and its re-tiled transpose
        delayed = quantizer is not None and quantizer.delayed and quantizer.stats is None
        if not delayed and quantizer is not None and quantizer.cast_norm is not None:
            y, y_fp8, mean, rstd = quantizer.cast_norm(x, weight, bias, eps, rms=rms, transpose=transpose,
                                                       zero_centered_gamma=zero_centered_gamma,
                                                       return_hp=return_hp, res=res)
            s = res.get("residual_out", x)
            if y is None and placeholder:  # gradient carrier only, as below
                y = s.new_empty(()).expand(s.shape)
            return y, y_fp8, mean, rstd, s
        return_hp = return_hp or not delayed  # the separate cast reads y
        scale = fp8_dtype = amax_out = None
        if delayed:
            scale, fp8_dtype, amax_out = quantizer.scale, quantizer.fp8_dtype, quantizer.amax
        elif quantizer is not None and not quantizer.delayed and quantizer.stats is None:
            amax_out = torch.zeros(1, dtype=torch.float32, device=x.device)
        if rms:
            y, y8, scale_inv, rstd = kn.rmsnorm_fwd(x, weight, eps, zero_centered_gamma=zero_centered_gamma,
                                                    scale=scale, fp8_dtype=fp8_dtype, amax_out=amax_out,
                                                    return_hp=return_hp, **res)
            mean = None
        else:
            y, y8, scale_inv, mean, rstd = kn.layernorm_fwd(x, weight, bias, eps,
                                                            zero_centered_gamma=zero_centered_gamma, scale=scale,
                                                            fp8_dtype=fp8_dtype, amax_out=amax_out,
                                                            return_hp=return_hp, **res)
        if residual is not None:
            x = res["residual_out"]
        if y is None and placeholder:  # gradient carrier only: one element broadcast to y's shape, no [M, N]
            y = x.new_empty(()).expand(x.shape)
        y_fp8 = None
        if delayed:
            # its transpose (``transpose``) is made by the consumer's first transpose_2d() call, after the consumer's
            # fprop GEMM was issued (at the start of a step the host launches the GEMM one launch earlier)
            y_fp8 = Float8Tensor(y8.reshape(-1, y8.shape[-1]), scale_inv, x.dtype, kernels=True)
        elif quantizer is not None:  # current scaling: the amax of the y the kernel wrote (no separate read)
            y_fp8 = quantizer.quantize(y.reshape(-1, y.shape[-1]), transpose=transpose, amax=amax_out)
        return y, y_fp8, mean, rstd, x
    if residual is not None:
        x = x + residual
    gamma = _gamma(weight, zero_centered_gamma)
    shape = (x.shape[-1],)
    if not rms:
        y, mean, rstd = torch.native_layer_norm(x, shape, gamma, bias, eps)
    elif _HAS_FUSED_RMS:  # (traced by torch.compile, RMSNorm takes the op path above: _op_path)
        (y, rstd), mean = torch._fused_rms_norm(x, shape, gamma, eps), None
    else:  # older torch: fp32 math, as the kernel reference
        mean, rstd = None, torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        y = (x.float() * rstd * gamma.float()).to(x.dtype)
    y_fp8 = None
    if quantizer is not None:
        y_fp8 = quantizer.quantize(y.reshape(-1, shape[0]), transpose=transpose)
    return y, y_fp8, mean, rstd, x


def _fuses_cast(x: torch.Tensor, quantizer: Optional[Quantizer]) -> bool:
    """The compiled norm kernel writes the FP8 copy itself: delayed scaling (scale known before the kernel), no
    stats recording, on CUDA (:func:`~fp8engine.ops.kernel_ops.compiled_kernel_ops`)."""
    return (quantizer is not None and quantizer.delayed and quantizer.stats is None and quantizer.state is not None
            and compiled_kernel_ops(x))


def _kernel_amax(x: torch.Tensor, quantizer: Optional[Quantizer]) -> bool:
    """The compiled norm kernel writes y and the amax of the values it wrote, and the cast op scales by that amax
    (current scaling, no stats recording, on CUDA): what eager mode runs on CUDA, with no separate amax read of y."""
    return (quantizer is not None and quantizer.kind == "current" and quantizer.stats is None
            and compiled_kernel_ops(x))


def _op_path(x: torch.Tensor, quantizer: Optional[Quantizer], rms: bool) -> bool:
    """True when :func:`norm_fwd` runs the norm kernel as a custom op (:mod:`fp8engine.ops.kernel_ops`): traced by
    ``torch.compile`` and either fusing the FP8 cast (:func:`_fuses_cast`), or taking the amax for current scaling's
    cast (:func:`_kernel_amax`), or RMSNorm on any device (Dynamo cannot trace ``torch._fused_rms_norm``, and
    traced the fp32-math RMSNorm wrongly in torch 2.11; the op runs the kernel on CUDA, its reference elsewhere). Its
    mean / rstd then have the kernel's layout, which :func:`norm_bwd` is told with ``op_path``."""
    return torch.compiler.is_compiling() and (rms or _fuses_cast(x, quantizer) or _kernel_amax(x, quantizer))


def norm_bwd(dy: torch.Tensor, x: torch.Tensor, mean, rstd, weight: torch.Tensor, *, rms: bool,
             zero_centered_gamma: bool, has_bias: bool, dresidual: Optional[torch.Tensor] = None,
             op_path: bool = False, kernels: bool = False):
    """Gradients ``(dx [..., N] in x.dtype, dweight [N], dbias [N] or None)`` of :func:`norm_fwd`'s ``y``
    (``d/dweight`` equals ``d/dgamma``, also with ``zero_centered_gamma``); ``x`` is the normalised tensor.
    ``dresidual`` (like x): a gradient reaching ``x`` by another path, added to dx (in the kernel on CUDA).
    ``op_path``: the forward ran the custom op (:func:`_op_path`): the backward kernel runs as one too;
    ``kernels``: the forward's backend (:func:`norm_fwd`)."""
    if op_path or kernels:
        dy, x = dy.contiguous(), x.contiguous()
        dres = None if dresidual is None else dresidual.contiguous()
        if op_path:
            dx, dw, db = norm_bwd_op(dy, x, mean, rstd, weight, dres, rms, zero_centered_gamma)
            return dx, dw, (None if rms else db)
        from fp8engine.kernels import norm as kn

        if rms:
            dx, dw = kn.rmsnorm_bwd(dy, x, rstd, weight, zero_centered_gamma=zero_centered_gamma, dresidual=dres)
            return dx, dw, None
        return kn.layernorm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma=zero_centered_gamma, dresidual=dres)
    gamma = _gamma(weight, zero_centered_gamma)
    if not rms:
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, (x.shape[-1],), mean, rstd, gamma,
                                                               gamma if has_bias else None, [True, True, has_bias])
    else:  # fp32 math (ATen's fused RMSNorm backward has no CPU kernel in torch 2.13)
        xhat = x.float() * rstd
        wdy = dy.float() * gamma.float()
        dx = rstd * (wdy - xhat * (xhat * wdy).mean(-1, keepdim=True))
        dw = (dy.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
        dx, dw, db = dx.to(x.dtype), dw.to(weight.dtype), None
    return (dx if dresidual is None else dx + dresidual), dw, db


class _NormCast(torch.autograd.Function):
    """``y, y_fp8, s = norm(x [+ residual])``; backward takes ``dy`` for ``y`` (the FP8 copy's consumer routes its
    gradient through ``y``, see :func:`fp8engine.ops.linear.fp8_linear`) and ``ds`` for the normalised tensor
    ``s`` (``x`` itself, or ``x + residual``), which the norm backward adds to dx: a residual connection that
    also reads ``s`` costs no separate gradient add."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, zero_centered_gamma, quantizer, transpose, return_hp, residual,
                kernels):
        y, y_fp8, mean, rstd, s = norm_fwd(x, weight, bias, eps, rms=rms, zero_centered_gamma=zero_centered_gamma,
                                           quantizer=quantizer, transpose=transpose, return_hp=return_hp,
                                           residual=residual, kernels=kernels)
        ctx.set_materialize_grads(False)  # an unused s gets no zero-filled gradient
        ctx.save_for_backward(s, weight, mean, rstd)
        ctx.rms, ctx.zero_centered_gamma, ctx.has_bias = rms, zero_centered_gamma, bias is not None
        ctx.has_residual = residual is not None
        ctx.op_path, ctx.kernels = _op_path(x, quantizer, rms), kernels
        return y, y_fp8, s

    @staticmethod
    def backward(ctx, dy, _unused, ds):
        s, weight, mean, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(s)
        dx, dw, db = norm_bwd(dy, s, mean, rstd, weight, rms=ctx.rms, zero_centered_gamma=ctx.zero_centered_gamma,
                              has_bias=ctx.has_bias, dresidual=ds, op_path=ctx.op_path, kernels=ctx.kernels)
        return dx, dw, db, None, None, None, None, None, None, (dx if ctx.has_residual else None), None


def _same_dtype(x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple:
    """``(x, residual)`` in ``torch.promote_types`` of their dtypes (the norm kernels add two tensors of one dtype;
    ``.to`` carries the gradients back to each one's own dtype)."""
    if residual is None or residual.dtype == x.dtype:
        return x, residual
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return x.to(dtype), residual.to(dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, *, rms: bool, kernels: bool,
         zero_centered_gamma: bool = False, residual: Optional[torch.Tensor] = None, return_input: bool = False):
    """LayerNorm (``rms=False``) or RMSNorm of the last dim; ``x [..., N]`` -> ``[..., N]`` in ``x.dtype``.
    Eager on CPU with ``kernels=False`` this is exactly ``F.layer_norm`` / ``F.rms_norm`` (same ATen kernels).

    ``residual`` (like x): normalise ``x + residual``. ``return_input``: return ``(y, s)`` with ``s`` the
    normalised tensor (``x`` or ``x + residual``), whose gradient is added inside the norm's backward. A
    ``residual`` of another dtype (an fp32 residual stream beside a bf16 branch under ``torch.autocast``) is
    added as PyTorch's ``x + residual`` would: both in the promoted dtype, which ``y`` and ``s`` then have.
    ``kernels``: the backend, the caller's choice (:func:`~fp8engine.fp8.quantizer.call_kernels`): True the Triton
    norm kernels, False ATen's."""
    x, residual = _same_dtype(x, residual)
    y, _, s = _NormCast.apply(x, weight, bias, eps, rms, zero_centered_gamma, None, False, True, residual, kernels)
    return (y, s) if return_input else y


def norm_cast(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, *, rms: bool,
              zero_centered_gamma: bool, quantizer: Quantizer, transpose: bool, return_hp: bool = True,
              residual: Optional[torch.Tensor] = None, return_input: bool = False) -> tuple:
    """:func:`norm` plus the FP8 copy ``[M, N]`` of its output cast by ``quantizer`` (with its transpose
    when ``transpose``, for the wgrad of the GEMM that consumes it). Returns ``(y, y_fp8)``, or ``(y, y_fp8, s)``
    with ``return_input`` (``residual``, its dtype promotion and ``s`` as in :func:`norm`). ``return_hp=False``: the
    caller consumes only ``y_fp8`` and ``y`` just carries its gradient (:func:`norm_fwd`)."""
    x, residual = _same_dtype(x, residual)
    y, y_fp8, s = _NormCast.apply(x, weight, bias, eps, rms, zero_centered_gamma, quantizer, transpose,
                                  return_hp, residual, quantizer.kernels)
    return (y, y_fp8, s) if return_input else (y, y_fp8)
