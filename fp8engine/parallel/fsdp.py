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

__all__ = ["shard_model", "is_sharded", "local_tensor"]


def shard_model(model: torch.nn.Module, mesh, layers: Iterable[torch.nn.Module], *,
                param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = torch.float32,
                reshard_after_forward: bool = True, fp8_all_gather: bool = False) -> torch.nn.Module:
    """``fully_shard`` each of ``layers`` (e.g. ``model.layers``) and then ``model`` itself over ``mesh``.

    Args:
        model: the root module (its remaining parameters, e.g. embedding and final norm, form the root's group).
        mesh: a 1-D ``DeviceMesh`` of the data-parallel ranks (``init_parallel(...).mesh["dp"]``).
        layers: the submodules that get their own all-gather / reduce-scatter group, in forward order.
        param_dtype: all-gather and compute dtype of the parameters (None: their own, e.g. fp32).
        reduce_dtype: gradient reduce-scatter dtype (None: ``param_dtype``).
        reshard_after_forward: free each layer's gathered parameters after its forward (re-gathered for the
            backward; ZeRO-3). False keeps them until the backward (ZeRO-2-like: more memory, fewer all-gathers).
        fp8_all_gather: all-gather the FP8 GEMM weights as FP8 bytes
            (:mod:`fp8engine.parallel.fsdp_fp8`; delayed and current scaling), the others in ``param_dtype``.
    Returns:
        ``model`` (``fully_shard`` changes it in place into an ``FSDPModule``).
    Raises:
        ValueError: ``mesh`` is not 1-D; ``model`` has FP8 primary weights (:func:`fp8engine.fp8_model_init`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fp8 = [name for name, p in model.named_parameters() if p.dtype in FP8_DTYPES.values()]
    if fp8:
        # (seen with torch 2.13: fully_shard asserts "FSDP expects uniform original parameter dtype but got
        # {torch.float32, torch.float8_e4m3fn}" at the first all-gather; gloo's all-gather of float8 raises
        # "RuntimeError: Invalid scalar type")
        raise ValueError(f"shard_model: {len(fp8)} parameters are FP8 primary weights (fp8_model_init), e.g. "
                         f"{fp8[0]!r}; FSDP2 cannot shard them (fully_shard wants one dtype for a group's trainable "
                         "parameters, and their gradients are in main_grad, which FSDP does not reduce-scatter). "
                         "Build the model without fp8_model_init and pass fp8_all_gather=True to all-gather FP8 bytes")
    if mesh.ndim != 1:
        raise ValueError(f"shard_model needs a 1-D data-parallel mesh, got {mesh.ndim}-D; pass mesh['dp']")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # fully_shard replaces each parameter by a DTensor parameter: carry over the attributes the layers set on
    # theirs (``sequence_parallel`` marks the replicated ones the tensor-parallel gradient code sums over tp)
    marks = {name: dict(p.__dict__) for name, p in model.named_parameters()}
    if fp8_all_gather:
        from fp8engine.parallel.fsdp_fp8 import enable_fp8_all_gather

        enable_fp8_all_gather(model, mesh.size())
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for name, p in model.named_parameters():
        for key, value in marks.get(name, {}).items():
            if not hasattr(p, key):
                setattr(p, key, value)
    return model


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP-sharded parameter or gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor``; ``t`` itself otherwise."""
    return t.to_local() if is_sharded(t) else t

