"""FP8 ``dot_general`` with a custom VJP and delayed scaling: the one FP8 GEMM op of the JAX frontend.

The three GEMMs, for ``y = dot_general(x, w)`` (``dims`` as in ``lax.dot_general``), each taking the FP8
arrays themselves as operands and dequantizing the *result* with the product of the two ``scale_inv``:

- fprop: ``y = dot_general(q(x), q(w)) * (x_scale_inv * w_scale_inv)`` with ``q`` = saturate-cast into the
  forward encoding (E4M3 under ``Format.HYBRID``) using the metas' *current* scales;
- dgrad: ``dx = dot_general(q(dy), q(w)) * (dy_scale_inv * w_scale_inv)``, contracting ``dy``'s kernel
  axes with the kernel's free axes, ``dy`` cast to the backward encoding (E5M2 under ``HYBRID``) with the
  grad meta's scale;
- wgrad: ``dw = dot_general(q(x), q(dy)) * (x_scale_inv * dy_scale_inv)``, contracting ``x``'s free axes.

The GEMMs are ``lax.dot_general`` on FP8 operands with ``preferred_element_type`` = the compute dtype
(float32 for float16, whose range an FP8 GEMM's sum can exceed): XLA's GPU GEMM rewriter turns such a dot
into a cuBLASLt FP8 GEMM (E4M3 x E4M3 forward, E5M2 x E4M3 backward under ``HYBRID``), layouts and
transposes its business; the scalar multiply after it is an elementwise op XLA fuses into the consumer.
cuBLASLt has no E5M2 x E5M2 GEMM: under ``Format.E5M2`` XLA falls back to a 16-bit GEMM (same results).
fprop uses ``Precision.DEFAULT`` (cuBLASLt fast accumulation), dgrad/wgrad ``Precision.HIGHEST`` (no fast
accumulation), TransformerEngine's split. On CPU XLA upcasts the FP8 operands to float32 and accumulates in
float32, so the same code runs everywhere and equals an exact emulation of the FP8 roundings followed by a
float32 GEMM (one rounding to the compute dtype after the GEMM and one after the scaling).

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
    compute_dtype: object  # dtype of the operands as passed in and of the results (y, dx, dw)
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


def _free_axes(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> tuple:
    """Axes of an operand that are neither contracted nor batch, ascending (they follow the batch axes in a
    ``lax.dot_general`` result, lhs's before rhs's)."""
    used = set(contract) | set(batch)
    return tuple(a for a in range(ndim) if a not in used)


def _to_axes(out: jax.Array, axes_of_out: Sequence[int]) -> jax.Array:
    """Transpose ``out`` so that its dimension ``j`` lands on axis ``axes_of_out[j]``."""
    perm = tuple(sorted(range(len(axes_of_out)), key=lambda j: axes_of_out[j]))
    return out if perm == tuple(range(len(perm))) else lax.transpose(out, perm)


def _acc_dtype(compute_dtype):
    """``preferred_element_type`` of the FP8 GEMMs: the compute dtype, except float32 for float16 (a sum of
    K products of FP8 values up to 448 * 57344 overflows float16's 65504)."""
    return jnp.dtype(jnp.float32) if jnp.dtype(compute_dtype) == jnp.float16 else jnp.dtype(compute_dtype)


def _fp8_gemm(a, b, dims, scale_inv, cfg: _GemmConfig, precision) -> jax.Array:
    """``dot_general(a, b, dims) * scale_inv`` in the compute dtype, ``a``/``b`` FP8 arrays, ``scale_inv`` the
    float32 product of the operands' scale_invs. The dot on the FP8 arrays with ``preferred_element_type`` is
    the form XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM."""
    acc = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_acc_dtype(cfg.compute_dtype))
    return (_f32(acc) * scale_inv).astype(cfg.compute_dtype)


def _fprop(qx, qw, scale_inv, cfg: _GemmConfig) -> jax.Array:
    """``y = dot_general(qx, qw, dims) * scale_inv``; fast accumulation (``Precision.DEFAULT``)."""
    return _fp8_gemm(qx, qw, cfg.dims, scale_inv, cfg, lax.Precision.DEFAULT)


def _dgrad(qdy, qw, x_ndim: int, scale_inv, cfg: _GemmConfig) -> jax.Array:
    """``dx``, shape of ``x``: ``qdy``'s kernel-free axes contracted with ``qw``'s free axes, batch with batch.

    The result's axes are ``[batch, x free, w contracted (ascending)]``; the last group maps back to the x
    axes they were contracted with."""
    (xc, wc), (xb, wb) = cfg.dims
    x_free, w_free = _free_axes(x_ndim, xc, xb), _free_axes(qw.ndim, wc, wb)
    n_lead = len(xb) + len(x_free)  # dy = [batch, x free, w free]
    dims = ((tuple(range(n_lead, n_lead + len(w_free))), w_free), (tuple(range(len(xb))), wb))
    out = _fp8_gemm(qdy, qw, dims, scale_inv, cfg, lax.Precision.HIGHEST)
    x_of_w = dict(zip(wc, xc))
    return _to_axes(out, xb + x_free + tuple(x_of_w[a] for a in sorted(wc)))


def _wgrad(qx, qdy, w_ndim: int, scale_inv, cfg: _GemmConfig) -> jax.Array:
    """``dw``, shape of ``w``: ``qx``'s free axes contracted with ``qdy``'s x-free axes, batch with batch.

    The result's axes are ``[batch, x contracted (ascending), w free]``; the middle group maps to the w axes
    they were contracted with (for ``DenseGeneral`` no transpose is left)."""
    (xc, wc), (xb, wb) = cfg.dims
    x_free = _free_axes(qx.ndim, xc, xb)
    w_free = _free_axes(w_ndim, wc, wb)
    dims = ((x_free, tuple(range(len(xb), len(xb) + len(x_free)))), (xb, tuple(range(len(xb)))))
    out = _fp8_gemm(qx, qdy, dims, scale_inv, cfg, lax.Precision.HIGHEST)
    w_of_x = dict(zip(xc, wc))
    return _to_axes(out, wb + tuple(w_of_x[a] for a in sorted(xc)) + w_free)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fp8_dot(x, w, x_meta: Fp8Meta, w_meta: Fp8Meta, g_meta: Fp8Meta, cfg: _GemmConfig):
    y, _ = _fp8_dot_fwd(x, w, x_meta, w_meta, g_meta, cfg)
    return y


def _fp8_dot_fwd(x, w, x_meta, w_meta, g_meta, cfg):
    qx = quantize(x, _f32(x_meta.scale), cfg.fwd_dtype)
    qw = quantize(w, _f32(w_meta.scale), cfg.fwd_dtype)
    x_si, w_si = _f32(x_meta.scale_inv), _f32(w_meta.scale_inv)
    y = _fprop(qx, qw, x_si * w_si, cfg)
    amaxes = (amax(x, cfg.amax_axes), amax(w, cfg.amax_axes))
    return y, (qx, qw, x_si, w_si, x_meta, w_meta, g_meta, amaxes)


def _fp8_dot_bwd(cfg, res, dy):
    qx, qw, x_si, w_si, x_meta, w_meta, g_meta, (x_amax, w_amax) = res
    dy_amax = amax(dy, cfg.amax_axes)
    qdy = quantize(dy, _f32(g_meta.scale), cfg.bwd_dtype)
    dy_si = _f32(g_meta.scale_inv)
    dx = _dgrad(qdy, qw, qx.ndim, dy_si * w_si, cfg)
    dw = _wgrad(qx, qdy, qw.ndim, x_si * dy_si, cfg)
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
        compute_dtype: dtype ``x``/``kernel`` are cast to before quantizing, the GEMMs'
            ``preferred_element_type`` (float32 for float16) and the dtype of ``y``, ``dx``, ``dw``; default
            ``x``'s and ``kernel``'s result type.
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
