"""Single-process checkpoints written atomically, and the RNG states a bit-exact resume needs.

A checkpoint is one ``torch.save`` file: the model's ``state_dict`` (parameters and the FP8 scaling buffers:
amax histories, scales, update counters), the optimizer's ``state_dict``, the step, the data position, every RNG
state (torch CPU and CUDA, Python ``random``, NumPy) and the run's settings (to refuse resuming a different run).
It is written to ``<name>.tmp`` and moved into place with ``os.replace``, so a crash never leaves a
half-written checkpoint. The last ``keep`` checkpoints are kept: ``checkpoint.pt`` (newest), ``checkpoint.1.pt``,
... (older), each with a sidecar ``<name>.json`` holding its size, CRC-32 and step, so a damaged file (truncated,
overwritten) is recognised before unpickling and :func:`load_latest` falls back to the newest one that loads. Multi-rank runs use :mod:`torch.distributed.checkpoint` instead
(:mod:`fp8engine.training.distributed`).
"""
from __future__ import annotations

import json
import os
import random
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp8engine.training import UsageError

__all__ = ["CHECKPOINT_NAME", "capture_rng_state", "restore_rng_state", "save_checkpoint", "load_checkpoint",
           "atomic_write", "load_latest", "checkpoint_paths", "file_crc32", "DamagedCheckpoint"]

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


class DamagedCheckpoint(Exception):
    """A checkpoint file that fails its sidecar check or cannot be unpickled (message: why, one line)."""


def file_crc32(path: Path, chunk: int = 1 << 22) -> int:
    """CRC-32 (zlib) of a file's bytes, read in ``chunk``-byte pieces."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def checkpoint_paths(out_dir: Path, keep: int = 2) -> list[Path]:
    """Checkpoint file names of ``out_dir``, newest first: ``checkpoint.pt``, ``checkpoint.1.pt``, ... (``keep``
    names; found or not)."""
    out_dir = Path(out_dir)
    return [out_dir / CHECKPOINT_NAME] + [out_dir / f"checkpoint.{i}.pt" for i in range(1, keep)]


def _existing(out_dir: Path) -> list[Path]:
    """Every checkpoint file in ``out_dir``, newest first (also beyond a smaller ``keep`` of this run)."""
    out_dir = Path(out_dir)
    older = sorted((p for p in out_dir.glob("checkpoint.*.pt") if p.name.split(".")[1].isdigit()),
                   key=lambda p: int(p.name.split(".")[1]))
    return [p for p in [out_dir / CHECKPOINT_NAME] + older if p.is_file()]


def save_checkpoint(out_dir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state`` to ``out_dir/checkpoint.pt`` atomically, keeping the ``keep - 1`` previous ones as
    ``checkpoint.1.pt`` ... (each with its ``.json`` sidecar); returns the path.

    The new file is complete (written, sidecar written) before any older one is renamed or dropped, so a crash at
    any moment leaves at least the previous checkpoint loadable.

    Raises:
        ValueError: ``keep < 1``.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1; got {keep}")
    out_dir = Path(out_dir)
    path = out_dir / CHECKPOINT_NAME
    tmp = out_dir / (CHECKPOINT_NAME + ".new")
    try:
        torch.save(state, tmp)
        meta = {"size": tmp.stat().st_size, "crc32": file_crc32(tmp), "step": state.get("step")}
        atomic_write(_sidecar(tmp), lambda t: t.write_text(json.dumps(meta) + "\n"))
        names = checkpoint_paths(out_dir, keep)
        for p in _existing(out_dir)[keep - 1:]:  # beyond the kept ones once the new one is in
            if p not in names[:keep - 1]:
                p.unlink(missing_ok=True)
                _sidecar(p).unlink(missing_ok=True)
        for older, newer in reversed(list(zip(names[1:], names[:-1]))):  # shift: .1 -> .2, ..., .pt -> .1
            if newer.is_file():
                os.replace(newer, older)
                if _sidecar(newer).is_file():
                    os.replace(_sidecar(newer), _sidecar(older))
                else:
                    _sidecar(older).unlink(missing_ok=True)
        os.replace(_sidecar(tmp), _sidecar(path))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        _sidecar(tmp).unlink(missing_ok=True)
    return path


def _load_one(path: Path) -> dict[str, Any]:
    """Load one checkpoint file after checking it against its sidecar; raises :class:`DamagedCheckpoint`."""
    side = _sidecar(path)
    if side.is_file():
        try:
            meta = json.loads(side.read_text())
            size, crc = int(meta["size"]), int(meta["crc32"])
        except (ValueError, KeyError, TypeError) as err:
            raise DamagedCheckpoint(f"its sidecar {side.name} is unreadable ({err})") from None
        actual = path.stat().st_size
        if actual != size:
            raise DamagedCheckpoint(f"{actual} bytes, the sidecar says {size} (truncated or overwritten)")
        if file_crc32(path) != crc:
            raise DamagedCheckpoint("CRC-32 differs from the sidecar's (the bytes changed after writing)")
    try:
        # weights_only=False: the checkpoint holds Python RNG state tuples and settings, written by this program.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # zip reader, unpickler, EOF: all mean the file is not a checkpoint any more
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DamagedCheckpoint(f"{type(err).__name__}: {first}") from None
    if not isinstance(state, dict) or "step" not in state or "model" not in state:
        raise DamagedCheckpoint("not a training checkpoint (no step/model entries)")
    return state


def load_latest(out_dir: Path, report=print) -> dict[str, Any]:
    """Load the newest checkpoint of ``out_dir`` that passes its sidecar check and unpickles, onto the CPU.

    Each damaged one is reported in one line (``report("checkpoint at PATH is damaged: why")``), and a fallback
    is reported too. The returned dict gets ``"path"``: the file it came from.

    Raises:
        UsageError: there is none, or none loads (the message names the directory).
    """
    out_dir = Path(out_dir)
    candidates = _existing(out_dir)
    if not candidates:
        raise UsageError(f"--resume: no checkpoint at {out_dir / CHECKPOINT_NAME}; drop --resume to start a new "
                         "run, or point --out at a directory a previous run wrote")
    for i, path in enumerate(candidates):
        try:
            state = _load_one(path)
        except DamagedCheckpoint as err:
            report(f"checkpoint at {path} is damaged: {err}")
            continue
        if i:
            report(f"resuming from the older checkpoint {path} (step {state['step']}) instead")
        state["path"] = str(path)
        return state
    raise UsageError(f"--resume: no checkpoint in {out_dir} loads (all {len(candidates)} damaged); start a new run "
                     "with another --out")


def load_checkpoint(out_dir: Path) -> dict[str, Any]:
    """Load the newest loadable checkpoint of ``out_dir`` onto the CPU (:func:`load_latest`, reporting to
    stderr).

    Raises:
        UsageError: there is none, or none loads.
    """
    return load_latest(out_dir, report=lambda line: print(f"fp8engine.train: {line}", file=sys.stderr, flush=True))
