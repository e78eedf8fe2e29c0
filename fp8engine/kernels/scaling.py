"""Delayed-scaling update for many FP8 tensors in one launch: new scales from amax histories, then roll histories.

For every row r of every (history [n_i, L], scale [n_i], fp8_max [n_i]) triple, in place:
    amax  = max(history[r, :])            (algo "max";  NaN anywhere in the row makes amax NaN)
          = history[r, 0]                 (algo "most_recent")
    sf    = (fp8_max[r] / amax) / 2**margin                  (IEEE fp32 divisions, as torch)
    scale[r] = sf  if update_scale and 0 < amax < inf (amax finite) and sf finite,  else unchanged
    history[r, :] = [history[r, 1], ..., history[r, L-1], history[r, 0]]  then history[r, 0] = 0
Formula after TransformerEngine's delayed scaling (``_default_sf_compute``); the "sf finite" guard is ours: an amax
so small that fp8_max/amax overflows (e.g. a denormal amax) keeps the old scale instead of writing inf.
Direction: the scale multiplies high-precision values into the FP8 range. scale_inv is not touched: it belongs to
the FP8 data and is written by the kernel that writes the bits.

One launch for all tensors: the launcher packs the data_ptr()s of the histories / scales / fp8_maxes into int64
device tensors; the kernel turns them back into pointers with ``.to(tl.pointer_type(tl.float32))``; one program per
row. All histories must share L. ``update_scale`` is a Python bool or a 0-d / 1-element bool tensor on the device
(read by the kernel, so no host sync). The pointer tables are built once per set of buffers (a small host-to-device
copy) and cached; ``update_steps`` (the states' int64 update counters) are incremented by the same launch.
:class:`DelayedScalingUpdate` holds one set of tensors checked and planned once.
"""

from __future__ import annotations

import itertools

import torch

from ._common import check_launchable, launch, next_power_of_2, tl, triton

__all__ = ["delayed_scaling_update", "delayed_scaling_update_reference", "DelayedScalingUpdate"]

_ALGOS = ("max", "most_recent")


@triton.jit
def _delayed_scaling_kernel(
    hist_ptrs,  # [T] int64: data_ptr of each fp32 amax history [n_i, L] (row-major, contiguous)
    scale_ptrs,  # [T] int64: data_ptr of each fp32 scale [n_i], updated in place
    max_ptrs,  # [T] int64: data_ptr of each fp32 fp8_max [n_i]
    row_ends,  # [T] int32: cumulative row counts (row_ends[t] = n_0 + ... + n_t)
    flag_ptr,  # [1] bool update_scale (only if FLAG_FROM_TENSOR)
    step_ptrs,  # [T] int64: data_ptr of each int64 update counter [] (only if COUNT)
    T,
    L,
    pow2_margin,  # fp32 2**margin
    MOST_RECENT: tl.constexpr,
    UPDATE: tl.constexpr,  # False: never update scales (Python update_scale=False)
    FLAG_FROM_TENSOR: tl.constexpr,
    COUNT: tl.constexpr,  # add 1 to each tensor's update counter (its row 0's program)
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    pid = tl.program_id(0)
    ts = tl.arange(0, BLOCK_T)
    ends = tl.load(row_ends + ts, mask=ts < T, other=2147483647)
    t = tl.sum((ends <= pid).to(tl.int32), axis=0)  # tensor index of this row
    row = pid - (tl.sum(tl.where(ts == t - 1, ends, 0), axis=0))  # row within tensor t
    hist = tl.load(hist_ptrs + t).to(tl.pointer_type(tl.float32)) + row.to(tl.int64) * L
    offs = tl.arange(0, BLOCK_L)
    lmask = offs < L
    h = tl.load(hist + offs, mask=lmask, other=0.0)
    rolled = tl.load(hist + (offs + 1) % L, mask=lmask, other=0.0)  # new[i] = old[i + 1], new[L-1] = old[0]
    if UPDATE:
        scale_p = tl.load(scale_ptrs + t).to(tl.pointer_type(tl.float32)) + row
        fp8_max = tl.load(tl.load(max_ptrs + t).to(tl.pointer_type(tl.float32)) + row)
        old = tl.load(scale_p)
        if MOST_RECENT:
            amax = tl.sum(tl.where(offs == 0, h, 0.0), axis=0)
        else:
            has_nan = tl.max((h != h).to(tl.int32), axis=0) > 0
            amax = tl.max(tl.where(lmask, h, float("-inf")), axis=0)
            amax = tl.where(has_nan, float("nan"), amax)
        sf = tl.math.div_rn(tl.math.div_rn(fp8_max, amax), pow2_margin)
        ok = (amax > 0.0) & (amax < float("inf")) & (tl.abs(sf) < float("inf"))
        if FLAG_FROM_TENSOR:
            ok = ok & (tl.load(flag_ptr).to(tl.int32) != 0)
        tl.store(scale_p, tl.where(ok, sf, old))
    # every lane has read the row before any lane overwrites it (bar.sync orders memory within the program)
    tl.debug_barrier()
    tl.store(hist + offs, tl.where(offs == 0, 0.0, rolled), mask=lmask)
    if COUNT:
        if row == 0:
            step = tl.load(step_ptrs + t).to(tl.pointer_type(tl.int64))
            tl.store(step, tl.load(step) + 1)


def _check(amax_histories, scales, fp8_maxes, algo, update_scale, op, update_steps=None):
    if algo not in _ALGOS:
        raise ValueError(f"{op}: algo must be one of {_ALGOS}, got {algo!r}")
    if not (len(amax_histories) == len(scales) == len(fp8_maxes)) or not amax_histories:
        raise ValueError(f"{op}: need equally long, non-empty lists of amax_histories, scales and fp8_maxes")
    lengths = {h.shape[-1] if h.dim() == 2 else None for h in amax_histories}
    if len(lengths) != 1 or None in lengths:
        raise ValueError(f"{op}: every amax history must be 2-D [n_i, L] with the same L; got lengths {lengths}")
    device = amax_histories[0].device
    for i, (h, s, fm) in enumerate(zip(amax_histories, scales, fp8_maxes)):
        for name, t in (("amax_histories", h), ("scales", s), ("fp8_maxes", fm)):
            if t.dtype != torch.float32:
                raise TypeError(f"{op}: {name}[{i}] has dtype {t.dtype}; only float32 is supported")
            if not t.is_contiguous():
                raise ValueError(f"{op}: {name}[{i}] must be contiguous; call .contiguous() first")
            if t.device != device:
                raise ValueError(f"{op}: {name}[{i}] is on {t.device}, {name}[0] on {device}")
        if s.shape != (h.shape[0],) or fm.shape != (h.shape[0],):
            raise ValueError(f"{op}: scales[{i}] and fp8_maxes[{i}] must have shape ({h.shape[0]},) like its history")
    if update_steps is not None:
        if len(update_steps) != len(amax_histories):
            raise ValueError(f"{op}: need one update_steps counter per amax history")
        for i, c in enumerate(update_steps):
            if c.dtype != torch.int64 or c.numel() != 1 or c.device != device:
                raise TypeError(f"{op}: update_steps[{i}] must be a 1-element int64 tensor on {device}")
    if isinstance(update_scale, torch.Tensor):
        if update_scale.dtype != torch.bool or update_scale.numel() != 1 or update_scale.device != device:
            raise TypeError(f"{op}: update_scale tensor must be a 1-element bool tensor on {device}")
    return lengths.pop()


#: Device pointer tables by the addresses they hold. Building them costs a host-to-device copy that waits for the
#: stream to drain (it would stall the CPU once per step), so they are built once per set of buffers and reused.
#: Bounded: a training loop touches one set (or a few, with several models).
_POINTER_TABLES: dict = {}
_POINTER_TABLES_MAX = 64


def _pointer_tables(amax_histories, scales, fp8_maxes, rows, device, update_steps=None):
    key = (device, tuple(t.data_ptr() for t in amax_histories), tuple(t.data_ptr() for t in scales),
           tuple(t.data_ptr() for t in fp8_maxes),
           None if update_steps is None else tuple(t.data_ptr() for t in update_steps), tuple(rows))
    tables = _POINTER_TABLES.get(key)
    if tables is None:
        if len(_POINTER_TABLES) >= _POINTER_TABLES_MAX:
            _POINTER_TABLES.clear()
        host = [torch.tensor(list(k), dtype=torch.int64) for k in key[1:4]]
        host.append(torch.tensor(list(itertools.accumulate(rows)), dtype=torch.int32))
        host.append(torch.tensor(list(key[4] or (0,)), dtype=torch.int64))
        tables = _POINTER_TABLES[key] = tuple(t.to(device) for t in host)
    return tables


def delayed_scaling_update(amax_histories, scales, fp8_maxes, *, margin, algo="max", update_scale=True,
                           update_steps=None):
    """Update ``scales`` from ``amax_histories`` and roll the histories, in place, in one launch.

    Args:
        amax_histories: list of fp32 contiguous [n_i, L] tensors (same L), column 0 = the newest amax.
        scales: list of fp32 [n_i] tensors, updated in place. fp8_maxes: list of fp32 [n_i] (448. / 57344.).
        margin: float; sf = (fp8_max / amax) / 2**margin. algo: "max" or "most_recent".
        update_scale: bool, or a 1-element bool tensor on the device (False -> only roll the histories).
        update_steps: None, or one 1-element int64 counter per history (``ScalingState.update_step``), each
            incremented by one in the same launch.
    Returns None. Raises ValueError / TypeError describing unsupported inputs (see the module docstring).
    """
    DelayedScalingUpdate(amax_histories, scales, fp8_maxes, margin=margin, algo=algo, update_steps=update_steps)(
        update_scale)


class DelayedScalingUpdate:
    """:func:`delayed_scaling_update` for one fixed set of tensors, checked and planned once: calling it costs the
    launch alone (what the delayed-scaling update at every ``fp8engine.autocast`` exit calls, cached by
    ``fp8engine.fp8.state.reduce_and_update`` per set of scaling-state buffers). Same arguments as the function
    (``update_steps`` included), held by reference: the update reads and writes those tensors on each call.
    ``__call__(update_scale=True)``. Raises as the function does: about the tensors at construction, about an
    ``update_scale`` tensor at the call."""

    def __init__(self, amax_histories, scales, fp8_maxes, *, margin, algo="max", update_steps=None):
        op = "DelayedScalingUpdate"
        L = _check(amax_histories, scales, fp8_maxes, algo, True, op, update_steps)
        check_launchable(amax_histories[0], op)
        self.tensors = (list(amax_histories), list(scales), list(fp8_maxes), update_steps)  # (kept alive)
        rows = [h.shape[0] for h in amax_histories]
        self.n_rows, self.L = sum(rows), L
        if self.n_rows == 0 or L == 0:
            return
        self.tables = _pointer_tables(amax_histories, scales, fp8_maxes, rows, amax_histories[0].device,
                                      update_steps)
        n_t = len(rows)
        self.meta = dict(MOST_RECENT=algo == "most_recent", COUNT=update_steps is not None,
                         BLOCK_T=next_power_of_2(n_t), BLOCK_L=next_power_of_2(L), num_warps=1 if L <= 256 else 4)
        self.n_t, self.pow2_margin = n_t, float(2.0**margin)

    def __call__(self, update_scale=True) -> None:
        flag_tensor = isinstance(update_scale, torch.Tensor)
        if flag_tensor:
            device = self.tensors[0][0].device
            if update_scale.dtype != torch.bool or update_scale.numel() != 1 or update_scale.device != device:
                raise TypeError(f"delayed_scaling_update: update_scale tensor must be a 1-element bool tensor on "
                                f"{device}")
        if self.n_rows == 0 or self.L == 0:
            if self.tensors[3] is not None:
                torch._foreach_add_(list(self.tensors[3]), 1)
            return
        hist_ptrs, scale_ptrs, max_ptrs, ends, step_ptrs = self.tables
        launch(_delayed_scaling_kernel, (self.n_rows,),
            hist_ptrs, scale_ptrs, max_ptrs, ends,
            update_scale.reshape(1) if flag_tensor else ends, step_ptrs, self.n_t, self.L, self.pow2_margin,
            UPDATE=flag_tensor or bool(update_scale), FLAG_FROM_TENSOR=flag_tensor, **self.meta,
        )  # fmt: skip


def delayed_scaling_update_reference(amax_histories, scales, fp8_maxes, *, margin, algo="max", update_scale=True,
                                     update_steps=None):
    """Plain-PyTorch ``delayed_scaling_update`` (same in-place results, one small op group per tensor)."""
    _check(amax_histories, scales, fp8_maxes, algo, update_scale, "delayed_scaling_update_reference", update_steps)
    for c in update_steps or ():
        c.add_(1)
    for h, s, fm in zip(amax_histories, scales, fp8_maxes):
        if h.numel() == 0:
            continue
        amax = h[:, 0] if algo == "most_recent" else h.amax(dim=1)
        # tensor / tensor: a Python-scalar divisor would be turned into a reciprocal multiply on CUDA
        sf = (fm / amax) / torch.tensor(2.0**margin, dtype=torch.float32, device=h.device)
        ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(sf)
        if isinstance(update_scale, torch.Tensor):
            ok = ok & update_scale.reshape(())
        elif not update_scale:
            ok = torch.zeros_like(ok)
        s.copy_(torch.where(ok, sf, s))
        rolled = torch.roll(h, shifts=-1, dims=1)
        rolled[:, 0] = 0.0
        h.copy_(rolled)
