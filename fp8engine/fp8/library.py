"""Delayed scaling under ``torch.compile``: where a compiled backward records the gradients' amaxes.

Eager backward max-accumulates ``|dy|``'s amax into ``ScalingState.amax_history[row, 0]`` after the FP8 region
exited and :func:`fp8engine.fp8.state.reduce_and_update` rolled the history (delayed scaling: the next update
consumes it). A compiled forward/backward pair cannot write there: AOTAutograd functionalizes the history,
which the forward also writes (the input's and weight's amaxes), so its backward would copy back the whole history
as it was at forward time, undoing the update in between (and autograd's version check on the saved history
rejects exactly that: "modified by an inplace operation").

So a compiled backward max-accumulates into ``ScalingState.grad_amax[row]`` instead, a buffer the forward never
writes: the backward reads and writes the live buffer, and the update folds it into ``amax_history[:, 0]`` (the
slot the eager backward would have written) before computing scales, then zeroes it. Zeroing keeps the buffer's
autograd version counter (the compiled forward saved the buffer for its backward; the backward must see the zeroed
buffer, exactly what eager mode's direct write sees), so the compiled run updates the state as eager mode does.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["fold_grad_amax"]


@torch.no_grad()
def fold_grad_amax(states: Sequence) -> None:
    """``amax_history[:, 0] = max(amax_history[:, 0], grad_amax)`` and ``grad_amax = 0`` for every state (a NaN
    in either stays NaN, so the update keeps the old scale, as for an eager NaN amax). Runs before each update, for
    the states a compiled backward wrote (``compiled_backward``, set while tracing by
    :func:`fp8engine.fp8.quantizer.get_quantizers`): eager training pays no launch for it."""
    for st in states:
        if not st.compiled_backward:
            continue
        ga = st.grad_amax
        if ga.device != st.amax_history.device:
            raise ValueError(f"ScalingState buffers on different devices: {ga.device} vs {st.amax_history.device}")
        col = st.amax_history[:, 0]
        col.copy_(torch.maximum(col, ga))
        with torch.autograd._unsafe_preserve_version_counter(ga):
            ga.zero_()
