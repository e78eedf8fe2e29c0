"""What every FP8 module shares: its scaling state, the per-forward FP8 set-up, and FP8 weight caching."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from fp8engine.fp8.autocast import get_fp8_context
from fp8engine.fp8.float8_tensor import Float8Tensor
from fp8engine.fp8.state import ScalingState
from fp8engine.ops.cast import FP8Plan, begin_fp8, cast_operand, cast_weights
from fp8engine.ops.gemm import check_gemm_dims

__all__ = ["FP8Module", "FP8WeightCache", "fp8_submodules", "prefetch_fp8_weights"]


class FP8WeightCache:
    """FP8 copies of weights for gradient accumulation (``is_first_microbatch``, TransformerEngine's semantics).

    ``None``: cast every call, cache nothing. ``True``: cast and keep. ``False``: reuse what the first
    micro-batch kept (no cast, no amax recorded). A copy put in ``prefetched`` by :func:`prefetch_fp8_weights`
    (cast together with other modules' weights) is used instead of casting, once.
    """

    def __init__(self):
        self._cache: dict[str, Float8Tensor] = {}
        self.prefetched: dict[str, Float8Tensor] = {}

    def get(self, name: str, weight: torch.Tensor, state: ScalingState, row: int, plan: FP8Plan,
            is_first_microbatch: Optional[bool], transpose: bool) -> Float8Tensor:
        if is_first_microbatch is False:
            cached = self._cache.get(name)
            if cached is None:
                raise ValueError(f"is_first_microbatch=False but no FP8 copy of {name!r} is cached; pass "
                                 "is_first_microbatch=True on the first micro-batch of the step")
            return cached
        w_fp8 = self.prefetched.pop(name, None)
        if w_fp8 is None:
            w_fp8 = cast_operand(weight, state, row, plan, transpose=transpose)
        if is_first_microbatch:
            self._cache[name] = w_fp8
        else:
            self._cache.pop(name, None)
        return w_fp8

    def clear(self) -> None:
        self._cache.clear()
        self.prefetched.clear()


class FP8Module(nn.Module):
    """Base of modules with FP8 GEMMs: owns ``fp8_state`` (a :class:`ScalingState`) and the weight cache.

    Subclasses call :meth:`fp8_begin` at the top of ``forward``; it returns None outside FP8 regions.
    """

    def __init__(self, roles: Sequence[str], gemm_dims: Sequence[tuple[int, int]], device=None):
        super().__init__()
        self.fp8_state = ScalingState(roles, device=device)
        self._gemm_dims = tuple(gemm_dims)
        self._fp8_dims_checked = False
        self._weight_cache = FP8WeightCache()

    def fp8_begin(self) -> Optional[FP8Plan]:
        ctx = get_fp8_context()
        if ctx is None:
            return None
        if not self._fp8_dims_checked:
            for k, n in self._gemm_dims:
                check_gemm_dims(k, n, type(self).__name__)
            self._fp8_dims_checked = True
        return begin_fp8(self.fp8_state, ctx)

    def fp8_weight(self, name: str, weight: torch.Tensor, role: str, plan: FP8Plan,
                   is_first_microbatch: Optional[bool]) -> Float8Tensor:
        # dgrad needs W^T whenever a backward may run (the input may require grad even if W does not).
        return self._weight_cache.get(name, weight, self.fp8_state, self.fp8_state.index(role), plan,
                                      is_first_microbatch, transpose=torch.is_grad_enabled())

    def fp8_weight_entries(self) -> list[tuple[str, torch.Tensor, str]]:
        """``(cache name, weight, role)`` of each weight the FP8 forward passes to :meth:`fp8_weight`, for
        :func:`prefetch_fp8_weights`; ``[]`` (the default): the module casts its weights itself."""
        return []


@contextlib.contextmanager
def prefetch_fp8_weights(modules: Sequence[FP8Module], is_first_microbatch: Optional[bool]) -> Iterator[None]:
    """Cast the FP8 weights of ``modules`` in one launch, then run the ``with`` block (their forwards), whose
    :meth:`FP8Module.fp8_weight` calls take those copies instead of casting one weight at a time.

    Same bits, scale_inv and recorded amaxes as the per-module casts (``cast_weights``); the GPU gets the weights'
    casts at the start of the block, and the host issues one launch instead of one per weight. Nothing is
    prefetched outside an FP8 region, with ``is_first_microbatch=False`` (cached copies are reused), without
    autograd (no transposed copies needed), or where ``cast_weights`` does not apply; copies not taken by the end
    of the block are dropped.
    """
    caches = []
    try:
        if get_fp8_context() is not None and is_first_microbatch is not False and torch.is_grad_enabled():
            caches = _prefetch(modules)
        yield
    finally:
        for cache in caches:
            cache.prefetched.clear()


def _prefetch(modules: Sequence[FP8Module]) -> list[FP8WeightCache]:
    entries, plan = [], None
    for m in modules:
        # a weight an enclosing prefetch (e.g. TransformerLayer's around MultiheadAttention's) already cast is skipped
        wanted = [(name, w, role) for name, w, role in m.fp8_weight_entries() if name not in m._weight_cache.prefetched]
        if wanted:
            plan = m.fp8_begin()
            entries += [(m, name, w, m.fp8_state.index(role)) for name, w, role in wanted]
    if plan is None:
        return []
    fp8 = cast_weights([w for _, _, w, _ in entries], [(m.fp8_state, row) for m, _, _, row in entries], plan)
    if fp8 is None:
        return []
    for (m, name, _, _), w_fp8 in zip(entries, fp8):
        m._weight_cache.prefetched[name] = w_fp8
    return [m._weight_cache for m, _, _, _ in entries]


def fp8_submodules(module: nn.Module) -> list[FP8Module]:
    """The :class:`FP8Module` s inside ``module`` (itself included), in registration order; computed once per module
    (for :func:`prefetch_fp8_weights` in its forward)."""
    found = module.__dict__.get("_fp8_submodules")
    if found is None:
        found = module.__dict__["_fp8_submodules"] = [m for m in module.modules() if isinstance(m, FP8Module)]
    return found
