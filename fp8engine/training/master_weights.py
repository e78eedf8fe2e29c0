"""``FP8MasterWeights``: any torch optimizer over fp32 master copies of a model's FP8 primary weights
(:func:`fp8engine.fp8_model_init`), the job of TransformerEngine's ``FusedAdam(master_weights=True)`` and of
Megatron's mixed-precision optimizer.

For every FP8 weight ``w`` (``[N, K]`` float8, with its module's ``<name>_scale_inv``):

- the master ``m`` is an fp32 ``[N, K]`` parameter: ``w``'s preserved initial value
  (``fp8_model_init(preserve_high_precision_init_val=True)``; then cleared, as TE's FusedAdam does), else ``w``
  dequantized;
- ``w.main_grad`` (fp32 ``[N, K]``, allocated here) is where the module accumulates ``w``'s gradient; it is ``m.grad``;
- :meth:`FP8MasterWeights.step` steps the inner optimizer on the masters and the other parameters, then writes each
  master back into its FP8 weight with a new current-scaling scale ``fp8_max / max|m|`` (bytes and ``scale_inv``
  in place).

The other parameters (norms, biases, embeddings) are the inner optimizer's as usual. Data parallel: a
:class:`~fp8engine.parallel.data_parallel.GradientAverager` of the replicas averages each ``main_grad`` in place
(an FP8 weight's bucket is fp32 whenever the averager was built) and the ``.grad`` of the others; every replica
then writes the same FP8 bytes. Under FSDP2 the sharded parameter is the master and the FP8 all-gather makes the
bytes (:func:`fp8engine.parallel.fsdp.masters_of_fp8_primary_weights`, which ``shard_model`` applies): this
wrapper is not used there.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from fp8engine.modules.base import FP8Module
from fp8engine.modules.fp8_init import (FP8_PARAM_DTYPES, clear_high_precision_init_val, get_high_precision_init_val,
                                        quantize_weight_)

__all__ = ["FP8MasterWeights"]


class FP8MasterWeights:
    """Optimizer wrapper keeping fp32 masters of ``model``'s FP8 primary weights (module docstring).

    Args:
        model: the module whose parameters are optimized; its FP8 primary weights are found in its
            :class:`~fp8engine.modules.base.FP8Module` submodules.
        optimizer_cls: the inner optimizer's class (default ``torch.optim.AdamW``), built as
            ``optimizer_cls(param_groups, **optimizer_kwargs)`` with each FP8 weight replaced by its master.
        param_groups: torch-style groups over ``model``'s parameters (dicts with ``"params"`` and options); default
            one group of all of them.
    Attributes:
        optimizer: the inner optimizer (give it to LR schedulers).
    Raises:
        ValueError: ``param_groups`` holds an FP8 parameter that is not a primary weight of ``model``'s modules, or
            (``load_state_dict``) a state of other masters.
    """

    def __init__(self, model: nn.Module, optimizer_cls=torch.optim.AdamW,
                 param_groups: Optional[Iterable[dict]] = None, **optimizer_kwargs):
        owners = {id(getattr(m, n)): (m, n) for m in model.modules() if isinstance(m, FP8Module)
                  for n in m.fp8_primary_weights()}
        groups = [{"params": list(model.parameters())}] if param_groups is None else [dict(g) for g in param_groups]
        #: (module, weight name, fp32 master) per FP8 weight, in parameter order
        self._masters: list[tuple[nn.Module, str, nn.Parameter]] = []
        for group in groups:
            group["params"] = [self._master(p, owners) for p in group["params"]]
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)

    def _master(self, param: torch.Tensor, owners: dict) -> torch.Tensor:
        """``param`` itself, or for an FP8 weight its new fp32 master (its ``main_grad`` allocated as its grad)."""
        owner = owners.get(id(param))
        if owner is None:
            if param.dtype in FP8_PARAM_DTYPES:
                raise ValueError(f"an FP8 parameter {tuple(param.shape)} in param_groups is not a primary weight of "
                                 "the model's FP8 modules (built under fp8_model_init); pass the model it belongs to")
            return param
        module, name = owner
        init = get_high_precision_init_val(param)
        if init is None:
            init = param.detach().float() * getattr(module, name + "_scale_inv")
        clear_high_precision_init_val(param)
        master = nn.Parameter(init.to(device=param.device, dtype=torch.float32, copy=True))
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        master.grad = param.main_grad
        self._masters.append((module, name, master))
        return master

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self, closure=None):
        """One inner optimizer step (masters' gradients = the weights' ``main_grad``), then every FP8 weight
        re-quantized from its master (current scaling). Returns the closure's loss, as torch optimizers do."""
        for module, name, master in self._masters:
            master.grad = getattr(module, name).main_grad
        loss = self.optimizer.step(closure)
        for module, name, master in self._masters:
            quantize_weight_(module, name, master)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``; the FP8 weights' ``main_grad`` are zeroed (kept allocated)."""
        self.optimizer.zero_grad(set_to_none)
        for module, name, master in self._masters:
            main_grad = getattr(module, name).main_grad
            main_grad.zero_()
            master.grad = main_grad

    def state_dict(self) -> dict:
        """``{"optimizer": the inner state_dict, "masters": [fp32 master per FP8 weight]}`` (references, as torch
        optimizers' state dicts hold; the FP8 bytes are the model's ``state_dict``)."""
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach() for _, _, m in self._masters]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore masters and inner state exactly (the FP8 weights come with the model's own ``state_dict``)."""
        masters = state_dict["masters"]
        if len(masters) != len(self._masters) or any(t.shape != m.shape for t, (_, _, m) in zip(masters,
                                                                                                self._masters)):
            raise ValueError(f"the state holds {len(masters)} masters of other shapes than this optimizer's "
                             f"{len(self._masters)} FP8 weights; load it into an optimizer of the same model")
        for t, (_, _, m) in zip(masters, self._masters):
            m.copy_(t)
        self.optimizer.load_state_dict(state_dict["optimizer"])
