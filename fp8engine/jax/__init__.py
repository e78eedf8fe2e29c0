"""JAX/Flax frontend of fp8engine: FP8 meta management, delayed scaling and FP8 dense layers.

Built on the framework-neutral recipes of :mod:`fp8engine.recipe`; imports neither torch nor anything from the
torch frontend. Needs ``jax`` and ``flax`` (``pip install fp8engine[jax]``).

Typical training step::

    with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(amax_history_len=16)):
        variables = model.init(rng, x)                       # {"params": ..., FP8_COLLECTION: ...}

        @jax.jit
        def step(params, metas, x, y):
            def loss(params, metas):
                out = model.apply({"params": params, FP8_COLLECTION: metas}, x)
                return jnp.mean((out - y) ** 2)
            l, (g_params, g_metas) = jax.value_and_grad(loss, argnums=(0, 1))(params, metas)
            return l, g_params, update_fp8_metas(g_metas)    # new scales from this step's amaxes

For micro-batching with ``nn.scan``, convert the metas with :func:`to_max_grad` before the scan (inside the
differentiated function) so the micro-batches' amaxes combine by max.
"""
from __future__ import annotations

try:
    import flax  # noqa: F401
    import jax  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fp8engine.jax needs jax and flax; install them with `pip install fp8engine[jax]`"
    ) from err

from fp8engine.jax.autocast import (
    Fp8Context,
    fp8_autocast,
    fp8_support,
    get_delayed_scaling,
    get_fp8_context,
    is_fp8_available,
)
from fp8engine.jax.dot import fp8_dot_general
from fp8engine.jax.max_grad import MAX_GRAD_F32, to_float32, to_max_grad
from fp8engine.jax.meta import (
    FP8_COLLECTION,
    Fp8Meta,
    compute_scale,
    roll_amax_history,
    update_collections,
    update_fp8_metas,
)
from fp8engine.jax.module import DenseGeneral, LayerNormDenseGeneral, LayerNormMLP
from fp8engine.jax.sharding import MeshResource

__all__ = [
    "fp8_autocast",
    "MeshResource",
    "Fp8Context",
    "get_fp8_context",
    "get_delayed_scaling",
    "is_fp8_available",
    "fp8_support",
    "FP8_COLLECTION",
    "Fp8Meta",
    "compute_scale",
    "roll_amax_history",
    "update_fp8_metas",
    "update_collections",
    "MAX_GRAD_F32",
    "to_max_grad",
    "to_float32",
    "fp8_dot_general",
    "DenseGeneral",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
]
