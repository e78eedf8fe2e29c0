"""FP8 ``dot_general`` with a custom VJP and delayed scaling: the one FP8 GEMM op of the JAX frontend.

The three GEMMs, for ``y = dot_general(x, w)`` (``dims`` as in ``lax.dot_general``):

- fprop: ``y = dot(dq(q(x)), dq(q(w)))`` with ``q`` = saturate-cast into the forward encoding (E4M3 under
  ``Format.HYBRID``) using the metas' *current* scales, ``dq`` = multiply by ``scale_inv``;
- dgrad: ``dx = dot_general_transpose_lhs(dq(q(dy)), dq(q(w)))`` with ``dy`` cast to the backward encoding
  (E5M2 under ``HYBRID``) with the grad meta's scale;
- wgrad: ``dw = dot_general_transpose_rhs(dq(q(dy)), dq(q(x)))``.

The dequantize-then-dot form is the pattern XLA's GPU GEMM rewriter turns into a cuBLASLt FP8 GEMM (scales
folded into the epilogue); on CPU it is an exact emulation of the FP8 roundings followed by a GEMM in the
compute dtype. The transposed GEMMs come from ``jax.vjp`` of ``lax.dot_general`` applied to the dequantized
operands, so any ``dimension_numbers`` (contracting and batch) work.

Delayed scaling: the amaxes of ``x``, ``w`` and ``dy`` (reduced with ``pmax`` over the bound mesh axes) are
returned as the cotangent of the metas: ``meta`` with ``amax_history[0] = max(amax_history[0], amax)``.
Everything else of the meta is passed through unchanged, so with the max-accumulating meta dtype
(:mod:`fp8engine.jax.max_grad`) several uses combine to the largest amax.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from fp8engine.jax.meta import Fp8Meta
from fp8engine.jax.sharding import reduce_amax

__all__ = ["FP8_DTYPES", "quantize", "dequantize", "amax", "fp8_dot_general"]

#: JAX dtype of each encoding name used by ``fp8engine.recipe.Format``.
FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def quantize(x: jax.Array, scale: jax.Array, fp8_dtype) -> jax.Array:
    """``saturate(x * scale)`` in ``fp8_dtype``: multiply in float32, clip to ``±finfo(fp8_dtype).max``,
    cast with round-to-nearest-even (NaN stays NaN). ``x`` any float dtype and shape, ``scale`` float32 scalar."""
    fp8_max = float(jnp.finfo(fp8_dtype).max)
    scaled = x.astype(jnp.float32) * scale.astype(jnp.float32)
    return jnp.clip(scaled, -fp8_max, fp8_max).astype(fp8_dtype)


def dequantize(q: jax.Array, scale_inv: jax.Array, dtype) -> jax.Array:
    """``q * scale_inv`` in ``dtype`` (FP8 values are exact in bf16/f16/f32)."""
    return q.astype(dtype) * scale_inv.astype(dtype)


def amax(x: jax.Array, axes: Sequence[str] = ()) -> jax.Array:
    """``max(|x|)`` as a float32 scalar, ``pmax``-reduced over the mesh ``axes`` (see ``sharding.reduce_amax``)."""
    return reduce_amax(jnp.max(jnp.abs(x)).astype(jnp.float32), axes)


@dataclass(frozen=True)
class _GemmConfig:
    """Static (trace-time) parameters of one FP8 GEMM."""

    dims: tuple  # lax.dot_general dimension_numbers, as nested tuples
    fwd_dtype: object  # FP8 dtype of x and w
    bwd_dtype: object  # FP8 dtype of dy
    compute_dtype: object  # dtype the dequantized operands and the result are in
    amax_axes: tuple  # mesh axes to pmax the amaxes over


def _f32(v: jax.Array) -> jax.Array:
    return lax.convert_element_type(v, jnp.float32)


def _like(value: jax.Array, ref: jax.Array) -> jax.Array:
    """``value`` (float32) converted to ``ref``'s dtype (float32 or the max-accumulating dtype)."""
    return lax.convert_element_type(value, ref.dtype)


def _meta_cotangent(meta: Fp8Meta, new_amax: jax.Array) -> Fp8Meta:
    """The meta with ``amax_history[0] = max(amax_history[0], new_amax)``, in the meta's own dtypes."""
    history = _f32(meta.amax_history)
    history = history.at[0].set(jnp.maximum(history[0], new_amax))
    return meta.replace(amax_history=_like(history, meta.amax_history))


def _dot(a, b, cfg: _GemmConfig):
    return lax.dot_general(a, b, cfg.dims, preferred_element_type=cfg.compute_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fp8_dot(x, w, x_meta: Fp8Meta, w_meta: Fp8Meta, g_meta: Fp8Meta, cfg: _GemmConfig):
    y, _ = _fp8_dot_fwd(x, w, x_meta, w_meta, g_meta, cfg)
    return y


def _fp8_dot_fwd(x, w, x_meta, w_meta, g_meta, cfg):
    qx = quantize(x, _f32(x_meta.scale), cfg.fwd_dtype)
    qw = quantize(w, _f32(w_meta.scale), cfg.fwd_dtype)
    x_si, w_si = _f32(x_meta.scale_inv), _f32(w_meta.scale_inv)
    y = _dot(dequantize(qx, x_si, cfg.compute_dtype), dequantize(qw, w_si, cfg.compute_dtype), cfg)
    amaxes = (amax(x, cfg.amax_axes), amax(w, cfg.amax_axes))
    return y, (qx, qw, x_si, w_si, x_meta, w_meta, g_meta, amaxes)


def _fp8_dot_bwd(cfg, res, dy):
    qx, qw, x_si, w_si, x_meta, w_meta, g_meta, (x_amax, w_amax) = res
    dy_amax = amax(dy, cfg.amax_axes)
    qdy = quantize(dy, _f32(g_meta.scale), cfg.bwd_dtype)
    dy_dq = dequantize(qdy, _f32(g_meta.scale_inv), cfg.compute_dtype)
    x_dq = dequantize(qx, x_si, cfg.compute_dtype)
    w_dq = dequantize(qw, w_si, cfg.compute_dtype)
    # dgrad and wgrad: the transposes of fprop, on the FP8-rounded operands.
    _, transpose = jax.vjp(lambda a, b: _dot(a, b, cfg), x_dq, w_dq)
    dx, dw = transpose(dy_dq.astype(cfg.compute_dtype))
    return (
        dx,
        dw,
        _meta_cotangent(x_meta, x_amax),
        _meta_cotangent(w_meta, w_amax),
        _meta_cotangent(g_meta, dy_amax),
    )


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _normalize_dims(dimension_numbers) -> tuple:
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def fp8_dot_general(
    x: jax.Array,
    kernel: jax.Array,
    dimension_numbers,
    x_meta: Fp8Meta,
    kernel_meta: Fp8Meta,
    grad_meta: Fp8Meta,
    *,
    fwd_encoding: str = "e4m3",
    bwd_encoding: str = "e5m2",
    compute_dtype: Optional[object] = None,
    amax_axes: Sequence[str] = (),
) -> jax.Array:
    """``lax.dot_general(x, kernel, dimension_numbers)`` with FP8 operands and delayed scaling.

    Args:
        x, kernel: float arrays (any shapes ``lax.dot_general`` accepts); cast to ``compute_dtype``.
        dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
        x_meta, kernel_meta, grad_meta: :class:`~fp8engine.jax.meta.Fp8Meta` of the input, the kernel and the
            output gradient; leaves float32 or :data:`~fp8engine.jax.MAX_GRAD_F32`. Their ``scale`` is used
            as is (delayed scaling); their cotangents carry this step's amaxes.
        fwd_encoding, bwd_encoding: ``"e4m3"`` / ``"e5m2"`` for x/kernel and for the output gradient
            (``Format.fwd`` / ``Format.bwd``).
        compute_dtype: dtype of the dequantized operands and of the result; default ``x``'s and
            ``kernel``'s result type.
        amax_axes: mesh axis names to ``pmax`` the amaxes over (the bound ones; see ``sharding.bound_axes``).

    Returns:
        ``y`` in ``compute_dtype``, shape as ``lax.dot_general``'s.

    Raises:
        ValueError: an encoding is not ``"e4m3"`` or ``"e5m2"``.
    """
    for name, enc in (("fwd_encoding", fwd_encoding), ("bwd_encoding", bwd_encoding)):
        if enc not in FP8_DTYPES:
            raise ValueError(f"{name} must be one of {tuple(FP8_DTYPES)}; got {enc!r}")
    cdt = jnp.dtype(compute_dtype) if compute_dtype is not None else jnp.result_type(x, kernel)
    cfg = _GemmConfig(
        dims=_normalize_dims(dimension_numbers),
        fwd_dtype=FP8_DTYPES[fwd_encoding],
        bwd_dtype=FP8_DTYPES[bwd_encoding],
        compute_dtype=cdt,
        amax_axes=tuple(amax_axes),
    )
    return _fp8_dot(x.astype(cdt), kernel.astype(cdt), x_meta, kernel_meta, grad_meta, cfg)
