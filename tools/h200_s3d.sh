#!/usr/bin/env bash
# Third session, final single-H200 batch: GPU tests of the changed paths, layer probe, bench layer / cast / linear.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q tests/kernels/test_norm_kernels.py tests/ops tests/modules -k "not cpu" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log
timeout 100 python3 tools/probe_layer.py --skip-gemm --skip-sdpa > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to" $OUT/probe.log
timeout 280 python3 -m fp8engine.bench layer --graph 2>&1 | tee $OUT/layer.log | grep "^|\|#"
timeout 60 python3 -m fp8engine.bench cast 2>&1 | grep "^|\|#"
timeout 90 python3 -m fp8engine.bench linear --shapes 8192x4096x16384 2>&1 | grep "^|\|#"
