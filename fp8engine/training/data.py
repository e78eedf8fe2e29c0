"""Token data for the training command, and deterministic, resumable batch sampling.

Sources:
- no ``--data``: the Python standard library's own ``.py`` sources, read at run time (real text on every
  machine), as bytes: vocabulary 256.
- a text file: its bytes (vocabulary 256).
- a directory with nanoGPT-style ``train.bin``/``val.bin`` (uint16 token ids, read through ``numpy.memmap``);
  the vocabulary is ``meta.pkl``'s ``vocab_size`` when present, else GPT-2's 50304 (50257 padded to 64).

Text is split 90 % train / 10 % validation (the last 10 %). Batches are a pure function of
``(seed, split, step, micro-batch)``: each draws its offsets from a ``torch.Generator`` seeded from those numbers,
so the data position is just the step and a resumed run sees exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import pickle
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from fp8engine.training import UsageError

__all__ = ["TokenData", "load_data", "stdlib_corpus", "check_seq_len", "get_batch", "batch_seed", "VAL_FRACTION",
           "GPT2_VOCAB"]

VAL_FRACTION = 0.1
GPT2_VOCAB = 50304  # GPT-2's 50257 BPE tokens padded to a multiple of 64
_STDLIB_MAX_BYTES = 8 * 2**20  # cap the default corpus so loading stays well under a second
_SPLITS = {"train": 0, "val": 1}


@dataclass
class TokenData:
    """Train/validation token arrays (1-D numpy, uint8 or uint16; possibly memmaps) and how to read them.

    ``encode(str) -> list[int]`` and ``decode(list[int]) -> str`` are None when the vocabulary is unknown
    (bins without ``meta.pkl``).
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str
    encode: Optional[Callable[[str], list]] = None
    decode: Optional[Callable[[list], str]] = None


def _encode_bytes(text: str) -> list:
    return list(text.encode("utf-8"))


def _decode_bytes(tokens: list) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def stdlib_corpus(max_bytes: int = _STDLIB_MAX_BYTES) -> tuple[bytes, int]:
    """The top-level ``.py`` files of this Python's standard library, in sorted order, concatenated.

    Returns ``(text, number of files)``; stops after ``max_bytes``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total, files = [], 0, 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total, files = total + len(data), files + 1
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes], files


def _split_bytes(raw: bytes, description: str) -> TokenData:
    tokens = np.frombuffer(raw, dtype=np.uint8)
    n_val = max(1, int(len(tokens) * VAL_FRACTION))
    return TokenData(tokens[:-n_val], tokens[-n_val:], 256, description, _encode_bytes, _decode_bytes)


def _load_bins(directory: Path) -> TokenData:
    arrays = {}
    for split in ("train", "val"):
        path = directory / f"{split}.bin"
        if not path.is_file():
            raise UsageError(f"--data {directory}: no {split}.bin there; give a text file or a directory holding "
                             "nanoGPT-style train.bin and val.bin (uint16 token ids)")
        if path.stat().st_size < 2:
            raise UsageError(f"--data {directory}: {split}.bin is empty; regenerate the token files")
        arrays[split] = np.memmap(path, dtype=np.uint16, mode="r")
    vocab, encode, decode = GPT2_VOCAB, None, None
    meta = directory / "meta.pkl"
    if meta.is_file():
        with open(meta, "rb") as f:
            info = pickle.load(f)
        vocab = int(info["vocab_size"])
        if "itos" in info and "stoi" in info:
            itos, stoi = info["itos"], info["stoi"]
            encode = lambda s: [stoi[c] for c in s if c in stoi]  # noqa: E731
            decode = lambda toks: "".join(itos[int(t)] for t in toks)  # noqa: E731
    return TokenData(arrays["train"], arrays["val"], vocab, f"token bins in {directory} (vocab {vocab})",
                     encode, decode)


def load_data(path: Optional[str]) -> TokenData:
    """Load ``--data`` (see the module docstring); None loads the standard-library corpus.

    Raises:
        UsageError: missing path, empty file, or a directory without ``train.bin``/``val.bin``.
    """
    if path is None:
        raw, files = stdlib_corpus()
        if not raw:
            raise UsageError("found no .py files in this Python's standard library; pass --data FILE")
        return _split_bytes(raw, f"Python standard library sources ({files} files, {len(raw):,} bytes)")
    p = Path(path)
    if p.is_dir():
        return _load_bins(p)
    if not p.exists():
        raise UsageError(f"--data {path}: no such file or directory; pass an existing text file or token directory")
    raw = p.read_bytes()
    if not raw:
        raise UsageError(f"--data {path}: the file is empty; pass a text file with some content")
    return _split_bytes(raw, f"{p.name} ({len(raw):,} bytes)")


def check_seq_len(data: TokenData, seq_len: int) -> None:
    """Raise :class:`UsageError` unless both splits hold at least ``seq_len + 1`` tokens (one input + target)."""
    shortest = min(len(data.train), len(data.val))
    if seq_len + 1 > shortest:
        which = "validation" if len(data.val) < len(data.train) else "training"
        raise UsageError(f"--seq-len {seq_len} is longer than the data allows (the {which} split has {shortest} "
                         f"tokens); use --seq-len {max(1, shortest - 1)} or less, or more data")


def batch_seed(seed: int, split: str, step: int, micro: int) -> int:
    """A 63-bit seed mixed from ``(seed, split, step, micro)`` (numpy ``SeedSequence``)."""
    state = np.random.SeedSequence([seed, _SPLITS[split], step, micro]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``tokens``: inputs ``x [batch, seq_len]`` and next-token targets ``y`` (int64, CPU).

    Offsets come from a ``torch.Generator`` seeded with ``seed`` (see :func:`batch_seed`).
    """
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(tokens) - seq_len, (batch_size,), generator=gen).tolist()
    windows = np.stack([np.asarray(tokens[i:i + seq_len + 1], dtype=np.int64) for i in starts])
    batch = torch.from_numpy(windows)
    return batch[:, :-1], batch[:, 1:]

