"""The fused Triton kernels as ``torch.library`` custom ops, for code under ``torch.compile``.

Eager code calls the kernels' Python launchers directly (:func:`fp8engine.fp8.float8_tensor.use_kernels`). Dynamo
cannot trace those launchers, so under ``torch.compile`` the ops would take their plain-PyTorch path and Inductor
would generate the kernels, which is slower (``python tools/compile_kernel_profile.py``, ``python
tools/step_profile.py --mode fp8-delayed-compile --kernels``). The ops below are opaque to Inductor: the compiled
graph calls our kernels (CUDA) or their plain-PyTorch references (any other device), with the same bits.

Each op declares what it mutates (``mutates_args``: the amax slot it max-accumulates into, a view of
``ScalingState.amax_history`` in a compiled forward or of ``grad_amax`` in a compiled backward under delayed
scaling, a zero-filled ``[1]`` buffer made in the graph under current scaling) and has a fake implementation giving
the output shapes and dtypes, so AOTAutograd functionalizes the mutation as it does the reference path's.

The ops: the activations (delayed scaling: written in FP8, :func:`act_fwd_fp8` / :func:`act_bwd_fp8`; current
scaling: written in high precision with its amax, :func:`act_fwd_amax` / :func:`act_bwd_dbias_amax`), the casts
(:func:`cast_fp8`, :func:`cast_transpose_dbias_fp8`, re-exported from :mod:`fp8engine.fp8.cast_ops`), LayerNorm /
RMSNorm (:func:`norm_fwd_fp8`, :func:`norm_bwd`), the fused QKV projection's rotary embedding (:func:`rope_qk`) and
its output gradient's cast with the rotation's gradient inside (:func:`qkv_grad_cast_fp8`, delayed scaling).

Current scaling runs what eager mode runs on CUDA: the norm / activation kernel writes high precision and takes the
amax of the values it wrote in the same pass, then :func:`cast_fp8` derives the scale from that amax on the device
(``scale_from_amax``) and casts: same kernels, same bits as eager mode, and nothing between the kernels for Inductor
to generate but the zero fill of the amax buffers.

Outputs a call does not produce are returned as empty ``[0]`` tensors (a custom op's outputs are tensors, never
aliases of its inputs). The cuBLASLt GEMMs have their ops in :mod:`fp8engine.ops.gemm_ops`.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8engine.fp8.cast_ops import (  # noqa: F401 (the cast ops live in the fp8 layer: the Quantizer calls them)
    _none_as_empty, _scale_inv_like, cast_fp8, cast_transpose_dbias_fp8, compiled_kernel_ops)
from fp8engine.fp8.library import kernel_op
from fp8engine.ops.rotary import rotate_views, unrotate_grads

__all__ = ["act_fwd_fp8", "act_bwd_fp8", "act_fwd_amax", "act_bwd_dbias_amax", "cast_fp8", "cast_transpose_dbias_fp8",
           "norm_fwd_fp8", "norm_bwd", "rope_qk", "qkv_grad_cast_fp8", "ACT_KINDS", "compiled_kernel_ops"]

#: Activations with fused kernels, and the names of their launchers in fp8engine.kernels.activation:
#: (forward, backward + cast-transpose + dbias); the references are the same names + ``_reference``.
ACT_KINDS = {"gelu": ("gelu_fwd", "gelu_bwd_cast_transpose"), "relu": ("relu_fwd", "relu_bwd_cast_transpose"),
             "swiglu": ("swiglu_fwd", "swiglu_bwd_cast_transpose")}


def _launcher(kind: str, which: int, device: torch.device):
    from fp8engine.kernels import activation as ka

    if kind not in ACT_KINDS:
        raise ValueError(f"activation must be one of {sorted(ACT_KINDS)}, got {kind!r}")
    name = ACT_KINDS[kind][which]
    return getattr(ka, name if device.type == "cuda" else name + "_reference")


def _act_out_shape(h: torch.Tensor, kind: str) -> tuple:
    n = h.shape[-1] // 2 if kind == "swiglu" else h.shape[-1]
    return (*h.shape[:-1], n)


@kernel_op("act_fwd_fp8", mutates_args=("amax",))
def act_fwd_fp8(h: torch.Tensor, kind: str, scale: torch.Tensor, fp8_dtype: torch.dtype,
                amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``act(h)`` written in FP8: ``(y8, scale_inv)``.

    Args:
        h: ``[*, D]`` bf16 / fp16 / fp32, contiguous (SwiGLU: ``D = 2 N``, ``[gate | up]``).
        kind: ``"gelu"`` (tanh approximation), ``"relu"`` or ``"swiglu"``.
        scale: ``[1]`` float32 FP8 scale (delayed scaling's, for this role).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        amax: ``[1]`` float32, max-accumulated with ``max |act(h)|`` in place.
    Returns:
        ``y8 [*, D']`` in ``fp8_dtype`` (``D' = N`` for SwiGLU, else ``D``), ``scale_inv [1]`` float32 (``1 / scale``).
    Errors are the launcher's (:mod:`fp8engine.kernels.activation`)."""
    _, y8, scale_inv = _launcher(kind, 0, h.device)(h, scale=scale, fp8_dtype=fp8_dtype, amax_out=amax)
    return y8, scale_inv


@act_fwd_fp8.register_fake
def _(h, kind, scale, fp8_dtype, amax):
    return h.new_empty(_act_out_shape(h, kind), dtype=fp8_dtype), _scale_inv_like(scale)


@kernel_op("act_bwd_fp8", mutates_args=("amax",))
def act_bwd_fp8(da: torch.Tensor, h: torch.Tensor, kind: str, scale: torch.Tensor, fp8_dtype: torch.dtype,
                amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dh = da * act'(h)`` cast to FP8 with its transpose and column sums: ``(dh8, dh8_t, scale_inv, dbias)``.

    Args:
        da: ``[*, D']`` gradient of the activation output, ``h``'s dtype, contiguous.
        h: ``[*, D]`` the activation's input, contiguous.
        kind, scale, fp8_dtype: as :func:`act_fwd_fp8` (the backward role's scale and format).
        amax: ``[1]`` float32, max-accumulated with ``max |dh|`` in place.
    Returns:
        ``dh8 [*, D]`` and ``dh8_t [D, M]`` (``M`` = rows of ``h``) in ``fp8_dtype``, ``scale_inv [1]`` float32,
        ``dbias [D]`` in ``da``'s dtype (fp32-accumulated column sums of ``dh``)."""
    dh8, dh8_t, scale_inv, dbias = _launcher(kind, 1, h.device)(da, h, scale, fp8_dtype, amax)
    return dh8, dh8_t, scale_inv, dbias


@act_bwd_fp8.register_fake
def _(da, h, kind, scale, fp8_dtype, amax):
    rows = h.numel() // h.shape[-1] if h.shape[-1] else 0
    return (h.new_empty(h.shape, dtype=fp8_dtype), h.new_empty((h.shape[-1], rows), dtype=fp8_dtype),
            _scale_inv_like(scale), da.new_empty((h.shape[-1],)))


@kernel_op("act_fwd_amax", mutates_args=("amax",))
def act_fwd_amax(h: torch.Tensor, kind: str, amax: torch.Tensor) -> torch.Tensor:
    """``act(h)`` written in high precision with its amax, for current scaling (the cast op then derives the scale
    from that amax: :func:`cast_fp8` with ``scale_from_amax``). One pass over ``h``, as in eager mode on CUDA.

    Args:
        h, kind: as :func:`act_fwd_fp8`.
        amax: ``[1]`` float32, max-accumulated in place with ``max |y|`` of the values written (in ``h.dtype``,
            NaN counted as +inf): pass zeros for the amax of this tensor alone.
    Returns:
        ``y [*, D']`` in ``h.dtype`` (``D' = N`` for SwiGLU, else ``D``). Errors are the launcher's."""
    y, _, _ = _launcher(kind, 0, h.device)(h, return_hp=True, amax_out=amax)
    return y


@act_fwd_amax.register_fake
def _(h, kind, amax):
    return h.new_empty(_act_out_shape(h, kind))


@kernel_op("act_bwd_dbias_amax", mutates_args=("amax",))
def act_bwd_dbias_amax(da: torch.Tensor, h: torch.Tensor, kind: str,
                       amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dh = da * act'(h)`` written in high precision with its column sums and its amax, for current scaling (the
    cast op then casts ``dh`` with the scale derived from that amax): ``(dh, dbias)``. One pass, as in eager mode.

    Args:
        da, h, kind: as :func:`act_bwd_fp8`.
        amax: ``[1]`` float32, max-accumulated in place with ``max |dh|`` of the values written (``da.dtype``).
    Returns:
        ``dh [*, D]`` in ``da.dtype``; ``dbias [D]`` in ``da.dtype`` (fp32-accumulated column sums of ``dh``).
        Errors are the launcher's."""
    dh, _, _, dbias = _launcher(kind, 1, h.device)(da, h, None, None, amax)
    return dh, dbias


@act_bwd_dbias_amax.register_fake
def _(da, h, kind, amax):
    return da.new_empty(h.shape), da.new_empty((h.shape[-1],))


def _norm_launchers(device: torch.device, rms: bool):
    from fp8engine.kernels import norm as kn

    names = ("rmsnorm_fwd", "rmsnorm_bwd") if rms else ("layernorm_fwd", "layernorm_bwd")
    suffix = "" if device.type == "cuda" else "_reference"
    return tuple(getattr(kn, n + suffix) for n in names)


@kernel_op("norm_fwd_fp8", mutates_args=("amax",))
def norm_fwd_fp8(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 residual: Optional[torch.Tensor], eps: float, rms: bool, zero_centered_gamma: bool,
                 scale: Optional[torch.Tensor], fp8_dtype: Optional[torch.dtype], amax: Optional[torch.Tensor],
                 return_hp: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm (``rms=False``) or RMSNorm of ``x [*, N]`` (``+ residual``, fused), also written in FP8, by one
    kernel (:mod:`fp8engine.kernels.norm`): ``(y, y8, scale_inv, mean, rstd, s)``.

    Args:
        x: ``[*, N]`` bf16 / fp16 / fp32, contiguous; weight, bias: ``[N]`` (bias None for RMSNorm).
        residual: None, or like ``x``: the norm is of ``s = x + residual`` (rounded to ``x.dtype``).
        scale, fp8_dtype, amax: the FP8 output's delayed-scaling scale ``[1]``, format, and amax slot (or None);
            scale and fp8_dtype None: no FP8 output (then ``amax``, if given, records ``max |y|``).
        return_hp: also write ``y`` in ``x.dtype`` (must be True without an FP8 output).
    Returns:
        ``y`` like ``x`` (``[0]`` without ``return_hp``), ``y8`` like ``x`` in ``fp8_dtype``, ``scale_inv [1]`` (both
        ``[0]`` without an FP8 output), ``mean [M]`` float32 (``[0]`` for RMSNorm), ``rstd [M]`` float32, ``s``
        (``[0]`` without ``residual``). Formulas and errors: the kernels'."""
    fwd = _norm_launchers(x.device, rms)[0]
    res = {} if residual is None else dict(residual=residual, residual_out=torch.empty_like(x))
    out = fwd(x, weight, *(() if rms else (bias,)), eps, zero_centered_gamma=zero_centered_gamma, scale=scale,
              fp8_dtype=fp8_dtype, amax_out=amax, return_hp=return_hp, **res)
    y, y8, scale_inv, rstd = out[0], out[1], out[2], out[-1]
    mean = None if rms else out[3]
    return (_none_as_empty(y, x), _none_as_empty(y8, x, torch.uint8), _none_as_empty(scale_inv, rstd),
            _none_as_empty(mean, rstd), rstd, _none_as_empty(res.get("residual_out"), x))


@norm_fwd_fp8.register_fake
def _(x, weight, bias, residual, eps, rms, zero_centered_gamma, scale, fp8_dtype, amax, return_hp):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    stat = x.new_empty((rows,), dtype=torch.float32)
    fp8 = scale is not None
    return (x.new_empty(x.shape if return_hp else (0,)),
            x.new_empty(x.shape, dtype=fp8_dtype) if fp8 else x.new_empty((0,), dtype=torch.uint8),
            stat.new_empty((1,) if fp8 else (0,)), x.new_empty((0,) if rms else (rows,), dtype=torch.float32), stat,
            x.new_empty(x.shape if residual is not None else (0,)))


@kernel_op("norm_bwd")
def norm_bwd(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
             dresidual: Optional[torch.Tensor], rms: bool, zero_centered_gamma: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`norm_fwd_fp8` (the kernel's, :mod:`fp8engine.kernels.norm`): ``(dx like x, dgamma [N],
    dbeta [N] or [0] for RMSNorm)``; ``x`` the normalised tensor (``s``), ``mean`` / ``rstd`` as the forward returned
    them, ``dresidual`` (like x) added to dx in fp32. dgamma / dbeta in ``weight.dtype``."""
    bwd = _norm_launchers(x.device, rms)[1]
    if rms:
        dx, dw = bwd(dy, x, rstd, weight, zero_centered_gamma=zero_centered_gamma, dresidual=dresidual)
        return dx, dw, weight.new_empty((0,))
    dx, dw, db = bwd(dy, x, mean, rstd, weight, zero_centered_gamma=zero_centered_gamma, dresidual=dresidual)
    # the kernel's dgamma and dbeta are two halves of one buffer: a custom op's outputs must not alias
    return dx, dw, db.clone()


@norm_bwd.register_fake
def _(dy, x, mean, rstd, weight, dresidual, rms, zero_centered_gamma):
    n = weight.shape[0]
    return torch.empty_like(x), weight.new_empty((n,)), weight.new_empty((0,) if rms else (n,))


def _rope_launchers(device: torch.device):
    """``(rotated q and k from the QKV output, QKV gradient cast)`` for ``device``: the kernels on CUDA, their
    plain-PyTorch references (the same bits) elsewhere."""
    from fp8engine.kernels import qkv_grad as kq
    from fp8engine.kernels import rotary as kr

    if device.type == "cuda":
        return kr.rope_qk, kq.qkv_grad_cast_transpose_dbias
    return _rope_qk_reference, _qkv_grad_reference


def _rope_qk_reference(qkv, cos, sin, split, batch):
    q, k = rotate_views(qkv.view(-1, batch, qkv.shape[-1]), split, cos, sin)
    return q.contiguous(), k.contiguous()  # (an operator's outputs: new, dense tensors)


def _qkv_grad_reference(dq, dk, dv, scale, fp8_dtype, amax_out=None, *, cos=None, sin=None):
    from fp8engine.kernels.qkv_grad import qkv_grad_cast_transpose_dbias_reference

    if cos is not None:
        dq, dk = unrotate_grads(dq, dk, (cos, sin))
    return qkv_grad_cast_transpose_dbias_reference(dq, dk, dv, scale, fp8_dtype, amax_out)


@kernel_op("rope_qk")
def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int, heads_per_group: int,
            head_dim: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k read from the grouped QKV projection output, in one pass
    (:func:`fp8engine.kernels.rotary.rope_qk`; elsewhere :func:`fp8engine.ops.rotary.rope_fwd` on the views).

    Args:
        qkv: ``[s, b, C]``, ``C = g * (hpg + 2) * d`` (layout: :mod:`fp8engine.ops.qkv`), contiguous, bf16/fp16/fp32.
        cos, sin: ``[s, 1, 1, r]`` in qkv's dtype (:func:`fp8engine.ops.rotary.rope_cos_sin`).
        groups, heads_per_group, head_dim, batch: ``g``, ``hpg``, ``d``, ``b``.
    Returns:
        ``q [s, b, g * hpg, d]``, ``k [s, b, g, d]`` in qkv's dtype, contiguous. Errors are the launcher's."""
    return _rope_launchers(qkv.device)[0](qkv, cos, sin, (groups, heads_per_group, head_dim), batch)


@rope_qk.register_fake
def _(qkv, cos, sin, groups, heads_per_group, head_dim, batch):
    s = qkv.numel() // (batch * groups * (heads_per_group + 2) * head_dim)
    return (qkv.new_empty((s, batch, groups * heads_per_group, head_dim)), qkv.new_empty((s, batch, groups, head_dim)))


@kernel_op("qkv_grad_cast_fp8", mutates_args=("amax",))
def qkv_grad_cast_fp8(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, scale: torch.Tensor,
                      fp8_dtype: torch.dtype, amax: Optional[torch.Tensor], cos: Optional[torch.Tensor],
                      sin: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV projection's output gradient cast to FP8 straight from ``dq, dk, dv``
    (:func:`fp8engine.kernels.qkv_grad.qkv_grad_cast_transpose_dbias`, one pass; elsewhere its reference):
    ``(data [T, C], data_t [C, T], scale_inv [1], dbias [C] in dq.dtype)``.

    Args:
        dq: ``[s, b, g, hpg, d]``; dk, dv: ``[s, b, g, d]`` (any strides, one dtype).
        scale: ``[1]`` float32, the grad_output role's delayed-scaling scale. fp8_dtype: its format.
        amax: ``[1]`` float32 max-accumulated with ``max |grad|`` in place, or None.
        cos, sin: the rotary angle tables ``[s, 1, 1, r]`` when dq, dk are gradients of rotated q, k (the rotation's
            gradient :func:`fp8engine.ops.rotary.rope_bwd` is applied first, inside the kernel), or None.
    Errors are the launcher's."""
    return _rope_launchers(dq.device)[1](dq, dk, dv, scale, fp8_dtype, amax, cos=cos, sin=sin)


@qkv_grad_cast_fp8.register_fake
def _(dq, dk, dv, scale, fp8_dtype, amax, cos, sin):
    s, b, g, hpg, d = dq.shape
    t, c = s * b, g * (hpg + 2) * d
    return (dq.new_empty((t, c), dtype=fp8_dtype), dq.new_empty((c, t), dtype=fp8_dtype), _scale_inv_like(scale),
            dq.new_empty((c,)))
