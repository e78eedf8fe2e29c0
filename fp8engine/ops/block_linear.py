"""``block_linear``: a linear layer whose three GEMMs run in block-scaled FP8 (the ``Float8BlockScaling`` recipe).

    fprop: y  = x @ w.T      x 1 x 128 tiles along K (in_features), w 128 x 128 blocks
    dgrad: dx = dy @ w       dy 1 x 128 tiles along N (out_features), w^T: the same blocks, transposed
    wgrad: dw = dy.T @ x     dy^T and x^T re-tiled: 1 x 128 tiles along the token dim M
Every scale is computed just in time from its own tile's amax (no history, nothing recorded); each operand is cast
once, its transposed (re-tiled) copy written by the same kernel pass. The bias is added by the fprop GEMM
(:func:`~fp8engine.ops.block_gemm.block_gemm`'s ``bias``); its gradient is ``dy.sum(0)`` in fp32, from the pass that
casts dy (:meth:`~fp8engine.fp8.block_quantizer.BlockQuantizer.quantize_dbias`).
Forward tensors are cast to ``recipe.fp8_format.fwd``, gradients to ``.bwd`` (E4M3, or E5M2 with HYBRID). The
casts are done by the GEMM's :class:`~fp8engine.fp8.quantizer.LinearQuantizers` of
:class:`~fp8engine.fp8.block_quantizer.BlockQuantizer` objects (what ``FP8Module.fp8_begin()`` returns under the
recipe); :func:`block_fp8_linear` is the entry point of the modules, :func:`block_linear` the standalone one.

Shapes: ``x`` ``[*, K]`` (e.g. ``[s, b, h]``), ``weight`` ``[N, K]``, ``bias`` ``[N]``; M = product of x's leading dims.
K and N must be multiples of 128 (the GEMMs' scaling block; :func:`check_block_dims`). M need not be: when it is not
a multiple of 128 the op zero-pads the token rows of ``x`` and ``dy`` to the next multiple (one copy of each) and
slices the outputs back. Padding is exact: a zero row adds nothing to any tile's amax or to the wgrad sum, and 1 x
128 tiles of the other operands are per row. Dtypes: x and weight bf16 or fp32 (the GEMM writes bf16 or fp32); y
and dx in x's dtype, dw in weight's dtype (fp32 into ``weight.main_grad`` with ``fuse_wgrad``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from fp8engine.fp8.block_quantizer import block_quantizers_for
from fp8engine.fp8.block_tensor import TILE_1x128, Float8BlockTensor
from fp8engine.fp8.float8_tensor import use_kernels
from fp8engine.fp8.quantizer import LinearQuantizers
from fp8engine.kernels.qkv_grad import assemble_qkv_grad, qkv_grad_1x128
from fp8engine.ops.backward import backward_keeps_graph
from fp8engine.ops.block_gemm import block_gemm
from fp8engine.ops.linear import main_grad_of
from fp8engine.ops.qkv import split_rotate
from fp8engine.ops.rotary import unrotate_grads
from fp8engine.recipe import Float8BlockScaling

__all__ = ["block_linear", "block_fp8_linear", "block_fp8_linear_qkv", "BlockLinearFunction", "BlockLinearQKV",
           "block_linear_grads", "check_block_dims", "check_x_q", "BLOCK_DTYPES"]

_B = Float8BlockScaling.BLOCK_SIZE
#: High-precision dtypes the block GEMM can write (``torch.nn.functional.scaled_mm``'s block-wise outputs).
BLOCK_DTYPES = (torch.bfloat16, torch.float32)


def check_block_dims(gemm_dims: Sequence[tuple[int, int]], what: str) -> None:
    """Raise ``ValueError`` unless every GEMM ``(in_features K, out_features N)`` in ``gemm_dims`` has both dims a
    multiple of 128, as the ``Float8BlockScaling`` GEMMs need (``what``: the module, for the message; a module with
    several GEMMs, e.g. LayerNormMLP's fc1 and fc2, gets the GEMM's position named too)."""
    for i, (k, n) in enumerate(gemm_dims):
        gemm = f" (GEMM {i + 1} of {len(gemm_dims)})" if len(gemm_dims) > 1 else ""
        for name, dim in (("in_features", k), ("out_features", n)):
            if dim % _B:
                raise ValueError(
                    f"{what}: {name}={dim}{gemm} is not a multiple of {_B}, which the Float8BlockScaling recipe's "
                    f"block GEMMs require (1 x {_B} and {_B} x {_B} scaling blocks); pad it to {-(-dim // _B) * _B}, "
                    "or use DelayedScaling / CurrentScaling (multiples of 16) for this model")


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, pad)) if pad else t


class BlockLinearFunction(torch.autograd.Function):
    """fprop / dgrad / wgrad in block-scaled FP8 (module docstring). Use through :func:`block_fp8_linear` or
    :func:`block_linear`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                quantizers: LinearQuantizers, w_q: Optional[tuple], fuse_wgrad: bool, use_hw: Optional[bool],
                x_q: Optional[tuple] = None):
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        pad = -m % _B
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or fuse_wgrad
        if x_q is None:
            qx, qx_t = quantizers.input.quantize(_pad_rows(x2, pad), transpose=need_dw)
        else:  # cast by the kernel that wrote x (the fused norm): rows already padded to a multiple of 128; q_t
            # is None when no backward runs (needs_input_grad stays True under no_grad; block_fp8_linear checked)
            qx, qx_t = x_q
            assert qx.shape[0] == m + pad, "x_q does not fit x"
        qw, qw_t = quantizers.weight.quantize(weight, transpose=need_dx) if w_q is None else w_q
        if need_dx and qw_t is None:  # a cached weight cast without its transpose (exact for 128 x 128 blocks)
            qw_t = qw.t()
        y = block_gemm(qx, qw, x.dtype, bias=bias, use_hw=use_hw)  # fprop: [M, K] x [N, K] -> [M, N] (+ bias)
        if pad:
            y = y[:m]
        ctx.save_for_backward(weight)
        ctx.saved = (qx_t if need_dw else None, qw_t if need_dx else None)
        ctx.cfg = (quantizers.grad_output, fuse_wgrad, use_hw, x.shape, x.dtype, pad)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dy2 = dy.reshape(-1, dy.shape[-1])
        if dy2.dtype not in BLOCK_DTYPES:
            dy2 = dy2.float()
        qx_t, qw_t = ctx.saved
        grad_q, pad, weight = ctx.cfg[0], ctx.cfg[5], ctx.saved_tensors[0]
        need_db = ctx.needs_input_grad[2]
        if qx_t is None and qw_t is None:  # only the bias needs a gradient
            if not backward_keeps_graph("a block-scaled FP8 linear"):
                ctx.saved = None
            return None, None, (dy2.sum(0, dtype=torch.float32).to(weight.dtype) if need_db else None), \
                None, None, None, None, None
        if need_db:  # the bias gradient from the cast's pass (padding rows are zeros: they add nothing)
            qdy, qdy_t, dbias = grad_q.quantize_dbias(_pad_rows(dy2, pad), transpose=qx_t is not None)
        else:
            (qdy, qdy_t), dbias = grad_q.quantize(_pad_rows(dy2, pad), transpose=qx_t is not None), None
        return (*block_linear_grads(ctx, qdy, qdy_t, dbias), None, None, None, None, None)


def block_linear_grads(ctx, qdy, qdy_t, dbias: Optional[torch.Tensor]) -> tuple:
    """``(dx, dw, dbias)`` of a block linear whose forward ran :meth:`BlockLinearFunction.forward` on ``ctx``, given
    the output gradient already cast (``qdy [M_pad, N]`` 1 x 128 and, when a wgrad runs, its re-tiled ``qdy_t``;
    token rows padded as the forward padded them) and its bias gradient (any float dtype, or None): dgrad ``dx = dy
    @ w`` ``[M, K]`` in x's dtype, wgrad ``dw = dy.T @ x`` in the weight's dtype (or added in fp32 into
    ``weight.main_grad`` with ``fuse_wgrad``, dw None), dbias in the weight's dtype."""
    (weight,) = ctx.saved_tensors
    qx_t, qw_t = ctx.saved
    _, fuse_wgrad, use_hw, x_shape, x_dtype, pad = ctx.cfg
    if not backward_keeps_graph("a block-scaled FP8 linear"):  # (kept for another backward under retain_graph)
        ctx.saved = None
    dx = dw = None
    if qw_t is not None:  # dgrad: [M, N] x [K, N] -> [M, K]
        dx = block_gemm(qdy, qw_t, x_dtype, use_hw=use_hw)
        dx = (dx[:dx.shape[0] - pad] if pad else dx).reshape(x_shape)
    if qx_t is not None:  # wgrad: [N, M] x [K, M] -> [N, K]
        if fuse_wgrad:
            main_grad_of(weight).add_(block_gemm(qdy_t, qx_t, torch.float32, use_hw=use_hw))
        else:
            dw = block_gemm(qdy_t, qx_t, weight.dtype, use_hw=use_hw)
    return dx, dw, None if dbias is None else dbias.to(weight.dtype)


class BlockLinearQKV(torch.autograd.Function):
    """:class:`BlockLinearFunction` whose output is returned as the grouped ``q, k, v`` of the fused QKV projection
    (:func:`fp8engine.ops.qkv.split_rotate`: views, q and k rotated with rotary angles), and whose backward casts the
    output gradient straight from ``dq, dk, dv`` (:func:`fp8engine.kernels.qkv_grad.qkv_grad_1x128`: the rotation's
    gradient, the 1 x 128 cast, its re-tiled transpose and the bias gradient in one pass) instead of assembling them
    into a ``[T, C]`` buffer first. Where that kernel does not run (the CPU reference path, a None gradient) the
    buffer is assembled and cast as :class:`BlockLinearFunction` casts its gradient: the same bits."""

    @staticmethod
    def forward(ctx, x, weight, bias, quantizers: LinearQuantizers, w_q: Optional[tuple], fuse_wgrad: bool,
                use_hw: Optional[bool], x_q: Optional[tuple], split: tuple, freqs: Optional[torch.Tensor]):
        y = BlockLinearFunction.forward(ctx, x, weight, bias, quantizers, w_q, fuse_wgrad, use_hw, x_q)
        q, k, v, ctx.rope = split_rotate(y, split, freqs)
        ctx.hpg = split[1]
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qx_t, qw_t = ctx.saved
        grad_q = ctx.cfg[0]
        need_db, rope = ctx.needs_input_grad[2], ctx.rope
        if not backward_keeps_graph("the block-scaled FP8 QKV projection"):
            ctx.rope = None
        kernels = use_kernels(dq) if grad_q.use_kernel is None else grad_q.use_kernel
        # (the kernel pads the token rows to a multiple of 128, as the forward padded x: the same row count)
        if (qx_t is not None or qw_t is not None) and dk is not None and dv is not None and dq is not None \
                and kernels and dq.dtype in BLOCK_DTYPES:
            data, sinv, data_t, sinv_t, dbias = qkv_grad_1x128(
                dq, dk, dv, grad_q.fp8_dtype, power_2_scale=grad_q.power_2_scale, transpose=qx_t is not None,
                dbias=need_db, cos=None if rope is None else rope[0], sin=None if rope is None else rope[1])
            qdy = Float8BlockTensor(data, sinv, TILE_1x128, dq.dtype)
            qdy_t = None if data_t is None else Float8BlockTensor(data_t, sinv_t, TILE_1x128, dq.dtype)
            return (*block_linear_grads(ctx, qdy, qdy_t, dbias), None, None, None, None, None, None, None)
        if rope is not None:
            dq, dk = unrotate_grads(dq, dk, rope)
        dy = assemble_qkv_grad(dq, dk, dv, heads_per_group=ctx.hpg)
        return (*BlockLinearFunction.backward(ctx, dy), None, None)


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     quantizers: LinearQuantizers, *, w_q: Optional[tuple] = None, fuse_wgrad: bool = False,
                     use_hw: Optional[bool] = None, x_q: Optional[tuple] = None) -> torch.Tensor:
    """Block-scaled FP8 ``x @ weight.T + bias`` with gradients: the modules' entry point (no per-call validation:
    the module checked K and N once with :func:`check_block_dims`).

    Args:
        x: ``[*, K]`` bf16 / fp32; output ``[*, N]`` in x's dtype. weight: ``[N, K]`` bf16 / fp32. bias: ``[N]``
            or None.
        quantizers: the GEMM's :class:`LinearQuantizers` of ``BlockQuantizer`` objects (``fp8_begin()`` under
            ``Float8BlockScaling``).
        w_q: the weight already cast, ``(qw, qw_t or None)`` from ``quantizers.weight.quantize`` (FP8 weight caching
            across micro-batches); cast now when None.
        fuse_wgrad: add wgrad (fp32) into ``weight.main_grad``; ``weight.grad`` stays None.
        use_hw: see :func:`fp8engine.ops.block_gemm.block_gemm` (default: cuBLASLt where available).
        x_q: ``x`` already cast, ``(q, q_t or None)`` 1 x 128-tiled with the token rows zero-padded to a multiple
            of 128 (the fused norm of :func:`fp8engine.ops.block_norm.block_norm_cast`; ``q_t`` needed when a
            wgrad runs); ``x`` then only carries the gradient (its values are not read). Cast now when None.
    Raises:
        TypeError: x or weight in another dtype than bf16 / fp32 (e.g. fp16: the block GEMM has no fp16 output).
    """
    _check_entry(x, weight, x_q, fuse_wgrad, "block_fp8_linear")
    return BlockLinearFunction.apply(x, weight, bias, quantizers, w_q, fuse_wgrad, use_hw, x_q)


def block_fp8_linear_qkv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         quantizers: LinearQuantizers, split: tuple, *, w_q: Optional[tuple] = None,
                         fuse_wgrad: bool = False, use_hw: Optional[bool] = None, x_q: Optional[tuple] = None,
                         freqs: Optional[torch.Tensor] = None):
    """:func:`block_fp8_linear` of the fused QKV projection returning ``(q [s, b, g, hpg, d], k [s, b, g, d], v
    [s, b, g, d])`` (:class:`BlockLinearQKV`; ``split = (g, hpg, d)`` per rank, ``weight`` ``[g * (hpg + 2) * d,
    K]`` in the grouped layout of :mod:`fp8engine.ops.qkv`, ``freqs`` rotary angles ``[s, 1, 1, r]`` or None).
    Arguments and errors otherwise as :func:`block_fp8_linear`; ``x`` is ``[s, b, K]``."""
    _check_entry(x, weight, x_q, fuse_wgrad, "block_fp8_linear_qkv")
    return BlockLinearQKV.apply(x, weight, bias, quantizers, w_q, fuse_wgrad, use_hw, x_q, tuple(split), freqs)


def _check_entry(x: torch.Tensor, weight: torch.Tensor, x_q: Optional[tuple], fuse_wgrad: bool, op: str) -> None:
    """The modules' entry points' checks: bf16 / fp32 operands, and an already cast input with its transpose when a
    wgrad will run."""
    if x.dtype not in BLOCK_DTYPES or weight.dtype not in BLOCK_DTYPES:
        raise TypeError(f"Float8BlockScaling: x is {x.dtype} and the weight {weight.dtype}; the block-scaled GEMMs "
                        "take bfloat16 or float32 (use torch.autocast(dtype=torch.bfloat16) or bf16 parameters)")
    check_x_q(x_q, torch.is_grad_enabled() and (weight.requires_grad or fuse_wgrad), op)


def check_x_q(x_q: Optional[tuple], wgrad: bool, op: str) -> None:
    """``ValueError`` when an already cast input ``x_q = (q, q_t)`` lacks the transpose ``q_t`` that the wgrad
    GEMM reads and a wgrad will run (``wgrad``: gradients enabled and the weight needs one)."""
    if x_q is not None and wgrad and x_q[1] is None:
        raise ValueError(f"{op}: x_q has no transposed copy (q_t), which the weight gradient needs while gradients "
                         "are enabled; cast it with transpose=True (block_norm_cast(..., transpose=True))")


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 recipe: Optional[Float8BlockScaling] = None, *, use_kernel: Optional[bool] = None,
                 use_hw: Optional[bool] = None) -> torch.Tensor:
    """``y = x @ weight.T + bias`` with all three GEMMs in block-scaled FP8, standalone (module docstring).

    Args:
        x: ``[*, K]`` bf16 / fp32. weight: ``[N, K]`` bf16 / fp32. bias: ``[N]`` or None.
        recipe: a :class:`Float8BlockScaling` (default ``Float8BlockScaling()``: E4M3, power-of-two scales).
        use_kernel: Triton cast kernels (True), the plain-PyTorch references (False), or
            :func:`~fp8engine.fp8.float8_tensor.use_kernels`'s choice (None: the kernels on CUDA).
        use_hw: see :func:`fp8engine.ops.block_gemm.block_gemm`.
    Returns:
        ``[*, N]`` in x's dtype.
    Raises:
        TypeError: ``recipe`` not a Float8BlockScaling; x / weight dtypes other than bf16 / fp32.
        ValueError: weight not 2-D, feature dims mismatch, or K, N not multiples of 128 (M is padded).
    """
    recipe = Float8BlockScaling() if recipe is None else recipe
    if not isinstance(recipe, Float8BlockScaling):
        raise TypeError(f"block_linear: recipe must be a Float8BlockScaling, got {type(recipe).__name__}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"block_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(want x [*, K], weight [N, K])")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in BLOCK_DTYPES:
            raise TypeError(f"block_linear: {name} has dtype {t.dtype}; supported: bfloat16, float32")
    check_block_dims([(weight.shape[1], weight.shape[0])], "block_linear")
    quantizers = LinearQuantizers(*block_quantizers_for(recipe, 3, use_kernel))
    return BlockLinearFunction.apply(x, weight, bias, quantizers, None, False, use_hw, None)
