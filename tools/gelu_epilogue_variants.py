"""Which cuBLASLt GELU epilogues take FP8, and do they beat the GEMM + Triton activation kernel pair of the MLP?
(CUDA; a measurement tool)

Forward, fc1 fprop: today ``_scaled_mm`` (bias epilogue, bf16 out) writes h, then ``gelu_fwd`` reads h and writes
the FP8 activation with its amax. Candidate: one cuBLASLt GEMM with ``GELU_AUX_BIAS``: D = GELU(acc + b1) in FP8
(D scale, amax of D), h written as the bf16 "aux" output for the backward.
Backward, fc2 dgrad: today ``_scaled_mm`` writes da (bf16), then ``gelu_bwd_cast_transpose`` reads da and h and
writes dh in FP8 (both layouts) + dbias + amax. Candidate: one cuBLASLt GEMM with ``DGELU_BGRAD`` (aux input h):
D = da * gelu'(h) in FP8 E5M2 (D scale, amax) and dbias, then ``transpose_fp8`` for the transposed copy.

Prints the header values used (read from the installed cublasLt.h), whether cuBLASLt accepts each variant, the
agreement with the kernels (byte match of the FP8 outputs, SQNR against float64 GELU-tanh and GELU-erf, dbias,
amax, and whether AMAX_D overwrites or max-accumulates), and ms per variant (CUDA events, back-to-back,
interleaved rounds, medians).

The variant that paid (GELU_AUX_BIAS, C = NULL, fast accumulation) is now ``fp8engine.kernels.cublaslt.scaled_mm_bias_gelu``;
this tool keeps its own descriptor code to try the variants the library does not offer (C aliased to D or a
separate buffer, no fast accumulation, and with ``--bwd`` the DGELU_BGRAD backward, which cuBLAS 13 refused with an
FP8 output and ran slower than the kernels with a bf16 one: docs/benchmarks.md).

Usage: python tools/gelu_epilogue_variants.py [--tokens 8192 --hidden 4096 --ffn 16384] [--rounds 5]
"""
import argparse
import ctypes
import glob
import math
import os
import re
import statistics
import sys

import torch

from fp8engine.bench.common import print_table, time_back_to_back
from fp8engine.kernels import activation as ka
from fp8engine.kernels.cast import transpose_fp8
from fp8engine.kernels import cublaslt as lt

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--tokens", type=int, default=8192)
p.add_argument("--hidden", type=int, default=4096)
p.add_argument("--ffn", type=int, default=16384)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--bwd", action="store_true", help="also the DGELU_BGRAD backward variants")
args = p.parse_args()
M, H, F = args.tokens, args.hidden, args.ffn
E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
dev = "cuda"

# ---- header values -------------------------------------------------------------------------------------------
GUESS = {"CUBLASLT_MATMUL_DESC_EPILOGUE": 7, "CUBLASLT_MATMUL_DESC_BIAS_POINTER": 8,
         "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER": 11, "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD": 12,
         "CUBLASLT_MATMUL_DESC_D_SCALE_POINTER": 20, "CUBLASLT_MATMUL_DESC_AMAX_D_POINTER": 21,
         "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE": 22, "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE": 26,
         "CUBLASLT_EPILOGUE_DEFAULT": 1, "CUBLASLT_EPILOGUE_BIAS": 4, "CUBLASLT_EPILOGUE_GELU_AUX_BIAS": 164,
         "CUBLASLT_EPILOGUE_GELU_BIAS": 36, "CUBLASLT_EPILOGUE_DGELU": 192, "CUBLASLT_EPILOGUE_DGELU_BGRAD": 208}
C = dict(GUESS)
headers = [h for d in sys.path for h in glob.glob(os.path.join(d, "nvidia", "*", "include", "cublasLt.h"))]
headers += glob.glob("/usr/local/cuda*/include/cublasLt.h")
if headers:
    text = open(headers[0]).read()
    for name in GUESS:
        m = re.search(rf"\b{name}\s*=\s*([0-9]+|[A-Z_]+(?:\s*\|\s*[A-Z_]+)*)", text)
        if m and m.group(1).isdigit():
            C[name] = int(m.group(1))
    print("header", headers[0], {k: (C[k], "" if C[k] == GUESS[k] else f"guess was {GUESS[k]}") for k in GUESS})
else:
    print("no cublasLt.h found; using the values from memory", GUESS)

ctx = lt._get_context()
lib, handle = ctx.lib, ctx.handle(torch.device(dev))
CT = {torch.float32: 0, BF16: 14, E4M3: 28, E5M2: 29}


def setattr_(desc, attr, val):
    lt._check(lib.MatmulDescSetAttribute(desc, attr, ctypes.byref(val), ctypes.sizeof(val)), f"set attr {attr}")


class Gemm:
    """Row-major ``out [m, n] = epi(a [m, k] @ b [n, k].T)``: cuBLASLt TN with A = b, B = a (cublaslt.py's form)."""

    def __init__(self, a, b, out, *, epilogue, fast_accum, bias=None, aux=None, d_scale=None, amax=None,
                 a_si=None, b_si=None, c=None):
        (m, k), n = a.shape, b.shape[0]
        self.desc = ctypes.c_void_p()
        lt._check(lib.MatmulDescCreate(ctypes.byref(self.desc), 68, 0), "desc")
        for attr, val in ((3, ctypes.c_int32(1)), (4, ctypes.c_int32(0)), (25, ctypes.c_int8(int(fast_accum))),
                          (C["CUBLASLT_MATMUL_DESC_EPILOGUE"], ctypes.c_uint32(epilogue)),
                          (17, ctypes.c_void_p(b_si.data_ptr())), (18, ctypes.c_void_p(a_si.data_ptr()))):
            setattr_(self.desc, attr, val)
        if bias is not None:
            setattr_(self.desc, C["CUBLASLT_MATMUL_DESC_BIAS_POINTER"], ctypes.c_void_p(bias.data_ptr()))
            setattr_(self.desc, C["CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE"], ctypes.c_int32(CT[bias.dtype]))
        if aux is not None:
            setattr_(self.desc, C["CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER"], ctypes.c_void_p(aux.data_ptr()))
            setattr_(self.desc, C["CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD"], ctypes.c_int64(n))
            setattr_(self.desc, C["CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE"], ctypes.c_int32(CT[aux.dtype]))
        if d_scale is not None:
            setattr_(self.desc, C["CUBLASLT_MATMUL_DESC_D_SCALE_POINTER"], ctypes.c_void_p(d_scale.data_ptr()))
        if amax is not None:
            setattr_(self.desc, C["CUBLASLT_MATMUL_DESC_AMAX_D_POINTER"], ctypes.c_void_p(amax.data_ptr()))
        self.la, self.lb, self.lc, self.ld = (ctypes.c_void_p() for _ in range(4))
        c_type = CT[BF16] if out.dtype in (E4M3, E5M2) else CT[out.dtype]
        for lay, t, rows, cols in ((self.la, CT[b.dtype], k, n), (self.lb, CT[a.dtype], k, m),
                                   (self.lc, c_type, n, m), (self.ld, CT[out.dtype], n, m)):
            lt._check(lib.MatrixLayoutCreate(ctypes.byref(lay), t, rows, cols, rows), "layout")
        pref = ctypes.c_void_p()
        lt._check(lib.MatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(32 << 20)
        lt._check(lib.MatmulPreferenceSetAttribute(pref, 1, ctypes.byref(ws), 8), "pref ws")
        res = (lt._HeuristicResult * 1)()
        found = ctypes.c_int(0)
        lt._check(lib.MatmulAlgoGetHeuristic(handle, self.desc, self.la, self.lb, self.lc, self.ld, pref, 1, res,
                                             ctypes.byref(found)), "heuristic")
        if found.value < 1:
            raise lt.CublasLtError("heuristic found no algorithm")
        self.res = res[0]
        self.ws = torch.empty(max(1, int(self.res.workspace_size)), dtype=torch.uint8, device=dev)
        self.a, self.b, self.out = a, b, out
        # C (never read: beta = 0) is D when it has D's type, else ``c`` (a bf16 buffer) or NULL; cuBLASLt refuses
        # C == D with different layouts (status 7)
        self.c = out.data_ptr() if c_type == CT[out.dtype] else (None if c is None else c.data_ptr())
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def __call__(self):
        o = self.out.data_ptr()
        lt._check(lib.Matmul(handle, self.desc, ctypes.byref(self.one), self.b.data_ptr(), self.la, self.a.data_ptr(),
                             self.lb, ctypes.byref(self.zero), self.c, self.lc, o, self.ld, ctypes.byref(self.res.algo),
                             self.ws.data_ptr(), int(self.res.workspace_size),
                             torch.cuda.current_stream().cuda_stream), "matmul")
        return self.out


def sqnr(x, ref):
    x, ref = x.double(), ref.double()
    return 10 * math.log10(ref.pow(2).sum().item() / max((x - ref).pow(2).sum().item(), 1e-300))


def gelu64(h, approximate):
    return torch.nn.functional.gelu(h.double(), approximate=approximate)


def dgelu64(h):
    h = h.double().requires_grad_()
    y = torch.nn.functional.gelu(h, approximate="tanh")
    (g,) = torch.autograd.grad(y.sum(), h)
    return g


torch.manual_seed(0)
one = torch.ones(1, device=dev)
# operands at realistic ranges: x ~ LayerNorm output, W ~ 0.02 init; scales as delayed scaling would pick
x = torch.randn(M, H, device=dev)
w1 = torch.randn(F, H, device=dev) * 0.02
b1 = (torch.randn(F, device=dev) * 0.02).to(BF16)
sx, sw = 448 / x.abs().max(), 448 / w1.abs().max()
x8, w18 = (x * sx).to(E4M3), (w1 * sw).to(E4M3)
x_si, w1_si = (1 / sx).reshape(1).float(), (1 / sw).reshape(1).float()
h_ref = torch._scaled_mm(x8, w18.t(), x_si.reshape(()), w1_si.reshape(()), bias=b1, out_dtype=BF16,
                         use_fast_accum=True)
a_scale = (448 / ka.gelu_fwd(h_ref, return_hp=True)[0].float().abs().max()).reshape(1)

rows, timers = [], {}
# ---- forward ---------------------------------------------------------------------------------------------------
amax_k = torch.zeros(1, device=dev)
_, a8_k, _ = ka.gelu_fwd(h_ref, scale=a_scale, fp8_dtype=E4M3, amax_out=amax_k)


def fwd_kernels():
    h = torch._scaled_mm(x8, w18.t(), x_si.reshape(()), w1_si.reshape(()), bias=b1, out_dtype=BF16,
                         use_fast_accum=True)
    return ka.gelu_fwd(h, scale=a_scale, fp8_dtype=E4M3, amax_out=amax_k)


timers["fwd: _scaled_mm + gelu_fwd"] = fwd_kernels
c_buf = torch.empty(M, F, dtype=BF16, device=dev)
for aux_dtype, c, fast in ((BF16, None, True), (BF16, c_buf, True), (BF16, None, False)):
    name = f"fwd: GELU_AUX_BIAS, FP8 D, {aux_dtype} aux, C {'NULL' if c is None else 'buffer'}, fast_accum {fast}"
    try:
        d8 = torch.empty(M, F, dtype=E4M3, device=dev)
        aux = torch.empty(M, F, dtype=aux_dtype, device=dev)
        amax_e = torch.full((1,), 1e9, device=dev)  # poisoned: tells overwrite from max-accumulate
        g = Gemm(x8, w18, d8, epilogue=C["CUBLASLT_EPILOGUE_GELU_AUX_BIAS"], fast_accum=fast, bias=b1, aux=aux,
                 d_scale=a_scale, amax=amax_e, a_si=x_si, b_si=w1_si, c=c)
        g()
        torch.cuda.synchronize()
        amax_after = amax_e.item()
        d = d8.float() / a_scale
        rows.append({"case": name, "accepted": True,
                     "aux == h (bytes)": bool(torch.equal(aux, h_ref)),
                     "aux max |diff|": (aux.float() - h_ref.float()).abs().max().item(),
                     "D bytes == gelu_fwd": f"{(d8.view(torch.uint8) == a8_k.view(torch.uint8)).float().mean().item():.4f}",
                     "SQNR tanh dB": round(sqnr(d, gelu64(h_ref, "tanh")), 2),
                     "SQNR erf dB": round(sqnr(d, gelu64(h_ref, "none")), 2),
                     "kernel SQNR tanh dB": round(sqnr(a8_k.float() / a_scale, gelu64(h_ref, "tanh")), 2),
                     "amax (poisoned 1e9 before)": amax_after, "kernel amax": amax_k.item()})
        timers[name] = g
    except lt.CublasLtError as err:
        rows.append({"case": name, "accepted": f"no: {err}"})

# ---- backward --------------------------------------------------------------------------------------------------
w2 = torch.randn(H, F, device=dev) * 0.02
dy = torch.randn(M, H, device=dev) * 1e-3
sdy, sw2 = 57344 / dy.abs().max(), 448 / w2.abs().max()
dy8, w2t8 = (dy * sdy).to(E5M2), (w2 * sw2).t().contiguous().to(E4M3)  # w2^T [F, H]
dy_si, w2_si = (1 / sdy).reshape(1).float(), (1 / sw2).reshape(1).float()
da_ref = torch._scaled_mm(dy8, w2t8.t(), dy_si.reshape(()), w2_si.reshape(()), out_dtype=BF16)
dh_hp = ka.gelu_bwd_cast_transpose(da_ref, h_ref, None, None)[0]
g_scale = (57344 / dh_hp.float().abs().max()).reshape(1)
amax_kb = torch.zeros(1, device=dev)
dh8_k, dh8t_k, _, db_k = ka.gelu_bwd_cast_transpose(da_ref, h_ref, g_scale, E5M2, amax_kb)


def bwd_kernels():
    da = torch._scaled_mm(dy8, w2t8.t(), dy_si.reshape(()), w2_si.reshape(()), out_dtype=BF16)
    return ka.gelu_bwd_cast_transpose(da, h_ref, g_scale, E5M2, amax_kb)


timers["bwd: _scaled_mm + gelu_bwd_cast_transpose"] = bwd_kernels
ref_dh = da_ref.double() * dgelu64(h_ref)
for out_dtype, bias_dtype in (((E5M2, BF16), (E5M2, torch.float32), (BF16, BF16)) if args.bwd else ()):
    name = f"bwd: DGELU_BGRAD, {out_dtype} D, {bias_dtype} dbias"
    try:
        dd = torch.empty(M, F, dtype=out_dtype, device=dev)
        db = torch.empty(F, dtype=bias_dtype, device=dev)
        amax_e = torch.full((1,), 1e9, device=dev)
        fp8_out = out_dtype == E5M2
        g = Gemm(dy8, w2t8, dd, epilogue=C["CUBLASLT_EPILOGUE_DGELU_BGRAD"], fast_accum=False, bias=db,
                 aux=h_ref, d_scale=g_scale if fp8_out else None, amax=amax_e if fp8_out else None,
                 a_si=dy_si, b_si=w2_si)
        g()
        torch.cuda.synchronize()
        d = dd.float() / g_scale if fp8_out else dd.float()
        row = {"case": name, "accepted": True,
               "SQNR dh vs f64 dB": round(sqnr(d, ref_dh), 2),
               "kernel SQNR dh dB": round(sqnr(dh8_k.float() / g_scale, ref_dh), 2),
               "dbias SQNR vs kernel dB": round(sqnr(db.float(), db_k.float()), 2),
               "dbias SQNR vs f64 dB": round(sqnr(db.float(), ref_dh.sum(0)), 2)}
        if fp8_out:
            row["D bytes == kernel"] = f"{(dd.view(torch.uint8) == dh8_k.view(torch.uint8)).float().mean().item():.4f}"
            row["amax (poisoned 1e9 before)"] = amax_e.item()
            row["kernel amax"] = amax_kb.item()
            timers[name + " + transpose_fp8"] = lambda g=g, dd=dd: transpose_fp8(g())
        else:
            timers[name] = g
        rows.append(row)
    except lt.CublasLtError as err:
        rows.append({"case": name, "accepted": f"no: {err}"})

for r in rows:
    print(r)

# ---- timing ----------------------------------------------------------------------------------------------------
per = {k: [] for k in timers}
for _ in range(args.rounds):
    for k, fn in timers.items():
        per[k].append(time_back_to_back(fn, steps=10, repeats=10))
print_table([{"variant": k, "ms (median of rounds)": round(statistics.median(v), 4),
              "rounds": " / ".join(f"{t:.3f}" for t in v)} for k, v in per.items()])
