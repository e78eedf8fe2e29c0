#!/usr/bin/env bash
# Seventh session, batch c: GPU tests of fc1's GELU epilogue (tests/ops/test_gemm_gelu.py) and of the ops / modules
# it touches, including CUDA-graph capture.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 280 python3 -m pytest -q tests/ops/test_gemm_gelu.py tests/ops/test_gemm_accumulate.py tests/ops/test_mlp_op.py \
  tests/modules/test_graph.py tests/modules/test_layernorm_mlp.py tests/modules/test_transformer.py 2>&1 | tail -15
