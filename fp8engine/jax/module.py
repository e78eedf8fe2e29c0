"""Flax modules of the JAX frontend: ``DenseGeneral``, ``LayerNormDenseGeneral``, ``LayerNormMLP``.

Inside ``fp8_autocast(enabled=True)`` every GEMM runs through :func:`fp8engine.jax.dot.fp8_dot_general` and
owns three :class:`~fp8engine.jax.meta.Fp8Meta` variables (``input_meta``, ``kernel_meta``, ``grad_meta``) in
the ``"fp8_meta_collection"`` collection; outside it (or with ``enabled=False``) the GEMM is a plain
``lax.dot_general`` in the compute dtype and no meta variables are created. Initialise and apply under the
same setting.

Sharding: ``kernel_axes`` / ``bias_axes`` name a parallelism role (``"dp"``, ``"tp"`` or ``None``) per
parameter dimension; with the active ``MeshResource`` they become ``nn.Partitioned`` annotations
(``nn.get_partition_spec`` reads them) so the parameters can be placed on a ``jax.sharding.Mesh``. Amaxes are
``pmax``-reduced over the mesh axes bound in the trace (inside ``shard_map``); under ``jax.jit`` with sharded
arrays the amax reduction is global already.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from fp8engine.jax.autocast import get_fp8_context
from fp8engine.jax.dot import fp8_dot_general
from fp8engine.jax.max_grad import is_max_grad, to_max_grad
from fp8engine.jax.meta import FP8_COLLECTION, META_NAMES, new_meta
from fp8engine.jax.sharding import MeshResource, bound_axes, resolve_spec

__all__ = ["DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"]

Dtype = Any
Initializer = Callable[..., jax.Array]
Roles = Sequence[Optional[str]]


def _as_tuple(value: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)


def _partitioned(init: Initializer, roles: Roles, mesh_resource: MeshResource) -> Initializer:
    """``init`` wrapped with ``nn.with_partitioning`` when ``roles`` shard anything under ``mesh_resource``."""
    spec = resolve_spec(tuple(roles), mesh_resource) if roles else None
    return init if spec is None else nn.with_partitioning(init, spec)


def _meta_values(module: nn.Module, recipe) -> list:
    """Create (at init) or read the three metas; float32 metas are converted to the max-accumulating dtype
    here so several uses in one trace combine by max (convert before ``nn.scan`` for micro-batching)."""
    fmt = recipe.fp8_format
    values = []
    for name, fp8_max in zip(META_NAMES, (fmt.fwd_max, fmt.fwd_max, fmt.bwd_max)):
        meta = module.variable(FP8_COLLECTION, name, new_meta, fp8_max, recipe.amax_history_len).value
        values.append(meta if is_max_grad(meta.scale) else to_max_grad(meta))
    return values


class DenseGeneral(nn.Module):
    """A linear transformation over one or several trailing axes, FP8 under ``fp8_autocast(enabled=True)``.

    ``y = dot_general(x, kernel, contract x[axis] with kernel[:len(axis)]) + bias``, as
    ``flax.linen.DenseGeneral`` (without ``batch_dims``). Under FP8: x and kernel cast to ``Format.fwd``
    (E4M3 under HYBRID), the output gradient to ``Format.bwd`` (E5M2 under HYBRID), delayed scaling per
    operand (:mod:`fp8engine.jax.dot`).

    Attributes:
        features: output feature size(s); kernel shape is ``x.shape[axis] + features``.
        axis: axis/axes of ``x`` to contract.
        use_bias: add a ``features``-shaped bias (kept in ``param_dtype``, added in the compute dtype).
        dtype: compute dtype (result dtype); default the promotion of ``x`` and ``param_dtype``.
        param_dtype: dtype of kernel and bias.
        kernel_init: default LeCun normal with fan-in over the contracted axes.
        bias_init: default zeros.
        kernel_axes, bias_axes: parallelism role per parameter dimension (``"dp"``, ``"tp"``, ``None``);
            empty = replicated.

    Shapes: ``x`` ``[..., *contracted]`` -> ``[..., *features]``.
    """

    features: Union[int, Sequence[int]]
    axis: Union[int, Sequence[int]] = -1
    use_bias: bool = True
    dtype: Optional[Dtype] = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Optional[Initializer] = None
    bias_init: Initializer = nn.initializers.zeros_init()
    kernel_axes: Roles = ()
    bias_axes: Roles = ()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        ctx = get_fp8_context()
        features = _as_tuple(self.features)
        axis = tuple(a % x.ndim for a in _as_tuple(self.axis))
        n_in = len(axis)
        kernel_init = self.kernel_init or nn.initializers.variance_scaling(
            1.0,
            "fan_in",
            "truncated_normal",
            in_axis=tuple(range(n_in)),
            out_axis=tuple(range(n_in, n_in + len(features))),
        )
        kernel_shape = tuple(x.shape[a] for a in axis) + features
        kernel = self.param(
            "kernel", _partitioned(kernel_init, self.kernel_axes, ctx.mesh_resource), kernel_shape, self.param_dtype
        )
        cdt = jnp.dtype(self.dtype) if self.dtype is not None else jnp.result_type(x.dtype, self.param_dtype)
        dims = ((axis, tuple(range(n_in))), ((), ()))
        if ctx.enabled:
            x_meta, k_meta, g_meta = _meta_values(self, ctx.recipe)
            y = fp8_dot_general(
                x,
                kernel,
                dims,
                x_meta,
                k_meta,
                g_meta,
                fwd_encoding=ctx.recipe.fp8_format.fwd,
                bwd_encoding=ctx.recipe.fp8_format.bwd,
                compute_dtype=cdt,
                amax_axes=bound_axes(ctx.mesh_resource),
            )
        else:
            y = lax.dot_general(x.astype(cdt), kernel.astype(cdt), dims, preferred_element_type=cdt)
        if self.use_bias:
            bias = self.param(
                "bias", _partitioned(self.bias_init, self.bias_axes, ctx.mesh_resource), features, self.param_dtype
            )
            y = y + bias.astype(cdt)
        return y


def _norm(kind: str, epsilon: float, dtype: Dtype, param_dtype: Dtype, name: str) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name)
    if kind == "rmsnorm":
        return nn.RMSNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name)
    raise ValueError(f"layernorm_type must be 'layernorm' or 'rmsnorm'; got {kind!r}")


class LayerNormDenseGeneral(nn.Module):
    """LayerNorm (or RMSNorm) in high precision, then an FP8 :class:`DenseGeneral`.

    Attributes are those of :class:`DenseGeneral`, plus ``layernorm_type`` (``"layernorm"``/``"rmsnorm"``),
    ``epsilon`` and ``return_layernorm_output`` (return ``(y, ln_out)`` instead of ``y``). The norm is over
    the last axis of ``x``; ``ln_out`` is in the compute dtype. Submodules: ``layernorm``, ``dense``.

    Raises:
        ValueError: unknown ``layernorm_type``.
    """

    features: Union[int, Sequence[int]]
    axis: Union[int, Sequence[int]] = -1
    use_bias: bool = True
    dtype: Optional[Dtype] = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Optional[Initializer] = None
    bias_init: Initializer = nn.initializers.zeros_init()
    kernel_axes: Roles = ()
    bias_axes: Roles = ()
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    return_layernorm_output: bool = False

    @nn.compact
    def __call__(self, x: jax.Array):
        ln_out = _norm(self.layernorm_type, self.epsilon, self.dtype, self.param_dtype, "layernorm")(x)
        y = DenseGeneral(
            features=self.features,
            axis=self.axis,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            kernel_axes=self.kernel_axes,
            bias_axes=self.bias_axes,
            name="dense",
        )(ln_out)
        return (y, ln_out) if self.return_layernorm_output else y


class LayerNormMLP(nn.Module):
    """``fc2(activation(fc1(norm(x))))`` with both GEMMs in FP8 (each with its own three metas).

    Tensor parallelism the Megatron way by default: ``fc1`` column-parallel (kernel ``(None, "tp")``),
    ``fc2`` row-parallel (kernel ``("tp", None)``); without a ``tp_resource`` these annotations vanish.

    Attributes:
        intermediate_dim: hidden size of the MLP.
        activation: elementwise function applied between the GEMMs (default ``nn.gelu``).
        use_bias, dtype, param_dtype, kernel_init, bias_init: as :class:`DenseGeneral`.
        layernorm_type, epsilon: as :class:`LayerNormDenseGeneral`.
        fc1_kernel_axes, fc2_kernel_axes: parallelism roles of the two kernels.

    Shapes: ``x`` ``[..., H]`` -> ``[..., H]``. Submodules: ``fc1`` (a :class:`LayerNormDenseGeneral`), ``fc2``.
    """

    intermediate_dim: int = 2048
    activation: Callable[[jax.Array], jax.Array] = nn.gelu
    use_bias: bool = True
    dtype: Optional[Dtype] = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Optional[Initializer] = None
    bias_init: Initializer = nn.initializers.zeros_init()
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    fc1_kernel_axes: Roles = (None, "tp")
    fc2_kernel_axes: Roles = ("tp", None)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        common = dict(
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
        )
        h = LayerNormDenseGeneral(
            features=self.intermediate_dim,
            layernorm_type=self.layernorm_type,
            epsilon=self.epsilon,
            kernel_axes=self.fc1_kernel_axes,
            bias_axes=self.fc1_kernel_axes[-1:],
            name="fc1",
            **common,
        )(x)
        h = self.activation(h)
        return DenseGeneral(features=x.shape[-1], kernel_axes=self.fc2_kernel_axes, name="fc2", **common)(h)
