"""CPU settings the entry points make before any work: torch's AVX2 kernels, and denormal floats flushed to zero.

AVX2 kernels. On CPUs with AVX-512 and AMX, torch 2.13's CPU build ran ``torch._scaled_mm`` -- the GEMM of every FP8
layer on a CPU -- about 100x slower than with its AVX2 kernels: 9.3 ms against 0.089 ms for a 128x64 @ 64x64 FP8 GEMM
on a 2-core Xeon (AVX-512, AMX), measured with ``torch._scaled_mm`` in a loop on 2026-11-24; the default
``python -m fp8engine.train`` CPU run went from ~34 s to ~0.12 s per step. (On the 2-core AMD EPYC, AVX-512 without
AMX, of the CI machine on 2026-11-27 the two made no measurable difference: 0.54-0.71 against 0.65-0.77 ms for that
GEMM, other jobs sharing the cores.) ATen picks its CPU kernels from ``ATEN_CPU_CAPABILITY`` when the process runs
its first CPU kernel, so the entry points (the training command, the benchmarks, the examples, the test suite) call
:func:`prefer_avx2_cpu_kernels` before doing any work. A value the user set is kept; GPU kernels are unaffected.

Denormals. A float32 value below 2**-126 is denormal, and x86 CPUs can compute with denormal operands or results many
times slower than with normal ones. The training command, the benchmarks and ``examples/hf_finetune.py`` therefore
run their work inside :func:`flush_denormals`, which sets ``torch.set_flush_denormal(True)`` (FTZ + DAZ in the
thread's MXCSR: denormal results and operands read as 0). On the 2-core AMD EPYC of the CI machine (torch 2.13,
2026-11-27) the default ``python -m fp8engine.train`` run logged the same losses with and without it and trained in
74 / 91 s against 88 / 111 s without (two pairs of runs, nothing else running; docs/benchmarks.md, train); on 2 cores
of a Xeon with torch 2.11 it made no difference. ``FP8ENGINE_FLUSH_DENORMAL=0`` (or ``false`` / ``off`` / ``no``)
leaves the setting alone; a process that already flushes keeps flushing.

The setting is per thread, and a thread inherits it from the thread that starts it: set at the start of a command,
it reaches the intra-op thread pool torch starts at the first parallel kernel. A caller running an entry point's
``main`` in a process whose pool already runs gets it in the calling thread only. Torch is imported only inside the
functions, so ``--help`` of the commands that import this module does not load it.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["prefer_avx2_cpu_kernels", "flush_denormals", "denormals_flushed", "FLUSH_DENORMAL_ENV"]

#: Environment variable: ``0`` / ``false`` / ``off`` / ``no`` keeps :func:`flush_denormals` from changing anything.
FLUSH_DENORMAL_ENV = "FP8ENGINE_FLUSH_DENORMAL"
_OFF = ("0", "false", "off", "no")


def prefer_avx2_cpu_kernels() -> None:
    """Set ``ATEN_CPU_CAPABILITY=avx2`` unless already set. Effective only before the process's first CPU kernel."""
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")


def denormals_flushed() -> bool:
    """Whether this thread's float32 CPU math flushes denormals to zero (probed: ``2**-130 * 1`` reads 0)."""
    import torch

    return torch.tensor(2.0 ** -130, dtype=torch.float32).mul(1.0).item() == 0.0


@contextlib.contextmanager
def flush_denormals() -> Iterator[bool]:
    """Flush denormal floats to zero on the CPU inside the block, unless ``FP8ENGINE_FLUSH_DENORMAL=0``.

    Yields whether denormals are flushed inside the block. On exit the setting goes back to what it was, in this
    thread (threads started inside the block keep it). A process that flushes already is left as it is, and so is
    everything when the variable says off or the CPU cannot flush (``torch.set_flush_denormal`` returns False).
    Use it first thing in an entry point, before torch starts its thread pool (see the module docstring).
    """
    import torch

    already = denormals_flushed()
    if already or os.environ.get(FLUSH_DENORMAL_ENV, "1").strip().lower() in _OFF:
        yield already
        return
    changed = torch.set_flush_denormal(True)
    try:
        yield changed
    finally:
        if changed:
            torch.set_flush_denormal(False)
