"""CPU kernel choice for the emulated FP8 path.

On CPUs with AVX-512 (and AMX), torch 2.13's CPU build runs ``torch._scaled_mm`` -- the GEMM of every FP8 layer on a
CPU -- about 100x slower than with its AVX2 kernels: 9.3 ms against 0.089 ms for a 128x64 @ 64x64 FP8 GEMM on the
2-core Xeon (AVX-512, AMX) of our CI kind, measured with ``torch._scaled_mm`` in a loop on 2026-11-24; the default
``python -m fp8engine.train`` CPU run went from ~34 s to ~0.12 s per step. ATen picks its CPU kernels from
``ATEN_CPU_CAPABILITY`` when the process runs its first CPU kernel, so the entry points (the training command, the
benchmarks, the examples, the test suite) call :func:`prefer_avx2_cpu_kernels` before doing any work. A value the
user set is kept; GPU kernels are unaffected.
"""
import os

__all__ = ["prefer_avx2_cpu_kernels"]


def prefer_avx2_cpu_kernels() -> None:
    """Set ``ATEN_CPU_CAPABILITY=avx2`` unless already set. Effective only before the process's first CPU kernel."""
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
