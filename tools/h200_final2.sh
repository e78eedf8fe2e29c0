#!/usr/bin/env bash
# Final single-H200 batch of this session: layer probe summary, then bench cast / linear / layer (with peers).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 tools/probe_layer.py --skip-gemm --skip-sdpa > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to" $OUT/probe.log
timeout 40 python3 -m fp8engine.bench cast 2>&1 | grep "^|\|#"
timeout 90 python3 -m fp8engine.bench linear --shapes 8192x4096x16384 2>&1 | grep "^|\|#"
timeout 240 python3 -m fp8engine.bench layer --graph 2>&1 | grep "^|\|#"
