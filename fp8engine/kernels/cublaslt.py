"""FP8 GEMMs called through ``ctypes`` on the cuBLASLt library the CUDA build of torch already loaded (no C++
build): the two ``torch._scaled_mm`` cannot express -- accumulation into the output (cuBLASLt's
``D = alpha * (A @ B) + beta * C`` with ``beta = 1``) and the ``GELU_AUX_BIAS`` epilogue with an FP8 output -- and
the one it can, at less host cost (:func:`gemm`: the same cuBLASLt call, planned once per configuration; eager CUDA
``fp8_mm`` calls it).

``torch._scaled_mm`` (and ``torch.nn.functional.scaled_mm``, torch 2.11-2.13) has no accumulate input, so
``fuse_wgrad_accumulation`` would otherwise be a GEMM into a fresh fp32 tensor plus ``main_grad.add_`` (one more
fp32 write and two fp32 reads of the weight's size). TransformerEngine makes the same cuBLASLt call with
``accumulate=True`` for its wgrad into ``main_grad``. The GELU epilogue lets fc1's fprop write the FP8 GELU output
(and the pre-activation for the backward) itself, instead of a bf16 output that an activation kernel reads again
(H200, 2026-11-21: the fc1 GEMM + activation pair 0.991 vs 1.067 ms in ``python tools/gelu_epilogue_variants.py@d6af129
--rounds 5``, the layer step -0.20 ms back-to-back in ``python -m fp8engine.bench layer --graph --rounds 3``; the
backward's ``DGELU_BGRAD`` has no FP8-output kernel there, status 15, and with a bf16 output it is slower than the
GEMM + Triton kernel).

Layout: torch tensors are row-major and cuBLASLt is column-major, so the row-major ``out [M, N] += a [M, K] @ b.T``
(``b [N, K]``) is the column-major ``out^T [N, M] += op_T(b) @ a`` -- cuBLASLt's "TN" form, the only one its FP8
kernels take on Hopper.

Constants are the values in CUDA 12/13's ``library_types.h`` (cudaDataType_t), ``cublas_api.h``
(cublasComputeType_t, cublasOperation_t) and ``cublasLt.h`` (descriptor / preference attributes).
Public: :func:`gemm` (``torch._scaled_mm``'s tensor-wise GEMM), :func:`scaled_mm_accumulate` (the wgrad into
``main_grad``), :func:`scaled_mm` (any fp32/bf16/fp16 output,
optionally accumulating, with a choice of cuBLASLt's ranked algorithms), :func:`scaled_mm_bias_gelu` and
:func:`available`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from contextlib import nullcontext
from typing import Optional

import torch

from fp8engine.kernels import _common

__all__ = ["available", "gemm", "scaled_mm_accumulate", "scaled_mm", "scaled_mm_bias_gelu", "CublasLtError",
           "CublasLtUnsupported"]

_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF, _CUDA_R_8F_E4M3, _CUDA_R_8F_E5M2 = 0, 2, 14, 28, 29
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
# cublasLtMatmulDescAttributes_t
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_EPILOGUE_AUX_POINTER, _DESC_EPILOGUE_AUX_LD = 11, 12
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_D_SCALE_POINTER, _DESC_AMAX_D_POINTER = 17, 18, 20, 21
_DESC_EPILOGUE_AUX_DATA_TYPE, _DESC_FAST_ACCUM, _DESC_BIAS_DATA_TYPE = 22, 25, 26
_STATUS_NOT_SUPPORTED = 15  # cublasStatus_t
# cublasLtEpilogue_t
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS, _EPILOGUE_GELU_AUX_BIAS = 1, 4, 164
# cublasLtMatmulPreferenceAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # MIN_ALIGNMENT_{A,B,C,D}_BYTES

#: Largest workspace the heuristic may plan with: 32 MiB, an upper bound chosen here (the heuristic reports what
#: the chosen algorithm needs, and each call allocates only that from torch's caching allocator).
_MAX_WORKSPACE_BYTES = 32 * 1024 * 1024
_DESC_SM_COUNT_TARGET = 15  # cublasLtMatmulDescAttributes_t, int32
#: SMs the FP8 GEMMs leave free for kernels on other streams (NCCL's, overlapped with them): the GEMMs are planned
#: for ``multi_processor_count - margin`` SMs (cuBLASLt's SM_COUNT_TARGET; TransformerEngine's NVTE_EXT_MARGIN_SM).
#: ``FP8ENGINE_GEMM_SM_MARGIN`` (read at import), default 0: every SM.
SM_MARGIN = int(os.environ.get("FP8ENGINE_GEMM_SM_MARGIN", "0") or 0)

_FP8_CUDA_TYPE = {torch.float8_e4m3fn: _CUDA_R_8F_E4M3, torch.float8_e5m2: _CUDA_R_8F_E5M2}
_OUT_CUDA_TYPE = {torch.float32: _CUDA_R_32F, torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}
_D_CUDA_TYPE = {**_OUT_CUDA_TYPE, **_FP8_CUDA_TYPE}


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than CUBLAS_STATUS_SUCCESS (0)."""


class CublasLtUnsupported(CublasLtError):
    """cuBLASLt has no kernel for this configuration on this GPU (its heuristic found none, or returned
    CUBLAS_STATUS_NOT_SUPPORTED = 15) -- found while planning, before anything was launched."""


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
    """Descriptors and the algorithm of one GEMM configuration: built once, reused for every call of it.

    Column-major sizes: ``D [m, n] (+)= op_T(A [k, m]) @ B [k, n]``; ``align`` = byte alignments of A, B and C = D.
    ``epilogue`` is a cublasLtEpilogue_t; with ``_EPILOGUE_BIAS`` the bias is of ``hp_type``; with
    ``_EPILOGUE_GELU_AUX_BIAS`` the bias and the aux output are of
    ``hp_type`` (aux ``[m, n]``, leading dim m) and D is FP8, whose C layout must be ``hp_type`` too (C is not read:
    beta = 0, passed as NULL). ``extra_attrs``: more ``(cublasLtMatmulDescAttributes_t, ctypes value)`` pairs set on
    the descriptor before the heuristic is asked (``tools/probe_block_gemm.py@d6af129 --algos``: the block scale modes
    and their scale pointers).
    """

    def __init__(self, lib: _Lib, handle: ctypes.c_void_p, m: int, n: int, k: int, a_type: int, b_type: int,
                 d_type: int, align: tuple, fast_accum: bool, algo_index: int, epilogue: int = _EPILOGUE_DEFAULT,
                 hp_type: Optional[int] = None, extra_attrs: tuple = ()):
        self.desc = ctypes.c_void_p()
        _check(lib.MatmulDescCreate(ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        attrs = [(_DESC_TRANSA, ctypes.c_int32(_CUBLAS_OP_T)), (_DESC_TRANSB, ctypes.c_int32(_CUBLAS_OP_N)),
                 (_DESC_FAST_ACCUM, ctypes.c_int8(int(fast_accum)))]
        if epilogue != _EPILOGUE_DEFAULT:
            attrs += [(_DESC_EPILOGUE, ctypes.c_uint32(epilogue)), (_DESC_BIAS_DATA_TYPE, ctypes.c_int32(hp_type))]
        if epilogue == _EPILOGUE_GELU_AUX_BIAS:
            attrs += [(_DESC_EPILOGUE_AUX_DATA_TYPE, ctypes.c_int32(hp_type)),
                      (_DESC_EPILOGUE_AUX_LD, ctypes.c_int64(m))]
        if SM_MARGIN > 0:
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            attrs.append((_DESC_SM_COUNT_TARGET, ctypes.c_int32(max(1, sms - SM_MARGIN))))
        for attr, val in (*attrs, *extra_attrs):
            _check(lib.MatmulDescSetAttribute(self.desc, attr, ctypes.byref(val), ctypes.sizeof(val)),
                   "MatmulDescSetAttribute")
        self.a_layout, self.b_layout, self.d_layout = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, dtype, rows, cols in ((self.a_layout, a_type, k, m), (self.b_layout, b_type, k, n),
                                          (self.d_layout, d_type, m, n)):
            _check(lib.MatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, rows), "MatrixLayoutCreate")
        self.c_is_d = d_type not in (_CUDA_R_8F_E4M3, _CUDA_R_8F_E5M2)
        self.c_layout = self.d_layout
        if not self.c_is_d:
            self.c_layout = ctypes.c_void_p()
            _check(lib.MatrixLayoutCreate(ctypes.byref(self.c_layout), hp_type, m, n, m), "MatrixLayoutCreate")
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
        status = lib.MatmulAlgoGetHeuristic(handle, self.desc, self.a_layout, self.b_layout, self.c_layout,
                                            self.d_layout, pref, algo_index + 1, results, ctypes.byref(found))
        if status == _STATUS_NOT_SUPPORTED or (status == 0 and found.value < 1):
            raise CublasLtUnsupported(f"cuBLASLt has no FP8 algorithm for D [{m}, {n}] += A^T [{k}, {m}] @ B [{k}, "
                                      f"{n}] with operand alignments {align}, epilogue {epilogue} (status {status})")
        _check(status, "MatmulAlgoGetHeuristic")
        if found.value <= algo_index:
            raise IndexError(f"cuBLASLt's heuristic returned {found.value} algorithms, asked for index {algo_index}")
        self.result = results[algo_index]
        self.workspace_size = int(self.result.workspace_size)


class _Context:
    """Per-process cuBLASLt handles (one per device) and the plan cache (a :class:`_Plan`, or the message of the
    configuration's :class:`CublasLtUnsupported`). A lock serialises the per-call pointer updates of a cached
    descriptor (autograd runs backward on its own thread)."""

    def __init__(self, lib: _Lib):
        self.lib, self.handles, self.plans, self.lock = lib, {}, {}, threading.Lock()
        self.sites: dict = {}  # gemm()'s call sites: key -> _Site, or the CublasLtUnsupported message
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)  # alpha and beta (host pointer mode)
        self.ptr = ctypes.c_void_p()  # holds a device pointer while it is copied into a descriptor

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
    """Largest power of two up to 256 dividing ``ptr`` (what the heuristic must assume about an operand): its lowest
    set bit, capped (a null pointer: 256)."""
    return min(ptr & -ptr, 256) if ptr else 256


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


def _check_operands(a, a_scale_inv, b, b_scale_inv, out, what: str) -> tuple[int, int, int]:
    """Validate ``a [M, K]``, ``b [N, K]`` FP8, ``out [M, N]`` and the scale_inv pair; return ``(M, N, K)``."""
    if a.dtype not in _FP8_CUDA_TYPE or b.dtype not in _FP8_CUDA_TYPE:
        raise TypeError(f"cuBLASLt {what} needs FP8 a and b, got {a.dtype} and {b.dtype}")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise TypeError("E5M2 x E5M2 GEMMs are not supported by cuBLASLt; quantize one operand to E4M3")
    (m, k), (n, kb) = a.shape, b.shape
    if kb != k or tuple(out.shape) != (m, n):
        raise ValueError(f"cuBLASLt {what} needs a [M, K], b [N, K], out [M, N]; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(out.shape)}")
    if k % 16 or n % 16:
        raise ValueError(f"FP8 GEMM dims K={k} and N={n} must be multiples of 16")
    if not all(t.is_cuda and t.device == out.device for t in (a, b, out, a_scale_inv, b_scale_inv)):
        raise ValueError(f"cuBLASLt {what}: all tensors must be on the same CUDA device")
    if not (a.is_contiguous() and b.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"cuBLASLt {what} needs contiguous row-major a, b and out")
    for name, t in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        if t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"cuBLASLt {what}: {name} must be a 1-element float32 tensor")
    return m, n, k


def _launch(a, a_scale_inv, b, b_scale_inv, out, **kw) -> None:
    """:func:`_launch_now`, or, while a step is recorded for replay (:mod:`fp8engine.ops.replay`), through the
    recorder, which records it as one op."""
    recorder = _common.RECORDER.get()
    if recorder is not None:
        recorder.call(_launch_now, a, a_scale_inv, b, b_scale_inv, out, **kw)
    else:
        _launch_now(a, a_scale_inv, b, b_scale_inv, out, **kw)


def _launch_now(a, a_scale_inv, b, b_scale_inv, out, *, accumulate: bool, fast_accum: bool, algo_index: int,
                epilogue: int = _EPILOGUE_DEFAULT, hp_type: Optional[int] = None, pointers: tuple = ()) -> None:
    """Run the cached plan of this configuration on the current stream. ``pointers``: extra (attribute, tensor)
    pairs whose device pointers are set on the descriptor for this call (bias, aux, D scale, amax)."""
    ctx = _get_context()
    (m, k), n = a.shape, b.shape[0]
    if m == 0:
        return
    # Column-major view (module docstring): D = out^T [n, m], A = b (op T), B = a.
    align = (_alignment(b.data_ptr()), _alignment(a.data_ptr()), _alignment(out.data_ptr()))
    key = (out.device.index, n, m, k, _FP8_CUDA_TYPE[b.dtype], _FP8_CUDA_TYPE[a.dtype], _D_CUDA_TYPE[out.dtype],
           align, bool(fast_accum), algo_index, epilogue, hp_type)
    lib, handle = ctx.lib, ctx.handle(out.device)
    # cuBLASLt launches on the current device: make it out's (autograd's backward threads already have it current)
    index = out.device.index
    guard = nullcontext() if torch._C._cuda_getDevice() == index else torch.cuda.device(index)
    with ctx.lock, guard:
        plan = ctx.plans.get(key)
        if plan is None:
            try:
                plan = _Plan(lib, handle, *key[1:])
            except CublasLtUnsupported as err:  # remembered: the heuristic is not asked again for this key
                plan = str(err)
            ctx.plans[key] = plan
        if isinstance(plan, str):
            raise CublasLtUnsupported(plan)
        workspace = torch.empty(plan.workspace_size, dtype=torch.uint8, device=out.device) \
            if plan.workspace_size else None
        for attr, t in ((_DESC_A_SCALE_POINTER, b_scale_inv), (_DESC_B_SCALE_POINTER, a_scale_inv), *pointers):
            ctx.ptr.value = t.data_ptr()
            _check(lib.MatmulDescSetAttribute(plan.desc, attr, ctypes.byref(ctx.ptr), 8), "MatmulDescSetAttribute")
        out_ptr = out.data_ptr()
        _check(lib.Matmul(handle, plan.desc, ctypes.byref(ctx.one), b.data_ptr(), plan.a_layout, a.data_ptr(),
                          plan.b_layout, ctypes.byref(ctx.one if accumulate else ctx.zero),
                          out_ptr if plan.c_is_d else None, plan.c_layout, out_ptr, plan.d_layout,
                          ctypes.byref(plan.result.algo), None if workspace is None else workspace.data_ptr(),
                          plan.workspace_size, torch._C._cuda_getCurrentRawStream(index)),  # current stream
               "cublasLtMatmul")


class _Site:
    """One configuration of :func:`gemm`, planned once (its own descriptor, layouts and algorithm) and called as
    ``site(a, a_scale_inv, b, b_scale_inv, out, bias)``: the per-call work is the scale / bias pointers written into
    the descriptor when they changed since the site's last call, a workspace when the algorithm wants one, and the
    ``cublasLtMatmul`` call on the current stream. A replayed step (:mod:`fp8engine.ops.replay`) calls the site
    itself: none of :func:`gemm`'s key building or checks, none of ``torch._scaled_mm``'s per-call descriptor set-up
    and heuristic query."""

    __slots__ = ("lib", "handle", "plan", "index", "device", "ptrs", "lock", "args", "__weakref__")

    def __init__(self, ctx: _Context, device: torch.device, plan: _Plan):
        self.lib, self.handle, self.plan, self.lock = ctx.lib, ctx.handle(device), plan, ctx.lock
        self.index, self.device = device.index, device
        self.ptrs = (None, None, None)  # the scale and bias pointers the descriptor holds
        # the constant arguments of cublasLtMatmul, as ctypes objects once (byref: pointers to them)
        self.args = (ctypes.byref(ctx.one), ctypes.byref(ctx.zero), ctypes.byref(plan.result.algo))

    def __call__(self, a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                 out: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        self.by_address(a.data_ptr(), a_scale_inv.data_ptr(), b.data_ptr(), b_scale_inv.data_ptr(), out.data_ptr(),
                        None if bias is None else bias.data_ptr())

    def by_address(self, a: int, a_scale_inv: int, b: int, b_scale_inv: int, out: int,
                   bias: Optional[int] = None) -> None:
        """The call with each tensor given by its device address (what a replayed step passes:
        :mod:`fp8engine.ops.replay` reads only the addresses of the tensors this site takes)."""
        lib, plan = self.lib, self.plan
        ptrs = (b_scale_inv, a_scale_inv, bias)
        workspace = torch.empty(plan.workspace_size, dtype=torch.uint8, device=self.device) \
            if plan.workspace_size else None
        guard = nullcontext() if torch._C._cuda_getDevice() == self.index else torch.cuda.device(self.index)
        with self.lock, guard:
            if ptrs != self.ptrs:
                for attr, new, old in zip((_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_BIAS_POINTER), ptrs,
                                          self.ptrs):
                    if new is not None and new != old:
                        value = ctypes.c_void_p(new)
                        _check(lib.MatmulDescSetAttribute(plan.desc, attr, ctypes.byref(value), 8),
                               "MatmulDescSetAttribute")
                self.ptrs = ptrs
            one, zero, algo = self.args
            # column-major view (module docstring): D = out^T, A = b (op T), B = a; C = D (beta = 0: not read)
            _check(lib.Matmul(self.handle, plan.desc, one, b, plan.a_layout, a, plan.b_layout,
                              zero, out, plan.c_layout, out, plan.d_layout, algo,
                              None if workspace is None else workspace.data_ptr(), plan.workspace_size,
                              torch._C._cuda_getCurrentRawStream(self.index)),
                   "cublasLtMatmul")


#: Most configurations :func:`gemm` plans (each keeps its cuBLASLt descriptors for the process's life); beyond them
#: it declines new ones. A training run uses a few dozen; token-by-token generation adds some per sequence length.
_MAX_SITES = 4096


def gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
         out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
         use_fast_accum: bool = False) -> Optional[torch.Tensor]:
    """``torch._scaled_mm``'s tensor-wise FP8 GEMM, called through cuBLASLt directly:
    ``out = (a * a_scale_inv) @ (b * b_scale_inv).T (+ bias)`` as a new ``[M, N]`` tensor of ``out_dtype``.

    The same cuBLASLt call ``torch._scaled_mm`` makes (torch 2.11-2.13, ``at::cuda::blas::scaled_gemm``): FP8 A and
    B with device scale pointers, fp32 compute, the bias in the ``BIAS`` epilogue, the heuristic's first algorithm
    for a 32 MiB workspace (torch's Hopper default), so the same bits (``tests/ops/test_gemm_cublaslt.py`` compares
    them on the GPU). torch sets up descriptors and asks the heuristic on every call; this plans each configuration
    once (:class:`_Site`), and a replayed step calls the planned site alone: 13.6 host us against
    ``torch._scaled_mm``'s 19.9 in ``python tools/gemm_cublaslt_choices.py@d6af129 --host-only`` (this function with its
    key and output allocation: 19.9), the FP8 delayed layer step at ``[128, 1, 256]`` 2-10 % less host time
    (``python tools/layer_host_time.py``'s ``torch._scaled_mm`` rows; one H100 80GB HBM3, torch 2.11.0+cu130,
    2026-11-27).

    Args:
        a: ``[M, K]`` FP8, b: ``[N, K]`` FP8, contiguous row-major CUDA tensors on one device, not both E5M2.
        a_scale_inv, b_scale_inv: 1-element float32 dequantization factors on that device.
        out_dtype: float32, bfloat16 or float16. bias: None or ``[N]`` contiguous of ``out_dtype`` (bf16 / fp16).
        use_fast_accum: cuBLASLt's fast accumulation (fprop).
    Returns None where this call does not apply and the caller runs ``torch._scaled_mm`` instead: no cuBLASLt, a
    non-contiguous operand, M = 0, no cuBLASLt algorithm for the configuration (remembered per configuration), or
    ``_MAX_SITES`` configurations planned already.
    The caller checks dtypes and K / N (multiples of 16), as :func:`fp8engine.ops.gemm.fp8_mm` does.
    """
    ctx = _get_context()
    if ctx is None or not (a.is_contiguous() and b.is_contiguous()) or a.shape[0] == 0:
        return None
    if bias is not None and (bias.dtype != out_dtype or not bias.is_contiguous()):
        return None
    (m, k), n = a.shape, b.shape[0]
    device = a.device
    key = (device.index, m, n, k, a.dtype, b.dtype, out_dtype, use_fast_accum, None if bias is None else bias.dtype,
           _alignment(a.data_ptr()), _alignment(b.data_ptr()))
    site = ctx.sites.get(key)
    if site is None:
        if len(ctx.sites) >= _MAX_SITES:  # shapes that keep changing (generation): torch._scaled_mm plans per call
            return None
        epilogue = _EPILOGUE_DEFAULT if bias is None else _EPILOGUE_BIAS
        hp_type = None if bias is None else _OUT_CUDA_TYPE[bias.dtype]
        # Column-major view: D [n, m] = op_T(b [k, n]) @ a [k, m]; the output is a fresh block (256-byte aligned)
        try:
            with ctx.lock:
                plan = _Plan(ctx.lib, ctx.handle(device), n, m, k, _FP8_CUDA_TYPE[b.dtype], _FP8_CUDA_TYPE[a.dtype],
                             _OUT_CUDA_TYPE[out_dtype], (key[-1], key[-2], 256), use_fast_accum, 0, epilogue, hp_type)
            site = _Site(ctx, device, plan)
        except CublasLtUnsupported as err:
            site = str(err)
        ctx.sites[key] = site
    if isinstance(site, str):
        return None
    out = torch.empty(m, n, dtype=out_dtype, device=device)
    recorder = _common.RECORDER.get()
    if recorder is not None:
        recorder.call(site, a, a_scale_inv, b, b_scale_inv, out, bias)
    else:
        site(a, a_scale_inv, b, b_scale_inv, out, bias)
    return out


def _require_context(what: str) -> None:
    if _get_context() is None:
        raise RuntimeError(f"fp8engine.kernels.cublaslt.{what} needs cuBLASLt on a GPU: {_load_error}")


def scaled_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
              out: torch.Tensor, *, accumulate: bool = False, use_fast_accum: bool = False,
              algo_index: int = 0) -> None:
    """``out (+)= (a * a_scale_inv) @ (b * b_scale_inv).T`` through cuBLASLt; ``out`` float32 / bfloat16 / float16
    ``[M, N]`` contiguous. ``algo_index`` picks the i-th algorithm of cuBLASLt's heuristic ranking (0 = its first
    choice, what ``torch._scaled_mm`` runs); ``tools/gemm_cublaslt_choices.py@d6af129`` times the others. Operands and
    errors as :func:`scaled_mm_accumulate`; IndexError when the heuristic returns fewer than ``algo_index + 1``
    algorithms.
    """
    _require_context("scaled_mm")
    if out.dtype not in _OUT_CUDA_TYPE:
        raise TypeError(f"cuBLASLt scaled_mm needs a float32/bfloat16/float16 out, got {out.dtype}")
    _check_operands(a, a_scale_inv, b, b_scale_inv, out, "scaled_mm")
    _launch(a, a_scale_inv, b, b_scale_inv, out, accumulate=accumulate, fast_accum=use_fast_accum,
            algo_index=algo_index)


def scaled_mm_bias_gelu(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                        bias: torch.Tensor, out: torch.Tensor, aux: torch.Tensor, out_scale: torch.Tensor,
                        amax: torch.Tensor, *, use_fast_accum: bool = True) -> None:
    """An FP8 GEMM with cuBLASLt's ``GELU_AUX_BIAS`` epilogue writing an FP8 output (fc1 fprop + GELU in one kernel):

    ``h = (a * a_scale_inv) @ (b * b_scale_inv).T + bias`` (fp32 accumulation), ``aux = h`` rounded to
    ``bias.dtype``, ``out = saturate(gelu(h) * out_scale)`` in FP8, ``amax = max |gelu(h)|`` (before scaling;
    *overwritten*, not max-accumulated). GELU is evaluated on the fp32 ``h`` by cuBLASLt (the unfused path applies it
    to the rounded ``h``; ``tests/ops/test_gemm_gelu.py`` checks the formula is the tanh form).

    Args:
        a: ``[M, K]`` FP8, b: ``[N, K]`` FP8 (contiguous row-major; not both E5M2); a_scale_inv, b_scale_inv,
            out_scale, amax: 1-element float32 on the GPU.
        bias: ``[N]`` bfloat16 or float16. out: ``[M, N]`` FP8 (E4M3 or E5M2). aux: ``[M, N]`` of ``bias.dtype``.
            All contiguous, on one GPU.
    Raises:
        TypeError / ValueError: dtypes / shapes, layouts or devices that do not fit (K and N multiples of 16).
        RuntimeError: cuBLASLt unavailable. CublasLtUnsupported: no such kernel on this GPU (nothing launched).
        CublasLtError: another cuBLASLt failure.
    """
    _require_context("scaled_mm_bias_gelu")
    if out.dtype not in _FP8_CUDA_TYPE or bias.dtype not in (torch.bfloat16, torch.float16) \
            or aux.dtype != bias.dtype:
        raise TypeError(f"scaled_mm_bias_gelu needs an FP8 out and bias / aux of one 16-bit float dtype, got out "
                        f"{out.dtype}, bias {bias.dtype}, aux {aux.dtype}")
    m, n, _ = _check_operands(a, a_scale_inv, b, b_scale_inv, out, "scaled_mm_bias_gelu")
    if tuple(bias.shape) != (n,) or tuple(aux.shape) != (m, n) or not (bias.is_contiguous() and aux.is_contiguous()):
        raise ValueError(f"scaled_mm_bias_gelu needs contiguous bias [{n}] and aux [{m}, {n}], got "
                         f"{tuple(bias.shape)} and {tuple(aux.shape)}")
    for name, t in (("bias", bias), ("aux", aux), ("out_scale", out_scale), ("amax", amax)):
        if t.device != out.device:
            raise ValueError(f"scaled_mm_bias_gelu: {name} is on {t.device}, out on {out.device}")
    for name, t in (("out_scale", out_scale), ("amax", amax)):
        if t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"scaled_mm_bias_gelu: {name} must be a 1-element float32 tensor")
    _launch(a, a_scale_inv, b, b_scale_inv, out, accumulate=False, fast_accum=use_fast_accum, algo_index=0,
            epilogue=_EPILOGUE_GELU_AUX_BIAS, hp_type=_OUT_CUDA_TYPE[bias.dtype],
            pointers=((_DESC_BIAS_POINTER, bias), (_DESC_EPILOGUE_AUX_POINTER, aux),
                      (_DESC_D_SCALE_POINTER, out_scale), (_DESC_AMAX_D_POINTER, amax)))
