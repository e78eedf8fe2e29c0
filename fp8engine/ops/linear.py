"""The linear op: one ``autograd.Function`` around the three GEMMs, with optional tensor-parallel communication.

- fprop: ``y  = x  @ w.T``   (E4M3 x E4M3 under HYBRID, fast accumulation)
- dgrad: ``dx = dy @ w``     (E5M2 grad x E4M3 weight)
- wgrad: ``dw = dy.T @ x``   (E5M2 grad x E4M3 input)

Operands are cast by the GEMM's :class:`~fp8engine.fp8.quantizer.LinearQuantizers`; backward casts ``dy`` once with
``Quantizer.quantize_dbias`` (on CUDA the ``cast_transpose_dbias`` kernel: both FP8 layouts and the bias gradient
in one pass) and runs the two GEMMs in :func:`dgrad_wgrad`, which the fused MLP and QKV ops share.

One op for every recipe: the quantizers return FP8 tensors that carry their own GEMMs (``x.fprop(w)``,
``dy.dgrad(w_t)``, ``dy.wgrad(x_t)``, ``dy.wgrad_into(x_t, main_grad)``, with ``t = x.t_operand()`` what backward
keeps of an operand's transpose). Per-tensor scaling (delayed, current): :class:`Float8Tensor`, whose GEMMs are
attached below (:mod:`fp8engine.ops.gemm`). Block scaling (``Float8BlockScaling``): 1 x 128-tiled inputs and
gradients and 128 x 128-blocked weights (:class:`~fp8engine.fp8.block_tensor.Float8BlockTensor`), whose GEMMs are
:mod:`fp8engine.ops.block_gemm`'s (K and N multiples of 128, bf16 / fp32 operands).

Tensor parallelism: ``comm``, a :class:`~fp8engine.ops.comm.LinearComm` (shapes per rank and where each collective
runs: :mod:`fp8engine.ops.comm`); None: no communication. The dgrad communication is started after the dgrad GEMM
and waited for after wgrad (Megatron-core's async dgrad communication).

Without quantizers (:func:`linear` with ``quantizers=None``, used by the tensor-parallel layers outside FP8 regions)
the same op runs the three GEMMs as plain matmuls in the input's dtype, with the same communication.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

from fp8engine.fp8.block_quantizer import BLOCK_DTYPES, block_quantizers_for
from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.quantizer import LinearQuantizers, Quantizer, call_kernels
from fp8engine.ops.backward import backward_keeps_graph
from fp8engine.ops.block_gemm import check_block_dims
from fp8engine.ops.comm import LinearComm
from fp8engine.ops.gemm import fp8_fprop, fp8_mm, fp8_mm_accumulate
from fp8engine.ops.gemm_ops import compiled_gemm_ops, mm_accumulate_fp8
from fp8engine.recipe import Float8BlockScaling

__all__ = ["linear", "fp8_linear", "block_linear", "linear_input", "output_leading_dims", "LINEAR_ROLES",
           "main_grad_of", "accumulate_wgrad", "fp8_wgrad_accumulate", "linear_main_grad", "dgrad_wgrad",
           "linear_backward"]

#: Rows of a Linear's :class:`ScalingState`.
LINEAR_ROLES = ("input", "weight", "grad_output")


def main_grad_of(weight: torch.Parameter) -> torch.Tensor:
    """The fp32 ``weight.main_grad`` the user allocated for ``fuse_wgrad_accumulation``.

    Raises ValueError when ``main_grad`` is missing, not float32, or not shaped like the weight."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise ValueError("fuse_wgrad_accumulation=True needs weight.main_grad (an fp32 tensor shaped like the "
                         "weight) to be allocated before backward")
    if main_grad.dtype != torch.float32 or main_grad.shape != weight.shape:
        raise ValueError(f"weight.main_grad must be float32 with the weight's shape {tuple(weight.shape)}, got "
                         f"{main_grad.dtype} {tuple(main_grad.shape)}")
    return main_grad


def fp8_wgrad_accumulate(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                         out: torch.Tensor, kernels: bool = False) -> None:
    """``out += (a * a_scale_inv) @ (b * b_scale_inv).T``, a wgrad ``[N, K]`` accumulated into fp32 ``main_grad``
    (FP8 ``a [N, M]``, ``b [K, M]``, ``M`` zero-padded to 16): :func:`fp8_mm_accumulate`, or traced by
    ``torch.compile`` on CUDA its custom op :func:`~fp8engine.ops.gemm_ops.mm_accumulate_fp8` (Dynamo cannot trace
    the ctypes call). Errors as :func:`fp8_mm_accumulate`."""
    if compiled_gemm_ops(out):
        mm_accumulate_fp8(a, a_scale_inv, b, b_scale_inv, out, True)
    else:
        fp8_mm_accumulate(a, a_scale_inv, b, b_scale_inv, out, pad_inner=True, kernels=kernels)


def _dgrad(dy: Float8Tensor, w_t: tuple, out_dtype: torch.dtype) -> torch.Tensor:
    return fp8_mm(dy.data, dy.scale_inv, w_t[0], w_t[1], out_dtype, kernels=dy.kernels)


def _wgrad(dy: Float8Tensor, x_t: tuple, out_dtype: torch.dtype) -> torch.Tensor:
    return fp8_mm(dy.transpose_2d(), dy.scale_inv, x_t[0], x_t[1], out_dtype, pad_inner=True, kernels=dy.kernels)


def _wgrad_into(dy: Float8Tensor, x_t: tuple, out: torch.Tensor) -> None:
    fp8_wgrad_accumulate(dy.transpose_2d(), dy.scale_inv, x_t[0], x_t[1], out, dy.kernels)


# The per-tensor GEMMs (module docstring): fprop y = x @ w.T + b, dgrad dx = dy @ w (w_t = w.t_operand()),
# wgrad dw = dy.T @ x (x_t = x.t_operand())
Float8Tensor.fprop, Float8Tensor.dgrad, Float8Tensor.wgrad, Float8Tensor.wgrad_into = (fp8_fprop, _dgrad, _wgrad,
                                                                                      _wgrad_into)


def accumulate_wgrad(weight: torch.Parameter, dw: torch.Tensor) -> None:
    """Add a computed ``dw`` into ``weight.main_grad`` (the high-precision paths; FP8 wgrads accumulate inside
    the GEMM with :func:`fp8engine.ops.gemm.fp8_mm_accumulate`). Errors as :func:`main_grad_of`."""
    main_grad_of(weight).add_(dw)


def linear_main_grad(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """High-precision ``F.linear`` whose weight gradient is added to ``weight.main_grad`` (``weight.grad`` stays
    None): the path ``fuse_wgrad_accumulation`` takes outside FP8 regions (:func:`linear` without quantizers)."""
    return linear(x, weight, bias, None, fuse_wgrad=True)


def output_leading_dims(x: torch.Tensor, rows: int) -> tuple:
    """The leading dims of an output with ``rows`` rows for the input ``x [*, K]``: ``x``'s, with dim 0 scaled by
    the all-gather (``tp``) or the reduce-scatter (``1/tp``) that changed the row count."""
    local = math.prod(x.shape[:-1])
    if rows == local:
        return tuple(x.shape[:-1])
    return (rows * x.shape[0] // local,) + tuple(x.shape[1:-1])


class _FP8Linear(torch.autograd.Function):
    """The linear op (module docstring). ``x_total`` is the fprop input ``[M, K]`` after any all-gather: a
    :class:`Float8Tensor` under FP8, else high precision (then ``w_fp8`` and ``grad_quantizer`` are None).
    ``x_shard``: the input's sequence shard that backward re-gathers for wgrad (instead of keeping ``x_total``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_total, w_fp8: Optional[Float8Tensor], grad_quantizer: Optional[Quantizer],
                fuse_wgrad: bool, comm: Optional[LinearComm] = None, x_shard=None):
        row = comm is not None and comm.reduces_output
        needs_dw = ctx.needs_input_grad[1] or fuse_wgrad
        ctx.grad_quantizer, ctx.fuse_wgrad, ctx.comm, ctx.x_shape = grad_quantizer, fuse_wgrad, comm, x.shape
        gemm_bias = None if bias is None or row else bias
        if grad_quantizer is None:  # high precision: keep x_total, or the shard to re-gather
            y = F.linear(x_total, weight, gemm_bias)
            ctx.regather = needs_dw and x_shard is not None
            ctx.save_for_backward((x_total if x_shard is None else x_shard) if needs_dw else None, weight)
        else:
            ctx.x_shard = x_shard if needs_dw else None
            y = x_total.fprop(w_fp8, x.dtype, gemm_bias)
            ctx.save_for_backward(weight)  # of x and w only the transposes backward needs (or the FP8 shard)
            ctx.x_t = x_total.t_operand() if needs_dw and x_shard is None else None
            ctx.w_t = w_fp8.t_operand() if ctx.needs_input_grad[0] else None
        if row:  # the partial sums over the ranks, then the (unsharded) bias
            y = comm.reduce_output(y)
            if bias is not None:
                y = y + bias.to(y.dtype)
        return y.reshape(*output_leading_dims(x, y.shape[0]), y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        dy2d = dy.reshape(-1, dy.shape[-1])
        need_db, db_rows = ctx.needs_input_grad[2], None
        comm = ctx.comm
        if comm is not None and comm.reduces_output:
            if need_db:  # the bias was added to this rank's rows after the reduction
                db_rows = dy2d.sum(0, dtype=torch.promote_types(dy.dtype, torch.float32))
            need_db = False
            dy2d = comm.gather_output_grad(dy2d)
        if ctx.grad_quantizer is None:
            grads = _hp_backward(ctx, dy2d, need_db)
        else:
            need_dw = ctx.needs_input_grad[1] or ctx.fuse_wgrad
            dy_fp8, db = ctx.grad_quantizer.quantize_dbias(dy2d, transpose=need_dw, dbias=need_db)
            grads = linear_backward(ctx, dy_fp8, db)
        if db_rows is not None:
            grads = (grads[0], grads[1], db_rows) + grads[3:]
        return (*grads, None, None)


def _hp_backward(ctx, dy2d: torch.Tensor, need_db: bool) -> tuple:
    """dgrad + wgrad of a high-precision ``_FP8Linear`` node, with the communication of :func:`dgrad_wgrad`."""
    x_saved, weight = ctx.saved_tensors
    comm, fuse = ctx.comm, ctx.fuse_wgrad
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or fuse
    finish = comm.regather_input(x_saved) if need_dw and ctx.regather else None
    dx = work = dw = None
    if need_dx:  # dgrad: dx = dy @ w (a partial sum over the ranks for column parallel)
        dx = dy2d @ weight
        if comm is not None:
            dx, work = comm.start_dgrad_comm(dx)
    if need_dw:  # wgrad: dw = dy.T @ x_total, overlapped with the dgrad communication
        dw = dy2d.t() @ (x_saved if finish is None else finish())
        if fuse:
            accumulate_wgrad(weight, dw.float())
            dw = None
    db = dy2d.sum(0, dtype=torch.promote_types(dy2d.dtype, torch.float32)).to(weight.dtype) if need_db else None
    if work is not None:
        work.wait()
    return (None if dx is None else dx.reshape(ctx.x_shape)), dw, db, None, None, None, None


def linear_backward(ctx, dy_fp8: Float8Tensor, db: Optional[torch.Tensor]) -> tuple:
    """dgrad + wgrad of an FP8 ``_FP8Linear`` node (communication included, :func:`dgrad_wgrad`) given its output
    gradient already in FP8 (``dy_fp8 [M, N]``, after any all-gather) and its bias gradient ``db`` (or None);
    returns the gradients of the node's first seven inputs ``(dx, dw, db, None x 4)``, ``dx`` shaped like ``x``."""
    weight = ctx.saved_tensors[-1]
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.fuse_wgrad
    dx, dw = dgrad_wgrad(dy_fp8, ctx.w_t if need_dx else None, ctx.x_t if need_dw else None, weight,
                         ctx.fuse_wgrad, comm=ctx.comm, x_shard=ctx.x_shard if need_dw else None)
    if not backward_keeps_graph("an FP8 linear"):  # (kept for another backward under retain_graph)
        ctx.x_t = ctx.w_t = ctx.x_shard = None
    if dx is not None:
        dx = dx.reshape(ctx.x_shape)
    if db is not None:
        db = db.to(dy_fp8.dtype)
    return dx, dw, db, None, None, None, None


def dgrad_wgrad(dy_fp8: Float8Tensor, w_t: Optional[tuple], x_t: Optional[tuple], weight: torch.Tensor,
                fuse_wgrad: bool, *, comm: Optional[LinearComm] = None,
                x_shard: Optional[Float8Tensor] = None) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The two backward GEMMs of a linear layer given its FP8 output gradient ``dy_fp8 [M, N]`` (either FP8 tensor
    type: the GEMMs are its methods). Returns ``(dx or None, dw or None)``:

    - dgrad ``dx = dy @ w`` ``[M, K]`` in ``dy_fp8.dtype`` when ``w_t`` (``w_fp8.t_operand()``; per-tensor
      ``(W^T data [K, N], scale_inv)``) is given; its ``comm`` (:meth:`LinearComm.start_dgrad_comm`) is started
      after the GEMM and waited for after wgrad;
    - wgrad ``dw = dy.T @ x`` ``[N, K]`` (tokens zero-padded to 16) when ``x_t`` (``x_fp8.t_operand()``) is given,
      or ``x_shard`` (an FP8 sequence shard ``[M / tp, K]`` whose re-gather is started before the dgrad GEMM): in
      ``weight.dtype``, or with ``fuse_wgrad`` accumulated in fp32 into ``weight.main_grad`` by the GEMM (then None).
    """
    finish = comm.regather_input(x_shard) if x_shard is not None else None
    dx = dw = work = None
    if w_t is not None:
        dx = dy_fp8.dgrad(w_t, dy_fp8.dtype)
        if comm is not None:
            dx, work = comm.start_dgrad_comm(dx)
    if finish is not None:
        x_t = finish().t_operand()
    if x_t is not None:
        if fuse_wgrad:
            dy_fp8.wgrad_into(x_t, main_grad_of(weight))
        else:
            dw = dy_fp8.wgrad(x_t, weight.dtype)
    if work is not None:
        work.wait()
    return dx, dw


def linear_input(x: torch.Tensor, quantizer: Optional[Quantizer], x_fp8: Optional[Float8Tensor],
                 comm: Optional[LinearComm], transpose: bool
                 ) -> tuple[Union[torch.Tensor, Float8Tensor], Optional[Union[torch.Tensor, Float8Tensor]]]:
    """fprop's input of a linear op and what its backward re-gathers: ``(x_total [M, K], x_shard or None)``.

    ``x [*, K]`` is this rank's input; with ``comm.gathers_input`` (column + sequence parallel) it is all-gathered
    by :meth:`LinearComm.gather_input`. ``quantizer`` (the GEMM's input role) casts it, with the transpose for
    wgrad when ``transpose``; None keeps it in high precision. ``x_fp8``: ``x`` already cast (by a norm kernel),
    returned as is.

    Raises:
        ValueError: ``x_fp8`` given together with a ``comm`` that all-gathers the input (cast after the gather), or
            cast without the transposed copy a wgrad needs (``transpose``: a 1 x 128 block-scaled input).
    """
    if comm is not None and comm.gathers_input:
        if x_fp8 is not None:
            raise ValueError("an input already cast to FP8 cannot be all-gathered for sequence parallelism; pass "
                             "the high-precision input (the op casts the shard with the tp-shared scale)")
        return comm.gather_input(x.detach().reshape(-1, x.shape[-1]), quantizer, transpose)
    if x_fp8 is not None:
        if transpose and x_fp8.lacks_transpose:
            raise ValueError("x_fp8 has no transposed copy, which the weight gradient needs while gradients are "
                             "enabled; cast it with transpose=True (norm_cast(..., transpose=True))")
        return x_fp8, None
    if quantizer is None:
        return x.detach().reshape(-1, x.shape[-1]), None
    return quantizer.quantize(x.reshape(-1, x.shape[-1]), transpose=transpose), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           quantizers: Optional[LinearQuantizers] = None, *, comm: Optional[LinearComm] = None,
           w_fp8: Optional[Float8Tensor] = None, x_fp8: Optional[Float8Tensor] = None,
           fuse_wgrad: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` with gradients, in FP8 under ``quantizers``, with ``comm``'s communication.

    Args:
        x: ``[*, K]`` float32/bf16/fp16, this rank's input: ``[s, b, K]``, or ``[s/tp, b, K]`` when ``comm``
            all-gathers it (column + sequence parallel). Output in ``x.dtype``: ``[*, N]`` (``[s, b, N/tp]``
            column parallel; ``[s, b, N]``, or ``[s/tp, b, N]`` with sequence parallelism, row parallel).
        weight: ``[N, K]`` (this rank's shard). bias: ``[N]`` or None (row parallel: added after the reduction).
            FP8: K and N multiples of 16 (of 128 under block scaling, whose operands are bf16 / fp32).
        quantizers: the GEMM's :class:`LinearQuantizers` (``FP8Module.fp8_begin()``), per-tensor or block-scaled
            (module docstring); None: plain matmuls.
        comm: a :class:`~fp8engine.ops.comm.LinearComm`, or None.
        w_fp8: an already cast weight (FP8 weight caching across micro-batches); cast now when None.
        x_fp8: an already cast input (e.g. written by a fused norm kernel); cast now when None.
        fuse_wgrad: accumulate wgrad into ``weight.main_grad`` (fp32); ``weight.grad`` stays None.
    Raises:
        ValueError: as :func:`linear_input`; ``main_grad`` missing or malformed with ``fuse_wgrad`` (backward).
    """
    if quantizers is None:
        x_total, x_shard = linear_input(x, None, None, comm, False)
        return _FP8Linear.apply(x, weight, bias, x_total, None, None, fuse_wgrad, comm, x_shard)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    x_total, x_shard = linear_input(x, quantizers.input, x_fp8, comm, needs_grad)
    if w_fp8 is None:
        w_fp8 = quantizers.weight.quantize(weight, transpose=needs_grad)
    return _FP8Linear.apply(x, weight, bias, x_total, w_fp8, quantizers.grad_output, fuse_wgrad, comm, x_shard)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], quantizers: LinearQuantizers,
               *, w_fp8: Optional[Float8Tensor] = None, fuse_wgrad: bool = False,
               x_fp8: Optional[Float8Tensor] = None, comm: Optional[LinearComm] = None) -> torch.Tensor:
    """FP8 ``x @ weight.T + bias`` with gradients: :func:`linear` with ``quantizers`` (same arguments)."""
    return linear(x, weight, bias, quantizers, comm=comm, w_fp8=w_fp8, x_fp8=x_fp8, fuse_wgrad=fuse_wgrad)


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 recipe: Optional[Float8BlockScaling] = None, *, kernels: Optional[bool] = None) -> torch.Tensor:
    """``y = x @ weight.T + bias`` with all three GEMMs in block-scaled FP8, without a module: :func:`linear` with
    the :class:`~fp8engine.fp8.block_quantizer.BlockQuantizer` objects of ``recipe``.

    fprop ``y = x @ w.T``: x in 1 x 128 tiles along K, w in 128 x 128 blocks; dgrad ``dx = dy @ w``: dy in 1 x 128
    tiles along N, ``w^T`` the same blocks transposed; wgrad ``dw = dy.T @ x``: ``dy^T`` and ``x^T`` re-tiled along
    the tokens. Every scale is computed just in time from its own tile's amax; the bias is added by the fprop GEMM.

    Args:
        x: ``[*, K]`` bf16 / fp32. weight: ``[N, K]`` bf16 / fp32. bias: ``[N]`` or None.
        recipe: a :class:`Float8BlockScaling` (default ``Float8BlockScaling()``: E4M3, power-of-two scales).
        kernels: Triton cast kernels (True), the plain-PyTorch references (False), or
            :func:`~fp8engine.fp8.quantizer.call_kernels`'s choice for ``x`` (None: the kernels on CUDA).
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
    kernels = call_kernels(x) if kernels is None else kernels  # (a functional entry: no module chose it)
    return linear(x, weight, bias, LinearQuantizers(*block_quantizers_for(recipe, 3, kernels)))
