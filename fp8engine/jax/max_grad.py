"""A float32 dtype whose cotangents combine by **max** instead of sum: the FP8 meta's gradient dtype.

Why: delayed scaling returns the new amax history as the "gradient" of the meta variables (see
:mod:`fp8engine.jax.dot`). When one meta is used several times in a differentiated program -- most often a
layer inside ``nn.scan`` over pipeline micro-batches, where the meta is a loop-invariant (broadcast) input --
JAX adds the per-use cotangents. Summing amax histories is wrong (``n`` micro-batches would multiply the
history by ``n``); the right combination is the element-wise max. This module defines an extended JAX dtype,
``MAX_GRAD_F32``, stored as float32, for which autodiff's accumulation (``add_jaxvals``) is ``max`` and whose
zero is ``-inf``. It is the same idea as Flax's ``fp8_ops.fp32_max_grad`` (which TransformerEngine/JAX uses as
``FlaxFloatMeta32``); the implementation here is our own.

Usage: convert float32 metas with :func:`to_max_grad` **outside** any ``nn.scan`` / ``lax.scan`` (the
conversion's transpose is where the max-combined cotangent becomes float32 again), or let
:class:`fp8engine.jax.DenseGeneral` convert per use when there is no scan. :func:`to_float32` converts back.
Only conversion to/from float32 is allowed; arithmetic needs float32 (convert first).

This relies on JAX's extended-dtype protocol (``jax._src.dtypes.ExtendedDType``), which is private API; it is
exercised by the tests on every JAX version we support.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as _core
from jax._src import dtypes as _dtypes

__all__ = ["MAX_GRAD_F32", "is_max_grad", "to_max_grad", "to_float32"]


class _MaxGradRules:
    """How JAX lowers, converts, fills and (above all) accumulates the max-gradient dtype."""

    @staticmethod
    def physical_element_aval(dtype) -> Any:
        # One float32 per element, same shape: lowering is a no-op.
        return _core.ShapedArray((), dtype.float_dtype)

    # Conversions are allowed only to/from the representation dtype (older JAX asks per pair, newer JAX
    # reads ``allow_conversion``; both are provided).
    allow_conversion = True

    @staticmethod
    def convert_from(edtype, other) -> bool:
        return edtype.float_dtype == other

    @staticmethod
    def convert_to(other, edtype) -> bool:
        return edtype.float_dtype == other

    @staticmethod
    def add(dtype, x, y):
        # Autodiff accumulation of cotangents: element-wise max (the whole point of this dtype). ``dtype`` is
        # not trusted (some JAX paths pass a function); the operands carry it.
        edtype = x.dtype if isinstance(getattr(x, "dtype", None), _MaxGradDType) else y.dtype
        xf = lax.convert_element_type(x, edtype.float_dtype)
        yf = lax.convert_element_type(y, edtype.float_dtype)
        return lax.convert_element_type(lax.max(xf, yf), edtype)

    @staticmethod
    def zero(dtype):
        # Identity of max: -inf.
        return lax.convert_element_type(np.array(-np.inf, dtype.float_dtype), dtype)

    @staticmethod
    def tangent_dtype(dtype):
        return dtype

    @staticmethod
    def full(shape, fill_value, dtype):
        value = lax.convert_element_type(fill_value, dtype.float_dtype)
        return lax.convert_element_type(lax.full(shape, value, dtype.float_dtype), dtype)

    @staticmethod
    def global_sharded_result_handler(aval, out_sharding, committed):
        # Lets eager (un-jitted) code hold arrays of this dtype: wrap the float32 buffers in an EArray.
        from jax._src import earray
        from jax._src.interpreters import pxla

        phys_aval = _core.physical_aval(aval)
        phys_handler = pxla.global_result_handlers[_core.ShapedArray](phys_aval, out_sharding, committed)
        return lambda bufs: earray.EArray(aval, phys_handler(bufs))


class _max_grad_scalar(_dtypes.extended):
    """Scalar type of :data:`MAX_GRAD_F32` (for ``jnp.issubdtype``)."""


@dataclass(frozen=True)
class _MaxGradDType(_dtypes.ExtendedDType):
    float_dtype: Any
    _rules: type = _MaxGradRules
    type: type = _max_grad_scalar

    @property
    def name(self) -> str:
        return "max_grad_f32"

    def __repr__(self) -> str:
        return self.name


#: float32 storage, max-accumulating cotangents. Values convert with ``lax.convert_element_type`` only.
MAX_GRAD_F32 = _MaxGradDType(np.dtype(np.float32))


def is_max_grad(x) -> bool:
    """True when ``x`` (an array or tracer) has dtype :data:`MAX_GRAD_F32`."""
    return getattr(x, "dtype", None) == MAX_GRAD_F32


def to_max_grad(tree):
    """Convert every float32 leaf of ``tree`` to :data:`MAX_GRAD_F32` (other leaves are left as they are).

    Apply to the FP8 meta collection outside ``nn.scan`` so micro-batch cotangents combine by max.
    """

    def convert(x):
        if isinstance(x, (jax.Array, np.ndarray)) and x.dtype == jnp.float32:
            return lax.convert_element_type(x, MAX_GRAD_F32)
        return x

    return jax.tree_util.tree_map(convert, tree)


def to_float32(tree):
    """Convert every :data:`MAX_GRAD_F32` leaf of ``tree`` back to float32 (other leaves are left as they are)."""
    return jax.tree_util.tree_map(
        lambda x: lax.convert_element_type(x, jnp.float32) if is_max_grad(x) else x, tree
    )
