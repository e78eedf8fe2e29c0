#!/usr/bin/env bash
# Sixth session, batch b: the cuBLASLt binding's GPU tests after the 16-byte alignment rule, and the per-algorithm
# timing of the 12 GEMMs plus the accumulating wgrad (tools/probe_cublaslt.py).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python3 -m pytest -q tests/ops/test_gemm_accumulate.py tests/fp8/test_gemm.py 2>&1 | tail -5
timeout 300 python3 tools/probe_cublaslt.py --rounds 3 2>&1 | tail -30
