"""FSDP2 all-gathers of FP8 weights: half the bytes of a bf16 all-gather (torchao's
``enable_fsdp_float8_all_gather``, on fp8engine's scaling state).

:func:`enable_fp8_all_gather` wraps the shard of every FP8 GEMM weight in a :class:`FP8AllGatherWeight` before
``fully_shard``. FSDP2 then calls its all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``):

1. pre: this rank casts its shard to the forward FP8 format with the scale *of the whole weight*: delayed
   scaling, the module's ``ScalingState.scale`` row (the same on every rank: the amax histories are MAX-reduced
   over the data-parallel group); current scaling, ``fp8_max / amax`` with the MAX of the shards' amaxes (one
   all-reduce over the FSDP group for all weights per forward, :class:`CurrentScales`). Quantization is
   element-wise, so the gathered bytes equal the cast of the unsharded weight bit for bit. A gather inside the
   backward (a re-gather, a recompute) reuses the forward's scale, so the parameter autograd saved gets back the
   forward's values.
2. the all-gather moves the ``uint8`` bytes and, in the same collective, each shard's amax (4 bytes);
3. post: the unsharded parameter is a :class:`~fp8engine.fp8.gathered_weight.GatheredFP8Weight` of the gathered
   bits, the shard's ``scale_inv`` and the MAX of the shards' amaxes (torchao's ``Float8TrainingTensor``): the
   modules' GEMMs take those bits as they are, and under delayed scaling the weight's amax history records the
   whole weight's amax. A later gather refills the same storage and only swaps ``scale_inv`` and ``amax``.

Gradients are untouched: FSDP2 reduce-scatters them in ``reduce_dtype`` as for any parameter, and the optimizer
updates the high-precision shard in place.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from fp8engine.fp8.autocast import get_fp8_context
from fp8engine.fp8.dtypes import fp8_dtype_of
from fp8engine.fp8.float8_tensor import current_scale, quantize
from fp8engine.fp8.gathered_weight import GatheredFP8Weight
from fp8engine.recipe import CurrentScaling, DelayedScaling

__all__ = ["CurrentScales", "FP8AllGatherWeight", "WeightScale", "enable_fp8_all_gather", "fp8_weight_rows",
           "unwrap_state_dict"]

aten = torch.ops.aten
#: Ops whose outputs stay wrapped (FSDP2's sharding: chunk, pad, copy, view; DTensor's detach): torchao's list.
_KEEP_WRAPPED = {aten.detach.default, aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor,
                 aten.copy_.default, aten.view.default, aten.as_strided.default, aten.split.Tensor,
                 aten._pin_memory.default}
#: FP8Module weight parameter -> its scaling-state row (the rows are ``input, weight, grad_output`` per GEMM).
_WEIGHT_ROW = {"weight": 1, "fc1_weight": 1, "fc2_weight": 4}


class CurrentScales:
    """Current scaling's weight scales for every FP8 all-gather weight of one model, in rounds (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``, done lazily): a round takes ``max |x|`` of every registered shard
    (``torch._foreach_norm`` of order inf), MAX-reduces them over the FSDP group in *one* all-reduce and keeps each
    weight's :func:`~fp8engine.fp8.float8_tensor.current_scale` for its own gather. A kept scale is served once, and
    only inside the FP8 region (``fp8_autocast`` entry) whose first gather started the round (the optimizer steps
    outside it); a shard gathered for the first time registers and starts a round. Every rank gathers the same
    weights in the same order, so the rounds (collectives) match across ranks."""

    def __init__(self):
        self._shards: list = []  # weakrefs to the registered shards, in registration order
        self._kept: dict = {}  # id(shard) -> (weakref, scale [1]) of this round not yet served
        self._region = None  # the FP8 context the round was taken in

    def scale(self, shard: torch.Tensor, group, dtype: torch.dtype) -> torch.Tensor:
        region = get_fp8_context()
        kept = self._kept.pop(id(shard), None) if region is self._region else None
        if kept is not None and kept[0]() is shard:
            return kept[1]
        if not any(ref() is shard for ref in self._shards):
            self._shards.append(weakref.ref(shard))
        self._shards = [ref for ref in self._shards if ref() is not None]
        shards = [ref() for ref in self._shards]
        amax = torch.stack(torch._foreach_norm([t.detach() for t in shards], float("inf"))).float()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scales = current_scale(amax, dtype)
        self._kept = {id(t): (ref, scales[i:i + 1]) for i, (t, ref) in enumerate(zip(shards, self._shards))}
        self._region = region
        return self._kept.pop(id(shard))[1]


class WeightScale:
    """Where a weight's FP8 scale comes from: its module's :class:`~fp8engine.fp8.state.ScalingState` and the
    state's weight row, and the model's :class:`CurrentScales`. ``__call__(shard, group)`` -> ``(scale [1] float32,
    fp8 dtype)`` for the active recipe (DelayedScaling or CurrentScaling; E4M3 unless the format's forward half is
    E5M2); outside an FP8 region the delayed-scaling scale of the state, in E4M3."""

    def __init__(self, state: nn.Module, row: int, current: CurrentScales):
        self.state, self.row, self.current = state, row, current

    def __call__(self, shard: torch.Tensor, group) -> tuple[torch.Tensor, torch.dtype]:
        ctx = get_fp8_context()
        recipe = ctx.recipe if ctx is not None else DelayedScaling()
        dtype = fp8_dtype_of(recipe.fp8_format.fwd)
        if isinstance(recipe, CurrentScaling):
            return self.current.scale(shard, group, dtype), dtype
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"the FP8 all-gather supports DelayedScaling and CurrentScaling; got "
                            f"{type(recipe).__name__} (shard_model(..., fp8_all_gather=False) for it)")
        return self.state.scale[self.row:self.row + 1], dtype


class FP8AllGatherWeight(torch.Tensor):
    """A weight shard (high precision) that FSDP2 all-gathers in FP8 (module docstring). Every other op sees the
    plain shard: ``__torch_dispatch__`` unwraps it (keeping the wrapper on the sharding ops FSDP2 applies)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_source: WeightScale):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   layout=data.layout, device=data.device,
                                                   requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, scale_source: WeightScale):
        self._data, self._scale_source = data, scale_source
        self._forward_scale = None  # (scale, dtype) of the latest gather outside the backward

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"FP8AllGatherWeight({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        source = None

        def unwrap(t):
            nonlocal source
            source = t._scale_source
            return t._data

        out = func(*pytree.tree_map_only(cls, unwrap, args), **pytree.tree_map_only(cls, unwrap, kwargs or {}))
        if func not in _KEEP_WRAPPED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, source), out)

    def __tensor_flatten__(self):
        return ["_data"], self._scale_source

    @staticmethod
    def __tensor_unflatten__(inner, scale_source, outer_size, outer_stride):
        return FP8AllGatherWeight(inner["_data"], scale_source)

    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None):
        if torch._C._current_graph_task_id() != -1 and self._forward_scale is not None:
            # a gather inside the backward (``reshard_after_forward``'s re-gather, a recompute): the forward's scale.
            # The state's has moved on since (the update at the autocast exit), and reading it here, on FSDP2's
            # copy-in stream, would race with that update on the default stream.
            scale, dtype = self._forward_scale
        else:
            scale, dtype = self._scale_source(self._data, mesh.get_group())
            scale = scale.clone()  # this gather's own copy (the state's buffer is updated in place)
            self._forward_scale = (scale, dtype)
        amax = torch.zeros(1, dtype=torch.float32, device=self._data.device)  # this shard's max |w|
        q = quantize(self._data.detach(), dtype, scale, amax_out=amax)  # one cast kernel on CUDA (the reference's bits)
        # the bytes and the shard's amax (4 bytes) travel in the same all-gather; post takes the MAX of the amaxes
        return (q.data.view(torch.uint8), amax.view(torch.uint8)), (q.scale_inv, dtype, q.kernels)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: Optional[torch.Tensor] = None):
        (data, amaxes), (scale_inv, dtype, kernels) = all_gather_outputs, metadata
        amax = amaxes.view(torch.float32).amax(0, keepdim=True)  # the whole weight's max |w|: MAX over shards
        if out is not None:  # a later gather: FSDP2 wrote the bits into the same storage; new scale_inv and amax
            out.refill(scale_inv, amax)
            return None
        return GatheredFP8Weight(data.view(dtype), scale_inv, amax, param_dtype, kernels), (data,)


def fp8_weight_rows(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, int]]:
    """``(module, parameter name, scaling state, weight row)`` of every FP8 GEMM weight parameter in ``model``
    (modules with an ``fp8_state`` and a parameter named ``weight``, ``fc1_weight`` or ``fc2_weight``)."""
    rows = []
    for module in model.modules():
        state = getattr(module, "fp8_state", None)
        if state is None:
            continue
        for name, row in _WEIGHT_ROW.items():
            param = module._parameters.get(name)
            if param is not None and row < len(state.roles) and state.roles[row].endswith("weight"):
                rows.append((module, name, state, row))
    return rows


def enable_fp8_all_gather(model: nn.Module, world_size: int) -> int:
    """Wrap every FP8 GEMM weight of ``model`` (:func:`fp8_weight_rows`) whose dim 0 divides by ``world_size``
    (the FSDP group's size: evenly sharded, no padding) so that a later ``fully_shard`` all-gathers it in FP8;
    returns how many were wrapped. Call before ``fully_shard`` (what :func:`fp8engine.parallel.fsdp.shard_model`
    does with ``fp8_all_gather=True``)."""
    rows = [r for r in fp8_weight_rows(model) if r[0]._parameters[r[1]].shape[0] % world_size == 0]
    current = CurrentScales()
    for module, name, state, row in rows:
        param = module._parameters[name]
        wrapped = nn.Parameter(FP8AllGatherWeight(param.data, WeightScale(state, row, current)),
                               requires_grad=param.requires_grad)
        wrapped.__dict__.update({k: v for k, v in param.__dict__.items() if not k.startswith("_")})
        module._parameters[name] = wrapped
    return len(rows)


def unwrap_state_dict(state: dict) -> dict:
    """``state`` (a model state dict of DTensors) with each :class:`FP8AllGatherWeight` shard replaced by the plain
    tensor it wraps (same storage): checkpoints hold plain tensors, and a load into the returned dict writes the
    parameters themselves."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, t in state.items():
        if isinstance(t, DTensor) and isinstance(t._local_tensor, FP8AllGatherWeight):
            t = DTensor.from_local(t._local_tensor._data, t.device_mesh, t.placements, run_check=False,
                                   shape=t.shape, stride=t.stride())
        out[key] = t
    return out
