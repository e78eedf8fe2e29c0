#!/usr/bin/env bash
# Sixth session, batch c: GPU tests of the accumulating wgrad (dropout off in the layer comparison) and of the
# modules / graphs that use it; the GEMM probe with torch's rowwise fprop dispatch interleaved; bench layer rows.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q tests/ops/test_gemm_accumulate.py tests/fp8/test_gemm.py tests/modules/test_graph.py \
  tests/modules/test_linear.py 2>&1 | tail -3
timeout 200 python3 tools/probe_cublaslt.py --rounds 5 --algos 1 2>&1 | tail -30
timeout 200 python3 -m fp8engine.bench layer --no-torchao --no-compile --rounds 3 2>&1 | grep "^|\|^#\|Error\|error"
