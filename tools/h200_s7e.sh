#!/usr/bin/env bash
# Seventh session, batch e: the GELU-epilogue tests (now also fp16 and M = 0), the GPU variants of the ops / modules /
# fp8 tests after the cuBLASLt refactor, and the layer's kernel profile with the epilogue in.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 60 python3 -m pytest -q tests/ops/test_gemm_gelu.py 2>&1 | tail -3
timeout 330 python3 -m pytest -q -x tests/ops tests/modules tests/fp8 -k "cuda or gpu or not cpu" 2>&1 | tail -4
timeout 150 python3 tools/probe_layer.py --skip-gemm --skip-sdpa 2>&1 | tail -45
