"""Multi-rank checkpoints of the training command, with ``torch.distributed.checkpoint`` (DCP): layout, last-K
retention, and a resume that falls back past a damaged shard on any rank.

Each checkpoint is a folder ``<out>/checkpoint/step_<k>/`` (DCP's ``.metadata`` and one ``__<rank>_0.distcp``
file per rank); ``<out>/checkpoint/latest`` names the newest complete one. Our tensor-parallel shards are plain
tensors with the same parameter names on every tp rank (not DTensors), and DCP keeps one copy of each key, so
keys carry the rank whose data they are (:func:`_sharded_state`):

- ``tp{t}/model.<param>``, ``tp{t}/optimizer.<...>``: tp rank ``t``'s parameter shards and AdamW state, one
  copy for all its data-parallel replicas (they are identical);
- ``rank{r}/buffers.<buffer>`` (FP8 scaling state), ``rank{r}/rng.<generator>``: rank ``r``'s own;
- ``step``, ``data_position``, ``settings``, ``config``: plain Python values, the same on every rank.

Resuming therefore needs the same world size and ``--tp`` (checked up front by :func:`read_sharded_settings`), except
between FSDP2 runs of the same ``--tp``, whose parameters and AdamW state DCP reshards (:func:`load_sharded`).

Integrity: after DCP has written, every rank computes the size and CRC-32 of its own shard file(s) (rank 0 also
of ``.metadata``), the ranks exchange them (one collective on a small byte tensor, :func:`_gather_text`), and
rank 0, having checked that every listed file is in the folder with its size and that DCP's metadata reads,
records them in ``checksums.json``. Only then does ``latest`` move to the new folder and are folders beyond the
newest ``keep`` deleted, so a crash at any moment leaves the previous checkpoints whole.

On ``--resume`` (:func:`select_sharded`) every rank checks its own files of the newest folder against
``checksums.json`` (one read of the checkpoint in all, spread over the ranks), and the ranks agree with one
collective: if any rank found damage, every rank prints the same line naming the folder and each rank's reason
and tries the next older folder. No rank ever enters a DCP load the others skip, so nothing hangs.
"""
from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fp8engine.parallel.fsdp_fp8 import unwrap_state_dict
from fp8engine.training import UsageError
from fp8engine.training.checkpoint import atomic_write, capture_rng_state, file_crc32

__all__ = ["SHARDED_DIR", "has_sharded", "sharded_dirs", "save_sharded", "read_sharded_settings", "select_sharded",
           "load_sharded", "reshardable", "CheckpointNotWritten"]

SHARDED_DIR = "checkpoint"
_CHECKSUMS = "checksums.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: __<rank>_<file index>.distcp
#: Bytes of each rank's line in :func:`_gather_text` (a reason or a JSON list of a few files fits easily).
_LINE_BYTES = 4096


class CheckpointNotWritten(RuntimeError):
    """A new multi-rank checkpoint did not verify after writing (the older ones are kept); one-line message,
    raised on every rank alike."""


def _root(out: Path) -> Path:
    return Path(out) / SHARDED_DIR


def _step_of(path: Path) -> Optional[int]:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def _latest_dir(out: Path) -> Optional[Path]:
    latest = _root(out) / "latest"
    return _root(out) / latest.read_text().strip() if latest.is_file() else None


def sharded_dirs(out: Path) -> list[Path]:
    """The complete checkpoint folders of ``out``, newest (highest step) first: those with a ``checksums.json``
    (written once every rank had written), and the one ``latest`` names (a checkpoint written before checksums
    were recorded). A crashed save's folder has neither and is not listed."""
    root = _root(out)
    if not root.is_dir():
        return []
    latest = _latest_dir(out)
    found = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None
             and ((p / _CHECKSUMS).is_file() or p == latest)]
    return sorted(found, key=_step_of, reverse=True)


def has_sharded(out: Path) -> bool:
    """Whether ``out`` holds a multi-rank checkpoint (complete or damaged: ``--out`` is then taken)."""
    return (_root(out) / "latest").is_file() or bool(sharded_dirs(out))


def _gather_text(text: str, device: torch.device) -> list[str]:
    """Every rank's ``text`` (UTF-8, at most ``_LINE_BYTES`` bytes; longer is cut), in rank order: one SUM
    all-reduce of a ``[world, _LINE_BYTES]`` uint8 tensor in which each rank fills its own row (collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = torch.zeros(world, _LINE_BYTES, dtype=torch.uint8)
    data = text.encode()[:_LINE_BYTES]
    if data:
        rows[rank, :len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    rows = rows.to(device)
    dist.all_reduce(rows)
    return [bytes(row.cpu().tolist()).rstrip(b"\0").decode(errors="ignore") for row in rows]


def _own_files(names, rank: int, world: int) -> list[str]:
    """The files of a step folder that ``rank`` vouches for: its own shards; rank 0 also every file no rank
    owns (``.metadata``)."""
    owned = []
    for name in names:
        match = _SHARD_FILE.match(name)
        owner = int(match.group(1)) if match and int(match.group(1)) < world else 0
        if owner == rank:
            owned.append(name)
    return owned


def _file_sums(step_dir: Path, names: list[str]) -> dict[str, dict[str, int]]:
    return {name: {"size": (step_dir / name).stat().st_size, "crc32": file_crc32(step_dir / name)}
            for name in names}


def _sharded_state(layout, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   rng: dict[str, Any]) -> dict[str, Any]:
    """The tensor part of a multi-rank checkpoint, keyed so that DCP keeps exactly what differs between ranks.

    ``tp{t}/model`` (parameters) and ``tp{t}/optimizer`` (AdamW state and param groups, keyed by parameter name)
    are identical on the data-parallel replicas of tp rank ``t``, so DCP writes them once per tp shard.
    ``rank{r}/buffers`` (the FP8 amax histories, scales and counters) and ``rank{r}/rng`` are per rank: between a
    backward and the next autocast exit, column 0 of an amax history holds this rank's own gradient amaxes, not
    yet MAX-reduced over the dp group. ``get_state_dict`` initialises AdamW's lazy state (a step with zero grads
    and lr 0, which leaves the parameters as they are), so on load the template has the saved shapes.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd = unwrap_state_dict(model_sd)  # FSDP2 FP8 all-gather weights: their plain shards
    buffer_names = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    t, r = f"tp{layout.tp_rank}", f"rank{layout.rank}"
    return {f"{t}/model": {k: v for k, v in model_sd.items() if k not in buffer_names},
            f"{t}/optimizer": optim_sd,
            f"{r}/buffers": {k: v for k, v in model_sd.items() if k in buffer_names},
            f"{r}/rng": rng}


def save_sharded(out: Path, layout, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: dict[str, Any], step: int, keep: int = 2, device: Optional[torch.device] = None) -> Path:
    """Save a multi-rank checkpoint of ``step`` with DCP (collective: every rank); returns its folder.

    Written to ``<out>/checkpoint/step_<k>/``: the model and optimizer taken from the objects as laid out by
    :func:`_sharded_state` (``state["model"]`` and ``state["optimizer"]``, the single-process format, are not
    used), ``state["rng"]`` under ``rank{r}/rng``, and the other entries of ``state`` (step, data position,
    settings, config: the same on every rank) as plain Python values under their own names. A folder of the same
    step already there (a crashed save's leftovers, or a damaged one a resume fell back past) is replaced.

    Then, in this order: each rank's file sizes and CRC-32s are gathered; rank 0 verifies the folder (every file
    there with its size, DCP's metadata readable) and writes ``checksums.json``; ``latest`` names the new folder;
    every other folder except the newest ``keep - 1`` older complete ones is deleted (also folders of later steps,
    left from a run that a resume fell back past). ``device``: where the small collective tensor lives (the
    process group's device: CUDA for NCCL; default CPU).

    Raises:
        ValueError: ``keep < 1``.
        CheckpointNotWritten: rank 0 found the new folder incomplete (on every rank; older folders are kept).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1; got {keep}")
    device = device if device is not None else torch.device("cpu")
    step_dir = _root(out) / f"step_{step}"
    if layout.is_main and step_dir.exists():
        shutil.rmtree(step_dir)
    dist.barrier()
    plain = {k: v for k, v in state.items() if k not in ("model", "optimizer", "rng")}
    dcp.save(_sharded_state(layout, model, optimizer, state["rng"]) | plain, checkpoint_id=step_dir)
    dist.barrier()  # every rank's files and the coordinator's .metadata are in place
    names = sorted(p.name for p in step_dir.iterdir() if p.is_file())
    reports = _gather_text(json.dumps(_file_sums(step_dir, _own_files(names, layout.rank, layout.world_size))),
                           device)
    problem = ""
    if layout.is_main:
        sums = {}
        try:
            for text in reports:
                sums.update(json.loads(text))
        except ValueError:  # cut at _LINE_BYTES: more shard files per rank than DCP's default writer makes
            problem = "a rank's list of files is too long to gather"
        problem = problem or _verify_written(step_dir, sums) or ""
        if not problem:
            atomic_write(step_dir / _CHECKSUMS, lambda tmp: tmp.write_text(json.dumps(sums, indent=1) + "\n"))
            atomic_write(_root(out) / "latest", lambda tmp: tmp.write_text(step_dir.name + "\n"))
            _prune(out, step_dir, keep)
    verdict = [line for line in _gather_text(problem, device) if line]
    if verdict:
        raise CheckpointNotWritten(f"the checkpoint {step_dir} did not verify after writing ({verdict[0]}); the "
                                   "older checkpoints are kept")
    return step_dir


def _verify_written(step_dir: Path, sums: dict[str, dict[str, int]]) -> Optional[str]:
    """Rank 0's check of a just-written folder: every file there was reported with its size, none is missing,
    DCP's metadata reads. Returns why not (one line) or None."""
    present = {p.name: p.stat().st_size for p in step_dir.iterdir() if p.is_file()}
    if ".metadata" not in sums:
        return "no .metadata"
    for name, meta in sums.items():
        if present.get(name) != meta["size"]:
            return f"{name}: {present.get(name, 'missing')} bytes, {meta['size']} written"
    unreported = sorted(set(present) - set(sums))
    if unreported:
        return f"{unreported[0]} is there but no rank reported it"
    try:
        dcp.FileSystemReader(step_dir).read_metadata()
    except Exception as err:  # an unpickling error of any kind
        return f".metadata does not read ({type(err).__name__})"
    return None


def _prune(out: Path, new_dir: Path, keep: int) -> None:
    """Delete every checkpoint folder but ``new_dir`` and the newest ``keep - 1`` complete ones older than it."""
    new_step = _step_of(new_dir)
    complete = set(sharded_dirs(out))
    older = sorted((p for p in complete if _step_of(p) < new_step), key=_step_of, reverse=True)
    kept = {new_dir, *older[:keep - 1]}
    for path in _root(out).iterdir():
        if path.is_dir() and _step_of(path) is not None and path not in kept:
            shutil.rmtree(path, ignore_errors=True)


def _damage(step_dir: Path, rank: int, world: int) -> Optional[str]:
    """Why the files ``rank`` vouches for in ``step_dir`` (:func:`_own_files`) do not match ``checksums.json``
    (one line), or None when they do (a folder written before checksums were recorded is not checked)."""
    sums_path = step_dir / _CHECKSUMS
    if not sums_path.is_file():
        return None if step_dir.is_dir() else "the folder is missing"
    try:
        sums = json.loads(sums_path.read_text())
        wanted = {name: (int(meta["size"]), int(meta["crc32"])) for name, meta in sums.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{_CHECKSUMS} is unreadable ({type(err).__name__})"
    for name in _own_files(sorted(wanted), rank, world):
        path, (size, crc) = step_dir / name, wanted[name]
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written (truncated or overwritten)"
        if file_crc32(path) != crc:
            return f"{name}: CRC-32 differs from the one recorded at save time"
    return None


def _read_meta(step_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """``{"step", "settings"}`` of one folder without a process group (DCP ``no_dist``); ``settings`` is the
    template DCP fills. Raises whatever DCP raises for an unreadable folder."""
    meta = {"step": 0, "settings": dict(settings)}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended here
        warnings.simplefilter("ignore")
        dcp.load(meta, checkpoint_id=step_dir, no_dist=True)
    return meta


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def read_sharded_settings(out: Path, settings: dict[str, Any]) -> Optional[dict[str, Any]]:
    """``{"step", "settings", "dir"}`` of the newest checkpoint folder whose plain values read (None without a
    multi-rank checkpoint); needs no process group, so every rank can refuse a wrong launch before one exists.
    Shards are not checked here (:func:`select_sharded` does, once the ranks can agree); the settings are the same
    in every folder of a run, and the step is an upper bound of the one the resume will use.

    Raises:
        UsageError: no folder reads, or the checkpoint was written by a different ``--tp``, or by a different
            world size without FSDP2 on both sides (:func:`reshardable`): the tensor-parallel shards and per-rank
            entries only fit the same layout.
    """
    if not has_sharded(out):
        return None
    dirs, errors = sharded_dirs(out), []
    for step_dir in dirs:
        try:
            meta = _read_meta(step_dir, settings)
        except Exception as err:  # DCP wraps missing files and keys in CheckpointException
            errors.append(f"{step_dir.name}: {_first_line(err)}")
            continue
        saved = meta["settings"]
        if (saved["world_size"], saved["tp"]) != (settings["world_size"], settings["tp"]) and not reshardable(
                saved, settings):
            raise UsageError(f"--resume: {step_dir} was written by {saved['world_size']} processes with --tp "
                             f"{saved['tp']}, this run has {settings['world_size']} with --tp {settings['tp']} (only "
                             "--fsdp runs of the same --tp reshard; other shards fit their own layout); resume with "
                             f"torchrun --nproc-per-node {saved['world_size']} ... --tp {saved['tp']}")
        return meta | {"dir": step_dir}
    why = f" ({errors[0]})" if errors else ""
    raise UsageError(f"--resume: no checkpoint in {_root(out)} can be read{why}; start a new run with another --out")


def select_sharded(out: Path, settings: dict[str, Any], device: torch.device,
                   report: Callable[[str], None]) -> dict[str, Any]:
    """Pick the newest checkpoint folder that verifies on every rank (collective: every rank, same answer);
    returns ``{"step", "settings", "dir"}`` of it.

    Per folder, newest first: each rank checks its own files against ``checksums.json`` and reads the plain
    values; one :func:`_gather_text` shares the verdicts. A folder any rank finds damaged is reported by every
    rank with the same line (``report("checkpoint at DIR is damaged (rank r: why); trying the next older one")``)
    and skipped; a fallback is reported too. ``settings``: the template of :func:`read_sharded_settings`.

    Raises:
        UsageError: no folder verifies on every rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dirs = sharded_dirs(out)
    for i, step_dir in enumerate(dirs):
        problem, meta = _damage(step_dir, rank, world), None
        if problem is None:
            try:
                meta = _read_meta(step_dir, settings)
            except Exception as err:
                problem = f"the step and settings do not read ({_first_line(err)})"
        verdicts = _gather_text(problem or "", device)
        bad = [f"rank {r}: {line}" for r, line in enumerate(verdicts) if line]
        if bad:
            report(f"checkpoint at {step_dir} is damaged ({'; '.join(bad)}); trying the next older one")
            continue
        if i:
            report(f"resuming from the older checkpoint {step_dir} (step {meta['step']}) instead")
        return meta | {"dir": step_dir}
    raise UsageError(f"--resume: no checkpoint in {_root(out)} verifies on every rank (all {len(dirs)} damaged); "
                     "start a new run with another --out")


def load_sharded(step_dir: Path, layout, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 rng_tracker=None, saved_world_size: Optional[int] = None) -> dict[str, Any]:
    """Load the checkpoint folder ``step_dir`` (from :func:`select_sharded`) into ``model`` and ``optimizer`` in
    place (collective: every rank); returns ``{"rng": this rank's RNG states}`` for
    :func:`~fp8engine.training.checkpoint.restore_rng_state`.

    Pass the unwrapped model (not DDP). The template is built like the saved state (:func:`_sharded_state`), so
    DCP reads this rank's tp shard, buffers and RNG states straight into it.

    ``saved_world_size``: the checkpoint's world size when it differs from this run's (FSDP2 runs of the same
    ``--tp``, :func:`reshardable`). DCP then reshards the parameters and AdamW state (``DTensor`` shards) over this
    run's data-parallel ranks; this rank's FP8 buffers are the elementwise MAX of those of the saved ranks of its tp
    rank (their amax histories differ only in column 0, this rank's pending gradient amaxes, whose MAX is what the
    next reduction over the data-parallel group would have made of them; every other entry is the same on all of
    them), and no RNG states are loaded (``"rng": None``: there is no saved rank to take them from one to one).
    """
    state = _sharded_state(layout, model, optimizer, capture_rng_state(rng_tracker))
    t, r = f"tp{layout.tp_rank}", f"rank{layout.rank}"
    if saved_world_size is None or saved_world_size == layout.world_size:
        dcp.load(state, checkpoint_id=step_dir)
        buffers, rng = state[f"{r}/buffers"], state[f"{r}/rng"]
    else:
        mine = state.pop(f"{r}/buffers")
        del state[f"{r}/rng"]
        sources = [f"rank{s}/buffers" for s in range(saved_world_size) if s % layout.tp_size == layout.tp_rank]
        for key in sources:  # rank = dp_rank * tp + tp_rank: the (dp, tp) mesh's row-major order
            state[key] = {name: value.clone() for name, value in mine.items()}
        dcp.load(state, checkpoint_id=step_dir)
        buffers = {name: (torch.stack([state[key][name] for key in sources]).amax(0)
                          if value.is_floating_point() else state[sources[0]][name]) for name, value in mine.items()}
        rng = None
    set_state_dict(model, optimizer, model_state_dict=state[f"{t}/model"] | buffers,
                   optim_state_dict=state[f"{t}/optimizer"])
    return {"rng": rng}


def reshardable(saved: dict[str, Any], settings: dict[str, Any]) -> bool:
    """Whether a checkpoint written with the run settings ``saved`` loads into a run of ``settings`` at another
    world size: both FSDP2 runs (``"fsdp"``: their parameters and AdamW state are ``DTensor`` shards, which DCP
    reshards) of the same ``--tp`` (plain tensor-parallel shards fit only their own layout)."""
    return bool(saved.get("fsdp")) and bool(settings.get("fsdp")) and saved.get("tp") == settings.get("tp")
