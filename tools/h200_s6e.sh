#!/usr/bin/env bash
# Sixth session, batch e (review fixes): GPU tests of the accumulating GEMM after fp8_mm_accumulate's dispatch was
# reordered (operand alignment checked after padding), and the probe's wgrad table (fp32 GEMM + add_ against the
# accumulating GEMM), which batch b's table did not show.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q tests/ops/test_gemm_accumulate.py tests/fp8/test_gemm.py tests/modules/test_graph.py \
  tests/modules/test_linear.py 2>&1 | tail -3
timeout 200 python3 tools/probe_cublaslt.py --rounds 3 --algos 1 2>&1 | tail -32
