"""The cache of recorded programs (:class:`ProgramCache`) and the check of a replay against the ordinary code
(:class:`Checked`, ``FP8ENGINE_REPLAY=check``), for the recorder and replayer of :mod:`fp8engine.ops.replay` (whose
module docstring says what a recording enforces).

A configuration whose recording was refused keeps its reason (a str) in the cache and runs the ordinary code, not
re-recorded at every call. The layer step's cache is module-level (``fp8engine.ops.layer._PROGRAMS``).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch

from fp8engine.ops.replay import Pair

__all__ = ["CHECK", "ProgramCache", "Checked", "ReplayMismatch", "MAX_PROGRAMS", "MISS_BUDGET", "MAX_RECORDINGS"]

#: ``FP8ENGINE_REPLAY=check`` (read at import): a cache stores each recorded :class:`Pair` as a :class:`Checked`.
CHECK = os.environ.get("FP8ENGINE_REPLAY", "1") == "check"
#: Configurations a :class:`ProgramCache` keeps (least recently used out first). A steady training run has a
#: handful; a program holds no tensor (the recorder refuses those it neither takes nor makes), only its generated
#: source (10-15 KB for the layer step's forward and backward on CPU), code and constants, so 256 of them hold a
#: few MiB of host memory.
MAX_PROGRAMS = 256
#: Recordings at a configuration's first call a :class:`ProgramCache` makes before it records a configuration only
#: at its second call. A recording costs host time (the recorder's mode around every torch call, the program's
#: generation), paid back only where the configuration comes again, and a run whose shapes keep changing sees most
#: configurations once: issue 44 measured such a run 4.2x slower with the replay on (CPU); on the H100 machine's
#: CPU, 40 steps of new lengths (the layer at H=64, FFN=128, 4 heads, batch 2, lengths 56..95) took 2.91 s with the
#: replay off, 3.76 s with every length recorded and 2.98 s with this budget. 8 is twice what a run of one model
#: makes (with and without the FP8 weight casts, the first layer's input with and without grad).
MISS_BUDGET = 8
#: Recordings started per configuration before it is given up (a forward whose backward never runs leaves it
#: unrecorded).
MAX_RECORDINGS = 3


class ProgramCache:
    """Recorded programs by configuration key (module docstring): at most ``size`` (``MAX_PROGRAMS``), least
    recently used out first, ``miss_budget`` recordings at a configuration's first call (``MISS_BUDGET``),
    ``attempts`` recordings started per configuration before it is given up (``MAX_RECORDINGS``); ValueError for a
    size or attempts below 1 or a negative budget.

    ``get(key)`` -> the program (a :class:`Pair`, or a :class:`Checked` under ``CHECK``), a str (why the
    configuration is not replayed), an int (recordings started, none finished), or None (not seen); the caller
    replays a program and calls ``move_to_end(key)`` (both the ``OrderedDict``'s own methods: the replay's hot
    path), else asks :meth:`start` whether to record this call, and stores what the recording gave with
    ``cache[key] = program_or_reason``. ``recordings`` counts the recordings started, ``misses`` those at a
    configuration's first call.
    """

    def __init__(self, size: int = MAX_PROGRAMS, miss_budget: int = MISS_BUDGET, attempts: int = MAX_RECORDINGS):
        if size < 1 or miss_budget < 0 or attempts < 1:
            raise ValueError(f"ProgramCache(size={size}, miss_budget={miss_budget}, attempts={attempts}): size and "
                             "attempts must be at least 1, miss_budget at least 0")
        self.size, self.miss_budget, self.attempts = size, miss_budget, attempts
        self._entries: OrderedDict = OrderedDict()  # key -> program / reason (str) / recordings started (int)
        self._seen: OrderedDict = OrderedDict()  # keys called once and not recorded (the budget spent), bounded
        self.get, self.move_to_end = self._entries.get, self._entries.move_to_end
        self.keys, self.values, self.items = self._entries.keys, self._entries.values, self._entries.items
        self.recordings = self.misses = 0

    def start(self, key) -> bool:
        """Whether to record this call of ``key``'s configuration (counted); False: run the ordinary code (the
        configuration is refused or given up, or seen for the first time with the miss budget spent)."""
        state = self._entries.get(key, 0)
        if type(state) is not int or state >= self.attempts:
            if key in self._entries:
                self._entries.move_to_end(key)
            return False
        if state == 0:
            if key in self._seen:
                del self._seen[key]  # its second call: recorded
            elif self.misses >= self.miss_budget:
                self._seen[key] = None
                if len(self._seen) > self.size:
                    self._seen.popitem(last=False)
                return False
            else:
                self.misses += 1
        self[key] = state + 1
        self.recordings += 1
        return True

    def __setitem__(self, key, value) -> None:
        """Store a configuration's program (``CHECK``: as a :class:`Checked`), the reason it is not replayed (a
        str), or its recordings started (an int); the least recently used entries beyond ``size`` go."""
        if CHECK and type(value) is Pair:
            value = Checked(value)
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __getitem__(self, key):
        return self._entries[key]

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(self._entries)

    def clear(self) -> None:
        """Forget every configuration and reset the budget and the counts."""
        self._entries.clear()
        self._seen.clear()
        self.recordings = self.misses = 0


class ReplayMismatch(RuntimeError):
    """``FP8ENGINE_REPLAY=check``: a replay gave other bits than the ordinary code (:class:`Checked`)."""


class Checked:
    """A :class:`Pair` run beside the ordinary code it was recorded from (``FP8ENGINE_REPLAY=check``): each call
    runs both from the same state and raises :class:`ReplayMismatch`, naming the first output or written tensor
    whose bits differ (dtype, shape, strides and every byte), else returns the ordinary code's results.

    ``forward(inputs, eager, eager_backward)`` -> ``(outputs, (backward, saved))``: ``eager()`` runs the ordinary
    forward and returns what the pair's forward returns (its outputs); ``eager_backward(*backward_inputs)`` runs
    the ordinary backward. The second result takes the place of ``(pair, saved)``: ``backward.backward(inputs,
    saved)`` checks the backward as the forward. The tensors a step may write are its inputs (a tensor the recording
    does not know aborts it; for the backward, the forward's inputs then its own, numbered so in the error),
    compared after the replay and after the ordinary code, each run from the inputs as they were (the other's
    writes undone).

    Slow (both run, and every input is copied): for tests and for hunting a key that misses something. An op whose
    bits vary from run to run (on CUDA, an attention backward that accumulates with atomics) can differ between any
    two runs, replayed or not: check with ``torch.use_deterministic_algorithms(True)`` where that shows."""

    def __init__(self, pair: Pair):
        self.pair = pair

    def forward(self, inputs: Sequence, eager: Callable, eager_backward: Callable):
        # the replay first, then the inputs as they were, the ordinary code last: what the ordinary forward saves
        # for its backward is not written afterwards (autograd's in-place check)
        before = _snapshot(inputs)
        got, saved = self.pair.forward(inputs)
        written = _snapshot(inputs)
        _restore(inputs, before)
        want = eager()
        _compare("forward", got, want, inputs, written)
        return want, (_CheckedBackward(self.pair, list(inputs), eager_backward), saved)


class _CheckedBackward:
    """The backward half of a :class:`Checked` call: ``backward(inputs, saved)`` as :meth:`Pair.backward`."""

    def __init__(self, pair: Pair, fwd_inputs: list, eager: Callable):
        self.pair, self.fwd_inputs, self.eager = pair, fwd_inputs, eager

    def backward(self, inputs: Sequence, saved: list):
        tensors = [*self.fwd_inputs, *inputs]  # the backward may write the forward's inputs (scaling state)
        before = _snapshot(tensors)
        # the ordinary code first (it reads what its forward saved before anything else writes), then the replay
        # from the same state; the ordinary code's state is kept
        want = self.eager(*inputs)
        after = _snapshot(tensors)
        _restore(tensors, before)
        got = self.pair.backward(inputs, saved)
        written = _snapshot(tensors)
        _restore(tensors, after)
        _compare("backward", got, want, tensors, written)
        return want


def _snapshot(tensors: Sequence) -> list:
    return [t.detach().clone() if isinstance(t, torch.Tensor) else None for t in tensors]


def _restore(tensors: Sequence, snapshot: list) -> None:
    """Write ``snapshot``'s values back into the tensors whose bits differ from it (only those: the others keep
    their version counters)."""
    with torch.no_grad():
        for t, s in zip(tensors, snapshot):
            if s is not None and _differs(t, s, layout=False) is not None:
                t.copy_(s)


def _differs(a, b, layout: bool = True) -> Optional[str]:
    """How ``a`` and ``b`` differ (the replay's, the ordinary code's), or None: the same bits. Tensors: dtype,
    shape, strides (``layout``: the two are different tensors; not between a tensor and its copy) and bytes;
    anything else by ``==``."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            return f"{type(a).__name__} {a!r:.60} against {type(b).__name__} {b!r:.60}"
        return None
    if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
        return f"{a.dtype} {tuple(a.shape)} on {a.device} against {b.dtype} {tuple(b.shape)} on {b.device}"
    if layout and a.stride() != b.stride() and a.numel() > 1:
        return f"strides {a.stride()} against {b.stride()}"
    if a.numel() == 0:
        return None
    bits_a, bits_b = (t.detach().contiguous().reshape(-1).view(torch.uint8).reshape(t.numel(), -1) for t in (a, b))
    diff = (bits_a != bits_b).any(dim=1)
    if not diff.any():
        return None
    n, first = int(diff.sum()), int(diff.nonzero()[0, 0])
    return (f"{n} of {a.numel()} elements ({a.dtype} {tuple(a.shape)}) differ; the first, flat index {first}: "
            f"{a.detach().reshape(-1)[first].item()!r} against {b.detach().reshape(-1)[first].item()!r}")


def _flat(v, path: str = "") -> list:
    """The leaves of ``v`` (tuples / lists, nested) with their paths (``"output 3"``, ``"output 1[0]"``)."""
    if type(v) in (list, tuple):
        return [leaf for i, a in enumerate(v) for leaf in _flat(a, f"{path}[{i}]" if path else f"output {i}")]
    return [(path or "output", v)]


def _compare(what: str, got, want, tensors: Sequence, written: list) -> None:
    """Raise :class:`ReplayMismatch` for the first output of ``got`` (the replay's) whose bits differ from
    ``want``'s (the ordinary code's), else for the first of ``tensors`` (as the ordinary code left them) whose
    bits differ from ``written`` (as the replay left them)."""
    leaves_got, leaves_want = _flat(got), _flat(want)
    if len(leaves_got) != len(leaves_want):
        raise ReplayMismatch(f"FP8ENGINE_REPLAY=check: the replayed {what} returned {len(leaves_got)} outputs, the "
                             f"ordinary code {len(leaves_want)}")
    for (path, a), (_, b) in zip(leaves_got, leaves_want):
        if (why := _differs(a, b)) is not None:
            raise ReplayMismatch(f"FP8ENGINE_REPLAY=check: the replayed {what}'s {path} differs from the ordinary "
                                 f"code's: {why}")
    for i, (t, w) in enumerate(zip(tensors, written)):
        if w is not None and (why := _differs(w, t, layout=False)) is not None:
            raise ReplayMismatch(f"FP8ENGINE_REPLAY=check: input {i} of the replayed {what}, which the step writes, "
                                 f"differs from the ordinary code's after it: {why}")
