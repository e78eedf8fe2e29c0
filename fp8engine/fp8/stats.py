"""FP8 health report: how well each FP8 tensor role fits its format (amax, scale, underflow %, saturation %).

Usage::

    with fp8engine.fp8_stats_recording(model):          # zeroes the counters, switches counting on
        with fp8engine.autocast():
            loss = model(x, y)
        loss.backward()                                  # backward casts of this forward are counted too
    print(fp8engine.format_fp8_stats(fp8engine.fp8_stats(model)))   # one host read of all counters

Where the counting happens: every :class:`~fp8engine.fp8.quantizer.Quantizer` built while its
:class:`~fp8engine.fp8.state.ScalingState` records carries a :class:`RoleStats` (``Quantizer.stats``); each cast it
makes adds its counts into small device tensors of that state (:class:`StatsCounters`) with device ops only, read
once by :func:`fp8_stats`. When recording is off, ``Quantizer.stats`` is None: a cast pays one attribute check.

Fused paths that never materialise the high-precision tensor (the norm and activation kernels writing FP8 only,
cuBLASLt's GELU epilogue, the fused QKV-gradient cast) take their unfused equivalent while recording, whose FP8 bits
can differ in the last place (the fused kernel casts the fp32 value, the unfused path its rounding to the
activation dtype), on recording steps only.

Definitions, for the casts counted since the last :func:`fp8_stats_recording` entry (``x`` the high-precision
tensor, ``scale`` the scale the cast used, ``q`` the FP8 result; one row per role):

- ``amax``: ``max |x|`` over the counted casts (the range the tensor really had on those steps).
- ``scale``: the scale the last counted cast used (multiply by it to enter the FP8 range): delayed scaling, the
  state's ``scale`` row during the step; current scaling, ``fp8_max / max |x|`` of that cast.
- ``underflow_pct``: ``100 * #{x != 0 and q == ±0} / #{x != 0}``: nonzero values flushed to zero, relative to the
  nonzero values (0 when there are none). TransformerEngine's ``underflows%`` (``LogFp8TensorStats``,
  ``transformer_engine/debug/features/utils/stats_computation.py``) is ``#{q == 0} / numel`` and so also counts
  values that were exactly zero before the cast (ReLU outputs, padding); this one counts only lost values.
- ``saturation_pct``: ``100 * #{values the saturating clamp changed} / numel``: values whose ``|x * scale|``
  (float32, as the cast computes it) would have rounded, with the format's mantissa and an unbounded exponent, to
  a magnitude above ``fp8_max``, i.e. ``|x * scale| > 464`` for E4M3 (448 plus half its top spacing 32; a tie
  rounds to 448, whose mantissa is even) and ``>= 61440`` for E5M2 (57344 + 8192 / 2; a tie rounds up to the
  even 65536). TransformerEngine's ``fp8_delayed_scaling_overflows%`` counts ``|x| > fp8_max * scale_inv``
  instead, which also counts values the clamp moves by less than the format's own rounding (under current
  scaling, the amax element whenever ``fp8_max / amax`` rounds up: about one amax in five).

Scope: one process's casts (rank 0's in the training command; a tensor-parallel rank sees its own shards). Not
counted: casts in a ``torch.compile``-d region, FP8 weight copies reused from the weight cache
(``is_first_microbatch=False``), and forward roles in regions that record no amaxes (``FP8Context.record_amax``
False: activation-checkpoint recomputes, which would count them twice, and the training command's evaluation
forwards). A role with no counted cast has ``amax``, ``underflow_pct``, ``saturation_pct`` and ``format`` None and
the state's current ``scale`` buffer.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, NamedTuple, Optional

import torch
from torch import nn

from fp8engine.fp8.dtypes import FP8_DTYPES
from fp8engine.fp8.state import ScalingState

__all__ = ["fp8_stats", "fp8_stats_recording", "format_fp8_stats", "FP8StatsRow", "RoleStats", "StatsCounters",
           "SATURATION_BOUND"]

#: Smallest float32 ``|x * scale|`` whose FP8 value the cast's clamp changes (module docstring). E4M3: the next
#: float32 above 464 (float32 spacing at 464 is 2**-15); E5M2: 61440 itself.
SATURATION_BOUND = {torch.float8_e4m3fn: 464.0 + 2.0 ** -15, torch.float8_e5m2: 61440.0}

_FORMAT_NAME = {dt: name for name, dt in FP8_DTYPES.items()}

# columns of StatsCounters.counts / .ranges
_NONZERO, _UNDERFLOW, _SATURATED, _NUMEL, _CASTS = range(5)
_AMAX, _SCALE = range(2)


class FP8StatsRow(NamedTuple):
    """One FP8 tensor role of one module (definitions: module docstring).

    Fields: ``module`` (qualified name of the module owning the scaling state, ``""`` for the root), ``role``
    (e.g. ``"fc1_grad_output"``), ``format`` (``"e4m3"`` / ``"e5m2"``), ``amax`` (high-precision units),
    ``scale`` (float32 value; multiply by it to enter the FP8 range), ``underflow_pct`` and ``saturation_pct``
    (percent, 0 to 100). ``row._asdict()`` is the JSON object the training command writes.
    """

    module: str
    role: str
    format: Optional[str]
    amax: Optional[float]
    scale: float
    underflow_pct: Optional[float]
    saturation_pct: Optional[float]


class RoleStats:
    """The counters of one role: views into its state's :class:`StatsCounters` row, and the cast's format.

    Attributes:
        counts: ``[5]`` int64 view (nonzero, underflowed, saturated, elements, casts).
        ranges: ``[2]`` float32 view (amax, last scale).
        bound: :data:`SATURATION_BOUND` of the format.
    """

    __slots__ = ("counts", "ranges", "bound")

    def __init__(self, counts: torch.Tensor, ranges: torch.Tensor, fp8_dtype: torch.dtype):
        self.counts, self.ranges, self.bound = counts, ranges, SATURATION_BOUND[fp8_dtype]

    @torch.no_grad()
    def record(self, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
        """Add one cast: ``x`` the high-precision input (any shape, float32/bf16/fp16), ``data`` its FP8 bits (same
        number of elements, row-major), ``scale`` the ``[1]`` float32 scale used. Device ops only (~15 small
        launches on CUDA, no host synchronisation)."""
        x = x.detach().reshape(-1)
        nonzero = x != 0
        flushed = data.reshape(-1).view(torch.uint8).bitwise_and(0x7F).eq(0)  # +0 and -0 in both formats
        # x (any float dtype) times the [1] float32 scale is computed in float32, the product the cast clamps
        clamped = torch.mul(x, scale.reshape(1)).abs_().ge(self.bound)
        self.counts[:_NUMEL].add_(torch.stack([nonzero.sum(), nonzero.logical_and_(flushed).sum(), clamped.sum()]))
        self.counts[_NUMEL].add_(x.numel())
        self.counts[_CASTS].add_(1)
        amax = self.ranges[_AMAX:_AMAX + 1]
        torch.maximum(amax, x.abs().amax().float().reshape(1), out=amax)
        self.ranges[_SCALE:_SCALE + 1].copy_(scale.reshape(1))


class StatsCounters:
    """The device counters of one :class:`ScalingState` (``state.stats_counters``).

    Attributes:
        counts: ``[n, 5]`` int64 per role: nonzero inputs, underflowed (nonzero -> ±0), saturated, elements, casts.
        ranges: ``[n, 2]`` float32 per role: amax (max-accumulated), scale of the last cast.
        formats: per role, the FP8 dtype of its quantizer when it was built under recording (None before).
    """

    def __init__(self, n: int, device: torch.device):
        self.counts = torch.zeros(n, 5, dtype=torch.int64, device=device)
        self.ranges = torch.zeros(n, 2, dtype=torch.float32, device=device)
        self.formats: list[Optional[torch.dtype]] = [None] * n

    def role(self, row: int, fp8_dtype: torch.dtype) -> RoleStats:
        """The :class:`RoleStats` of ``row`` cast to ``fp8_dtype`` (called when a quantizer is built)."""
        self.formats[row] = fp8_dtype
        return RoleStats(self.counts[row], self.ranges[row], fp8_dtype)

    def zero(self) -> None:
        """Start a new count (``formats`` stay: cached quantizers keep their RoleStats and format)."""
        self.counts.zero_()
        self.ranges.zero_()


def _states(model: nn.Module) -> Iterator[tuple[str, ScalingState]]:
    """``(owner name, state)`` for every ScalingState in ``model`` (``model`` itself included), module order."""
    for name, module in model.named_modules():
        if isinstance(module, ScalingState):
            yield name.rpartition(".")[0], module


def _set_recording(state: ScalingState, on: bool) -> None:
    """Switch ``state``'s quantizer cache to the set with (or without) RoleStats: each mode keeps its own cache,
    so after the first recording block a switch rebuilds nothing."""
    if state.stats_recording != on:
        state.stats_recording = on
        state._quantizers, state._other_quantizers = state._other_quantizers, state._quantizers


@contextlib.contextmanager
def fp8_stats_recording(model: nn.Module, enabled: bool = True):
    """Count underflow / saturation of every FP8 cast of ``model``'s modules inside the block.

    At entry each ScalingState of ``model`` gets zeroed device counters (allocated on the state's device on first
    use) and records; at exit recording stops, the counts stay until the next entry and are read by
    :func:`fp8_stats`. Quantizers are built per forward, so what counts is where the *forward* ran: the backward
    casts (grad_output roles) of a forward run inside the block are counted even when ``backward()`` is called
    after it. ``enabled=False`` is a no-op block (the caller's switch). Nothing is synchronised with the host.
    Blocks do not nest (an inner entry zeroes the counts, an inner exit stops the recording). Work replayed from a
    CUDA graph captured outside the block (``make_graphed_callables``, the training command's ``CUDAGraphStep``)
    runs no Python and counts nothing: its rows stay "not counted" (None); run such steps eagerly to record them.

    Raises:
        ValueError: ``model`` holds no FP8 scaling state (no fp8engine FP8 module).
    """
    if not enabled:
        yield
        return
    states = [st for _, st in _states(model)]
    if not states:
        raise ValueError(f"fp8_stats_recording: {type(model).__name__} has no FP8 modules (no ScalingState); "
                         "convert it with fp8engine.convert_to_fp8 or build it from fp8engine modules")
    for st in states:
        c = st.stats_counters
        if c is None or c.counts.device != st.scale.device or c.counts.shape[0] != len(st.roles):
            st.stats_counters = StatsCounters(len(st.roles), st.scale.device)
            if not st.stats_recording:
                st._other_quantizers.clear()  # their RoleStats view the old counters
        else:
            c.zero()
        _set_recording(st, True)
    try:
        yield
    finally:
        for st in states:
            _set_recording(st, False)


def fp8_stats(model: nn.Module) -> list[FP8StatsRow]:
    """One :class:`FP8StatsRow` per FP8 tensor role of every module of ``model`` (module order, then role order),
    from the casts counted in the last :func:`fp8_stats_recording` block (definitions: module docstring).

    Reads every state's counters and scales in one device-to-host copy (one synchronisation); call it after the
    step, not inside the hot loop. Raises ValueError when ``model`` holds no FP8 scaling state.
    """
    found = list(_states(model))
    if not found:
        raise ValueError(f"fp8_stats: {type(model).__name__} has no FP8 modules (no ScalingState)")
    counters = [st.stats_counters or StatsCounters(len(st.roles), st.scale.device) for _, st in found]
    packed = []
    for (_, st), c in zip(found, counters):
        dev = st.scale.device  # the counters stay where they were made; the state may have moved since
        packed.append(torch.cat([c.counts.to(dev, torch.float64), c.ranges.to(dev, torch.float64),
                                 st.scale.detach().double()[:, None]], 1))
    table = torch.cat([p.to(packed[0].device) for p in packed]).cpu().tolist()  # the only host read
    rows, i = [], 0
    for (name, st), c in zip(found, counters):
        for r, role in enumerate(st.roles):
            nonzero, under, sat, numel, casts, amax, last_scale, buffer_scale = table[i]
            i += 1
            if casts == 0:
                rows.append(FP8StatsRow(name, role, None, None, buffer_scale, None, None))
                continue
            rows.append(FP8StatsRow(name, role, _FORMAT_NAME.get(c.formats[r]), amax, last_scale,
                                    100.0 * under / nonzero if nonzero else 0.0, 100.0 * sat / numel))
    return rows


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def format_fp8_stats(rows: list[FP8StatsRow]) -> str:
    """``rows`` as a fixed-width text table (one line per row, a header, ``-`` for values not recorded)."""
    header = ("module", "role", "format", "amax", "scale", "underflow %", "saturation %")
    body = [(r.module or "(model)", r.role, r.format or "-", _fmt(r.amax, ".4g"), _fmt(r.scale, ".4g"),
             _fmt(r.underflow_pct, ".4f"), _fmt(r.saturation_pct, ".4f")) for r in rows]
    widths = [max(len(line[k]) for line in [header, *body]) for k in range(len(header))]
    lines = []
    for line in [header, *body]:
        left = [line[k].ljust(widths[k]) for k in range(3)]
        right = [line[k].rjust(widths[k]) for k in range(3, len(header))]
        lines.append("  ".join(left + right).rstrip())
    return "\n".join(lines)
