"""``convert_to_fp8``: swap the ``torch.nn.Linear`` layers (and ``transformers``' ``Conv1D``) of an existing model
for FP8 modules, and report what was converted and what was kept in high precision.

Hugging Face checkpoints: the FP8 scaling buffers (``<layer>.fp8_state.{amax_history,scale,update_step}``) are added
to the model's ``_keys_to_ignore_on_save``, so ``model.save_pretrained(dir)`` writes exactly the keys of the original
model and ``AutoModelForCausalLM.from_pretrained(dir)`` loads it without unexpected keys. The scaling state travels
separately: :func:`fp8engine.modules.fp8_state_io.save_fp8_state` / ``load_fp8_state``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from fp8engine.modules.conv1d import Conv1DLinear
from fp8engine.modules.linear import Linear

__all__ = ["convert_to_fp8", "ConversionReport", "default_module_filter_fn", "OUTPUT_PROJECTION_NAMES"]

#: Last name components of output projections kept in high precision by :func:`default_module_filter_fn`
#: (``transformers``: ``lm_head``; GPT-NeoX: ``embed_out``; Megatron: ``output_layer``).
OUTPUT_PROJECTION_NAMES = ("lm_head", "embed_out", "output_layer")

KEEP_FILTER = "module_filter_fn returned False"
KEEP_OUTPUT = "output projection (LM head)"
KEEP_TIED = "weight tied to an embedding"
KEEP_DIMS = "in/out features not multiples of 16 (FP8 GEMM)"


@dataclass
class ConversionReport:
    """What :func:`convert_to_fp8` did: ``converted`` (fully qualified names, in module order) and ``kept``
    (``(name, reason)`` of the ``nn.Linear``/``Conv1D`` layers left in high precision). ``str(report)`` is a
    table a user can print."""

    converted: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)

    @property
    def kept_names(self) -> list[str]:
        return [name for name, _ in self.kept]

    def __str__(self) -> str:
        lines = [f"convert_to_fp8: {len(self.converted)} layers converted to FP8, {len(self.kept)} kept"]
        lines += [f"  fp8   {name}" for name in self.converted]
        lines += [f"  kept  {name}: {reason}" for name, reason in self.kept]
        return "\n".join(lines)


def default_module_filter_fn(module: nn.Module, fqn: str) -> bool:
    """The default filter: False (keep in high precision) for output projections, i.e. layers whose last name
    component is one of :data:`OUTPUT_PROJECTION_NAMES`; True otherwise. :func:`convert_to_fp8` also keeps, by
    default, any layer whose weight is an embedding's (tied LM heads, whatever their name)."""
    return fqn.rsplit(".", 1)[-1] not in OUTPUT_PROJECTION_NAMES


def _conv1d_type() -> Optional[type]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional
        return None
    return Conv1D


def _dims(sub: nn.Module) -> tuple[int, int]:
    if type(sub) is nn.Linear:
        return sub.in_features, sub.out_features
    return sub.weight.shape[0], sub.weight.shape[1]  # Conv1D: weight [in, out]


def _swap(sub: nn.Module, k: int, n: int) -> nn.Module:
    cls = Linear if type(sub) is nn.Linear else Conv1DLinear
    new = cls(k, n, bias=sub.bias is not None, params_dtype=sub.weight.dtype, device=torch.device("meta"))
    new.weight = sub.weight
    new.bias = sub.bias
    new.fp8_state = new.fp8_state.__class__(new.fp8_state.roles, device=sub.weight.device)
    new.train(sub.training)
    return new


def convert_to_fp8(module: nn.Module, module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None
                   ) -> ConversionReport:
    """Replace (in place) every ``torch.nn.Linear`` in ``module`` by an :class:`fp8engine.Linear`, and every
    ``transformers.pytorch_utils.Conv1D`` (GPT-2; weight ``[in, out]``) by a :class:`Conv1DLinear`, sharing the
    weight and bias parameters (same device, dtype, values, ``requires_grad`` and parameter names).

    Kept in high precision, with the reason in the report: layers ``module_filter_fn`` rejects; by default
    (``module_filter_fn=None``) output projections (:func:`default_module_filter_fn`) and layers whose weight is
    tied to an ``nn.Embedding``'s; always, layers whose in/out features are not multiples of 16 (FP8 GEMMs cannot
    take them).

    Saving: the FP8 buffers of converted layers are listed in ``module._keys_to_ignore_on_save`` (an instance
    attribute, merged with the class's), so a ``transformers`` model's ``save_pretrained`` checkpoint has the
    original keys and loads into a plain model with no unexpected keys; ``load_state_dict``/``state_dict`` of the
    converted model still carry the buffers. To keep the FP8 scaling state with a Hugging Face checkpoint, call
    ``save_fp8_state(model, dir)`` after ``save_pretrained(dir)``, and after ``from_pretrained(dir)`` +
    ``convert_to_fp8`` call ``load_fp8_state(model, dir)`` (:mod:`fp8engine.modules.fp8_state_io`).

    Args:
        module: the model; a bare ``nn.Linear`` cannot be swapped in place (wrap it in a container).
        module_filter_fn: ``fn(layer, fqn) -> bool``; only layers for which it returns True are swapped.
    Returns:
        A :class:`ConversionReport` (printable).
    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (e.g. a state dict, a list of layers, a model class or a
            checkpoint path), or is itself an ``nn.Linear``.
    """
    if not isinstance(module, nn.Module):
        what = (f"the class {module.__name__}" if isinstance(module, type)
                else f"an object of type {type(module).__name__}")
        raise TypeError(f"convert_to_fp8 takes a model (a torch.nn.Module instance, e.g. "
                        f"AutoModelForCausalLM.from_pretrained(...) or nn.Sequential(...)) and swaps its layers in "
                        f"place; got {what}")
    if isinstance(module, nn.Linear):
        raise TypeError("convert_to_fp8 swaps children in place; wrap a bare nn.Linear in a container "
                        "(e.g. nn.Sequential) or build fp8engine.Linear directly")
    conv1d = _conv1d_type()
    default = module_filter_fn is None
    tied = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)} if default else set()
    report = ConversionReport()
    ignore = set(getattr(module, "_keys_to_ignore_on_save", None) or ())
    for fqn, child in list(module.named_modules()):
        for name, sub in list(child.named_children()):
            if not (type(sub) is nn.Linear or (conv1d is not None and type(sub) is conv1d)):
                continue
            sub_fqn = f"{fqn}.{name}" if fqn else name
            if default and id(sub.weight) in tied:
                report.kept.append((sub_fqn, KEEP_TIED))
                continue
            if not (default_module_filter_fn if default else module_filter_fn)(sub, sub_fqn):
                report.kept.append((sub_fqn, KEEP_OUTPUT if default else KEEP_FILTER))
                continue
            k, n = _dims(sub)
            if k % 16 or n % 16:
                report.kept.append((sub_fqn, KEEP_DIMS))
                continue
            new = _swap(sub, k, n)
            setattr(child, name, new)
            report.converted.append(sub_fqn)
            ignore.update(f"{sub_fqn}.fp8_state.{key}" for key in new.fp8_state.state_dict())
    if report.converted:
        module._keys_to_ignore_on_save = ignore
    return report
