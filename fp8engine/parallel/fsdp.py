"""Sharded data parallelism with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``), as torchtitan applies it.

:func:`shard_model` calls ``fully_shard`` on every transformer layer and then on the root module over a 1-D
``DeviceMesh`` of the data-parallel ranks: each rank keeps ``1/dp`` of every parameter (a ``DTensor`` sharded on
dim 0) and of its AdamW state; a layer's parameters are all-gathered just before its forward (and again before
its backward: ``reshard_after_forward``) and its gradients reduce-scattered (averaged) right after its backward.
Composes with our tensor parallelism (a 2-D layout, FSDP across the ``dp`` mesh dimension, TP within): the
tensor-parallel shards are plain tensors, which FSDP shards further over ``dp``.

The FP8 scaling state (amax histories, scales) is held in module *buffers*, which ``fully_shard`` leaves whole on
every rank: they stay replicated and are MAX-reduced over the FP8 group (``fp8_autocast(fp8_group=...)``, the
data-parallel group) at each autocast exit, as under DDP.

Mixed precision: ``param_dtype`` is the dtype the parameters are all-gathered in and computed with (bf16 halves
the all-gather bytes of fp32 master weights; the FP8 casts then start from the bf16 weights, torchtitan's and
torchao's FSDP2 setting), ``reduce_dtype`` the gradients' reduce-scatter dtype (fp32: the average of the
replicas' gradients is rounded once, as DDP's fp32 all-reduce does).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from fp8engine.fp8.dtypes import FP8_DTYPES

__all__ = ["shard_model", "masters_of_fp8_primary_weights", "is_sharded", "local_tensor"]


def shard_model(model: torch.nn.Module, mesh, layers: Iterable[torch.nn.Module], *,
                param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = torch.float32,
                reshard_after_forward: bool = True, fp8_all_gather: bool = False,
                layers_per_group: int = 1) -> torch.nn.Module:
    """``fully_shard`` ``layers`` (e.g. ``model.layers``) in groups of ``layers_per_group`` and then ``model``
    itself over ``mesh``.

    Args:
        model: the root module (its remaining parameters, e.g. embedding and final norm, form the root's group).
        mesh: a 1-D ``DeviceMesh`` of the data-parallel ranks (``init_parallel(...).mesh["dp"]``).
        layers: the submodules to shard, in forward order.
        layers_per_group: consecutive ``layers`` that form one FSDP2 group, all-gathered and reduce-scattered
            together. 1 is torchtitan's one group per transformer layer; more issue fewer, larger collectives and
            run FSDP2's per-group host code fewer times, for the memory of that many gathered layers.
        param_dtype: all-gather and compute dtype of the parameters (None: their own, e.g. fp32).
        reduce_dtype: gradient reduce-scatter dtype (None: ``param_dtype``).
        reshard_after_forward: free each layer's gathered parameters after its forward (re-gathered for the
            backward; ZeRO-3). False keeps them until the backward (ZeRO-2-like: more memory, fewer all-gathers).
        fp8_all_gather: all-gather the FP8 GEMM weights as FP8 bytes
            (:mod:`fp8engine.parallel.fsdp_fp8`; delayed and current scaling), the others in ``param_dtype``.
            Always on for a model with FP8 primary weights (:func:`masters_of_fp8_primary_weights`).
    Returns:
        ``model`` (``fully_shard`` changes it in place into an ``FSDPModule``).
    Raises:
        ValueError: ``mesh`` is not 1-D; ``layers_per_group`` is not a positive integer.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh.ndim != 1:
        raise ValueError(f"shard_model needs a 1-D data-parallel mesh, got {mesh.ndim}-D; pass mesh['dp']")
    if isinstance(layers_per_group, bool) or not isinstance(layers_per_group, int) or layers_per_group < 1:
        raise ValueError(f"layers_per_group must be a positive integer; got {layers_per_group!r}")
    if masters_of_fp8_primary_weights(model):
        fp8_all_gather = True  # the FP8 bytes on the wire are what the FP8 primary weights were for
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # fully_shard replaces each parameter by a DTensor parameter: carry over the attributes the layers set on
    # theirs (``sequence_parallel`` marks the replicated ones the tensor-parallel gradient code sums over tp)
    marks = {name: dict(p.__dict__) for name, p in model.named_parameters()}
    if fp8_all_gather:
        from fp8engine.parallel.fsdp_fp8 import enable_fp8_all_gather

        enable_fp8_all_gather(model, mesh.size())
    layers = list(layers)
    for start in range(0, len(layers), layers_per_group):
        group = layers[start:start + layers_per_group]
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for name, p in model.named_parameters():
        for key, value in marks.get(name, {}).items():
            if not hasattr(p, key):
                setattr(p, key, value)
    return model


@torch.no_grad()
def masters_of_fp8_primary_weights(model: torch.nn.Module) -> int:
    """Turn every FP8 primary weight of ``model`` (built under :func:`fp8engine.fp8_model_init`) back into a
    high-precision parameter holding its master value, ready for ``fully_shard``; returns how many.

    Under FSDP2 the sharded parameter *is* the optimizer's master copy, and the FP8 bytes are made by the FP8
    all-gather (:mod:`fp8engine.parallel.fsdp_fp8`, which :func:`shard_model` then switches on): TransformerEngine's
    FSDP2 use of ``fp8_model_init`` with one copy fewer (the shard holds the master, 4 bytes per element, instead of
    FP8 bytes plus a separate fp32 master, 5), so such a model shards unchanged.

    Each weight's master is its kept initial value (``fp8_model_init(preserve_high_precision_init_val=True)``,
    then cleared), else its FP8 bytes dequantized (``weight.float() * scale_inv``), in the dtype of the model's
    other parameters (``fully_shard`` wants one dtype per group; float32 when there are none). Its
    ``<name>_scale_inv`` buffer is dropped (a checkpoint of the unsharded FP8 model still loads), and
    ``fuse_wgrad_accumulation`` is switched off on its module: FSDP2 reduce-scatters ``.grad``, not ``main_grad``.
    Delayed and current scaling."""
    from fp8engine.modules.base import FP8Module
    from fp8engine.modules.fp8_init import clear_high_precision_init_val, get_high_precision_init_val

    fp8 = tuple(FP8_DTYPES.values())
    others = [p.dtype for p in model.parameters() if p.dtype not in fp8]
    dtype = others[0] if others else torch.float32
    count = 0
    for module in model.modules():
        names = module.fp8_primary_weights() if isinstance(module, FP8Module) else ()
        for name in names:
            param, scale_inv = getattr(module, name), module._buffers.pop(name + "_scale_inv")
            value = get_high_precision_init_val(param)
            value = param.float() * scale_inv if value is None else value
            clear_high_precision_init_val(param)
            master = torch.nn.Parameter(value.to(device=param.device, dtype=dtype, copy=True),
                                        requires_grad=param.requires_grad)
            drop = ("main_grad", "get_high_precision_init_val", "clear_high_precision_init_val")
            vars(master).update({k: v for k, v in vars(param).items() if k not in drop})  # the layers' marks
            setattr(module, name, master)
            count += 1
        if names:
            module.fuse_wgrad_accumulation = False
            module._weight_cache.clear()
            module._stored_fp8.clear()
    return count


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP-sharded parameter or gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor``; ``t`` itself otherwise."""
    return t.to_local() if is_sharded(t) else t

