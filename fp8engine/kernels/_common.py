"""Shared pieces of the fp8engine Triton kernels: the FP8 conversion, amax, partial-sum reduction, launcher checks.

Scale direction everywhere: ``fp8 = saturate(x.float() * scale).to(fp8_dtype)`` -- multiply by ``scale`` to go from
the high-precision range into the FP8 range; ``scale_inv = 1 / scale`` dequantizes. ``saturate`` clamps to
``+-fp8_max`` (E4M3 448, E5M2 57344); NaN stays NaN; the conversion rounds to nearest even, exactly as
``torch.Tensor.to(float8)`` does.

FP8 conversion paths (``_fp32_to_fp8_bits``):
  * on a GPU the hardware conversion (``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` on sm_89+), round-to-nearest-even,
    except in tiled kernels that also write the transposed copy (last item; see ``fp8_cvt_mode``);
  * under ``TRITON_INTERPRET=1`` an exact integer emulation. The interpreter's own float->fp8 conversion (Triton
    3.9 ``interpreter._convert_float``) is NOT round-to-nearest-even: it adds the first cut-off bit (ties away from
    zero instead of to even), ORs a mantissa carry into the exponent instead of adding it (e.g. -0.12386 -> 0x98
    instead of 0xa0 in E4M3) and truncates FP8 subnormals (0.00102 -> 0x00 instead of 0x01). About 8 % of random
    inputs differed from torch, so the interpreter path never uses it. The emulation is bit-identical to torch on
    every finite input (tests/kernels/test_fp8_conversion.py sweeps all bf16/fp16 bit patterns and the rounding ties).
    Set ``FP8ENGINE_EMULATE_FP8_CVT=1`` to force the emulation on a GPU too (used by the tests to cross-check).
  * in tiled kernels that also write the transposed copy, on a GPU: the same hardware instruction issued by inline
    PTX (``CVT_PTX``, see ``fp8_cvt_mode``).

NaN encoding: the emulation writes ``0x7f | sign`` (torch's encoding, both formats); the GPU hardware conversion
may drop the NaN's sign. Compare NaN positions, not NaN bits.

amax convention: a NaN in the reduced tensor is counted as +inf, so amax is +inf (never NaN) -- ``tl.max`` does not
propagate NaN on GPUs, this makes the result defined; the delayed-scaling update then keeps the old scale.
"""

from __future__ import annotations

import contextvars
import inspect
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the references and fp8engine.kernels stay importable without Triton

    class _MissingTriton:
        """Stand-in for ``triton`` / ``triton.language`` so kernel modules import; launching raises."""

        constexpr = object  # only used in annotations

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _MissingTriton()  # type: ignore[assignment]
    HAS_TRITON = False


#: FP8 dtypes the kernels write, with their largest finite value, mantissa bits and exponent bias.
FP8_FORMATS = {
    torch.float8_e4m3fn: (448.0, 3, 7),
    torch.float8_e5m2: (57344.0, 2, 15),
}
HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)



#: Whether the kernels run under Triton's interpreter: ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel module
#: is imported (with this one), so a later change of the variable does not change which kernels run.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    return _INTERPRET


#: How a kernel converts fp32 to FP8 bits (its ``CVT`` constexpr): Triton's conversion (``.to(tl.float8e4nv)``),
#: the exact integer emulation, or the hardware instruction issued by inline PTX (``_fp32_to_fp8_bits_ptx``).
CVT_TRITON, CVT_EMULATE, CVT_PTX = 0, 1, 2


def fp8_cvt_mode(tiled_transpose: bool = False) -> int:
    """The ``CVT`` constexpr of a launch: the exact integer emulation (``CVT_EMULATE``) under the interpreter or when
    forced by ``FP8ENGINE_EMULATE_FP8_CVT=1``; in tiled kernels that also write the transposed copy
    (``tiled_transpose=True``) the inline-PTX conversion (``CVT_PTX``), or the emulation with
    ``FP8ENGINE_TILED_FP8_CVT=emulate``; elsewhere Triton's conversion (``CVT_TRITON``).

    Why tiled kernels do not use Triton's conversion: on H200 with Triton 3.6 ``.to(tl.float8e4nv)`` inside tile
    kernels that also write the transposed copy wrote wrong bytes for some configurations (fp32 inputs, N < 64,
    SwiGLU's two halves, and the GELU backward on bf16 64 x 128 tiles: NaN bytes where torch has finite values),
    whether the 8-bit tile or the fp32 tile was transposed (cf. triton-lang/triton#11111, fp8 transposed stores
    miscompiled). Only the plain cast-transpose of 16-bit inputs on full 64 x 128 tiles (``cast._hw_cvt_ok``) uses
    it, checked bit-exact by the GPU tests. The PTX path issues the same ``cvt.rn.satfinite`` instruction on plain
    32-bit registers and returns uint8, so the tile that is transposed is an ordinary integer tile.
    """
    if interpreting() or os.environ.get("FP8ENGINE_EMULATE_FP8_CVT") == "1":
        return CVT_EMULATE
    if not tiled_transpose:
        return CVT_TRITON
    return CVT_EMULATE if os.environ.get("FP8ENGINE_TILED_FP8_CVT") == "emulate" else CVT_PTX


# ----------------------------------------------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------------------------------------------
#: ``FP8ENGINE_FAST_LAUNCH=0`` sends every launch through Triton's own ``kernel[grid](...)`` (read at import).
FAST_LAUNCH = os.environ.get("FP8ENGINE_FAST_LAUNCH", "1") != "0"
#: (id(kernel), device, meta, per-argument specialization) -> (kernel, run, function, packed_metadata, trailing
#: constexprs), or False where the kernel's signature does not allow the direct call (see :func:`_direct_entry`).
_LAUNCHES: dict = {}
#: The :class:`fp8engine.ops.replay.Recorder` recording the running step, or None (launches and cuBLASLt calls
#: report themselves to it).
RECORDER: contextvars.ContextVar = contextvars.ContextVar("fp8engine_recorder", default=None)
_INT32 = (-(2**31), 2**31 - 1)
_Tensor = torch.Tensor


def _arg_key(a) -> tuple:
    """What Triton specializes a non-tensor launch argument on: an int's value 1, divisibility by 16 and 32-bit
    range; else the type (and value, for bools and None). (Tensors: their dtype and the 16-byte alignment of their
    pointer, computed inline in :func:`launch`.)"""
    if isinstance(a, bool) or a is None:
        return (a,)
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, _INT32[0] <= a <= _INT32[1])
    return (type(a),)


def _direct_entry(kernel, compiled, n_args: int, meta: dict):
    """The pieces of a direct launch of ``compiled`` (what ``kernel[grid](*args, **meta)`` returned), or False
    when its launcher cannot be called directly: the positional arguments must be the kernel's leading parameters
    and every later parameter a constexpr (its value is baked into ``compiled``; the launcher skips it but takes
    a value for it)."""
    params = getattr(kernel, "params", None)
    if params is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return False
    tail = []
    for p in params[n_args:]:
        if not getattr(p, "is_constexpr", False):
            return False
        if p.name in meta:
            tail.append(meta[p.name])
        elif p.default is not inspect.Parameter.empty:
            tail.append(p.default)
        else:
            return False
    return compiled.run, compiled.function, compiled.packed_metadata, tuple(tail)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids. ``triton.cdiv`` is a ``constexpr_function`` in Triton 3.6+: each call
    from Python goes through its JIT-call wrapper (~37 calls per FP8 layer step, 0.24 ms of the step's host time
    under cProfile on the H100)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), as ``triton.next_power_of_2`` without its wrapper."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` at a third of the host cost once the specialization has launched before.

    Triton's launch path re-binds and re-specializes every argument, formats a cache key and reads its knobs on
    each call: 16.5 host us per launch on the H100 against 6.1 us for the compiled kernel's own launcher
    (``CompiledKernel.run``), bits equal (probe of the cast kernel, torch 2.11, Triton 3.6). An FP8 layer step
    makes ~18 launches. The launcher takes a pointer argument as an int as well as a tensor (6.6 against 8.3 host us
    per call of the cast kernel's, another H100 host), so the direct call passes the pointers this function reads
    anyway for the key (timing probes, 2026-11-26, not kept in the repository). So the first launch of each (kernel, device, ``meta``, argument specialization -- the
    key Triton itself compiles for, :func:`_arg_key`) goes through Triton and keeps the compiled kernel; later
    ones call its launcher on the current stream directly. ``meta``: the constexpr and launch options
    (``num_warps``), by keyword. Triton's launch hooks (``knobs.runtime.launch_enter_hook``, used by its
    profiler) are not called on the direct path; ``FP8ENGINE_FAST_LAUNCH=0`` turns it off. Under
    ``TRITON_INTERPRET=1`` every launch goes through the interpreter. While a step is recorded for replay
    (:mod:`fp8engine.ops.replay`: ``RECORDER`` set) the recorder launches and records it.
    """
    recorder = RECORDER.get()
    if recorder is not None:
        recorder.launch(kernel, grid, args, meta)
        return
    launch_now(kernel, grid, args, meta)


def _launch_key(kernel, device: int, args: tuple, meta: dict) -> tuple:
    """``(key, ptrs)``: the direct-launch cache key of :func:`launch` and each tensor argument as its pointer."""
    # one pass over the arguments: the specialization key and, for the direct call, each tensor as its pointer
    # (the launcher takes an int for a pointer argument and skips its own data_ptr() call). The kernel is keyed by
    # id (JITFunction's __hash__ is Python code) and checked by identity on a hit (an id can be reused).
    ptrs = [a.data_ptr() if isinstance(a, _Tensor) else a for a in args]
    key = (id(kernel), device, tuple(meta.items()),
           tuple([(a.dtype, not p & 15) if isinstance(a, _Tensor) else _arg_key(a) for a, p in zip(args, ptrs)]))
    return key, ptrs


def launch_now(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """:func:`launch` without the recorder check (what a recorder and a replay call)."""
    if not FAST_LAUNCH or interpreting():
        kernel[grid](*args, **meta)
        return
    device = torch._C._cuda_getDevice()  # the device Triton launches on (torch.cuda.current_device())
    key, ptrs = _launch_key(kernel, device, args, meta)
    hit = _LAUNCHES.get(key)
    if not hit or hit[0] is not kernel:
        compiled = kernel[grid](*args, **meta)
        if hit is None or (hit and hit[0] is not kernel):
            entry = _direct_entry(kernel, compiled, len(args), meta)
            _LAUNCHES[key] = entry and (kernel, *entry)
        return
    _, run, function, packed, tail = hit
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, torch._C._cuda_getCurrentRawStream(device),
        function, packed, None, None, None, *ptrs, *tail)


def current_stream() -> int:
    """The current CUDA stream of the current device, as the raw handle a compiled launcher takes."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def launch_entry(kernel, args: tuple, meta: dict):
    """``(run, function, packed_metadata, trailing constexprs)`` of the compiled launcher :func:`launch` calls
    for this kernel and argument specialization once it has launched, or None (interpreter, ``FAST_LAUNCH`` off,
    or a signature the direct call does not take)."""
    if not FAST_LAUNCH or interpreting():
        return None
    key, _ = _launch_key(kernel, torch._C._cuda_getDevice(), args, meta)
    hit = _LAUNCHES.get(key)
    return tuple(hit[1:]) if hit and hit[0] is kernel else None


# ----------------------------------------------------------------------------------------------------------------
# Launcher checks
# ----------------------------------------------------------------------------------------------------------------
def check_launchable(x: torch.Tensor, op: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{op}: Triton is not installed; use {op}_reference or install triton")
    if not (x.is_cuda or interpreting()):
        raise ValueError(
            f"{op}: tensor on {x.device} is not supported; the Triton kernels need a CUDA tensor, or "
            f"TRITON_INTERPRET=1 for CPU tensors (or call {op}_reference)"
        )


def check_hp(x: torch.Tensor, name: str, op: str) -> None:
    if x.dtype not in HP_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {x.dtype}; supported: bfloat16, float16, float32")
    if not x.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous; call .contiguous() first")
    if x.dim() == 0:
        raise ValueError(f"{op}: {name} must have at least one dimension")


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """View a contiguous tensor as [M, N] with N the last dim (M = product of the leading dims, 1 for 1-D)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def fp8_format(fp8_dtype: torch.dtype, op: str) -> tuple[float, bool]:
    """Return ``(fp8_max, is_e4m3)``; raise TypeError for other dtypes."""
    if fp8_dtype not in FP8_FORMATS:
        raise TypeError(f"{op}: fp8_dtype {fp8_dtype} not supported; use torch.float8_e4m3fn or torch.float8_e5m2")
    return FP8_FORMATS[fp8_dtype][0], fp8_dtype == torch.float8_e4m3fn


def check_scalar_f32(t: torch.Tensor | None, name: str, device: torch.device, op: str,
                     also: torch.dtype | None = None) -> None:
    """``t``: None, or a 1-element float32 tensor (or of dtype ``also``) on ``device``; TypeError / ValueError."""
    if t is None:
        return
    if t.dtype not in (torch.float32, also) or t.numel() != 1:
        kind = "float32" if also is None else f"float32 or {also}"
        raise TypeError(f"{op}: {name} must be a 1-element {kind} tensor, got {t.dtype} with shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the input is on {device}")


def new_scale_inv(device: torch.device) -> torch.Tensor:
    """A fresh [1] fp32 buffer for scale_inv (never a view of the scale)."""
    return torch.empty(1, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------------------------------------------
# Plain-PyTorch reference pieces (no Triton)
# ----------------------------------------------------------------------------------------------------------------
def quantize_reference(y: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``saturate(y.float() * scale).to(fp8_dtype)``; NaN stays NaN (torch.clamp propagates it)."""
    fp8_max = FP8_FORMATS[fp8_dtype][0]
    return torch.clamp(y.float() * scale.float().reshape(()), -fp8_max, fp8_max).to(fp8_dtype)


def amax_reference(y: torch.Tensor) -> torch.Tensor:
    """max(|y|) in fp32 as a 0-d tensor, NaN counted as +inf (the kernels' convention); 0 for an empty tensor."""
    a = y.detach().float().abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
    return a.amax() if a.numel() else torch.zeros((), dtype=torch.float32, device=y.device)


def atomic_max_reference(amax_out: torch.Tensor | None, amax: torch.Tensor) -> None:
    """What the kernels' atomic_max does: amax_out = max(amax_out, amax), never lowering it."""
    if amax_out is not None:
        amax_out.copy_(torch.maximum(amax_out, amax.reshape(amax_out.shape)))


def scale_inv_reference(scale: torch.Tensor) -> torch.Tensor:
    return torch.reciprocal(scale.detach().float().reshape(1))


def scale_from_amax_reference(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """Current scaling's scale from an amax ``[1]`` fp32: ``reciprocal(amax) * fp8_max``, 1.0 where the amax is 0,
    negative or not finite (the rule of ``fp8engine.fp8.float8_tensor.current_scale``, same rounding)."""
    amax = amax.detach().float().reshape(1)
    ok = (amax > 0) & (amax < float("inf"))
    return torch.where(ok, torch.reciprocal(torch.where(ok, amax, 1.0)) * fp8_max, 1.0)


# ----------------------------------------------------------------------------------------------------------------
# Triton device functions
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _fp32_to_fp8_bits(y, MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr):
    """Exact round-to-nearest-even fp32 -> FP8 bits (uint8) for |y| <= fp8_max or NaN (saturate first).

    Normal results: the classic integer RNE on the fp32 bits (add 0x..7ff + lowest kept bit, shift), then rebias
    the exponent; a mantissa carry propagates into the exponent by the integer add. FP8 subnormals: scale |y| so
    one FP8 subnormal step is 1.0 and add 2**23, which makes the fp32 adder round to an integer (RNE) that then
    sits in the low mantissa bits; a result of 2**MANT_BITS is the smallest normal, which is the right encoding.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    mag = tl.where(is_nan, 0, mag)
    rounded = (mag + ((1 << (22 - MANT_BITS)) - 1) + ((mag >> (23 - MANT_BITS)) & 1)) >> (23 - MANT_BITS)
    normal = rounded - ((127 - EXP_BIAS) << MANT_BITS)
    # multiply by 1 / (smallest FP8 subnormal) = 2**(MANT_BITS - 1 + EXP_BIAS): exact (power of two)
    q = mag.to(tl.float32, bitcast=True) * (1 << (MANT_BITS - 1 + EXP_BIAS)) + 8388608.0
    sub = q.to(tl.int32, bitcast=True) - 0x4B000000
    out = tl.where(mag < ((128 - EXP_BIAS) << 23), sub, normal)
    out = tl.where(is_nan, 0x7F, out) | sign
    return out.to(tl.uint8)


@triton.jit
def _round_to(v, dtype: tl.constexpr, CVT: tl.constexpr):
    """fp32 ``v`` -> ``dtype`` rounded to nearest even, as torch. Under the interpreter (``CVT == 1``) the
    fp32 -> bf16 conversion truncates, so bf16 is rounded here with the integer RNE on the fp32 bits (NaN kept)."""
    if CVT == 1 and dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit
def _quantize(y, scale, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, CVT: tl.constexpr):
    """saturate(y * scale) -> FP8 bits as uint8. ``y`` fp32 block, ``scale`` fp32 scalar. NaN passes the clamp.
    ``CVT``: 0 Triton's conversion, 1 the integer emulation, 2 inline PTX (see ``fp8_cvt_mode``)."""
    v = y * scale
    v = tl.where(v > FP8_MAX, FP8_MAX, v)
    v = tl.where(v < -FP8_MAX, -FP8_MAX, v)
    if CVT == 1:
        if IS_E4M3:
            b = _fp32_to_fp8_bits(v, 3, 7)
        else:
            b = _fp32_to_fp8_bits(v, 2, 15)
    elif CVT == 2:
        b = _fp32_to_fp8_bits_ptx(v, IS_E4M3)
    else:
        if IS_E4M3:
            b = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            b = v.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    return b


@triton.jit
def _fp32_to_fp8_bits_ptx(v, IS_E4M3: tl.constexpr):
    """fp32 -> FP8 bits (uint8) by the sm_89+ instruction ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` (round to nearest
    even; finite inputs beyond the range saturate, NaN stays NaN), four values per asm block: the two x2
    conversions give 16 bits each (first operand in the high byte), packed low half first into the 32-bit output
    that Triton splits into four uint8 lanes in element order. GPU only (the interpreter cannot run PTX)."""
    if IS_E4M3:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [v], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [v], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _masked_abs(y, mask):
    """|y| with NaN counted as +inf and masked-off lanes as 0 (what the amax of a block reduces)."""
    a = tl.abs(y)
    a = tl.where(a != a, float("inf"), a)
    return tl.where(mask, a, 0.0)


@triton.jit
def _abs_max(y, mask):
    """max(|y|) over a 2-D block as an fp32 scalar; masked-off lanes count 0, NaN counts +inf."""
    return tl.max(tl.max(_masked_abs(y, mask), axis=1), axis=0)


@triton.jit
def _abs_max_flat(y, mask):
    """max(|y|) over a 1-D block, as :func:`_abs_max`."""
    return tl.max(_masked_abs(y, mask), axis=0)


@triton.jit
def _store_tile(
    v,  # fp32 [BLOCK_M, BLOCK_N] values of rows offs_m, columns offs_n of an [M, NC] matrix
    offs_m,
    offs_n,
    M,
    NC,
    col_end,  # columns >= col_end are masked off (col_end <= NC; a tile may cover part of a wider row)
    out_ptr,  # [M, NC] row-major output: uint8 FP8 bits if IS_FP8, else high precision (its element type)
    out_t_ptr,  # [NC, M] row-major transposed FP8 bits (uint8); only used if IS_FP8 and WRITE_T
    scale,  # fp32 scalar scale (ignored unless IS_FP8)
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    CVT: tl.constexpr,
    IS_FP8: tl.constexpr,
    WRITE_T: tl.constexpr,
):
    """Store a tile (FP8 or high precision) and, for FP8, optionally its transpose; offsets in int64."""
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < col_end)
    if IS_FP8:
        b = _quantize(v, scale, FP8_MAX, IS_E4M3, CVT)
        tl.store(out_ptr + rows[:, None] * NC + cols[None, :], b, mask=mask)
        if WRITE_T:
            # the transposed tile goes to rows offs_n of the [NC, M] copy; tl.trans lets the compiler stage it
            # through shared memory so both stores are coalesced
            mask_t = (offs_n[:, None] < col_end) & (offs_m[None, :] < M)
            tl.store(out_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(b), mask=mask_t)
    else:
        tl.store(out_ptr + rows[:, None] * NC + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_scale_inv(scale, scale_inv_ptr):  # scale_inv_ptr: [1] fp32, written with an IEEE division
    tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))


@triton.jit
def _scale_from_amax(amax, FP8_MAX: tl.constexpr):
    """Current scaling's scale from an fp32 amax, as :func:`scale_from_amax_reference`: the IEEE reciprocal of the
    amax times FP8_MAX (torch's ``fp8_max / amax`` rounds the same way), 1.0 where the amax is 0 or not finite."""
    ok = (amax > 0) & (amax < float("inf"))
    return tl.where(ok, tl.math.div_rn(1.0, tl.where(ok, amax, 1.0)) * FP8_MAX, 1.0)


#: Columns per program of :func:`sum_partials`' kernel, and the most rows it loads at once.
_SUM_BLOCK_N, _SUM_BLOCK_P = 64, 32


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CVT: tl.constexpr):
    """out[n] = sum over p of part[p, n] (``[P, N]`` fp32, row-major), in fp32, rounded once to out's dtype
    (:func:`_round_to`); each program sums BLOCK_N columns, BLOCK_P rows at a time in a fixed order
    (deterministic)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        v = tl.load(part_ptr + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < P) & cmask[None, :],
                    other=0.0)
        acc += tl.sum(v, axis=0)
    tl.store(out_ptr + cols, _round_to(acc, out_ptr.dtype.element_ty, CVT), mask=cmask)


def sum_partials(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Sum an [P, N] fp32 buffer of partial column sums over P -> [N] in ``out_dtype`` (summed in fp32, rounded once).

    Stage 2 of the kernels' deterministic column reductions (dbias, dgamma/dbeta): one Triton launch
    (:func:`_sum_partials_kernel`, a fixed order for a given shape, no atomics: deterministic) into one new tensor.
    It replaced torch's ``partials.sum(0).to(out_dtype)`` -- two dispatched ops, the sum's TensorIterator setup
    included -- because an FP8 layer step makes six of these reductions and its replayed program
    (:mod:`fp8engine.ops.replay`) calls a compiled launcher directly: 31-64 host us per ``sum`` + ``to`` pair against
    15-25 per allocation + launch in the replayed delayed-scaling step (H100, commit da4d931, 2026-11-26, per-line
    timing of the replayed program by the probe kept as ``tools/replay_lines.py``). Reference:
    :func:`sum_partials_reference`. ``P`` may be 0 (zeros)."""
    p, n = partials.shape
    out = torch.empty(n, dtype=out_dtype, device=partials.device)
    if n:
        launch(_sum_partials_kernel, (cdiv(n, _SUM_BLOCK_N),), partials.contiguous(), out, p, n,
               BLOCK_P=min(_SUM_BLOCK_P, next_power_of_2(max(p, 1))), BLOCK_N=_SUM_BLOCK_N, CVT=fp8_cvt_mode(),
               num_warps=4)
    return out


def sum_partials_reference(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Plain PyTorch :func:`sum_partials`: ``partials.sum(0)`` in fp32 rounded once to ``out_dtype`` (the order of the
    fp32 additions may differ from the kernel's: equal within fp32 rounding)."""
    return partials.float().sum(0).to(out_dtype)
