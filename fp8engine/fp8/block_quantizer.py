"""``BlockQuantizer``: how one FP8 tensor role of a module is cast under the ``Float8BlockScaling`` recipe.

The block-scaled counterpart of :class:`~fp8engine.fp8.quantizer.Quantizer`, with its interface, so the modules keep
one set-up path (:func:`~fp8engine.fp8.quantizer.get_quantizers` -> one ``LinearQuantizers`` per GEMM, cached).

Roles and blocks (DeepSeek-V3, arXiv:2412.19437 §3.3; TransformerEngine's ``Float8BlockQuantizer``): ``input`` and
``grad_output`` 1 x 128 tiles, ``scale_inv [M, K/128]``, the wgrad operand re-tiled along the token dim by the same
kernel pass; ``weight`` 128 x 128 blocks, ``scale_inv [N/128, K/128]``, transposed exactly. Scales come just in time
from each block's own amax (rule and layouts: :mod:`fp8engine.kernels.block_cast`, :mod:`fp8engine.fp8.block_tensor`);
nothing is recorded and the ``ScalingState`` buffers are untouched under this recipe.

Where an op fuses a cast into another kernel it asks the quantizer for that fused cast (``cast_norm``, ``cast_act``,
``cast_act_grad``, ``cast_qkv_grad``: the block kernels of :mod:`fp8engine.kernels.block_norm`,
``.block_activation`` and ``.qkv_grad``); the per-tensor ``Quantizer`` has None there. ``kernels``, chosen by
:func:`~fp8engine.fp8.quantizer.get_quantizers`, runs the Triton kernels or the plain-PyTorch references (the same
FP8 bits and scales).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fp8engine.fp8.block_tensor import BLOCK_128x128, TILE_1x128, Float8BlockTensor, quantize_block
from fp8engine.fp8.dtypes import fp8_dtype_of

__all__ = ["BlockQuantizer", "block_quantizers_for", "BLOCK_DTYPES"]

#: High-precision dtypes the block GEMM takes and writes (``torch.nn.functional.scaled_mm``'s block-wise outputs).
BLOCK_DTYPES = (torch.bfloat16, torch.float32)
_B = TILE_1x128[1]


def _pad_rows(x2: torch.Tensor) -> torch.Tensor:
    """``x2 [M, K]`` with zero rows appended up to a multiple of 128 (itself when M is one)."""
    pad = -x2.shape[0] % _B
    return F.pad(x2, (0, 0, 0, pad)) if pad else x2


def _tiled(data, sinv, data_t, sinv_t, dtype, rows: int) -> Float8BlockTensor:
    """A 1 x 128 :class:`Float8BlockTensor` from a kernel's outputs (rows padded), with its transpose if written."""
    t = None if data_t is None else Float8BlockTensor(data_t, sinv_t, TILE_1x128, dtype)
    return Float8BlockTensor(data, sinv, TILE_1x128, dtype, rows, t)


class BlockQuantizer:
    """Casts tensors of one FP8 role to :class:`~fp8engine.fp8.block_tensor.Float8BlockTensor`.

    Attributes:
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (the recipe format's forward half for
            ``input`` / ``weight``, backward half for gradients).
        block: ``(1, 128)`` (activations, gradients) or ``(128, 128)`` (weights).
        power_2_scale: the recipe's ``power_2_scale`` (power-of-two block scales).
        role: the role name (for messages).
        kernels: True runs the Triton kernels (the casts and the fused casts below), False (default) the
            plain-PyTorch references.
        kind, is_block: ``"block"``, True.
        delayed, record_amax, scale, amax, stats: False, False, None, None, None, so per-tensor code that inspects a
            quantizer takes its unfused branch (nothing recorded; FP8 cast statistics are not counted for block casts).
    Raises:
        ValueError (constructor): ``block`` is not one of the two block shapes.
    """

    __slots__ = ("fp8_dtype", "block", "power_2_scale", "role", "kernels")
    kind = "block"
    is_block = True
    delayed = record_amax = False
    scale = amax = stats = None

    def __init__(self, fp8_dtype: torch.dtype, block: tuple, power_2_scale: bool = True, role: str = "",
                 kernels: bool = False):
        block = tuple(block)
        if block not in (TILE_1x128, BLOCK_128x128):
            raise ValueError(f"BlockQuantizer: block must be {TILE_1x128} or {BLOCK_128x128}, got {block}")
        self.fp8_dtype, self.block, self.power_2_scale, self.role = fp8_dtype, block, power_2_scale, role
        self.kernels = kernels

    def quantize(self, x: torch.Tensor, *, transpose: bool = False,
                 amax: Optional[torch.Tensor] = None) -> Float8BlockTensor:
        """Cast ``x`` (``[*, K]`` bf16 / fp32, viewed as ``[M, K]``) in one kernel pass: a
        :class:`Float8BlockTensor` ``[M_pad, K]`` (1 x 128 tiles: the rows zero-padded to a multiple of 128,
        ``rows = M``) holding, with ``transpose``, its ``[K, M_pad]`` transposed operand (re-tiled along M for
        1 x 128, the exact block transpose for 128 x 128). ``amax``: accepted for the per-tensor interface (a
        current-scaling amax), unused: block scales come from each block's own amax.

        Raises:
            TypeError: ``x`` neither bf16 nor fp32 (the block GEMMs' dtypes); as
            :func:`fp8engine.fp8.block_tensor.quantize_block`.
        """
        if x.dtype not in BLOCK_DTYPES:
            raise TypeError(f"Float8BlockScaling: a {x.dtype} tensor; the block-scaled GEMMs take bfloat16 or "
                            "float32 (use torch.autocast(dtype=torch.bfloat16) or bf16 parameters)")
        x2 = x.detach().reshape(-1, x.shape[-1])
        out = quantize_block(_pad_rows(x2) if self.block == TILE_1x128 else x2, self.fp8_dtype, self.block,
                             power_2_scale=self.power_2_scale, transpose=transpose, use_kernel=self.kernels)
        q, q_t = out if transpose else (out, None)
        q.rows, q._t = x2.shape[0], q_t
        return q

    def quantize_dbias(self, dy: torch.Tensor, *, transpose: bool = True,
                       dbias: bool = True) -> tuple[Float8BlockTensor, Optional[torch.Tensor]]:
        """Cast a gradient ``dy`` (``[*, N]``, viewed as ``[M, N]``; 1 x 128 tiles, rows padded as
        :meth:`quantize`) and, with ``dbias``, its column sums in the same pass (``quantize_block(..., dbias=True)``):
        ``(q, dbias [N] in dy.dtype or None)``. An fp16 ``dy`` is cast from its fp32 copy (the GEMMs write no fp16).

        Raises:
            ValueError: this quantizer has 128 x 128 blocks (weights have no bias gradient); as :meth:`quantize`.
        """
        if self.block != TILE_1x128:
            raise ValueError(f"BlockQuantizer.quantize_dbias: role {self.role!r} has {self.block} blocks; a bias "
                             "gradient is cast with 1 x 128 tiles")
        if dy.dtype == torch.float16:
            dy = dy.float()
        if not dbias:
            return self.quantize(dy, transpose=transpose), None
        dy2 = dy.reshape(-1, dy.shape[-1])
        q, q_t, db = quantize_block(_pad_rows(dy2), self.fp8_dtype, self.block, power_2_scale=self.power_2_scale,
                                    transpose=transpose, use_kernel=self.kernels, dbias=True)
        q.rows, q._t = dy2.shape[0], q_t
        return q, db

    # -- the fused casts (module docstring): the block kernels, or None where they do not run ----------------------
    def cast_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, *,
                  rms: bool, zero_centered_gamma: bool, transpose: bool, return_hp: bool, res: dict):
        """LayerNorm / RMSNorm of a contiguous ``x [..., K]`` written 1 x 128-tiled by one kernel
        (:func:`fp8engine.kernels.block_norm.norm_fwd_1x128`, rows padded, its re-tiled transpose when
        ``transpose``): ``(y or None, y_fp8, mean, rstd)``, the norm op's layout (its backward is the per-tensor
        norm's kernels). ``res``: ``{}`` or ``dict(residual=, residual_out=)`` (normalise ``x + residual``)."""
        from fp8engine.kernels.block_norm import norm_fwd_1x128

        y, data, sinv, data_t, sinv_t, mean, rstd = norm_fwd_1x128(
            x, weight, None if rms else bias, eps, self.fp8_dtype, rms=rms, zero_centered_gamma=zero_centered_gamma,
            power_2_scale=self.power_2_scale, transpose=transpose, pad_rows=True, return_hp=return_hp, **res)
        return y, _tiled(data, sinv, data_t, sinv_t, x.dtype, x.numel() // x.shape[-1]), mean, rstd

    def cast_act(self, h: torch.Tensor, kind: str, transpose: bool) -> Optional[Float8BlockTensor]:
        """``act(h)`` for a contiguous ``h [M, D]`` written only in FP8 by the activation kernel
        (:func:`fp8engine.kernels.block_activation.act_fwd_1x128`, rows padded), or None off the kernel path."""
        if not self.kernels:
            return None
        from fp8engine.kernels.block_activation import act_fwd_1x128

        out = act_fwd_1x128(h, kind, self.fp8_dtype, power_2_scale=self.power_2_scale, transpose=transpose,
                            pad_rows=True)
        return _tiled(*out, h.dtype, h.shape[0])

    def cast_act_grad(self, da: torch.Tensor, h: torch.Tensor, kind: str, *, transpose: bool,
                      dbias: bool) -> Optional[tuple]:
        """``dh = da * act'(h)`` written only in FP8 by one kernel pass with its re-tiled transpose and column sums
        (:func:`fp8engine.kernels.block_activation.act_bwd_1x128`): ``(dh_fp8, dbias or None)``, or None off the
        kernel path."""
        if not self.kernels:
            return None
        from fp8engine.kernels.block_activation import act_bwd_1x128

        data, sinv, data_t, sinv_t, db = act_bwd_1x128(da, h, kind, self.fp8_dtype, transpose=transpose,
                                                       power_2_scale=self.power_2_scale, pad_rows=True, dbias=dbias)
        return _tiled(data, sinv, data_t, sinv_t, h.dtype, h.shape[0]), db

    def cast_qkv_grad(self, dq, dk, dv, *, transpose: bool, dbias: bool, rope: Optional[tuple]) -> Optional[tuple]:
        """The fused QKV projection's output gradient cast straight from ``dq, dk, dv`` (the rotation's gradient
        applied in the gather when ``rope = (cos, sin)``; :func:`fp8engine.kernels.qkv_grad.qkv_grad_1x128`):
        ``(dy_fp8 [T, C], dbias or None)``, or None where that kernel does not run (the reference path, a None
        gradient, an fp16 gradient)."""
        if dq is None or dk is None or dv is None or dq.dtype not in BLOCK_DTYPES or not self.kernels:
            return None
        from fp8engine.kernels import qkv_grad as kq

        cos, sin = rope if rope is not None else (None, None)
        data, sinv, data_t, sinv_t, db = kq.qkv_grad_1x128(dq, dk, dv, self.fp8_dtype, transpose=transpose,
                                                           power_2_scale=self.power_2_scale, dbias=dbias, cos=cos,
                                                           sin=sin)
        return _tiled(data, sinv, data_t, sinv_t, dq.dtype, dv.shape[0] * dv.shape[1]), db

    def __repr__(self) -> str:
        return (f"BlockQuantizer(role={self.role!r}, block={self.block}, fp8_dtype={self.fp8_dtype}, "
                f"power_2_scale={self.power_2_scale})")


def block_quantizers_for(recipe, n_roles: int, kernels: bool = False) -> list:
    """``n_roles`` :class:`BlockQuantizer` objects for a scaling state under the ``Float8BlockScaling`` ``recipe``,
    by position as :class:`~fp8engine.fp8.quantizer.LinearQuantizers` groups them (rows ``3g, 3g+1, 3g+2`` =
    GEMM ``g``'s input, weight, grad_output): input 1 x 128 tiles in the forward format, weight 128 x 128 blocks in
    the forward format, grad_output 1 x 128 tiles in the backward format; ``kernels``: their backend."""
    fwd, bwd = fp8_dtype_of(recipe.fp8_format.fwd), fp8_dtype_of(recipe.fp8_format.bwd)
    # (fp8 dtype, block, role) of rows 3g, 3g+1, 3g+2
    per_gemm = ((fwd, TILE_1x128, "input"), (fwd, BLOCK_128x128, "weight"), (bwd, TILE_1x128, "grad_output"))
    return [BlockQuantizer(*per_gemm[i % 3][:2], recipe.power_2_scale, per_gemm[i % 3][2], kernels)
            for i in range(n_roles)]
