"""FP8 meta per GEMM operand, the delayed-scaling update rule, and collection helpers.

Each FP8 GEMM keeps three metas (input, kernel, grad) as Flax variables in the collection
:data:`FP8_COLLECTION` (``"fp8_meta_collection"``). A meta is an :class:`Fp8Meta`: ``fp8_max`` (scalar),
``amax_history`` ``[L]``, ``scale`` and ``scale_inv`` (scalars), all float32.

Scale direction (as everywhere in fp8engine): ``fp8 = saturate(x * scale)`` goes into the FP8 range,
``x ~= fp8 * scale_inv`` dequantizes.

Training-step protocol (TransformerEngine/JAX's): differentiate the loss with respect to the meta collection
too. The FP8 GEMM's custom VJP returns, as the "gradient" of each meta, the meta with this step's amax
written into ``amax_history[0]`` (see :mod:`fp8engine.jax.dot`). Then :func:`update_fp8_metas` recomputes
``scale``/``scale_inv`` from the history and rolls it, exactly like the torch frontend's
``update_fp8_scale`` followed by ``update_amax_history``.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import flax.struct
import jax
import jax.numpy as jnp
from flax.core.frozen_dict import FrozenDict

from fp8engine.jax.autocast import get_delayed_scaling
from fp8engine.jax.max_grad import to_float32

__all__ = [
    "FP8_COLLECTION",
    "META_NAMES",
    "Fp8Meta",
    "new_meta",
    "compute_scale",
    "roll_amax_history",
    "update_fp8_meta",
    "update_fp8_metas",
    "update_collections",
]

#: Flax collection holding the FP8 metas of every FP8 GEMM.
FP8_COLLECTION = "fp8_meta_collection"

#: Variable names of the three metas of one GEMM, in the order (input, kernel, grad).
META_NAMES = ("input_meta", "kernel_meta", "grad_meta")

Collection = Union[dict, FrozenDict]


@flax.struct.dataclass
class Fp8Meta:
    """Delayed-scaling state of one GEMM operand (a frozen dataclass and a JAX pytree).

    Attributes:
        fp8_max: scalar, float32: largest finite value of the operand's FP8 encoding (448 for E4M3,
            57344 for E5M2; ``fp8engine.recipe.FP8_MAX``).
        amax_history: ``[L]`` float32, ``L = DelayedScaling.amax_history_len``; index 0 is the current step's
            slot (written by the GEMM), the rest are past steps.
        scale: scalar float32; multiply by it to go into the FP8 range. Starts at 1.0.
        scale_inv: scalar float32, ``1 / scale``; multiply FP8 values by it to dequantize.

    Leaves may also have dtype :data:`fp8engine.jax.MAX_GRAD_F32` (while being differentiated).
    """

    fp8_max: jax.Array
    amax_history: jax.Array
    scale: jax.Array
    scale_inv: jax.Array


def new_meta(fp8_max: float, amax_history_len: int) -> Fp8Meta:
    """A fresh meta: zero history ``[amax_history_len]``, ``scale = scale_inv = 1``, all float32."""
    return Fp8Meta(
        fp8_max=jnp.asarray(fp8_max, jnp.float32),
        amax_history=jnp.zeros((amax_history_len,), jnp.float32),
        scale=jnp.ones((), jnp.float32),
        scale_inv=jnp.ones((), jnp.float32),
    )


def compute_scale(
    amax_history, scale, fp8_max, *, margin: float = 0, amax_compute_algo: str = "max"
):
    """New ``(scale, scale_inv)`` from an amax history; same rule as the torch frontend's ``update_fp8_scale``.

    ``amax = max(history[..., :])`` (``"max"``) or ``history[..., 0]`` (``"most_recent"``);
    ``sf = (fp8_max / amax) / 2**margin`` in float32; where ``amax <= 0``, ``amax`` is not finite or ``sf``
    overflows (a denormal amax) the previous ``scale`` is kept; ``scale_inv = 1 / sf``.
    Source: TransformerEngine's ``_default_sf_compute`` / ``FP8Helper.update_fp8_scale``; bit-identical to
    ``fp8engine.fp8.scaling.update_fp8_scale`` (tested).

    Args:
        amax_history: ``[..., L]`` float32.
        scale: ``[...]`` float32, the current scale.
        fp8_max: scalar or ``[...]`` float32.
        margin: >= 0.
        amax_compute_algo: ``"max"`` or ``"most_recent"``.

    Returns:
        ``(scale, scale_inv)``, each ``[...]`` float32.

    Raises:
        ValueError: unknown ``amax_compute_algo``.
    """
    if amax_compute_algo == "max":
        amax = jnp.max(amax_history, axis=-1)
    elif amax_compute_algo == "most_recent":
        amax = amax_history[..., 0]
    else:
        raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent'; got {amax_compute_algo!r}")
    amax = jnp.asarray(amax, jnp.float32)
    sf = (jnp.asarray(fp8_max, jnp.float32) / amax) / (2.0**margin)
    usable = (amax > 0.0) & jnp.isfinite(amax) & jnp.isfinite(sf)
    sf = jnp.where(usable, sf, scale)
    return sf, 1.0 / sf


def roll_amax_history(amax_history):
    """Advance the history window: roll by -1 along the last axis, then zero slot 0 (torch's
    ``update_amax_history``). ``[..., L]`` -> ``[..., L]``."""
    rolled = jnp.roll(amax_history, -1, axis=-1)
    return rolled.at[..., 0].set(0.0)


def update_fp8_meta(meta: Fp8Meta, recipe, recompute_scale=True) -> Fp8Meta:
    """One meta's update: new scale/scale_inv from the history (when ``recompute_scale``), then roll.

    ``recompute_scale`` may be a traced boolean (then the choice is made with ``jnp.where``).
    """
    meta = to_float32(meta)
    scale, scale_inv = compute_scale(
        meta.amax_history,
        meta.scale,
        meta.fp8_max,
        margin=recipe.margin,
        amax_compute_algo=recipe.amax_compute_algo,
    )
    if recompute_scale is not True:
        scale = jnp.where(recompute_scale, scale, meta.scale)
        scale_inv = jnp.where(recompute_scale, scale_inv, meta.scale_inv)
    return meta.replace(amax_history=roll_amax_history(meta.amax_history), scale=scale, scale_inv=scale_inv)


def update_fp8_metas(state: Any, *, step: Optional[Any] = None) -> Any:
    """Apply the delayed-scaling update to every :class:`Fp8Meta` in ``state``, with the active recipe.

    ``state`` is the meta collection (or any pytree holding ``Fp8Meta`` leaves, e.g. the whole variables
    dict; other leaves are returned unchanged), usually the gradient with respect to the metas. Metas in
    :data:`~fp8engine.jax.MAX_GRAD_F32` come back as float32. The recipe (margin, algo, interval) is read
    from :func:`get_delayed_scaling` at trace time. Histories are rolled on every call; with
    ``interval > 1`` scales are recomputed only when ``step % interval == 0`` (``step`` may be traced).

    Raises:
        ValueError: ``interval > 1`` and ``step`` is not given.
    """
    recipe = get_delayed_scaling()
    if recipe.interval == 1:
        recompute = True
    elif step is None:
        raise ValueError(
            f"DelayedScaling.interval={recipe.interval} needs the training step: update_fp8_metas(state, step=...)"
        )
    else:
        recompute = jnp.asarray(step) % recipe.interval == 0
    return jax.tree_util.tree_map(
        lambda m: update_fp8_meta(m, recipe, recompute) if isinstance(m, Fp8Meta) else m,
        state,
        is_leaf=lambda x: isinstance(x, Fp8Meta),
    )


def update_collections(new: Collection, original: Collection) -> Collection:
    """``original`` with its top-level keys replaced by those of ``new``; keeps ``original``'s container type.

    Example: ``variables = update_collections({FP8_COLLECTION: metas}, variables)``. A ``FrozenDict``
    ``original`` gives a ``FrozenDict``, a ``dict`` gives a ``dict``.

    Raises:
        TypeError: ``new`` or ``original`` is not a dict or FrozenDict.
    """
    for name, value in (("new", new), ("original", original)):
        if not isinstance(value, (dict, FrozenDict)):
            raise TypeError(f"update_collections: {name} must be a dict or FrozenDict; got {type(value).__name__}")
    merged = {**dict(original), **dict(new)}
    return FrozenDict(merged) if isinstance(original, FrozenDict) else merged
