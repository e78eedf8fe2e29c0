"""The FP8 scaling state of a converted model, saved beside a Hugging Face checkpoint.

``save_pretrained`` of a model converted by :func:`fp8engine.convert_to_fp8` leaves the FP8 buffers out (they
are in ``_keys_to_ignore_on_save``), so the checkpoint loads into a plain ``transformers`` model. To resume FP8
training with the same amax histories and scales::

    model.save_pretrained(d)
    save_fp8_state(model, d)                 # writes d/fp8_state.pt
    ...
    model = AutoModelForCausalLM.from_pretrained(d)
    convert_to_fp8(model)                    # same filter as before
    load_fp8_state(model, d)
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
from torch import nn

from fp8engine.fp8.state import ScalingState

__all__ = ["save_fp8_state", "load_fp8_state", "fp8_state_dict", "FP8_STATE_NAME"]

FP8_STATE_NAME = "fp8_state.pt"


def fp8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{"<module>.fp8_state.<buffer>": tensor}`` for every :class:`ScalingState` in ``model`` (detached CPU
    copies: ``amax_history [roles, history] fp32``, ``scale [roles] fp32``, ``update_step [] int64``)."""
    out = {}
    for name, sub in model.named_modules():
        if isinstance(sub, ScalingState):
            for key, value in sub.state_dict().items():
                out[f"{name}.{key}"] = value.detach().cpu().clone()
    return out


def save_fp8_state(model: nn.Module, directory: Union[str, Path]) -> Path:
    """Write ``model``'s FP8 scaling state to ``directory/fp8_state.pt`` (``torch.save`` of
    :func:`fp8_state_dict`); returns the path.

    Raises:
        ValueError: ``model`` has no FP8 modules (nothing to save).
    """
    state = fp8_state_dict(model)
    if not state:
        raise ValueError("save_fp8_state: the model has no FP8 modules; call fp8engine.convert_to_fp8 first")
    path = Path(directory) / FP8_STATE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def load_fp8_state(model: nn.Module, directory: Union[str, Path]) -> None:
    """Copy ``directory/fp8_state.pt`` into ``model``'s FP8 scaling state (onto each state's device).

    Raises:
        FileNotFoundError: no ``fp8_state.pt`` in ``directory``.
        ValueError: the saved keys differ from the model's (it was converted with another filter, or is another
            model); the message names the first few differences.
    """
    path = Path(directory) / FP8_STATE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"load_fp8_state: no {FP8_STATE_NAME} in {directory} (write it with save_fp8_state)")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    mine = fp8_state_dict(model)
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or unexpected:
        raise ValueError(f"load_fp8_state: {path} does not match the model's FP8 layers (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}); convert the model with the filter used when saving")
    for name, sub in model.named_modules():
        if isinstance(sub, ScalingState):
            sub.load_state_dict({key: saved[f"{name}.{key}"] for key in sub.state_dict()})
