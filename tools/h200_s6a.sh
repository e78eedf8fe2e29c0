#!/usr/bin/env bash
# Sixth session, batch a: cuBLASLt through ctypes (fp8engine/ops/cublaslt.py). Checks the header constants the
# binding uses, runs its GPU tests, times the 12 GEMMs per cuBLASLt algorithm and the accumulating wgrad
# (tools/probe_cublaslt.py), and the layer rows with and without fuse_wgrad_accumulation.
export PYTHONUNBUFFERED=1
echo "== header constants"
for d in $(python3 -c "import nvidia, sys; print(' '.join(nvidia.__path__))" 2>/dev/null) /usr/local/cuda/include; do
  find "$d" -name cublasLt.h -o -name library_types.h -o -name cublas_api.h 2>/dev/null
done | sort -u > /tmp/headers
cat /tmp/headers
grep -hE "CUBLASLT_MATMUL_(DESC_(TRANSA|TRANSB|A_SCALE_POINTER|B_SCALE_POINTER|FAST_ACCUM)|PREF_(MAX_WORKSPACE_BYTES|MIN_ALIGNMENT_[ABCD]_BYTES)) *=|CUDA_R_(32F|16F|16BF|8F_E4M3|8F_E5M2) *=|CUBLAS_COMPUTE_32F *=|CUBLAS_OP_[NT] *=" $(cat /tmp/headers) | sort -u
grep -h -A8 "typedef struct {" $(grep -l cublasLtMatmulHeuristicResult_t $(cat /tmp/headers)) | grep -B8 "} cublasLtMatmulHeuristicResult_t" | head -12
echo "== tests"
timeout 200 python3 -m pytest -q -x tests/ops/test_gemm_accumulate.py tests/fp8/test_gemm.py 2>&1 | tail -15
echo "== probe"
timeout 200 python3 tools/probe_cublaslt.py --rounds 3 2>&1 | tail -30
echo "== bench layer (no torchao, no compile)"
timeout 180 python3 -m fp8engine.bench layer --no-torchao --no-compile --rounds 3 2>&1 | grep "^|\|^#\|Error\|error"
