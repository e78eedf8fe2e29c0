"""``Float8BlockTensor``: FP8 data with a TENSOR of block scales (the ``Float8BlockScaling`` recipe).

Every 1 x 128 tile or 128 x 128 block of the 2-D data ``[M, K]`` has its own scale, written by the kernel that wrote
the bits (``fp8engine.kernels.block_cast``): ``data = saturate(x * scale)`` per block, ``scale_inv = 1 / scale``
dequantizes: ``x ~= data * scale_inv[block]``.

``scale_inv`` layouts (fp32; M rows, K columns, K the contraction dim of the GEMM that consumes the tensor):
  * ``block == (1, 128)`` (activations, gradients): logical ``[M, ceil(K/128)]``, ``scale_inv[i, j]`` for row i,
    columns ``128 j .. 128 j + 127``; stored M-major (strides ``(1, M)``: a ``[K/128, M]`` buffer seen through
    ``.t()``), the "outer-dim-major" layout ``torch.nn.functional.scaled_mm`` takes for ``ScalingType.BlockWise1x128``.
  * ``block == (128, 128)`` (weights): ``[ceil(M/128), ceil(K/128)]`` row-major; ``ops/block_gemm.py`` pads its
    columns to a multiple of 4 and passes it transposed (``ScalingType.BlockWise128x128``).
Dims that are not multiples of 128 give partial edge tiles (scale from the elements present); the GEMMs refuse them.

Transposes: a 128 x 128-blocked tensor transposes exactly (:meth:`Float8BlockTensor.t`). A 1 x 128-tiled one does
not (its tiles would become 128 x 1): its transpose is re-tiled from the high-precision tensor with new 1 x 128
scales along the other dim (``quantize_block(x, (1, 128), transpose=True)``, TransformerEngine's
``columnwise_usage``), written by the same cast and carried by the tensor (:meth:`Float8BlockTensor.t_operand`).

Token rows: the re-tiled transpose's tiles run along M, so the casts zero-pad the rows to a multiple of 128 (a zero
row adds nothing to any tile's amax or to the wgrad's sum) and the tensor remembers the real count (``rows``); the
GEMMs (``fprop``, ``dgrad``, ``wgrad``, ``wgrad_into``, attached by :mod:`fp8engine.ops.block_gemm` as
:mod:`fp8engine.ops.linear` attaches the per-tensor ones) drop the padded rows of their output.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8engine.fp8.dtypes import FP8_DTYPES, HIGH_PRECISION_DTYPES
from fp8engine.recipe import Float8BlockScaling

__all__ = ["Float8BlockTensor", "quantize_block", "TILE_1x128", "BLOCK_128x128"]

_B = Float8BlockScaling.BLOCK_SIZE
#: The two block shapes: 1 x 128 tiles (activations, gradients) and 128 x 128 blocks (weights).
TILE_1x128 = (1, _B)
BLOCK_128x128 = (_B, _B)


class Float8BlockTensor:
    """Block-scaled FP8 2-D tensor (not a torch.Tensor subclass: an operand holder for the block GEMM).

    Attributes:
        data: ``[M, K]`` ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, contiguous.
        scale_inv: fp32 block scale inverses, layout per ``block`` (module docstring).
        block: ``(1, 128)`` or ``(128, 128)``.
        dtype: the high-precision dtype the data came from (default of :meth:`dequantize`).
        rows: the real token count M (``data`` may hold zero rows padding it to a multiple of 128).
        data_t: the ``[K, M]`` transposed operand written with the data (1 x 128: re-tiled along M), or None.
    Raises:
        TypeError / ValueError (constructor): wrong dtypes, block, or scale_inv shape for the data.
    """

    __slots__ = ("data", "scale_inv", "block", "dtype", "rows", "_t")

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, block: tuple, dtype: torch.dtype,
                 rows: Optional[int] = None, data_t: Optional["Float8BlockTensor"] = None):
        if data.dtype not in FP8_DTYPES.values() or data.dim() != 2:
            raise TypeError(f"Float8BlockTensor: data must be a 2-D FP8 tensor, got {data.dtype} {tuple(data.shape)}")
        block = tuple(block)
        if block not in (TILE_1x128, BLOCK_128x128):
            raise ValueError(f"Float8BlockTensor: block must be {TILE_1x128} or {BLOCK_128x128}, got {block}")
        m, k = data.shape
        want = (-(-m // block[0]), -(-k // block[1]))
        if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want:
            raise ValueError(f"Float8BlockTensor: scale_inv must be float32 of shape {want} for data {(m, k)} with "
                             f"block {block}; got {scale_inv.dtype} {tuple(scale_inv.shape)}")
        self.data, self.scale_inv, self.block, self.dtype = data, scale_inv, block, dtype
        self.rows = m if rows is None else rows
        self._t = data_t

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    def expanded_scale_inv(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``[M, K]`` ``scale_inv`` of each element's block, in ``dtype``."""
        m, k = self.data.shape
        s = self.scale_inv.to(dtype)
        return s.repeat_interleave(self.block[0], 0).repeat_interleave(self.block[1], 1)[:m, :k]

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``data * scale_inv`` per block, computed in float64 (exact) and rounded once to ``dtype``
        (default: the original high-precision dtype). Returns ``[M, K]``."""
        out = self.data.to(torch.float64) * self.expanded_scale_inv(torch.float64)
        return out.to(dtype or self.dtype)

    def t(self) -> "Float8BlockTensor":
        """The ``[K, M]`` transpose of a 128 x 128-blocked tensor (bytes transposed, block grid transposed; exact).

        Raises:
            ValueError: for 1 x 128 tiles, which do not transpose: re-tile with
                ``quantize_block(x, (1, 128), transpose=True)`` from the high-precision tensor instead.
        """
        if self.block != BLOCK_128x128:
            raise ValueError("Float8BlockTensor.t(): 1 x 128 tiles do not transpose (they would become 128 x 1); "
                             "re-tile from the high-precision tensor with quantize_block(x, (1, 128), transpose=True)")
        return Float8BlockTensor(self.data.t().contiguous(), self.scale_inv.t().contiguous(), self.block, self.dtype)

    def t_operand(self) -> Optional["Float8BlockTensor"]:
        """The ``[K, M]`` operand the GEMMs take for this tensor's transpose (dgrad: the weight's, wgrad: the
        input's): the copy written with the data (1 x 128: re-tiled along M), or the exact block transpose of a
        128 x 128-blocked tensor (made once, then kept); None for a 1 x 128 tensor cast without it."""
        if self._t is None and self.block == BLOCK_128x128:
            self._t = self.t()
        return self._t

    @property
    def lacks_transpose(self) -> bool:
        """True for a 1 x 128 tensor cast without its re-tiled transpose (a wgrad cannot use it)."""
        return self._t is None and self.block == TILE_1x128

    def __repr__(self) -> str:
        return (f"Float8BlockTensor(shape={tuple(self.data.shape)}, fp8_dtype={self.data.dtype}, block={self.block}, "
                f"dtype={self.dtype})")


def quantize_block(x: torch.Tensor, fp8_dtype: torch.dtype, block: tuple = TILE_1x128, *, power_2_scale: bool = True,
                   transpose: bool = False, use_kernel: Optional[bool] = None, dbias: bool = False):
    """Cast ``x`` to block-scaled FP8 (scales from each block's amax; rule in ``fp8engine.kernels.block_cast``).

    Args:
        x: ``[*, K]`` bf16 / fp16 / fp32, viewed as ``[M, K]`` (M = product of the leading dims).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        block: ``(1, 128)`` (activations, gradients) or ``(128, 128)`` (weights).
        power_2_scale: power-of-two scales (exact ``scale_inv``; see ``Float8BlockScaling``).
        transpose: also return the ``[K, M]`` transposed operand: re-tiled along M for ``(1, 128)``, the exact
            block transpose for ``(128, 128)``; both from the same kernel pass.
        use_kernel: run the Triton kernel (default: when ``x`` is on CUDA); False runs the plain-PyTorch reference.
        dbias: (1 x 128 only: a gradient) also return its column sums ``x.sum(0)`` in fp32 rounded to x's dtype,
            from the same kernel pass (``block_cast.cast_1x128_dbias``).
    Returns:
        a :class:`Float8BlockTensor`, or ``(q, q_t)`` when ``transpose``; with ``dbias`` always
        ``(q, q_t or None, dbias [K])``.
    Raises:
        TypeError: ``x`` not a high-precision float tensor, or ``fp8_dtype`` not FP8. ValueError: bad ``block``,
        ``x`` 0-d, ``dbias`` with 128 x 128 blocks.
    """
    from fp8engine.kernels import block_cast as kb

    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"quantize_block: x has dtype {x.dtype}; supported: float32, bfloat16, float16")
    if fp8_dtype not in FP8_DTYPES.values():
        raise TypeError(f"quantize_block: fp8_dtype {fp8_dtype} not supported; use torch.float8_e4m3fn or e5m2")
    block = tuple(block)
    if block not in (TILE_1x128, BLOCK_128x128):
        raise ValueError(f"quantize_block: block must be {TILE_1x128} or {BLOCK_128x128}, got {block}")
    if x.dim() == 0:
        raise ValueError("quantize_block: x must have at least one dimension")
    if dbias and block != TILE_1x128:
        raise ValueError(f"quantize_block: dbias (a bias gradient) is cast with {TILE_1x128} tiles, got {block}")
    x2 = x.detach().reshape(-1, x.shape[-1]).contiguous()
    if use_kernel is None:
        use_kernel = x2.is_cuda
    if dbias:
        fn = kb.cast_1x128_dbias if use_kernel else kb.cast_1x128_dbias_reference
    elif block == TILE_1x128:
        fn = kb.cast_1x128 if use_kernel else kb.cast_1x128_reference
    else:
        fn = kb.cast_128x128 if use_kernel else kb.cast_128x128_reference
    data, sinv, data_t, sinv_t, *db = fn(x2, fp8_dtype, power_2_scale=power_2_scale, transpose=transpose)
    q = Float8BlockTensor(data, sinv, block, x.dtype)
    q_t = Float8BlockTensor(data_t, sinv_t, block, x.dtype) if transpose else None
    if dbias:
        return q, q_t, db[0]
    return (q, q_t) if transpose else q
