"""Delayed scaling under ``torch.compile``: where a compiled backward records the gradients' amaxes.

Eager backward max-accumulates ``|dy|``'s amax into ``ScalingState.amax_history[row, 0]`` after the FP8 region
exited and :func:`fp8engine.fp8.state.reduce_and_update` rolled the history (the next update consumes it). A
compiled forward/backward pair cannot write there: AOTAutograd functionalizes the history, which the forward also
writes, so its backward would copy back the whole history as it was at forward time, undoing the update in between
(autograd's version check on the saved history rejects exactly that: "modified by an inplace operation").

So a compiled backward max-accumulates into ``ScalingState.grad_amax[row]``, a buffer the forward never writes; the
update folds it into ``amax_history[:, 0]`` before computing scales, then zeroes it, keeping the buffer's autograd
version counter (the compiled forward saved the buffer for its backward, which must see the zeroed buffer, as
eager mode's direct write does).

The forward's scales are read through :func:`frozen_scale`, an opaque op. The update rewrites ``ScalingState.scale``
in place between the compiled forward and its backward, and AOTAutograd saves module buffers without a version
check. Inductor's partitioner (``min_cut_rematerialization_partition``) recomputes cheap pointwise chains from
buffers in the backward: it re-cast the weight for dgrad from the *updated* scale while the saved ``scale_inv`` was
the forward's, scaling dgrad by ``new_scale / old_scale`` (input gradients off 3.6e3x at step 1 of a ``Linear``).
It never recomputes a custom op, so it keeps the op's output, the scales as the forward read them.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

__all__ = ["fold_grad_amax", "frozen_scale", "kernel_op"]

_LIB = torch.library.Library("fp8engine", "FRAGMENT")


def kernel_op(name: str, mutates_args: tuple = ()):
    """Decorator: register ``fn`` as the operator ``torch.ops.fp8engine.<name>`` (schema inferred from its type hints,
    ``mutates_args`` the arguments it writes in place, :func:`torch.library.infer_schema`) with ``fn`` as its
    implementation for every device (``CompositeExplicitAutograd``: opaque to Inductor, not decomposed). Returns the
    ``OpOverload``, with ``register_fake`` for the fake (meta) implementation.

    Not ``torch.library.custom_op``: its Python dispatch wrapper costs ~100 us per call of a cast-like op against
    ~13 us for a ``Library`` registration (2-core CPU, ``python tools/op_overhead.py@d6af129``). The ops take no
    gradient (they run inside ``autograd.Function`` classes or compiled backward graphs); the mutations declared in
    the schema are what functionalization reads, as for ``custom_op``."""
    def define(fn):
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        op = getattr(torch.ops.fp8engine, name).default
        op.__doc__ = fn.__doc__
        op.register_fake = functools.partial(torch.library.register_fake, f"fp8engine::{name}")
        return op
    return define


@kernel_op("frozen_scale")
def frozen_scale(scale: torch.Tensor) -> torch.Tensor:
    """A copy of ``scale`` (``[n]`` float32, a ``ScalingState.scale``) that a compiled backward cannot re-read from the
    live buffer (module docstring). Used by the forward roles' quantizers inside a ``torch.compile`` trace; one
    per module forward."""
    return scale.clone()


@frozen_scale.register_fake
def _(scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(scale)


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
