"""Data x tensor parallel training under ``torchrun``: layout checks, gradient helpers, per-rank checkpoints.

Layout (``fp8engine.parallel.init_parallel``): ``world = dp * tp``, tp innermost. Every tp rank of a data-parallel
replica sees the same batch; dp replica ``r`` takes micro-batch ``micro * dp + r`` of the step, so the global
batch of a step does not depend on how it is split (with dp = 1 it is exactly the single-process batch).

Checkpoints of multi-rank runs are written with ``torch.distributed.checkpoint`` (DCP) to
``<out>/checkpoint/step_<k>/``; ``<out>/checkpoint/latest`` names the last complete one. Our tensor-parallel
shards are plain tensors with the same parameter names on every tp rank (not DTensors), and DCP keeps one copy
of each key, so keys carry the rank whose data they are (:func:`_sharded_state`):

- ``tp{t}/model.<param>``, ``tp{t}/optimizer.<...>``: tp rank ``t``'s parameter shards and AdamW state, one
  copy for all its data-parallel replicas (they are identical);
- ``rank{r}/buffers.<buffer>`` (FP8 scaling state), ``rank{r}/rng.<generator>``: rank ``r``'s own;
- ``step``, ``data_position``, ``settings``, ``config``: plain Python values, the same on every rank.

Resuming therefore needs the same world size and ``--tp`` (checked up front by :func:`read_sharded_settings`).

Once every rank has written, rank 0 records the size and CRC-32 of every file of the step directory in
``checksums.json`` before pointing ``latest`` at it; :func:`read_sharded_settings` (run by every rank before the
process group exists) checks them all, so a damaged shard of any rank stops every rank with the same one-line
message and no collective can hang on it.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fp8engine.training import UsageError
from fp8engine.training.checkpoint import atomic_write, capture_rng_state, file_crc32

__all__ = ["Layout", "env_world_size", "check_layout", "init_layout", "clip_grad_norm", "all_reduce_sum",
           "save_sharded", "load_sharded", "read_sharded_settings", "has_sharded", "SHARDED_DIR"]

SHARDED_DIR = "checkpoint"


@dataclass
class Layout:
    """This process's place in the ``dp x tp`` grid (all sizes 1 and groups None for a single process)."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    dp_group: Any = None
    tp_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """``WORLD_SIZE`` set by ``torchrun`` (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(tp: int, sequence_parallel: bool, config, seq_len: int, fp8: bool) -> None:
    """Raise :class:`UsageError` when ``--tp``/``--sequence-parallel`` cannot work with this launch and model."""
    world = env_world_size()
    if tp < 1 or world % tp:
        raise UsageError(f"--tp {tp} must divide the number of processes ({world}); launch with "
                         f"torchrun --nproc-per-node {max(tp, 1)} (or a multiple of it)")
    if sequence_parallel and tp == 1:
        raise UsageError("--sequence-parallel needs --tp 2 or more")
    if tp == 1:
        return
    for name, value in (("n_head", config.n_head), ("kv heads", config.kv_heads),
                        ("ffn_hidden_size", config.ffn_hidden_size), ("vocab size", config.vocab_size)):
        if value % tp:
            raise UsageError(f"--tp {tp} does not divide the model's {name} ({value}); choose a --tp that does")
    if sequence_parallel and seq_len % tp:
        raise UsageError(f"--sequence-parallel needs --seq-len divisible by --tp {tp}; got {seq_len}")
    if fp8 and config.fp8_problems(tp):
        raise UsageError(f"--tp {tp} leaves FP8 GEMMs misaligned: {config.fp8_problems(tp)[0]}; use a smaller "
                         "--tp or --precision bf16")


def init_layout(tp: int, device: torch.device, timeout: Optional[float] = None) -> Layout:
    """Initialise ``torch.distributed`` from ``torchrun``'s environment when there is more than one process;
    ``timeout`` (seconds, None: torch's default) bounds every collective's wait."""
    if env_world_size() == 1:
        return Layout()
    from fp8engine.parallel import init_parallel

    env = init_parallel(tp, backend=None if device.type == "cuda" else "gloo", timeout=timeout)
    return Layout(dist.get_rank(), dist.get_world_size(), env.dp_rank, env.dims.dp, env.dims.tp, env.tp_rank,
                  env.dp_group if env.dims.dp > 1 else None, env.tp_group if env.dims.tp > 1 else None)


def all_reduce_sum(values: list[float], group, device) -> list[float]:
    """SUM a few Python floats across ``group`` (identity for None)."""
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, tp_group) -> torch.Tensor:
    """Clip to a global L2 norm ``max_norm``; returns the norm before clipping (fp32 device scalar, no host
    synchronisation, so it can run inside a captured CUDA graph).

    With tensor parallelism a parameter holding a shard contributes its local sum of squares, summed over
    ``tp_group``; a replicated one (norms and row-parallel biases, marked with a ``sequence_parallel``
    attribute by the layers) is counted once (Megatron's ``clip_grad_norm_fp32``).
    """
    params = [p for p in params if p.grad is not None]
    if tp_group is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    sharded = [p.grad for p in params if not hasattr(p, "sequence_parallel")]
    replicated = [p.grad for p in params if hasattr(p, "sequence_parallel")]
    device = params[0].grad.device
    sq_sharded = sum((g.float().pow(2).sum() for g in sharded), torch.zeros((), device=device))
    dist.all_reduce(sq_sharded, group=tp_group)
    sq = sq_sharded + sum((g.float().pow(2).sum() for g in replicated), torch.zeros((), device=device))
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return norm


def _root(out: Path) -> Path:
    return Path(out) / SHARDED_DIR


def _latest_dir(out: Path) -> Optional[Path]:
    latest = _root(out) / "latest"
    return _root(out) / latest.read_text().strip() if latest.is_file() else None


def _sharded_state(layout: Layout, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
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
    buffer_names = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    t, r = f"tp{layout.tp_rank}", f"rank{layout.rank}"
    return {f"{t}/model": {k: v for k, v in model_sd.items() if k not in buffer_names},
            f"{t}/optimizer": optim_sd,
            f"{r}/buffers": {k: v for k, v in model_sd.items() if k in buffer_names},
            f"{r}/rng": rng}


def save_sharded(out: Path, layout: Layout, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: dict[str, Any], step: int) -> None:
    """Save a multi-rank checkpoint of ``step`` with ``torch.distributed.checkpoint`` (collective: every rank).

    Written to ``<out>/checkpoint/step_<k>/`` (DCP's ``.metadata`` and ``__<rank>_0.distcp`` files): the model
    and optimizer taken from the objects as laid out by :func:`_sharded_state` (``state["model"]`` and
    ``state["optimizer"]``, the single-process format, are not used), ``state["rng"]`` under ``rank{r}/rng``, and
    the other entries of ``state`` (step, data position, settings, config: the same on every rank) as plain
    Python values under their own names. Once every rank has written (``dcp.save`` returns after the coordinator
    wrote ``.metadata``, then a barrier), rank 0 atomically points ``<out>/checkpoint/latest`` at the new step and
    removes the previous one, so ``latest`` always names a complete checkpoint.
    """
    step_dir = _root(out) / f"step_{step}"
    if layout.is_main and step_dir.exists() and step_dir != _latest_dir(out):  # a crashed save's leftovers
        shutil.rmtree(step_dir)
    dist.barrier()
    plain = {k: v for k, v in state.items() if k not in ("model", "optimizer", "rng")}
    dcp.save(_sharded_state(layout, model, optimizer, state["rng"]) | plain, checkpoint_id=step_dir)
    dist.barrier()
    if layout.is_main:
        sums = {p.name: {"size": p.stat().st_size, "crc32": file_crc32(p)} for p in sorted(step_dir.iterdir())
                if p.is_file() and p.name != _CHECKSUMS}
        atomic_write(step_dir / _CHECKSUMS, lambda tmp: tmp.write_text(json.dumps(sums, indent=1) + "\n"))
        latest = _root(out) / "latest"
        previous = latest.read_text().strip() if latest.is_file() else None
        atomic_write(latest, lambda tmp: tmp.write_text(step_dir.name + "\n"))
        if previous and previous != step_dir.name:
            shutil.rmtree(_root(out) / previous, ignore_errors=True)
    dist.barrier()


_CHECKSUMS = "checksums.json"


def _damage(step_dir: Path) -> Optional[str]:
    """Why ``step_dir`` does not match its ``checksums.json`` (one line), or None when every file does (a
    checkpoint written before checksums were recorded is not checked)."""
    sums_path = step_dir / _CHECKSUMS
    if not sums_path.is_file():
        return None if step_dir.is_dir() else "the directory is missing"
    try:
        sums = json.loads(sums_path.read_text())
    except ValueError as err:
        return f"{_CHECKSUMS} is unreadable ({err})"
    for name, meta in sums.items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["size"]:
            return f"{name} has {path.stat().st_size} bytes, {meta['size']} were written (truncated or overwritten)"
        if file_crc32(path) != meta["crc32"]:
            return f"{name}: CRC-32 differs from the one recorded at save time"
    return None


def has_sharded(out: Path) -> bool:
    return (_root(out) / "latest").is_file()


def read_sharded_settings(out: Path, settings: dict[str, Any]) -> Optional[dict[str, Any]]:
    """``{"step", "settings"}`` of the checkpoint ``latest`` names (None without one); needs no process group.

    ``settings`` (this run's) is the template DCP fills with the saved values, so it must have the saved keys.

    Raises:
        UsageError: the checkpoint is damaged (a file differs from ``checksums.json``) or cannot be read, or was
            written by a different world size or ``--tp`` (the tensor-parallel shards and per-rank entries only
            fit the same layout).
    """
    step_dir = _latest_dir(out)
    if step_dir is None:
        return None
    damage = _damage(step_dir)
    if damage is not None:
        raise UsageError(f"--resume: checkpoint at {step_dir} is damaged: {damage}; use a new --out")
    meta = {"step": 0, "settings": dict(settings)}
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended here
            warnings.simplefilter("ignore")
            dcp.load(meta, checkpoint_id=step_dir, no_dist=True)
    except Exception as err:  # DCP wraps missing files and keys in CheckpointException
        raise UsageError(f"--resume: cannot read the checkpoint {step_dir} ({str(err).strip().splitlines()[0]}); "
                         "use a new --out") from None
    saved = meta["settings"]
    if (saved["world_size"], saved["tp"]) != (settings["world_size"], settings["tp"]):
        raise UsageError(f"--resume: {step_dir} was written by {saved['world_size']} processes with --tp "
                         f"{saved['tp']}, this run has {settings['world_size']} with --tp {settings['tp']}; resume "
                         f"with torchrun --nproc-per-node {saved['world_size']} ... --tp {saved['tp']}")
    return meta


def load_sharded(out: Path, layout: Layout, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, rng_tracker=None) -> dict[str, Any]:
    """Load the checkpoint ``latest`` names into ``model`` and ``optimizer`` in place (collective: every rank);
    returns ``{"rng": this rank's RNG states}`` for :func:`~fp8engine.training.checkpoint.restore_rng_state`.

    Pass the unwrapped model (not DDP). The template is built like the saved state (:func:`_sharded_state`), so
    DCP reads this rank's tp shard, buffers and RNG states straight into it.
    """
    step_dir = _latest_dir(out)
    state = _sharded_state(layout, model, optimizer, capture_rng_state(rng_tracker))
    dcp.load(state, checkpoint_id=step_dir)
    t, r = f"tp{layout.tp_rank}", f"rank{layout.rank}"
    set_state_dict(model, optimizer, model_state_dict=state[f"{t}/model"] | state[f"{r}/buffers"],
                   optim_state_dict=state[f"{t}/optimizer"])
    return {"rng": state[f"{r}/rng"]}
