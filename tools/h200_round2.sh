#!/usr/bin/env bash
# One batched call on one H200: GPU tests of the kernels and ops, norm tile timings, the layer probe and benchmark.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 250 python3 -m pytest -q -p no:cacheprovider -x tests/kernels tests/ops tests/modules -k "not cpu" 2>&1 | tail -6
timeout 60 python3 tools/tune_norm.py 2>&1 | grep "^|"
timeout 150 python3 tools/probe_layer.py --skip-gemm --skip-sdpa --host-profile 2>&1 | grep -v "Warning\|warn(" \
  | sed -n '/^FP8 layer step/,$p' | grep -v "^ *[a-zA-Z_]*  *[0-9.]*%  \|^--\|Self CPU\|Self CUDA\|  gap  " | cut -c1-120 | head -190
timeout 120 python3 -m fp8engine.bench layer --no-torchao --no-compile 2>&1 | grep "^|\|#"
