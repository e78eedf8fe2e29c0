"""``launch(kernel, grid, *args, **meta)``: ``kernel[grid](*args, **meta)`` with less host time per call.

Why: on the H200 machine a ``kernel[grid](...)`` call costs 15 us of host time, of which the compiled launcher
(the C function that calls ``cuLaunchKernelEx``) is 5.7 us (``tools/tune_kernels.py --only host``); the rest is
``JITFunction.run`` binding the arguments, building the specialization key, reading Triton's settings and making
the launch metadata, again for every call. An FP8 layer step makes about 25 launches, and the host issuing them
is what the GPU waits for during the forward of a step (docs/benchmarks.md, fifth session).

How: the first call with a given *key* goes through ``kernel[grid](...)`` (compiling when needed), which returns
the ``CompiledKernel`` it ran; later calls with the same key hand the arguments to that kernel's launcher directly,
in the order ``JITFunction.run`` does (every kernel parameter in declaration order, constexprs included). The key
holds what Triton specializes a compiled kernel on, so a key hit runs exactly the kernel Triton would have picked:

- per tensor argument: its dtype and whether ``data_ptr()`` is a multiple of 16 (Triton's pointer alignment);
- per int argument: whether it equals 1, is a multiple of 16, and fits int32 / int64 (Triton's int types);
- per bool / float argument: the type; the keyword arguments (constexprs, ``num_warps``, ...) by value;
- the current CUDA device.

It is never coarser than Triton's own key (it is finer in places: e.g. an int's divisibility is kept even for a
parameter Triton does not specialize), so a hit cannot run a wrongly specialized kernel. Restrictions, checked at
the first call of a key (else every call takes ``kernel[grid](...)``): runtime parameters are passed positionally and
constexprs by keyword, no pre-run hooks, and this Triton must have the launcher API used here (Triton 3.6 on the H200,
3.9 in CI; under ``TRITON_INTERPRET=1`` every call takes ``kernel[grid](...)``).
``FP8ENGINE_TRITON_FAST_LAUNCH=0`` (read at import) turns the direct path off, for comparisons.
"""
from __future__ import annotations

import os

import torch

try:
    from triton.runtime.jit import JITFunction
except ImportError:  # no Triton (launch is never reached then) or a layout this module does not know
    JITFunction = None

__all__ = ["launch", "launch_key"]

ENABLED = os.environ.get("FP8ENGINE_TRITON_FAST_LAUNCH", "1") != "0"

_INT32 = (-(2**31), 2**31)
_INT64_MAX = 2**63


def _scalar_key(a):
    if isinstance(a, bool):  # before int: bool is an int subclass
        return bool
    if isinstance(a, int):
        return a == 1, a % 16 == 0, (0 if _INT32[0] <= a < _INT32[1] else 1 if a < _INT64_MAX else 2)
    if isinstance(a, float):
        return float
    return type(a), a  # anything else (e.g. None): by value


def launch_key(args: tuple, meta: dict, device: int) -> tuple:
    """The key under which :func:`launch` reuses a compiled kernel (see the module docstring)."""
    return (device, tuple([(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else _scalar_key(a)
                           for a in args]), tuple(meta.items()))


def _runtime():
    """Triton's launch hooks, or None when this Triton lacks the API the direct path uses."""
    try:
        from triton import knobs

        return knobs.runtime
    except (ImportError, AttributeError):
        return None


#: None turns the direct path off (no Triton, an unknown launcher API, or FP8ENGINE_TRITON_FAST_LAUNCH=0).
_RUNTIME = _runtime() if ENABLED and JITFunction is not None else None


class _Entry:
    """A compiled kernel and the constexpr/default values that follow the positional arguments."""

    __slots__ = ("compiled", "tail")

    def __init__(self, compiled, tail: tuple):
        self.compiled, self.tail = compiled, tail


def _make_entry(kernel, compiled, args: tuple, meta: dict):
    """The direct-call entry for this first launch, or None when the direct path does not apply."""
    params = getattr(kernel, "params", None)
    if (compiled is None or params is None or getattr(kernel, "pre_run_hooks", None)
            or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))):
        return None
    if any(p.is_constexpr for p in params[:len(args)]):  # a positional constexpr: the key holds no values
        return None
    tail = []
    for p in params[len(args):]:
        if not p.is_constexpr:  # a runtime argument passed by keyword: its value would be frozen in the tail
            return None
        if p.name in meta:
            tail.append(meta[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return None
    return _Entry(compiled, tuple(tail))


def launch(kernel, grid: tuple, *args, **meta):
    """Launch ``kernel`` (a ``@triton.jit`` function) on ``grid`` (1 to 3 ints) with positional runtime/constexpr
    arguments ``args`` and keyword ``meta`` (constexprs by name, launch options such as ``num_warps``): the same
    effect as ``kernel[grid](*args, **meta)``, on the current CUDA stream. Returns None."""
    if _RUNTIME is None or not isinstance(kernel, JITFunction):  # e.g. TRITON_INTERPRET=1: InterpretedFunction
        kernel[grid](*args, **meta)
        return
    device = torch.cuda.current_device()
    key = launch_key(args, meta, device)
    cache = kernel.__dict__.setdefault("_fp8engine_launch_cache", {})
    entry = cache.get(key, False)
    if entry is False:  # first call with this key: Triton's own path, then remember what it ran
        compiled = kernel[grid](*args, **meta)
        cache[key] = _make_entry(kernel, compiled, args, meta)
        return
    if entry is None:
        kernel[grid](*args, **meta)
        return
    compiled = entry.compiled
    full = args + entry.tail
    stream = torch._C._cuda_getCurrentRawStream(device)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    rt = _RUNTIME
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *full), rt.launch_enter_hook, rt.launch_exit_hook, *full)


def cached_entries(kernel) -> int:
    """How many keys of ``kernel`` have a direct-call entry (for tests)."""
    return sum(e is not None for e in kernel.__dict__.get("_fp8engine_launch_cache", {}).values())
