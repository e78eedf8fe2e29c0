"""An FP8 GEMM that accumulates into its output: cuBLASLt's ``D = alpha * (A @ B) + beta * C`` with ``beta = 1``,
called through ``ctypes`` on the cuBLASLt library the CUDA build of torch already loaded (no C++ build).

``torch._scaled_mm`` (and ``torch.nn.functional.scaled_mm``, torch 2.11-2.13) has no accumulate input, so
``fuse_wgrad_accumulation`` would otherwise be a GEMM into a fresh fp32 tensor plus ``main_grad.add_`` (one more
fp32 write and two fp32 reads of the weight's size). TransformerEngine makes the same cuBLASLt call with
``accumulate=True`` for its wgrad into ``main_grad``.

Layout: torch tensors are row-major and cuBLASLt is column-major, so the row-major ``out [M, N] += a [M, K] @ b.T``
(``b [N, K]``) is the column-major ``out^T [N, M] += op_T(b) @ a`` -- cuBLASLt's "TN" form, the only one its FP8
kernels take on Hopper.

Constants are the values in CUDA 12/13's ``library_types.h`` (cudaDataType_t), ``cublas_api.h``
(cublasComputeType_t, cublasOperation_t) and ``cublasLt.h`` (descriptor / preference attributes).
Public: :func:`scaled_mm_accumulate` (the wgrad into ``main_grad``), :func:`scaled_mm` (any fp32/bf16/fp16 output,
optionally accumulating, with a choice of cuBLASLt's ranked algorithms) and :func:`available`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from contextlib import nullcontext
from typing import Optional

import torch

__all__ = ["available", "scaled_mm_accumulate", "scaled_mm", "CublasLtError"]

_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF, _CUDA_R_8F_E4M3, _CUDA_R_8F_E5M2 = 0, 2, 14, 28, 29
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
# cublasLtMatmulDescAttributes_t
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
# cublasLtMatmulPreferenceAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # MIN_ALIGNMENT_{A,B,C,D}_BYTES

#: Largest workspace the heuristic may plan with: 32 MiB, an upper bound chosen here (the heuristic reports what
#: the chosen algorithm needs, and each call allocates only that from torch's caching allocator).
_MAX_WORKSPACE_BYTES = 32 * 1024 * 1024

_FP8_CUDA_TYPE = {torch.float8_e4m3fn: _CUDA_R_8F_E4M3, torch.float8_e5m2: _CUDA_R_8F_E5M2}
_OUT_CUDA_TYPE = {torch.float32: _CUDA_R_32F, torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than CUBLAS_STATUS_SUCCESS (0)."""


class _HeuristicResult(ctypes.Structure):
    # cublasLtMatmulHeuristicResult_t: cublasLtMatmulAlgo_t (uint64_t data[8]), size_t workspaceSize,
    # cublasStatus_t state, float wavesCount, int reserved[4].
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_library_path() -> Optional[str]:
    """Path of the libcublasLt the process already mapped (torch's CUDA build links it), read from
    ``/proc/self/maps``; None when it is not mapped or the file is not there (not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ")[-1]
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        return None
    return None


class _Lib:
    """The cuBLASLt functions this module calls, with their C signatures."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        pvp = ctypes.POINTER(vp)
        sigs = {
            "cublasLtCreate": [pvp],
            "cublasLtMatmulDescCreate": [pvp, i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [pvp, i32, u64, u64, i64],
            "cublasLtMatmulPreferenceCreate": [pvp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(i32)],
            # handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace, size, stream
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            setattr(self, name[len("cublasLt"):], fn)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} returned cublasStatus_t {status}")


class _Plan:
    """Descriptors and the algorithm of one GEMM shape: built once, reused for every call of that shape."""

    def __init__(self, lib: _Lib, handle: ctypes.c_void_p, key: tuple):
        # column-major sizes: D [m, n] (+)= op_T(A [k, m]) @ B [k, n]; alignments in bytes of A, B and C = D
        m, n, k, a_type, b_type, d_type, align, fast_accum, algo_index = key
        self.desc = ctypes.c_void_p()
        _check(lib.MatmulDescCreate(ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        for attr, val in ((_DESC_TRANSA, ctypes.c_int32(_CUBLAS_OP_T)), (_DESC_TRANSB, ctypes.c_int32(_CUBLAS_OP_N)),
                          (_DESC_FAST_ACCUM, ctypes.c_int8(int(fast_accum)))):
            _check(lib.MatmulDescSetAttribute(self.desc, attr, ctypes.byref(val), ctypes.sizeof(val)),
                   "MatmulDescSetAttribute")
        self.a_layout, self.b_layout, self.d_layout = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, dtype, rows, cols in ((self.a_layout, a_type, k, m), (self.b_layout, b_type, k, n),
                                          (self.d_layout, d_type, m, n)):
            _check(lib.MatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, rows), "MatrixLayoutCreate")
        pref = ctypes.c_void_p()
        _check(lib.MatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        ws = ctypes.c_uint64(_MAX_WORKSPACE_BYTES)
        _check(lib.MatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "MatmulPreferenceSetAttribute")
        for attr, val in zip(_PREF_MIN_ALIGNMENT, (align[0], align[1], align[2], align[2])):
            val = ctypes.c_uint32(val)
            _check(lib.MatmulPreferenceSetAttribute(pref, attr, ctypes.byref(val), 4), "MatmulPreferenceSetAttribute")
        results = (_HeuristicResult * (algo_index + 1))()
        found = ctypes.c_int(0)
        _check(lib.MatmulAlgoGetHeuristic(handle, self.desc, self.a_layout, self.b_layout, self.d_layout,
                                          self.d_layout, pref, algo_index + 1, results, ctypes.byref(found)),
               "MatmulAlgoGetHeuristic")
        if found.value < 1:
            raise CublasLtError(f"cuBLASLt has no FP8 algorithm for D [{m}, {n}] += A^T [{k}, {m}] @ B [{k}, {n}] "
                                f"with operand alignments {align}")
        if found.value <= algo_index:
            raise IndexError(f"cuBLASLt's heuristic returned {found.value} algorithms, asked for index {algo_index}")
        self.result = results[algo_index]
        self.workspace_size = int(self.result.workspace_size)


class _Context:
    """Per-process cuBLASLt handles (one per device) and the plan cache. A lock serialises the per-call scale-pointer
    updates of a cached descriptor (autograd runs backward on its own thread)."""

    def __init__(self, lib: _Lib):
        self.lib, self.handles, self.plans, self.lock = lib, {}, {}, threading.Lock()
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)  # alpha and beta (host pointer mode)
        self.scale_ptrs = (ctypes.c_void_p(), ctypes.c_void_p())

    def handle(self, device: torch.device) -> ctypes.c_void_p:
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = self.handles.get(index)
        if handle is None:
            handle = ctypes.c_void_p()
            with torch.cuda.device(index):
                _check(self.lib.Create(ctypes.byref(handle)), "cublasLtCreate")
            self.handles[index] = handle
        return handle


_context: Optional[_Context] = None
_load_error: Optional[str] = None


def _get_context() -> Optional[_Context]:
    global _context, _load_error
    if _context is None and _load_error is None:
        path = None
        if torch.cuda.is_available():
            torch.cuda.init()  # maps torch's CUDA libraries (libcublasLt among them) if that has not happened yet
            path = _loaded_library_path() or ctypes.util.find_library("cublasLt")
        if path is None:
            _load_error = "libcublasLt is not loaded (no CUDA build of torch, or no GPU)"
        else:
            try:
                _context = _Context(_Lib(path))
            except (OSError, AttributeError) as err:  # a library without these symbols (cuBLAS < 11.8)
                _load_error = f"cannot bind cuBLASLt at {path}: {err}"
    return _context


def available() -> bool:
    """True when the cuBLASLt accumulate path can be used in this process (CUDA torch with a GPU)."""
    return _get_context() is not None


def _alignment(ptr: int) -> int:
    """Largest power of two up to 256 dividing ``ptr`` (what the heuristic must assume about an operand)."""
    align = 256
    while ptr % align:
        align //= 2
    return align


def scaled_mm_accumulate(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                         out: torch.Tensor) -> None:
    """``out += (a * a_scale_inv) @ (b * b_scale_inv).T`` in one cuBLASLt FP8 GEMM (fp32 accumulation, without
    fast accumulation), on the current CUDA stream.

    Args:
        a: ``[M, K]`` FP8 (E4M3 or E5M2), contiguous row-major. b: ``[N, K]`` FP8, contiguous row-major; at most
            one of the two is E5M2.
        a_scale_inv, b_scale_inv: 1-element float32 dequantization factors on the GPU (read by the GEMM).
        out: ``[M, N]`` float32, contiguous, on the same GPU; updated in place.
    Raises:
        TypeError: wrong dtypes. ValueError: shapes, layouts or devices that do not fit, or K / N not a multiple
        of 16. RuntimeError: cuBLASLt unavailable (see :func:`available`); CublasLtError: a cuBLASLt call failed.
    """
    if out.dtype != torch.float32:
        raise TypeError(f"scaled_mm_accumulate accumulates into float32, got out of dtype {out.dtype}")
    scaled_mm(a, a_scale_inv, b, b_scale_inv, out, accumulate=True)


def scaled_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
              out: torch.Tensor, *, accumulate: bool = False, use_fast_accum: bool = False,
              algo_index: int = 0) -> None:
    """``out (+)= (a * a_scale_inv) @ (b * b_scale_inv).T`` through cuBLASLt; ``out`` float32 / bfloat16 / float16
    ``[M, N]`` contiguous. ``algo_index`` picks the i-th algorithm of cuBLASLt's heuristic ranking (0 = its first
    choice, what ``torch._scaled_mm`` runs); ``tools/probe_cublaslt.py`` times the others. Operands and errors as
    :func:`scaled_mm_accumulate`; IndexError when the heuristic returns fewer than ``algo_index + 1`` algorithms.
    """
    ctx = _get_context()
    if ctx is None:
        raise RuntimeError(f"fp8engine.ops.cublaslt needs cuBLASLt on a GPU: {_load_error}")
    if a.dtype not in _FP8_CUDA_TYPE or b.dtype not in _FP8_CUDA_TYPE or out.dtype not in _OUT_CUDA_TYPE:
        raise TypeError(f"cuBLASLt scaled_mm needs FP8 a/b and a float32/bfloat16/float16 out, got {a.dtype}, "
                        f"{b.dtype}, {out.dtype}")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise TypeError("E5M2 x E5M2 GEMMs are not supported by cuBLASLt; quantize one operand to E4M3")
    (m, k), (n, kb) = a.shape, b.shape
    if kb != k or tuple(out.shape) != (m, n):
        raise ValueError(f"cuBLASLt scaled_mm needs a [M, K], b [N, K], out [M, N]; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(out.shape)}")
    if k % 16 or n % 16:
        raise ValueError(f"FP8 GEMM dims K={k} and N={n} must be multiples of 16")
    tensors = (a, b, out, a_scale_inv, b_scale_inv)
    if not all(t.is_cuda and t.device == out.device for t in tensors):
        raise ValueError("cuBLASLt scaled_mm: all tensors must be on the same CUDA device")
    if not (a.is_contiguous() and b.is_contiguous() and out.is_contiguous()):
        raise ValueError("cuBLASLt scaled_mm needs contiguous row-major a, b and out")
    if a_scale_inv.numel() != 1 or b_scale_inv.numel() != 1 or a_scale_inv.dtype != torch.float32 \
            or b_scale_inv.dtype != torch.float32:
        raise ValueError("a_scale_inv and b_scale_inv must be 1-element float32 tensors")
    if m == 0:
        return
    # Column-major view (module docstring): D = out^T [n, m], A = b (op T), B = a.
    align = (_alignment(b.data_ptr()), _alignment(a.data_ptr()), _alignment(out.data_ptr()))
    key = (out.device.index, n, m, k, _FP8_CUDA_TYPE[b.dtype], _FP8_CUDA_TYPE[a.dtype], _OUT_CUDA_TYPE[out.dtype],
           align, bool(use_fast_accum), algo_index)
    lib, handle = ctx.lib, ctx.handle(out.device)
    # cuBLASLt launches on the current device: make it out's (autograd's backward threads already have it current)
    guard = nullcontext() if torch.cuda.current_device() == out.device.index else torch.cuda.device(out.device)
    with ctx.lock, guard:
        plan = ctx.plans.get(key)
        if plan is None:
            plan = ctx.plans[key] = _Plan(lib, handle, key[1:])
        workspace = torch.empty(plan.workspace_size, dtype=torch.uint8, device=out.device) \
            if plan.workspace_size else None
        a_ptr, b_ptr = ctx.scale_ptrs
        a_ptr.value, b_ptr.value = b_scale_inv.data_ptr(), a_scale_inv.data_ptr()
        _check(lib.MatmulDescSetAttribute(plan.desc, _DESC_A_SCALE_POINTER, ctypes.byref(a_ptr), 8),
               "MatmulDescSetAttribute")
        _check(lib.MatmulDescSetAttribute(plan.desc, _DESC_B_SCALE_POINTER, ctypes.byref(b_ptr), 8),
               "MatmulDescSetAttribute")
        out_ptr = out.data_ptr()
        _check(lib.Matmul(handle, plan.desc, ctypes.byref(ctx.one), b.data_ptr(), plan.a_layout, a.data_ptr(),
                          plan.b_layout, ctypes.byref(ctx.one if accumulate else ctx.zero), out_ptr, plan.d_layout,
                          out_ptr, plan.d_layout, ctypes.byref(plan.result.algo),
                          None if workspace is None else workspace.data_ptr(), plan.workspace_size,
                          torch.cuda.current_stream(out.device).cuda_stream), "cublasLtMatmul")
