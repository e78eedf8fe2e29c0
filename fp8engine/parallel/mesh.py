"""Data x tensor parallel layout from ``torchrun``'s environment: sizes, checks, the device mesh and its groups."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ParallelDims", "ParallelEnv", "init_parallel"]


@dataclass(frozen=True)
class ParallelDims:
    """``dp * tp == world_size`` ranks; rank ``r`` is tp rank ``r % tp`` of dp replica ``r // tp`` (tp innermost,
    so a tp group is ``tp`` consecutive ranks, e.g. one NVLink island).

    Raises:
        ValueError: a size below 1 or ``dp * tp != world_size`` (the message names the numbers).
    """

    dp: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelDims.{name} must be an int >= 1; got {v!r}")
        if self.dp * self.tp != self.world_size:
            raise ValueError(f"ParallelDims: dp ({self.dp}) * tp ({self.tp}) = {self.dp * self.tp} != "
                             f"world_size ({self.world_size})")

    @classmethod
    def from_env(cls, tp: int, world_size: Optional[int] = None) -> "ParallelDims":
        """``dp = WORLD_SIZE / tp`` from ``torchrun``'s ``WORLD_SIZE`` (or ``world_size``); ValueError when tp
        does not divide it."""
        ws = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", "1"))
        if tp < 1 or ws % tp:
            raise ValueError(f"ParallelDims: tp={tp} must be >= 1 and divide world_size={ws}")
        return cls(dp=ws // tp, tp=tp, world_size=ws)

    def validate_model(self, *, num_heads: Optional[int] = None, num_query_groups: Optional[int] = None,
                       hidden: Optional[int] = None, ffn: Optional[int] = None, vocab: Optional[int] = None) -> None:
        """Raise ``ValueError`` naming the dimension and both numbers when tp does not divide it."""
        for name, value in (("num_heads", num_heads), ("num_query_groups", num_query_groups), ("hidden", hidden),
                            ("ffn", ffn), ("vocab", vocab)):
            if value is not None and value % self.tp:
                raise ValueError(f"tensor parallel size tp={self.tp} does not divide {name}={value}; choose a tp "
                                 f"that divides it (or pad {name} to a multiple of {self.tp})")

    def build_mesh(self, device_type: Optional[str] = None):
        """A ``DeviceMesh`` of shape ``(dp, tp)`` with dim names ``("dp", "tp")`` (default process group must be
        initialised)."""
        from torch.distributed.device_mesh import init_device_mesh

        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))


@dataclass(frozen=True)
class ParallelEnv:
    """What :func:`init_parallel` returns: the dims, the mesh and this rank's groups and ranks in them."""

    dims: ParallelDims
    mesh: object
    dp_group: object
    tp_group: object
    dp_rank: int
    tp_rank: int


def init_parallel(tp: int, *, backend: Optional[str] = None, model_dims: Optional[dict] = None,
                  timeout: Optional[float] = None) -> ParallelEnv:
    """Initialise the default process group from ``torchrun``'s environment (``nccl`` with CUDA, else ``gloo``;
    skipped if already initialised), bind this process to GPU ``LOCAL_RANK``, build the ``(dp, tp)`` mesh.

    Args:
        tp: tensor-parallel size. backend: override the backend.
        model_dims: optional ``ParallelDims.validate_model`` keywords (num_heads, hidden, ffn, vocab, ...).
        timeout: seconds a collective (and the rendezvous) may wait before failing (None: torch's default, 10 min
            for NCCL and gloo), so a dead peer ends the survivors with an error instead of a hang.
    Raises:
        ValueError: tp does not divide the world size or a model dimension.
    """
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        kwargs = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), **kwargs)
    dims = ParallelDims.from_env(tp, dist.get_world_size())
    if model_dims:
        dims.validate_model(**model_dims)
    mesh = dims.build_mesh("cuda" if use_cuda else "cpu")
    dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
    return ParallelEnv(dims, mesh, dp_group, tp_group, dist.get_rank(dp_group), dist.get_rank(tp_group))
