"""``BlockQuantizer``: how one FP8 tensor role of a module is cast under the ``Float8BlockScaling`` recipe.

The per-tensor :class:`~fp8engine.fp8.quantizer.Quantizer` has a counterpart here so that the modules keep one
set-up path (``FP8Module.fp8_begin()`` -> :func:`~fp8engine.fp8.quantizer.get_quantizers` -> one
:class:`~fp8engine.fp8.quantizer.LinearQuantizers` per GEMM, built once per scaling state and recipe and cached):
under block scaling its three entries are ``BlockQuantizer`` objects.

Roles and blocks (DeepSeek-V3, arXiv:2412.19437 §3.3; TransformerEngine's ``Float8BlockQuantizer``):
  * ``input`` and ``grad_output`` (activations, gradients): 1 x 128 tiles along the last dim, ``scale_inv``
    ``[M, K/128]``; the transposed operand for wgrad is RE-TILED (1 x 128 tiles along the token dim, new scales
    from the high-precision tensor), written by the same kernel pass;
  * ``weight``: 128 x 128 blocks, ``scale_inv`` ``[N/128, K/128]``; its transpose (dgrad) is exact.
Scales are computed just in time from each block's own amax (``scale = fp8_max / amax``, power of two when
``power_2_scale``; rule and layouts in :mod:`fp8engine.kernels.block_cast`). Nothing is recorded into the module's
amax history and the scaling state is never updated: the ``ScalingState`` buffers are untouched under this recipe.

Backend: :func:`fp8engine.fp8.float8_tensor.use_kernels` picks the Triton kernels (CUDA, or any device inside
``kernels_forced()``) or the plain-PyTorch references; both write the same FP8 bits and scales.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8engine.fp8.block_tensor import BLOCK_128x128, TILE_1x128, quantize_block
from fp8engine.fp8.dtypes import fp8_dtype_of
from fp8engine.fp8.float8_tensor import use_kernels

__all__ = ["BlockQuantizer", "BlockPair", "block_quantizers_for"]

#: What :meth:`BlockQuantizer.quantize` returns: ``(q, q_t)``, ``q`` the ``[M, K]`` operand and ``q_t`` its
#: ``[K, M]`` transposed operand (re-tiled for 1 x 128 tiles), or None when no transpose was asked for.
BlockPair = tuple


class BlockQuantizer:
    """Casts tensors of one FP8 role to :class:`~fp8engine.fp8.block_tensor.Float8BlockTensor`.

    Attributes:
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (the recipe format's forward half for
            ``input`` / ``weight``, backward half for gradients).
        block: ``(1, 128)`` (activations, gradients) or ``(128, 128)`` (weights).
        power_2_scale: the recipe's ``power_2_scale`` (power-of-two block scales).
        role: the role name (for messages).
        use_kernel: None (default): :func:`~fp8engine.fp8.float8_tensor.use_kernels` decides per tensor; True /
            False forces the Triton kernels / the plain-PyTorch reference (tests, ``ops.block_linear``'s argument).
        kind: ``"block"``. ``is_block``: True (the per-tensor ``Quantizer`` has False: the modules branch on it).
        delayed, scale, amax, stats: False / None / None / None, so per-tensor code that inspects a quantizer (e.g.
            the norm op's fused-cast test ``quantizer.delayed``) takes its unfused branch; ``record_amax`` is False
            (nothing recorded; FP8 cast statistics are not counted for block casts).
    Raises:
        ValueError (constructor): ``block`` is not one of the two block shapes.
    """

    __slots__ = ("fp8_dtype", "block", "power_2_scale", "role", "use_kernel")
    kind = "block"
    is_block = True
    delayed = False
    scale = None
    amax = None
    stats = None
    record_amax = False

    def __init__(self, fp8_dtype: torch.dtype, block: tuple, power_2_scale: bool = True, role: str = "",
                 use_kernel: Optional[bool] = None):
        block = tuple(block)
        if block not in (TILE_1x128, BLOCK_128x128):
            raise ValueError(f"BlockQuantizer: block must be {TILE_1x128} or {BLOCK_128x128}, got {block}")
        self.fp8_dtype, self.block, self.power_2_scale, self.role = fp8_dtype, block, power_2_scale, role
        self.use_kernel = use_kernel

    def quantize(self, x: torch.Tensor, *, transpose: bool = False) -> BlockPair:
        """Cast ``x`` (``[*, K]`` bf16 / fp16 / fp32, viewed as ``[M, K]``) in one kernel pass.

        Returns:
            ``(q, q_t)``: ``q`` the ``[M, K]`` :class:`Float8BlockTensor`; with ``transpose`` ``q_t`` the
            ``[K, M]`` one (1 x 128: re-tiled along M; 128 x 128: the exact block transpose), else None.
        Raises:
            as :func:`fp8engine.fp8.block_tensor.quantize_block`.
        """
        out = quantize_block(x, self.fp8_dtype, self.block, power_2_scale=self.power_2_scale,
                             transpose=transpose,
                             use_kernel=use_kernels(x) if self.use_kernel is None else self.use_kernel)
        return out if transpose else (out, None)

    def quantize_dbias(self, dy: torch.Tensor, *, transpose: bool = True) -> tuple:
        """Cast a gradient ``dy`` (``[*, N]``, viewed as ``[M, N]``; 1 x 128 tiles) and return its bias gradient,
        the column sums, too: ``(q, q_t or None, dbias [N] in dy.dtype)`` (``quantize_block(..., dbias=True)``: the
        kernels in one pass, :func:`fp8engine.kernels.block_cast.cast_1x128_dbias`; the reference ``dy.sum(0)`` in
        fp32; the two differ only in the fp32 summation order).

        Raises:
            ValueError: this quantizer has 128 x 128 blocks (weights have no bias gradient); as :meth:`quantize`.
        """
        if self.block != TILE_1x128:
            raise ValueError(f"BlockQuantizer.quantize_dbias: role {self.role!r} has {self.block} blocks; a bias "
                             "gradient is cast with 1 x 128 tiles")
        return quantize_block(dy, self.fp8_dtype, self.block, power_2_scale=self.power_2_scale, transpose=transpose,
                              use_kernel=use_kernels(dy) if self.use_kernel is None else self.use_kernel, dbias=True)

    def __repr__(self) -> str:
        return (f"BlockQuantizer(role={self.role!r}, block={self.block}, fp8_dtype={self.fp8_dtype}, "
                f"power_2_scale={self.power_2_scale})")


def block_quantizers_for(recipe, n_roles: int, use_kernel: Optional[bool] = None) -> list:
    """``n_roles`` :class:`BlockQuantizer` objects for a scaling state under the ``Float8BlockScaling`` ``recipe``,
    by position as :class:`~fp8engine.fp8.quantizer.LinearQuantizers` groups them (rows ``3g, 3g+1, 3g+2`` =
    GEMM ``g``'s input, weight, grad_output): input 1 x 128 tiles in the forward format, weight 128 x 128 blocks in
    the forward format, grad_output 1 x 128 tiles in the backward format."""
    fwd, bwd = fp8_dtype_of(recipe.fp8_format.fwd), fp8_dtype_of(recipe.fp8_format.bwd)
    # (fp8 dtype, block, role) of rows 3g, 3g+1, 3g+2
    per_gemm = ((fwd, TILE_1x128, "input"), (fwd, BLOCK_128x128, "weight"), (bwd, TILE_1x128, "grad_output"))
    return [BlockQuantizer(*per_gemm[i % 3][:2], recipe.power_2_scale, per_gemm[i % 3][2], use_kernel)
            for i in range(n_roles)]
