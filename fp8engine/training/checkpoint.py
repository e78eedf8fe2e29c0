"""Single-process checkpoints written atomically, and the RNG states a bit-exact resume needs.

A checkpoint is one ``torch.save`` file: the model's ``state_dict`` (parameters and the FP8 scaling buffers:
amax histories, scales, update counters), the optimizer's ``state_dict``, the step, the data position, every RNG
state (torch CPU and CUDA, Python ``random``, NumPy) and the run's settings (to refuse resuming a different run).
It is written to ``<name>.tmp`` and moved over the old one with ``os.replace``, so a crash never leaves a
half-written checkpoint. Multi-rank runs use :mod:`torch.distributed.checkpoint` instead
(:mod:`fp8engine.training.distributed`).
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp8engine.training import UsageError

__all__ = ["CHECKPOINT_NAME", "capture_rng_state", "restore_rng_state", "save_checkpoint", "load_checkpoint",
           "atomic_write"]

CHECKPOINT_NAME = "checkpoint.pt"


def capture_rng_state(rng_tracker=None) -> dict[str, Any]:
    """Every RNG a training step may draw from (dropout uses torch's, and ``rng_tracker``'s named states inside
    tensor-parallel regions; python/numpy for completeness)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if rng_tracker is not None:
        state["tracker"] = rng_tracker.get_states()
    return state


def restore_rng_state(state: dict[str, Any], rng_tracker=None) -> None:
    """Inverse of :func:`capture_rng_state` (CUDA states only when CUDA is available here; the tracker's states
    when both the checkpoint and this run have a tracker)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if rng_tracker is not None and "tracker" in state:
        rng_tracker.set_states(state["tracker"])


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` and then ``os.replace`` the temporary file onto ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_checkpoint(out_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``out_dir/checkpoint.pt`` atomically; returns the path."""
    path = Path(out_dir) / CHECKPOINT_NAME
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    return path


def load_checkpoint(out_dir: Path) -> dict[str, Any]:
    """Load ``out_dir/checkpoint.pt`` onto the CPU.

    Raises:
        UsageError: there is none (the message names the path and how to start a new run).
    """
    path = Path(out_dir) / CHECKPOINT_NAME
    if not path.is_file():
        raise UsageError(f"--resume: no checkpoint at {path}; drop --resume to start a new run, or point --out at "
                         "a directory a previous run wrote")
    # weights_only=False: the checkpoint holds Python RNG state tuples and settings, written by this program.
    return torch.load(path, map_location="cpu", weights_only=False)
