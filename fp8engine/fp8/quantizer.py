"""``Quantizer``: how one FP8 tensor role of a module (a GEMM's input, weight or output gradient) is cast.

A module's :class:`~fp8engine.fp8.state.ScalingState` holds one row per role. :func:`get_quantizers` turns it into
one :class:`LinearQuantizers` ``(input, weight, grad_output)`` per GEMM, cached on the state per recipe and
``record_amax`` flag, so the per-call FP8 set-up is a dict look-up.

Recipes (``kind``):
- ``"delayed"`` (:class:`~fp8engine.recipe.DelayedScaling`): ``scale`` is the ``[1]`` view ``state.scale[row:row+1]``;
  ``amax`` the ``[1]`` view ``state.amax_history[row, 0:1]`` that each cast max-accumulates ``max |x|`` into (None
  for forward roles while activation checkpointing recomputes: the amax was counted in the first forward).
- ``"current"`` (:class:`~fp8engine.recipe.CurrentScaling`): ``scale = fp8_max / max |x|`` of the tensor being cast
  (1.0 where that amax is 0 or not finite); nothing recorded, ``scale`` and ``amax`` are None.
- ``"block"`` (:class:`~fp8engine.recipe.Float8BlockScaling`): :class:`~fp8engine.fp8.block_quantizer.BlockQuantizer`
  objects instead (1 x 128 / 128 x 128 block scales, just in time; nothing recorded), built and cached the same way.

Backend: :func:`get_quantizers` asks :func:`fp8engine.fp8.float8_tensor.use_kernels` once; the quantizers, the FP8
tensors they write and the state's scale update keep that answer (``kernels``). A call without quantizers asks once
where it enters (:func:`call_kernels`). Both backends give the same FP8 bits for the same scale.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

import fp8engine.fp8.cast_ops as _cast_ops
from fp8engine.fp8.dtypes import fp8_dtype_of
from fp8engine.fp8.float8_tensor import Float8Tensor, current_scale, quantize_torch, use_kernels
from fp8engine.recipe import CurrentScaling, DelayedScaling, Float8BlockScaling

__all__ = ["Quantizer", "LinearQuantizers", "get_quantizers", "call_kernels", "recipe_kind"]

#: Quantizer sets kept per state (one per recipe x record flag); more than this and the cache starts over.
_CACHE_SIZE = 8


def recipe_kind(recipe) -> str:
    """``"delayed"``, ``"current"`` or ``"block"`` for a recipe object; ``TypeError`` for any other."""
    if isinstance(recipe, DelayedScaling):
        return "delayed"
    if isinstance(recipe, CurrentScaling):
        return "current"
    if isinstance(recipe, Float8BlockScaling):
        return "block"
    raise TypeError(f"no FP8 quantizer for recipe {type(recipe).__name__}; use DelayedScaling, CurrentScaling or "
                    "Float8BlockScaling")


class Quantizer:
    """Casts tensors of one FP8 role to :class:`Float8Tensor` (``data = saturate(x * scale)``, round to nearest
    even; ``scale_inv = 1 / scale`` written with the bits).

    Attributes:
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (the recipe format's forward or backward half).
        kind: ``"delayed"`` or ``"current"`` (module docstring).
        scale: delayed: ``[1]`` float32 view of the state's ``scale`` row (multiply by it to enter the FP8 range);
            current: None.
        amax: delayed: ``[1]`` float32 view of the state's ``amax_history[row, 0]``, or None when the amax is not
            recorded; current: None.
        role: the role name (for messages).
        state, row: delayed: the ScalingState and row the views come from (a ``torch.compile`` trace re-slices them).
        stats: a :class:`~fp8engine.fp8.stats.RoleStats` every cast counts underflow / saturation into (while the
            state records, :func:`~fp8engine.fp8.stats.fp8_stats_recording`), or None. Fused callers that write
            FP8 without :meth:`quantize` take their unfused path while it is set.
        kernels: the backend of this quantizer's casts and of the ops it is handed: True the Triton kernels (and
            cuBLASLt GEMMs for the FP8 tensors it writes), False the plain-PyTorch references.
        replay_key: what a replay key holds of ``scale`` and ``amax``, computed once by :mod:`fp8engine.ops.layer`.
    """

    __slots__ = ("fp8_dtype", "kind", "scale", "amax", "role", "delayed", "state", "row", "stats", "replay_key",
                 "kernels")

    def __init__(self, fp8_dtype: torch.dtype, kind: str, scale: Optional[torch.Tensor] = None,
                 amax: Optional[torch.Tensor] = None, role: str = "", state=None, row: int = -1, stats=None,
                 kernels: bool = False):
        if kind not in ("delayed", "current"):
            raise ValueError(f"Quantizer kind must be 'delayed' or 'current', got {kind!r}")
        if kind == "delayed" and scale is None:
            raise ValueError("a delayed-scaling Quantizer needs its scale (a [1] float32 tensor)")
        self.fp8_dtype, self.kind, self.scale, self.amax, self.role = fp8_dtype, kind, scale, amax, role
        self.delayed = kind == "delayed"
        self.state, self.row, self.stats, self.kernels = state, row, stats, kernels
        self.replay_key = None

    @property
    def record_amax(self) -> bool:
        return self.amax is not None

    def _kernel_args(self, x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple:
        """``(scale, amax_out, scale_from_amax)`` for a cast kernel writing ``x``: delayed scaling passes its views;
        current scaling passes ``max |x|`` (unless given) as the scale operand and the kernel derives the scale from
        it on the device (no host synchronisation). The amax is torch's inf-norm (one dispatched op, less host time
        than a zeroed buffer plus a Triton amax launch: ``python tools/layer_host_time.py --profile current``), kept
        in x's dtype (exact; NaN stays NaN, which the kernel turns into scale 1.0 like an inf amax)."""
        if self.delayed:
            return self.scale, self.amax, False
        if amax is None:
            # (detached only where grad mode would record the reduction: inside a fused op it is off)
            x_ = x.detach() if x.requires_grad and torch.is_grad_enabled() else x
            amax = torch.linalg.vector_norm(x_, float("inf"))  # in x's dtype: the kernel reads it as fp32
        elif amax.dtype not in (torch.float32, x.dtype) or amax.numel() != 1:
            amax = amax.float().reshape(1)
        return amax, None, True

    def quantize(self, x: torch.Tensor, *, transpose: bool = False,
                 amax: Optional[torch.Tensor] = None) -> Float8Tensor:
        """Cast ``x [*, N]`` (float32/bf16/fp16); with ``transpose`` also the 2-D transposed copy ``[N, M]``.

        ``amax`` (current scaling only): ``max |x|`` computed already (e.g. MAX-reduced across ranks), as a
        1-element tensor, float32 or x's dtype. Kernels: one cast(-transpose) pass (current scaling: an amax pass
        first)."""
        if self.kernels:
            from fp8engine.kernels.cast import cast_to_fp8

            x = x.contiguous()
            scale, amax_out, from_amax = self._kernel_args(x, amax)
            data, data_t, scale_inv = cast_to_fp8(x, scale, self.fp8_dtype, amax_out, transpose=transpose,
                                                  scale_from_amax=from_amax)
            if self.stats is not None:  # (from_amax: the kernel derived current_scale(amax) on the device)
                self.stats.record(x, data, current_scale(scale, self.fp8_dtype) if from_amax else scale)
            return Float8Tensor(data, scale_inv, x.dtype, data_t, kernels=True)
        if not self.delayed:
            if _cast_ops.compiled_kernel_ops(x) and self.stats is None:
                return self._quantize_op(x, transpose, amax)
            if amax is None:
                amax = x.detach().abs().amax()
            scale, amax_out = current_scale(amax, self.fp8_dtype), None
        elif self.state is not None and torch.compiler.is_compiling():
            if _cast_ops.compiled_kernel_ops(x):
                return self._quantize_op(x, transpose, amax)
            return quantize_torch(x, self.fp8_dtype, *self.compiled_views(), transpose)
        else:
            scale, amax_out = self.scale, self.amax
        out = quantize_torch(x, self.fp8_dtype, scale, amax_out, transpose)
        if self.stats is not None:
            self.stats.record(x, out.data, scale)
        return out

    def _op_args(self, x: torch.Tensor, amax: Optional[torch.Tensor]) -> tuple:
        """``(scale, amax_out, scale_from_amax)`` for the cast custom ops in a ``torch.compile`` trace: delayed
        scaling's views of the live state (:meth:`compiled_views`), or current scaling's amax (computed in the
        graph unless given), as :meth:`_kernel_args` gives them to the launchers in eager mode."""
        if self.delayed:
            return (*self.compiled_views(), False)
        return self._kernel_args(x, amax)

    def _quantize_op(self, x: torch.Tensor, transpose: bool, amax: Optional[torch.Tensor]) -> Float8Tensor:
        """:meth:`quantize` traced by ``torch.compile`` on CUDA: our cast kernel as an opaque custom op
        (:func:`fp8engine.ops.kernel_ops.cast_fp8`) where Inductor would generate amax, scale and cast passes."""
        x = x.detach().contiguous()
        scale, amax_out, from_amax = self._op_args(x, amax)
        data, data_t, scale_inv = _cast_ops.cast_fp8(x, scale, self.fp8_dtype, amax_out, transpose, from_amax)
        return Float8Tensor(data, scale_inv, x.dtype, data_t if transpose else None)

    def compiled_views(self) -> tuple:
        """``(scale, amax)`` inside a ``torch.compile`` trace, amax sliced from the live state buffers (AOTAutograd
        sees the buffer mutations it must replay). A forward role's scale is the forward's frozen copy of the scales
        (``self.scale``, see :func:`get_quantizers`); a gradient role reads the live ``state.scale`` (updated since
        the forward, as in eager mode) and records into ``state.grad_amax`` instead of the history (why, for both:
        :mod:`fp8engine.fp8.library`)."""
        st, row = self.state, self.row
        if not _is_grad(self.role):
            return self.scale, (None if self.amax is None else st.amax_history[row, 0:1])
        # get_quantizers flagged the state for the fold (outside the autograd.Function)
        return st.scale[row:row + 1], st.grad_amax[row:row + 1]

    def quantize_dbias(self, dy: torch.Tensor, *, transpose: bool,
                       dbias: bool) -> tuple[Float8Tensor, Optional[torch.Tensor]]:
        """Cast a gradient ``dy [M, N]`` and, with ``dbias``, return its column sums too:
        ``(dy_fp8, dbias [N] in dy.dtype or None)``.

        Kernels: ``cast_transpose_dbias`` (one pass writing both layouts and the fp32-accumulated column sums)
        when ``dbias``, else ``cast_to_fp8``. Torch: :meth:`quantize` then ``dy.sum(0, dtype=float32)``; the two
        bias gradients differ only in summation order."""
        if dbias and self.kernels:
            from fp8engine.kernels.cast import cast_transpose_dbias

            dy = dy.contiguous()
            scale, amax_out, from_amax = self._kernel_args(dy)
            data, data_t, scale_inv, db = cast_transpose_dbias(dy, scale, self.fp8_dtype, amax_out,
                                                               scale_from_amax=from_amax)
            if self.stats is not None:
                self.stats.record(dy, data, current_scale(scale, self.fp8_dtype) if from_amax else scale)
            return Float8Tensor(data, scale_inv, dy.dtype, data_t, kernels=True), db
        if (dbias and _cast_ops.compiled_kernel_ops(dy) and self.stats is None
                and (not self.delayed or self.state is not None)):
            dy = dy.contiguous()  # traced by torch.compile on CUDA: the kernel as a custom op
            scale, amax_out, from_amax = self._op_args(dy, None)
            data, data_t, scale_inv, db = _cast_ops.cast_transpose_dbias_fp8(dy, scale, self.fp8_dtype, amax_out,
                                                                             from_amax)
            return Float8Tensor(data, scale_inv, dy.dtype, data_t), db
        dy_fp8 = self.quantize(dy, transpose=transpose)
        return dy_fp8, (dy.sum(0, dtype=torch.float32).to(dy.dtype) if dbias else None)

    #: per-tensor scaling (the block-scaled counterpart, ``BlockQuantizer``, has True)
    is_block = False
    #: the fused casts a quantizer may bring (``BlockQuantizer``'s block kernels); None: the ops' own fused kernels
    #: cast with this quantizer's scale
    cast_norm = cast_act = cast_act_grad = cast_qkv_grad = None

    def __repr__(self) -> str:
        return (f"Quantizer(role={self.role!r}, kind={self.kind!r}, fp8_dtype={self.fp8_dtype}, "
                f"record_amax={self.record_amax})")


class LinearQuantizers(NamedTuple):
    """The three quantizers of one GEMM: fprop ``y = x @ w.T`` casts ``input`` and ``weight``; backward casts
    ``grad_output`` (dgrad ``dx = dy @ w``, wgrad ``dw = dy.T @ x``)."""

    input: Quantizer
    weight: Quantizer
    grad_output: Quantizer


def _is_grad(role: str) -> bool:
    return role.endswith("grad") or role.endswith("grad_output")


def _build(state, recipe, record_amax: bool, kernels: bool, counters=None,
           fwd_scale: Optional[torch.Tensor] = None) -> tuple:
    """Quantizers of every GEMM of ``state``, running the backend ``kernels``; with ``counters`` (the state's
    :class:`~fp8engine.fp8.stats.StatsCounters` while it records) each role counts its casts, except forward roles
    of a recompute (``record_amax`` False: counted in the first forward). ``fwd_scale``: where the forward roles'
    scale views come from (default ``state.scale``; a compiled forward passes
    :func:`fp8engine.fp8.library.frozen_scale` of it)."""
    kind = recipe_kind(recipe)
    if kind == "block":
        from fp8engine.fp8.block_quantizer import block_quantizers_for

        qs = block_quantizers_for(recipe, len(state.roles), kernels)
    else:
        fwd, bwd = fp8_dtype_of(recipe.fp8_format.fwd), fp8_dtype_of(recipe.fp8_format.bwd)
        qs = []
        for i, role in enumerate(state.roles):
            grad = _is_grad(role)
            dtype = bwd if grad else fwd
            stats = counters.role(i, dtype) if counters is not None and (grad or record_amax) else None
            if kind == "delayed":
                amax = state.amax_history[i, 0:1] if (grad or record_amax) else None
                scale = state.scale if grad or fwd_scale is None else fwd_scale
                qs.append(Quantizer(dtype, kind, scale[i:i + 1], amax, role, state, i, stats, kernels))
            else:
                qs.append(Quantizer(dtype, kind, role=role, stats=stats, kernels=kernels))
    return tuple(LinearQuantizers(*qs[i:i + 3]) for i in range(0, len(qs) - len(qs) % 3, 3))


def get_quantizers(state, ctx) -> tuple[LinearQuantizers, ...]:
    """The :class:`LinearQuantizers` of ``state`` under the FP8 region ``ctx`` (an
    :class:`~fp8engine.fp8.autocast.FP8Context`): one per GEMM, GEMM ``g`` using the state's rows ``3g .. 3g+2``
    (``input, weight, grad_output``). Delayed scaling also sizes the amax history to the recipe's length and
    registers ``state`` with ``ctx`` for the update at the region's exit.

    Cached on ``state`` per (recipe, ``ctx.record_amax``, backend) and rebuilt when its buffers were replaced
    (``.to()``, a history resize), so the views always point at the live buffers; traced (``torch.compile``)
    quantizers are built anew and never count FP8 stats. The backend is
    :func:`~fp8engine.fp8.float8_tensor.use_kernels` of the state's buffers, kept as ``state.kernels`` for its
    update. Raises TypeError for a recipe without quantizers (:func:`recipe_kind`)."""
    recipe = ctx.recipe
    delayed = isinstance(recipe, DelayedScaling)
    if torch.compiler.is_compiling():
        # traced: built in the graph's Python (no cache look-ups for Dynamo to guard on); the flag is written, not
        # read (no guard): this state's compiled backward records into grad_amax, folded before each update
        fwd_scale = None
        if delayed:
            from fp8engine.fp8.library import frozen_scale

            state.compiled_backward = True
            # its (eager) update after the compiled forward: the fused kernel for a CUDA state, as casts trace as ops
            state.kernels = state.scale.is_cuda and _cast_ops.compiled_kernel_ops(state.scale)
            if state.amax_history.shape[1] != recipe.amax_history_len:
                state.resize_history(recipe.amax_history_len)
                state.history_from_graph = True
            if not state.registered_outside_graph:
                ctx.register(state)
            fwd_scale = frozen_scale(state.scale)
        return _build(state, recipe, ctx.record_amax, False, fwd_scale=fwd_scale)
    cache, record, kernels = state._quantizers, ctx.record_amax, use_kernels(state.scale)
    if delayed:
        if state.amax_history.shape[1] != recipe.amax_history_len:
            state.resize_history(recipe.amax_history_len)
        if state.kernels != kernels:  # its update's backend (written on a change only: nn.Module.__setattr__)
            state.kernels = kernels
        ctx.register(state)
    # fast path, the steady state of training: the same recipe object as the last call (identity checks only;
    # hashing the recipe dataclass hashes all its fields)
    last = cache.get(None)
    if (last is not None and last[0] is recipe and last[1] is record and last[2] is state.scale
            and last[3] is state.amax_history and last[5] is kernels):
        return last[4]
    key = (recipe, record, kernels)
    hit = cache.get(key)
    if hit is None or hit[0] is not state.scale or hit[1] is not state.amax_history:
        if len(cache) >= _CACHE_SIZE:
            cache.clear()
        counters = state.stats_counters if state.stats_recording else None
        hit = (state.scale, state.amax_history, _build(state, recipe, record, kernels, counters))
        cache[key] = hit
    cache[None] = (recipe, record, hit[0], hit[1], hit[2], kernels)
    return hit[2]


def call_kernels(x: torch.Tensor, quantizers: Optional[tuple[LinearQuantizers, ...]] = None) -> bool:
    """The backend (``kernels``) of a module or functional-op call, chosen where it enters and passed to its ops: its
    ``quantizers``' under FP8 (:func:`get_quantizers` chose it), else :func:`use_kernels` on its input ``x``."""
    return quantizers[0].input.kernels if quantizers else use_kernels(x)
