"""Framework-neutral FP8 recipes, shared by the torch and JAX frontends.

Nothing here imports torch or jax: a recipe is plain configuration. Names and defaults follow
TransformerEngine (``transformer_engine.common.recipe``) so that users can carry their configs over.

Scale direction used everywhere in fp8engine: ``fp8 = saturate(x * scale)`` goes from the high-precision
range into the FP8 range, and ``scale_inv = 1 / scale`` dequantizes (``x ≈ fp8 * scale_inv``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, ClassVar, Union

__all__ = ["Format", "DelayedScaling", "CurrentScaling", "Float8CurrentScaling", "Float8BlockScaling", "Recipe",
           "FP8_MAX", "AMAX_COMPUTE_ALGOS"]

#: Largest finite magnitude of each FP8 encoding (OCP FP8 spec, "FP8 Formats for Deep Learning",
#: Micikevicius et al. 2022): E4M3 saturates at 448, E5M2 at 57344.
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}

#: The named amax reductions over the history; a callable ``history -> amax`` is also accepted.
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


class Format(enum.Enum):
    """FP8 format per pass, as in TransformerEngine.

    ``E4M3``: E4M3 for forward tensors and gradients. ``E5M2``: E5M2 for both.
    ``HYBRID``: E4M3 in the forward pass (activations, weights), E5M2 for gradients (wider range).
    The value is ``(forward encoding, backward encoding)``.
    """

    E4M3 = ("e4m3", "e4m3")
    E5M2 = ("e5m2", "e5m2")
    HYBRID = ("e4m3", "e5m2")

    @property
    def fwd(self) -> str:
        """Encoding of forward tensors (input, weight): ``"e4m3"`` or ``"e5m2"``."""
        return self.value[0]

    @property
    def bwd(self) -> str:
        """Encoding of gradients (grad_output): ``"e4m3"`` or ``"e5m2"``."""
        return self.value[1]

    @property
    def fwd_max(self) -> float:
        return FP8_MAX[self.fwd]

    @property
    def bwd_max(self) -> float:
        return FP8_MAX[self.bwd]


def _check_format(fp8_format) -> None:
    if not isinstance(fp8_format, Format):
        raise ValueError(
            f"fp8_format must be one of Format.E4M3, Format.E5M2, Format.HYBRID; got {fp8_format!r}"
        )


@dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor scaling from a history of past amaxes (TransformerEngine's ``DelayedScaling``).

    At every update, ``amax = algo(history)``, ``scale = (fp8_max / amax) / 2**margin`` (the previous scale is
    kept where amax is 0 or not finite), then the history is rolled. The first step uses the initial scale 1.0.

    Args:
        margin: power-of-two head-room, >= 0. Larger margins shrink the scale by ``2**margin``.
        fp8_format: a :class:`Format`; default ``Format.HYBRID``.
        interval: scales are recomputed every ``interval`` updates (amaxes are recorded every step); >= 1.
        amax_history_len: length ``L`` of the amax history window; >= 1.
        amax_compute_algo: ``"max"`` (max over the window), ``"most_recent"`` (the current step's amax), or a
            callable mapping a history tensor ``[..., L]`` to amaxes ``[...]``.
        reduce_amax: reduce amaxes (MAX) across the autocast's ``amax_group`` before each update.

    Raises:
        ValueError: a field is out of range; the message names the field and what is allowed.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    interval: int = 1
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or self.margin < 0:
            raise ValueError(f"DelayedScaling.margin must be a number >= 0; got {self.margin!r}")
        _check_format(self.fp8_format)
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"DelayedScaling.interval must be an int >= 1; got {self.interval!r}")
        if (
            isinstance(self.amax_history_len, bool)
            or not isinstance(self.amax_history_len, int)
            or self.amax_history_len < 1
        ):
            raise ValueError(
                f"DelayedScaling.amax_history_len must be an int >= 1; got {self.amax_history_len!r}"
            )
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS} or a callable "
                f"history -> amax; got {algo!r}"
            )
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"DelayedScaling.reduce_amax must be True or False; got {self.reduce_amax!r}")


@dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor "just in time" scaling: ``scale = fp8_max / amax(x)`` of the very tensor being cast.

    No history: every cast costs an extra amax reduction, in exchange for never overflowing when ranges jump.
    (TransformerEngine's ``Float8CurrentScaling``; torchao's "tensorwise dynamic" scaling.)

    Raises:
        ValueError: ``fp8_format`` is not a :class:`Format`.
    """

    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)


#: TransformerEngine's name of :class:`CurrentScaling` (``transformer_engine.common.recipe.Float8CurrentScaling``):
#: the same class, so ``Float8CurrentScaling() == CurrentScaling()`` and either passes ``isinstance`` for the other.
Float8CurrentScaling = CurrentScaling


@dataclass(frozen=True)
class Float8BlockScaling:
    """Block-scaled FP8 (TransformerEngine's ``Float8BlockScaling``; the DeepSeek-V3 recipe, arXiv:2412.19437 §3.3).

    Every cast is "just in time" like :class:`CurrentScaling`, but the amax, and so the scale, is taken per block
    of ``BLOCK_SIZE`` = 128 elements instead of per tensor, so one outlier only coarsens its own block:
      * activations (the GEMM input) and gradients: 1 x 128 tiles, one scale per row per 128 consecutive
        elements of the last (contraction) dimension: ``scale_inv`` is ``[M, K/128]``;
      * weights: 128 x 128 blocks: ``scale_inv`` is ``[N/128, K/128]`` for an ``[N, K]`` weight.
    Per block: ``scale = fp8_max / amax(block)`` (1 where the amax is 0 or not finite), rounded down to a power of
    two when ``power_2_scale``; ``fp8 = saturate(x * scale)``, ``x ~= fp8 * scale_inv``, ``scale_inv = 1 / scale``.
    Layouts and kernels: :mod:`fp8engine.fp8.block_tensor`, :mod:`fp8engine.kernels.block_cast`; the GEMM:
    :mod:`fp8engine.ops.block_gemm`; the quantizers :mod:`fp8engine.fp8.block_quantizer`, which the same ops as
    the per-tensor recipes take (:mod:`fp8engine.ops.linear`; feature dims multiples of 128).

    Args:
        fp8_format: ``Format.E4M3`` (default, E4M3 everywhere, as DeepSeek-V3 and TransformerEngine's default) or
            ``Format.HYBRID`` (E5M2 gradients; torch's sm_90 block-wise GEMM takes E4M3 operands only, so with
            HYBRID the dgrad / wgrad GEMMs run ``ops/block_gemm.py``'s emulation, slowly). ``Format.E5M2`` is
            refused: per-block scales already give each block the range it needs, so E5M2's extra range would only
            cost mantissa bits in the forward pass (TransformerEngine refuses it too).
        power_2_scale: round every block scale down to a power of two (default True). Then ``x * scale`` and
            ``fp8 * scale_inv`` only shift exponents: ``scale_inv = 1 / scale`` is exact, dequantization is exact
            (no second rounding), the scale survives any transpose / re-layout unchanged, and the GEMM's
            per-block rescale in the accumulator adds no error. The price is at most one binade of unused range
            (the largest block value lands in (fp8_max/2, fp8_max]). TransformerEngine's ``Float8BlockScaling``
            uses power-of-two scales unless ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` is set; DeepSeek-V3 restricts
            activation scales to integral powers of 2 where they are re-used (arXiv:2412.19437 §3.3).

    Raises:
        ValueError: ``fp8_format`` is not E4M3 / HYBRID, or ``power_2_scale`` is not a bool.
    """

    #: Elements per tile (1 x 128) and per block side (128 x 128); fixed by the hardware GEMM's block scaling.
    BLOCK_SIZE: ClassVar[int] = 128

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)
        if self.fp8_format is Format.E5M2:
            raise ValueError(
                "Float8BlockScaling.fp8_format=Format.E5M2 is not supported (block scales already give each block "
                "its range; E5M2 only loses precision); use Format.E4M3 or Format.HYBRID (E5M2 gradients)"
            )
        if not isinstance(self.power_2_scale, bool):
            raise ValueError(f"Float8BlockScaling.power_2_scale must be True or False; got {self.power_2_scale!r}")


Recipe = Union[DelayedScaling, CurrentScaling, Float8BlockScaling]

